"""On-policy distillation (GKD) and sequence-level KD: a fraction of each micro-batch answered by a model's samples.

The hook runs on each micro-batch before the step counts its tokens (``Trainer.make_batch``; with
``generation_batch_size`` set, on the step's micro-batches together, ``Trainer.make_batches``)::

    batch = self.make_batch(batch)            # a fraction of rows: prompt + sample, labels on the sample only
    teacher_out = self.teacher_forward(batch)
    student_out = self.student_forward(batch)
    loss = self.compute_loss(student_out, teacher_out, batch)

A row's prompt is everything before its first counted label (a row with none is a prompt alone, the data
on-policy and sequence-level KD need no answers for). The chosen rows get ``prompt + sample``: labels -100 on
the prompt and after the end token, the end token itself counted, so every loss of the library runs on the
sampled tokens only (``losses/base.py valid_positions``).

* ``sampler: student`` (on-policy, Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
  from Self-Generated Mistakes"): the student's ZeRO-2 weights are whole on every rank, so each rank samples
  on its own, with Hugging Face ``generate`` on the bare model in eval mode under no_grad.
* ``sampler: teacher`` (sequence-level KD, Kim & Rush 2016): the ZeRO-3 teacher's generate gathers shards at
  every token, a collective, so it runs with ``synced_gpus``: every rank keeps stepping until the slowest has
  finished, and a rank with no row to sample generates a throw-away one.

With ``pack_to`` the sampled micro-batch's conversations are then packed into rows of up to that many tokens
(``chat.pack_padded``), as ``data.packing`` packs chat data, so samples of varying length leave little padding.

Ranks sample different lengths; the ZeRO-3 teacher forward that follows then runs on shapes agreed across ranks
(each pads its batch to the longest row on any rank), so a rank that finished early never waits alone. Row
choice and sampling draw from the global torch generators, which every checkpoint saves and restores per rank
(``checkpoint.capture_rng``): a resumed run samples exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from distill_kit.config import OnPolicyConfig
from distill_kit.data import chat
from distill_kit.engines import distributed
from distill_kit.engines.kernels import student_samples
from distill_kit.engines.models import end_token, positions
from distill_kit.errors import ConfigError
from losses.base import IGNORE_INDEX

Batch = dict[str, torch.Tensor]
FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"
logger = logging.getLogger(__name__)




def refuse_packed(batch: Mapping[str, Any], fraction: float) -> None:
    """A packed batch (``position_ids``, several conversations a row) cannot have rows replaced by prompt + sample:
    the sampler takes unpacked rows and packs after sampling (``pack_to``; the CLI's train loader does not pack
    when the run samples). This guards Python use."""
    if "position_ids" in batch:
        raise ConfigError(f"a packed micro-batch reached the on-policy sampler (fraction={fraction}): its rows hold "
                          "several conversations whose prompts it cannot take apart. Give it unpacked rows and set "
                          "training.on_policy.pack_to to pack them after sampling")


class Sampler:
    """Replaces ``fraction`` of a micro-batch's rows by ``prompt + sample`` from ``model()``.

    ``model`` returns the bare Hugging Face model to sample from (called at each batch: the engine may wrap it
    anew). ``synced`` makes every rank step generation together (a ZeRO-3 model's generate is a collective).
    """

    def __init__(self, config: OnPolicyConfig, model: Callable[[], nn.Module], synced: bool = False):
        self.config, self.model, self.synced = config, model, synced
        self.capped = False  # the cap to max_length was logged

    def __call__(self, batch: Mapping[str, Any]) -> Batch:
        """One micro-batch, its chosen rows sampled in one call."""
        if self.config.fraction == 0:
            return dict(batch)
        refuse_packed(batch, self.config.fraction)
        batch = repeat_rows(batch, self.config.samples_per_prompt)
        rows = self.choose_rows(batch)
        prompts = [self.row_prompt(batch, int(row)) for row in rows]
        samples = self.generate(prompts if prompts or not self.synced else [self.row_prompt(batch, 0)])[:len(prompts)]
        return self.pack(splice(batch, rows, prompts, samples, self.pad_token_id))

    def row_prompt(self, batch: Mapping[str, Any], row: int) -> torch.Tensor:
        """A row's prompt to answer (``on_policy.prompt_tokens``: a text row's first tokens); a row without one is
        refused (Python use: the CLI refuses text data without ``prompt_tokens`` before any work)."""
        prompt = prompt_of(batch, row, self.config.prompt_tokens)
        if len(prompt) == 0:
            raise ConfigError("an on-policy row has no prompt (it counts every token, as text data does): set "
                              "training.on_policy.prompt_tokens (e.g. 32) to take each row's first tokens as its "
                              "prompt, or give chat data")
        return prompt

    def many(self, batches: Sequence[Mapping[str, Any]]) -> list[Batch]:
        """A step's micro-batches: each one's rows chosen in turn, then all chosen rows sampled together in calls of
        ``generation_batch_size`` rows (0: each micro-batch alone, as ``__call__``)."""
        if self.config.fraction == 0 or not self.config.generation_batch_size:
            return [self(batch) for batch in batches]
        for batch in batches:
            refuse_packed(batch, self.config.fraction)
        batches = [repeat_rows(batch, self.config.samples_per_prompt) for batch in batches]
        rows = [self.choose_rows(batch) for batch in batches]
        prompts = [[self.row_prompt(batch, int(row)) for row in chosen]
                   for batch, chosen in zip(batches, rows, strict=True)]
        samples = iter(self.generate_batched([p for group in prompts for p in group], self.row_prompt(batches[0], 0)))
        return [self.pack(splice(batch, chosen, group, [next(samples) for _ in group], self.pad_token_id))
                for batch, chosen, group in zip(batches, rows, prompts, strict=True)]

    def pack(self, batch: Batch) -> Batch:
        """With ``pack_to``, the sampled micro-batch's conversations packed into rows (``chat.pack_padded``), padded
        to the rows and length of the largest on any rank, as ``splice`` agrees the padded rows' length."""
        if not self.config.pack_to:
            return batch

        def agree(shape: tuple[int, int]) -> list[int]:
            largest = distributed.all_reduce_max(torch.tensor(shape, device=batch["input_ids"].device))
            return [int(n) for n in largest.tolist()]

        return chat.pack_padded(batch, self.config.pack_to, self.pad_token_id, agree=agree)

    def generate_batched(self, prompts: list[torch.Tensor], filler: torch.Tensor) -> list[torch.Tensor]:
        """``generate`` in calls of min(``generation_batch_size``, len(prompts)) rows, the last padded with copies
        of ``filler``; a synced sampler makes as many calls as the rank with the most rows (at least one)."""
        size = min(self.config.generation_batch_size, max(len(prompts), 1))
        calls = -(-len(prompts) // size)
        if self.synced:
            calls = max(1, int(distributed.all_reduce_max(torch.tensor(calls, device=filler.device))))
        samples: list[torch.Tensor] = []
        for call in range(calls):
            chunk = prompts[call * size:(call + 1) * size]
            samples += self.generate(chunk + [filler] * (size - len(chunk)))[:len(chunk)]
        return samples

    def choose_rows(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """``round(fraction * rows)`` row indices: prompts without answers first, each group in random order."""
        labels = batch["labels"]
        count = round(self.config.fraction * labels.shape[0])
        order = torch.randperm(labels.shape[0])
        answered = (labels[order] != IGNORE_INDEX).any(dim=1).cpu()
        return torch.cat([order[~answered], order[answered]])[:count]

    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each prompt's sample, up to and including the end token (or ``max_new_tokens`` long)."""
        if not prompts:
            return []
        model, config = self.model(), self.config
        pad, eos = self.pad_token_id, self.eos_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=prompts[0].device)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(prompt):], mask[i, width - len(prompt):] = prompt, 1
        room = self.room(model, width)
        options: dict[str, Any] = {"do_sample": config.temperature > 0, "max_new_tokens": max(room, 1),
                                   "pad_token_id": pad, "eos_token_id": eos, "synced_gpus": self.synced,
                                   "use_cache": True}  # a training config often turns the cache off
        if config.temperature > 0:
            options.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k or None)
        if self.static_cache(model, ids.device):
            options["cache_implementation"] = "static"
        was_training = model.training
        model.eval()
        try:
            with sdpa_gqa(config.sdpa_gqa and ids.device.type != "cpu"), eager_layers(model):
                out = model.generate(input_ids=ids, attention_mask=mask, **options)[:, width:]
        finally:
            model.train(was_training)
        if room < 1:  # a prompt that fills every position gets no sample (its one decoded token, decoded so that
            return [out[i, :0] for i in range(len(prompts))]  # a synced generate steps with the others, is dropped)
        ended = (out == eos).int()
        lengths = torch.where(ended.any(dim=1), ended.argmax(dim=1) + 1, out.shape[1])
        return [out[i, :int(n)] for i, n in enumerate(lengths)]

    def room(self, model: nn.Module, width: int) -> int:
        """New tokens that fit after prompts ``width`` long: ``max_new_tokens``, cut to the row limit
        (``max_length``, or the sampling model's positions), the cut logged the first time it bites."""
        limit = self.config.max_length or positions(getattr(model, "config", None))
        if limit is None or width + self.config.max_new_tokens <= limit:
            return self.config.max_new_tokens
        if not self.capped:
            self.capped = True
            logger.warning("on-policy samples capped at %d new tokens (prompts of %d tokens + on_policy.max_new_tokens "
                           "%d would pass the %d positions a model of the run reads; longer prompts get fewer)",
                           max(limit - width, 0), width, self.config.max_new_tokens, limit)
        return limit - width

    def static_cache(self, model: nn.Module, device: torch.device) -> bool:
        """'auto': a static cache (whose decode step transformers compiles) for a whole model on an accelerator;
        not on the CPU, and not for a ZeRO-3 model (``synced``), whose shards are gathered by hooks at each call."""
        if self.config.cache == "auto":
            return (device.type != "cpu" and not self.synced
                    and bool(getattr(model, "_can_compile_fullgraph", False)))
        return self.config.cache == "static"

    @property
    def eos_token_id(self) -> int:
        if self.config.eos_token_id is not None:
            return self.config.eos_token_id
        model = self.model()
        eos = end_token(getattr(model, "generation_config", None), model.config)
        if eos is None:
            raise ValueError("on-policy sampling needs an end token: the model's config has no eos_token_id; set "
                             "training.on_policy.eos_token_id (e.g. the tokenizer's eos_token_id)")
        return int(eos)

    @property
    def pad_token_id(self) -> int:
        if self.config.pad_token_id is not None:
            return self.config.pad_token_id
        pad = getattr(self.model().config, "pad_token_id", None)
        return int(pad) if pad is not None else self.eos_token_id


@contextlib.contextmanager
def sdpa_gqa(enabled: bool) -> Iterator[None]:
    """While it lasts, transformers' SDPA attention passes grouped-query heads to SDPA as they are
    (``enable_gqa``), also under a mask, instead of repeating each key/value head (``TRANSFORMERS_SDPA_FORCE_GQA``);
    the variable's earlier value comes back after."""
    if not enabled:
        yield
        return
    before = os.environ.get(FORCE_GQA)
    os.environ[FORCE_GQA] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[FORCE_GQA]
        else:
            os.environ[FORCE_GQA] = before


def eager_layers(model: nn.Module) -> contextlib.AbstractContextManager:
    """Generation runs a model whose decoder layers are compiled one by one (``kernels: compile``; an FP8 teacher's
    default) eagerly: the layers were compiled for scoring, with no cache, and generating with one makes each layer
    recompile for its own cache state, past dynamo's limit of 8 (the cost: benchmarks/RESULTS.md). Other models
    generate as they are (transformers may compile their decode step)."""
    compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
    return torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()


def student_kernels(choice: str, config: OnPolicyConfig) -> str:
    """The student's ``training.student_kernels`` when it samples: ``auto`` then means none. Liger's RMSNorm
    kernel inside the compiled static-cache decode step makes torch.compile assume it mutates the weights, so the
    step runs without CUDA graphs (the cost: benchmarks/RESULTS.md). An explicit ``liger`` is kept, with a warning
    that says what it costs."""
    if choice == "liger" and student_samples(config):
        logger.warning("training.student_kernels: liger in a student that samples on-policy keeps its decode step "
                       "from compiling whole (no CUDA graphs, a recompile per layer): on one H200 its sampling took "
                       "8.2x as long and its on-policy step 5.2x (benchmarks/results/peers.md); auto leaves Liger "
                       "out of a sampling student")
    return "none" if choice == "auto" and student_samples(config) else choice


def repeat_rows(batch: Mapping[str, Any], times: int) -> Batch:
    """Each row ``times`` times, its copies side by side (``samples_per_prompt``: a group of samples of one prompt,
    in one generate call); every per-row tensor of the batch (``teacher_id`` too) alike."""
    if times == 1:
        return dict(batch)
    rows = batch["input_ids"].shape[0]

    def repeated(value: Any) -> Any:
        if torch.is_tensor(value) and value.dim() and value.shape[0] == rows:
            return value.repeat_interleave(times, dim=0)
        if isinstance(value, list) and len(value) == rows:  # the records' fields (data/chat.py)
            return [item for item in value for _ in range(times)]
        return value
    return {k: repeated(v) for k, v in batch.items()}


def prompt_of(batch: Mapping[str, Any], row: int, prompt_tokens: int = 0) -> torch.Tensor:
    """Row ``row``'s prompt (the batch contract's, ``chat.prompt_lengths``): its tokens before the first counted
    label, or all of its tokens when none counts; ``prompt_tokens`` > 0 (text rows, ``on_policy.prompt_tokens``):
    its first ``prompt_tokens`` tokens (fewer if it is shorter)."""
    if prompt_tokens:
        mask = batch.get("attention_mask")
        length = int(mask[row].sum()) if mask is not None else batch["input_ids"].shape[1]
        return batch["input_ids"][row, :min(prompt_tokens, length)]
    parts = {k: batch[k][row:row + 1] for k in ("labels", "attention_mask")}
    return batch["input_ids"][row, :int(chat.prompt_lengths(parts))]


def splice(batch: Mapping[str, Any], rows: torch.Tensor, prompts: list[torch.Tensor], samples: list[torch.Tensor],
           pad: int) -> Batch:
    """The batch with each chosen row replaced by ``prompt + sample`` (labels on the sample only), right-padded
    to the longest row on any rank so that every rank's teacher forward has the same shape."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    local = max([input_ids.shape[1], *(len(p) + len(s) for p, s in zip(prompts, samples, strict=True))])
    length = int(distributed.all_reduce_max(torch.tensor(local, device=input_ids.device)))
    out = {"input_ids": torch.full((input_ids.shape[0], length), pad, dtype=input_ids.dtype, device=input_ids.device)}
    out["labels"] = torch.full_like(out["input_ids"], IGNORE_INDEX)
    out["attention_mask"] = torch.zeros_like(out["input_ids"], dtype=mask.dtype)
    width = input_ids.shape[1]
    out["input_ids"][:, :width], out["labels"][:, :width], out["attention_mask"][:, :width] = input_ids, labels, mask
    for row, prompt, sample in zip(rows.tolist(), prompts, samples, strict=True):
        end = len(prompt) + len(sample)
        out["input_ids"][row] = pad
        out["input_ids"][row, :end] = torch.cat([prompt, sample])
        out["labels"][row] = IGNORE_INDEX
        out["labels"][row, len(prompt):end] = sample
        out["attention_mask"][row] = 0
        out["attention_mask"][row, :end] = 1
    return {k: v for k, v in batch.items() if k not in out} | out

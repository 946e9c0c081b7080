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

Ranks sample different lengths; the ZeRO-3 teacher forward that follows then runs on shapes agreed across ranks
(each pads its batch to the longest row on any rank), so a rank that finished early never waits alone. Row
choice and sampling draw from the global torch generators, which every checkpoint saves and restores per rank
(``checkpoint.capture_rng``): a resumed run samples exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from distill_kit.engines import distributed
from distill_kit.errors import ConfigError
from losses.base import IGNORE_INDEX

Batch = dict[str, torch.Tensor]
FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@dataclass
class OnPolicyConfig:
    """Which rows of a micro-batch a model answers itself, and how it samples.

    Off by default (``fraction: 0``): the batch is used exactly as the data gives it.
    """

    fraction: float = 0.0
    """lambda in GKD: the share of each micro-batch's rows answered by samples (0 = off-policy, 1 = every row).
    Rows without an answer (prompts) are chosen first, the rest at random; unchosen prompts count no tokens."""
    sampler: Literal["student", "teacher"] = "student"
    """Who writes the samples: 'student' is on-policy distillation; 'teacher' is sequence-level KD (the teacher's
    ZeRO-3 generate steps every rank together at every token: slower than a student's, see README)."""
    max_new_tokens: int = 64
    """Longest sample; a sample cut here has no end token and every one of its tokens counts."""
    temperature: float = 1.0
    """Sampling temperature; 0 decodes greedily."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 keeps the whole distribution (GKD samples from it unchanged)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    generation_batch_size: int = 0
    """Rows per ``generate`` call. 0: each micro-batch samples its own rows, one call each. N > 0: the chosen rows
    of all of a step's micro-batches (``gradient_accumulation_steps`` of them) are sampled together, in calls of
    min(N, the step's rows) rows, the last padded with copies of a prompt, so that small micro-batches sample at
    a large batch's speed (decoding a small student is bound by per-token overhead, not arithmetic; see
    benchmarks/RESULTS.md) and a compiled static-cache decode step sees one batch size. Choose N dividing the
    step's sampled rows: padding rows are decoded and thrown away."""
    cache: Literal["auto", "static", "dynamic"] = "auto"
    """KV cache of generation: 'auto' is static on an accelerator where the model supports it (1.8x the new
    tokens/s of a dynamic one for a 0.5B student at batch 256 on an H200, 4x at 64), dynamic on the CPU and for a
    ZeRO-3 teacher."""
    sdpa_gqa: bool = True
    """Decode with SDPA's own grouped-query attention on an accelerator (transformers' switch
    ``TRANSFORMERS_SDPA_FORCE_GQA``, set only while ``generate`` runs): inside the compiled static-cache decode step
    transformers otherwise copies every key/value head once per query head that shares it, at every token.
    Measured for the 0.5B Qwen2-shaped student on an H200: 2.4x the new tokens/s at batch 256, 2.9x at 512."""
    eos_token_id: int | None = None
    """Token that ends a sample (counted); None reads the sampling model's generation config."""
    pad_token_id: int | None = None
    """Token that pads; None reads the model's config, else uses the end token."""

    def __post_init__(self) -> None:
        checks = {
            "fraction": 0.0 <= self.fraction <= 1.0,
            "sampler": self.sampler in ("student", "teacher"),
            "max_new_tokens": self.max_new_tokens >= 1,
            "temperature": self.temperature >= 0.0,
            "top_p": 0.0 < self.top_p <= 1.0,
            "top_k": self.top_k >= 0,
            "cache": self.cache in ("auto", "static", "dynamic"),
            "generation_batch_size": self.generation_batch_size >= 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"on_policy.{name}={getattr(self, name)!r}" for name in bad)
            raise ValueError(f"invalid on-policy settings: {values} (fraction in [0, 1], sampler student or "
                             "teacher, max_new_tokens >= 1, temperature >= 0, top_p in (0, 1], top_k >= 0, "
                             "generation_batch_size >= 0)")


def refuse_packed(batch: Mapping[str, Any], fraction: float) -> None:
    """Sampled rows are not packed yet: a packed batch (``position_ids``, several conversations a row) cannot
    have rows replaced by prompt + sample. ``validate`` refuses the config before any work; this guards Python use."""
    if "position_ids" in batch:
        raise ConfigError(f"data.packing: true cannot be combined with training.on_policy.fraction={fraction}: "
                          "sampled rows are not packed yet; set data.packing: false (or on_policy.fraction: 0)")


class Sampler:
    """Replaces ``fraction`` of a micro-batch's rows by ``prompt + sample`` from ``model()``.

    ``model`` returns the bare Hugging Face model to sample from (called at each batch: the engine may wrap it
    anew). ``synced`` makes every rank step generation together (a ZeRO-3 model's generate is a collective).
    """

    def __init__(self, config: OnPolicyConfig, model: Callable[[], nn.Module], synced: bool = False):
        self.config, self.model, self.synced = config, model, synced

    def __call__(self, batch: Mapping[str, Any]) -> Batch:
        """One micro-batch, its chosen rows sampled in one call."""
        if self.config.fraction == 0:
            return dict(batch)
        refuse_packed(batch, self.config.fraction)
        rows = self.choose_rows(batch)
        prompts = [prompt_of(batch, int(row)) for row in rows]
        samples = self.generate(prompts if prompts or not self.synced else [prompt_of(batch, 0)])[:len(prompts)]
        return splice(batch, rows, prompts, samples, self.pad_token_id)

    def many(self, batches: Sequence[Mapping[str, Any]]) -> list[Batch]:
        """A step's micro-batches: each one's rows chosen in turn, then all chosen rows sampled together in calls of
        ``generation_batch_size`` rows (0: each micro-batch alone, as ``__call__``)."""
        if self.config.fraction == 0 or not self.config.generation_batch_size:
            return [self(batch) for batch in batches]
        for batch in batches:
            refuse_packed(batch, self.config.fraction)
        rows = [self.choose_rows(batch) for batch in batches]
        prompts = [[prompt_of(batch, int(row)) for row in chosen] for batch, chosen in zip(batches, rows, strict=True)]
        samples = iter(self.generate_batched([p for group in prompts for p in group], prompt_of(batches[0], 0)))
        return [splice(batch, chosen, group, [next(samples) for _ in group], self.pad_token_id)
                for batch, chosen, group in zip(batches, rows, prompts, strict=True)]

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
        options: dict[str, Any] = {"do_sample": config.temperature > 0, "max_new_tokens": config.max_new_tokens,
                                   "pad_token_id": pad, "eos_token_id": eos, "synced_gpus": self.synced,
                                   "use_cache": True}  # a training config often turns the cache off
        if config.temperature > 0:
            options.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k or None)
        if self.static_cache(model, ids.device):
            options["cache_implementation"] = "static"
        was_training = model.training
        model.eval()
        try:
            with sdpa_gqa(config.sdpa_gqa and ids.device.type != "cpu"):
                out = model.generate(input_ids=ids, attention_mask=mask, **options)[:, width:]
        finally:
            model.train(was_training)
        ended = (out == eos).int()
        lengths = torch.where(ended.any(dim=1), ended.argmax(dim=1) + 1, out.shape[1])
        return [out[i, :int(n)] for i, n in enumerate(lengths)]

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
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else getattr(model.config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
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


def student_samples(config: OnPolicyConfig) -> bool:
    return config.fraction > 0 and config.sampler == "student"


def student_kernels(choice: str, config: OnPolicyConfig) -> str:
    """The student's ``training.student_kernels`` when it samples: ``auto`` then means none. Liger's RMSNorm
    kernel inside the compiled static-cache decode step makes torch.compile assume it mutates the weights, so the
    step runs without CUDA graphs (measured on an H200, benchmarks/RESULTS.md). An explicit ``liger`` is kept."""
    return "none" if choice == "auto" and student_samples(config) else choice


def teacher_liger(config: OnPolicyConfig) -> dict[str, bool]:
    """Liger options for the teacher when the student samples: no RoPE kernel. Liger's RoPE replaces a function of
    the architecture's modeling file, so a student of the teacher's architecture runs it too, and in the student's
    compiled decode step it breaks the graph in every layer: torch.compile recompiles the rest of the layer per
    layer index until its limit (8) and runs the others eagerly, ~33 ms a token for a 0.5B student on an H200
    (benchmarks/RESULTS.md). The teacher keeps Liger's RMSNorm and SwiGLU."""
    return {"rope": False} if student_samples(config) else {}


def prompt_of(batch: Mapping[str, Any], row: int) -> torch.Tensor:
    """Row ``row``'s prompt (the batch contract's, ``chat.prompt_lengths``): its tokens before the first counted
    label, or all of its tokens when none counts."""
    from distill_kit.data.chat import prompt_lengths  # here: chat reads the run config, which reads this module

    return batch["input_ids"][row, :int(prompt_lengths({k: batch[k][row:row + 1] for k in ("labels",
                                                                                          "attention_mask")}))]


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

"""Held-out evaluation of one or more students against the teacher, through local `evaluate` modules.

Per counted token (next label not -100) it collects each model's negative log-likelihood, the
teacher-student KL and both argmax tokens, gathers them from every rank, and lets the modules in
``distill_kit/training/metrics`` turn them into perplexity, top-1 agreement and mean KL. The teacher runs once
per batch however many students are evaluated; every rank must pass the same number of batches (the
ZeRO-3 teacher's forward is a collective), which the data loaders guarantee.

When the batches carry ``token_bytes`` (paired blocks, ``distill_kit/data/paired_blocks.py``), every model also
gets held-out bits per byte, the measure that compares across tokenizers. With a teacher that has another
tokenizer (``teacher_input_ids`` in the batch) each model's perplexity is over its own tokens, and top-1
agreement and KL, which need one vocabulary, are left out.

With ``eval.speculative`` on, :func:`evaluate_drafters` adds each student's figures as a drafter of the teacher
(``speculative.py``): ``speculative_tau`` and the rest, beside its perplexity.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from distill_kit.config import SpeculativeConfig
from distill_kit.engines import distributed
from distill_kit.engines.models import positions
from distill_kit.errors import DataError
from distill_kit.training import speculative
from distill_kit.training.on_policy import prompt_of
from losses.base import next_token_labels, valid_positions

if TYPE_CHECKING:
    import evaluate

METRICS_DIR = Path(__file__).resolve().parent / "metrics"
CHUNK_TOKENS = 2048  # rows upcast to float32 at a time: bounds memory at large vocabularies

Forward = Callable[[dict[str, torch.Tensor]], Any]


def load_metric(name: str) -> evaluate.EvaluationModule:
    """One of ``metrics/``, loaded by the ``evaluate`` library when an evaluation first needs it: importing
    ``evaluate`` pulls in transformers' pipelines (~3 s a process on a 2-core CPU), which every training process
    would otherwise pay at start-up whether it evaluates or not."""
    import evaluate

    return evaluate.load(str(METRICS_DIR / f"{name}.py"))


@torch.no_grad()
def token_statistics(student_logits: torch.Tensor, teacher_logits: torch.Tensor, batch: Mapping[str, Any]) -> dict:
    """1-D CPU tensors over this batch's counted tokens: NLLs, KL(teacher || student) and argmaxes."""
    rows = valid_positions(batch).reshape(-1).nonzero().squeeze(1)
    labels = next_token_labels(batch).reshape(-1)
    vocab = min(student_logits.shape[-1], teacher_logits.shape[-1])
    s_flat = student_logits.reshape(-1, student_logits.shape[-1])
    t_flat = teacher_logits.reshape(-1, teacher_logits.shape[-1])
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("student_nll", "teacher_nll", "kl", "student_top1",
                                                           "teacher_top1")}
    for chunk in rows.split(CHUNK_TOKENS):
        s_logp = F.log_softmax(s_flat.index_select(0, chunk)[:, :vocab].float(), dim=-1)
        t_logp = F.log_softmax(t_flat.index_select(0, chunk)[:, :vocab].float(), dim=-1)
        target = labels.index_select(0, chunk).unsqueeze(1)
        out["student_nll"].append(-s_logp.gather(1, target).squeeze(1))
        out["teacher_nll"].append(-t_logp.gather(1, target).squeeze(1))
        out["kl"].append((t_logp.exp() * (t_logp - s_logp)).sum(-1))
        out["student_top1"].append(s_logp.argmax(-1))
        out["teacher_top1"].append(t_logp.argmax(-1))
    return {k: torch.cat(v).cpu() if v else torch.empty(0) for k, v in out.items()}


@torch.no_grad()
def own_token_statistics(logits: torch.Tensor, batch: Mapping[str, Any], prefix: str = "") -> dict:
    """NLL of each counted token under its own model, and the bytes of text it stands for (for bits per byte).

    ``prefix`` "teacher_" reads the teacher's tokens of paired blocks; a model is then only judged on its own
    tokens, which is all that compares across tokenizers.
    """
    own = {"labels": batch[f"{prefix}labels"], "input_ids": batch[f"{prefix}input_ids"]}
    rows = valid_positions(own).reshape(-1).nonzero().squeeze(1)
    labels, flat = next_token_labels(own).reshape(-1), logits.reshape(-1, logits.shape[-1])
    nll = [F.cross_entropy(flat.index_select(0, chunk).float(), labels.index_select(0, chunk), reduction="none")
           for chunk in rows.split(CHUNK_TOKENS)]
    out = {"nll": torch.cat(nll).cpu() if nll else torch.empty(0)}
    if f"{prefix}token_bytes" in batch:
        out["bytes"] = torch.roll(batch[f"{prefix}token_bytes"], -1, dims=1).reshape(-1)[rows].cpu()
    return out


def _gather(values: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """Every rank's token statistics, concatenated on rank 0 (None elsewhere)."""
    local = {k: torch.cat(v) if v else torch.empty(0) for k, v in values.items()}
    everyone = distributed.all_gather_object(local)
    if not distributed.is_main():
        return None
    return {k: torch.cat([part[k] for part in everyone]) for k in local}


@torch.no_grad()
def evaluate_students(
    students: Mapping[str, Forward],
    teacher_forward: Forward | None,
    batches: Iterable[Mapping[str, Any]],
    device: torch.device,
    max_batches: int | None = None,
) -> dict[str, dict[str, float]]:
    """``{"teacher": {...}, <student name>: {...}}`` on every rank: perplexity, nll, KL, top-1 agreement.

    ``teacher_forward`` None (teachers with no full distribution: a store, a server): each student's own figures
    only (perplexity; bits per byte where batches carry bytes), with no teacher entry."""
    values: dict[str, dict[str, list[torch.Tensor]]] = {name: {} for name in students}
    teacher_values: dict[str, list[torch.Tensor]] = {}
    for batch in itertools.islice(batches, max_batches):
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        if teacher_forward is None:  # the students' own tokens, nothing to compare with
            for name, forward in students.items():
                for key, tensor in own_token_statistics(forward(batch).logits, batch).items():
                    values[name].setdefault(f"student_{key}", []).append(tensor)
            continue
        teacher_logits = teacher_forward(batch).logits
        paired = "teacher_input_ids" in batch  # another tokenizer: each model is judged on its own tokens only
        for name, forward in students.items():
            logits = forward(batch).logits
            stats = {} if paired else token_statistics(logits, teacher_logits, batch)
            if "token_bytes" in batch:
                stats |= {f"student_{k}": v for k, v in own_token_statistics(logits, batch).items()}
            for key, tensor in stats.items():
                values[name].setdefault(key, []).append(tensor)
        teacher_stats = {"teacher_nll": stats["teacher_nll"]} if not paired else {}
        if "token_bytes" in batch:
            prefix = "teacher_" if paired else ""
            teacher_stats |= {f"teacher_{k}": v for k, v in own_token_statistics(teacher_logits, batch, prefix).items()}
        for key, tensor in teacher_stats.items():
            teacher_values.setdefault(key, []).append(tensor)

    report = None
    gathered = {name: _gather(v) for name, v in values.items()}
    teacher = _gather(teacher_values)
    counted_by = teacher if teacher_forward is not None else next(iter(gathered.values()), None)
    counted = None if counted_by is None else max((len(v) for k, v in counted_by.items() if k.endswith("nll")),
                                                  default=0)
    if distributed.broadcast_object(counted) == 0:  # every rank raises, none is left in a collective
        raise DataError(f"the held-out evaluation counted no token in {max_batches if max_batches else 'all'} "
                        "batches (its rows hold no label to score: prompts only, or nothing): perplexity would read "
                        "1 and KL 0 over nothing. Give held-out data with answers (data.heldout), or more eval "
                        "batches (eval.max_batches)")
    if distributed.is_main():
        report = {"teacher": _own_metrics(teacher, "teacher")} if teacher_forward is not None else {}
        for name, stats in gathered.items():
            report[name] = _own_metrics(stats, "student")
            if "kl" in stats:
                agreement, kl = load_metric("top1_agreement"), load_metric("mean_kl")
                report[name] |= (agreement.compute(predictions=stats["student_top1"].tolist(),
                                                   references=stats["teacher_top1"].tolist())
                                 | kl.compute(predictions=stats["kl"].double().tolist()))
    return distributed.broadcast_object(report)


def _own_metrics(stats: Mapping[str, torch.Tensor], side: str) -> dict[str, float]:
    """Perplexity over the model's own tokens, and bits per byte where the batches say how many bytes a token is."""
    out = load_metric("perplexity").compute(predictions=stats[f"{side}_nll"].double().tolist())
    if f"{side}_bytes" in stats:
        out |= load_metric("bits_per_byte").compute(predictions=stats[f"{side}_nll"].double().tolist(),
                                                    references=stats[f"{side}_bytes"].tolist())
    return out


def held_out_prompts(batches: Iterable[Mapping[str, Any]], count: int, prompt_tokens: int) -> list[torch.Tensor]:
    """The first ``count`` held-out rows' prompts (CPU): a chat row's own prompt (its last ``prompt_tokens`` tokens),
    a text row's first ``prompt_tokens`` tokens (a text row counts every token: it has no prompt of its own)."""
    prompts: list[torch.Tensor] = []
    for batch in batches:
        for row in range(batch["input_ids"].shape[0]):
            prompt = prompt_of(batch, row)
            if len(prompt) == 0:  # a text row
                prompt = prompt_of(batch, row, prompt_tokens)
            prompt = prompt[-prompt_tokens:].cpu()
            if len(prompt):
                prompts.append(prompt)
            if len(prompts) == count:
                return prompts
    return prompts


@torch.no_grad()
def evaluate_drafters(target: torch.nn.Module, drafters: Mapping[str, torch.nn.Module],
                      batches: Iterable[Mapping[str, Any]], config: SpeculativeConfig,
                      device: torch.device) -> dict[str, dict[str, Any]]:
    """Each drafter's speculative-decoding figures against ``target`` (``speculative.py``), keys ``speculative_*``,
    on every rank. Every rank decodes rank 0's prompts (a ZeRO-3 target's forward is a collective: every rank must
    make the same calls), and rank 0's figures are the result."""
    prompts = distributed.broadcast_object(held_out_prompts(batches, config.prompts, config.prompt_tokens)
                                           if distributed.is_main() else None)
    if not prompts:
        raise DataError("eval.speculative found no held-out prompt to decode: give held-out data (data.heldout)")
    limit = min((n for n in (positions(getattr(m, "config", None)) for m in (target, *drafters.values())) if n),
                default=None)
    longest = max(len(p) for p in prompts)
    new_tokens = config.max_new_tokens if limit is None else min(config.max_new_tokens, limit - longest - config.gamma)
    if new_tokens < 1:
        raise DataError(f"eval.speculative: prompts of {longest} tokens leave no room to decode in {limit} positions; "
                        "lower eval.speculative.prompt_tokens")
    figures = speculative.evaluate_drafters(target, drafters, [p.to(device) for p in prompts], gamma=config.gamma,
                                            max_new_tokens=new_tokens, mode=config.mode,
                                            temperature=config.temperature, eos_token_id=None, seed=config.seed)
    named = {name: {f"speculative_{key}": value for key, value in row.items()} | {"speculative_prompts": len(prompts)}
             for name, row in figures.items()}
    return distributed.broadcast_object(named)

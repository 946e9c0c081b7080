"""A captured teacher's next-token targets: its top-k log-probabilities per token, not its logits.

Offline distillation (``distill_kit/offline/store.py``) runs the teacher once and keeps, per token, the
``k`` most likely ids, their log-probabilities at temperature 1 and the log of the mass left outside them
(the tail). A captured teacher's output carries these as its ``logits``; :class:`losses.LogitLoss` sees
the type and compares the student with them on the k ids, through :func:`losses.functional.top_k_rows`,
so every divergence keeps its one formula. Two readings of the missing mass:

* renormalised over the k ids (``log_tail`` None): works at any temperature, since
  softmax(log p / T) over the ids equals the teacher's tempered distribution renormalised over them;
* with the tail bucket (``log_tail`` given): k + 1 outcomes, "any other token" the last. It keeps the
  teacher's confidence, but the tail's mass is known only at the temperature it was captured at (1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import losses.functional as functional
from losses.chunked import ChunkLoss, PerToken


@dataclass(frozen=True)
class SparseTeacherLogits:
    """Top-k next-token targets of a captured teacher, aligned with the student's logits.

    ``log_probs`` (B, T, k) float: log p of each id at temperature 1. ``ids`` (B, T, k) int64.
    ``log_tail`` (B, T) float: log of the probability outside the k ids; None to renormalise over k.
    Positions the store did not keep (padding) hold any values; the losses never count them.
    """

    log_probs: torch.Tensor
    ids: torch.Tensor
    log_tail: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.ids.shape[-1]


@dataclass(frozen=True)
class SampledTeacherLogits:
    """K tokens drawn from the teacher's distribution at ``temperature`` per position (a sampled store, RS-KD).

    ``ids`` (B, T, k) int64 the distinct tokens drawn, ``counts`` (B, T, k) how often each was (0: an unused slot;
    each position's counts sum to K), ``log_probs`` (B, T, k) their log p at ``temperature``. Losses compare with
    them by :func:`losses.functional.sampled_forward_kl`, an unbiased estimate of forward KL and of its gradient.
    """

    log_probs: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor
    temperature: float = 1.0

    @property
    def k(self) -> int:
        return self.ids.shape[-1]


def sampled_chunk_loss(targets: SampledTeacherLogits, temperature: float, loss_name: str) -> ChunkLoss:
    """The sampled estimator on a chunk's student rows; the loss's temperature must be the one the draws were made
    at (the estimator is of KL(p_T || q_T) for that T only)."""
    if temperature != targets.temperature:
        raise ValueError(
            f"{loss_name}: temperature {temperature}, and the teacher's tokens were sampled at temperature "
            f"{targets.temperature}: the sampled estimate is of the distribution at the temperature it was drawn at. "
            f"Set the loss's temperature to {targets.temperature}, or capture the store again with --temperature "
            f"{temperature}."
        )
    k = targets.k
    return ChunkLoss(sampled_rows_loss, (targets.log_probs.reshape(-1, k), targets.ids.reshape(-1, k),
                                         targets.counts.reshape(-1, k)), {"temperature": temperature})


def sampled_rows_loss(student: torch.Tensor, log_probs: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, *,
                      temperature: float) -> torch.Tensor:
    """One chunk: student ``(c, Vs)`` float32 against the teacher's draws ``(c, k)``."""
    return functional.sampled_forward_kl(student / temperature, log_probs, ids, counts)


def top_k_chunk_loss(per_token: PerToken, targets: SparseTeacherLogits, labels: torch.Tensor, temperature: float,
                     loss_name: str) -> ChunkLoss:
    """``per_token`` on a chunk's student rows and the teacher's top-k targets, both divided by T."""
    if targets.log_tail is not None and temperature != 1.0:
        raise ValueError(
            f"{loss_name}: temperature {temperature} with a captured teacher's tail bucket: the tail's mass is "
            "known only at temperature 1, where it was captured. Set temperature: 1.0, or open the store with "
            "tail_bucket=False to renormalise over the top k (exact at any temperature)."
        )
    k = targets.k
    log_tail = None if targets.log_tail is None else targets.log_tail.reshape(-1)
    return ChunkLoss(top_k_rows_loss, (targets.log_probs.reshape(-1, k), targets.ids.reshape(-1, k), log_tail, labels),
                     {"per_token": per_token, "temperature": temperature})


def top_k_rows_loss(student: torch.Tensor, log_probs: torch.Tensor, ids: torch.Tensor, log_tail: torch.Tensor | None,
                    labels: torch.Tensor, *, per_token: PerToken, temperature: float) -> torch.Tensor:
    """One chunk: student ``(c, Vs)`` float32 against the teacher's top-k ``(c, k)`` (and tail ``(c,)``)."""
    teacher = log_probs.to(student.dtype) / temperature
    tail = None if log_tail is None else log_tail.to(student.dtype)
    student_rows, teacher_rows = functional.top_k_rows(student / temperature, teacher, ids, tail)
    return per_token(student_rows, teacher_rows, labels)

"""The hard-label term: ordinary next-token cross-entropy of the student on the data's labels."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import losses.functional as functional
from losses.base import LogitLoss, LossOutput
from losses.chunked import ChunkLoss


class CrossEntropy(LogitLoss):
    """Next-token cross-entropy, -log q(label), on the labels of the batch (``-100`` ignored).

    Mixed with a divergence it is the classic KD objective, ``0.5 CE + 0.5 KL`` (Hinton et al. 2015).
    It runs at temperature 1 without ``T**2`` scaling, because the labels are a one-hot target, not a
    softened distribution; so it takes no ``temperature``. It shares the chunked path of the logit
    losses, so it does not build a float32 copy of the logits either.
    Config: ``[{name: cross_entropy, weight: 0.5}, {name: forward_kl, weight: 0.5, temperature: 2.0}]``.
    """

    needs_teacher = False

    def __init__(self, chunk_size: int = 1024):
        super().__init__(temperature=1.0, scale_by_t2=False, chunk_size=chunk_size)

    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        # The labels are the target, so the teacher slot is never read, and a model trained without a teacher
        # (side by side, or a no-teacher baseline) can use this loss.
        return super().forward(student, _NO_TEACHER, batch)

    def chunk_loss(self, teacher_logits: Any, labels: torch.Tensor) -> ChunkLoss:
        return ChunkLoss(label_rows, (labels,))

    def per_token(self, student_logits, teacher_logits, labels) -> torch.Tensor:
        return functional.cross_entropy(student_logits, labels)


def label_rows(student: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One chunk: student ``(c, V)`` float32 logits, labels ``(c,)`` -> ``(c,)`` cross-entropy."""
    return functional.cross_entropy(student, labels)


class _NoTeacher:
    logits = None


_NO_TEACHER = _NoTeacher()

"""Mutual learning: models trained side by side teach each other, with no teacher.

Deep Mutual Learning (Zhang, Xiang, Hospedales and Lu, CVPR 2018): each of K models learns from the
labels and, at once, from the other models' current predictions, which act as soft targets that carry
more than the one-hot label. Model i's loss is ``CE(y, q_i) + 1/(K-1) * sum_{j != i} KL(p_j || q_i)``
with the peers' distributions ``p_j`` detached; with two models this is each one distilling the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from losses.base import LossOutput
from losses.divergences import ForwardKL


class MutualKL(ForwardKL):
    """The mean forward KL(p_peer || q) over the peers' outputs, which the teacher slot holds.

    Models trained side by side (``Distiller(..., teachers=[])``;
    docs/students.md#models-side-by-side-without-a-teacher) get the other models' detached outputs there; given a
    single teacher's outputs instead, it is plain forward KL. Temperature, ``T**2``
    scaling, chunking and normalisation are :class:`ForwardKL`'s. It is the soft half of deep mutual
    learning; the labels' half is ``cross_entropy``, so the paper's objective is the weighted sum
    ``[{name: cross_entropy, weight: 1.0}, {name: mutual_kl, weight: 1.0}]``.
    """

    needs_teacher = False

    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        peers = teacher if isinstance(teacher, Sequence) else [teacher]
        if not peers:
            raise ValueError("mutual_kl has no peer to learn from: train at least two models side by side")
        loss = torch.stack([super(MutualKL, self).forward(student, peer, batch).total for peer in peers]).mean()
        return LossOutput(loss, {self.name: loss.detach()})

"""A weighted sum of named losses, e.g. ``0.5 CE + 0.5 KL``: the third tier of torchdistill's design.

Each term keeps its own parameters (temperature, layers, ...) and is logged under its label, unweighted,
so a run's log shows what every term does, not only their sum; figures a term logs beside its value (a policy
gradient's rewards and entropy) keep their own names. The sum needs whatever any term needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from losses.base import DistillationLoss, LossOutput


class WeightedSum(DistillationLoss):
    """``sum_k weight_k * loss_k``. Built from a config list by :func:`losses.registry.build_loss`::

        loss:
          - {name: cross_entropy, weight: 0.5}
          - {name: forward_kl, weight: 0.5, temperature: 2.0}
          - {name: hidden_mse, weight: 0.1, label: hidden}

    Args:
        terms: ``(label, weight, loss)`` triples; labels are the keys in ``LossOutput.parts`` and in the
            checkpoint (``terms.<label>.projection.weight``), so they must be distinct.
    """

    def __init__(self, terms: Sequence[tuple[str, float, DistillationLoss]]):
        super().__init__()
        if not terms:
            raise ValueError("a weighted sum of losses needs at least one term, e.g. [{name: forward_kl, weight: 1.0}]")
        self.terms = nn.ModuleDict()
        self.weights: dict[str, float] = {}
        for label, weight, loss in terms:
            if not label.isidentifier():
                raise ValueError(f"loss label {label!r} must be an identifier (letters, digits, '_'); set 'label'")
            if label in self.terms:
                raise ValueError(f"two loss terms are labelled {label!r}; give one of them a distinct 'label'")
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight >= 0):
                raise ValueError(f"loss term {label!r} has weight {weight!r}; a weight must be a finite number >= 0")
            self.terms[label] = loss
            self.weights[label] = float(weight)
        self.needs_hidden_states = any(loss.needs_hidden_states for loss in self.terms.values())
        self.needs_attentions = any(loss.needs_attentions for loss in self.terms.values())
        self.needs_full_logits = any(loss.needs_full_logits for loss in self.terms.values())
        self.needs_teacher = any(loss.needs_teacher for loss in self.terms.values())
        self.takes_teacher_head = all(loss.takes_teacher_head for loss in self.terms.values())

    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        total = 0.0
        parts = {}
        for label, loss in self.terms.items():
            out = loss(student, teacher, batch)
            total = total + self.weights[label] * out.total
            parts[label] = out.total.detach()
            parts |= {key: value for key, value in out.parts.items() if key != loss.name}  # a term's own figures
        return LossOutput(total, parts)

"""Several teachers of one student: how their outputs are combined into one loss (``combine``).

Two ways to combine (``combine``):

- ``"sum"``: ``sum_k w_k * loss(student, teacher_k)``, one loss module per teacher (each with its own hidden-state
  projection when widths differ). It is the only choice for hidden-state and attention losses (there is no
  "mixture" of two models' hidden states), and the usual one for teachers of different skills or weighted by
  trust (MT-BERT, Wu et al. 2021). With reverse KL it is mode-seeking across teachers: ``sum_k w_k KL(q || p_k)``
  is, up to a constant, ``KL(q || r)`` with ``r`` proportional to ``prod_k p_k^{w_k}`` (a product of experts):
  the student favours tokens every teacher finds likely.
- ``"mixture"``: ``loss(student, p_mix)`` with ``p_mix = sum_k w_k p_k`` (weights normalised to 1), the ensemble's
  averaged distribution, as in Hinton et al. 2015 (distilling an ensemble into one model) and You et al. 2017.
  It suits an ensemble of peers on the same task, and any divergence that should see one target distribution:
  reverse KL or JSD against the mixture keep each teacher's modes available to the student. For forward KL the
  two coincide in gradient: ``sum_k w_k KL(p_k || q) = KL(p_mix || q) + const`` (the constant is the teachers'
  weighted divergence from their mixture), so only the logged values differ. The mixture is built over the full
  vocabulary in float32 (``losses/functional.py:mixture_logits``): one (tokens x vocabulary) tensor more, so it
  needs teachers with full distributions (the plan refuses top-k teachers here).
- ``"route"``: each row its own teacher (``teachers/group.py``), one plain loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any, Literal

from torch import nn

from distill_kit.config import TeacherSpec
from distill_kit.errors import ConfigError
from losses import DistillationLoss, LossOutput
from losses.base import LogitLoss
from losses.composite import WeightedSum
from losses.functional import mixture_logits

Combine = Literal["sum", "mixture", "route"]


def check_weights(specs: Sequence[TeacherSpec]) -> None:
    if specs and not any(spec.weight > 0 for spec in specs):
        raise ConfigError("teachers: every teacher has weight 0: give at least one a weight > 0")


class TeacherEnsembleLoss(DistillationLoss):
    """One student's loss against several teachers' outputs (a mapping ``{teacher name: output}``).

    ``combine="sum"``: ``sum_k w_k loss_k(student, teacher_k)``, parts ``<teacher>/<part>``. ``"mixture"``: the one
    loss against the teachers' weighted mixture, given to it as logits (``mixture_logits``) at its temperature.
    """

    def __init__(self, losses: Mapping[str, DistillationLoss], weights: Mapping[str, float], combine: Combine):
        super().__init__()
        if combine not in ("sum", "mixture"):
            raise ValueError(f"combine must be 'sum' or 'mixture', got {combine!r}")
        self.combine = combine
        self.weights = dict(weights)
        self.losses = nn.ModuleDict(losses if combine == "sum" else {next(iter(losses)): next(iter(losses.values()))})
        self.needs_hidden_states = any(loss.needs_hidden_states for loss in self.losses.values())
        self.needs_attentions = any(loss.needs_attentions for loss in self.losses.values())
        self.needs_teacher = True
        # The sum hands the student's outputs to its losses as they are (the fused head too, when they all take it);
        # the mixture is built over the full vocabulary, next to the student's full logits.
        self.needs_full_logits = combine == "mixture" or any(loss.needs_full_logits for loss in self.losses.values())
        if combine == "mixture":
            self.temperature = mixture_temperature(next(iter(self.losses.values())))
            total = sum(self.weights.values())
            self.shares = {name: weight / total for name, weight in self.weights.items()}

    def forward(self, student: Any, teachers: Mapping[str, Any], batch: Mapping[str, Any]) -> LossOutput:
        if self.combine == "mixture":
            (loss,) = self.losses.values()
            return loss(student, self.mixture(teachers, student.logits.shape[-1]), batch)
        total, parts = 0.0, {}
        for name, loss in self.losses.items():
            out = loss(student, teachers[name], batch)
            total = total + self.weights[name] * out.total
            parts[name] = out.total.detach()
            parts.update({f"{name}/{part}": value for part, value in out.parts.items() if part != loss.name})
        return LossOutput(total, parts)

    def mixture(self, teachers: Mapping[str, Any], vocab: int, temperature: float | None = None) -> Any:
        """An output whose ``logits`` are the teachers' weighted mixture (vocabularies cut to the student's)."""
        temperature = self.temperature if temperature is None else temperature
        logits = mixture_logits([teachers[name].logits[..., :vocab] for name in self.shares],
                                list(self.shares.values()), temperature)
        return SimpleNamespace(logits=logits)


def mixture_temperature(loss: DistillationLoss) -> float:
    """The temperature of a loss's teacher terms; a mixture is formed at one temperature, so they must agree."""
    terms = loss.terms.values() if isinstance(loss, WeightedSum) else [loss]
    if any(term.needs_hidden_states or term.needs_attentions for term in terms):
        raise ValueError("combine: mixture averages the teachers' distributions; hidden-state and attention losses "
                         "compare each teacher's own states: use combine: sum")
    temperatures = {term.temperature for term in terms if isinstance(term, LogitLoss) and term.needs_teacher}
    if len(temperatures) > 1:
        raise ValueError(f"combine: mixture needs one temperature for every teacher term, got {sorted(temperatures)}")
    return temperatures.pop() if temperatures else 1.0



"""The frozen side of a run: no teacher, one, or several, each its own engine (ZeRO-3 by default: sharded across the
ranks), or a captured store. :class:`Teachers` loads them and runs their forward; a student's loss against several
teachers is a :class:`TeacherEnsembleLoss`.

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
  vocabulary in float32 (``losses/functional.py:mixture_logits``): one (tokens x vocabulary) tensor more.

Every teacher must use the student's tokenizer (the logits are compared token id by token id); checkpoints
record every teacher's weight hash by name, and resume refuses other teachers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import deepspeed
import torch
from torch import nn

from distill_kit.config import TeacherSpec, TrainingConfig
from distill_kit.engines import distributed, fp8, kernels
from distill_kit.engines.build import build_teacher
from distill_kit.engines.fingerprint import teacher_fingerprint
from distill_kit.engines.models import ModelSource
from distill_kit.errors import ConfigError
from distill_kit.training.on_policy import teacher_liger
from losses import DistillationLoss, LossOutput
from losses.base import LogitLoss
from losses.composite import WeightedSum
from losses.functional import mixture_logits

Combine = Literal["sum", "mixture", "route"]
Batch = dict[str, Any]


class Teachers:
    """The run's frozen teachers, in order (each ZeRO-3 forward is a collective: every rank runs the same ones).

    ``forward`` returns what the losses read: one teacher's output, or ``{name: output}`` for several (combined by
    each student's :class:`TeacherEnsembleLoss`); with no teacher there is nothing to run. The teachers load one
    after another, each into its own shards, before any student: the large models must never exist unsharded next
    to the students.
    """

    def __init__(self, specs: Sequence[TeacherSpec], ds_configs: Mapping[str, Mapping[str, Any]],
                 training: TrainingConfig, device: torch.device, *, need_attentions: bool = False,
                 vocab_size: int | None = None):
        """``vocab_size``: the smallest teacher vocabulary (the plan's), which routed rows are compared on."""
        self.specs = {spec.name: spec for spec in specs}
        self.ds_configs = dict(ds_configs)
        """Each teacher's DeepSpeed config as its engine was given it, by name."""
        self.engines: dict[str, nn.Module] = {}
        precision = fp8.resolve(training.teacher_precision, training.dtype)  # checked by the plan
        for spec in specs:
            if isinstance(spec.model, deepspeed.DeepSpeedEngine):  # built already (shared by Distillers): as it is
                self.engines[spec.name] = spec.model
                continue
            model = fp8.load_teacher(spec.model, ds_configs[spec.name], training.dtype, precision, need_attentions,
                                     device)
            kernels.apply(model, fp8.run_teacher_kernels(training), "training.teacher_kernels",
                          liger=teacher_liger(training.on_policy))
            self.engines[spec.name] = build_teacher(model, ds_configs[spec.name], training.dtype, device)
        self._identities: dict[str, str] | None = None
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.engines)

    @property
    def first(self) -> nn.Module | None:
        """The first teacher's engine: "the teacher" where one model is meant (``sampler: teacher``)."""
        return next(iter(self.engines.values()), None)

    def forward(self, inputs: Mapping[str, Any], route: torch.Tensor | None = None) -> Any:
        """Every teacher on the same inputs, without gradients: one output, or ``{name: output}``. With ``route``
        (``combine: route``: each row's teacher index) each teacher runs only over its rows, and the output holds
        every row's logits from its own teacher."""
        with torch.no_grad():
            if route is not None:
                return self.routed(inputs, route)
            outputs = {name: engine(**inputs) for name, engine in self.engines.items()}
        return next(iter(outputs.values())) if len(outputs) == 1 else outputs

    def routed(self, inputs: Mapping[str, Any], route: torch.Tensor) -> SimpleNamespace:
        """Each row's logits from the teacher ``route`` names for it (vocabularies cut to the smallest).

        A ZeRO-3 forward is a collective, so every rank runs the teachers any rank needs, in the same order: a rank
        with no row of one runs it over its first row and drops the result. The routed loader (``ChatLoader(route=
        ...)``) gives every rank one and the same teacher per micro-batch, so that never happens in a run of it.
        """
        names = list(self.engines)
        needed = torch.zeros(len(names), device=route.device)
        needed[route.unique()] = 1
        needed = distributed.all_reduce_max(needed)
        logits = None
        for index in needed.nonzero().flatten().tolist():
            rows = (route == index).nonzero().flatten()
            sub = rows if len(rows) else route.new_zeros(1)  # a forward this rank only joins
            out = self.engines[names[index]](**{k: v[sub] if torch.is_tensor(v) else v for k, v in inputs.items()})
            vocab = self.vocab_size or out.logits.shape[-1]
            if logits is None:
                logits = out.logits.new_zeros((route.shape[0], out.logits.shape[1], vocab))
            if len(rows):
                logits[rows] = out.logits[..., :vocab]
        return SimpleNamespace(logits=logits)

    def mixture(self, outputs: Any) -> Any:
        """What evaluation compares a student with: the one teacher (or each row's own, routed), or the teachers'
        weighted mixture at temperature 1 (vocabularies cut to the smallest)."""
        if type(outputs) is not dict:  # one output (a ModelOutput is a dict subclass), or routed rows
            return outputs
        total = sum(spec.weight for spec in self.specs.values())
        vocab = min(out.logits.shape[-1] for out in outputs.values())
        return SimpleNamespace(logits=mixture_logits([outputs[name].logits[..., :vocab] for name in self.specs],
                                                     [spec.weight / total for spec in self.specs.values()], 1.0))

    @property
    def identities(self) -> dict[str, str]:
        """Each teacher's weight sha256 by name (computed once, on every rank: the hashes gather ZeRO-3 shards)."""
        if self._identities is None:
            self._identities = {name: teacher_fingerprint(engine) for name, engine in self.engines.items()}
        return self._identities

    @property
    def sha256(self) -> str | None:
        """What checkpoints record and resume compares: the one teacher's hash, or every teacher's name and hash."""
        if not self.engines:
            return None
        if len(self.engines) == 1:
            return next(iter(self.identities.values()))
        return ", ".join(f"{name}={sha}" for name, sha in self.identities.items())


def check_weights(specs: Sequence[TeacherSpec]) -> None:
    if specs and not any(spec.weight > 0 for spec in specs):
        raise ConfigError("teachers: every teacher has weight 0: give at least one a weight > 0")


def tokenizer_problems(reference: tuple[str, ModelSource], others: Sequence[tuple[str, ModelSource]]) -> list[str]:
    """Every folder of ``others`` that holds a tokenizer must have ``reference``'s vocabulary (``reference``: a label
    and a folder): logit losses compare the teachers' and the students' distributions token id by token id. Folders
    without a tokenizer are compared by vocabulary size instead (``plan.check_vocabulary``); so is a reference
    without one, which compares nothing here. One rule for the Python path (:func:`check_tokenizers`) and the
    CLI's start-up checks (``run/validate.py``: teachers and student folders), which name the run's tokenizer (or the
    students' own, ``student_tokenizer``) as the reference."""
    from transformers import AutoTokenizer

    def vocabulary(source: ModelSource) -> dict[str, int] | None:
        return AutoTokenizer.from_pretrained(source).get_vocab() if _has_tokenizer(source) else None

    label, source = reference
    others = [(name, other) for name, other in others if _has_tokenizer(other)]
    expected = vocabulary(source) if others else None  # nothing to compare: no tokenizer is read
    if expected is None:
        return []
    problems = []
    for name, other in others:
        theirs = vocabulary(other)
        if theirs != expected:
            problems.append(
                f"{name}: its tokenizer differs from {label}'s ({str(source)!r}: {len(expected)} tokens; "
                f"{str(other)!r}: {len(theirs)}, or other ids). Logit losses compare teachers and students token id "
                "by token id: use teachers and students that share the student's tokenizer (distilling across "
                "tokenizers, loss cross_tokenizer with student_tokenizer, takes one teacher: teacher:)")
    return problems


def check_tokenizers(student: ModelSource, specs: Sequence[TeacherSpec]) -> None:
    """Before anything loads: every teacher with a tokenizer in its folder has the student's (or, when the student
    has none there, the first such teacher's) vocabulary. A ``ConfigError`` naming the first that does not."""
    sources = [("the student", student), *((f"teachers[{spec.name}]", spec.model) for spec in specs)]
    found = [(label, source) for label, source in sources if _has_tokenizer(source)]
    problems = tokenizer_problems(found[0], found[1:]) if found else []
    if problems:
        raise ConfigError(problems[0])


def _has_tokenizer(source: ModelSource) -> bool:
    return isinstance(source, str | Path) and any((Path(source) / f).is_file()
                                                  for f in ("tokenizer_config.json", "tokenizer.json"))


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



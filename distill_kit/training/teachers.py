"""Several frozen teachers for one student: each its own engine (ZeRO-3 by default), every teacher's forward every
micro-batch, one loss that combines them.

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

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import nn

from distill_kit.distiller import CONFIG_DIR, Batch, Distiller
from distill_kit.engines import deepspeed_config, distributed, fp8, kernels, models
from distill_kit.engines.build import build_teacher
from distill_kit.engines.models import ModelSource
from distill_kit.run import evaluation, export
from distill_kit.training import checkpoint
from distill_kit.training.config import TrainingConfig
from distill_kit.training.loop import Trainer
from distill_kit.training.on_policy import teacher_liger
from distill_kit.training.student_spec import StudentSpec, spec_from, student_specs
from losses import DistillationLoss, LossOutput, build_loss
from losses.base import LogitLoss
from losses.composite import WeightedSum
from losses.functional import mixture_logits

Combine = Literal["sum", "mixture"]


@dataclass(frozen=True)
class TeacherSpec:
    """One frozen teacher of the student, as a user or a ``teachers: [...]`` entry describes it."""

    name: str
    """Label in logs (``<name>/<part>``) and in the checkpoints' record of teacher identities."""
    model: ModelSource
    """A save_pretrained directory, a hub name or a built ``nn.Module``."""
    weight: float = 1.0
    """Its weight in the sum of losses, or its share of the mixture (weights are normalised there)."""
    ds_config: str | Path | Mapping[str, Any] | None = None
    """Its DeepSpeed config; None takes the group's teacher config (ZeRO-3 by default)."""
    ds_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Dotted keys written into its config over the group's teacher overrides."""

    def __post_init__(self) -> None:
        if not (self.name and self.name.replace("-", "_").replace(".", "_").isidentifier()):
            raise ValueError(f"teacher name {self.name!r} must be a non-empty word (letters, digits, '_', '-', '.')")
        if not (isinstance(self.weight, int | float) and math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"teacher {self.name!r}: weight must be a finite number >= 0, got {self.weight!r}")


def teacher_specs(entries: Sequence[TeacherSpec | Mapping[str, Any]]) -> list[TeacherSpec]:
    """Specs from specs or dicts; unknown keys, repeated names and all-zero weights are errors."""
    specs = [spec_from(TeacherSpec, entry, "teacher") for entry in entries]
    names = [spec.name for spec in specs]
    if not specs:
        raise ValueError("no teachers: give at least one, e.g. [{name: big, model: path/to/teacher, weight: 1.0}]")
    if len(set(names)) != len(names):
        raise ValueError(f"teacher names must differ: {sorted({n for n in names if names.count(n) > 1})} repeat")
    if not any(spec.weight > 0 for spec in specs):
        raise ValueError("every teacher has weight 0: give at least one a weight > 0")
    return specs


def check_tokenizers(student: ModelSource, specs: Sequence[TeacherSpec]) -> None:
    """Every model with a tokenizer in its directory must have the same vocabulary, before anything loads."""
    from transformers import AutoTokenizer

    found = [(name, source) for name, source in [("student", student), *((s.name, s.model) for s in specs)]
             if not isinstance(source, nn.Module) and (Path(source) / "tokenizer_config.json").is_file()]
    vocabularies = {name: AutoTokenizer.from_pretrained(source).get_vocab() for name, source in found}
    sizes = {name: models.model_config(source).vocab_size for name, source in
             [("student", student), *((s.name, s.model) for s in specs)]
             if getattr(models.model_config(source), "vocab_size", None)}
    for name, vocab in vocabularies.items():
        first, reference = next(iter(vocabularies.items()))
        if vocab != reference:
            raise ValueError(
                f"teacher/student tokenizers differ: {first!r} has {len(reference)} tokens, {name!r} {len(vocab)} "
                "(or the same count with other ids). Every teacher must use the student's tokenizer: logit losses "
                "compare distributions token id by token id. Drop that teacher or use one with the same tokenizer."
            )
    student_vocab = sizes.get("student")
    smaller = {name: size for name, size in sizes.items() if student_vocab and size < student_vocab}
    if smaller:
        raise ValueError(f"teachers {smaller} have a smaller vocabulary than the student's ({student_vocab}): they "
                         "cannot share its tokenizer. Use teachers with the student's tokenizer.")


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


class MultiTeacherDistiller(Distiller):
    """A Distiller whose teacher slot holds several frozen teachers; the step and loop are the Distiller's.

    ``teacher_forward`` runs every teacher and returns ``{name: output}``; ``compute_loss`` combines them through
    :class:`TeacherEnsembleLoss`. ``self.teacher`` is the first teacher's engine; ``self.teachers`` all of them.
    """

    def __init__(
        self,
        student: ModelSource,
        teachers: Sequence[TeacherSpec | Mapping[str, Any]],
        *,
        loss: Any = "forward_kl",
        combine: Combine = "sum",
        training: TrainingConfig | None = None,
        student_ds_config: str | Path | Mapping[str, Any] = CONFIG_DIR / "zero2_student.json",
        teacher_ds_config: str | Path | Mapping[str, Any] = CONFIG_DIR / "zero3_teacher.json",
        student_ds_overrides: Mapping[str, Any] | None = None,
        teacher_ds_overrides: Mapping[str, Any] | None = None,
        peft: Any = None,
    ):
        specs = teacher_specs(teachers)
        check_tokenizers(student, specs)
        student_facts = models.facts(student)
        losses = {spec.name: build_loss(loss, **{f"student_{k}": v for k, v in student_facts.items()},
                                        **{f"teacher_{k}": v for k, v in models.facts(spec.model).items()})
                  for spec in specs}
        ensemble = TeacherEnsembleLoss(losses, {spec.name: spec.weight for spec in specs}, combine)
        Trainer.__init__(self, training)  # distributed start-up before any ZeRO-3 load
        configs = {}
        for spec in specs:  # every config checked before any teacher loads
            _, configs[spec.name] = deepspeed_config.prepare_pair(
                student_ds_config, spec.ds_config or teacher_ds_config, self.training,
                student_hidden_size=student_facts["hidden_size"], teacher_hidden_size=models.hidden_size(spec.model),
                world_size=distributed.world_size(), student_overrides=student_ds_overrides,
                teacher_overrides={**(teacher_ds_overrides or {}), **spec.ds_overrides})
        for spec in specs:
            kernels.check_model_type(self.training.teacher_kernels, models.model_type(spec.model),
                                     f"training.teacher_kernels (teacher {spec.name!r})")
            fp8.check_teacher(self.training.teacher_precision, self.training.dtype, spec.model,
                              f"training.teacher_precision (teacher {spec.name!r})")
        precision = fp8.resolve(self.training.teacher_precision, self.training.dtype)
        self.teacher_ds_configs = configs
        """Each teacher's DeepSpeed config as its engine was given it, by name."""
        self.teachers: dict[str, nn.Module] = {}
        for spec in specs:  # the teachers load first, one after another, each into its own shards
            model = fp8.load_teacher(spec.model, configs[spec.name], self.training.dtype, precision,
                                     ensemble.needs_attentions, self.device)
            kernels.apply(model, fp8.teacher_kernels(self.training.teacher_kernels, precision),  # as a lone teacher's
                          "training.teacher_kernels",
                          liger=teacher_liger(self.training.on_policy))
            self.teachers[spec.name] = build_teacher(model, configs[spec.name], self.training.dtype, self.device)
        first = specs[0]
        super().__init__(student, first.model, loss=ensemble, training=self.training,
                         student_ds_config=student_ds_config, teacher_ds_config=first.ds_config or teacher_ds_config,
                         student_ds_overrides=student_ds_overrides,
                         teacher_ds_overrides={**(teacher_ds_overrides or {}), **first.ds_overrides},
                         shared_teacher=self.teachers[first.name], peft=peft)
        self._teacher_identities: dict[str, str] | None = None

    def teacher_forward(self, batch: Batch) -> dict[str, Any]:
        """Every teacher, in order (each ZeRO-3 forward is a collective: every rank runs the same ones)."""
        inputs = self.model_inputs(batch)
        with torch.no_grad():
            return {name: teacher(**inputs) for name, teacher in self.teachers.items()}

    @property
    def teacher_identities(self) -> dict[str, str]:
        """Each teacher's weight sha256 by name (computed once, on every rank: the hashes gather ZeRO-3 shards)."""
        if self._teacher_identities is None:
            self._teacher_identities = {name: checkpoint.teacher_fingerprint(teacher)
                                        for name, teacher in self.teachers.items()}
        return self._teacher_identities

    @property
    def teacher_sha256(self) -> str:
        """What checkpoints record and resume compares: every teacher's name and weight hash."""
        return ", ".join(f"{name}={sha}" for name, sha in self.teacher_identities.items())

    def evaluate(self, batches: Iterable[Batch], max_batches: int | None = None) -> dict[str, dict[str, float]]:
        """As the Distiller's, with the teachers' weighted mixture at temperature 1 as "the teacher"."""
        total = sum(self.loss.weights.values())
        shares = {name: weight / total for name, weight in self.loss.weights.items()}

        def ensemble(batch: Batch) -> Any:
            outs = self.teacher_forward(batch)
            vocab = min(out.logits.shape[-1] for out in outs.values())
            return SimpleNamespace(logits=mixture_logits([outs[n].logits[..., :vocab] for n in shares],
                                                         list(shares.values()), 1.0))

        self.student.eval()
        try:
            return evaluation.evaluate_students({"student": self.student_forward}, ensemble, batches, self.device,
                                                max_batches)
        finally:
            self.student.train()


class TaughtStudent(Trainer):
    """One student of several teachers as a named group: what ``scripts/distill.py`` runs for ``teachers: [...]``.

    It gives the :class:`MultiTeacherDistiller` inside the interface of a
    :class:`~distill_kit.training.multi_student.MultiStudentDistiller` of one student, so the CLI's loop, logs,
    checkpoints and export do not change: records ``<name>/loss``, ``<name>/<teacher>``; checkpoints keep the engine
    in ``step_N/<name>`` and every teacher's identity in the manifest; ``evaluate`` returns ``{"teacher": ..., <name>:
    ...}`` with the teachers' weighted mixture as the teacher. The step is the Distiller's ``training_step``.
    """

    def __init__(
        self,
        student: StudentSpec | Mapping[str, Any],
        teachers: Sequence[TeacherSpec | Mapping[str, Any]],
        *,
        combine: Combine = "sum",
        training: TrainingConfig | None = None,
        student_ds_config: str | Path | Mapping[str, Any] = CONFIG_DIR / "zero2_student.json",
        teacher_ds_config: str | Path | Mapping[str, Any] = CONFIG_DIR / "zero3_teacher.json",
        student_ds_overrides: Mapping[str, Any] | None = None,
        teacher_ds_overrides: Mapping[str, Any] | None = None,
    ):
        super().__init__(training)
        (spec,) = student_specs([student])
        self.name = spec.name
        self.distiller = MultiTeacherDistiller(
            spec.model, teachers, loss=spec.loss, combine=combine, training=spec.training(self.training),
            student_ds_config=spec.ds_config or student_ds_config, teacher_ds_config=teacher_ds_config,
            student_ds_overrides={**(student_ds_overrides or {}), **spec.ds_overrides},
            teacher_ds_overrides=teacher_ds_overrides, peft=spec.peft)
        self.students: dict[str, Distiller] = {spec.name: self.distiller}
        self.teacher = self.distiller.teacher
        self.teacher_ds_config = self.distiller.teacher_ds_configs

    @property
    def teacher_sha256(self) -> str:
        """Every teacher's name and weight hash, as the checkpoints record them (``MultiTeacherDistiller``)."""
        return self.distiller.teacher_sha256

    def engines(self) -> dict[str, Any]:
        return {self.name: self.distiller.student}

    def make_batch(self, batch: Batch) -> Batch:
        return self.distiller.make_batch(batch)

    def make_batches(self, batches: list[Batch]) -> list[Batch]:
        return self.distiller.make_batches(batches)

    def micro_batch(self, batch: Batch) -> dict[str, LossOutput]:
        return {self.name: self.distiller.training_step(batch)}

    def evaluate(self, batches: Iterable[Batch], max_batches: int | None = None) -> dict[str, dict[str, float]]:
        metrics = self.distiller.evaluate(batches, max_batches)
        return {"teacher": metrics["teacher"], self.name: metrics["student"]}

    def export(self, directory: str | Path, tokenizer: Any | None = None) -> dict[str, Path]:
        """The bare student as ``<directory>/<name>`` (a PEFT student's adapter folder, and ``merged`` on request)."""
        return {self.name: export.export_student(self.distiller.student_model, Path(directory) / self.name, tokenizer,
                                                 merged=self.distiller.export_merged)}

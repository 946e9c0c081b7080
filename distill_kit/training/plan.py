"""A run's plan: everything its engines will use, derived from the specs without loading a single weight.

:func:`make_plan` is pure (it reads model configs, never weights) and is the one place where a run's shape is
checked: the :class:`~distill_kit.distiller.Distiller` builds from the plan, and the CLI's start-up checks
(``run/validate.py``) make the same plan from the models' configs to report its problems before anything is written.
So no rule is written twice, and what was checked is what runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed

from distill_kit.config import StudentSpec, TeacherSpec, TrainingConfig, check_names
from distill_kit.engines import fp8, kernels, models, peft_student
from distill_kit.engines.deepspeed_config import FrozenConfig, TrainedConfig, prepare, zero_stage
from distill_kit.errors import ConfigError
from distill_kit.training.teachers import Combine, TeacherEnsembleLoss, check_tokenizers, check_weights
from losses import DistillationLoss, build_loss

DeepSpeedConfig = str | Path | Mapping[str, Any]


@dataclass
class Plan:
    """What a run will build: its models, each student's loss, and each engine's resolved DeepSpeed config."""

    students: list[StudentSpec]
    teachers: list[TeacherSpec]
    training: TrainingConfig
    losses: dict[str, DistillationLoss]
    """Each student's loss, sized by its model and its teachers' (several teachers: a ``TeacherEnsembleLoss``)."""
    student_ds_configs: dict[str, dict[str, Any]]
    """Each student's DeepSpeed config, every "auto" filled from the run, by student name."""
    teacher_ds_configs: dict[str, dict[str, Any]]
    """Each teacher's, by teacher name."""
    teacher_vocab_size: int | None
    """The smallest teacher vocabulary (None across tokenizers or without a teacher): no student's may exceed it,
    and routed rows are compared on it (a teacher's padded vocabulary is cut to it)."""
    adapters: dict[str, Any]
    """Each LoRA student's ``peft.PeftConfig``, by name (``engines/peft_student.py``)."""
    combine: Combine = "sum"
    """How several teachers teach: a sum of losses, one loss against their mixture, or each row its own (route)."""

    @property
    def need_attentions(self) -> bool:
        """A loss reads attention maps: the models load with eager attention (fused kernels return none)."""
        return any(loss.needs_attentions for loss in self.losses.values())


def make_plan(
    students: Sequence[StudentSpec],
    teachers: Sequence[TeacherSpec],
    *,
    training: TrainingConfig,
    world_size: int,
    combine: Combine = "sum",
    student_ds_config: DeepSpeedConfig,
    teacher_ds_config: DeepSpeedConfig,
    student_ds_overrides: Mapping[str, Any] | None = None,
    teacher_ds_overrides: Mapping[str, Any] | None = None,
    vocab_map: Any = None,
    alone: bool = False,
) -> Plan:
    """The plan of a run of ``students`` and ``teachers`` (specs whose ``model`` is a path, a hub name, a built
    module or a ``PretrainedConfig``); a ``ConfigError`` or ``DeepSpeedConfigError`` names what cannot run and its fix.

    ``alone``: the one-line case, whose messages say "student" and "teacher" rather than each model's name.
    """
    check_shape(students, teachers, training, vocab_map)
    if combine not in ("sum", "mixture", "route"):
        raise ConfigError(f"combine: {combine!r} is not one of sum, mixture, route")
    if combine == "route" and training.on_policy.fraction > 0 and training.on_policy.sampler == "teacher":
        raise ConfigError("combine: route with training.on_policy.sampler: teacher: each row would need its own "
                          "teacher's sample; use sampler: student (each sample is scored by its row's teacher)")
    student_facts = {s.name: models.facts(s.model) for s in students}
    teacher_facts = {t.name: models.facts(t.model) for t in teachers}
    losses = {s.name: student_loss(s, student_facts[s.name], teachers, teacher_facts, combine, vocab_map)
              for s in students}
    if not teachers:
        needing = sorted(name for name, loss in losses.items() if loss.needs_teacher)
        if needing:
            raise ConfigError(f"students {needing}: their losses read a teacher's outputs, and this run has no "
                              "teacher: use cross_entropy, mutual_kl or a weighted sum of them, or add a teacher")
    student_configs, teacher_configs = prepare(
        {s.name: TrainedConfig(s.ds_config or student_ds_config, s.training(training),
                               student_facts[s.name]["hidden_size"], {**(student_ds_overrides or {}), **s.ds_overrides})
         for s in students},
        {t.name: FrozenConfig(t.ds_config or teacher_ds_config, teacher_facts[t.name]["hidden_size"],
                              {**(teacher_ds_overrides or {}), **t.ds_overrides}) for t in teachers},
        world_size=world_size,
        labels={name: "student" if alone else f"student {name!r}" for name in student_facts}
        | {name: "teacher" if len(teachers) == 1 else f"teacher {name!r}" for name in teacher_facts})
    for spec in teachers:  # FP8 where it cannot run (the device, a layer, the size), before anything loads
        if not isinstance(spec.model, deepspeed.DeepSpeedEngine):
            fp8.check_teacher(training.teacher_precision, training.dtype, spec.model,
                              "training.teacher_precision" if len(teachers) == 1 else
                              f"training.teacher_precision (teacher {spec.name!r})")
    for kind, specs in (("teacher", teachers), ("student", students)):
        for spec in specs:
            kernels.check_model_type(getattr(training, f"{kind}_kernels"), models.model_type(spec.model),
                                     f"training.{kind}_kernels ({kind} {spec.name!r})")
    # No student's vocabulary may exceed any teacher's (a teacher's padded one is cut by the losses); across
    # tokenizers the vocabulary map relates them instead.
    teacher_vocabs = [] if vocab_map is not None else [
        size for spec in teachers if (size := getattr(models.model_config(spec.model), "vocab_size", None))]
    teacher_vocab = min(teacher_vocabs, default=None)
    adapters = {}
    for spec in students:
        check_vocabulary(getattr(models.model_config(spec.model), "vocab_size", None), teacher_vocab, spec.name)
        if spec.peft is not None:
            try:
                adapters[spec.name] = peft_student.check(spec.peft, zero_stage(student_configs[spec.name]))
                peft_student.check_targets(adapters[spec.name], models.model_config(spec.model))
            except (ImportError, TypeError, ValueError) as err:
                raise ConfigError(f"students[{spec.name}].peft: {err}") from None
    return Plan(list(students), list(teachers), training, losses, student_configs, teacher_configs, teacher_vocab,
                adapters, combine)


def check_vocabulary(student_vocab: int | None, teacher_vocab: int | None, name: str) -> None:
    """A teacher vocabulary padded past the student's is cut by the losses; a larger student one is an error."""
    if student_vocab and teacher_vocab and student_vocab > teacher_vocab:
        raise ConfigError(
            f"student {name!r}: its vocabulary ({student_vocab}) is larger than the teacher's ({teacher_vocab}): "
            "they cannot share a tokenizer. Build the student with the teacher's tokenizer and vocab_size, or, to "
            "distil across tokenizers, use loss cross_tokenizer with paired blocks and Distiller(..., vocab_map="
            "VocabMap.build(student_tokenizer, teacher_tokenizer)) (a run config: student_tokenizer).")


def check_shape(students: Sequence[StudentSpec], teachers: Sequence[TeacherSpec], training: TrainingConfig,
                vocab_map: Any) -> None:
    """The shapes a run cannot have, each with its fix."""
    if not students:
        raise ConfigError("no students: give at least one, e.g. students=[StudentSpec(name='small', model=...)]")
    check_names(students, "student")  # again for specs given to make_plan directly (config.specs checks them)
    check_names(teachers, "teacher")
    missing = [s.name for s in students if s.model is None]
    if missing:
        raise ConfigError(f"students {missing} have no model: give each a model (a directory, a hub name or an "
                          "nn.Module); a run config's init / init_from_teacher students are built by the CLI")
    check_weights(teachers)
    fraction = training.on_policy.fraction
    if fraction > 0 and len(students) > 1:
        raise ConfigError(
            f"training.on_policy.fraction={fraction} with {len(students)} students: each student would sample its "
            "own completions, so they could not share batches or the teachers' forward. Distil them in separate "
            "runs, or set training.on_policy.fraction: 0")
    if fraction > 0 and training.on_policy.sampler == "teacher" and not teachers:
        raise ConfigError("training.on_policy.sampler: teacher, and this run has no teacher: use sampler: student")
    if len(teachers) > 1:
        if vocab_map is not None:
            raise ConfigError("several teachers across tokenizers is not supported: every teacher must use the "
                              "student's tokenizer (drop student_tokenizer, or keep one teacher)")
        check_tokenizers(students[0].model, teachers)


def student_loss(spec: StudentSpec, facts: Mapping[str, Any], teachers: Sequence[TeacherSpec],
                 teacher_facts: Mapping[str, Mapping[str, Any]], combine: Combine, vocab_map: Any) -> DistillationLoss:
    """A student's loss, sized by its facts and its teachers': one loss per teacher combined by
    :class:`TeacherEnsembleLoss` when there are several, the plain loss for one teacher or none."""
    def built(teacher: TeacherSpec | None) -> DistillationLoss:
        sized = {f"student_{k}": v for k, v in facts.items()}
        if teacher is not None:
            sized |= {f"teacher_{k}": v for k, v in teacher_facts[teacher.name].items()}
        try:
            return build_loss(spec.loss, **sized, vocab_map=vocab_map)
        except (KeyError, TypeError, ValueError) as err:
            message = err.args[0] if isinstance(err, KeyError) and err.args else err
            raise ConfigError(f"students[{spec.name}].loss: {message}") from None

    if len(teachers) <= 1 or combine == "route":  # routed: each row's logits come from its own teacher
        loss = built(teachers[0] if teachers else None)
        if combine == "route" and (loss.needs_hidden_states or loss.needs_attentions):
            raise ConfigError(f"students[{spec.name}].loss with combine: route: a routed teacher output holds each "
                              "row's logits only; hidden-state and attention losses compare one teacher's states: "
                              "use combine: sum")
        return loss
    try:
        return TeacherEnsembleLoss({t.name: built(t) for t in teachers}, {t.name: t.weight for t in teachers},
                                   combine)
    except ValueError as err:
        raise ConfigError(f"students[{spec.name}].loss with combine: {combine}: {err}") from None

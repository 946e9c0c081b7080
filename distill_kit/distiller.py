"""The Distiller: frozen teachers (ZeRO-3) teaching trained students (ZeRO-2), one step at a time.

Every shape of run is this one class::

    Distiller(student, teacher)                                   # the one-line case
    Distiller(students=[StudentSpec(...), ...], teachers=[TeacherSpec(...)])          # N students, one teacher
    Distiller(students=[StudentSpec(...)], teachers=[...], combine="sum" | "mixture")  # one student, M teachers
    Distiller(students=[StudentSpec(..., loss="mutual_kl"), ...], teachers=[])        # no teacher: side by side

Inside, two kinds of parts and no second loop: one :class:`~distill_kit.training.student.Student` per trained model
(engine, loss, forward, export) and the :class:`~distill_kit.teachers.group.Teachers` (frozen engines, or a
captured store). The step, each hook overridable alone by research code::

    batch = self.make_batch(batch)                       # on-policy: samples replace a fraction of the answers
    teacher_out = self.teacher_forward(batch)            # no_grad, ZeRO-3 shards; one forward for every student
    for student in self.students.values():
        student_out = self.student_forward(batch, student)                   # ZeRO-2 engine
        loss = self.compute_loss(student_out, teacher_out, batch, student)
        student.engine.backward(loss.total); student.engine.step()

The loop around the step (accumulation, records, checkpoints and resume, signals, non-finite steps) is
:class:`~distill_kit.training.loop.Trainer`'s: ``train``, ``save``, ``load``, ``resume``, ``step``, ``history``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoTokenizer

from distill_kit.config import DeepSpeedSettings, StudentSpec, TeacherSpec, TrainingConfig, specs
from distill_kit.engines import distributed
from distill_kit.engines.models import ModelSource, fresh_student, in_dtype
from distill_kit.errors import ConfigError, RewardFailed, StepFault, TeacherFault
from distill_kit.teachers import TeacherSetup
from distill_kit.teachers.combine import Combine
from distill_kit.teachers.group import Teachers
from distill_kit.training import evaluation, nonfinite
from distill_kit.training.loop import Batch, Trainer
from distill_kit.training.on_policy import Sampler
from distill_kit.training.plan import DataFacts, Plan, make_plan
from distill_kit.training.rewarding import Rewarder
from distill_kit.training.student import Student, unrolled_loss
from losses import DistillationLoss, LossOutput
from losses.policy import sampled_log_probs

logger = logging.getLogger("distill_kit")

DeepSpeedConfig = str | Path | Mapping[str, Any]


class Distiller(Trainer):
    """Students trained against frozen teachers in one process, each model its own DeepSpeed engine.

    ``student`` and ``teacher`` (the one-line case) or the entries of ``students`` and ``teachers`` are paths, hub
    names or built ``nn.Module``s (a teacher may be a :class:`~distill_kit.offline.CapturedTeacher`). Each engine's
    ZeRO stage comes from its own DeepSpeed config, so the same code runs ZeRO-2 + ZeRO-3 (the default), the
    ZeRO-3-for-both baseline, or a replicated (stage 0) teacher.
    """

    def __init__(
        self,
        student: ModelSource | None = None,
        teacher: ModelSource | None = None,
        *,
        students: Sequence[StudentSpec | Mapping[str, Any]] | None = None,
        teachers: Sequence[TeacherSpec | Mapping[str, Any]] | None = None,
        combine: Combine = "sum",
        loss: Any = "forward_kl",
        peft: Any = None,
        training: TrainingConfig | None = None,
        deepspeed: DeepSpeedSettings | None = None,
        data: DataFacts | None = None,
        output_dir: str | Path | None = None,
        tokenizer: str | None = None,
        vocab_map: Any = None,
        student_ds_config: DeepSpeedConfig | None = None,
        teacher_ds_config: DeepSpeedConfig | None = None,
        plan: Plan | None = None,
        speculative: Any = None,
    ):
        """``loss`` and ``peft`` belong to the one-line case (a spec carries its own). ``peft`` (``{r, alpha,
        dropout, target_modules}``, an ``AdapterConfig`` or a ``peft.PeftConfig``) trains adapters on a frozen
        student. ``combine`` joins several teachers: ``sum`` of one loss per teacher, one loss against their weighted
        ``mixture``, or each row its own teacher (``route``; ``teachers/combine.py``). ``deepspeed``: the run's
        DeepSpeed configs and overrides as one value (``student_ds_config`` / ``teacher_ds_config``: the common
        case's shorthand). ``data``: what the data is (chat or text, rows, packing), which on-policy sampling and the
        positions check read. ``output_dir``: checkpoints go to ``<output_dir>/checkpoints`` (or
        ``training.checkpoint_dir``); with neither, nothing is saved. ``tokenizer``: the run's, which every model's is
        checked against (default: the plan's choice, ``plan.run_tokenizer``: the lead teacher's, as its card names
        it). ``vocab_map`` (a :class:`~distill_kit.data.alignment.VocabMap`) says the tokenizers differ: batches are
        paired blocks and the loss ``cross_tokenizer`` gets it. ``plan``: one made already from the same specs (the
        CLI's, made by its start-up checks), built as it is. ``speculative`` (an ``eval.speculative``
        :class:`~distill_kit.config.SpeculativeConfig`): every evaluation also measures each student as a drafter of
        the teacher (tau, acceptance by position, predicted speed-up; docs/drafters.md).
        """
        student_specs, teacher_specs = _the_specs(student, teacher, students, teachers, loss, peft)
        deepspeed = deepspeed or DeepSpeedSettings()
        if student_ds_config is not None or teacher_ds_config is not None:
            deepspeed = dataclasses.replace(deepspeed, **{k: v for k, v in (("student", student_ds_config),
                                                                              ("teacher", teacher_ds_config)) if v})
        super().__init__(training)
        if plan is None:
            plan = make_plan(student_specs, teacher_specs, training=self.training, combine=combine,
                             world_size=distributed.world_size(), deepspeed=deepspeed, data=data,
                             output_dir=output_dir, tokenizer=tokenizer, vocab_map=vocab_map,
                             alone=student is not None, speculative=speculative)
        self.plan = plan
        """Every decision the run builds from (``training/plan.py``), checked before anything loads."""
        self.training = self.plan.training  # with what the plan derived: sample limits, the checkpoint folder
        cut = [s.name for s in student_specs if s.model is None and s.init_from_teacher is not None]
        if cut:  # refused before any model loads
            raise ConfigError(f"students{cut}.init_from_teacher cuts a student from the teacher's weights on "
                              "calibration batches: run it through scripts/distill.py, or cut it first "
                              "(distill_kit.students.from_teacher.student_from_teacher) and give model=")
        if distributed.is_main():
            for note in self.plan.notes:
                logger.info(note)
        self.teachers = Teachers(teacher_specs, self.plan.cards, self._teacher_setups(),
                                 vocab_size=self.plan.teacher_vocab_size, paging=self.plan.paging)
        self.teacher = self.teachers.first
        """The first teacher's model (an engine; None without one); ``self.teachers`` holds them all."""
        self.students: dict[str, Student] = {
            s.name: Student(self._built(s), self.plan.keys[s.name], self.plan.losses[s.name],
                            self.plan.student_ds_configs[s.name], s.training(self.training),
                            adapters=self.plan.adapters.get(s.name), main=distributed.is_main(),
                            config=self.plan.student_configs[s.name])
            for s in student_specs}
        self.teachers.attach(self.students)  # a teacher made of a student (kind self) takes it now, before any step
        self._hooks_take_student = {hook: "student" in inspect.signature(getattr(self, hook)).parameters
                                    for hook in ("student_forward", "compute_loss")}
        if len(self.students) > 1 and not all(self._hooks_take_student.values()):
            hooks = [hook for hook, takes in self._hooks_take_student.items() if not takes]
            raise ConfigError(f"{type(self).__name__} overrides {hooks} without a `student` parameter, and this run "
                              f"has {len(self.students)} students: add `student` (the Student part) to the override")
        only = next(iter(self.students.values()))
        on_policy = self.training.on_policy
        self.sampler = (Sampler(on_policy, lambda: only.model) if on_policy.sampler == "student" else
                        Sampler(on_policy, lambda: getattr(self.teacher, "module", self.teacher),
                                synced=distributed.world_size() > 1))
        self.rewarder = self._rewarder()
        """Scores the student's samples with ``training.rewards`` (``training/rewarding.py``); None without rewards."""

    def _rewarder(self) -> Rewarder | None:
        """The run's rewards on its samples, decoded by the run's tokenizer as the plan decided it
        (``plan.run_tokenizer``)."""
        if not self.plan.rewards:
            return None
        source = self.plan.tokenizer
        if source is None:
            raise ConfigError("training.rewards read the samples as text, and no model of this run names a tokenizer: "
                              "pass tokenizer= (a folder or hub name)")
        return Rewarder(self.training.rewards, self.plan.rewards, AutoTokenizer.from_pretrained(source),
                        self.training.on_policy.samples_per_prompt, [t.name for t in self.plan.teachers])

    def _teacher_setups(self) -> dict[str, TeacherSetup]:
        return {name: TeacherSetup(self.plan.teacher_ds_configs[name], self.training, self.device,
                                   need_attentions=self.plan.need_attentions,
                                   head_at_loss=self.plan.head_at_loss[name]) for name in self.plan.cards}

    def _built(self, spec: StudentSpec) -> StudentSpec:
        """A student given as a model, or built here from the plan's config: ``init`` (fresh weights, seeded by
        ``training.seed``, as the CLI builds it). A cut (``init_from_teacher``) is refused before (it needs the CLI's
        calibration batches)."""
        if spec.model is not None:
            return spec
        if spec.feature_drafter is not None:
            return dataclasses.replace(spec, model=in_dtype(self._feature_drafter(spec), self.training.dtype),
                                       feature_drafter=None)
        fresh = fresh_student(self.plan.student_configs[spec.name], self.training.seed)  # fp32, as the CLI saves it
        return dataclasses.replace(spec, model=in_dtype(fresh, self.training.dtype), init={})

    def _feature_drafter(self, spec: StudentSpec) -> nn.Module:
        """EAGLE-3's drafter on the run's one teacher (the plan checked it runs in-process with hidden states): built
        on a whole copy of the teacher loaded here, of which it keeps the embedding table and head (frozen), so
        that a ZeRO-3 teacher's partitioned weights are never what it shares. Seeded by ``training.seed``."""
        from transformers import AutoModelForCausalLM

        from distill_kit.students.feature_drafter import FeatureDrafter

        source = self.plan.teachers[0].model
        teacher = (copy.deepcopy(source) if isinstance(source, nn.Module) else
                   AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32))
        torch.manual_seed(self.training.seed)
        return FeatureDrafter(teacher, layers=spec.feature_drafter.layers, ttt_steps=spec.feature_drafter.ttt_steps)

    # ---- the hooks ---------------------------------------------------------------------------------------

    def make_batch(self, batch: Batch) -> Batch:
        """Each micro-batch as trained on, before the step counts its tokens (the loop calls it): with
        ``training.on_policy.fraction`` > 0 a share of its rows become prompt + sample (``on_policy.py``)."""
        return self.sampler(batch)

    def make_batches(self, batches: list[Batch]) -> list[Batch]:
        """A step's micro-batches: with ``training.on_policy.generation_batch_size`` set, the sampler samples all of
        their chosen rows together (``make_batch`` is not called); otherwise each goes through ``make_batch``. With
        ``training.rewards``, each sampled micro-batch is then scored (``rewards``, ``advantages``, ``no_signal``)."""
        if self.training.on_policy.generation_batch_size and self.training.on_policy.fraction > 0:
            made = self.sampler.many(batches)
        else:
            made = super().make_batches(batches)
        if self.rewarder is not None:
            made = self._agreed(lambda: [self.rewarder(batch, f" of micro-batch {i} at step {self.step + 1}")
                                         for i, batch in enumerate(made)], RewardFailed)
        if self.updates_per_rollout > 1 and self.training.on_policy.sampler == "student":
            made = [batch | {"sampling_log_probs": self._log_probs_now(batch)} for batch in made]
        return made

    @property
    def updates_per_rollout(self) -> int:
        """``training.on_policy.updates_per_rollout``: each step's samples trained on at that many steps."""
        return self.training.on_policy.updates_per_rollout

    def stale_batches(self, batches: list[Batch]) -> list[Batch]:
        """A rollout's micro-batches at the steps after the one that sampled them: each token's log-probability
        when sampled becomes ``old_log_probs``, which ``policy_gradient``'s clipped ratio reads. The sampling step
        itself passes none (its ratio is exactly 1), so it trains as a run with ``updates_per_rollout: 1`` does."""
        return [batch | {"old_log_probs": batch["sampling_log_probs"]} if "sampling_log_probs" in batch else batch
                for batch in batches]

    def _log_probs_now(self, batch: Batch) -> torch.Tensor:
        """``(B, T)`` the sampling student's log-probability of each next label (the first student: the one the
        sampler runs), at the weights that just sampled the batch (eval mode, as the sampler ran; no gradients); 0
        where no label counts."""
        student = next(iter(self.students.values()))
        was_training = student.engine.training
        student.engine.eval()
        try:
            with torch.no_grad():
                return sampled_log_probs(student.forward(batch), batch)
        finally:
            student.engine.train(was_training)

    def _agreed(self, work: Callable[[], Any], fault: type[StepFault]) -> Any:
        """``work()``, and when it fails on any rank (a reward, a teacher server: a ``StepFault``), a failure on every
        rank: one that skipped the step's collectives would leave the others waiting in them. One flag all-reduced
        per call, with several ranks only."""
        failure, result = None, None
        try:
            result = work()
        except StepFault as err:
            failure = err
        if distributed.world_size() > 1:
            failed = distributed.all_reduce_max(torch.tensor(int(failure is not None), device=self.device))
            if int(failed) and failure is None:
                raise fault("it failed on another rank, whose log names the cause")
        if failure is not None:
            raise failure
        return result

    def teacher_inputs(self, batch: Batch) -> dict[str, Any]:
        """What every teacher is called with: the students' inputs, with hidden states or attention maps when any
        student's loss needs them, and the teacher's own tokens when its tokenizer differs (paired blocks)."""
        requests = [student.inputs(batch) for student in self.students.values()]
        inputs = requests[0] | {flag: any(r[flag] for r in requests)
                                for flag in ("output_hidden_states", "output_attentions")}
        if "teacher_input_ids" in batch:
            inputs |= {"input_ids": batch["teacher_input_ids"], "attention_mask": batch["teacher_attention_mask"]}
            inputs.pop("position_ids", None)
        return inputs | {key: batch[key] for key in self.teachers.batch_keys if key in batch}  # e.g. a self-teacher's

    def teacher_forward(self, batch: Batch) -> Any:
        """One forward of every teacher, shared by every student: an output, or ``{name: output}`` for several;
        with ``combine: route``, each row's teacher (``batch["teacher_id"]``) over its rows only."""
        return self.teachers.forward(self.teacher_inputs(batch), route=self._route(batch))

    def _route(self, batch: Batch) -> Any:
        if self.plan.combine != "route":
            return None
        if "teacher_id" not in batch:
            raise ConfigError("combine: route needs each row's teacher: batches carry teacher_id, the index of its "
                              "teacher in teachers= (ChatLoader(..., route=[names]) adds it from the records)")
        return batch["teacher_id"]

    @property
    def reads_ahead(self) -> bool:
        """Across steps too, when a teacher prefetches (``Teachers.prefetches``) and the next micro-batch is what it
        will read: not when rows are replaced by samples first (a paged teacher's route is the data's all the same)."""
        return (self.needs_teacher and self.teachers.prefetches
                and (self.training.on_policy.fraction == 0 or self.teachers.pager is not None))

    @property
    def needs_teacher(self) -> bool:
        """Some student's loss reads the teachers' outputs. When none does (cross-entropy alone: SFT,
        sequence-level KD) the step skips their forward, on every rank alike."""
        return any(student.loss.needs_teacher for student in self.students.values())

    def student_forward(self, batch: Batch, student: Student | None = None) -> Any:
        """``student`` (default: the only one) on the batch; fused, a ``HeadOutput`` whose logits are lazy."""
        return (student or self.only_student).forward(batch)

    def compute_loss(self, student_out: Any, teacher_out: Any, batch: Batch,
                     student: Student | None = None) -> LossOutput:
        """``student``'s loss against the teachers' outputs (or, with no teacher, its peers' detached outputs)."""
        return (student or self.only_student).loss(student_out, teacher_out, batch)

    def training_step(self, batch: Batch) -> dict[str, LossOutput]:
        """One micro-batch: the teachers' forward once, then each student's forward, loss, backward and step.

        With no teacher, every student's forward comes first and each loss reads the others' detached outputs
        (mutual learning at the same weights). A non-finite loss makes DeepSpeed discard that student's update;
        the loop skips the step when every student discarded it (``nonfinite.py``).
        """
        teacher_out = self._agreed(lambda: self.teacher_forward(batch), TeacherFault) if self.needs_teacher else None
        if self.needs_teacher and self.upcoming is not None:  # a server's answers, a paged teacher's weights
            self.teachers.prefetch(self.teacher_inputs(self.upcoming), route=self._route(self.upcoming))
        peers = {} if len(self.teachers) else {n: self._forward(batch, s) for n, s in self.students.items()}
        losses = {}
        for name, student in self.students.items():
            if peers:
                student_out = peers[name]
            elif student.reads_teacher_features:  # a feature-reading drafter: the teacher's hidden states in,
                student_out = student.forward(batch, teacher_out, unroll=True)  # its unrolled draft steps out
            else:
                student_out = self._forward(batch, student)
            target = teacher_out if len(self.teachers) else tuple(_detached(o) for n, o in peers.items() if n != name)
            loss = (unrolled_loss([self._loss(out, target, batch, student) for out in student_out])
                    if isinstance(student_out, list) else self._loss(student_out, target, batch, student))
            student.engine.backward(nonfinite.poison_if_not_finite(loss.total))
            student.engine.step()
            losses[student.key] = loss
        return losses

    def _forward(self, batch: Batch, student: Student) -> Any:
        """``student_forward``, also as research code overrides it for one student: ``(self, batch)``."""
        if self._hooks_take_student["student_forward"]:
            return self.student_forward(batch, student=student)
        return self.student_forward(batch)

    def _loss(self, student_out: Any, teacher_out: Any, batch: Batch, student: Student) -> LossOutput:
        """``compute_loss``, also as overridden for one student: ``(self, student_out, teacher_out, batch)``."""
        if self._hooks_take_student["compute_loss"]:
            return self.compute_loss(student_out, teacher_out, batch, student=student)
        return self.compute_loss(student_out, teacher_out, batch)

    # ---- what the loop (training/loop.py) reads ------------------------------------------------------------

    def engines(self) -> dict[str, Any]:
        """Each student's engine by its key (the one-line case's: the empty key)."""
        return {student.key: student.engine for student in self.students.values()}

    def micro_batch(self, batch: Batch) -> dict[str, LossOutput]:
        return self.training_step(batch)

    @property
    def teacher_sha256(self) -> str | None:
        """The teachers' identity stored with each checkpoint (computed once, on every rank: it gathers)."""
        return self.teachers.sha256

    # ---- evaluation and export -----------------------------------------------------------------------------

    def evaluate(self, batches: Iterable[Batch], max_batches: int | None = None) -> dict[str, dict[str, float]]:
        """``{"teacher": {...}, <student>: {...}}`` over all ranks: perplexities, top-1 agreement and mean KL
        against the teacher (several teachers: their weighted mixture). The one-line case's student is
        ``"student"``. One teacher pass per batch; none for teachers with no full distribution (a store, a
        server: top-k targets), whose run reports each student's own perplexity only."""
        if not len(self.teachers):
            raise ConfigError("evaluate() compares students with a teacher, and this run has none")
        forwards = {student.key or "student": (  # a feature-reading drafter: one more teacher forward a batch
            (lambda batch, student=student: student.forward(batch, self.teacher_forward(batch)))
            if student.reads_teacher_features else partial(self._forward, student=student))
                    for student in self.students.values()}
        engines = self.engines().values()
        for engine in engines:
            engine.eval()
        try:
            dense = all(card.dense for card in self.plan.cards.values())
            figures = evaluation.evaluate_students(
                forwards, (lambda batch: self.teachers.mixture(self.teacher_forward(batch))) if dense else None,
                batches, self.device, max_batches)
            if self.plan.speculative is not None:
                drafted = evaluation.evaluate_drafters(
                    getattr(self.teacher, "module", self.teacher),
                    {student.key or "student": student.model for student in self.students.values()},
                    batches, self.plan.speculative, self.device)
                for name, row in drafted.items():
                    figures[name] |= row
            return figures
        finally:
            for engine in engines:
                engine.train()

    def export(self, directory: str | Path, tokenizer: Any | None = None) -> dict[str, Path]:
        """Each bare student as a Hugging Face model directory, ``<directory>/<name>``."""
        return {name: student.export(Path(directory) / name, tokenizer) for name, student in self.students.items()}

    # ---- the one-student shorthands ------------------------------------------------------------------------

    @property
    def only_student(self) -> Student:
        if len(self.students) != 1:
            raise ValueError(f"this run has {len(self.students)} students: pass the one you mean "
                             f"(distiller.students[name], one of {sorted(self.students)})")
        return next(iter(self.students.values()))

    @property
    def student(self) -> Any:
        """The one student's engine."""
        return self.only_student.engine

    @property
    def student_model(self) -> nn.Module:
        """The one student's bare model (no engine, no loss parameters), e.g. for export."""
        return self.only_student.model

    @property
    def student_ds_config(self) -> dict[str, Any]:
        """The DeepSpeed config the one student's engine was given."""
        return self.only_student.ds_config

    @property
    def teacher_ds_config(self) -> dict[str, Any] | None:
        """The DeepSpeed config the first teacher's engine was given (all: ``teachers.ds_configs``)."""
        return next(iter(self.teachers.ds_configs.values()), None)

    @property
    def loss(self) -> DistillationLoss:
        return self.only_student.loss

    @property
    def fused_head(self) -> bool:
        return self.only_student.fused_head

    @property
    def export_merged(self) -> bool:
        return self.only_student.export_merged


def _the_specs(student: ModelSource | None, teacher: ModelSource | None, students: Sequence[Any] | None,
               teachers: Sequence[Any] | None, loss: Any, peft: Any) -> tuple[list[StudentSpec], list[TeacherSpec]]:
    """The run's models as specs, whichever form they were given in."""
    if (student is None) == (students is None):
        raise ConfigError("give one student (Distiller(student, teacher)) or a list of them (students=[...]), "
                          "not both and not neither")
    if teacher is not None and teachers is not None:
        raise ConfigError("give one teacher (Distiller(student, teacher)) or a list of them (teachers=[...]), "
                          "not both")
    if student is not None:
        student_specs = [StudentSpec(name="student", model=student, loss=loss, peft=peft)]
    else:
        student_specs = specs(StudentSpec, students, "student")
    if teacher is not None:
        teacher_specs = [TeacherSpec(name="teacher", model=teacher)]
    else:
        teacher_specs = specs(TeacherSpec, teachers or [], "teacher")
    return student_specs, teacher_specs


def _detached(output: Any) -> Any:
    """A model output (a ``ModelOutput`` dict of tensors and tuples of tensors) cut from autograd: a peer's outputs
    may teach a student but never train the peer."""
    if not isinstance(output, Mapping):  # a fused forward's HeadOutput: its logits are not computed yet
        return output

    def cut(value: Any) -> Any:
        if hasattr(value, "detach"):
            return value.detach()
        if isinstance(value, tuple):
            return tuple(cut(v) for v in value)
        return value
    return type(output)(**{key: cut(value) for key, value in output.items()})

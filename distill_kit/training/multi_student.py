"""Several students of one frozen teacher: one teacher forward per micro-batch feeds every student.

A teacher is usually the expensive model, so distilling N students (different sizes, losses or learning
rates) in one run pays for its forward once per micro-batch instead of N times, and holds its ZeRO-3
shards once. Each student is an ordinary :class:`~distill_kit.distiller.Distiller` around the shared
teacher engine, with its own DeepSpeed engine, config, optimizer, scheduler, loss, checkpoints and
export; so its hooks (``student_forward``, ``compute_loss``, ``student_step``) are the single-student ones::

    teacher_out = self.teacher_forward(batch)                  # once, ZeRO-3 shards
    for student in self.students.values():
        student.student_step(batch, teacher_out)               # forward, loss, backward, step

The loop around it is the Distiller's (:class:`~distill_kit.training.loop.Trainer`): records ``<name>/loss``,
``<name>/<part>``, ``<name>/lr``; one checkpoint of the whole group (each student's engine in ``step_N/<name>``,
one manifest, the shared step, history, random generators and data position); ``resume()``, signals and
non-finite steps as for one student.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from distill_kit.distiller import CONFIG_DIR, Batch, Distiller
from distill_kit.engines import deepspeed_config, distributed, fp8, kernels, models
from distill_kit.engines.build import build_teacher
from distill_kit.engines.deepspeed_config import TrainedConfig
from distill_kit.engines.models import ModelSource
from distill_kit.run import evaluation, export
from distill_kit.training.config import TrainingConfig
from distill_kit.training.loop import Trainer
from distill_kit.training.on_policy import teacher_liger
from distill_kit.training.student_spec import StudentSpec, student_specs
from losses import DistillationLoss, LossOutput, build_loss


class MultiStudentDistiller(Trainer):
    """N students of one teacher, trained together on the same micro-batches.

    ``students`` are :class:`StudentSpec`s or plain dicts with the same keys (a run config's
    ``students: [...]``). A student without its own ``ds_config`` takes ``student_ds_config``;
    ``student_ds_overrides`` apply to every student, under each one's own ``ds_overrides``. The run's state
    (``step``, ``history``, ``stopped_by``, checkpoints) is the group's; its students' hooks do the work.
    """

    def __init__(
        self,
        teacher: ModelSource,
        students: Sequence[StudentSpec | Mapping[str, Any]],
        *,
        training: TrainingConfig | None = None,
        teacher_ds_config: str | Path | Mapping[str, Any] = CONFIG_DIR / "zero3_teacher.json",
        teacher_ds_overrides: Mapping[str, Any] | None = None,
        student_ds_config: str | Path | Mapping[str, Any] = CONFIG_DIR / "zero2_student.json",
        student_ds_overrides: Mapping[str, Any] | None = None,
        vocab_map: Any = None,
    ):
        """``vocab_map``: the students' tokenizer differs from the teacher's (see :class:`Distiller`)."""
        fraction = (training or TrainingConfig()).on_policy.fraction
        if fraction > 0 and len(students) > 1:  # before anything starts
            raise ValueError(
                f"training.on_policy.fraction={fraction} with {len(students)} students: each "
                "student would sample its own completions, so they could not share batches or the teacher's forward "
                "(the point of a group). Distil them in separate runs, or set training.on_policy.fraction: 0")
        super().__init__(training)
        specs = student_specs(students)
        teacher_facts = models.facts(teacher)
        student_facts = {spec.name: models.facts(spec.model) for spec in specs}
        requests = {spec.name: dict(
            student_ds_config=spec.ds_config or student_ds_config,
            student_ds_overrides={**(student_ds_overrides or {}), **spec.ds_overrides},
            training=spec.training(self.training),
            peft=spec.peft,
        ) for spec in specs}
        # Every student's config and the teacher's are checked together before anything loads.
        _, self.teacher_ds_config = deepspeed_config.prepare_group(
            {f"student {name!r}": TrainedConfig(r["student_ds_config"], r["training"],
                                                student_facts[name]["hidden_size"], r["student_ds_overrides"])
             for name, r in requests.items()},
            teacher_ds_config, teacher_hidden_size=teacher_facts["hidden_size"], world_size=distributed.world_size(),
            teacher_overrides=teacher_ds_overrides,
        )
        losses: dict[str, DistillationLoss] = {spec.name: build_loss(
            spec.loss, **{f"student_{k}": v for k, v in student_facts[spec.name].items()},
            **{f"teacher_{k}": v for k, v in teacher_facts.items()}, vocab_map=vocab_map,
        ) for spec in specs}
        # The teacher loads first and once: it must never exist unsharded next to the students.
        need_attentions = any(loss.needs_attentions for loss in losses.values())
        precision = fp8.resolve(self.training.teacher_precision, self.training.dtype)
        fp8.check_teacher(precision, self.training.dtype, teacher)
        teacher_model = fp8.load_teacher(teacher, self.teacher_ds_config, self.training.dtype, precision,
                                         need_attentions, self.device)
        kernels.apply(teacher_model, fp8.teacher_kernels(self.training.teacher_kernels, precision),
                      "training.teacher_kernels", liger=teacher_liger(self.training.on_policy))
        self.teacher = build_teacher(teacher_model, self.teacher_ds_config, self.training.dtype, self.device)
        self.students: dict[str, Distiller] = {
            spec.name: Distiller(spec.model, teacher, loss=losses[spec.name], teacher_ds_config=teacher_ds_config,
                                 teacher_ds_overrides=teacher_ds_overrides, shared_teacher=self.teacher,
                                 vocab_map=vocab_map, **requests[spec.name])
            for spec in specs
        }

    # ---- the step ----------------------------------------------------------------------------------------

    def teacher_forward(self, batch: Batch) -> Any:
        """The teacher once, with hidden states or attention maps when any student's loss needs them."""
        requests = [student.teacher_inputs(batch) for student in self.students.values()]
        inputs = requests[0] | {flag: any(r[flag] for r in requests)
                                for flag in ("output_hidden_states", "output_attentions")}
        with torch.no_grad():
            return self.teacher(**inputs)

    def make_batch(self, batch: Batch) -> Batch:
        """The one student's samples when it is on-policy (several on-policy students are refused above)."""
        return next(iter(self.students.values())).make_batch(batch) if len(self.students) == 1 else batch

    def make_batches(self, batches: list[Batch]) -> list[Batch]:
        """The one student's step of samples (``Distiller.make_batches``), when there is one student."""
        if len(self.students) == 1:
            return next(iter(self.students.values())).make_batches(batches)
        return super().make_batches(batches)

    def training_step(self, batch: Batch) -> dict[str, LossOutput]:
        """One micro-batch: the teacher's forward, then every student's half of the single-student step.

        A non-finite loss makes DeepSpeed discard that student's update (``Distiller.student_step``); the loop
        skips the step when every student discarded it, and stops naming them when only some did.
        """
        teacher_out = self.teacher_forward(batch)
        return {name: student.student_step(batch, teacher_out) for name, student in self.students.items()}

    # ---- the loop (training/loop.py: Trainer) ----------------------------------------------------------------

    def engines(self) -> dict[str, Any]:
        return {name: student.student for name, student in self.students.items()}

    def micro_batch(self, batch: Batch) -> dict[str, LossOutput]:
        return self.training_step(batch)

    # ---- evaluation and export ---------------------------------------------------------------------------

    def evaluate(self, batches: Iterable[Batch], max_batches: int | None = None) -> dict[str, dict[str, float]]:
        """``{"teacher": {...}, <name>: {...}}``: perplexities, top-1 agreement and KL; one teacher pass per batch."""
        for engine in self.engines().values():
            engine.eval()
        try:
            return evaluation.evaluate_students({name: s.student_forward for name, s in self.students.items()},
                                                self.teacher_forward, batches, self.device, max_batches)
        finally:
            for engine in self.engines().values():
                engine.train()

    def export(self, directory: str | Path, tokenizer: Any | None = None) -> dict[str, Path]:
        """Each bare student as a Hugging Face model directory, ``<directory>/<name>`` (a PEFT student's: its
        adapter folder, and ``<name>/merged`` when its ``peft.export_merged`` asks)."""
        return {name: export.export_student(student.student_model, Path(directory) / name, tokenizer,
                                            merged=student.export_merged)
                for name, student in self.students.items()}

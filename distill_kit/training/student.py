"""One trained model of a run, without a loop: its engine, its loss, its forward, its export.

The :class:`~distill_kit.distiller.Distiller` holds one :class:`Student` per trained model and runs the step over
them; the loop around the step (``training/loop.py``) sees only each student's engine, by its key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import deepspeed
from torch import nn

from distill_kit.config import StudentSpec, TrainingConfig
from distill_kit.data.chat import packed_model_inputs
from distill_kit.engines import fp8, kernels, models, peft_student, quantize
from distill_kit.engines.build import build_student
from distill_kit.engines.head import why_not_fused
from distill_kit.training.export import export_student
from distill_kit.training.on_policy import student_kernels
from losses import DistillationLoss, LossOutput

logger = logging.getLogger(__name__)

Batch = dict[str, Any]


class Student:
    """A trained model: loaded under its own ZeRO layout, wrapped with its loss into a DeepSpeed engine.

    ``key`` names it in the loop's records and checkpoints: the empty key is the one-student form
    (``Distiller(student, teacher)``: records ``loss``, checkpoint folder ``deepspeed``); otherwise it is ``name``
    (records ``<name>/loss``, checkpoint folder ``<name>``).
    """

    def __init__(self, spec: StudentSpec, key: str, loss: DistillationLoss, ds_config: Mapping[str, Any],
                 training: TrainingConfig, *, adapters: Any = None, main: bool = True, config: Any = None):
        """``adapters``: the ``peft.PeftConfig`` of a LoRA student (the plan's), trained on its frozen base.
        ``config``: its model config as the plan read it (so that it is read once per run)."""
        self.spec, self.key, self.name, self.loss = spec, key, spec.name, loss
        self.ds_config = ds_config
        """The DeepSpeed config its engine was given (every "auto" filled from the run)."""
        self.training = training
        self.export_merged = peft_student.wants_merged_export(spec.peft)
        model = models.load(spec.model, ds_config, training.dtype, loss.needs_attentions, config=config)
        if spec.quantize is not None and quantize.quantize_of(model) is None:  # fake-quantised before any kernel
            quantize.prepare(model, spec.quantize)
        kernels.apply(model, student_kernels(training.student_kernels, training.on_policy), "training.student_kernels",
                      liger=kernels.beside(fp8.run_teacher_kernels(training)))
        if adapters is not None:
            model = peft_student.wrap(model, adapters)
        self.engine: deepspeed.DeepSpeedEngine = build_student(model, loss, ds_config, training)
        unfused = why_not_fused(model, loss, ds_config, training.fused_loss)
        if unfused and training.fused_loss and main:
            logger.info("student %r: logits materialised in full: %s", spec.name, unfused)
        self.fused_head = unfused is None
        """The student runs without its output head; logit losses apply it chunk by chunk (``losses/fused.py``)."""

    @property
    def reads_teacher_features(self) -> bool:
        """A feature-reading drafter (``students/feature_drafter.py``): its forward takes the teacher's hidden
        states (:meth:`forward`'s ``teacher_out``), and it asks the teacher for them (:meth:`inputs`)."""
        return bool(getattr(self.model, "reads_teacher_features", False))

    @property
    def model(self) -> nn.Module:
        """The bare model (no engine, no loss parameters), e.g. for export or sampling."""
        return self.engine.module.student

    def inputs(self, batch: Batch) -> dict[str, Any]:
        """What it is called with: no labels (the loss modules own every loss), positions when the batch carries
        them (packed rows), and hidden states or attentions only when its loss asks for them. Never a KV cache: a
        scoring forward reads none, and building one costs memory and, in layers under ``torch.compile``, a
        recompile per layer (the cache's per-layer state is guarded on), which past dynamo's limit of 8 leaves the
        remaining layers eager."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"), "use_cache": False,
                  "output_hidden_states": self.loss.needs_hidden_states or self.reads_teacher_features,
                  "output_attentions": self.loss.needs_attentions}
        return inputs | packed_model_inputs(batch)  # packed chat rows: position_ids, no 2-D mask, no cache

    def forward(self, batch: Batch, teacher_out: Any = None, unroll: bool = False) -> Any:
        """Fused: a ``HeadOutput`` (hidden states and head), whose ``logits`` are computed only if read. A
        feature-reading drafter reads ``teacher_out``'s hidden states (the step's one teacher forward); with
        ``unroll`` (the training step) it returns its ``ttt_steps`` unrolled draft steps, a list, whose losses
        :func:`unrolled_loss` sums."""
        inputs = self.inputs(batch)
        if self.reads_teacher_features:
            hidden_states = getattr(teacher_out, "hidden_states", None)
            if hidden_states is None:
                raise ValueError(f"student {self.name!r} reads its teacher's hidden states, and the teacher's output "
                                 "has none: call forward(batch, teacher_out) with a forward that asked for them")
            inputs["teacher_hidden_states"] = hidden_states
            if unroll:
                inputs["draft_steps"] = getattr(self.model, "ttt_steps", 1)
        return self.engine(**inputs, head=not self.fused_head)

    def export(self, directory: str | Path, tokenizer: Any | None = None) -> Path:
        """A Hugging Face model directory (a PEFT student's: its adapter folder, and ``merged`` on request; a
        feature-reading drafter's: EAGLE-3's folder, ``FeatureDrafter.save_pretrained``)."""
        if self.reads_teacher_features:  # ZeRO 0-2 (the students' default): whole on every rank
            from distill_kit.engines import distributed

            if distributed.is_main():
                self.model.save_pretrained(directory, tokenizer)
            distributed.barrier()
            return Path(directory)
        return export_student(self.model, directory, tokenizer, merged=self.export_merged)


TTT_DECAY = 0.8
"""EAGLE-3's weight of each later unrolled draft step's loss (step m: ``0.8 ** (m - 1)``)."""


def unrolled_loss(steps: Sequence[LossOutput]) -> LossOutput:
    """A feature-reading drafter's training-time test: the losses of its unrolled draft steps, step m weighted
    ``TTT_DECAY ** (m - 1)`` and summed, as EAGLE-3 trains. Logged: the first step's parts as they are (the
    figure comparable with a drafter trained on one step) and each later step's loss as ``draft_step_<m>``."""
    total = sum(TTT_DECAY ** m * step.total for m, step in enumerate(steps))
    parts = dict(steps[0].parts) | {f"draft_step_{m + 1}": step.total.detach() for m, step in enumerate(steps) if m}
    return LossOutput(total, parts)

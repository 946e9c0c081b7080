"""The Distiller: a frozen ZeRO-3 teacher teaching a ZeRO-2 student, one step at a time.

Each hook does one thing and can be overridden alone by research code::

    batch = self.make_batch(batch)                 # on-policy: samples replace a fraction of the answers
    teacher_out = self.teacher_forward(batch)      # no_grad, ZeRO-3 shards gathered layer by layer
    student_out = self.student_forward(batch)      # ZeRO-2 engine
    loss = self.compute_loss(student_out, teacher_out, batch)
    self.student.backward(loss.total); self.student.step()

The loop around the step (accumulation, records, checkpoints and resume, signals, non-finite steps) is
:class:`~distill_kit.training.loop.Trainer`'s, shared with the groups of ``multi_student.py`` and
``side_by_side.py``: ``train``, ``save``, ``load``, ``resume``, ``step``, ``history``, ``stopped_by``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distill_kit.engines import deepspeed_config, distributed, fp8, kernels, models, peft_student
from distill_kit.engines.build import build_student, build_teacher
from distill_kit.engines.head import why_not_fused
from distill_kit.engines.models import ModelSource
from distill_kit.run import evaluation
from distill_kit.training import nonfinite
from distill_kit.training.config import TrainingConfig
from distill_kit.training.loop import Batch, Trainer
from distill_kit.training.on_policy import Sampler, student_kernels, teacher_liger
from losses import DistillationLoss, LossOutput, build_loss

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class Distiller(Trainer):
    """Owns the student engine (trained) and the teacher engine (frozen) in one process.

    ``student`` and ``teacher`` are paths or hub names (loaded under their own ZeRO layout) or built
    ``nn.Module``s. Each engine's ZeRO stage comes from its own DeepSpeed config, so the same code runs
    ZeRO-2 + ZeRO-3 (the default), the ZeRO-3-for-both baseline, or a replicated (stage 0) teacher.
    """

    def __init__(
        self,
        student: ModelSource,
        teacher: ModelSource,
        *,
        loss: Any = "forward_kl",
        training: TrainingConfig | None = None,
        student_ds_config: str | Path | Mapping[str, Any] = CONFIG_DIR / "zero2_student.json",
        teacher_ds_config: str | Path | Mapping[str, Any] = CONFIG_DIR / "zero3_teacher.json",
        student_ds_overrides: Mapping[str, Any] | None = None,
        teacher_ds_overrides: Mapping[str, Any] | None = None,
        shared_teacher: nn.Module | None = None,
        vocab_map: Any = None,
        peft: peft_student.PeftSpec | None = None,
    ):
        """``shared_teacher`` is a teacher engine already built from ``teacher`` and ``teacher_ds_config``
        (several students share one, see ``multi_student.py``): nothing is loaded for it again.

        ``vocab_map`` (a :class:`~distill_kit.data.alignment.VocabMap`) says the two tokenizers differ: the
        batches are paired blocks (``distill_kit/data/paired_blocks.py``) and the loss ``cross_tokenizer``
        gets the map; the vocabularies are then not required to line up. ``peft`` (``{r, alpha, dropout,
        target_modules}``, an ``AdapterConfig`` or a ``peft.PeftConfig``) trains adapters on a frozen student
        instead of the whole student (``engines/peft_student.py``)."""
        super().__init__(training)
        student_facts, teacher_facts = models.facts(student), models.facts(teacher)
        self.student_ds_config, self.teacher_ds_config = deepspeed_config.prepare_pair(
            student_ds_config,
            teacher_ds_config,
            self.training,
            student_hidden_size=student_facts["hidden_size"],
            teacher_hidden_size=teacher_facts["hidden_size"],
            world_size=distributed.world_size(),
            student_overrides=student_ds_overrides,
            teacher_overrides=teacher_ds_overrides,
        )
        self.loss: DistillationLoss = build_loss(
            loss, **{f"student_{k}": v for k, v in student_facts.items()},
            **{f"teacher_{k}": v for k, v in teacher_facts.items()}, vocab_map=vocab_map,
        )
        adapters = (peft_student.check(peft, deepspeed_config.zero_stage(self.student_ds_config))
                    if peft is not None else None)
        self.export_merged = peft_student.wants_merged_export(peft)
        kernels.check_model_type(self.training.teacher_kernels, models.model_type(teacher), "training.teacher_kernels")
        precision = fp8.resolve(self.training.teacher_precision, self.training.dtype)
        if shared_teacher is None:
            fp8.check_teacher(precision, self.training.dtype, teacher)
        kernels.check_model_type(self.training.student_kernels, models.model_type(student), "training.student_kernels")
        # The teacher loads first: it is the large one, and must never exist unsharded next to the student.
        need_attentions = self.loss.needs_attentions
        teacher_model = (fp8.load_teacher(teacher, self.teacher_ds_config, self.training.dtype, precision,
                                          need_attentions, self.device)
                         if shared_teacher is None else getattr(shared_teacher, "module", shared_teacher))
        student_model = models.load(student, self.student_ds_config, self.training.dtype, need_attentions)
        if shared_teacher is None:
            kernels.apply(teacher_model, fp8.teacher_kernels(self.training.teacher_kernels, precision),
                          "training.teacher_kernels", liger=teacher_liger(self.training.on_policy))
        kernels.apply(student_model, student_kernels(self.training.student_kernels, self.training.on_policy),
                      "training.student_kernels")
        if vocab_map is None:
            check_vocabularies(student_model, teacher_model)
        if adapters is not None:
            student_model = peft_student.wrap(student_model, adapters)
        self.teacher = (build_teacher(teacher_model, self.teacher_ds_config, self.training.dtype, self.device)
                        if shared_teacher is None else shared_teacher)
        self.student = build_student(student_model, self.loss, self.student_ds_config, self.training)
        unfused = why_not_fused(student_model, self.loss, self.student_ds_config, self.training.fused_loss)
        if unfused and self.training.fused_loss and distributed.is_main():
            logging.getLogger(__name__).info("student logits materialised in full: %s", unfused)
        self.fused_head = unfused is None
        """The student runs without its output head; logit losses apply it chunk by chunk (``losses/fused.py``)."""
        on_policy = self.training.on_policy
        self.sampler = (Sampler(on_policy, lambda: self.student_model) if on_policy.sampler == "student" else
                        Sampler(on_policy, lambda: getattr(self.teacher, "module", self.teacher),
                                synced=distributed.world_size() > 1))

    # ---- the hooks ---------------------------------------------------------------------------------------

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """What both models are called with: no labels (the loss modules own every loss), and hidden
        states or attentions only when a loss asks for them."""
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": batch.get("attention_mask"),
            "output_hidden_states": self.loss.needs_hidden_states,
            "output_attentions": self.loss.needs_attentions,
        }

    def make_batch(self, batch: Batch) -> Batch:
        """Each micro-batch as trained on, before the step counts its tokens (the loop calls it): with
        ``training.on_policy.fraction`` > 0 a share of its rows become prompt + sample (``on_policy.py``)."""
        return self.sampler(batch)

    def make_batches(self, batches: list[Batch]) -> list[Batch]:
        """A step's micro-batches: with ``training.on_policy.generation_batch_size`` set, the sampler samples all of
        their chosen rows together (``make_batch`` is not called); otherwise each goes through ``make_batch``."""
        if self.training.on_policy.generation_batch_size and self.training.on_policy.fraction > 0:
            return self.sampler.many(batches)
        return super().make_batches(batches)

    def teacher_inputs(self, batch: Batch) -> dict[str, Any]:
        """The teacher reads its own tokens when its tokenizer differs (paired blocks carry ``teacher_input_ids``)."""
        inputs = self.model_inputs(batch)
        if "teacher_input_ids" in batch:
            inputs |= {"input_ids": batch["teacher_input_ids"], "attention_mask": batch["teacher_attention_mask"]}
        return inputs

    def teacher_forward(self, batch: Batch) -> Any:
        with torch.no_grad():
            return self.teacher(**self.teacher_inputs(batch))

    def student_forward(self, batch: Batch) -> Any:
        """Fused: a ``HeadOutput`` (hidden states and head), whose ``logits`` are computed only if read."""
        return self.student(**self.model_inputs(batch), head=not self.fused_head)

    def compute_loss(self, student_out: Any, teacher_out: Any, batch: Batch) -> LossOutput:
        return self.loss(student_out, teacher_out, batch)

    def training_step(self, batch: Batch) -> LossOutput:
        """One micro-batch: forwards, loss, backward; the engine steps the optimizer at the boundary. A loss that never
        reads the teacher (cross-entropy alone: SFT, sequence-level KD) skips its forward, on every rank alike."""
        teacher_out = self.teacher_forward(batch) if self.loss.needs_teacher else None
        return self.student_step(batch, teacher_out)

    def student_step(self, batch: Batch, teacher_out: Any) -> LossOutput:
        """The student's half of a micro-batch, given the teacher's outputs (which several students may share)."""
        student_out = self.student_forward(batch)
        loss = self.compute_loss(student_out, teacher_out, batch)
        self.student.backward(nonfinite.poison_if_not_finite(loss.total))  # NaN/inf: DeepSpeed skips the step
        self.student.step()
        return loss

    # ---- the loop (training/loop.py: Trainer): this one model, unnamed ---------------------------------------

    def engines(self) -> dict[str, Any]:
        """The student, with the empty name: records read ``loss``, ``<part>``, ``lr`` (see ``training/loop.py``)."""
        return {"": self.student}

    def micro_batch(self, batch: Batch) -> dict[str, LossOutput]:
        return {"": self.training_step(batch)}

    # ---- evaluation --------------------------------------------------------------------------------------

    def evaluate(self, batches: Iterable[Batch], max_batches: int | None = None) -> dict[str, dict[str, float]]:
        """Held-out perplexity of student and teacher, top-1 agreement and mean KL, over all ranks."""
        self.student.eval()
        try:
            return evaluation.evaluate_students({"student": self.student_forward}, self.teacher_forward, batches,
                                                self.device, max_batches)
        finally:
            self.student.train()

    # ---- plumbing ----------------------------------------------------------------------------------------

    @property
    def student_model(self) -> nn.Module:
        """The bare student (no engine, no loss parameters), e.g. for export."""
        return self.student.module.student


def check_vocabularies(student: nn.Module, teacher: nn.Module) -> None:
    """A teacher vocabulary padded past the student's is cut by the losses; a larger student one is an error."""
    student_vocab = getattr(getattr(student, "config", None), "vocab_size", None)
    teacher_vocab = getattr(getattr(teacher, "config", None), "vocab_size", None)
    if student_vocab and teacher_vocab and student_vocab > teacher_vocab:
        raise ValueError(
            f"the student's vocabulary ({student_vocab}) is larger than the teacher's ({teacher_vocab}): they "
            "cannot share a tokenizer. Build the student with the teacher's tokenizer and vocab_size, or, to distil "
            "across tokenizers, use loss cross_tokenizer with paired blocks and Distiller(..., vocab_map=VocabMap."
            "build(student_tokenizer, teacher_tokenizer)) (a run config: students[].tokenizer)."
        )

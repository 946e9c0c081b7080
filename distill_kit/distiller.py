"""The Distiller: a frozen ZeRO-3 teacher teaching a ZeRO-2 student, one step at a time.

Each hook does one thing and can be overridden alone by research code::

    teacher_out = self.teacher_forward(batch)      # no_grad, ZeRO-3 shards gathered layer by layer
    student_out = self.student_forward(batch)      # ZeRO-2 engine
    loss = self.compute_loss(student_out, teacher_out, batch)
    self.student.backward(loss.total); self.student.step()
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from tqdm.auto import tqdm

from distill_kit import deepspeed_config, distributed, engines, evaluation, models
from distill_kit.config import TrainingConfig
from distill_kit.models import ModelSource
from losses import DistillationLoss, LossOutput, build_loss
from losses.base import valid_positions

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
Batch = dict[str, torch.Tensor]


class Distiller:
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
    ):
        """``shared_teacher`` is a teacher engine already built from ``teacher`` and ``teacher_ds_config``
        (several students share one, see ``multi_student.py``): nothing is loaded for it again."""
        self.training = training or TrainingConfig()
        self.device = distributed.init()
        transformers.set_seed(self.training.seed)
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
            **{f"teacher_{k}": v for k, v in teacher_facts.items()},
        )
        # The teacher loads first: it is the large one, and must never exist unsharded next to the student.
        need_attentions = self.loss.needs_attentions
        teacher_model = (models.load(teacher, self.teacher_ds_config, self.training.dtype, need_attentions)
                         if shared_teacher is None else getattr(shared_teacher, "module", shared_teacher))
        student_model = models.load(student, self.student_ds_config, self.training.dtype, need_attentions)
        check_vocabularies(student_model, teacher_model)
        self.teacher = (engines.build_teacher(teacher_model, self.teacher_ds_config, self.training.dtype, self.device)
                        if shared_teacher is None else shared_teacher)
        self.student = engines.build_student(student_model, self.loss, self.student_ds_config)
        self.step = 0

    # ---- the hooks -------------------------------------------------------------------------------------

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """What both models are called with: no labels (the loss modules own every loss), and hidden
        states or attentions only when a loss asks for them."""
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": batch.get("attention_mask"),
            "output_hidden_states": self.loss.needs_hidden_states,
            "output_attentions": self.loss.needs_attentions,
        }

    def teacher_forward(self, batch: Batch) -> Any:
        with torch.no_grad():
            return self.teacher(**self.model_inputs(batch))

    def student_forward(self, batch: Batch) -> Any:
        return self.student(**self.model_inputs(batch))

    def compute_loss(self, student_out: Any, teacher_out: Any, batch: Batch) -> LossOutput:
        return self.loss(student_out, teacher_out, batch)

    def training_step(self, batch: Batch) -> LossOutput:
        """One micro-batch: forwards, loss, backward; the engine steps the optimizer at the boundary."""
        teacher_out = self.teacher_forward(batch)
        return self.student_step(batch, teacher_out)

    def student_step(self, batch: Batch, teacher_out: Any) -> LossOutput:
        """The student's half of a micro-batch, given the teacher's outputs (which several students may share)."""
        student_out = self.student_forward(batch)
        loss = self.compute_loss(student_out, teacher_out, batch)
        self.check_finite(loss)
        self.student.backward(loss.total)
        self.student.step()
        return loss

    # ---- the loop --------------------------------------------------------------------------------------

    def train(self, batches: Iterable[Batch], until: int | None = None) -> list[dict[str, float]]:
        """Run until optimizer step ``until`` (default ``training.max_steps``); one log record per step.

        ``batches`` yields this rank's micro-batches. Every rank must yield the same number (the ZeRO-3
        teacher's forward is a collective); a re-iterable (a DataLoader) is read again for more epochs.
        Calling again with a later ``until`` continues where the last call stopped (evaluate in between).
        """
        until = self.training.max_steps if until is None else min(until, self.training.max_steps)
        self.student.train()
        history = []
        micro_batches = self._cycle(batches)
        progress = tqdm(total=until, initial=self.step, desc="distilling",
                        disable=not distributed.is_main(), dynamic_ncols=True)
        while self.step < until:
            step_batches = [self._to_device(next(micro_batches))
                            for _ in range(self.training.gradient_accumulation_steps)]
            normalizer = self.loss_normalizer(step_batches)
            parts: dict[str, torch.Tensor] = {}
            for batch in step_batches:
                loss = self.training_step({**batch, "loss_normalizer": normalizer})
                for name, value in {"loss": loss.total.detach(), **loss.parts}.items():
                    parts[name] = parts.get(name, 0.0) + value.float() / len(step_batches)
            self.step += 1
            record = {"step": self.step, "lr": self.student.get_lr()[0]} | {
                name: (distributed.all_reduce_sum(value) / distributed.world_size()).item()
                for name, value in parts.items()
            }
            history.append(record)
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.4f}")
            if self.step % self.training.log_every == 0 and distributed.is_main():
                logger.info("step %d: %s", self.step, record)
        progress.close()
        return history

    def loss_normalizer(self, step_batches: list[Batch]) -> torch.Tensor:
        """Valid tokens of the whole step (all micro-batches, all ranks) per micro-batch per rank.

        DeepSpeed averages gradients over micro-batches and ranks; dividing each micro-batch's token sum
        by this makes the result the exact per-token mean over the step, so neither micro-batch size nor
        accumulation changes the loss (see ``losses/base.py``).
        """
        local = sum(valid_positions(batch).sum() for batch in step_batches)
        total = distributed.all_reduce_sum(torch.as_tensor(local, device=self.device, dtype=torch.float32))
        return total.clamp(min=1) / (len(step_batches) * distributed.world_size())

    def check_finite(self, loss: LossOutput) -> None:
        """Stop every rank together on a NaN/inf loss, before it reaches the weights."""
        bad = torch.tensor(float(not torch.isfinite(loss.total.detach()).all()), device=self.device)
        if distributed.all_reduce_sum(bad).item() > 0:
            parts = {name: float(value) for name, value in loss.parts.items()}
            raise FloatingPointError(
                f"non-finite loss at step {self.step + 1} on at least one rank (this rank's parts: {parts}). "
                "Lower the learning rate, check the data for empty sequences, or use bf16 instead of fp16."
            )

    # ---- evaluation and saving -----------------------------------------------------------------------

    def evaluate(self, batches: Iterable[Batch], max_batches: int | None = None) -> dict[str, dict[str, float]]:
        """Held-out perplexity of student and teacher, top-1 agreement and mean KL, over all ranks."""
        self.student.eval()
        try:
            return evaluation.evaluate_students({"student": self.student_forward}, self.teacher_forward, batches,
                                                self.device, max_batches)
        finally:
            self.student.train()

    def save(self, directory: str | Path) -> None:
        """A resumable DeepSpeed checkpoint of the student (weights, optimizer, scheduler, loss params)."""
        self.student.save_checkpoint(str(directory), client_state={"step": self.step})

    def load(self, directory: str | Path) -> None:
        _, client_state = self.student.load_checkpoint(str(directory))
        if client_state is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {str(directory)!r}")
        self.step = client_state["step"]

    # ---- plumbing ------------------------------------------------------------------------------------

    @property
    def student_model(self) -> nn.Module:
        """The bare student (no engine, no loss parameters), e.g. for export."""
        return self.student.module.student

    def _to_device(self, batch: Mapping[str, Any]) -> Batch:
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    @staticmethod
    def _cycle(batches: Iterable[Batch]) -> Iterator[Batch]:
        while True:
            iterator = iter(batches)
            first = next(iterator, None)
            if first is None:
                raise ValueError("the training data yielded no batches on this rank")
            yield first
            yield from iterator
            if iterator is batches:
                raise ValueError("the training data ran out before max_steps; pass a re-iterable such as a DataLoader")


def check_vocabularies(student: nn.Module, teacher: nn.Module) -> None:
    """A teacher vocabulary padded past the student's is cut by the losses; a larger student one is an error."""
    student_vocab = getattr(getattr(student, "config", None), "vocab_size", None)
    teacher_vocab = getattr(getattr(teacher, "config", None), "vocab_size", None)
    if student_vocab and teacher_vocab and student_vocab > teacher_vocab:
        raise ValueError(
            f"the student's vocabulary ({student_vocab}) is larger than the teacher's ({teacher_vocab}): they "
            "cannot share a tokenizer. Build the student with the teacher's tokenizer and vocab_size."
        )

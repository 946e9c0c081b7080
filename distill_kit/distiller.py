"""The Distiller: a frozen ZeRO-3 teacher teaching a ZeRO-2 student, one step at a time.

Each hook does one thing and can be overridden alone by research code::

    teacher_out = self.teacher_forward(batch)      # no_grad, ZeRO-3 shards gathered layer by layer
    student_out = self.student_forward(batch)      # ZeRO-2 engine
    loss = self.compute_loss(student_out, teacher_out, batch)
    self.student.backward(loss.total); self.student.step()
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from tqdm.auto import tqdm

from distill_kit import checkpoint, deepspeed_config, distributed, engines, evaluation, models, nonfinite, preemption
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
        # What a checkpoint keeps beyond the engine (see checkpoint.py), and how the loop stops.
        self.history: list[dict[str, float]] = []  # every step's record; restored on resume, so the logs continue
        self.micro_batches_seen = 0  # this rank's position in data that keeps none of its own
        self.nonfinite = nonfinite.NonFiniteSteps(self.training.max_bad_steps,
                                                  loss_scaling=self.training.dtype == "fp16")
        self.stopped_by: str | None = None  # the signal that ended the last train() early, if one did
        self._teacher_sha256: str | None = None
        self._data: tuple[Iterable[Batch], Iterator[Batch]] | None = None  # the data train() reads, and where
        self._resumed_position: dict[str, Any] | None = None  # a checkpoint's data position, for the next train()
        self._saved_at: tuple[int, int] | None = None

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
        self.student.backward(nonfinite.poison_if_not_finite(loss.total))  # NaN/inf: DeepSpeed skips the step
        self.student.step()
        return loss

    # ---- the loop --------------------------------------------------------------------------------------

    def train(self, batches: Iterable[Batch], until: int | None = None) -> list[dict[str, float]]:
        """Run until optimizer step ``until`` (default ``training.max_steps``); one log record per step.

        ``batches`` yields this rank's micro-batches. Every rank must yield the same number (the ZeRO-3
        teacher's forward is a collective); a re-iterable (a DataLoader) is read again for more epochs.
        Calling again with a later ``until`` continues where the last call stopped (evaluate in between).

        Reliability (see ``checkpoint.py``, ``nonfinite.py``, ``preemption.py``): a checkpoint goes to
        ``training.checkpoint_dir`` every ``training.save_every`` steps, after the last step, and when SIGTERM or
        SIGINT reaches any rank: the step is finished, every rank saves and returns, and ``stopped_by`` names the
        signal. A step with a NaN/inf loss or gradient is skipped on every rank (``skipped_steps`` in the records).
        """
        until = self.training.max_steps if until is None else min(until, self.training.max_steps)
        self.student.train()
        self.stopped_by = None
        first = len(self.history)
        micro_batches = self._micro_batches(batches)
        progress = tqdm(total=until, initial=self.step, desc="distilling",
                        disable=not distributed.is_main(), dynamic_ncols=True)
        with preemption.StopRequest(self.device) as stop:
            while self.step < until:
                step_batches = [self._to_device(next(micro_batches))
                                for _ in range(self.training.gradient_accumulation_steps)]
                self.micro_batches_seen += len(step_batches)
                normalizer = self.loss_normalizer(step_batches)
                parts: dict[str, torch.Tensor] = {}
                for batch in step_batches:
                    loss = self.training_step({**batch, "loss_normalizer": normalizer})
                    for name, value in {"loss": loss.total.detach(), **loss.parts}.items():
                        parts[name] = parts.get(name, 0.0) + value.float() / len(step_batches)
                record = {"lr": self.student.get_lr()[0]} | {
                    name: (distributed.all_reduce_sum(value) / distributed.world_size()).item()
                    for name, value in parts.items()
                }
                if self.nonfinite.counts(self.step + 1, record, self.student.was_step_applied()):
                    self.step += 1
                    record = {"step": self.step} | record | {"skipped_steps": self.nonfinite.skipped}
                    self.history.append(record)
                    progress.update(1)
                    progress.set_postfix(loss=f"{record['loss']:.4f}")
                    if self.step % self.training.log_every == 0 and distributed.is_main():
                        logger.info("step %d: %s", self.step, record)
                    if self.training.save_every and self.step % self.training.save_every == 0:
                        self._save_if_configured()
                if stop.agreed():
                    self.stopped_by = stop.received or "a signal on another rank"
                    break
        progress.close()
        if self.stopped_by or self.step == self.training.max_steps:
            self._save_if_configured()
        return self.history[first:]

    def loss_normalizer(self, step_batches: list[Batch]) -> torch.Tensor:
        """Valid tokens of the whole step (all micro-batches, all ranks) per micro-batch per rank.

        DeepSpeed averages gradients over micro-batches and ranks; dividing each micro-batch's token sum
        by this makes the result the exact per-token mean over the step, so neither micro-batch size nor
        accumulation changes the loss (see ``losses/base.py``).
        """
        local = sum(valid_positions(batch).sum() for batch in step_batches)
        total = distributed.all_reduce_sum(torch.as_tensor(local, device=self.device, dtype=torch.float32))
        return total.clamp(min=1) / (len(step_batches) * distributed.world_size())

    # ---- evaluation and saving -----------------------------------------------------------------------

    def evaluate(self, batches: Iterable[Batch], max_batches: int | None = None) -> dict[str, dict[str, float]]:
        """Held-out perplexity of student and teacher, top-1 agreement and mean KL, over all ranks."""
        self.student.eval()
        try:
            return evaluation.evaluate_students({"student": self.student_forward}, self.teacher_forward, batches,
                                                self.device, max_batches)
        finally:
            self.student.train()

    def save(self, directory: str | Path | None = None) -> Path:
        """Checkpoint everything needed to continue exactly into ``<directory>/step_<step>``, atomically.

        ``directory`` defaults to ``training.checkpoint_dir``. Every rank calls it (the engine's save is a
        collective). Saving changes nothing that follows: each rank's random generators are put back after it.
        """
        directory = directory if directory is not None else self.training.checkpoint_dir
        if directory is None:
            raise ValueError("no checkpoint directory: pass one to save(), or set training.checkpoint_dir")
        rng = checkpoint.capture_rng()
        loader = self._data[0] if self._data is not None else None
        path = checkpoint.save(
            directory, self.student, step=self.step,
            trainer_state={"step": self.step, "history": self.history, "nonfinite": self.nonfinite.state_dict()},
            rank_state={"rng": rng, "micro_batches_seen": self.micro_batches_seen,
                        "loader": loader.state_dict() if hasattr(loader, "state_dict") else None},
            teacher_sha256=self.teacher_sha256, keep_last=self.training.keep_checkpoints,
        )
        checkpoint.restore_rng(rng)
        self._saved_at = (self.step, self.micro_batches_seen)
        return path

    def load(self, path: str | Path) -> None:
        """Continue from a checkpoint: engine, step, history, counters, this rank's random generators, and its
        data position (applied to the data the next ``train()`` is given).

        ``path`` is one checkpoint (a ``step_N`` folder) or a directory ``save()`` wrote them to (its latest
        complete one is loaded). A checkpoint that does not match its manifest is refused.
        """
        path = Path(path)
        reason = None
        if distributed.is_main():
            if (path / checkpoint.MANIFEST).is_file():
                reason = checkpoint.verify(path)
            else:
                found = checkpoint.latest_complete(path)
                path, reason = (found, None) if found is not None else (path, "it holds no complete checkpoint")
        path, reason = distributed.broadcast_object((path, reason))
        if reason is not None:
            raise ValueError(f"cannot load checkpoint {path}: {reason}")
        self._load(path)

    def resume(self, directory: str | Path | None = None) -> Path | None:
        """Load the latest complete checkpoint under ``directory`` (default ``training.checkpoint_dir``).

        Returns its path, or None when there is none yet (a fresh start). Incomplete or corrupt checkpoints are
        skipped with a warning; rank 0 chooses, so every rank loads the same one.
        """
        directory = directory if directory is not None else self.training.checkpoint_dir
        if directory is None:
            raise ValueError("nothing to resume from: pass a directory to resume(), or set training.checkpoint_dir")
        found = checkpoint.latest_complete(directory) if distributed.is_main() else None
        found = distributed.broadcast_object(found)
        if found is not None:
            self._load(found)
        return found

    @property
    def teacher_sha256(self) -> str:
        """The teacher's identity stored with each checkpoint; computed once (on every rank: it gathers)."""
        if self._teacher_sha256 is None:
            self._teacher_sha256 = checkpoint.teacher_fingerprint(self.teacher)
        return self._teacher_sha256

    def _load(self, path: Path) -> None:
        trainer_state, rank_state = checkpoint.load(path, self.student, teacher_sha256=self.teacher_sha256)
        self.step, self.history = trainer_state["step"], trainer_state["history"]
        self.nonfinite.load_state_dict(trainer_state["nonfinite"])
        self.micro_batches_seen = rank_state["micro_batches_seen"]
        self._resumed_position = {"micro_batches_seen": self.micro_batches_seen, "loader": rank_state["loader"]}
        self._data = None
        checkpoint.restore_rng(rank_state["rng"])
        self._saved_at = (self.step, self.micro_batches_seen)
        if distributed.is_main():
            logger.info("resumed from %s at step %d", path, self.step)

    def _save_if_configured(self) -> None:
        if self.training.checkpoint_dir is not None and self._saved_at != (self.step, self.micro_batches_seen):
            self.save()

    # ---- plumbing ------------------------------------------------------------------------------------

    @property
    def student_model(self) -> nn.Module:
        """The bare student (no engine, no loss parameters), e.g. for export."""
        return self.student.module.student

    def _to_device(self, batch: Mapping[str, Any]) -> Batch:
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _micro_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """This rank's micro-batches: the same data as the last call continues its stream; other data is read
        from where it stands, except right after a resume, when it is put at the checkpoint's position: a loader
        with ``load_state_dict`` (``data.BlockLoader``) is given its saved state, and any other re-iterable is
        read past the micro-batches the run had used, so a list given whole resumes exactly too.
        """
        if self._data is not None and self._data[0] is batches:
            return self._data[1]
        position, self._resumed_position = self._resumed_position, None
        stream = self._cycle(batches)
        if position is not None and position["loader"] is not None and hasattr(batches, "load_state_dict"):
            batches.load_state_dict(position["loader"])
        elif position is not None:
            stream = itertools.islice(stream, position["micro_batches_seen"], None)
        self._data = (batches, stream)
        return stream

    @staticmethod
    def _cycle(batches: Iterable[Batch]) -> Iterator[Batch]:
        """Epoch after epoch. A loader resumed at the very end of an epoch yields nothing once; two empty
        passes in a row mean there is no data."""
        empty_before = False
        while True:
            iterator = iter(batches)
            first = next(iterator, None)
            if first is None:
                if empty_before or iterator is batches:
                    raise ValueError("the training data yielded no batches on this rank")
                empty_before = True
                continue
            empty_before = False
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

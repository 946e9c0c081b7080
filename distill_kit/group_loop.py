"""The training loop of several models that step together on the same micro-batches.

Used by :class:`~distill_kit.multi_student.MultiStudentDistiller` (students of one teacher) and
:class:`~distill_kit.side_by_side.SideBySide` (models without a teacher). A group supplies its
``training_step`` (one micro-batch for every model, returning each model's loss); the loop around it
(accumulation, the step's token normaliser, one log record per optimizer step) is the same for both, and
follows the single-student :meth:`Distiller.train <distill_kit.distiller.Distiller.train>`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from distill_kit import distributed
from distill_kit.config import TrainingConfig
from distill_kit.distiller import Batch, Distiller
from losses import LossOutput
from losses.base import valid_positions

logger = logging.getLogger(__name__)


class Group(Protocol):
    """What the loop needs from a group of models."""

    training: TrainingConfig
    device: torch.device
    step: int
    """Optimizer steps taken; the same for every model of the group."""
    data: tuple[Iterable[Batch], Iterator[Batch]] | None
    """The data the last ``train`` read, and where it stands (None before the first)."""

    def engines(self) -> Mapping[str, Any]:
        """Each model's DeepSpeed engine by name."""

    def training_step(self, batch: Batch) -> Mapping[str, LossOutput]:
        """One micro-batch for every model: forwards, losses, backwards and engine steps."""


def train_group(group: Group, batches: Iterable[Batch], until: int | None = None) -> list[dict[str, float]]:
    """Step every model of ``group`` to optimizer step ``until`` (default ``training.max_steps``).

    Returns one record per step: ``step``, and per model ``<name>/loss``, ``<name>/<part>`` and
    ``<name>/lr``, each part the mean over the step's micro-batches and all ranks. Called again with the
    same ``batches`` (training in stretches, evaluating in between), it reads on where it stopped.
    """
    training = group.training
    until = training.max_steps if until is None else min(until, training.max_steps)
    for engine in group.engines().values():
        engine.train()
    history = []
    if group.data is None or group.data[0] is not batches:
        group.data = (batches, Distiller._cycle(batches))
    micro_batches = group.data[1]
    progress = tqdm(total=until, initial=group.step, desc="training together",
                    disable=not distributed.is_main(), dynamic_ncols=True)
    while group.step < until:
        step_batches = [{k: v.to(group.device) if torch.is_tensor(v) else v for k, v in next(micro_batches).items()}
                        for _ in range(training.gradient_accumulation_steps)]
        normalizer = step_normalizer(step_batches, group.device)
        parts: dict[str, torch.Tensor] = {}
        for batch in step_batches:
            for name, loss in group.training_step({**batch, "loss_normalizer": normalizer}).items():
                for part, value in {"loss": loss.total.detach(), **loss.parts}.items():
                    key = f"{name}/{part}"
                    parts[key] = parts.get(key, 0.0) + value.float() / len(step_batches)
        group.step += 1
        means = distributed.all_reduce_sum(torch.stack(list(parts.values()))) / distributed.world_size()
        record = {"step": group.step} | dict(zip(parts, means.tolist(), strict=True)) | {
            f"{name}/lr": engine.get_lr()[0] for name, engine in group.engines().items()
        }
        history.append(record)
        progress.update(1)
        if group.step % training.log_every == 0 and distributed.is_main():
            logger.info("step %d: %s", group.step, record)
    progress.close()
    return history


def step_normalizer(step_batches: list[Batch], device: torch.device) -> torch.Tensor:
    """Valid tokens of the whole step (all micro-batches, all ranks) per micro-batch per rank.

    Every model divides its token sums by it, as in :meth:`Distiller.loss_normalizer`, so each model's
    loss is the per-token mean of the step whatever the micro-batch size or accumulation.
    """
    local = sum(valid_positions(batch).sum() for batch in step_batches)
    total = distributed.all_reduce_sum(torch.as_tensor(local, device=device, dtype=torch.float32))
    return total.clamp(min=1) / (len(step_batches) * distributed.world_size())


def check_finite(losses: Mapping[str, LossOutput], step: int, device: torch.device) -> None:
    """Stop every rank together on a NaN/inf loss of any model, naming the models.

    A group stops rather than skipping the step as the single-student loop does: its models would
    otherwise disagree about which steps they took.
    """
    bad = torch.tensor([float(not torch.isfinite(loss.total.detach()).all()) for loss in losses.values()],
                       device=device)
    bad = distributed.all_reduce_sum(bad)
    if bad.sum().item() > 0:
        names = [name for name, count in zip(losses, bad.tolist(), strict=True) if count > 0]
        raise FloatingPointError(
            f"non-finite loss of {names} at step {step + 1} on at least one rank. Lower that model's lr, check "
            "the data for empty sequences, or use bf16 instead of fp16."
        )

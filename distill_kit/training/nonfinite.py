"""Non-finite steps: skipped on every rank together, and fatal after too many in a row.

A NaN or inf loss (or gradient) must never reach the weights, and every rank must take the same decision, or
the ranks' replicas drift apart. DeepSpeed's ZeRO optimizers already make that decision: at the optimizer step
they all-reduce whether any gradient is non-finite and, if so, discard the step on every rank (zero the
gradients, leave optimizer and scheduler untouched; the same mechanism fp16 loss scaling uses). Two things are
added here: a non-finite *loss* is turned into non-finite gradients (:func:`poison_if_not_finite`), so it always
trips that check even where its gradient alone would be finite; and :class:`NonFiniteSteps` counts the skipped
steps for the logs and stops the run at the ``stop_after``-th in a row, naming the step and the loss parts that
went bad. A skipped step is not a step: the step counter (and so the learning-rate schedule, which DeepSpeed
does not advance either) stays where it was, while the data moves on past the bad batch. A student engine with
no such check (no ZeRO, in fp32) takes the step anyway; that stops the run at once. Several models stepping
together (a group) skip a step only when every model's engine discarded it (:meth:`NonFiniteSteps.all_or_none`);
when some took it and some did not, their steps no longer line up, and the run stops naming them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


def poison_if_not_finite(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` unchanged (times exactly 1), or, if it is NaN/inf, a loss whose every gradient is NaN.

    No host synchronisation: the choice is a tensor operation, and the gradient check DeepSpeed runs at the
    optimizer step is where all ranks learn of it.
    """
    factor = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
    return loss * factor


class NonFiniteError(FloatingPointError):
    """Too many consecutive non-finite steps; the last complete checkpoint was written before them."""


@dataclass
class NonFiniteSteps:
    """Decides, once per optimizer step and identically on every rank, whether the step counts."""

    stop_after: int
    """The bad step that makes this many in a row raises :class:`NonFiniteError` instead of being skipped."""
    loss_scaling: bool = False
    """fp16: a step discarded with a finite loss is the loss scaler's routine overflow, not a fault."""
    skipped: int = 0
    """Bad steps skipped so far in the run (logged with every step)."""
    consecutive: int = 0

    def counts(self, step: int, record: Mapping[str, float], applied: bool) -> bool:
        """True when optimizer step ``step`` was good; ``record`` holds the all-reduced loss parts.

        ``applied`` is the engine's ``was_step_applied()``, which DeepSpeed agrees on across ranks.
        """
        bad_parts = sorted(name for name, value in record.items() if not math.isfinite(value))
        if applied and not bad_parts:
            self.consecutive = 0
            return True
        if not bad_parts and self.loss_scaling:
            logger.info("step %d: fp16 loss scale overflow, step skipped and the scale lowered", step)
            return False
        what = (f"non-finite {', '.join(bad_parts)} on at least one rank" if bad_parts
                else "a non-finite gradient with a finite loss")
        if applied:  # an optimizer without an overflow check (no ZeRO, fp32) took the step: the weights are spoilt
            raise NonFiniteError(
                f"step {step}: {what}, and the optimizer step was taken anyway: this student engine cannot discard "
                "steps. Use a ZeRO student config (zero_optimization.stage 1-3) to skip such steps, and resume "
                "from the last complete checkpoint, which is intact."
            )
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.stop_after:
            raise NonFiniteError(
                f"step {step}: {what}; {self.consecutive} bad steps in a row (training.max_bad_steps="
                f"{self.stop_after}). The weights were not updated by these steps and the last complete "
                "checkpoint is intact: resume from it with a lower learning rate or gradient clipping, check the "
                "data for empty sequences, or use bf16 instead of fp16."
            )
        logger.warning("step %d: %s; step skipped on every rank (%d skipped so far)", step, what, self.skipped)
        return False

    def all_or_none(self, step: int, applied: Mapping[str, bool], record: Mapping[str, float]) -> bool:
        """Whether the models of a group took optimizer step ``step`` (``applied``: each engine's
        ``was_step_applied()``); ``record`` holds the step's all-reduced loss parts, keyed ``<name>/<part>``.

        Models that disagree (some discarded a non-finite step, some took it) raise :class:`NonFiniteError` naming
        them: skipping the step would lose the takers' update, keeping it would leave the others a step behind.
        With fp16 loss scaling, models that discarded the step with finite losses only overflowed their loss
        scale: the step counts, and they (as DeepSpeed does for any fp16 run) lose that one update.
        """
        if len(set(applied.values())) <= 1:
            return all(applied.values())
        took = sorted(name for name, ok in applied.items() if ok)
        dropped = sorted(name for name, ok in applied.items() if not ok)
        bad = sorted(key for key, value in record.items() if not math.isfinite(value))
        if self.loss_scaling and not any(key.split("/")[0] in dropped for key in bad):
            logger.info("step %d: fp16 loss scale overflow of %s: their update skipped, scale lowered", step, dropped)
            return True
        why = f"non-finite {', '.join(bad)} on at least one rank" if bad else "a non-finite gradient with a finite loss"
        raise NonFiniteError(
            f"step {step}: models {dropped} discarded their optimizer step ({why}) while {took} took theirs, so the "
            "models' steps no longer line up. The last complete checkpoint is intact: resume from it with a lower "
            f"learning rate or gradient clipping for {dropped}, check the data for empty sequences, or use bf16 "
            "instead of fp16."
        )

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.skipped, self.consecutive = int(state["skipped"]), int(state["consecutive"])

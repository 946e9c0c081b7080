"""The learning-rate schedule: the lr every optimizer step uses, written once, run by the engines.

DeepSpeed's own schedulers start one step late for this purpose (they begin at their minimum and move
after each step, and lift a warm-up below 2 steps to 2), so a student engine runs this schedule instead, as
a ``torch.optim.lr_scheduler.LambdaLR`` handed to ``deepspeed.initialize``. With ``T = max_steps``,
``w = max(1, warmup_steps)`` and ``lr`` the peak, optimizer step ``k`` (1-based) uses

* warm-up, ``k <= w``: ``lr * k / w`` -- a linear rise that reaches ``lr`` at step ``w``; no step trains at
  lr 0, and ``warmup_steps`` 0 (or 1) is the full lr at step 1;
* after it, with ``q = (k - w) / (T + 1 - w)`` the fraction of the decay done (0 < q < 1):
  ``linear``: ``lr * (m + (1 - m) * (1 - q))``; ``cosine``: ``lr * (m + (1 - m) * (1 + cos(pi q)) / 2)``;
  ``constant``: ``lr``; where ``m = min_lr_ratio``. The decay reaches ``m * lr`` (0 by default) just after
  the last step: with ``T = 5, w = 2`` the linear schedule is ``lr * [1/2, 1, 3/4, 1/2, 1/4]``.

A warm-up longer than the run (``warmup_steps >= max_steps``, e.g. a short trial run) is only a rise.
A step skipped as non-finite does not advance the schedule (DeepSpeed does not step the scheduler then).
"""

from __future__ import annotations

import math

import torch

from distill_kit.config import TrainingConfig


def lr_factor(step: int, training: TrainingConfig) -> float:
    """The fraction of ``training.lr`` that optimizer step ``step`` (1-based) uses."""
    total, warmup = training.max_steps, max(1, training.warmup_steps)
    if step <= warmup:
        return step / warmup
    if training.lr_schedule == "constant":
        return 1.0
    done = min(1.0, (step - warmup) / (total + 1 - warmup))
    remaining = 1.0 - done if training.lr_schedule == "linear" else (1.0 + math.cos(math.pi * done)) / 2
    return training.min_lr_ratio + (1.0 - training.min_lr_ratio) * remaining


def scheduler(optimizer: torch.optim.Optimizer, training: TrainingConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule on ``optimizer``, whose lr is the peak. LambdaLR calls the function with the number of steps
    taken so far, so the lr it sets is the next step's: ``lr_factor(taken + 1)``.

    The function is a closure, not an object, so the scheduler's state (saved in checkpoints) holds only numbers.
    """

    def factor(taken: int) -> float:
        return lr_factor(taken + 1, training)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resync(engine: object) -> None:
    """Put the engine's lr at its schedule's value for the next step, from the count of steps taken.

    After a checkpoint load the count is the checkpoint's while the lr is whatever the optimizer state held; a
    resumed run with a new ``max_steps`` (or a DeepSpeed layout that does not save the lr) would otherwise take its
    first step at a stale lr. In every other case this sets the value already there.
    """
    scheduler = getattr(engine, "lr_scheduler", None)
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                        strict=True):
            group["lr"] = base * factor(scheduler.last_epoch)

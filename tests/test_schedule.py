"""The learning-rate schedule against values written out by hand (engines/schedule.py documents them)."""

from __future__ import annotations

import pytest
import torch

from distill_kit import TrainingConfig
from distill_kit.engines.schedule import lr_factor, resync, scheduler


@pytest.mark.parametrize("settings, factors", [
    # warm-up 0 and 1: full lr at step 1; the linear decay reaches 0 just after the last step
    (dict(max_steps=4, warmup_steps=0), [1.0, 0.75, 0.5, 0.25]),
    (dict(max_steps=4, warmup_steps=1), [1.0, 0.75, 0.5, 0.25]),
    (dict(max_steps=5, warmup_steps=2), [0.5, 1.0, 0.75, 0.5, 0.25]),
    (dict(max_steps=3, warmup_steps=3), [1 / 3, 2 / 3, 1.0]),
    (dict(max_steps=2, warmup_steps=4), [0.25, 0.5]),  # a warm-up longer than the run only rises
    (dict(max_steps=4, warmup_steps=2, min_lr_ratio=0.4), [0.5, 1.0, 0.8, 0.6]),
    (dict(max_steps=4, warmup_steps=2, lr_schedule="constant"), [0.5, 1.0, 1.0, 1.0]),
    # cosine to 10%: 0.1 + 0.9 * (1 + cos(pi * q)) / 2 at q = 1/3, 2/3
    (dict(max_steps=4, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1), [0.5, 1.0, 0.775, 0.325]),
    (dict(max_steps=3, warmup_steps=0, lr_schedule="cosine"), [1.0, 0.75, 0.25]),  # q = 1/3, 2/3, to 0
])
def test_every_step_uses_the_documented_lr(settings, factors):
    training = TrainingConfig(lr=2.0, **settings)
    assert [lr_factor(k, training) for k in range(1, training.max_steps + 1)] == pytest.approx(factors, abs=1e-12)
    # The LambdaLR the engines run: before step k the optimizer holds step k's lr.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=training.lr)
    lrs = scheduler(optimizer, training)
    applied = []
    for _ in range(training.max_steps):
        applied.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        lrs.step()
    assert applied == pytest.approx([2.0 * f for f in factors], abs=1e-12)


def test_schedule_settings_out_of_range_are_named():
    with pytest.raises(ValueError, match="lr_schedule='step'"):
        TrainingConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="min_lr_ratio=1.5"):
        TrainingConfig(min_lr_ratio=1.5)


def test_a_resumed_run_with_more_steps_takes_its_next_step_at_the_new_schedules_lr():
    """Saved after 2 of 4 steps (warm-up 0, linear), resumed with max_steps 8: step 3 uses lr * 6/8, not 2/4."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    first = scheduler(optimizer, TrainingConfig(lr=1.0, max_steps=4))
    for _ in range(2):
        optimizer.step()
        first.step()
    saved_optimizer, saved_scheduler = optimizer.state_dict(), first.state_dict()
    assert saved_optimizer["param_groups"][0]["lr"] == 0.5  # the old schedule's step 3

    optimizer = torch.optim.SGD([parameter], lr=1.0)
    engine = type("Engine", (), {"lr_scheduler": scheduler(optimizer, TrainingConfig(lr=1.0, max_steps=8))})()
    optimizer.load_state_dict(saved_optimizer)
    engine.lr_scheduler.load_state_dict(saved_scheduler)
    resync(engine)
    assert optimizer.param_groups[0]["lr"] == 0.75

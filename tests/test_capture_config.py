"""Offline capture fills its teacher's DeepSpeed config with the plan's code: the plan's config, the plan's refusal.

No engine is built: ``offline.capture.engine_config`` is what ``capture`` hands its engine, and
``plan.teacher_ds_configs`` what a run hands its teacher's, for the same teacher, config and settings.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distill_kit.config import CONFIG_DIR, StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.errors import ConfigError, DeepSpeedConfigError
from distill_kit.offline.capture import CaptureConfig, engine_config
from distill_kit.training.plan import make_plan

TEACHER = str(Path(__file__).resolve().parents[1] / "distill_kit" / "assets" / "default" / "teacher")
STAGE0 = {"zero_optimization": {"stage": 0}, "fp16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": 99,
          "gradient_clipping": "auto"}
"""A replicated teacher with a batch key of its own (the run's replaces it) and auto values to fill."""


def planned(ds_config, world_size: int, micro_batch_size: int, dtype: str) -> dict:
    """The teacher's DeepSpeed config in the plan of a run of one student and this teacher."""
    plan = make_plan([StudentSpec(name="s", model=TEACHER)], [TeacherSpec(name="t", model=TEACHER,
                                                                          ds_config=ds_config)],
                     training=TrainingConfig(micro_batch_size=micro_batch_size, dtype=dtype), world_size=world_size)
    return plan.teacher_ds_configs["t"]


@pytest.mark.parametrize("ds_config, world_size, micro_batch_size, dtype", [
    (None, 1, 8, "bf16"), (str(CONFIG_DIR / "zero3_teacher.json"), 2, 4, "fp32"), (STAGE0, 3, 2, "fp32")])
def test_capture_fills_its_teachers_config_as_the_plan_does(ds_config, world_size, micro_batch_size, dtype):
    captured = engine_config(TEACHER, CaptureConfig(micro_batch_size=micro_batch_size, dtype=dtype), world_size,
                             ds_config)
    assert captured == planned(ds_config, world_size, micro_batch_size, dtype)
    assert captured["train_micro_batch_size_per_gpu"] == micro_batch_size and "optimizer" not in captured


def test_a_bad_config_is_refused_in_the_plans_words_before_anything_loads():
    bad = {"zero_optimization": {"stage": 5}, "fp16": {"enabled": True}, "zero_optimisation": {}}
    with pytest.raises(ConfigError) as plan_error:
        planned(bad, 1, 4, "fp32")
    with pytest.raises(DeepSpeedConfigError) as capture_error:
        engine_config(TEACHER, CaptureConfig(micro_batch_size=4, dtype="fp32"), 1, bad)
    assert str(capture_error.value) == str(plan_error.value)
    for problem in ("stage is 5", "fp16.enabled is True", "did you mean 'zero_optimization'"):
        assert problem in str(capture_error.value)

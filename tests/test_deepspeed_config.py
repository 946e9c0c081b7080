"""User DeepSpeed configs -> engine configs: loading, "auto" filling, and errors that name the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distill_kit import TrainingConfig
from distill_kit.engines.deepspeed_config import DeepSpeedConfigError, load, prepare_pair

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures"
SEED_DOC = ROOT.parent / "shared/seeds/accelerate-deepspeed-multiple-models.ko.txt"
TRAINING = TrainingConfig(max_steps=50, micro_batch_size=4, gradient_accumulation_steps=2, lr=3e-4,
                          weight_decay=0.1, warmup_steps=5, max_grad_norm=0.7, dtype="bf16")


def pair(student, teacher, training=TRAINING, **kw):
    return prepare_pair(student, teacher, training, student_hidden_size=64, teacher_hidden_size=128,
                        world_size=2, **kw)


@pytest.mark.skipif(not SEED_DOC.exists(), reason="the seed document lives in ../shared")
def test_fixtures_are_the_seed_documents_configs_verbatim():
    text = SEED_DOC.read_text()
    for name in ("seed_zero2_config.json", "seed_zero3_config.json"):
        assert (FIXTURES / name).read_text().strip() in text


def test_seed_configs_load_and_fill_every_auto():
    student, teacher = pair(FIXTURES / "seed_zero2_config.json", FIXTURES / "seed_zero3_config.json",
                            training=TrainingConfig(micro_batch_size=1, lr=3e-4, dtype="bf16", lr_schedule="constant"))
    assert "auto" not in json.dumps(student) + json.dumps(teacher)
    assert student["optimizer"]["params"]["lr"] == 3e-4
    assert "scheduler" not in student  # checked against the run, then run by distill-kit (engines/schedule.py)
    assert student["bf16"]["enabled"] is True and teacher["bf16"]["enabled"] is True
    zero = teacher["zero_optimization"]
    assert zero["reduce_bucket_size"] == 128 * 128  # transformers' rules, from the teacher's hidden size
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 128 * 128)
    assert zero["stage3_param_persistence_threshold"] == 10 * 128


def test_shipped_configs_fill_from_the_run():
    student, teacher = pair(ROOT / "configs/zero2_student.json", ROOT / "configs/zero3_teacher.json")
    assert student["train_micro_batch_size_per_gpu"] == 4 == teacher["train_micro_batch_size_per_gpu"]
    assert student["train_batch_size"] == 4 * 2 * 2
    assert student["gradient_clipping"] == 0.7
    assert student["optimizer"]["params"]["weight_decay"] == 0.1
    assert student["optimizer"]["params"]["betas"] == [0.9, 0.999] and student["optimizer"]["params"]["eps"] == 1e-8
    assert "scheduler" not in student
    assert student["zero_optimization"]["reduce_bucket_size"] == int(5e8)  # DeepSpeed's default below stage 3
    assert "optimizer" not in teacher


def test_teacher_gets_the_students_micro_batch_when_missing():
    _, teacher = pair(ROOT / "configs/zero2_student.json", {"zero_optimization": {"stage": 3}})
    assert teacher["train_micro_batch_size_per_gpu"] == 4


def test_conflicting_micro_batch_is_an_error_naming_the_fix():
    student = load(ROOT / "configs/zero2_student.json") | {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(DeepSpeedConfigError, match=r"train_micro_batch_size_per_gpu is 1 but the run uses 4"):
        pair(student, ROOT / "configs/zero3_teacher.json")


def test_teachers_own_micro_batch_is_replaced_by_the_runs_with_a_notice(caplog):
    """The seed's teacher config says 1; a frozen teacher never uses it, so the run's 4 replaces it."""
    with caplog.at_level("WARNING", logger="distill_kit.engines.deepspeed_config"):
        _, teacher = pair(ROOT / "configs/zero2_student.json", FIXTURES / "seed_zero3_config.json")
    assert teacher["train_micro_batch_size_per_gpu"] == 4
    (notice,) = [r.getMessage() for r in caplog.records]
    assert "train_micro_batch_size_per_gpu 1 replaced by the run's 4" in notice


def test_every_problem_is_reported_at_once():
    student = load(ROOT / "configs/zero2_student.json") | {"zero_optimization.stage3_prefetch_bucket_size": 5e8,
                                                           "gradient_clipings": 1.0}
    teacher = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"},
               "bf16": {"enabled": False}, "mystery": {"x": "auto"}}
    with pytest.raises(DeepSpeedConfigError) as err:
        pair(student, teacher)
    message = str(err.value)
    assert "'zero_optimization.stage3_prefetch_bucket_size' is dotted" in message
    assert "did you mean 'gradient_clipping'?" in message
    assert "unknown key 'mystery'" in message
    assert "cannot fill 'mystery.x: auto'" in message
    assert "teacher DeepSpeed config: bf16.enabled is False but the run's training.dtype is 'bf16'" in message


def test_dotted_overrides_are_written_nested():
    _, teacher = pair(ROOT / "configs/zero2_student.json", ROOT / "configs/zero3_teacher.json",
                      teacher_overrides={"zero_optimization.stage3_prefetch_bucket_size": 5e8})
    assert teacher["zero_optimization"]["stage3_prefetch_bucket_size"] == 5e8
    assert "zero_optimization.stage3_prefetch_bucket_size" not in teacher


def test_student_without_optimizer_is_an_error():
    with pytest.raises(DeepSpeedConfigError, match='no "optimizer" section'):
        pair({"zero_optimization": {"stage": 2}}, ROOT / "configs/zero3_teacher.json")


def test_unreadable_configs_are_clear(tmp_path):
    with pytest.raises(DeepSpeedConfigError, match="does not exist"):
        load(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": {"stage": 3')
    with pytest.raises(DeepSpeedConfigError, match="cannot parse"):
        load(broken)


SHIPPED = load(ROOT / "configs/zero2_student.json")
# A student config that states its schedule, DeepSpeed style (the shipped one leaves it to the run).
WITH_SCHEDULER = SHIPPED | {"scheduler": {"type": "WarmupDecayLR", "params": {
    "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}}


@pytest.mark.parametrize("override, message", [
    ({"optimizer.params.lr": 1e-3}, "optimizer.params.lr is 0.001 but the run's training.lr is 0.0003"),
    ({"optimizer.params.betas": [0.9, 0.999]},
     "optimizer.params.betas is [0.9, 0.999] but the run's training.betas is (0.9, 0.95)"),
    ({"optimizer.params.eps": 1e-6}, "optimizer.params.eps is 1e-06 but the run's training.eps is 1e-08"),
    ({"optimizer.params.weight_decay": 0.0}, "weight_decay is 0.0 but the run's training.weight_decay is 0.1"),
    ({"gradient_clipping": 1.0}, "gradient_clipping is 1.0 but the run's training.max_grad_norm is 0.7"),
    ({"bf16.enabled": False}, "bf16.enabled is False but the run's training.dtype is 'bf16'"),
    ({"fp16.enabled": True}, "bf16 and fp16 are both enabled"),
    ({"scheduler.params.warmup_num_steps": 100}, "warmup_num_steps is 100 but the run's training.warmup_steps is 5"),
    ({"scheduler.params.total_num_steps": 1000}, "total_num_steps is 1000 but the run's training.max_steps is 50"),
    ({"scheduler.params.warmup_max_lr": 1e-3}, "warmup_max_lr is 0.001 but the run's training.lr is 0.0003"),
    ({"scheduler.params.warmup_min_lr": 1e-5}, "warmup_min_lr is 1e-05, but warm-up starts from 0"),
    ({"scheduler.params.warmup_type": "log"}, "warmup_type is 'log'; the warm-up is linear"),
    ({"scheduler.type": "WarmupCosineLR"}, "WarmupCosineLR is a cosine schedule but the run's training.lr_schedule "
                                           "is 'linear'; set training.lr_schedule to 'cosine'"),
    ({"scheduler.type": "OneCycle"}, "is not a schedule distill-kit runs"),
    ({"scheduler.params.cycle_momentum": True}, "scheduler.params.cycle_momentum is not a setting"),
])
def test_explicit_values_that_contradict_the_run_name_both(override, message):
    training = TrainingConfig(max_steps=50, micro_batch_size=4, gradient_accumulation_steps=2, lr=3e-4,
                              betas=(0.9, 0.95), weight_decay=0.1, warmup_steps=5, max_grad_norm=0.7, dtype="bf16")
    pair(WITH_SCHEDULER, ROOT / "configs/zero3_teacher.json", training=training)  # as written, it agrees
    with pytest.raises(DeepSpeedConfigError) as err:
        pair(WITH_SCHEDULER, ROOT / "configs/zero3_teacher.json", training=training, student_overrides=override)
    assert message in str(err.value)


def test_values_a_config_leaves_out_come_from_the_run():
    """The seed's student config has no betas, eps or clipping: the run's fill them, not AdamW's defaults."""
    bare = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}, "zero_optimization": {"stage": 2}}
    training = TrainingConfig(max_steps=50, micro_batch_size=4, gradient_accumulation_steps=2, lr=3e-4,
                              betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, max_grad_norm=0.7)
    student, _ = pair(bare, ROOT / "configs/zero3_teacher.json", training=training)
    assert student["optimizer"]["params"] == {"torch_adam": True, "lr": 3e-4, "weight_decay": 0.1,
                                              "betas": [0.9, 0.95], "eps": 1e-6}
    assert student["gradient_clipping"] == 0.7
    assert student["bf16"] == {"enabled": False} and student["fp16"] == {"enabled": False}


def test_bf16_in_a_config_of_an_fp32_run_is_an_error():
    teacher = load(ROOT / "configs/zero3_teacher.json") | {"bf16": {"enabled": True}}
    with pytest.raises(DeepSpeedConfigError, match=r"teacher DeepSpeed config: bf16.enabled is True but the run's "
                                                   r"training.dtype is 'fp32'"):
        pair(ROOT / "configs/zero2_student.json", teacher, training=TrainingConfig(dtype="fp32"))


def test_a_matching_cosine_section_is_accepted_and_removed():
    cosine = SHIPPED | {"scheduler": {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": "auto", "total_num_steps": 50, "cos_min_ratio": 0.1, "warmup_min_ratio": 0.0}}}
    training = TrainingConfig(max_steps=50, micro_batch_size=4, gradient_accumulation_steps=2, warmup_steps=5,
                              lr_schedule="cosine", min_lr_ratio=0.1)
    student, _ = pair(cosine, ROOT / "configs/zero3_teacher.json", training=training)
    assert "scheduler" not in student


@pytest.mark.parametrize("stage", ["two", "2", 4, True])
def test_a_zero_stage_that_is_not_0_to_3_names_the_key(stage):
    with pytest.raises(DeepSpeedConfigError, match=rf"zero_optimization.stage is {stage!r}; it must be one of "
                                                   r"0, 1, 2, 3"):
        pair(ROOT / "configs/zero2_student.json", ROOT / "configs/zero3_teacher.json",
             teacher_overrides={"zero_optimization.stage": stage})

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
                            training=TrainingConfig(micro_batch_size=1, lr=3e-4, dtype="bf16"))
    assert "auto" not in json.dumps(student) + json.dumps(teacher)
    assert student["optimizer"]["params"]["lr"] == 3e-4
    assert student["scheduler"]["params"]["warmup_max_lr"] == 3e-4
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
    assert student["scheduler"]["params"]["total_num_steps"] == 50
    assert student["zero_optimization"]["reduce_bucket_size"] == int(5e8)  # DeepSpeed's default below stage 3
    assert "optimizer" not in teacher


def test_teacher_gets_the_students_micro_batch_when_missing():
    _, teacher = pair(ROOT / "configs/zero2_student.json", {"zero_optimization": {"stage": 3}})
    assert teacher["train_micro_batch_size_per_gpu"] == 4


def test_conflicting_micro_batch_is_an_error_naming_the_fix():
    teacher = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    with pytest.raises(DeepSpeedConfigError, match=r"train_micro_batch_size_per_gpu is 1 but the run uses 4"):
        pair(ROOT / "configs/zero2_student.json", teacher)


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
    assert "disagree on precision" in message


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

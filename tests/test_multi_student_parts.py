"""The pieces of multi-model training that need no ranks: specs, grouped configs, mutual learning."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distill_kit import TrainingConfig
from distill_kit.config import StudentSpec, TeacherSpec, specs
from distill_kit.engines.deepspeed_config import DeepSpeedConfigError, TrainedConfig, prepare_group
from distill_kit.errors import ConfigError
from losses import build_loss
from losses.functional import forward_kl

ROOT = Path(__file__).resolve().parents[1]
TRAINING = TrainingConfig(max_steps=10, micro_batch_size=2, lr=1e-3)


def test_specs_from_dicts_and_their_errors():
    """One loader for specs given in Python and in a run config: the same dataclass, the same errors."""
    small, big = specs(StudentSpec, [StudentSpec("small", "a"), {"name": "big", "model": "b", "lr": 1e-4}], "student")
    assert big.training(TRAINING).lr == 1e-4 and small.training(TRAINING) is TRAINING
    with pytest.raises(ConfigError, match=r"unknown config key 'students\[0\].los': did you mean 'students\[0\].loss'"):
        specs(StudentSpec, [{"name": "x", "model": "a", "los": "forward_kl"}], "student")
    with pytest.raises(ConfigError, match="given more than once"):
        specs(StudentSpec, [StudentSpec("x", "a"), StudentSpec("x", "b")], "student")
    with pytest.raises(ValueError, match="non-empty word"):
        StudentSpec("a/b", "a")
    with pytest.raises(ConfigError, match=r"teachers\[0\]: .*weight must be a finite number >= 0"):
        specs(TeacherSpec, [{"name": "t", "model": "m", "weight": -1}], "teacher")


def test_grouped_configs_report_every_students_problems_at_once():
    good = ROOT / "configs/zero2_student.json"
    with pytest.raises(DeepSpeedConfigError) as err:
        prepare_group(
            {"student 'a'": TrainedConfig({"zero_optimization": {"stage": 2}}, TRAINING, 32),
             "student 'b'": TrainedConfig(good, TRAINING, 48, {"bf16.enabled": True}),
             "student 'c'": TrainedConfig(good, TRAINING, 48)},
            ROOT / "configs/zero3_teacher.json", teacher_hidden_size=64, world_size=1,
        )
    message = str(err.value)
    assert "student 'a' DeepSpeed config: no \"optimizer\" section" in message
    assert ("student 'b' DeepSpeed config: bf16.enabled is True but the run's training.dtype is 'fp32'; set "
            "bf16.enabled to \"auto\" (or leave it out), or training.dtype to 'bf16'") in message
    assert "student 'c'" not in message


def test_grouped_configs_fill_each_lr_and_need_no_teacher():
    configs, teacher = prepare_group(
        {"a": TrainedConfig(ROOT / "configs/zero2_student.json", TRAINING, 32),
         "b": TrainedConfig(ROOT / "configs/zero2_student.json", TrainingConfig(max_steps=10, micro_batch_size=2,
                                                                                lr=5e-4), 48)},
        None, teacher_hidden_size=None, world_size=1,
    )
    assert teacher is None
    assert [configs[k]["optimizer"]["params"]["lr"] for k in "ab"] == [1e-3, 5e-4]
    # Below ZeRO-3 the bucket is DeepSpeed's default (5e8, measured faster than hidden²), whatever each model's width.
    assert [configs[k]["zero_optimization"]["reduce_bucket_size"] for k in "ab"] == [int(5e8)] * 2


def _outputs(seed: int, requires_grad: bool = False) -> SimpleNamespace:
    logits = 2 * torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return SimpleNamespace(logits=logits.requires_grad_(requires_grad))


BATCH = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long)}


def test_mutual_kl_is_the_mean_forward_kl_to_each_peer_and_trains_only_the_model():
    me, peers = _outputs(0, requires_grad=True), (_outputs(1, True), _outputs(2, True))
    loss = build_loss({"name": "mutual_kl", "temperature": 2.0})(me, peers, BATCH).total
    expected = torch.stack([
        forward_kl(me.logits[:, :-1].reshape(-1, 7) / 2, p.logits[:, :-1].reshape(-1, 7) / 2).mean() * 4 for p in peers
    ]).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    loss.backward()
    assert me.logits.grad is not None and all(p.logits.grad is None for p in peers)


def test_mutual_kl_with_one_teacher_is_forward_kl_and_without_peers_is_an_error():
    me, teacher = _outputs(0), _outputs(1)
    assert build_loss("mutual_kl")(me, teacher, BATCH).total.item() == pytest.approx(
        build_loss("forward_kl")(me, teacher, BATCH).total.item(), rel=1e-12)
    with pytest.raises(ValueError, match="at least two models"):
        build_loss("mutual_kl")(me, (), BATCH)


def test_cross_entropy_never_reads_the_teacher_slot():
    me = _outputs(0)
    assert build_loss("cross_entropy")(me, None, BATCH).total.item() == pytest.approx(
        build_loss("cross_entropy")(me, _outputs(1), BATCH).total.item(), rel=1e-12)
    assert not build_loss([{"name": "cross_entropy", "weight": 1}, {"name": "mutual_kl", "weight": 1}]).needs_teacher
    assert build_loss([{"name": "cross_entropy", "weight": 1}, {"name": "forward_kl", "weight": 1}]).needs_teacher

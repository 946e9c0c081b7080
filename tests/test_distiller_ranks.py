"""The Distiller on real DeepSpeed engines: one rank under plain python, two ranks under torchrun (gloo)."""

from __future__ import annotations

import pytest
import rank_results
from launch import ROOT, run_ranks
from tolerances import assert_float32_equivalent

WORKER = ROOT / "tests/workers/core_scenarios.py"
SCENARIOS = ["zero2_zero3", "teacher_sharding", "zero3_zero3", "zero2_zero0", "losses_and_hooks", "seed_configs"]
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("two_ranks")
    run_ranks(WORKER, [str(out), ",".join(SCENARIOS)], nprocs=2)
    return rank_results.read(out, 2)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("one_rank")
    run_ranks(WORKER, [str(out), "zero2_zero3,zero3_zero3"], nprocs=0)  # plain `python`, no launcher
    return rank_results.read(out, 1)


def _matches_plain_pytorch(result: dict) -> None:
    assert result["max_param_change"] > 1e-3  # the students did move
    assert_float32_equivalent(result)  # the bound follows from float32 rounding on this CPU: tests/tolerances.py
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
    assert result["logged_lrs"] == pytest.approx(result["lrs"], rel=1e-12)  # the lr each step used, as applied


@pytest.mark.parametrize("scenario", ["zero2_zero3", "zero3_zero3", "zero2_zero0"])
def test_two_ranks_match_plain_pytorch(two_ranks, scenario):
    """Same student parameters and per-step losses as a plain AdamW loop over the union of both ranks' data, run
    with the documented schedule written out step by step (core_scenarios.SCHEDULES: linear with warm-up 0 and 1,
    cosine to 10% with warm-up 2), last step included."""
    for result in two_ranks[scenario]:
        _matches_plain_pytorch(result)


@pytest.mark.parametrize("scenario", ["zero2_zero3", "zero3_zero3"])
def test_one_rank_plain_python_matches_plain_pytorch(one_rank, scenario):
    (result,) = one_rank[scenario]
    _matches_plain_pytorch(result)


def test_stages_come_from_each_config(two_ranks):
    assert [r["student_zero3"] for r in two_ranks["zero2_zero3"]] == [False, False]
    assert [r["student_zero3"] for r in two_ranks["zero3_zero3"]] == [True, True]
    assert [r["teacher_is_engine"] for r in two_ranks["zero2_zero3"]] == [True, True]
    assert [r["teacher_is_engine"] for r in two_ranks["zero2_zero0"]] == [False, False]


def test_teacher_is_sharded_frozen_and_unchanged(two_ranks):
    for result in two_ranks["teacher_sharding"]:
        assert result["local_fraction"] == pytest.approx(0.5, abs=0.01)
        assert result["teacher_unchanged"]
        assert not result["teacher_requires_grad"]
        assert not result["teacher_training_mode"]
        assert not result["student_partitioned"]  # loaded while the teacher's ZeRO-3 config was not active
        assert not result["transformers_zero3_left_on"]
        assert result["last_loss"] < 0.5 * result["first_loss"]
        assert result["eval_kl_after"] < 0.5 * result["eval_kl_before"]  # held-out metrics see the same gain
        assert result["eval_tokens"] > 0 and 0 <= result["eval_agreement_after"] <= 1


def test_two_zero3_configs_keep_their_own_persistence(two_ranks):
    for result in two_ranks["persistence"]:
        assert result["student"]["threshold"] != result["teacher"]["threshold"]
        for side in ("student", "teacher"):
            assert result[side]["wrong"] == []
            assert result[side]["persisted"] > 0


def test_seed_configs_drive_a_run_with_offloaded_optimizer(two_ranks):
    for result in two_ranks["seed_configs"]:
        assert result["offload"]
        assert len(result["losses"]) == 3
        assert all(loss > 0 for loss in result["losses"])


def test_weighted_losses_projection_and_user_loss_train(two_ranks):
    for result in two_ranks["losses_and_hooks"]:
        assert {"cross_entropy", "forward_kl", "hidden_mse", "HalfForwardKL"} <= set(result["parts"])
        assert result["last"] < result["first"]
        assert result["projection_moved"]  # trained by the student's optimizer...
        assert result["projection_in_checkpoint"]  # ...saved with it...
        assert not result["student_has_projection"]  # ...and not part of the student


def test_readme_subclass_overrides_one_hook(two_ranks):
    for result in two_ranks["losses_and_hooks"]:
        assert "topk_kl" in result["subclass_parts"]
        assert result["subclass_last"] < 0.8 * result["subclass_first"]

"""Runs with rewards on a real DeepSpeed engine (one rank, in this process): weight 0 switches a part off exactly,
plain GRPO equals a plain-PyTorch loop, resume is exact, and a failing reward stops cleanly after a checkpoint."""

from __future__ import annotations

import pytest
import rank_results
from launch import ROOT, run_ranks
from tolerances import assert_float32_equivalent

WORKER = ROOT / "tests/workers/reward_scenarios.py"
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("rewards")
    run_ranks(WORKER, [str(out), "weight_zero,grpo,stale,resume,reward_fails"], nprocs=0)
    return {name: results[0] for name, results in rank_results.read(out, 1).items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("rewards_two")
    run_ranks(WORKER, [str(out), "fails_on_one_rank"], nprocs=2)
    return rank_results.read(out, 2)["fails_on_one_rank"]


def test_a_reward_failing_on_one_rank_stops_every_rank_at_the_same_step(two_ranks):
    assert [r["step"] for r in two_ranks] == [2, 2]
    assert [r["error"] for r in two_ranks] == ["RewardFailed", "RewardFailed"]
    assert "it failed on another rank" in two_ranks[0]["stopped_by"]
    assert "reward 'ones' failed on the prompt" in two_ranks[1]["stopped_by"]


def test_reward_weight_zero_is_todays_on_policy_run_bit_for_bit(runs):
    result = runs["weight_zero"]
    assert result["scored"]  # the samples were scored, and the term computed (weight 0)
    assert result["losses"] == result["losses_with_rewards"] == result["reverse_kl_with_rewards"]
    assert result["identical_params"]
    assert all(mean >= 0 for mean in result["reward_means"])


def test_teacher_weight_zero_is_plain_grpo(runs):
    """The engine's GRPO against GRPO written out in plain PyTorch on the same samples (float32 rounding bound:
    tests/tolerances.py); the teacher is never run, each micro-batch holds 2 prompts x 4 samples side by side."""
    result = runs["grpo"]
    assert_float32_equivalent(result)
    assert result["teacher_forwards"] == 0
    assert result["rows"] == [8] * 6 and all(result["prompts_per_group"])
    assert result["groups_with_signal"] > 0
    for key in ("policy_gradient", "reward_mean", "reward_std", "no_signal", "sample_length", "entropy"):
        assert key in result["record_keys"]


def test_resumed_run_with_rewards_and_groups_ends_where_the_uninterrupted_one_does(runs):
    assert runs["resume"]["identical_params"] and runs["resume"]["same_history"]


def test_a_failing_reward_stops_after_a_checkpoint_and_resume_loses_nothing(runs):
    result = runs["reward_fails"]
    assert result["stopped_by"].startswith("a reward failing (reward 'ones' failed on the prompt")
    assert "row " in result["stopped_by"] and "at step 3" in result["stopped_by"]
    assert result["step"] == 2 and result["saved"][-1] == "step_00000002"
    assert result["resumed_to"] == 4 and result["identical_params"]


def test_stale_samples_train_as_plain_pytorch_clips_them_and_resume_inside_a_rollout_is_exact(runs):
    """updates_per_rollout 2: two rollouts sampled for three steps, the second step on the first step's samples
    with PPO's clipped ratio, as the plain-PyTorch loop computes it (float32 rounding bound: tests/tolerances.py);
    stopped between the rollout's two steps and resumed, the run is the uninterrupted one bit for bit."""
    result = runs["stale"]
    assert_float32_equivalent(result)
    assert result["rollouts_sampled"] == 2
    assert result["reward_means"][0] == result["reward_means"][1] != result["reward_means"][2]
    assert result["resumed_identical"] and result["resumed_history"]

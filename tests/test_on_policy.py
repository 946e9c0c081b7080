"""On-policy distillation and sequence-level KD on real DeepSpeed engines: one rank (plain python), two (torchrun)."""

from __future__ import annotations

import pytest
import rank_results
from launch import ROOT, run_ranks

WORKER = ROOT / "tests/workers/on_policy_scenarios.py"
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("on_policy_two")
    run_ranks(WORKER, [str(out), "equivalence,equivalence_step,fraction_zero,resume,seq_kd,packed"], nprocs=2)
    return rank_results.read(out, 2)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("on_policy_one")
    run_ranks(WORKER, [str(out), "equivalence,resume"], nprocs=0)
    return rank_results.read(out, 1)


def _check_equivalence(result: dict) -> None:
    assert result["mismatched_samples"] == 0  # every sample is the current student's greedy continuation
    assert result["max_param_change"] > 1e-3
    # 3 AdamW steps of size ~3e-3: float32 rounding of reverse KL's gradient (summed in another order than the
    # reference's) is amplified on near-zero gradients by Adam's 1/sqrt(v); a wrong sample, mask or normaliser
    # moves a parameter by ~1e-3.
    assert result["max_param_diff"] < 2e-5
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
    assert result["sampled_per_batch"] == [2] * len(result["sampled_per_batch"])  # round(2/3 * 3) rows
    assert result["counted_after_eos"] == 0


def test_two_ranks_sampling_different_lengths_match_plain_pytorch(two_ranks):
    """Ranks sample rows of different lengths, pad to one agreed length, and train as plain PyTorch would."""
    results = two_ranks["equivalence"]
    for result in results:
        _check_equivalence(result)
    assert results[0]["padded"] == results[1]["padded"]  # agreed shapes for the ZeRO-3 teacher
    assert any(a != b for a, b in zip(results[0]["unpadded"], results[1]["unpadded"], strict=True))
    assert sum(r["eos_ended"] for r in results) > 0  # some samples ended at the end token, which counts


def test_step_sampled_together_in_fixed_size_calls_matches_plain_pytorch(two_ranks):
    """generation_batch_size: a step's chosen rows of both micro-batches go through generate together, in calls of
    the same size (the last padded), and train exactly as sampling each micro-batch alone would."""
    for result in two_ranks["equivalence_step"]:
        _check_equivalence(result)
        assert result["generate_calls"] == [3, 3] * 3  # 4 rows a step, 3 steps
    for alone in two_ranks["equivalence"]:
        assert alone["generate_calls"] == [2] * 6  # one call per micro-batch
    assert [r["padded"] for r in two_ranks["equivalence_step"]] == [r["padded"] for r in two_ranks["equivalence"]]
    for together, alone in zip(two_ranks["equivalence_step"], two_ranks["equivalence"], strict=True):
        assert together["losses"] == pytest.approx(alone["losses"], rel=1e-6)


def test_packed_sampled_micro_batches_train_as_unpacked_ones(two_ranks):
    """on_policy.pack_to: every sampled micro-batch is packed (fewer rows, positions restarting per conversation,
    the same counted tokens), both ranks agree on each packed shape, and the run lands where the unpacked one does.
    Bounds as in the plain-PyTorch equivalence above: packed and padded attention round differently in float32
    (~1e-7 per logit), which Adam's 1/sqrt(v) amplifies on near-zero gradients over 3 steps to ~1e-6; a sample or
    a boundary gone wrong moves a parameter by ~lr = 3e-3."""
    results = two_ranks["packed"]
    for result in results:
        assert result["has_positions"] and result["counted"] == result["ref_counted"]
        assert sum(result["packed_rows"]) < sum(result["rows"])
        assert result["max_param_change"] > 1e-3
        assert result["max_param_diff"] < 2e-5
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
    assert results[0]["shapes"] == results[1]["shapes"]  # agreed across ranks


def test_one_rank_matches_plain_pytorch(one_rank):
    _check_equivalence(one_rank["equivalence"][0])


def test_fraction_zero_is_off_policy_exactly(two_ranks):
    for result in two_ranks["fraction_zero"]:
        assert result["same_history"] and result["batches_untouched"]
        assert result["max_param_diff"] == 0.0


@pytest.mark.parametrize("ranks", ["one_rank", "two_ranks"])
def test_resumed_on_policy_run_samples_and_trains_as_uninterrupted(ranks, request):
    for result in request.getfixturevalue(ranks)["resume"]:
        assert result["sampled_tokens"] > 0
        assert result["same_samples"]
        assert result["losses"] == result["ref_losses"]
        assert result["max_param_diff"] == 0.0


def test_seq_kd_teacher_samples_are_its_greedy_answers(two_ranks):
    """The ZeRO-3 teacher generates with every rank in step (synced), though the ranks' prompts differ."""
    results = two_ranks["seq_kd"]
    assert [r["steps"] for r in results] == [2, 2]
    assert all(r["mismatched_samples"] == 0 for r in results)
    # cross-entropy never reads the teacher: no scoring forward (its samples come from generate), and the same
    # student as a run that scores every micro-batch
    assert all(r["teacher_forwards"] == 0 and r["scoring_teacher_forwards"] > 0 for r in results)
    assert all(r["max_param_diff_vs_scoring"] == 0.0 for r in results)

"""Resume exactly, never lose a checkpoint, never hang: real ranks, real DeepSpeed engines, real signals."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from launch import ROOT, run_ranks

WORKER = ROOT / "tests/workers/reliability_scenarios.py"
pytestmark = pytest.mark.multirank


def _results(out: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}.rank*.json"))]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reliability")
    run_ranks(WORKER, [str(out), "resume,routed_resume,nonfinite"], nprocs=2, timeout=300)
    return out


@pytest.fixture(scope="module")
def killed_then_resumed(tmp_path_factory) -> dict:
    """One rank under plain python, SIGKILLed inside a save; then a new process resumes what it left."""
    out = tmp_path_factory.mktemp("killed")
    with pytest.raises(AssertionError, match="exited with -9"):
        run_ranks(WORKER, [str(out), "killed_save"], nprocs=0, timeout=120, in_process=False)
    run_ranks(WORKER, [str(out), "after_kill"], nprocs=0, timeout=120, in_process=False)
    (result,) = _results(out, "after_kill")
    return result


def test_interrupted_and_resumed_equals_uninterrupted_on_two_ranks(two_ranks):
    """SIGTERM on one rank mid-step 3, resumed in a new Distiller from a fresh loader: the same six losses,
    learning rates and final weights (dropout on, so every rank's torch generator must come back too), and the
    same next draw from Python's, NumPy's and torch's generators."""
    for result in _results(two_ranks, "resume"):
        assert result["resumed_from"] == "step_00000003"
        assert result["steps"] == [1, 2, 3, 4, 5, 6]
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-6, abs=0)
        assert result["lrs"] == pytest.approx(result["ref_lrs"], rel=1e-12)
        assert result["max_param_diff"] < 1e-6
        assert result["draws"] == result["ref_draws"]


def test_a_routed_run_interrupted_and_resumed_equals_uninterrupted(two_ranks):
    """combine: route with two teachers: the resumed run continues the routed loader where it stopped (each
    global batch one teacher's rows) and lands on the uninterrupted run's losses and weights."""
    for result in _results(two_ranks, "routed_resume"):
        assert result["stopped_at"] == 3 and result["resumed_from"] == "step_00000003"
        assert result["steps"] == [1, 2, 3, 4, 5, 6]
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-6, abs=0)
        assert result["max_param_diff"] < 1e-6


def test_sigterm_on_one_rank_stops_every_rank_with_a_checkpoint_at_that_step(two_ranks):
    results = _results(two_ranks, "resume")
    assert [r["stopped"]["by"] for r in results] == ["a signal on another rank", "SIGTERM"]
    for result in results:
        assert result["stopped"]["step"] == 3
        assert result["stopped"]["checkpoints"] == ["step_00000003"]


def test_teacher_is_unchanged_and_a_different_teacher_is_refused(two_ranks):
    for result in _results(two_ranks, "resume"):
        assert result["teacher_hash_unchanged"]
        assert result["teacher_hash"] == result["plain_module_hash"]  # the weights, whatever the ZeRO layout
        assert result["teacher_hash"] != result["other_teacher_hash"]
        assert result["teacher_hash"] in result["refusal"] and result["other_teacher_hash"] in result["refusal"]


def test_skipped_non_finite_steps_equal_never_seeing_their_data(two_ranks):
    """A NaN loss on one rank and a NaN gradient (finite loss) on the other are skipped on both ranks: the run
    matches one without those batches, learning-rate schedule included, and counts the skips."""
    for result in _results(two_ranks, "nonfinite"):
        assert result["losses"] == pytest.approx(result["clean_losses"], rel=1e-6)
        assert result["lrs"] == pytest.approx(result["clean_lrs"], rel=1e-12)
        assert result["max_param_diff"] < 1e-6
        assert result["skipped"] == [0, 1, 2, 2]
        assert result["teacher_forwards"] == 6 * 2  # six attempted steps of two micro-batches


def test_consecutive_non_finite_steps_stop_with_the_last_good_checkpoint_intact(two_ranks):
    for result in _results(two_ranks, "nonfinite"):
        assert "step 2: non-finite forward_kl, loss" in result["error"]  # the step and the parts that went bad
        assert "cross_entropy" not in result["error"]
        assert "training.max_bad_steps=2" in result["error"]
        assert result["stopped_at"] == 1 and result["intact"] == "step_00000001"
        assert result["reloaded_step"] == 1 and result["reloaded_params_equal"]


def test_uneven_data_runs_the_same_teacher_forwards_on_every_rank(two_ranks):
    """13 blocks over 2 ranks x 2 (a block dropped per epoch) for training; 5 held-out blocks for evaluation,
    whose last batch leaves one rank only filler. The launch finishing within its timeout is the no-hang proof."""
    results = _results(two_ranks, "uneven")
    assert [r["train_forwards"] for r in results] == [12, 12]
    assert [r["eval_forwards"] for r in results] == [2, 2]
    assert results[0]["student_ppl"] == results[1]["student_ppl"]


def test_sigkill_during_a_save_loses_nothing_on_one_rank(killed_then_resumed):
    """Killed inside the save of step 4: step 2 stays complete, the half-written step 4 is ignored, and the
    resumed run (plain python, one rank) equals an uninterrupted one; the leftover is cleared by the next save."""
    result = killed_then_resumed
    assert result["left"] == [".partial-step_00000004", "step_00000002"]
    assert result["resumed_from"] == "step_00000002"
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-6, abs=0)
    assert result["max_param_diff"] < 1e-6
    assert result["after"] == ["step_00000004", "step_00000006"]


def test_a_stalled_rank_makes_the_others_fail_loudly_within_the_timeout(tmp_path):
    """One rank stops after step 1; the other's next collective fails after the 5 s collective timeout (ranks of
    their own: the kept ones' group has the usual timeout)."""
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_ranks(WORKER, [str(tmp_path), "stall"], nprocs=2, timeout=120, in_process=False)
    message = str(failure.value)
    assert "timed out after" not in message  # the ranks failed by themselves, not killed by the test's timeout
    assert "rank 0 failed after" in message
    assert "timeout" in message.lower() or "timed out" in message.lower()
    assert time.monotonic() - started < 90

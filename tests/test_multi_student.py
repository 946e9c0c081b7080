"""Several models at once on 2 real ranks: students of one teacher, and models side by side."""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_results
from launch import ROOT, run_ranks

WORKER = ROOT / "tests/workers/multi_scenarios.py"
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out: Path = tmp_path_factory.mktemp("multi")
    run_ranks(WORKER, [str(out)], nprocs=2, timeout=240)
    return rank_results.read(out, 2)


def test_students_of_one_teacher_match_separate_runs(ranks):
    """A shared teacher pass changes nothing but cost: each student ends where a Distiller of its own would."""
    for result in ranks["shared_teacher"]:
        for name in ("small", "big"):
            assert result["max_param_change"][name] > 1e-3  # the students did move
            assert result["max_param_diff"][name] < 1e-6
            lr, alone_loss, shared_loss = result["lr_and_last_losses"][name]
            assert shared_loss == pytest.approx(alone_loss, rel=1e-6)
        assert result["lr_and_last_losses"]["big"][0] == 2e-3  # its own lr, not the run's
        # Each student's own schedule (warm-up 2 of 4 steps, linear decay), the lr each step used, written out:
        small_big = [1.5e-3, 1e-3, 3e-3, 2e-3, 2e-3, 4e-3 / 3, 1e-3, 2e-3 / 3]  # step 1 (small, big), step 2, ...
        assert [lr for step in result["lrs"] for lr in step] == pytest.approx(small_big, rel=1e-12)
        assert {"small/loss", "small/lr", "big/cross_entropy", "big/reverse_kl", "step"} <= set(result["history_keys"])


def test_teacher_runs_once_per_micro_batch(ranks):
    for result in ranks["shared_teacher"]:
        assert result["teacher_forwards"] == result["micro_batches"]
        assert result["separate_teacher_forwards"] == 2 * result["micro_batches"]
        assert result["eval_teacher_forwards"] == result["eval_batches"]  # evaluation shares it too
        assert result["eval_keys"] == ["big", "small", "teacher"]


GROUP_CHECKPOINT = ["big", "manifest.json", "rank00000.json", "rank00000.safetensors", "rank00001.json",
                    "rank00001.safetensors", "small", "trainer_state.json",
                    "zero_to_fp32.py", "zero_to_torch.py"]  # the last two: DeepSpeed's recovery scripts


def test_sigterm_on_one_rank_stops_the_group_with_one_checkpoint_at_that_step(ranks):
    """Each student's engine in its own folder, one manifest and the shared state beside them."""
    results = ranks["shared_teacher"]
    assert [r["stopped"]["by"] for r in results] == ["a signal on another rank", "SIGTERM"]
    for result in results:
        assert result["stopped"]["step"] == 3
        assert result["stopped"]["checkpoints"] == ["step_00000002", "step_00000003"]  # periodic, then the signal's
        assert result["stopped"]["files"] == GROUP_CHECKPOINT


def test_a_stopped_group_resumed_equals_uninterrupted(ranks):
    """Resumed from the signal's checkpoint (resume()) and from the periodic one (load(step_2)), each new group
    given the whole data again: the same losses and learning rates of both students, the same final weights."""
    for result in ranks["shared_teacher"]:
        assert result["resumed_from"] == "step_00000003" and result["resumed_step"] == 3
        assert result["periodic_step"] == 2
        for losses in (result["resumed_losses"], result["periodic_losses"]):
            assert len(losses) == 4
            for got, want in zip(losses, result["losses"], strict=True):
                assert got == pytest.approx(want, rel=1e-6, abs=0)
        assert result["resumed_lrs"] == result["lrs"]
        assert all(diff < 1e-6 for diff in result["resumed_diff"].values())
        assert all(diff < 1e-6 for diff in result["periodic_diff"].values())


def test_each_students_export_stands_alone(ranks):
    for result in ranks["shared_teacher"]:
        assert all(diff == 0.0 for diff in result["export_diff"].values())


def test_models_side_by_side_match_training_alone(ranks):
    for result in ranks["side_by_side"]:
        for name in ("small", "big"):
            assert result["max_param_change"][name] > 1e-3
            assert result["max_param_diff"][name] < 1e-6
        assert result["checkpoint_dirs"] == ["step_00000004"]
        assert result["checkpoint_files"] == GROUP_CHECKPOINT
        assert result["reloaded_step"] == 4
        assert all(diff == 0.0 for diff in result["reloaded_diff"].values())


def test_mutual_learning_trains_each_model_on_its_peers(ranks):
    for result in ranks["side_by_side"]:
        assert {"small/mutual_kl", "big/mutual_kl", "small/cross_entropy"} <= set(result["mutual_parts"])
        assert result["mutual_kl"][-1] < result["mutual_kl"][0]  # the models come to agree
        assert all(diff > 1e-4 for diff in result["mutual_vs_alone"].values())  # and it changes their training


def test_a_group_skips_a_step_every_model_discarded_and_stops_when_they_disagree(ranks):
    """Both models' losses NaN (on one rank): the step is skipped by both. Only big's: big discards its step
    while small takes its own, so the run stops, naming them."""
    for result in ranks["side_by_side"]:
        assert result["poisoned_history"] == [[1, 0]]
        assert "step 2: models ['big'] discarded their optimizer step (non-finite big/loss" in result["disagreement"]
        assert "while ['small'] took theirs" in result["disagreement"]


def test_side_by_side_refuses_a_loss_that_needs_a_teacher(ranks):
    for result in ranks["side_by_side"]:
        assert "read a teacher's outputs" in result["refusal"] and "mutual_kl" in result["refusal"]


def test_benchmark_helper_reports_both_sides(ranks):
    for result in ranks["bench_smoke"]:
        assert result["shared"]["teacher_forwards"] == 1  # one timed step, one micro-batch
        assert result["separate"]["teacher_forwards"] == 2
        assert result["shared"]["tokens_per_s"] > 0 and result["separate"]["tokens_per_s"] > 0
        assert set(result["separate"]["runs"]) == {"small", "big"}

"""Several models at once on 2 real ranks: students of one teacher, and models side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import ROOT, run_ranks

WORKER = ROOT / "tests/workers/multi_scenarios.py"
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out: Path = tmp_path_factory.mktemp("multi")
    run_ranks(WORKER, [str(out)], nprocs=2, timeout=240)
    names = {p.name.split(".rank")[0] for p in out.glob("*.rank*.json")}
    return {name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)] for name in names}


def test_students_of_one_teacher_match_separate_runs(ranks):
    """A shared teacher pass changes nothing but cost: each student ends where a Distiller of its own would."""
    for result in ranks["shared_teacher"]:
        for name in ("small", "big"):
            assert result["max_param_change"][name] > 1e-3  # the students did move
            assert result["max_param_diff"][name] < 1e-6
            lr, alone_loss, shared_loss = result["lr_and_last_losses"][name]
            assert shared_loss == pytest.approx(alone_loss, rel=1e-6)
        assert result["lr_and_last_losses"]["big"][0] == 2e-3  # its own lr, not the run's
        assert {"small/loss", "small/lr", "big/cross_entropy", "big/reverse_kl", "step"} <= set(result["history_keys"])


def test_teacher_runs_once_per_micro_batch(ranks):
    for result in ranks["shared_teacher"]:
        assert result["teacher_forwards"] == result["micro_batches"]
        assert result["separate_teacher_forwards"] == 2 * result["micro_batches"]
        assert result["eval_teacher_forwards"] == result["eval_batches"]  # evaluation shares it too
        assert result["eval_keys"] == ["big", "small", "teacher"]


def test_each_students_checkpoint_and_export_stand_alone(ranks):
    for result in ranks["shared_teacher"]:
        assert result["checkpoint_dirs"] == ["big", "small"]
        assert result["resumed_step"] == 3
        assert all(diff < 1e-6 for diff in result["resumed_diff"].values())  # resumed run ends identically
        assert result["alone_loads_its_checkpoint"] == 3  # an ordinary single-student checkpoint
        assert all(diff == 0.0 for diff in result["export_diff"].values())


def test_models_side_by_side_match_training_alone(ranks):
    for result in ranks["side_by_side"]:
        for name in ("small", "big"):
            assert result["max_param_change"][name] > 1e-3
            assert result["max_param_diff"][name] < 1e-6
        assert result["checkpoint_dirs"] == ["big", "small"]
        assert result["reloaded_step"] == 4
        assert all(diff == 0.0 for diff in result["reloaded_diff"].values())


def test_mutual_learning_trains_each_model_on_its_peers(ranks):
    for result in ranks["side_by_side"]:
        assert {"small/mutual_kl", "big/mutual_kl", "small/cross_entropy"} <= set(result["mutual_parts"])
        assert result["mutual_kl"][-1] < result["mutual_kl"][0]  # the models come to agree
        assert all(diff > 1e-4 for diff in result["mutual_vs_alone"].values())  # and it changes their training


def test_side_by_side_refuses_a_loss_that_needs_a_teacher(ranks):
    for result in ranks["side_by_side"]:
        assert "read a teacher's outputs" in result["refusal"] and "mutual_kl" in result["refusal"]


def test_benchmark_helper_reports_both_sides(ranks):
    for result in ranks["bench_smoke"]:
        assert result["shared"]["teacher_forwards"] == 1  # one timed step, one micro-batch
        assert result["separate"]["teacher_forwards"] == 2
        assert result["shared"]["tokens_per_s"] > 0 and result["separate"]["tokens_per_s"] > 0
        assert set(result["separate"]["runs"]) == {"small", "big"}

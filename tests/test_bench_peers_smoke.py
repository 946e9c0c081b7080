"""``benchmarks/bench_peers.py``'s CPU smoke mode: distill-kit's side always, TRL's side only where ``trl`` imports.

TRL is in no extra the test suite installs (it is the ``peers`` extra, for the benchmark alone; ``dev`` leaves it
out), so in ``make test`` the TRL test skips, and the launch records TRL's runs as skipped rather than failing.
With ``pip install -e .[peers]``, the TRL test runs DistillationTrainer and GKDTrainer on the tiny pair and checks
that their first-batch loss is ours (same weights, rows and positions: the objectives agree). Nothing about speed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
from launch import ROOT, run_ranks

SCRIPT = ROOT / "benchmarks/bench_peers.py"
FIELDS = {"tokens_per_s_per_gpu", "step_ms", "step_ms_all", "first_batch_loss", "losses", "peak_allocated_gib",
          "optimizer"}


def launch(tmp_path, runs: list[str]) -> dict:
    run_ranks(SCRIPT, ["--smoke", "--warmup", "1", "--steps", "1", "--runs", *runs, "--out", str(tmp_path)],
              nprocs=0, timeout=300)
    assert "| tiny | ours@2 |" in (tmp_path / "peers.md").read_text()
    return json.loads((tmp_path / "peers.json").read_text())


def test_ours_side(tmp_path):
    """Our run reports every field; a TRL run without TRL is recorded as skipped, not failed."""
    peers = [] if importlib.util.find_spec("trl") else ["distill@2"]
    result = launch(tmp_path, ["ours@2", *peers])
    ours = result["runs"][0]
    assert ours["status"] == "ok", ours
    assert FIELDS <= ours.keys() and ours["policy"] == "off" and ours["divergence"] == "fkl"
    assert len(ours["losses"]) == 2 and all(math.isfinite(loss) for loss in ours["losses"])
    assert result["summary"]["largest_micro_batch"] == {"tiny ours": 2}
    if peers:
        assert result["runs"][1]["status"] == "skipped: trl is not installed"


def test_trl_side_reports_our_loss(tmp_path):
    pytest.importorskip("trl")
    result = launch(tmp_path, ["ours@2", "distill@2", "gkd@2"])
    assert [run["status"] for run in result["runs"]] == ["ok"] * 3, result["runs"]
    comparisons = [c for c in result["summary"]["comparisons"] if c["basis"] == "same micro-batch"]
    assert {c["peer"] for c in comparisons} == {"distill@2", "gkd@2"}
    for comparison in comparisons:  # fp32, the same weights, rows and positions
        assert comparison["loss_rel_diff"] < 1e-5, comparison


def test_run_names():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_peers import GPU_RUNS, SMOKE_RUNS, parse_planned, parse_run

    for _, text in GPU_RUNS + SMOKE_RUNS:  # the default launches' runs are all well formed
        parse_run(text)

    run = parse_run("distill@32,16+on+z2")
    assert run.micro_batches == (16, 32) and run.on_policy and run.divergence == "fkl"
    assert run.label(16) == "distill@16+on+z2" and run.key == "distill+on+z2"
    assert parse_run("gkd@8+jsd").divergence == "jsd"
    for bad in ("ours", "trl@8", "ours@8+z2", "distill@8+rkl+jsd", "gkd@8+fast"):
        with pytest.raises(Exception, match="bad run"):
            parse_run(bad)
    pair, run = parse_planned("qwen2-32b-0.5b:distill@8+on")  # --plan: a run on its own pair
    assert pair == "qwen2-32b-0.5b" and run.label(8) == "distill@8+on"
    for bad in ("ours@8", ":ours@8"):
        with pytest.raises(Exception, match="bad plan entry"):
            parse_planned(bad)

"""``benchmarks/bench_drafting.py`` at tiny shapes on the CPU, in-process: every figure is written, and its cached
speculative decoding loop returns the target's greedy tokens under every drafter policy, with tau = 1 for the drafter
that never agrees and every draft kept (but where the run ends) for the one that always does. Nothing about speed."""

from __future__ import annotations

import json
import sys

import pytest
from launch import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_drafting  # noqa: E402


@pytest.mark.slow  # two models built and timed: ~5 s on a loaded 2-core CPU, off the fast tier
def test_smoke(tmp_path):
    gamma, new = 3, 14
    bench_drafting.main(["--pair", "tiny", "--device", "cpu", "--dtype", "fp32", "--gamma", str(gamma), "--new",
                         str(new), "--prompt", "8", "--repeats", "1", "--batch", "1", "2", "--tau", "2.0",
                         "--policies", "never", "model", "always",
                         "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench_drafting.json").read_text())
    for batch in ("1", "2"):
        figures = result["latency"][batch]
        assert min(figures["target_step_s"], figures["target_verify_s"], figures["drafter_step_s"],
                   figures["feature_drafter_step_s"]) > 0
        assert figures["predicted_speedup"]["2.0"] > 0
    assert result["agreement"]["fp32"]["agree"] == 1.0  # float32 at these shapes: no near-tie flips
    runs = result["end_to_end"]
    assert all(runs[p]["same_tokens_as_target"] for p in ("never", "model", "always"))
    assert runs["never"]["tau"] == 1.0 and runs["never"]["rounds"] == new
    # always: gamma + 1 tokens a round; only the last round, cut at the end of the reference, may keep fewer
    assert runs["always"]["rounds"] == -(-new // (gamma + 1))

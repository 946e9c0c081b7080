"""The offline benchmark's CPU smoke mode: tiny models on 2 gloo ranks, so the GPU benchmark never rots.

It asserts that every phase ran and reported its fields; nothing about speed, which a CPU cannot show.
"""

from __future__ import annotations

import json

import pytest
from launch import ROOT, run_ranks

SCRIPT = ROOT / "benchmarks/bench_offline.py"
pytestmark = pytest.mark.multirank


def test_offline_benchmark_smoke(tmp_path):
    run_ranks(SCRIPT, ["--pair", "tiny", "--seq-len", "32", "--micro-batch", "2", "--warmup", "1", "--steps", "2",
                       "--k", "8", "--dtype", "fp32", "--out", str(tmp_path)], nprocs=2, timeout=180)
    result = json.loads((tmp_path / "offline.json").read_text())
    for run in ("online", "offline"):
        assert result[run]["tokens_per_s_per_gpu"] > 0 and len(result[run]["losses"]) == 3
        assert all(loss == loss for loss in result[run]["losses"])  # no NaN
    # vocabulary 256: uint8 ids; k = 8 fp16 values + 8 ids + an fp16 tail
    assert result["capture"]["top_k_bytes_per_token"] == 8 * 3 + 2
    assert result["capture"]["tokens"] == 2 * 2 * 3 * 32  # ranks x micro-batch x steps x length
    assert "offline / online" in (tmp_path / "offline.md").read_text()

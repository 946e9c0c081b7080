"""The step benchmark's CPU smoke mode: tiny models on 2 gloo ranks, so the GPU benchmark never rots.

It asserts that every mode ran and every reported field is there; nothing about speed, which a CPU
cannot say anything useful about.
"""

from __future__ import annotations

import json

import pytest
from launch import ROOT, run_ranks

SCRIPT = ROOT / "benchmarks/bench_step.py"
MODES = ["ours", "baseline", "upper"]
RUN_FIELDS = {"tokens_per_s_per_gpu", "mfu_spec", "mfu_measured", "peak_allocated_gib", "step_ms", "phase_ms",
              "build_s", "losses"}
PHASES = {"teacher_forward", "student_forward", "loss", "backward", "optimizer_step", "other"}
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    run_ranks(SCRIPT, ["--pair", "tiny", "--seq-len", "32", "--micro-batch", "2", "--warmup", "1", "--steps", "2",
                       "--loss-memory-shape", "2,16", "--runs", *MODES, "ours+fused+naive", "ours+unfused",
                       "--out", str(out)],
              nprocs=2, timeout=400)
    assert (out / "chart.png").stat().st_size > 0
    assert "ours@2 / baseline" in (out / "results.md").read_text()
    return json.loads((out / "bench.json").read_text())


def test_every_mode_reports_every_field(smoke):
    assert [run["label"] for run in smoke["runs"]] == [f"{mode}@2" for mode in MODES] + ["ours@2+fused+naive",
                                                                                          "ours@2+unfused"]
    for run in smoke["runs"]:
        assert run["status"] == "ok", run
        assert RUN_FIELDS <= run.keys()
        assert set(run["phase_ms"]) == PHASES
        assert len(run["losses"]) == 3 and all(loss == loss for loss in run["losses"])  # no NaN
    assert smoke["runs"][-2]["optimizer"] == "AdamW"
    assert [run["fused_head"] for run in smoke["runs"]] == [True, False, True, False, False]  # ZeRO-3, naive: off


def test_meta_and_loss_memory(smoke):
    meta = smoke["meta"]
    assert meta["world_size"] == 2 and meta["command"].startswith("torchrun --nproc_per_node 2")
    assert meta["flops_per_token"] == 6 * meta["student_params"] + 2 * meta["teacher_params"]
    memory = smoke["loss_memory"]
    ours = [name for name in memory["over_naive"] if name.startswith("ours_chunk")]
    assert ours and "naive" in memory
    for name in ours:  # the same number as the naive loss, for less memory
        assert memory[name]["loss"] == pytest.approx(memory["naive"]["loss"], rel=1e-5)
    head = smoke["loss_memory_head"]  # the student's head + loss from hidden states: chunked, fused, naive
    assert {"chunked_chunk1024", "fused_chunk1024", "naive"} <= head.keys()
    for name in head["over_naive"]:
        assert head[name]["loss"] == pytest.approx(head["naive"]["loss"], rel=1e-5)
        assert head[name]["head_grad_norm"] == pytest.approx(head["naive"]["head_grad_norm"], rel=1e-5)

"""The step benchmark's CPU smoke mode: tiny models on 2 gloo ranks, so the GPU benchmark never rots.

It asserts that every mode ran and every reported field is there; nothing about speed, which a CPU
cannot say anything useful about.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
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
                       "ours+teacherlogits", "--out", str(out)],
              nprocs=2, timeout=400)
    assert (out / "chart.png").stat().st_size > 0
    assert "ours@2 / baseline" in (out / "results.md").read_text()
    return json.loads((out / "bench.json").read_text())


def test_every_mode_reports_every_field(smoke):
    assert [run["label"] for run in smoke["runs"]] == [f"{mode}@2" for mode in MODES] + [
        "ours@2+fused+naive", "ours@2+unfused", "ours@2+teacherlogits"]
    for run in smoke["runs"]:
        assert run["status"] == "ok", run
        assert RUN_FIELDS <= run.keys()
        assert set(run["phase_ms"]) == PHASES
        assert len(run["losses"]) == 3 and all(loss == loss for loss in run["losses"])  # no NaN
    assert smoke["runs"][-2]["optimizer"] == "AdamW"
    assert [run["fused_head"] for run in smoke["runs"]] == [True, False, True, False, False, True]  # ZeRO-3, naive: off
    # The ZeRO-3 teacher without its head unless the run turns training.teacher_head_at_loss off.
    assert smoke["runs"][0]["teacher_head_at_loss"] and smoke["runs"][0]["teacher_output"] == ["HeadOutput"]
    assert not smoke["runs"][-1]["teacher_head_at_loss"]
    assert smoke["runs"][-1]["teacher_output"] == ["CausalLMOutputWithPast"]
    (pair,) = smoke["teacher_head"]
    assert (pair["head_at_loss"], pair["full_logits"]) == ("ours@2", "ours@2+teacherlogits")


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


def test_teacher_head_variants_and_the_largest_micro_batch(tmp_path, monkeypatch):
    """``--teacher-head both --micro-batches``: each variant tried in increasing micro-batches until one runs out of
    memory, larger ones not attempted, the largest that ran recorded per variant. The runs themselves are stand-ins
    (one process, no engines): out of memory is what a GPU decides."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_step

    fits = {(): 3, ("teacherlogits",): 1}  # the largest micro-batch each variant fits, as a GPU would decide
    attempted = []

    def measure(run, args, facts, device):
        attempted.append(run.label)
        if run.micro_batch > fits[run.levers]:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return {"label": run.label, "mode": run.mode, "micro_batch": run.micro_batch, "levers": list(run.levers),
                "status": "ok", "tokens_per_s_per_gpu": 100.0 * run.micro_batch, "mfu_spec": 0.1, "mfu_measured": 0.1,
                "peak_allocated_gib": 1.0 * run.micro_batch, "step_ms": 10.0, "teacher_output": ["HeadOutput"],
                "phase_ms": dict.fromkeys(("teacher_forward", "student_forward", "loss", "backward",
                                           "optimizer_step", "other"), 1.0)}

    monkeypatch.setattr(bench_step, "measure", measure)
    monkeypatch.setattr(bench_step.distributed, "init", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--pair", "tiny", "--loss-memory-shape", "0", "--runs", "ours",
                                      "--teacher-head", "both", "--micro-batches", "3", "1", "2", "--out",
                                      str(tmp_path)])
    bench_step.main()
    assert attempted == ["ours@1", "ours@2", "ours@3", "ours@1+teacherlogits", "ours@2+teacherlogits"]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [run["status"] for run in result["runs"]] == ["ok"] * 4 + ["out of memory",
                                                                      "not attempted: micro-batch 2 ran out of memory"]
    assert result["largest_micro_batch"] == {"ours": 3, "ours+teacherlogits": 1}
    assert [pair["head_at_loss"] for pair in result["teacher_head"]] == ["ours@1"]
    assert result["meta"]["teacher_head"] == "both" and result["meta"]["micro_batches"] == [3, 1, 2]

"""benchmarks/bench_qad.py at tiny shapes on the CPU (the H200 command runs the same code), and the quality
benchmark's arithmetic of "what distillation adds" (benchmarks/qad_quality.py). Nothing about speed."""

from __future__ import annotations

import sys

import pytest
import torch
from launch import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
pytest.importorskip("torchao")


@pytest.mark.slow
def test_the_qad_benchmark_runs_every_row_and_refuses_what_this_device_cannot_run(tmp_path):
    import bench_qad

    result = bench_qad.main(["--out", str(tmp_path), "--shape", "tiny", "--schemes", "int4_weight_only", "fp8",
                             "--group-size", "32", "--micro-batch", "2", "--seq-len", "16", "--steps", "1",
                             "--warmup", "1", "--decode-tokens", "4"])
    assert (tmp_path / "bench_qad.json").is_file() and not (tmp_path / "exports").exists()
    none, int4, fp8 = result["step"]
    assert none["status"] == int4["status"] == "ok" and none["fake_quantized_layers"] == 0
    assert int4["fake_quantized_layers"] == 2 * 7 and int4["tokens_per_s"] > 0
    bf16, int4_decode, fp8_decode = result["decode"]
    assert int4_decode["weight_bytes"] < bf16["weight_bytes"] and int4_decode["decode_tokens_per_s"] > 0
    if not torch.cuda.is_available():
        assert fp8["status"].startswith("refused: students[s].quantize: fp8 needs FP8 tensor cores")
        assert fp8_decode["status"].startswith("refused: fp8 needs FP8 tensor cores")


def test_the_share_of_the_ptq_gap_qad_recovers():
    import qad_quality

    seed = {"teacher": {"perplexity": 10.0}, "ptq": {"perplexity": 12.0, "mean_kl": 0.2},
            "qat": {"perplexity": 11.5, "mean_kl": 0.3}, "qad": {"perplexity": 10.4, "mean_kl": 0.05}}
    assert qad_quality.recovered(seed) == pytest.approx(0.8)
    other = {**seed, "qad": {"perplexity": 11.8, "mean_kl": 0.1}}
    summary = qad_quality.summarize({0: seed, 1: other})
    assert summary["qad_recovers_of_ptq_gap"]["seeds"] == pytest.approx([0.8, 0.1])
    assert summary["qad"]["perplexity"]["mean"] == pytest.approx(11.1)
    assert summary["qad_beats_qat_every_seed"] is False
    assert summary["qad_closer_to_teacher_than_qat_every_seed"] is True
    assert qad_quality.recovered({**seed, "ptq": {"perplexity": 10.0}}) is None  # no gap: nothing to recover
    assert qad_quality.recovered({**seed, "ptq": {"perplexity": 10.00001}}) is None  # below evaluation resolution


def test_bins_moved_counts_the_weights_whose_int4_value_differs_from_ptqs():
    """One weight pushed across its rounding boundary (and nothing else changed) moves exactly one value of all the
    quantised weights; the group's scale (max |w| / 7.5) is left alone by choosing a weight that is not the max."""
    import qad_quality
    from tiny_models import llama_config
    from transformers import LlamaForCausalLM

    from distill_kit.config import QuantizeConfig
    from distill_kit.engines import quantize

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    spec = QuantizeConfig("int4_weight_only", group_size=16)
    ptq = qad_quality.int_values(quantize.convert(model, spec))
    total = sum(v.numel() for v in ptq.values())
    assert qad_quality.bins_moved(quantize.convert(model, spec), ptq) == 0
    weight = model.model.layers[0].mlp.down_proj.weight
    group = weight.data[0, :16]
    scale = group.abs().max() / 7.5
    index = int((group.abs() < group.abs().max() / 2).nonzero()[0])  # a weight well inside the group's range
    with torch.no_grad():
        group[index] += scale  # exactly one bin up: its int4 value changes by 1, the group's max does not
    assert qad_quality.bins_moved(quantize.convert(model, spec), ptq) == 1 / total

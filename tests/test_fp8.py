"""The FP8 teacher on the CPU (``distill_kit/engines/fp8.py``): configuration, refusals, and the layer-at-a-time
loading path with the stand-in quantiser (``backend="fake"``) checked against float64 references. torchao's FP8
kernels themselves need a GPU: ``benchmarks/check_fp8.py`` compares them with the same float64 reference."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from distill_kit.config import TrainingConfig
from distill_kit.engines import fingerprint, fp8, kernels, models
from distill_kit.errors import ConfigError
from distill_kit.run.run_config import DEFAULT_TEACHER


def float64_fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """Row-wise FP8 written out in float64 from the spec: scale = amax / 448 rounded as the input's dtype rounds it,
    values rounded to the nearest e4m3, ties to the even code (found by a search over every finite e4m3 value, not
    by a cast). Ties are common: bf16 values over a bf16 scale often land halfway between two e4m3 values."""
    codes = torch.arange(256, dtype=torch.uint8)
    grid = codes.view(torch.float8_e4m3fn).double()
    finite = torch.isfinite(grid)
    grid, odd = grid[finite], (codes[finite] & 1).long()
    scale = (x.abs().amax(-1, keepdim=True) / 448).double()  # in x's dtype first, as torchao 0.18 computes it
    scaled = (x.double() / scale).clamp(-448, 448)
    distance = (scaled.unsqueeze(-1) - grid).abs()
    nearest = distance == distance.min(-1, keepdim=True).values
    return grid[((~nearest).long() * 2 + odd).argmin(-1)] * scale


def test_stand_in_linear_matches_float64_reference():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True, dtype=torch.bfloat16)
    x = torch.randn(5, 7, 64, dtype=torch.bfloat16) * 3
    expected = float64_fake_fp8(x) @ float64_fake_fp8(linear.weight.detach()).t() + linear.bias.double()
    got = fp8.FakeFloat8Linear(linear)(x).double()
    # The stand-in accumulates in float32 and rounds its output to bf16: at most half a bf16 ulp (2^-8 relative)
    # of each output plus float32 accumulation over 64 terms (~64 * 2^-24 of the terms' magnitude), well under 2^-7.
    assert torch.allclose(got, expected, rtol=2**-7, atol=1e-3)
    # The quantised weights match value for value.
    assert torch.equal(fp8.FakeFloat8Linear(linear).qdata.double() * fp8.FakeFloat8Linear(linear).scale.double(),
                       float64_fake_fp8(linear.weight.detach()))


def test_quantisation_error_is_what_fp8_costs():
    """The error FP8 adds is e4m3's (3 mantissa bits: at most 2^-4 relative per value), not a broken scale."""
    torch.manual_seed(1)
    w = torch.randn(32, 128, dtype=torch.bfloat16)
    q, scale = fp8.quantize_rows(w)
    back = q.float() * scale
    assert (back.abs().amax(-1) <= 448 * scale.squeeze(-1) * (1 + 2**-7)).all()
    relative = ((back - w.float()).abs() / w.float().abs().clamp_min(1e-3)).median()
    assert 0 < relative < 2**-4


def test_layer_by_layer_load_equals_whole_model_quantised(tmp_path):
    """Streaming the checkpoint a decoder layer at a time gives the same model as loading it whole, then
    quantising: same names, the tied head, RoPE's buffers; and its logits stay close to bf16's."""
    streamed = fp8.load(DEFAULT_TEACHER, torch.device("cpu"), backend="fake")
    whole = AutoModelForCausalLM.from_pretrained(DEFAULT_TEACHER, dtype=torch.bfloat16)
    bf16 = AutoModelForCausalLM.from_pretrained(DEFAULT_TEACHER, dtype=torch.bfloat16).eval()
    for layer in models.decoder_layers(whole):
        fp8.quantize_layer(layer, "fake")
    whole.eval()
    ids = torch.randint(0, whole.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = streamed(input_ids=ids).logits, whole(input_ids=ids).logits, bf16(input_ids=ids).logits
    assert torch.equal(a, b)
    assert streamed.lm_head.weight is streamed.model.embed_tokens.weight
    assert fp8.is_fp8(streamed) and not any(p.requires_grad for p in streamed.parameters())
    # FP8 moves the trained teacher's distribution a little (GPU, held-out text: KL 0.007 nats, benchmarks/RESULTS.md)
    p, q = c.float().log_softmax(-1), a.float().log_softmax(-1)
    assert (p.exp() * (p - q)).sum(-1).mean() < 0.05


def test_load_from_sharded_checkpoint_and_missing_tensor(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TEACHER, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="2MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    streamed = fp8.load(tmp_path / "sharded", torch.device("cpu"), backend="fake")
    reference = fp8.load(DEFAULT_TEACHER, torch.device("cpu"), backend="fake")
    ids = torch.arange(32)[None]
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, reference(input_ids=ids).logits)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.3.mlp.up_proj.weight"]
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="model.layers.3.mlp.up_proj.weight"):
        fp8.load(tmp_path / "sharded", torch.device("cpu"), backend="fake")


def test_fingerprint_covers_fp8_weights():
    quantised = fp8.load(DEFAULT_TEACHER, torch.device("cpu"), backend="fake")
    bf16 = AutoModelForCausalLM.from_pretrained(DEFAULT_TEACHER, dtype=torch.bfloat16)
    again = fp8.load(DEFAULT_TEACHER, torch.device("cpu"), backend="fake")
    assert fingerprint.teacher_fingerprint(quantised) == fingerprint.teacher_fingerprint(again)
    assert fingerprint.teacher_fingerprint(quantised) != fingerprint.teacher_fingerprint(bf16)


def test_config_names_and_auto():
    assert TrainingConfig().teacher_precision == "auto"
    assert fp8.resolve("auto", "bf16") == "bf16" and fp8.resolve("auto", "fp32") == "fp32"
    assert fp8.teacher_kernels("auto", "fp8") == "compile" and fp8.teacher_kernels("liger", "fp8") == "liger"
    assert fp8.teacher_kernels("auto", "bf16") == "auto"
    with pytest.raises(ValueError, match="teacher_precision='fp4'"):
        TrainingConfig(teacher_precision="fp4")
    # bf16 names a bf16 run's teacher; in an fp32 run it would silently run in fp32
    with pytest.raises(ValueError, match="teacher_precision 'bf16' with training.dtype 'fp32'.*set training.dtype"):
        TrainingConfig(teacher_precision="bf16")
    assert TrainingConfig(teacher_precision="bf16", dtype="bf16").teacher_precision == "bf16"
    from distill_kit.offline.capture import CaptureConfig  # the capture's config keeps the same rule

    with pytest.raises(ValueError, match="capture teacher_precision 'bf16' with dtype 'fp32'.*set dtype bf16"):
        CaptureConfig(dtype="fp32", teacher_precision="bf16")
    with pytest.raises(ValueError, match="capture teacher_precision must be auto, bf16 or fp8, got 'fp4'"):
        CaptureConfig(teacher_precision="fp4")


def test_refusals_before_loading(monkeypatch):
    # This CPU: no GPU, and the message names the key, the value and the fix.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"training.teacher_precision 'fp8': no CUDA GPU.*bf16 or auto"):
        fp8.check_teacher("fp8", "bf16", DEFAULT_TEACHER)
    fp8.check_teacher("auto", "bf16", DEFAULT_TEACHER)  # auto is bf16 here: nothing to refuse
    # A GPU without FP8 tensor cores (an A100), and one with them but without torchao.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "A100")
    with pytest.raises(ConfigError, match="compute capability 8.0"):
        fp8.check_teacher("fp8", "bf16", DEFAULT_TEACHER)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(fp8.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="torchao is not installed"):
        fp8.check_teacher("fp8", "bf16", DEFAULT_TEACHER)


def test_uncovered_architectures_are_refused():
    from transformers import GPT2Config

    gpt2 = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128)
    with pytest.raises(ConfigError, match="Conv1D"):
        fp8.check_teacher("fp8", "bf16", AutoModelForCausalLM.from_config(gpt2), backend="fake")
    odd = LlamaConfig(hidden_size=72, intermediate_size=200, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128)
    with pytest.raises(ConfigError, match="multiples of 16"):
        fp8.check_teacher("fp8", "bf16", AutoModelForCausalLM.from_config(odd), backend="fake")
    fp8.check_teacher("fp8", "bf16", DEFAULT_TEACHER, backend="fake")  # Llama, sizes of 16: covered


def test_too_large_for_one_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(fp8, "why_no_fp8_device", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"total_memory": 2**20})())
    with pytest.raises(ConfigError, match="replicated.*ZeRO-3"):
        fp8.check_teacher("fp8", "bf16", DEFAULT_TEACHER)


def test_weight_bytes_counts_one_byte_per_quantised_weight():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=100, tie_word_embeddings=False)
    skeleton = fp8.empty_model(config)
    linear = sum(m.weight.numel() + 4 * m.out_features for layer in models.decoder_layers(skeleton)
                 for m in layer.modules() if isinstance(m, nn.Linear))
    rest = 2 * (2 * 100 * 64 + 64 + 2 * 2 * 64)  # embeddings + head, final norm, two norms a layer, in bf16
    assert fp8.weight_bytes(skeleton) == linear + rest


def test_fp8_teacher_layers_alone_compile_with_torchaos_tuning(monkeypatch):
    """The inductor tuning torchao recommends (most of a cold compile) goes to an FP8 teacher's compiled layers
    only: torchao is asked not to set it for the whole process, where the student's fused loss would get it too."""
    import sys
    import types

    asked = []
    torchao = types.ModuleType("torchao.quantization")
    torchao.PerRow = lambda: "row"
    torchao.Float8DynamicActivationFloat8WeightConfig = lambda **kwargs: asked.append(kwargs)
    torchao.quantize_ = lambda layer, config: None
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.quantization", torchao)
    with pytest.raises(ConfigError, match="left these linear layers unquantised"):  # the stand-in quantised nothing
        fp8.quantize_layer(torch.nn.Sequential(torch.nn.Linear(16, 16)), "torchao")
    assert asked == [{"granularity": "row", "set_inductor_config": False}]

    compiled = {}
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: compiled.__setitem__(self, kwargs))
    teacher = fp8.load(DEFAULT_TEACHER, torch.device("cpu"), backend="fake")
    bf16 = AutoModelForCausalLM.from_pretrained(DEFAULT_TEACHER)
    for model in (teacher, bf16):
        kernels.apply(model, "compile")
    layers = models.decoder_layers(teacher)
    assert all(compiled[layer] == {"options": fp8.COMPILE_OPTIONS} for layer in layers)
    assert all(compiled[layer] == {"options": None} for layer in models.decoder_layers(bf16))
    assert len(compiled) == len(layers) + len(models.decoder_layers(bf16))


def test_the_compile_benchmark_runs_its_stand_in_on_the_cpu(monkeypatch):
    """benchmarks/fp8_compile.py's measurement with the tiny teacher and the CPU stand-in (eager: no compile)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fp8_compile

    result = fp8_compile.measure("eager", layers=1, batch=1, seq_len=8, pair="tiny")
    assert result["dynamo_unique_graphs"] == 0 and result["tokens"] == 8 and result["warm_forward_ms"] > 0

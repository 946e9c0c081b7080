"""Kernel choices per model: names and missing Liger fail before any work; what each choice patches.
(Speed and the patched teacher's logits on GPU are benchmarks: benchmarks/bench_step.py, RESULTS.md.)"""

import pytest
from tiny_models import gpt2_config
from transformers import GPT2LMHeadModel

from distill_kit import config
from distill_kit.config import TrainingConfig
from distill_kit.engines import kernels
from distill_kit.errors import ConfigError


def test_unknown_choice_and_missing_liger_are_config_errors(monkeypatch):
    with pytest.raises(ValueError, match="teacher_kernels 'fast' is not one of none, liger, compile, auto"):
        TrainingConfig(teacher_kernels="fast")
    monkeypatch.setattr(config, "liger_installed", lambda: False)
    with pytest.raises(ValueError, match=r"student_kernels 'liger' needs liger-kernel: pip install 'distill-kit\["):
        TrainingConfig(student_kernels="liger")
    with pytest.raises(ConfigError, match="needs liger-kernel"):
        kernels.check_model_type("liger", "qwen2", "training.teacher_kernels")
    assert kernels.resolve("auto", GPT2LMHeadModel(gpt2_config(16, 1))) == "none"  # no Liger: auto is plain


def test_liger_patches_the_instance_with_its_own_function_and_refuses_other_architectures(monkeypatch):
    calls = []

    def patch_gpt2(model=None, rope=True, rms_norm=True, swiglu=True, cross_entropy=True,
                   fused_linear_cross_entropy=True):
        calls.append((model, rope, rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy))

    monkeypatch.setattr(config, "liger_installed", lambda: True)
    monkeypatch.setattr(kernels, "_liger_patchers", lambda: {"gpt2": patch_gpt2, "qwen2": patch_gpt2})
    model = GPT2LMHeadModel(gpt2_config(16, 1))
    assert kernels.apply(model, "liger") == "liger"
    assert calls == [(model, True, True, True, False, False)]  # the losses own the loss: no Liger cross-entropy
    kernels.apply(model, "liger", liger={"rope": False})  # a sampling student's teacher (kernels.teacher_liger)
    assert calls[1] == (model, False, True, True, False, False)
    with pytest.raises(ConfigError, match=r"no kernels for model type 'bert' \(it supports gpt2, qwen2\); set "
                                          "training.student_kernels to 'none' or 'compile'"):
        kernels.check_model_type("liger", "bert", "training.student_kernels")


def test_compile_wraps_each_decoder_layer_only():
    model = GPT2LMHeadModel(gpt2_config(16, 2))
    assert kernels.apply(model, "compile") == "compile"
    compiled = [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert compiled == ["transformer.h.0", "transformer.h.1"]
    assert kernels.apply(GPT2LMHeadModel(gpt2_config(16, 1)), "none") == "none"


def test_what_models_are_called_with_compiles_identical_layers_once():
    """``Student.inputs`` (every scoring forward's arguments, teachers' too) ask for no KV cache: with one, each
    layer's cache state is guarded on and every compiled layer recompiles, past dynamo's limit of 8 running the rest
    eagerly (an FP8 teacher's cold compile took minutes for it). Counted with dynamo's own counting backend."""
    from types import SimpleNamespace

    import torch
    from tiny_models import qwen2_config
    from torch._dynamo.testing import CompileCounter
    from transformers import Qwen2ForCausalLM

    from distill_kit.training.student import Student

    torch._dynamo.reset()
    model = Qwen2ForCausalLM(qwen2_config(num_hidden_layers=4)).eval()
    counter = CompileCounter()
    for layer in model.model.layers:
        layer.compile(backend=counter)
    loss = SimpleNamespace(needs_hidden_states=False, needs_attentions=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    student = SimpleNamespace(loss=loss, reads_teacher_features=False)
    inputs = Student.inputs(student, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    with torch.no_grad():
        model(**inputs)
        assert counter.frame_count == 1  # one graph shared by the four layers
        model(**inputs | {"use_cache": True})
    assert counter.frame_count > 2  # the test can see the per-layer recompiles a cache brings
    torch._dynamo.reset()


def test_liger_leaves_later_models_of_the_architecture_alone(monkeypatch):
    """Liger rebinds the modeling file's classes as well as patching the instance; every rebinding but RoPE's is
    put back, so a model built afterwards (the next Distiller's teacher) keeps its own kernels choice."""
    from transformers.models.gpt2 import modeling_gpt2

    original_mlp = modeling_gpt2.GPT2MLP
    monkeypatch.setattr(modeling_gpt2, kernels.ROPE, "hf rope", raising=False)

    def patch_gpt2(model=None, rope=True, rms_norm=True, swiglu=True):
        modeling_gpt2.GPT2MLP = "liger mlp"  # what Liger does to the architecture's classes
        if rope:
            setattr(modeling_gpt2, kernels.ROPE, "liger rope")

    monkeypatch.setattr(config, "liger_installed", lambda: True)
    monkeypatch.setattr(kernels, "_liger_patchers", lambda: {"gpt2": patch_gpt2})
    kernels.apply(GPT2LMHeadModel(gpt2_config(16, 1)), "liger")
    assert modeling_gpt2.GPT2MLP is original_mlp
    assert getattr(modeling_gpt2, kernels.ROPE) == "liger rope"  # the instance calls it through the module

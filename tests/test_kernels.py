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
    kernels.apply(model, "liger", liger={"rope": False})  # a sampling student's teacher (on_policy.teacher_liger)
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

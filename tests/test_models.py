"""transformers' process-wide DeepSpeed config points at the right engine's config only while it loads."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from tiny_models import save_pair
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.integrations import deepspeed as hf_deepspeed

from distill_kit.engines import models

ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
ZERO2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}


def test_switches_to_zero3_only_inside_and_restores_the_users_config():
    users = hf_deepspeed.HfDeepSpeedConfig(dict(ZERO2))  # a user's own config, set before ours
    try:
        with models.active_transformers_config(ZERO3):
            assert hf_deepspeed.is_deepspeed_zero3_enabled()
            assert hf_deepspeed.deepspeed_config()["zero_optimization"]["stage"] == 3
        assert hf_deepspeed.deepspeed_config() is users.config
        with models.active_transformers_config(ZERO2):
            assert hf_deepspeed.deepspeed_config() is None  # ZeRO-2 loads are plain: nothing partitions
        assert hf_deepspeed.deepspeed_config() is users.config
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()


def test_restores_even_when_loading_fails():
    with pytest.raises(RuntimeError), models.active_transformers_config(ZERO3):
        raise RuntimeError("boom")
    assert not hf_deepspeed.is_deepspeed_zero3_enabled()


def test_hidden_size_from_path_or_module(tmp_path):
    teacher, _ = save_pair(tmp_path)
    assert models.hidden_size(teacher) == 64
    assert models.hidden_size(GPT2LMHeadModel(GPT2Config(n_embd=48, n_layer=1, n_head=4))) == 48


def test_missing_model_path_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        models.hidden_size(tmp_path / "no-such-model")


def _said(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "distill_kit.engines.models"]


def _tiny(dtype: torch.dtype) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)).to(dtype)


@pytest.mark.parametrize(("given", "run"), [(torch.bfloat16, "fp32"), (torch.float32, "bf16"),
                                            (torch.bfloat16, "fp16")])
def test_a_module_in_another_dtype_is_cast_to_the_runs_as_a_folder_is_loaded(given, run, caplog):
    """A folder is loaded in ``training.dtype``; a module given built is cast to it (in place, its values kept to
    the new dtype's rounding) with one info line naming both dtypes and the setting that keeps its own."""
    module = _tiny(given)
    before = module.transformer.wte.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="distill_kit.engines.models"):
        loaded = models.load(module, {}, run)
    assert loaded is module
    assert {p.dtype for p in module.parameters()} == {models.TORCH_DTYPES[run]}
    torch.testing.assert_close(module.transformer.wte.weight, before.to(models.TORCH_DTYPES[run]), rtol=0, atol=0)
    (line,) = _said(caplog)
    name = str(given).removeprefix("torch.")
    assert line.startswith(f"GPT2LMHeadModel given as a module in {name}: cast to the run's training.dtype {run}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="distill_kit.engines.models"):
        assert models.load(module, {}, run) is module  # in the run's dtype already: as it is, without a word
    assert not _said(caplog)


def test_a_bf16_student_module_trains_in_fp32_in_an_fp32_run(caplog):
    """Through the Distiller: the bf16 student is cast before its engine is built, so it trains in fp32 (DeepSpeed
    keeps no fp32 master copy of an fp32 run's weights: left in bf16 it would train in bf16)."""
    from distill_kit import Distiller, TrainingConfig

    student, teacher = _tiny(torch.bfloat16), _tiny(torch.float32)
    with caplog.at_level(logging.INFO, logger="distill_kit.engines.models"):
        distiller = Distiller(student, teacher, training=TrainingConfig(max_steps=1, lr=1e-2, dtype="fp32"))
    assert any("given as a module in bfloat16: cast to the run's training.dtype fp32" in m for m in _said(caplog))
    assert {p.dtype for p in distiller.student_model.parameters()} == {torch.float32}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    before = distiller.student_model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    (record,) = distiller.train([{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}])
    assert math.isfinite(record["loss"])
    after = distiller.student_model.transformer.h[0].mlp.c_fc.weight
    assert after.dtype == torch.float32 and not torch.equal(after, before)

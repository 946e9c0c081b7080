"""transformers' process-wide DeepSpeed config points at the right engine's config only while it loads."""

from __future__ import annotations

import pytest
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

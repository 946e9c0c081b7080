"""The teacher/student pairs the step benchmark distils, built random-initialised in their engines' layout.

Step time depends on shapes, not on what the weights learned, and the GPU machine cannot download
checkpoints; so the models are built from configs with random weights. A ZeRO-3 model is built under
transformers' ZeRO-3 context (``zero.Init``), so a 7.6B teacher never exists whole on any rank, exactly
as ``from_pretrained`` would place a real one; any other model is built directly on its device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

from distill_kit.engines.deepspeed_config import zero_stage
from distill_kit.engines.models import TORCH_DTYPES, active_transformers_config

QWEN2_VOCAB = 151_936
QWEN2_72B_VOCAB = 152_064  # Qwen2-72B's embedding is padded past the tokenizer's 151,936 ids


def qwen2(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
          tied: bool) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
        max_position_embeddings=32_768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, use_cache=False,
    )


def llama32_1b() -> LlamaConfig:
    """Llama-3.2-1B's shape (1.24B parameters, tied embeddings), as in meta-llama/Llama-3.2-1B-Instruct's
    config.json (copied in kevinstephano/thunder_model_blocks, hf_llama/llama_config.py)."""
    return LlamaConfig(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, max_position_embeddings=131_072,
        rope_theta=500_000.0, rms_norm_eps=1e-5, use_cache=False,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )


QWEN2_05B = qwen2(896, 4864, 24, 14, 2, QWEN2_VOCAB, tied=True)
"""Qwen2-0.5B's shape (0.49B parameters, tied embeddings): the student of every Qwen2 pair."""


@dataclass(frozen=True)
class Pair:
    teacher: PretrainedConfig
    student: PretrainedConfig
    description: str


PAIRS: dict[str, Pair] = {
    # Qwen2-7B and Qwen2-0.5B shapes (both cut to the tokenizer's 151,936 ids): 7.6B and 0.49B parameters.
    "qwen2-7b-0.5b": Pair(qwen2(3584, 18944, 28, 28, 4, QWEN2_VOCAB, tied=False), QWEN2_05B,
                         "Qwen2-7B-shaped teacher, Qwen2-0.5B-shaped student"),
    # A teacher no single GPU holds with the student: Qwen2-72B's shape (72.7B parameters, 135 GiB in bf16),
    # its vocabulary padded to 152,064 as the real one is (the losses cut it to the student's 151,936).
    "qwen2-72b-0.5b": Pair(qwen2(8192, 29568, 80, 64, 8, QWEN2_72B_VOCAB, tied=False), QWEN2_05B,
                          "Qwen2-72B-shaped teacher, Qwen2-0.5B-shaped student"),
    # The largest teacher that fits one H200 in bf16 beside the student, for either framework (bench_peers.py):
    # Qwen2.5-32B's shape (32.8B parameters, 61 GiB in bf16), its vocabulary cut to the student's 151,936 ids as the
    # 7B pair's is (TRL's losses take one vocabulary for both models).
    "qwen2-32b-0.5b": Pair(qwen2(5120, 27648, 64, 40, 8, QWEN2_VOCAB, tied=False), QWEN2_05B,
                          "Qwen2.5-32B-shaped teacher, Qwen2-0.5B-shaped student"),
    # Qwen2-1.5B teacher for a quicker look at the same student.
    "qwen2-1.5b-0.5b": Pair(qwen2(1536, 8960, 28, 12, 2, QWEN2_VOCAB, tied=True), QWEN2_05B,
                           "Qwen2-1.5B-shaped teacher, Qwen2-0.5B-shaped student"),
    # The shape TRL published its distillation speed at (huggingface/trl PR #6942: Llama 3.2 1B student and teacher,
    # bf16, sequence 1024, batch 32, one H100, 26.8k tokens/s uncompiled): a same-size pair, the loss's share at its
    # largest (vocabulary 128,256 against hidden 2048).
    "llama3.2-1b-1b": Pair(llama32_1b(), llama32_1b(), "Llama-3.2-1B-shaped teacher and student (TRL PR #6942)"),
    # The CPU smoke run: every code path, seconds per step.
    "tiny": Pair(
        qwen2(64, 128, 2, 4, 2, 256, tied=False),
        qwen2(32, 64, 1, 4, 2, 256, tied=True),
        "tiny Qwen2 pair for the CPU smoke test",
    ),
}


def build(config: Qwen2Config, ds_config: Mapping[str, Any], dtype: str, device: torch.device,
          attn_implementation: str) -> nn.Module:
    """A random-initialised causal LM, partitioned at construction when ``ds_config`` is ZeRO-3."""
    placement = contextlib.nullcontext() if zero_stage(ds_config) == 3 else torch.device(device)
    with active_transformers_config(ds_config), placement:
        return AutoModelForCausalLM.from_config(
            config, dtype=TORCH_DTYPES[dtype], attn_implementation=attn_implementation
        )


def parameter_count(model: nn.Module) -> int:
    """All parameters, tied ones once, whether or not ZeRO-3 has partitioned them (``ds_numel`` is the full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())

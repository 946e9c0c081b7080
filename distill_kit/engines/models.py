"""Load teacher and student so that each lands in the right ZeRO layout.

transformers decides whether ``from_pretrained`` builds a model inside ``deepspeed.zero.Init`` (weights go
straight into shards) by looking at one process-wide DeepSpeed config. With two engines in one process that
global must point at the teacher's ZeRO-3 config while the teacher loads, and at the student's config (or
none) while the student loads; otherwise a ZeRO-2 student gets partitioned, or a 70B teacher
materialises whole on every rank. :func:`active_transformers_config` does that switch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.integrations import deepspeed as hf_deepspeed

from distill_kit.engines.deepspeed_config import zero_stage

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

logger = logging.getLogger(__name__)

ModelSource = str | Path | nn.Module


@contextmanager
def active_transformers_config(ds_config: Mapping[str, Any] | None) -> Iterator[None]:
    """Make ``ds_config`` transformers' DeepSpeed config inside the block (only ZeRO-3 matters to it).

    transformers keeps the config behind a module-level weak reference; the previous one is put back on
    exit so that a user's own ``HfDeepSpeedConfig`` outlives ours.
    """
    previous = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    holder = hf_deepspeed.HfDeepSpeedConfig(dict(ds_config)) if ds_config and zero_stage(ds_config) == 3 else None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = previous
        del holder


def model_config(source: ModelSource) -> PretrainedConfig | None:
    """The model's config without loading weights (needed to fill ZeRO bucket sizes before loading)."""
    if isinstance(source, nn.Module):
        return getattr(source, "config", None)
    if isinstance(source, PretrainedConfig):  # a plan made before the model exists (run/validate.py)
        return source
    try:
        return AutoConfig.from_pretrained(source)
    except OSError as err:
        raise FileNotFoundError(
            f"cannot load model config from {str(source)!r}: {err}. Pass a directory written by "
            "save_pretrained (with config.json), a hub name where the hub is reachable, or an nn.Module."
        ) from err


def facts(source: ModelSource) -> dict[str, int | None]:
    """Width and depth, read from the config: ZeRO bucket sizes and hidden-state losses are sized by them."""
    config = model_config(source)
    if config is None:
        return {"hidden_size": None, "num_layers": None}
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {
        "hidden_size": getattr(config, "hidden_size", None) or getattr(config, "n_embd", None),
        "num_layers": getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None),
    }


def positions(config: Any) -> int | None:
    """How many positions a model's config says it reads (None when it does not say): the longest row it takes."""
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def end_token(generation_config: Any, model_config: Any) -> int | None:
    """The token a sample ends at: the generation config's ``eos_token_id``, else the model config's; the first of
    a list. The sampler reads it from the model, a teacher's card and the start-up checks from its folder."""
    eos = getattr(generation_config, "eos_token_id", None)
    eos = eos if eos is not None else getattr(model_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return None if eos is None else int(eos)


def model_type(source: ModelSource) -> str | None:
    """The architecture's name in its config (``qwen2``, ``gpt2``), for checks made before loading."""
    return getattr(model_config(source), "model_type", None)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks the model names in ``_no_split_modules``: what ``kernels: compile`` compiles one by one
    and an FP8 teacher quantises (and loads) one by one."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def parameter_count(config: PretrainedConfig) -> int:
    """Parameters of the model ``config`` describes, counted on the meta device (no memory, no time); transformers'
    own error when the config builds no model."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def fresh_student(config: PretrainedConfig, seed: int) -> nn.Module:
    """A model of ``config`` with fresh weights drawn from ``seed``: the same weights wherever it is built."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def has_tokenizer(source: Any) -> bool:
    """A local folder holding a tokenizer (what tokenizer rules compare; a hub name cannot be read offline)."""
    return isinstance(source, str | Path) and any((Path(source) / f).is_file()
                                                  for f in ("tokenizer_config.json", "tokenizer.json"))


def generation_config(source: Any) -> Any:
    """A model folder's ``generation_config.json`` (its end token may differ from the config's), or None."""
    if not (isinstance(source, str | Path) and (Path(source) / "generation_config.json").is_file()):
        return getattr(source, "generation_config", None) if isinstance(source, nn.Module) else None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source)
    except Exception:  # noqa: BLE001 - an unreadable generation config: the model config's end token
        return None


def hidden_size(source: ModelSource) -> int | None:
    return facts(source)["hidden_size"]


def load(source: ModelSource, ds_config: Mapping[str, Any], dtype: str, need_attentions: bool = False,
         config: PretrainedConfig | None = None) -> nn.Module:
    """A causal LM from a path or hub name, built under ``ds_config``'s ZeRO layout, in ``dtype``; a module given
    built is cast to ``dtype`` as a path is loaded in it (:func:`in_dtype`). ``config``: its config as the plan read
    it (so a run reads each model's config once); None reads it here.

    Fused attention kernels (SDPA, flash) return no attention maps, so a loss that needs them gets eager
    attention, and every other run keeps the fast default.
    """
    if isinstance(source, nn.Module):
        return in_dtype(source, dtype)
    kwargs = {"attn_implementation": "eager"} if need_attentions else {}
    if config is not None:
        kwargs["config"] = config
    with active_transformers_config(ds_config):
        return AutoModelForCausalLM.from_pretrained(source, dtype=TORCH_DTYPES[dtype], **kwargs)


def in_dtype(model: nn.Module, dtype: str) -> nn.Module:
    """A model given as a module, in the run's ``dtype`` (``training.dtype``), as a path is loaded in it: its
    floating-point weights cast in place, with one info line naming both dtypes (a bf16 module would otherwise train
    in an fp32 run with bf16 weights and no fp32 master copy: DeepSpeed casts only into bf16 and fp16). A module in
    ``dtype`` already is returned as it is."""
    wanted = TORCH_DTYPES[dtype]
    found = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                    if p.is_floating_point() and p.dtype != wanted})
    if found:
        logger.info("%s given as a module in %s: cast to the run's training.dtype %s, as a model loaded from a "
                    "folder is (set training.dtype: %s to train in its own)", type(model).__name__, "/".join(found),
                    dtype, {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(found[0], found[0]))
        model.to(wanted)
    return model

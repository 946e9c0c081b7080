"""PEFT students: a frozen pretrained model plus small trained adapters (LoRA), through the ``peft`` library.

Distilling into a model that is already good usually means training adapters, not the whole model (TRL,
ms-swift and torchtune do the same): the base weights stay frozen and replicated, and only the adapters'
parameters reach the ZeRO-2 optimizer, so its fp32 master copy, Adam moments and gradients are sized to the
adapters. The adapters are ``peft``'s own modules (``get_peft_model``), not written here; this file only
turns a run config's ``peft: {r, alpha, dropout, target_modules}`` into a ``peft.LoraConfig`` and writes the
export (the adapter folder, and on request the merged model).

What the rest of the kit does with such a student:

- the engine (``engines/build.py``) trains the parameters that require gradients: the adapters (and the loss
  module's own, e.g. a hidden-state projection);
- checkpoints (``training/checkpoint.py``) keep only the trained parameters and the optimizer state; the frozen
  base comes from the model's source on resume, and its sha256 in the manifest makes sure it is the same one;
- hidden-state and attention losses read ``hidden_states`` / ``attentions`` from the wrapped model's output,
  which ``PeftModel`` passes through unchanged, and the model facts (width, depth) from the base config.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distill_kit.config import AdapterConfig

INSTALL_HINT = "install it with `pip install peft` (or `pip install distill-kit[peft]`)"




PeftSpec = AdapterConfig | Mapping[str, Any] | Any
"""An :class:`AdapterConfig`, a mapping of its fields (a run config's ``peft:``), or any ``peft.PeftConfig``."""


def require_peft() -> Any:
    """The ``peft`` module, or an ImportError that says how to install it."""
    try:
        import peft
    except ImportError as err:
        raise ImportError(f"a student with `peft:` adapters needs the peft library: {INSTALL_HINT}") from err
    return peft


def lora_config(config: AdapterConfig) -> Any:
    """The ``peft.LoraConfig`` for a causal LM."""
    targets = config.target_modules if isinstance(config.target_modules, str) else list(config.target_modules)
    return require_peft().LoraConfig(r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                     target_modules=targets, task_type="CAUSAL_LM")


def adapter_config(spec: PeftSpec) -> Any:
    """``spec`` as a ``peft.PeftConfig``; unknown keys of a mapping are errors naming the valid ones."""
    if isinstance(spec, AdapterConfig):
        return lora_config(spec)
    if isinstance(spec, Mapping):
        fields = [f.name for f in dataclasses.fields(AdapterConfig)]
        unknown = sorted(set(spec) - set(fields))
        if unknown:
            raise ValueError(f"unknown peft keys {unknown}; a peft entry has {', '.join(fields)}")
        return lora_config(AdapterConfig(**spec))
    if isinstance(spec, require_peft().PeftConfig):
        return spec
    raise TypeError(f"peft must be an AdapterConfig, a mapping of its fields or a peft.PeftConfig, got {spec!r}")


def wants_merged_export(spec: PeftSpec | None) -> bool:
    if isinstance(spec, AdapterConfig):
        return spec.export_merged
    return bool(isinstance(spec, Mapping) and spec.get("export_merged", False))


def check(spec: PeftSpec, zero_stage: int) -> Any:
    """The ``peft.PeftConfig`` for ``spec``, checked before anything loads.

    ZeRO-3 is refused: it would shard the frozen base and gather it every forward and backward for adapters a
    fraction of its size; a frozen base has no optimizer state for ZeRO-2 to shard, so ZeRO-2 costs only the
    replicated base weights (in the run's dtype) and is faster.
    """
    if zero_stage == 3:
        raise ValueError("a PEFT student trains under ZeRO stage 0-2 (its frozen base is replicated, only the "
                         "adapters are trained and sharded); set the student's zero_optimization.stage to 2")
    return adapter_config(spec)


def check_targets(config: Any, model_config: Any) -> None:
    """Every ``target_modules`` name of the ``peft.PeftConfig`` is a module of the student (a model built on the
    meta device from its config, no weights); a string target ('all-linear', a regex) is peft's to resolve, as is a
    model transformers cannot build from its config. A ``ValueError`` naming the student's linear layers otherwise."""
    targets = getattr(config, "target_modules", None)
    if model_config is None or targets is None or isinstance(targets, str):
        return
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
    except Exception:  # noqa: BLE001 - peft reports its own error when it wraps the model
        return
    names = {name for name, _ in model.named_modules()}
    missing = [t for t in sorted(targets) if t not in names | {n.rpartition(".")[2] for n in names}]
    if missing:
        linear = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                         if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
        raise ValueError(f"target_modules: {missing} name no module of the student; its linear layers are {linear} "
                         "(or use 'all-linear')")


def wrap(model: nn.Module, config: Any) -> nn.Module:
    """``model`` with adapters added by ``peft.get_peft_model``: base frozen, adapters trainable."""
    return require_peft().get_peft_model(model, config)


def is_peft(module: nn.Module) -> bool:
    """Whether ``module`` (a student, or the engine's ``StudentWithLoss`` around one) carries PEFT adapters."""
    student = getattr(module, "student", module)
    return hasattr(student, "peft_config") and hasattr(student, "get_base_model")


_FROZEN_SHA256: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def frozen_parameters_sha256(module: nn.Module) -> str:
    """sha256 of the frozen parameters (names, shapes, dtypes, values): the base a checkpoint's adapters need.

    Computed once per module (frozen weights do not change). Only called for stage 0-2 students, whose weights
    are whole on every rank (no gathering).
    """
    if module in _FROZEN_SHA256:
        return _FROZEN_SHA256[module]
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        if not param.requires_grad:
            values = param.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{name}|{tuple(param.shape)}|{values.dtype}|".encode())
            digest.update(values.view(torch.uint8).numpy().tobytes())
    _FROZEN_SHA256[module] = digest.hexdigest()
    return _FROZEN_SHA256[module]


def parameter_counts(module: nn.Module) -> dict[str, int]:
    """Trained and frozen parameter counts of a module (e.g. the engine's module)."""
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return {"trained": trained, "frozen": frozen}


def export(model: nn.Module, directory: str | Path, tokenizer: Any | None, merged: bool) -> Path:
    """Write the adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) to ``directory``, and
    with ``merged`` the base with the adapters folded in (``merge_and_unload``) to ``directory/merged``.

    Call on rank 0 only; the engine's model is left untouched (the merge happens on a CPU copy).
    """
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if merged:
        with torch.no_grad():
            copy_on_cpu = copy.deepcopy(model).to("cpu")
            base = copy_on_cpu.merge_and_unload()
        base.save_pretrained(directory / "merged", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory / "merged")
    return directory

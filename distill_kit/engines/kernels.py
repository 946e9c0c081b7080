"""Faster kernels for a loaded model, chosen per model: ``none``, ``liger``, ``compile`` or ``auto``.

* ``liger``: Liger-Kernel's Triton RoPE, RMSNorm and SwiGLU (``pip install distill-kit[liger]``), patched into
  the model instance by Liger's own per-architecture function (its cross-entropy kernels stay off: the losses
  own the loss). RMSNorm and SwiGLU are patched on this instance's modules (the classes Liger also rebinds in
  the modeling file are put back); RoPE is a function of the architecture's modeling file, so Liger replaces it
  for every model of that architecture in the process.
  The patched modules keep their parameters and their ZeRO-3 hooks, so a sharded teacher still gathers its
  shards layer by layer. Measured on 2 x H200 (``benchmarks/RESULTS.md``): the teacher's forward 16% faster.
* ``compile``: ``torch.compile`` on each decoder layer (the classes the model names in ``_no_split_modules``),
  so the embedding, head and ZeRO's hooks between layers stay eager.
* ``auto``: ``liger`` on a CUDA machine where Liger is installed and supports the architecture, else ``none``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from distill_kit import config
from distill_kit.engines import fp8, models
from distill_kit.errors import ConfigError

LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}


def beside(teacher_kernels: str) -> dict[str, bool]:
    """Liger options for a student whose teacher runs ``teacher_kernels``: no RoPE kernel beside a compiled
    teacher. Liger's RoPE replaces a function of the architecture's modeling file for the whole process, so a
    teacher of the student's architecture would run it too, inside its compiled layers, where dynamo cannot trace
    it and breaks each layer's graph around it."""
    return {"rope": False} if teacher_kernels == "compile" else {}


def student_samples(on_policy: config.OnPolicyConfig) -> bool:
    """The student samples (``training.on_policy``): its compiled decode step is what some kernels break."""
    return on_policy.fraction > 0 and on_policy.sampler == "student"


def teacher_liger(on_policy: config.OnPolicyConfig) -> dict[str, bool]:
    """Liger options for the teacher when the student samples: no RoPE kernel. Liger's RoPE replaces a function of
    the architecture's modeling file, so a student of the teacher's architecture runs it too, and in the student's
    compiled decode step it breaks the graph in every layer: torch.compile recompiles the rest of the layer per
    layer index until its limit (8) and runs the others eagerly (the cost: benchmarks/RESULTS.md). The teacher
    keeps Liger's RMSNorm and SwiGLU."""
    return {"rope": False} if student_samples(on_policy) else {}


def _error(message: str) -> ValueError:
    """A ``ConfigError``: the CLI reports it without a traceback."""
    return ConfigError(message)


def _liger_patchers() -> dict:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN


def check_model_type(choice: str, model_type: str | None, key: str = "kernels") -> None:
    """Before loading: a ``ConfigError`` if ``choice`` cannot be had for this architecture."""
    try:
        config.check_kernels(choice, key)
    except ValueError as err:
        raise _error(str(err)) from None
    if choice == "liger" and model_type not in _liger_patchers():
        raise _error(f"{key} 'liger': liger-kernel has no kernels for model type {model_type!r} (it supports "
                     f"{', '.join(sorted(_liger_patchers()))}); set {key} to 'none' or 'compile'")


def resolve(choice: str, model: nn.Module, key: str = "kernels") -> str:
    """The kernels ``choice`` means for ``model`` here (``auto`` decided); a ``ConfigError`` if it cannot be had."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    check_model_type(choice, model_type, key)
    if choice == "auto":
        usable = torch.cuda.is_available() and config.liger_installed() and model_type in _liger_patchers()
        return "liger" if usable else "none"
    if choice == "compile" and not models.decoder_layers(model):
        raise _error(f"{key} 'compile' found no decoder layers in {type(model).__name__} (none of the classes in its "
                     f"_no_split_modules); set {key} to 'none'")
    return choice


def apply(model: nn.Module, choice: str, key: str = "kernels", liger: Mapping[str, bool] | None = None) -> str:
    """Patch ``model`` in place with the kernels ``choice`` resolves to; returns what was applied. ``liger``
    overrides entries of ``LIGER_KERNELS`` (e.g. ``{"rope": False}``)."""
    applied = resolve(choice, model, key)
    if applied == "liger":
        patch = _liger_patchers()[model.config.model_type]
        accepted = inspect.signature(patch).parameters
        with _instance_only(model):
            patch(model=model, **{k: v for k, v in (LIGER_KERNELS | dict(liger or {})).items() if k in accepted})
    elif applied == "compile":
        options = fp8.compile_options(model)  # an FP8 teacher's tuning, for its layers alone
        for layer in models.decoder_layers(model):
            layer.compile(options=options)
    return applied


ROPE = "apply_rotary_pos_emb"
"""The one name of a modeling file that Liger's patch must leave replaced: the model calls it from there."""


@contextlib.contextmanager
def _instance_only(model: nn.Module) -> Iterator[None]:
    """Liger's patch with ``model=`` patches that instance's norms and MLPs, and also rebinds the classes of the
    architecture's modeling file (``Qwen2RMSNorm``, ``Qwen2MLP``, ...), so that every model of that architecture
    built later in the process - the next Distiller's teacher, a benchmark's next run - would get Liger's modules
    whatever its own kernels choice. Every name it rebinds is put back but RoPE, a function the patched instance
    calls through the module."""
    module = inspect.getmodule(type(model))
    before = dict(vars(module)) if module is not None else {}
    try:
        yield
    finally:
        for name, value in before.items():
            if name != ROPE and getattr(module, name, None) is not value:
                setattr(module, name, value)


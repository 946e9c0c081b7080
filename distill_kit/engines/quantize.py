"""A quantized student: ``students[i].quantize``, through torchao's quantization-aware training (QAT).

Served models run in 4 and 8 bits, and quantising a model after training (PTQ) loses accuracy that training can win
back. Here the student trains with every linear layer of its decoder layers *fake-quantised*: torchao's
``QATConfig(base, step="prepare")`` swaps each ``nn.Linear`` for a ``FakeQuantizedLinear`` whose forward rounds the
weight (and, for the dynamic-activation schemes, each token's input) to the scheme's grid and back, in the training
dtype, with a straight-through gradient. At export ``QATConfig(base, step="convert")`` turns the same layers into
real low-bit weights with the *same* torchao PTQ config, so the exported model computes what the student trained on
(``tests/test_quantize.py`` checks both bitwise on the CPU). Nothing here rounds a number by hand.

What stays in high precision, and why: the embeddings, the norms and the output head. The head decides the logits
every distillation loss compares, is one matmul in many, and is what the fused loss (``losses/fused.py``) applies
chunk by chunk from ``lm_head.weight`` directly: kept unquantised, that path stays exact. The same choice as the FP8
teacher (``engines/fp8.py``) and torchao's own Hugging Face recipes (``modules_to_not_convert: [lm_head]``).

The schemes and their torchao PTQ configs (:func:`base_config`):

- ``int4_weight_only``: ``IntxWeightOnlyConfig(int4, PerGroup(group_size))``, symmetric int4 weights with a scale
  per group; runs on any device (exported as ``IntxUnpackedToInt8Tensor``: one int4 value per byte on disk).
  torchao's ``Int4WeightOnlyConfig`` (packed, GPU kernels) needs the ``mslk`` kernels and a CUDA device to convert,
  and is not used so that one scheme trains, exports and loads the same way everywhere.
- ``int8_dynamic_act_int4_weight``: ``Int8DynamicActivationIntxWeightConfig(int4, PerGroup(group_size))``, the same
  weights and each token's activations in asymmetric int8 (ExecuTorch's and torchao's "8da4w").
- ``fp8``: ``Float8DynamicActivationFloat8WeightConfig(PerRow())``, e4m3 weights and activations, a scale per row:
  converting needs a CUDA GPU of compute capability 8.9+.
- ``nvfp4`` / ``mxfp4``: torchao's prototype MX formats (4-bit floats in blocks of 16 / 32 with FP8 / E8M0 block
  scales): Blackwell (compute capability 10.0+).

Refusals (:func:`problems`, called by the plan before anything is written): a scheme this device cannot run (saying
which can), a scheme the installed torchao cannot convert, a student with no ``nn.Linear`` in its decoder layers
(GPT-2's ``Conv1D``), a group size that does not divide every quantised layer's input width, a ZeRO-3 student, and
LoRA adapters on a quantized student (merging adapters into quantized weights is not what was trained:
docs/quantized_students.md).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distill_kit.config import QUANT_SCHEMES, QuantizeConfig
from distill_kit.engines import models

CPU_SCHEMES = ("int4_weight_only", "int8_dynamic_act_int4_weight")
"""Schemes whose fake quantisation, conversion and quantized forward run on any device (the CPU included)."""
MIN_CAPABILITY = {"fp8": (8, 9), "nvfp4": (10, 0), "mxfp4": (10, 0)}
"""The compute capability each floating-point scheme's kernels need: FP8 tensor cores (Ada, Hopper and later), FP4
tensor cores (Blackwell)."""
BLOCK = {"nvfp4": 16, "mxfp4": 32}
"""The formats' own block sizes (inputs sharing one scale): fixed by NVFP4 and the OCP MX specification."""
INT4 = ("int4_weight_only", "int8_dynamic_act_int4_weight")
BASE_CONFIGS = {
    "int4_weight_only": ("torchao.quantization", "IntxWeightOnlyConfig"),
    "int8_dynamic_act_int4_weight": ("torchao.quantization", "Int8DynamicActivationIntxWeightConfig"),
    "fp8": ("torchao.quantization", "Float8DynamicActivationFloat8WeightConfig"),
    "nvfp4": ("torchao.prototype.mx_formats", "NVFP4DynamicActivationNVFP4WeightConfig"),
    "mxfp4": ("torchao.prototype.mx_formats", "MXDynamicActivationMXWeightConfig"),
}
"""Where each scheme's torchao PTQ config lives: what QAT infers its fake quantisers from and converts with."""
SAVED_TENSORS = {"int4_weight_only": "IntxUnpackedToInt8Tensor", "int8_dynamic_act_int4_weight":
                 "IntxUnpackedToInt8Tensor", "fp8": "Float8Tensor", "nvfp4": "NVFP4Tensor", "mxfp4": "MXTensor"}
"""The torchao tensor each scheme's converted weights are, which torchao's safetensors support must list for the
export to be written without pickle."""
INSTALL_HINT = "pip install 'torchao==0.18.0' (or pip install 'distill-kit[quantize]')"


# ---- the torchao configs --------------------------------------------------------------------------------------


def require_torchao() -> Any:
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(f"students[].quantize needs torchao: {INSTALL_HINT}")
    import torchao

    return torchao


def base_config(quantize: QuantizeConfig) -> Any:
    """The torchao PTQ config of ``quantize``'s scheme: what QAT's prepare step infers the fake quantisers from, what
    its convert step applies, and what the exported folder's ``quantization_config`` names."""
    require_torchao()
    module, name = BASE_CONFIGS[quantize.scheme]
    cls = getattr(importlib.import_module(module), name)
    if quantize.scheme in INT4:
        from torchao.quantization.granularity import PerGroup

        group = PerGroup(quantize.group_size)
        if quantize.scheme == "int4_weight_only":
            return cls(weight_dtype=torch.int4, granularity=group)
        return cls(weight_dtype=torch.int4, weight_granularity=group)
    if quantize.scheme == "fp8":
        from torchao.quantization import PerRow

        return cls(granularity=PerRow())
    if quantize.scheme == "mxfp4":
        return cls(activation_dtype=torch.float4_e2m1fn_x2, weight_dtype=torch.float4_e2m1fn_x2)
    return cls()


def quantized_layers(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """``quantize_``'s filter: the ``nn.Linear`` layers inside the model's decoder layers (not the head)."""
    inside = {id(m) for layer in models.decoder_layers(model) for m in layer.modules() if isinstance(m, nn.Linear)}
    return lambda module, fqn: id(module) in inside


def prepare(model: nn.Module, quantize: QuantizeConfig) -> nn.Module:
    """Fake-quantise ``model``'s decoder-layer linear layers in place (torchao's QAT prepare step); returns it.

    ``learn_scales``: the weight fake quantisers are torchao's range-learning ones (static scales, trainable),
    initialised from the weights as PTQ would before any optimiser sees the parameters (what torchao's
    ``initialize_fake_quantizers`` does with a forward of the whole model, done here quantiser by quantiser on its
    own weight: a model forward would run the student's kernels, which may be GPU-only (Liger's rope) while the
    student is still on the CPU); each becomes an ``nn.Parameter`` named ``...weight_fake_quantizer.scale``, which
    the student's optimiser trains and its checkpoints save, and torchao's convert step exports. torchao keeps the
    symmetric zero point (zeros) as a plain attribute, which ``.to(device)`` does not move: it is registered as a
    buffer here so that the model moves (and saves) whole."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    if not quantize.learn_scales:
        quantize_(model, QATConfig(base_config(quantize), step="prepare"), filter_fn=quantized_layers(model))
    else:
        from torchao.quantization.qat import IntxFakeQuantizeConfig
        from torchao.quantization.qat.fake_quantize_config import _infer_fake_quantize_configs

        activation, weight = _infer_fake_quantize_configs(base_config(quantize))  # the scheme's own, then static
        learned = IntxFakeQuantizeConfig(weight.dtype, weight.granularity, mapping_type=weight.mapping_type,
                                         is_dynamic=False, range_learning=True)
        quantize_(model, QATConfig(activation_config=activation, weight_config=learned, step="prepare"),
                  filter_fn=quantized_layers(model))
        for name in fake_quantized(model):
            layer = model.get_submodule(name)
            quantizer = layer.weight_fake_quantizer
            quantizer._initialized = True  # as initialize_fake_quantizers marks it; its first call sets the scale
            with torch.no_grad():
                quantizer(layer.weight)
            zero_point = quantizer.zero_point
            del quantizer.zero_point
            quantizer.register_buffer("zero_point", zero_point)
    model._distill_kit_quantize = quantize  # what export converts with (kept on the module, not in its state)
    return model


def quantize_of(model: nn.Module) -> QuantizeConfig | None:
    """The :class:`QuantizeConfig` a model was prepared with (:func:`prepare`), or None."""
    return getattr(getattr(model, "student", model), "_distill_kit_quantize", None)


def fake_quantized(model: nn.Module) -> list[str]:
    """The names of ``model``'s fake-quantised linear layers."""
    from torchao.quantization.qat import FakeQuantizedLinear

    return [name for name, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)
            or type(m).__name__ in ("NVFP4FakeQuantizedLinear", "MXFakeQuantizedLinear")]


def convert(model: nn.Module, quantize: QuantizeConfig) -> nn.Module:
    """A copy of the fake-quantised ``model`` with real low-bit weights (torchao's QAT convert step), on its device;
    ``model`` itself keeps training. Without fake-quantised layers (a teacher, for PTQ) the copy is quantised with
    the same PTQ config directly: the weights PTQ would serve."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    with torch.no_grad():
        copied = copy.deepcopy(model)
    copied.eval()
    base = base_config(quantize)
    if fake_quantized(copied):
        quantize_(copied, QATConfig(base, step="convert"))  # every FakeQuantizedLinear, back to nn.Linear, quantised
    else:
        quantize_(copied, base, filter_fn=quantized_layers(copied))
    return copied


def save(model: nn.Module, quantize: QuantizeConfig, directory: str | Path, tokenizer: Any | None = None) -> Path:
    """Convert ``model`` (:func:`convert`) and write it as a Hugging Face folder with ``quantization_config`` (a
    ``TorchAoConfig``) in config.json and its weights in safetensors (torchao's tensor layouts, read back through
    torchao's allow-list, never pickle): ``AutoModelForCausalLM.from_pretrained`` loads it as low-bit weights."""
    from transformers import TorchAoConfig
    from transformers.quantizers import AutoHfQuantizer

    from distill_kit.engines.models import active_transformers_config

    directory = Path(directory)
    converted = convert(model, quantize)
    config = TorchAoConfig(base_config(quantize), modules_to_not_convert=unconverted(converted))
    converted.config.quantization_config = config
    converted.hf_quantizer = AutoHfQuantizer.from_config(config, pre_quantized=True)
    with active_transformers_config(None):
        converted.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def unconverted(model: nn.Module) -> list[str]:
    """The linear layers left in high precision (the head, any outside the decoder layers): the loader's
    ``modules_to_not_convert``."""
    inside = quantized_layers(model)
    return sorted(name for name, m in model.named_modules()
                  if isinstance(m, nn.Linear) and not inside(m, name) and type(m.weight) is nn.Parameter)


def weight_bytes(directory: str | Path) -> int:
    """Bytes of an exported folder's weight files (``*.safetensors``): its size on disk, for the report."""
    return sum(path.stat().st_size for path in Path(directory).glob("*.safetensors"))


@contextlib.contextmanager
def unpatched_linear() -> Iterator[None]:
    """``torch.nn.functional.linear`` as torch defines it, for the duration: a converted (low-bit) model run in a
    process that has built a ZeRO-3 engine. DeepSpeed's ``zero.Init`` replaces ``F.linear`` for the rest of the
    process with its memory-efficient wrapper (``zero3_linear_wrap``, "this will persist unless manually reset"),
    which calls ``weight.t()`` and ``matmul`` directly, operations torchao's low-bit tensors do not implement; they
    implement ``F.linear`` itself. The fake-quantised student is unaffected (its weights are plain tensors)."""
    import torch.nn.functional as F  # noqa: N812

    try:
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher
    except ImportError:  # no DeepSpeed, no patch
        yield
        return
    original = getattr(patcher, "linear_bk", F.linear)
    current = F.linear
    F.linear = original
    try:
        yield
    finally:
        F.linear = current


def export_record(directory: str | Path, quantize: QuantizeConfig) -> dict[str, Any]:
    """What the report says of a quantized export: its scheme, its weight files' bytes on disk, and the bytes the
    same parameters take in bf16 (2 per parameter), read from the folder (no weights loaded)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    config.quantization_config = None
    return {"scheme": quantize.scheme, "group_size": quantize.group_size if quantize.scheme in INT4 else None,
            "weight_bytes": weight_bytes(directory), "bf16_bytes": 2 * models.parameter_count(config)}


# ---- refusals, before anything loads --------------------------------------------------------------------------


def runnable_schemes(capability: tuple[int, int] | None) -> list[str]:
    """The schemes a device of ``capability`` (None: no CUDA GPU) can train and convert."""
    return list(CPU_SCHEMES) + [s for s, need in MIN_CAPABILITY.items()
                                if capability is not None and capability >= need]


def device_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def why_not_device(scheme: str, capability: tuple[int, int] | None) -> str | None:
    """Why a device of ``capability`` (None: the CPU) cannot run ``scheme``, naming what it can run; or None."""
    need = MIN_CAPABILITY.get(scheme)
    if need is None or (capability is not None and capability >= need):
        return None
    here = "this machine has no CUDA GPU" if capability is None else \
        f"this GPU has compute capability {capability[0]}.{capability[1]}"
    kind = "FP8 tensor cores (Ada, Hopper, Blackwell)" if scheme == "fp8" else "FP4 tensor cores (Blackwell)"
    return (f"{scheme} needs {kind}, compute capability {need[0]}.{need[1]}+, and {here}; schemes that run here: "
            f"{', '.join(runnable_schemes(capability))}")


def why_not_convertible(scheme: str) -> str | None:
    """Why the installed torchao cannot train and export ``scheme`` (its PTQ config or its saved tensor missing)."""
    if importlib.util.find_spec("torchao") is None:
        return f"torchao is not installed: {INSTALL_HINT}"
    module, name = BASE_CONFIGS[scheme]
    try:
        found = hasattr(importlib.import_module(module), name)
    except ImportError:
        found = False
    torchao = require_torchao()
    if not found:
        return (f"torchao {torchao.__version__} has no {module}.{name} to convert {scheme} with; install "
                f"torchao 0.18.0 or choose another scheme")
    try:
        from torchao.prototype.safetensors.safetensors_utils import ALLOWED_TENSORS_SUBCLASSES
    except ImportError:
        ALLOWED_TENSORS_SUBCLASSES = []  # noqa: N806 - torchao's name
    if SAVED_TENSORS[scheme] not in ALLOWED_TENSORS_SUBCLASSES:
        return (f"torchao {torchao.__version__} cannot write {SAVED_TENSORS[scheme]} (the converted {scheme} weights) "
                "to safetensors; install torchao 0.18.0 or choose another scheme")
    return None


def layer_problems(model: nn.Module, quantize: QuantizeConfig) -> list[str]:
    """What in ``model`` (built on the meta device: no weights) the scheme cannot quantise: no decoder layers, no
    ``nn.Linear`` in them, an input width the group or block size does not divide."""
    layers = models.decoder_layers(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    inside = quantized_layers(model)
    linears = [(name, m) for name, m in model.named_modules() if inside(m, name)]
    if not layers or not linears:
        foreign = sorted({type(m).__name__ for layer in layers for m in layer.modules()
                          if type(m).__name__ == "Conv1D"})
        how = f"computes its projections with {', '.join(foreign)}" if foreign else "has no nn.Linear decoder layers"
        return [f"model type {model_type!r} {how}, and torchao's QAT fake-quantises nn.Linear only: use a student "
                "of a Llama-, Qwen2- or Mistral-like architecture, or drop quantize"]
    group = BLOCK.get(quantize.scheme, quantize.group_size if quantize.scheme in INT4 else None)
    if group is None:
        return []
    widths = sorted({m.in_features for _, m in linears})
    bad = [w for w in widths if w % group]
    if not bad:
        return []
    what = "quantize.group_size" if quantize.scheme in INT4 else f"{quantize.scheme}'s block of"
    divisors = [g for g in (256, 128, 64, 32, 16, 8) if all(w % g == 0 for w in widths)]
    fix = (f"set quantize.group_size to one that divides them all ({', '.join(map(str, divisors))})" if divisors
           and quantize.scheme in INT4 else "choose widths that are multiples of it, or another scheme")
    return [f"{what} {group} does not divide the input width of every quantised layer (widths {widths}; "
            f"{bad} are not multiples): {fix}"]


def problems(quantize: QuantizeConfig, model_config: Any, *, zero_stage: int, peft: bool,
             capability: tuple[int, int] | None = None, module: nn.Module | None = None) -> list[str]:
    """Every reason a student cannot be trained and exported with ``quantize``, each with its fix (messages without
    the ``students[name].quantize`` prefix, which the plan adds). ``capability``: the device's (None: read it)."""
    found = []
    if quantize.scheme not in QUANT_SCHEMES:  # a spec built past its checks
        return [f"scheme {quantize.scheme!r} is not one of {', '.join(QUANT_SCHEMES)}"]
    if (reason := why_not_convertible(quantize.scheme)) is not None:
        return [reason]
    if (reason := why_not_device(quantize.scheme, device_capability() if capability is None else capability)):
        found.append(reason)
    if quantize.learn_scales and quantize.scheme not in INT4:
        found.append(f"learn_scales trains int4 group scales (torchao's range learning): {quantize.scheme} has none "
                     f"to learn; use {' or '.join(INT4)}, or drop learn_scales")
    if zero_stage == 3:
        found.append("a quantized student trains under ZeRO stage 0-2 (its export converts one whole copy on rank 0); "
                     "set the student's zero_optimization.stage to 2")
    if peft:
        found.append("LoRA adapters on a quantized student are not supported: the trained model is Q(W) x + B A x, "
                     "and merging the adapters for a low-bit export quantises W + B A instead, which is not the "
                     "model that was trained. Train every weight (drop peft: quantization-aware distillation), or "
                     "drop quantize")
    skeleton = module
    if skeleton is None and model_config is not None:
        try:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(model_config)
        except Exception:  # noqa: BLE001 - a config that builds no model is named by the plan's own checks
            skeleton = None
    if skeleton is not None:
        found += layer_problems(skeleton, quantize)
    return found

"""A frozen teacher in FP8: ``training.teacher_precision: fp8``.

The teacher never trains, so it needs no bf16 gradients or master weights and can run as inference engines run
it: every linear layer of its decoder layers in FP8 (e4m3) through torchao's float8 inference
(``Float8DynamicActivationFloat8WeightConfig``, ``torch._scaled_mm`` underneath). Row-wise scales: each weight row
is scaled by its own ``amax / 448`` once, at load; each activation row (token) by its own at every forward. The
embeddings, norms and the output head stay bf16 (the head decides the logits the student learns from, and is one
matmul in ~80). Half the weight memory, and on Hopper twice the matmul rate once the scaling and casting around
the matmuls are fused: ``auto`` teacher kernels become ``compile`` (``torch.compile`` per decoder layer, so
identical layers share one graph) for an FP8 teacher.

Layout: replicated. Each rank holds the whole FP8 teacher and runs it with no gathers at all, whatever stage the
teacher's DeepSpeed config names (it builds no engine for the teacher); a teacher whose FP8 weights exceed the GPU
is refused before loading. ZeRO-3 partitions
plain tensors, and torchao's ``Float8Tensor`` (FP8 data plus a scale per row) is a tensor subclass ZeRO-3 cannot
flatten into its partitions; DeepSpeed's ``zero_quantized_weights`` only compresses the bf16 all-gather (to int8)
and still computes in bf16, so it saves traffic, not memory or matmul time. A teacher too large even in FP8 has
no FP8 layout here: the refusal says so and names the bf16 ZeRO-3 teacher or offline capture instead.

Loading never holds the whole bf16 teacher on the GPU: the model is built without storage (accelerate's
``init_empty_weights``), then the embeddings, final norm and head are filled, and each decoder layer in turn is
filled in bf16 from the checkpoint's safetensors and quantised before the next one is read. The GPU peak is the
FP8 teacher plus one bf16 layer; the host reads the safetensors through memory maps, one layer at a time.

``backend="fake"`` is a stand-in that runs on a CPU: the same quantisation (FP8 e4m3 values, the same float32
scales), dequantised and multiplied in float32. The tests run the loading path with it; the GPU check
``benchmarks/check_fp8.py`` compares torchao's kernels with the same float64 reference.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from distill_kit.config import Precision  # noqa: F401 - the setting's choices, re-exported
from distill_kit.engines import models
from distill_kit.errors import ConfigError

Backend = Literal["torchao", "fake"]
COMPILE_OPTIONS = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True}
"""Inductor options of an FP8 teacher's compiled layers (``kernels.apply`` passes them to ``torch.compile``): the
tuning torchao recommends for quantised models, which the FP8 figures of benchmarks/RESULTS.md were taken with. It
is most of a layer's cold compile (``benchmarks/fp8_compile.py``; its figures: benchmarks/RESULTS.md). torchao
would set it for the whole process (``set_inductor_config``), every later compile included - the student's fused
loss too; :func:`quantize_layer` turns that off and the options apply to the teacher's layers alone."""
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
ALIGN = 16
"""``torch._scaled_mm`` needs both dimensions of an FP8 weight to be multiples of 16 (torchao skips, silently,
any linear layer that is not; here that is an error instead)."""
MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9), Hopper (9.0) and later."""


def resolve(choice: str, dtype: str) -> str:
    """``auto`` is the run's dtype (never FP8: it changes the teacher's outputs, so it is asked for by name)."""
    return dtype if choice == "auto" else choice


def teacher_kernels(kernels: str, precision: str) -> str:
    """An FP8 teacher's ``auto`` kernels are ``compile``: eager dynamic quantisation spends on scaling and casting
    what the FP8 matmuls save (slower than bf16: benchmarks/RESULTS.md)."""
    return "compile" if precision == "fp8" and kernels == "auto" else kernels


def run_teacher_kernels(training: Any) -> str:
    """The teachers' kernels choice of a run's ``TrainingConfig``: what :class:`~distill_kit.teachers.group.
    Teachers` applies, and what a student's Liger options depend on (``kernels.beside``)."""
    return teacher_kernels(training.teacher_kernels, resolve(training.teacher_precision, training.dtype))


# ---- refusals, before anything loads --------------------------------------------------------------------------


def why_no_fp8_device() -> str | None:
    """Why this process cannot run torchao's FP8 kernels, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (FP8 matmuls run on GPUs of compute capability 8.9+: Ada, Hopper, Blackwell)"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name()} has compute capability {capability[0]}.{capability[1]}, and FP8 "
                "tensor cores need 8.9+ (Ada, Hopper, Blackwell)")
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'torchao>=0.18')"
    return None


def check_teacher(precision: str, dtype: str, source: models.ModelSource, key: str = "training.teacher_precision",
                  backend: Backend = "torchao") -> None:
    """A ``ConfigError`` before loading if the teacher cannot run in FP8 here: the device, a layer torchao does not
    cover, or a size no GPU here holds (judged on the model built without storage)."""
    if resolve(precision, dtype) != "fp8":  # the name itself is checked with the config (TrainingConfig)
        return
    if backend == "torchao" and (reason := why_no_fp8_device()):
        raise ConfigError(f"{key} 'fp8': {reason}. Set {key} to bf16 or auto.")
    if isinstance(source, nn.Module) and is_fp8(source):
        return  # quantised already (a benchmark's shape-only teacher): it is on its GPU
    if isinstance(source, nn.Module):
        skeleton = source
    else:
        skeleton = empty_model(models.model_config(source))
    uncovered = uncovered_layers(skeleton)
    if uncovered:
        raise ConfigError(f"{key} 'fp8': {uncovered}. Set {key} to bf16 for this teacher.")
    need = weight_bytes(skeleton)
    if backend == "torchao" and need > (total := torch.cuda.get_device_properties(0).total_memory):
        raise ConfigError(
            f"{key} 'fp8': the FP8 teacher is replicated (each rank holds all of it), and its weights alone need "
            f"{need / 2**30:.0f} GiB, more than this GPU's {total / 2**30:.0f} GiB. Set {key} to bf16 and shard it "
            "with ZeRO-3 (teacher_ds_config), or capture it offline (scripts/capture_teacher.py).")


def weight_bytes(model: nn.Module) -> int:
    """The FP8 teacher's weight bytes: 1 a decoder-layer linear weight (+ a float32 scale a row), 2 the rest."""
    linear = {id(m.weight): m for layer in models.decoder_layers(model) for m in layer.modules()
              if isinstance(m, nn.Linear)}
    total = 0
    for param in {id(p): p for p in model.parameters()}.values():
        total += param.numel() + 4 * param.shape[0] if id(param) in linear else 2 * param.numel()
    return total


def uncovered_layers(model: nn.Module) -> str | None:
    """What in ``model`` torchao's FP8 linear cannot run, in words, or None."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    layers = models.decoder_layers(model)
    if not layers:
        return (f"model type {model_type!r} ({type(model).__name__}) names no decoder layers (_no_split_modules) to "
                "quantise")
    foreign = sorted({type(m).__name__ for layer in layers for m in layer.modules()
                      if not isinstance(m, nn.Linear) and getattr(m, "weight", None) is not None
                      and getattr(m.weight, "dim", lambda: 0)() == 2})
    if foreign:
        return (f"model type {model_type!r} computes its projections with {', '.join(foreign)}, not nn.Linear, "
                "which torchao's float8 inference does not cover")
    misaligned = sorted({f"{type(m).__name__}[{m.out_features}x{m.in_features}]" for layer in layers
                         for m in layer.modules() if isinstance(m, nn.Linear)
                         and (m.in_features % ALIGN or m.out_features % ALIGN)})
    if misaligned:
        return (f"model type {model_type!r} has linear layers whose sizes are not multiples of {ALIGN} "
                f"({', '.join(misaligned[:4])}), which FP8 matmuls (torch._scaled_mm) need")
    if not any(isinstance(m, nn.Linear) for layer in layers for m in layer.modules()):
        return f"model type {model_type!r} has no linear layers in its decoder layers"
    return None


# ---- quantisation ---------------------------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 values and float32 scales, one per row (last dimension reduced), as torchao 0.18's row-wise float8
    (its ``torch`` quantise path): ``scale = amax / 448`` computed in the input's dtype (bf16: the scale is rounded
    to bf16, then kept as float32), ``q = clamp(float32(x) / scale, +-448)`` rounded to e4m3. An all-zero row gets
    scale 1 (torchao's would divide by zero; no row of a trained model is all zeros)."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class FakeFloat8Linear(nn.Module):
    """The CPU stand-in for torchao's FP8 linear: weights quantised once (row-wise), activations per token at every
    call, both dequantised and multiplied in float32, the output in the input's dtype. Not fast: the same numbers
    as the FP8 kernel up to float32 accumulation order, for tests on machines without FP8."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qdata, scale = quantize_rows(linear.weight.detach())
        # Parameters (frozen), as torchao's weights are: the teacher's fingerprint hashes parameters.
        self.qdata = nn.Parameter(qdata, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qx, sx = quantize_rows(x)
        out = (qx.float() * sx) @ (self.qdata.float() * self.scale).t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


def quantize_layer(layer: nn.Module, backend: Backend = "torchao") -> None:
    """Every ``nn.Linear`` inside ``layer`` to FP8, in place; an error if torchao left one in bf16."""
    if backend == "fake":
        for name, child in list(layer.named_modules()):
            if isinstance(child, nn.Linear):
                parent_name, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent_name) if parent_name else layer, attr, FakeFloat8Linear(child))
        return
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(layer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False))
    left = [name for name, m in layer.named_modules() if isinstance(m, nn.Linear) and m.weight.dtype != FP8_DTYPE
            and not hasattr(m.weight, "qdata")]
    if left:
        raise ConfigError(f"torchao left these linear layers unquantised: {left[:4]}; set the teacher precision "
                          "to bf16")


def is_fp8(model: nn.Module) -> bool:
    return getattr(getattr(model, "module", model), "teacher_precision", None) == "fp8"


def compile_options(model: nn.Module) -> dict[str, bool] | None:
    """The inductor options ``model``'s compiled layers take: :data:`COMPILE_OPTIONS` for an FP8 teacher."""
    return dict(COMPILE_OPTIONS) if is_fp8(model) else None


# ---- loading --------------------------------------------------------------------------------------------------


def empty_model(config: Any, need_attentions: bool = False) -> nn.Module:
    """The model with its parameters on the meta device (no storage) and its buffers (RoPE's) real, on the CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": "eager"} if need_attentions else {}
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, **kwargs)


class SafetensorsReader:
    """Tensors of a ``save_pretrained`` directory by name, one at a time (memory-mapped, never the whole file)."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            self.files = {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        elif (directory / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(directory / "model.safetensors", "pt") as handle:
                self.files = dict.fromkeys(handle.keys(), directory / "model.safetensors")
        else:
            raise ConfigError(f"teacher {str(directory)!r}: an FP8 teacher loads from safetensors (model.safetensors "
                              "or model.safetensors.index.json); save the teacher with save_pretrained")
        self._open: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, "pt")
        return self._open[path].get_tensor(name)


def random_weights(std: float, seed: int = 0) -> Callable[[str, torch.Size, torch.device], torch.Tensor]:
    """Weights for a shape-only teacher (benchmarks): normal(0, std) matrices, ones for norms, zeros for biases."""
    generator: dict[torch.device, torch.Generator] = {}

    def make(name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
        if len(shape) == 1:
            return (torch.ones if "norm" in name else torch.zeros)(shape, dtype=torch.bfloat16, device=device)
        gen = generator.setdefault(device, torch.Generator(device).manual_seed(seed))
        return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=gen)

    return make


def load(source: models.ModelSource | Any, device: torch.device, *, need_attentions: bool = False,
         backend: Backend = "torchao", weights: Callable[[str, torch.Size, torch.device], torch.Tensor] | None = None,
         config: Any = None) -> nn.Module:
    """An FP8 teacher on ``device`` from a bf16 checkpoint directory, read and quantised one decoder layer at a time.

    ``source``: a ``save_pretrained`` directory, or (with ``weights``) a config: the benchmarks' shape-only teachers.
    An ``nn.Module`` is quantised in place. The model returned is in eval mode, frozen, and marked
    ``teacher_precision = "fp8"`` (its builder then leaves it where it is).
    """
    from accelerate.utils import set_module_tensor_to_device

    if isinstance(source, nn.Module) and is_fp8(source):
        return source  # loaded in FP8 already (a benchmark's shape-only teacher, see benchmarks/bench_step.py)
    if isinstance(source, nn.Module):
        model = source.to(device=device, dtype=torch.bfloat16)
        for layer in models.decoder_layers(model):
            quantize_layer(layer, backend)
        return _finish(model)
    if config is None:
        config = source if weights is not None and not isinstance(source, str | Path) else models.model_config(source)
    if weights is None:
        reader = SafetensorsReader(source)

        def weights(name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
            if name not in reader:
                raise ConfigError(f"teacher {str(source)!r}: the checkpoint has no tensor {name!r} that its "
                                  f"{type(model).__name__} needs; was it written by save_pretrained of this model?")
            tensor = reader(name)
            if tensor.shape != shape:
                raise ConfigError(f"teacher {str(source)!r}: {name} has shape {tuple(tensor.shape)} in the checkpoint, "
                                  f"{tuple(shape)} in its config")
            return tensor.to(device=device, dtype=torch.bfloat16)

    model = empty_model(config, need_attentions)
    layers = models.decoder_layers(model)
    in_layer = {id(p): index for index, layer in enumerate(layers) for p in layer.parameters()}
    groups: list[list[str]] = [[] for _ in range(len(layers) + 1)]  # [0]: embeddings, norm, head; then each layer
    head = model.get_output_embeddings()
    tied = head.weight if head is not None and _tied(model) else None  # filled by _tie from the embeddings
    for name, param in model.named_parameters():
        if param is not tied:
            groups[in_layer[id(param)] + 1 if id(param) in in_layer else 0].append(name)
    for index, names in enumerate(groups):
        for name in names:
            shape = model.get_parameter(name).shape
            set_module_tensor_to_device(model, name, device, value=weights(name, shape, device))
        if index == 0:
            _tie(model)
        else:
            quantize_layer(layers[index - 1], backend)  # its bf16 weights go as the FP8 ones arrive
    for name, buffer in list(model.named_buffers()):
        if buffer.device != device:
            set_module_tensor_to_device(model, name, device, value=buffer)
    return _finish(model)


def _tie(model: nn.Module) -> None:
    """Point the head at the embeddings again where they are tied (filling replaced the embedding's parameter)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if _tied(model) and head is not None and embeddings is not None:
        head.weight = embeddings.weight


def _tied(model: nn.Module) -> bool:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(config, "tie_word_embeddings", False))


def _finish(model: nn.Module) -> nn.Module:
    model.requires_grad_(False)
    model.eval()
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"FP8 load left parameters without values: {left[:4]}")
    model.teacher_precision = "fp8"
    return model


def load_teacher(source: models.ModelSource, ds_config: Mapping[str, Any], dtype: str, precision: str,
                 need_attentions: bool, device: torch.device, backend: Backend = "torchao", config: Any = None,
                 ) -> nn.Module:
    """The teacher in the precision asked for: FP8 through :func:`load`, otherwise as ``models.load`` loads it.
    ``config``: its model config, read once by the plan (None reads it from ``source``)."""
    if resolve(precision, dtype) == "fp8":
        return load(source, device, need_attentions=need_attentions, backend=backend, config=config)
    return models.load(source, ds_config, dtype, need_attentions, config=config)


def fingerprint_tensor(param: torch.Tensor) -> tuple[str, list[torch.Tensor]]:
    """What identifies a weight: its plain values, or an FP8 weight's data and scales (a torchao ``Float8Tensor``)."""
    if hasattr(param, "qdata") and hasattr(param, "scale"):
        return "fp8", [param.qdata, param.scale]
    return str(param.dtype), [param]


def digest_tensors(digest: Any, tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        values = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(values.view(torch.uint8).numpy().tobytes())


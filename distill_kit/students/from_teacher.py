"""A student cut out of its teacher: chosen layers (DistilBERT) and pruned width (Minitron).

Depth: the student keeps a subset of the teacher's decoder layers, in order, with the embeddings, the final
norm and the head copied; keeping every other layer is how DistilBERT initialises its student (Sanh et al.
2019). Width: the student keeps the most important hidden channels, MLP neurons and attention heads (whole
key-value groups under grouped-query attention), ranked by activation magnitude on a few calibration batches
as Minitron does (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge Distillation"):

- an MLP neuron's importance is the mean |activation| entering ``down_proj``;
- a head's is the mean |output| over its ``head_dim`` channels entering ``o_proj`` (a key-value group's is
  the sum over its query heads);
- a hidden channel's is the mean |output| of every RMSNorm that reads the residual stream (both norms of each
  kept layer and the final norm), summed.

Each mean runs over every calibration token. The result is an ordinary Hugging Face model of the teacher's
architecture (Llama, Qwen2) whose config states the new sizes, ``head_dim`` included, so
``save_pretrained``/``from_pretrained`` round-trip it.

A ZeRO-3 teacher is never gathered whole: calibration runs the teacher's own forward with each module's
weights gathered just before it runs and freed just after (``deepspeed.zero.GatheredParameters``), and the
copy gathers one layer at a time. Every rank runs the same calibration batches, so every rank computes the
same ranking and builds the same student; the result does not depend on the number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import deepspeed
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from distill_kit.config import FromTeacherConfig
from distill_kit.engines.models import active_transformers_config

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")




class UnsupportedTeacherError(ValueError):
    """The teacher's architecture has no layer/width surgery here."""


# ---- which layers, heads, neurons and channels ---------------------------------------------------------------


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_supported(config: PretrainedConfig) -> None:
    model_type = getattr(_text_config(config), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedTeacherError(
            f"init_from_teacher supports teachers of model_type {list(SUPPORTED_MODEL_TYPES)} (LlamaForCausalLM, "
            f"Qwen2ForCausalLM); this teacher is {model_type!r} ({type(config).__name__}). Build the student "
            "with students[i].init (random weights in the teacher's config) or give students[i].model instead."
        )


def kept_layers(config: FromTeacherConfig, num_layers: int) -> list[int]:
    """The teacher layers the student keeps, in the student's order; a ValueError names a bad choice."""
    if config.layers is not None:
        bad = [i for i in config.layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"layers {bad} do not exist: the teacher has layers 0..{num_layers - 1}")
        if len(set(config.layers)) != len(config.layers):
            raise ValueError(f"layers {list(config.layers)} name a layer twice; name each kept layer once")
        return list(config.layers)
    for name in ("first", "last"):
        k = getattr(config, name)
        if k is not None and k > num_layers:
            raise ValueError(f"{name}: {k} layers asked for, the teacher has {num_layers}")
    if config.first is not None:
        return list(range(config.first))
    if config.last is not None:
        return list(range(num_layers - config.last, num_layers))
    return list(range(0, num_layers, config.every or 1))


@dataclass(frozen=True)
class Shape:
    """The teacher's sizes and the student's."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


def teacher_shape(config: PretrainedConfig) -> Shape:
    config = _text_config(config)
    heads = config.num_attention_heads
    return Shape(config.hidden_size, config.intermediate_size, heads,
                 getattr(config, "num_key_value_heads", None) or heads,
                 getattr(config, "head_dim", None) or config.hidden_size // heads)


def student_shape(config: FromTeacherConfig, teacher: Shape) -> Shape:
    """The student's sizes; a ValueError names any that is larger than the teacher's or splits a KV group."""
    heads = config.num_attention_heads or teacher.num_attention_heads
    kv = config.num_key_value_heads
    if kv is None:  # keep the teacher's query heads per group
        kv = max(1, heads * teacher.num_key_value_heads // teacher.num_attention_heads)
    student = Shape(config.hidden_size or teacher.hidden_size, config.intermediate_size or teacher.intermediate_size,
                    heads, kv, teacher.head_dim)
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        if getattr(student, name) > getattr(teacher, name):
            raise ValueError(f"{name}: the student keeps at most the teacher's {getattr(teacher, name)}, "
                             f"not {getattr(student, name)}")
    teacher_group = teacher.num_attention_heads // teacher.num_key_value_heads
    if heads % kv or heads // kv > teacher_group:
        raise ValueError(
            f"num_attention_heads {heads} with num_key_value_heads {kv}: each kept key-value group keeps whole "
            f"query heads of its own, at most the teacher's {teacher_group} per group, so num_attention_heads must "
            f"be num_key_value_heads times 1..{teacher_group}")
    return student


def check(config: FromTeacherConfig, teacher_config: PretrainedConfig) -> None:
    """Every problem that needs no weights (architecture, layers, sizes), found before the teacher loads."""
    check_supported(teacher_config)
    kept_layers(config, _text_config(teacher_config).num_hidden_layers)
    student_shape(config, teacher_shape(teacher_config))


def _top(importance: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries, in their original order (ties to the lower index)."""
    order = torch.sort(-importance.double(), stable=True).indices[:k]
    return torch.sort(order).values


def kept_heads(importance: torch.Tensor, teacher: Shape, student: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept key-value groups and query heads of one layer, from each query head's importance.

    Groups rank by the sum of their query heads' importance; inside each kept group its most important
    query heads are kept, so every kept query head still reads its own keys and values.
    """
    group = teacher.num_attention_heads // teacher.num_key_value_heads
    per_group = student.num_attention_heads // student.num_key_value_heads
    by_group = importance.reshape(teacher.num_key_value_heads, group)
    groups = _top(by_group.sum(1), student.num_key_value_heads)
    heads = torch.cat([g * group + _top(by_group[g], per_group) for g in groups.tolist()])
    return groups, heads


# ---- gathering a ZeRO-3 teacher piece by piece -------------------------------------------------------------------


@contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """``module``'s own weights whole inside the block (a no-op for a model that is not ZeRO-3 partitioned)."""
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield


@contextmanager
def gathered_while_running(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Each module's weights are gathered when its forward starts and freed when it ends, so a ZeRO-3 model
    without an engine can run its own forward while holding one layer at a time."""
    handles, held = [], {}

    def enter(module: nn.Module, _args: tuple) -> None:
        held[module] = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        held[module].__enter__()

    def leave(module: nn.Module, _args: tuple, _out: object) -> None:
        held.pop(module).__exit__(None, None, None)

    try:
        for module in modules:
            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
        yield
    finally:
        for handle in handles:
            handle.remove()


def _parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    base = model.model
    return base, base.layers


# ---- importance -----------------------------------------------------------------------------------------------------


@dataclass
class Importance:
    """Mean |activation| per hidden channel (summed over norms), per MLP neuron and per query head, by layer."""

    hidden: torch.Tensor
    """(hidden_size,)"""
    neurons: dict[int, torch.Tensor]
    """teacher layer -> (intermediate_size,)"""
    heads: dict[int, torch.Tensor]
    """teacher layer -> (num_attention_heads,)"""


@torch.no_grad()
def measure_importance(teacher: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], layers: list[int],
                       device: torch.device | str = "cpu") -> Importance:
    """Activation magnitudes of the kept ``layers`` over every calibration token (padding excluded)."""
    shape = teacher_shape(teacher.config)
    base, decoder = _parts(teacher)
    sums: dict[str, torch.Tensor] = {}
    tokens = 0
    mask: torch.Tensor | None = None

    def add(key: str, values: torch.Tensor) -> None:
        values = values.detach().abs().double()
        if mask is not None:
            values = values * mask[..., None]
        total = values.reshape(-1, values.shape[-1]).sum(0)
        sums[key] = sums[key] + total if key in sums else total

    hooks = []
    norms = [base.norm] + [m for i in layers for m in (decoder[i].input_layernorm, decoder[i].post_attention_layernorm)]
    for norm in norms:
        hooks.append(norm.register_forward_hook(lambda _m, _a, out: add("hidden", out)))
    for i in layers:
        hooks.append(decoder[i].mlp.down_proj.register_forward_pre_hook(lambda _m, a, i=i: add(f"mlp{i}", a[0])))
        hooks.append(decoder[i].self_attn.o_proj.register_forward_pre_hook(lambda _m, a, i=i: add(f"attn{i}", a[0])))
    was_training = teacher.training
    teacher.eval()
    try:
        with gathered_while_running([base.embed_tokens, *decoder, base.norm]):
            for batch in batches:
                input_ids = batch["input_ids"].to(device)
                attention = batch.get("attention_mask")
                attention = torch.ones_like(input_ids) if attention is None else attention.to(device)
                mask = attention.double()
                tokens += int(attention.sum())
                base(input_ids=input_ids, attention_mask=attention)
    finally:
        for hook in hooks:
            hook.remove()
        teacher.train(was_training)
    if tokens == 0:
        raise ValueError("the calibration batches hold no tokens; importance needs at least one")
    heads = {i: (sums[f"attn{i}"] / tokens).reshape(shape.num_attention_heads, shape.head_dim).mean(1)
             for i in layers}
    return Importance(hidden=sums["hidden"] / tokens, neurons={i: sums[f"mlp{i}"] / tokens for i in layers},
                      heads=heads)


# ---- the student -------------------------------------------------------------------------------------------------


def student_config(teacher_config: PretrainedConfig, layers: list[int], shape: Shape) -> PretrainedConfig:
    """The teacher's config with the student's depth and sizes; head_dim stays explicit (it no longer equals
    hidden_size / num_attention_heads once either is pruned)."""
    config = type(teacher_config).from_dict(teacher_config.to_dict())
    update = {"num_hidden_layers": len(layers), "hidden_size": shape.hidden_size,
              "intermediate_size": shape.intermediate_size, "num_attention_heads": shape.num_attention_heads,
              "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim}
    if getattr(teacher_config, "layer_types", None) is not None:  # Qwen2: full or sliding attention per layer
        update["layer_types"] = [teacher_config.layer_types[i] for i in layers]
    config.update(update)
    return config


def _copy(target: torch.Tensor, source: torch.Tensor, rows: torch.Tensor | None = None,
          cols: torch.Tensor | None = None) -> None:
    source = source.detach()
    if rows is not None:
        source = source.index_select(0, rows.to(source.device))
    if cols is not None:
        source = source.index_select(1, cols.to(source.device))
    target.copy_(source.to(device=target.device, dtype=target.dtype))


def _linear(target: nn.Linear, source: nn.Linear, rows: torch.Tensor, cols: torch.Tensor) -> None:
    _copy(target.weight, source.weight, rows, cols)
    if source.bias is not None:
        _copy(target.bias, source.bias, rows)


def _head_rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    return (heads[:, None] * head_dim + torch.arange(head_dim, device=heads.device)[None, :]).reshape(-1)


@torch.no_grad()
def student_from_teacher(teacher: nn.Module, config: FromTeacherConfig,
                         calibration: Iterable[Mapping[str, torch.Tensor]] = (),
                         device: torch.device | str = "cpu") -> nn.Module:
    """A new student (float32, on the CPU, on every rank) cut out of ``teacher`` as ``config`` says.

    ``teacher`` may be a plain model or a ZeRO-3-partitioned one without an engine (every rank must call this
    together then: gathers are collective). ``calibration`` yields micro-batches with ``input_ids`` (and
    ``attention_mask``); only width pruning reads it, at most ``config.calibration_batches`` of them.
    """
    check_supported(teacher.config)
    tshape = teacher_shape(teacher.config)
    layers = kept_layers(config, _text_config(teacher.config).num_hidden_layers)
    shape = student_shape(config, tshape)
    base, decoder = _parts(teacher)
    if config.prunes_width:
        batches = [b for _, b in zip(range(config.calibration_batches), calibration, strict=False)]
        if not batches:
            raise ValueError("width pruning needs calibration batches (input_ids); none were given")
        importance = measure_importance(teacher, batches, layers, device)
        hidden = _top(importance.hidden, shape.hidden_size)
    else:
        importance, hidden = None, torch.arange(tshape.hidden_size)

    with active_transformers_config(None):  # never build the student inside a ZeRO-3 zero.Init
        student = AutoModelForCausalLM.from_config(student_config(teacher.config, layers, shape),
                                                   dtype=torch.float32)
    sbase, sdecoder = _parts(student)
    with gathered(base.embed_tokens), gathered(base.norm):
        _copy(sbase.embed_tokens.weight, base.embed_tokens.weight, cols=hidden)
        _copy(sbase.norm.weight, base.norm.weight, rows=hidden)
    tied = student.get_output_embeddings().weight is sbase.embed_tokens.weight
    if not tied:
        head, shead = teacher.get_output_embeddings(), student.get_output_embeddings()
        with gathered(head):
            _linear(shead, head, torch.arange(head.weight.shape[0]), hidden)

    for k, i in enumerate(layers):
        if importance is None:
            groups, heads = torch.arange(tshape.num_key_value_heads), torch.arange(tshape.num_attention_heads)
            neurons = torch.arange(tshape.intermediate_size)
        else:
            groups, heads = kept_heads(importance.heads[i], tshape, shape)
            neurons = _top(importance.neurons[i], shape.intermediate_size)
        q_rows, kv_rows = _head_rows(heads, tshape.head_dim), _head_rows(groups, tshape.head_dim)
        source, target = decoder[i], sdecoder[k]
        with gathered(source):
            _copy(target.input_layernorm.weight, source.input_layernorm.weight, rows=hidden)
            _copy(target.post_attention_layernorm.weight, source.post_attention_layernorm.weight, rows=hidden)
            attn, sattn = source.self_attn, target.self_attn
            _linear(sattn.q_proj, attn.q_proj, q_rows, hidden)
            _linear(sattn.k_proj, attn.k_proj, kv_rows, hidden)
            _linear(sattn.v_proj, attn.v_proj, kv_rows, hidden)
            _linear(sattn.o_proj, attn.o_proj, hidden, q_rows)
            mlp, smlp = source.mlp, target.mlp
            _linear(smlp.gate_proj, mlp.gate_proj, neurons, hidden)
            _linear(smlp.up_proj, mlp.up_proj, neurons, hidden)
            _linear(smlp.down_proj, mlp.down_proj, hidden, neurons)
    return student

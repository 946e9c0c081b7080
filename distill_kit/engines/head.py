"""Running a student or a teacher without its output head, so that a logit loss can apply the head chunk by chunk.

A Hugging Face causal LM is a body (``model.base_model``: embeddings, layers, final norm) and a head
(``get_output_embeddings()``, an ``nn.Linear``); for the architectures in :data:`EXACT_HEADS` the logits are
exactly ``head(body(...).last_hidden_state)``. Others scale or cap their logits after the head (Gemma 2's
soft-capping, Cohere's ``logit_scale``, Granite's ``logits_scaling``), so fusing would change the loss: they,
and non-HF modules, keep the plain path. See ``losses/fused.py`` for the loss side.

The student's side: :func:`why_not_fused`, :func:`headless_forward`. The teacher's side:
:func:`why_not_teacher_head`, :func:`teacher_head_forward`; there the full (tokens x vocabulary) teacher logits,
the largest tensor of a teacher forward, are never built (``losses/chunked.py:head_chunk_loss``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

from distill_kit.engines.deepspeed_config import zero_stage
from losses.fused import HeadOutput

EXACT_HEADS = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3"})
"""``model_type``s whose forward is ``logits = lm_head(last_hidden_state)``, read from their modeling code."""


def _unwrapped(model: nn.Module) -> nn.Module:
    """A PEFT student's causal LM with its adapters injected in place (peft's ``get_base_model``): its body runs
    them, while the ``PeftModel`` wrapper's own ``base_model`` would run the whole model, head included."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def why_not_fused(model: nn.Module, loss: Any, ds_config: Mapping[str, Any], enabled: bool) -> str | None:
    """None when the student may run headless with a fused logit loss; otherwise the reason, for the log."""
    model = _unwrapped(model)
    if not enabled:
        return "training.fused_loss is off"
    if getattr(loss, "needs_full_logits", True):
        return f"loss {type(loss).__name__} reads the student's full logits"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in EXACT_HEADS:
        return (f"the fused head is known exact only for model types {sorted(EXACT_HEADS)}, "
                f"not {model_type!r}")
    body, head = getattr(model, "base_model", model), model.get_output_embeddings()
    if body is model or not isinstance(head, nn.Linear):
        return "the model has no separate body and linear output head"
    if zero_stage(ds_config) == 3:
        return "a ZeRO-3 student's head weight is partitioned outside its forward (use a ZeRO-2 student)"
    return None


def headless_forward(model: nn.Module, **inputs: Any) -> HeadOutput:
    """The body's forward; the head is handed on, not applied."""
    model = _unwrapped(model)
    out = model.base_model(**inputs)
    return HeadOutput(hidden=out.last_hidden_state, head=model.get_output_embeddings(),
                      hidden_states=getattr(out, "hidden_states", None), attentions=getattr(out, "attentions", None))


@dataclass(frozen=True)
class GatheredHead:
    """A ZeRO-3 teacher's output head, gathered whole and copied: ``weight`` (V, H), ``bias`` (V,) or None.

    ZeRO-3 re-partitions a gathered parameter when its gathering context ends, but the loss applies the head
    later, once per chunk and per student; this copy outlives the context. It is what a
    :class:`~losses.fused.HeadOutput` needs of a head: the two tensors, and the logits when called.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight, self.bias)


def teacher_head_forward(model_or_engine: nn.Module, **inputs: Any) -> HeadOutput:
    """The teacher's body forward; its head is handed on to the loss, not applied.

    ``model_or_engine`` is the teacher as built (``engines/build.py:build_teacher``): a replicated or FP8 module
    (an FP8 teacher's head stays bf16: ``engines/fp8.py``) hands on its own head. A ZeRO-3 engine runs its forward
    as usual, with the body standing in for the whole model, so every hook DeepSpeed keeps around it runs (its top
    module's start-of-forward hook steps the parameter coordinator, which records the order of the modules once and
    then prefetches by it; called on the body alone it never records one, and every layer's gather waits). The
    head, untouched by that forward and so still partitioned, is then gathered once and copied
    (:class:`GatheredHead`), for every student of the micro-batch. ``inputs`` are the model's keyword arguments
    (``input_ids``, ``attention_mask``, ``output_hidden_states``, ...; no ``labels``). Call it under
    ``torch.no_grad()``, as the teacher's full forward is.
    """
    engine = model_or_engine if isinstance(model_or_engine, deepspeed.DeepSpeedEngine) else None
    model = _unwrapped(model_or_engine if engine is None else engine.module)
    body, head = model.base_model, model.get_output_embeddings()
    if engine is None:
        out = body(**inputs)
    else:
        with _forward_replaced(engine.module, lambda **kwargs: body(**kwargs)):  # a function, not a submodule
            out = engine(**inputs)
        if _is_zero3(head.weight):
            head = _gathered(head)
    return HeadOutput(hidden=out.last_hidden_state, head=head, hidden_states=getattr(out, "hidden_states", None),
                      attentions=getattr(out, "attentions", None))


def _is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")  # set on every parameter ZeRO-3 manages


def _gathered(head: nn.Module) -> GatheredHead:
    """One all-gather of the head's weight and bias, copied before ZeRO-3 partitions them again."""
    bias = getattr(head, "bias", None)
    with deepspeed.zero.GatheredParameters([p for p in (head.weight, bias) if p is not None], modifier_rank=None):
        return GatheredHead(head.weight.detach().clone(), None if bias is None else bias.detach().clone())


@contextlib.contextmanager
def _forward_replaced(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``module(...)`` runs ``forward`` inside ``module``'s own hooks, until the context ends."""
    own = vars(module).get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own

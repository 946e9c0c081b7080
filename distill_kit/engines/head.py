"""Running a student without its output head, so that a logit loss can apply the head chunk by chunk.

A Hugging Face causal LM is a body (``model.base_model``: embeddings, layers, final norm) and a head
(``get_output_embeddings()``, an ``nn.Linear``); for the architectures in :data:`EXACT_HEADS` the logits are
exactly ``head(body(...).last_hidden_state)``. Others scale or cap their logits after the head (Gemma 2's
soft-capping, Cohere's ``logit_scale``, Granite's ``logits_scaling``), so fusing would change the loss: they,
and non-HF modules, keep the plain path. See ``losses/fused.py`` for the loss side.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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

"""The student's output head fused with a logit loss: the full student logits never exist.

Given the student's final hidden states ``(N, H)`` and its head (weight ``(V, H)``, optional bias ``(V,)``),
the forward pass walks the counted rows ``chunk_size`` at a time; per chunk it computes the chunk's logits
``(c, V)`` in the model's dtype (exactly what the head would give them), the loss on them through the same
:data:`~losses.chunked.ChunkLoss` as the chunked path (so the divergence is the one in ``losses/functional.py``),
and right there the gradient with respect to those logits, which two matmuls turn into the gradients with
respect to the chunk's hidden states and the head's weight and bias. Backward only scales them by
``grad_output``. The largest tensors are one chunk's ``(c, V)`` float32 logits and their gradient, the
``(N, H)`` hidden-state gradient and a float32 ``(V, H)`` head-gradient accumulator; for N = 16k tokens and
V = 152k that is ~1.2 GB against ~10 GB for one bf16 copy of the logits.

On CUDA the per-chunk loss-and-gradient is ``torch.compile``d (softmax, divergence and gradient fuse into a
few kernels); on the CPU, and with ``compile=False``, it runs eagerly. The math is the same either way.

A tied embedding is the same ``Parameter`` as the head weight, so its gradient from here and from the
embedding lookup add up in autograd as they do without fusion.

The teacher's head can be applied at the loss too (Liger's fused distillation applies both heads there): a
teacher's :class:`HeadOutput` reaches the :data:`~losses.chunked.ChunkLoss` as its hidden states (per-row
targets) and its head's weight and bias (shared tensors), and each chunk's teacher logits are computed next to
the student's (``losses/chunked.py:head_chunk_loss``). That works on both student paths, fused or materialised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from losses.chunked import ChunkLoss, chunked_loss
from losses.functional import compute_dtype


@dataclass
class HeadOutput:
    """A causal LM's outputs with the output head not yet applied (see ``distill_kit/engines/head.py``).

    ``hidden`` (B, T, H) are the final hidden states the head reads (after the final norm); ``head`` is the
    output layer (``weight`` (V, H), ``bias`` (V,) or None; anything with those two attributes that maps hidden
    states to logits when called, such as a ZeRO-3 teacher's gathered head). ``hidden_states`` and
    ``attentions`` are the body's, as a Hugging Face model returns them. A logit loss applies the head chunk by
    chunk, for a student (the fused path) or a teacher (``losses/chunked.py:head_chunk_loss``); anything else
    that reads ``logits`` (evaluation, a user loss, a mixture of teachers) gets them computed in full on first
    use, differentiably, and kept.
    """

    hidden: torch.Tensor
    head: torch.nn.Module
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    _logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self.head(self.hidden)
        return self._logits


def logit_loss_sum(student: Any, rows: torch.Tensor, chunk_loss: ChunkLoss, chunk_size: int) -> torch.Tensor:
    """Sum of ``chunk_loss`` over the counted ``rows``: fused with the head for a :class:`HeadOutput`,
    chunked over materialised logits otherwise. Both give the same value and gradients."""
    if isinstance(student, HeadOutput) and student._logits is None:
        hidden = student.hidden.reshape(-1, student.hidden.shape[-1])
        return fused_head_loss(hidden, student.head.weight, getattr(student.head, "bias", None), rows, chunk_loss,
                               chunk_size)
    logits = student.logits
    return chunked_loss(logits.reshape(-1, logits.shape[-1]), rows, chunk_loss, chunk_size)


def fused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor,
                    chunk_loss: ChunkLoss, chunk_size: int, compile: bool | None = None) -> torch.Tensor:
    """``sum_rows chunk_loss(hidden[rows] @ weight.T + bias)`` as a differentiable scalar, chunk by chunk.

    ``hidden`` (N, H), ``weight`` (V, H), ``bias`` (V,) or None, ``rows`` (n,) indices of counted rows.
    ``compile`` None compiles the per-chunk step on CUDA only.
    """
    want_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    step = _step(hidden.is_cuda if compile is None else compile)
    return _FusedHeadLoss.apply(hidden, weight, bias, rows, chunk_loss, chunk_size, want_grad, step)


def value_and_grad(logits: torch.Tensor, rows_loss: Callable[..., torch.Tensor], options: dict[str, Any],
                   *targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: (sum of the loss, its gradient w.r.t. ``logits`` in their dtype), computed in float32."""

    def total(student: torch.Tensor) -> torch.Tensor:
        return rows_loss(student, *targets, **options).sum()

    grad, value = torch.func.grad_and_value(total)(logits.to(compute_dtype(logits.dtype)))
    return value, grad.to(logits.dtype)


@functools.cache
def _compiled() -> Callable[..., Any]:
    """One compiled step per process; dynamo specialises it per loss function and, after a second chunk
    length (the last, shorter chunk), compiles it once more with a dynamic length. Every tensor reaches it as
    an argument (a teacher head's weight included: :attr:`~losses.chunked.ChunkLoss.shared`), so a new tensor
    of the same shape and dtype, step after step, reuses the graph."""
    return torch.compile(value_and_grad)


def _step(compile: bool) -> Callable[..., Any]:
    return _compiled() if compile else value_and_grad


class _FusedHeadLoss(torch.autograd.Function):
    """The head's matmul and the loss per chunk; every gradient is made in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, chunk_loss, chunk_size, want_grad, step):
        dtype = compute_dtype(hidden.dtype)
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        if want_grad:
            grad_hidden = torch.zeros_like(hidden)  # (N, H): uncounted rows get no gradient
            grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)  # (V, H) accumulator
            grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=dtype, device=bias.device)
        for chunk in rows.split(chunk_size):
            h = hidden[chunk]  # (c, H)
            logits = F.linear(h, weight, bias)  # (c, V), the model's dtype: what the head itself computes
            if not want_grad:
                total += chunk_loss(logits.to(dtype), chunk).sum()
                continue
            value, grad = step(logits, chunk_loss.rows_loss, dict(chunk_loss.options), *chunk_loss.select(chunk))
            total += value.detach()
            grad_hidden.index_copy_(0, chunk, grad @ weight)
            grad_weight += (grad.t() @ h).to(dtype)
            if grad_bias is not None:
                grad_bias += grad.sum(0, dtype=dtype)
        if want_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype),
                                  None if grad_bias is None else grad_bias.to(bias.dtype))
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_output.to(grad_hidden.dtype)
        return (grad_hidden * scale, grad_weight * scale.to(grad_weight.dtype),
                None if grad_bias is None else grad_bias * scale.to(grad_bias.dtype),
                None, None, None, None, None)

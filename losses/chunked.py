"""Memory-bounded evaluation of a per-token logit loss, Liger-Kernel style.

Plain autograd through ``log_softmax`` on (B*T, V) logits keeps several float32 (B*T, V) tensors alive
until backward: for a 150k vocabulary and 16k tokens that is ~10 GB per tensor. Here the forward pass
walks the counted rows ``chunk_size`` at a time; for each chunk it upcasts to float32, computes the loss
and, right there, its gradient with respect to the student logits, and writes that gradient in the
logits' own dtype into one buffer. Backward only scales the buffer by ``grad_output``. So the only
full-size tensor this adds is the gradient the student logits need anyway (in bf16 for a bf16 model);
float32 lives one chunk at a time. Teacher targets are read, never differentiated.

What a chunk is compared with is a :data:`ChunkLoss`: a live teacher's logits (:func:`dense_chunk_loss`), a
live teacher's final hidden states and output head, applied to the chunk's rows only (:func:`head_chunk_loss`),
or a captured teacher's top-k log-probabilities (``losses/sparse.py``); the chunking is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from losses.functional import compute_dtype

PerToken = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ChunkLoss:
    """What a chunk of student rows is compared with, as ``rows_loss(student, *targets[chunk], **options)``.

    ``targets`` are flat tensors indexed by row (a teacher's ``(N, Vt)`` logits, ``(N,)`` labels, ...; None
    passes through), ``options`` the loss's constants and ``shared`` tensors every chunk reads whole (a teacher
    head's ``(Vt, H)`` weight and ``(Vt,)`` bias or None), passed after the chunk's targets. Keeping the function,
    the per-row tensors and the constants apart lets the fused head path (``losses/fused.py``) hand exactly one
    chunk's tensors to a ``torch.compile``d step whose function and constants stay the same from step to step (no
    recompiles); a shared tensor reaches it as an argument, so dynamo treats it as an input (guarded on shape and
    dtype), not as a constant baked into the graph, and a new one each step (a ZeRO-3 teacher's head gathered
    afresh) compiles nothing new.
    Called as ``chunk_loss(student (c, Vs) float32, chunk (c,) row indices) -> (c,)`` loss per token.
    """

    rows_loss: Callable[..., torch.Tensor]
    targets: tuple[torch.Tensor | None, ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    shared: tuple[torch.Tensor | None, ...] = ()

    def select(self, chunk: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The positional tensors of ``rows_loss`` for one chunk: the targets' rows, then the shared tensors."""
        return tuple(None if t is None else t[chunk] for t in self.targets) + self.shared

    def __call__(self, student: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        return self.rows_loss(student, *self.select(chunk), **self.options)


class _ChunkedLogitLoss(torch.autograd.Function):
    """sum over ``rows`` of ``chunk_loss(student[rows], rows)``; the gradient is made in forward."""

    @staticmethod
    def forward(ctx, student_logits, rows, chunk_loss, chunk_size, want_grad):
        # student_logits (N, Vs), rows (n,) indices of counted rows.
        dtype = compute_dtype(student_logits.dtype)
        total = torch.zeros((), dtype=dtype, device=student_logits.device)
        grad = torch.zeros_like(student_logits) if want_grad else None  # (N, Vs), logits' dtype
        for chunk in rows.split(chunk_size):
            s = student_logits[chunk].to(dtype)  # (c, Vs) float32, a fresh copy
            if want_grad:
                s.requires_grad_(True)
                with torch.enable_grad():
                    value = chunk_loss(s, chunk).sum()
                    (chunk_grad,) = torch.autograd.grad(value, s)
                grad.index_copy_(0, chunk, chunk_grad.to(grad.dtype))
            else:
                value = chunk_loss(s, chunk).sum()
            total += value.detach()
        if want_grad:
            ctx.save_for_backward(grad)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None, None, None


def chunked_loss(
    student_logits: torch.Tensor, rows: torch.Tensor, chunk_loss: ChunkLoss, chunk_size: int
) -> torch.Tensor:
    """Sum of ``chunk_loss`` over the counted ``rows`` of flat ``(N, V)`` student logits, as a differentiable scalar.

    The gradient buffer is only built when autograd will use it, so evaluation under ``no_grad`` costs one
    chunk of float32 and nothing more.
    """
    want_grad = torch.is_grad_enabled() and student_logits.requires_grad
    return _ChunkedLogitLoss.apply(student_logits, rows, chunk_loss, chunk_size, want_grad)


def dense_chunk_loss(per_token: PerToken, teacher_logits: torch.Tensor, labels: torch.Tensor,
                     temperature: float) -> ChunkLoss:
    """``per_token(student / T, teacher / T, labels)`` on a chunk, against a live teacher's flat ``(N, Vt)`` logits.

    Vocabularies are cut to the shorter of the two (a teacher padded past the real vocabulary).
    """
    options = {"per_token": per_token, "temperature": temperature}
    return ChunkLoss(dense_rows, (teacher_logits.detach(), labels), options)


def dense_rows(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, *, per_token: PerToken,
               temperature: float) -> torch.Tensor:
    """One chunk: student ``(c, Vs)`` float32, teacher ``(c, Vt)`` logits, labels ``(c,)`` -> ``(c,)``."""
    vocab = min(student.shape[-1], teacher.shape[-1])
    return per_token(student[:, :vocab] / temperature, teacher[:, :vocab].to(student.dtype) / temperature, labels)


def head_chunk_loss(per_token: PerToken, teacher_hidden: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, labels: torch.Tensor, temperature: float) -> ChunkLoss:
    """:func:`dense_chunk_loss` against a live teacher whose output head is applied here, one chunk at a time.

    ``teacher_hidden`` (N, H) are the teacher's final hidden states (after its final norm), ``weight`` (Vt, H) and
    ``bias`` (Vt,) or None its head. Each chunk's teacher logits (c, Vt) exist only while that chunk's loss is
    computed, so the teacher's full (N, Vt) logits never do. The targets are detached: the teacher is never
    differentiated (nor is a peer model whose outputs stand in the teacher's slot).
    """
    options = {"per_token": per_token, "temperature": temperature}
    shared = (weight.detach(), None if bias is None else bias.detach())
    return ChunkLoss(head_rows, (teacher_hidden.detach(), labels), options, shared)


def head_rows(student: torch.Tensor, teacher_hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, *, per_token: PerToken, temperature: float) -> torch.Tensor:
    """One chunk: the teacher's logits ``(c, Vt)`` from its hidden states ``(c, H)`` in the teacher's dtype (what its
    head computes), then exactly :func:`dense_rows`."""
    teacher = F.linear(teacher_hidden, weight, bias)
    return dense_rows(student, teacher, labels, per_token=per_token, temperature=temperature)


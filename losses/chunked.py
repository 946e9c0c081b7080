"""Memory-bounded evaluation of a per-token logit loss, Liger-Kernel style.

Plain autograd through ``log_softmax`` on (B*T, V) logits keeps several float32 (B*T, V) tensors alive
until backward: for a 150k vocabulary and 16k tokens that is ~10 GB per tensor. Here the forward pass
walks the counted rows ``chunk_size`` at a time; for each chunk it upcasts to float32, computes the loss
and, right there, its gradient with respect to the student logits, and writes that gradient in the
logits' own dtype into one buffer. Backward only scales the buffer by ``grad_output``. So the only
full-size tensor this adds is the gradient the student logits need anyway (in bf16 for a bf16 model);
float32 lives one chunk at a time. Teacher logits are read, never differentiated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from losses.functional import compute_dtype

PerToken = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _ChunkedLogitLoss(torch.autograd.Function):
    """sum over ``rows`` of ``per_token(student / T, teacher / T, labels)``; the gradient is made in forward."""

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, labels, rows, per_token, temperature, chunk_size, want_grad):
        # student_logits (N, Vs), teacher_logits (N, Vt), labels (N,), rows (n,) indices of counted rows.
        vocab = min(student_logits.shape[-1], teacher_logits.shape[-1])
        dtype = compute_dtype(student_logits.dtype)
        total = torch.zeros((), dtype=dtype, device=student_logits.device)
        grad = torch.zeros_like(student_logits) if want_grad else None  # (N, Vs), logits' dtype
        for chunk in rows.split(chunk_size):
            s = student_logits[chunk, :vocab].to(dtype)  # (c, V) float32, a fresh copy
            t = teacher_logits[chunk, :vocab].to(dtype)
            if want_grad:
                s.requires_grad_(True)
                with torch.enable_grad():
                    value = per_token(s / temperature, t / temperature, labels[chunk]).sum()
                    (chunk_grad,) = torch.autograd.grad(value, s)
                grad[:, :vocab].index_copy_(0, chunk, chunk_grad.to(grad.dtype))
            else:
                value = per_token(s / temperature, t / temperature, labels[chunk]).sum()
            total += value.detach()
        if want_grad:
            ctx.save_for_backward(grad)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None, None, None, None, None, None


def chunked_logit_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    rows: torch.Tensor,
    per_token: PerToken,
    temperature: float,
    chunk_size: int,
) -> torch.Tensor:
    """Sum of ``per_token`` over the counted ``rows`` of flat ``(N, V)`` logits, as a differentiable scalar.

    Vocabularies are cut to the shorter of the two (a teacher padded past the real vocabulary). The
    gradient buffer is only built when autograd will use it, so evaluation under ``no_grad`` costs one
    chunk of float32 and nothing more.
    """
    want_grad = torch.is_grad_enabled() and student_logits.requires_grad
    return _ChunkedLogitLoss.apply(
        student_logits, teacher_logits.detach(), labels, rows, per_token, temperature, chunk_size, want_grad
    )

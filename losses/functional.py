"""The math, written once. Every function maps float32 rows ``(n, V)`` to a per-row loss ``(n,)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_teacher || q_student) = sum_v p (log p - log q): the student covers every teacher mode."""
    teacher_logp = F.log_softmax(teacher_logits, dim=-1)
    student_logp = F.log_softmax(student_logits, dim=-1)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)

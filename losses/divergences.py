"""Logit divergences between the student's and the teacher's next-token distributions."""

from __future__ import annotations

import torch

from losses import functional
from losses.base import LogitLoss


class ForwardKL(LogitLoss):
    """Forward KL, KL(p_teacher || q_student), Hinton et al. 2015 "Distilling the Knowledge in a Neural
    Network". Config: ``{name: forward_kl, temperature: 1.0}``."""

    def per_token(self, student_logits, teacher_logits, labels) -> torch.Tensor:
        return functional.forward_kl(student_logits, teacher_logits)

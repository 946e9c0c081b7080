"""A loss written outside the library, plugged in by import path (``user_losses:HalfForwardKL``)."""

from __future__ import annotations

from losses import LogitLoss
from losses.functional import forward_kl


class HalfForwardKL(LogitLoss):
    def per_token(self, student_logits, teacher_logits, labels):
        return 0.5 * forward_kl(student_logits, teacher_logits)

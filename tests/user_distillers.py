"""Research code outside the library: a Distiller subclass that overrides one hook, run by the CLI through
``distiller: tests.user_distillers:MarkedDistiller``."""

from __future__ import annotations

from distill_kit import Distiller
from losses import LossOutput


class MarkedDistiller(Distiller):
    """The library's loss, plus a part of its own in every record (``<student>/subclass``: 1)."""

    def compute_loss(self, student_out, teacher_out, batch, student=None):
        loss = super().compute_loss(student_out, teacher_out, batch, student)
        return LossOutput(loss.total, {**loss.parts, "subclass": loss.total.detach() * 0 + 1})


class NotADistiller:
    """What ``distiller:`` must refuse."""

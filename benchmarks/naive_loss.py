"""The textbook forward KL on the full vocabulary in float32: the reference the chunked loss is measured against.

It is what most distillation scripts write (``F.kl_div`` over ``log_softmax`` of upcast logits). Autograd
keeps several float32 (tokens x vocab) tensors alive until backward, which is the memory and time the
chunked :class:`losses.LogitLoss` avoids. Same token selection and normalisation as the real losses, so
both compute the same number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn.functional as F

from losses import DistillationLoss, LossOutput
from losses.base import normalizer, valid_positions


class NaiveForwardKL(DistillationLoss):
    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        mask = valid_positions(batch)  # (B, T)
        vocab = min(student.logits.shape[-1], teacher.logits.shape[-1])
        log_q = F.log_softmax(student.logits[..., :vocab].float(), dim=-1)  # (B, T, V) float32
        log_p = F.log_softmax(teacher.logits[..., :vocab].float(), dim=-1)
        per_token = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)  # (B, T)
        loss = (per_token * mask).sum() / normalizer(batch, mask)
        return LossOutput(loss, {"naive_forward_kl": loss.detach()})

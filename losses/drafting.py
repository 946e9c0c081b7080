"""A drafter's loss on its own proposals as its target verifies them (target-verified rollouts, in the manner of
Draft-OPD): the loss of each drafted token weighted by how likely speculative decoding is to read it and to reject
it (``functional.verification_weights``).

With ``training.on_policy: {fraction: 1.0, sampler: student}`` the counted tokens are the student's own samples:
each is a draft, ``a_t = min(1, p(x_t) / q(x_t))`` the probability that the teacher keeps it
(``functional.acceptance_probability``). Cut into rounds of ``gamma`` drafts, a token weighs the probability that the
target reaches it (every earlier draft of its round kept) times ``1 + rejected_weight * (1 - a_t)``: tokens a
verifier never reads weigh little, those it would reject weigh most. The divergence at each token is total variation
by default (1 - TV is the acceptance probability: DistillSpec's objective for drafters). The weights are detached:
the divergence's gradient is the one followed. Off-policy (the data's tokens) it runs too, with the data's tokens
as drafts, which is not what the weights are for.

Config: ``{name: target_verified, gamma: 4, rejected_weight: 1.0, divergence: total_variation}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import losses.functional as functional
from losses.base import DistillationLoss, LossOutput, next_token_labels, normalizer, valid_positions

DIVERGENCES = {"total_variation": functional.total_variation, "forward_kl": functional.forward_kl,
               "reverse_kl": functional.reverse_kl}


class TargetVerified(DistillationLoss):
    """Target-verified rollouts: a divergence per drafted token, weighted toward where the target rejects."""

    takes_teacher_head = False  # reads the teacher's logits whole (the weights need p at each drafted token)

    def __init__(self, gamma: int = 4, rejected_weight: float = 1.0, divergence: str = "total_variation",
                 temperature: float = 1.0):
        super().__init__()
        if not (isinstance(gamma, int) and gamma >= 1):
            raise ValueError(f"target_verified gamma: {gamma!r}; give the draft length, a whole number >= 1 (e.g. 4)")
        if not rejected_weight >= 0:
            raise ValueError(f"target_verified rejected_weight: {rejected_weight}; give a number >= 0 (0: weigh by "
                             "the chance of being read only)")
        if divergence not in DIVERGENCES:
            raise ValueError(f"target_verified divergence: {divergence!r} is not one of {', '.join(DIVERGENCES)}")
        if not temperature > 0:
            raise ValueError(f"target_verified temperature: {temperature}; give a number > 0")
        self.gamma, self.rejected_weight, self.temperature = gamma, float(rejected_weight), float(temperature)
        self.divergence = DIVERGENCES[divergence]

    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        teacher_logits = teacher.logits
        if not torch.is_tensor(teacher_logits):
            raise ValueError("target_verified reads the teacher's full logits (p at each drafted token), and this "
                             "teacher gives top-k targets only (a store, a server): distil from a live teacher")
        mask = valid_positions(batch)
        drafts = next_token_labels(batch).clamp(min=0)
        vocab = min(student.logits.shape[-1], teacher_logits.shape[-1])
        s = student.logits[..., :vocab]
        s = s.to(functional.compute_dtype(s.dtype)) / self.temperature  # float32; float64 passes (tests)
        t = teacher_logits[..., :vocab].detach().to(s.dtype) / self.temperature
        with torch.no_grad():
            acceptance = functional.acceptance_probability(s, t, drafts.clamp(max=vocab - 1))
            weights = functional.verification_weights(acceptance, mask, self.gamma, self.rejected_weight)
        loss = (self.divergence(s, t) * weights).sum() / normalizer(batch, mask)
        accepted = (acceptance * mask).sum() / mask.sum().clamp(min=1)
        return LossOutput(loss, {self.name: loss.detach(), "draft_acceptance": accepted.detach()})

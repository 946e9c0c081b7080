"""Logit divergences between the student's and the teacher's next-token distributions.

Each class only picks a function from ``losses.functional`` and validates its parameters at construction;
temperature, ``T**2`` scaling, masking, chunking and normalisation come from :class:`LogitLoss`. In the
formulas, p = softmax(teacher_logits / T) and q = softmax(student_logits / T).
"""

from __future__ import annotations

import torch

import losses.functional as functional
from losses.base import LogitLoss


def _check_unit_interval(name: str, value: float, *, upper_open: bool, hint: str) -> float:
    value = float(value)
    if not (0.0 <= value < 1.0 if upper_open else 0.0 <= value <= 1.0):
        interval = "[0, 1)" if upper_open else "[0, 1]"
        raise ValueError(f"{name} must be in {interval}, got {value}. {hint}")
    return value


class ForwardKL(LogitLoss):
    """Forward KL, KL(p || q), Hinton et al. 2015 "Distilling the Knowledge in a Neural Network".

    Mode-covering: the student is penalised wherever the teacher has mass it lacks.
    Config: ``{name: forward_kl, temperature: 2.0}``. Against a sampled store it is the unbiased RS-KD estimate.
    """

    sampled_targets = True

    def per_token(self, student_logits, teacher_logits, labels) -> torch.Tensor:
        return functional.forward_kl(student_logits, teacher_logits)


class ReverseKL(LogitLoss):
    """Reverse KL, KL(q || p), Gu et al. 2024 "MiniLLM".

    Mode-seeking: a small student concentrates on the teacher's main modes instead of smearing over all.
    Config: ``{name: reverse_kl}``.
    """

    def per_token(self, student_logits, teacher_logits, labels) -> torch.Tensor:
        return functional.reverse_kl(student_logits, teacher_logits)


class GeneralizedJSD(LogitLoss):
    """Generalized Jensen-Shannon divergence, Agarwal et al. 2024 "On-Policy Distillation of Language
    Models" (GKD): beta KL(p || m) + (1 - beta) KL(q || m) with m = beta p + (1 - beta) q.

    ``beta`` in [0, 1] interpolates between the KLs: beta = 0 is forward KL(p || q) and beta = 1 reverse
    KL(q || p), computed exactly (the mixture formula itself is 0 at both ends).
    Config: ``{name: generalized_jsd, beta: 0.5}``.
    """

    def __init__(self, beta: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.beta = _check_unit_interval(
            "generalized_jsd beta", beta, upper_open=False, hint="0 = forward KL, 0.5 = symmetric JSD, 1 = reverse KL."
        )

    def per_token(self, student_logits, teacher_logits, labels) -> torch.Tensor:
        return functional.generalized_jsd(student_logits, teacher_logits, self.beta)


class SkewForwardKL(LogitLoss):
    """Skew KL, KL(p || alpha p + (1 - alpha) q), Ko et al. 2024 "DistiLLM".

    Mixing a little of p into the student's side keeps the loss and its gradient bounded where q -> 0,
    which DistiLLM found to train faster and more stably. alpha = 0 is forward KL.
    Config: ``{name: skew_forward_kl, alpha: 0.1}``.
    """

    def __init__(self, alpha: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.alpha = _check_unit_interval(
            "skew_forward_kl alpha", alpha, upper_open=True, hint="alpha = 1 makes the loss 0; DistiLLM uses 0.1."
        )

    def per_token(self, student_logits, teacher_logits, labels) -> torch.Tensor:
        return functional.skew_forward_kl(student_logits, teacher_logits, self.alpha)


class SkewReverseKL(LogitLoss):
    """Skew reverse KL, KL(q || (1 - alpha) p + alpha q), Ko et al. 2024 "DistiLLM". alpha = 0 is reverse KL.

    Config: ``{name: skew_reverse_kl, alpha: 0.1}``.
    """

    def __init__(self, alpha: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.alpha = _check_unit_interval(
            "skew_reverse_kl alpha", alpha, upper_open=True, hint="alpha = 1 makes the loss 0; DistiLLM uses 0.1."
        )

    def per_token(self, student_logits, teacher_logits, labels) -> torch.Tensor:
        return functional.skew_reverse_kl(student_logits, teacher_logits, self.alpha)


class TotalVariation(LogitLoss):
    """Total variation distance, 1/2 sum_v |p - q| (Wen et al. 2023 "f-Divergence Minimization for
    Sequence-Level Knowledge Distillation"): bounded in [0, 1], so no single token dominates.

    Config: ``{name: total_variation}``.
    """

    def per_token(self, student_logits, teacher_logits, labels) -> torch.Tensor:
        return functional.total_variation(student_logits, teacher_logits)


class LogitMSE(LogitLoss):
    """Mean squared error between logits, mean_v (z_s - z_t)^2, Ba & Caruana 2014 "Do Deep Nets Really
    Need to be Deep?". Matches the logits themselves, not only their softmax. It is computed on z / T
    like every logit loss, so with the default ``T**2`` scaling the temperature cancels out.

    Config: ``{name: logit_mse}``.
    """

    top_k_targets = False  # raw logits, which a captured teacher's top-k log-probabilities do not hold

    def per_token(self, student_logits, teacher_logits, labels) -> torch.Tensor:
        return functional.mean_squared_error(student_logits, teacher_logits)

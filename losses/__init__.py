"""Distillation losses: small modules with one signature, found by name through a registry."""

from losses.attention import AttentionKL
from losses.base import DistillationLoss, LogitLoss, LossOutput
from losses.composite import WeightedSum
from losses.cross_tokenizer import CrossTokenizer
from losses.divergences import (
    ForwardKL,
    GeneralizedJSD,
    LogitMSE,
    ReverseKL,
    SkewForwardKL,
    SkewReverseKL,
    TotalVariation,
)
from losses.drafting import TargetVerified
from losses.hidden import HiddenCosine, HiddenMSE, HiddenStateLoss
from losses.mutual import MutualKL
from losses.policy import PolicyGradient
from losses.registry import LOSSES, build_loss, resolve
from losses.supervised import CrossEntropy

__all__ = [
    "LOSSES",
    "AttentionKL",
    "CrossEntropy",
    "CrossTokenizer",
    "DistillationLoss",
    "ForwardKL",
    "GeneralizedJSD",
    "HiddenCosine",
    "HiddenMSE",
    "HiddenStateLoss",
    "LogitLoss",
    "LogitMSE",
    "LossOutput",
    "MutualKL",
    "PolicyGradient",
    "ReverseKL",
    "SkewForwardKL",
    "SkewReverseKL",
    "TargetVerified",
    "TotalVariation",
    "WeightedSum",
    "build_loss",
    "resolve",
]

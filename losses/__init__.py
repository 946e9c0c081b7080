"""Distillation losses: small modules with one signature, found by name through a registry."""

from losses.base import DistillationLoss, LogitLoss, LossOutput
from losses.divergences import ForwardKL
from losses.registry import LOSSES, build_loss

__all__ = ["LOSSES", "DistillationLoss", "ForwardKL", "LogitLoss", "LossOutput", "build_loss"]

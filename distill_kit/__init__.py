"""distill-kit: train a small student language model to imitate a large frozen teacher on DeepSpeed."""

from distill_kit.config import TrainingConfig
from distill_kit.distiller import Distiller

__all__ = ["Distiller", "TrainingConfig"]

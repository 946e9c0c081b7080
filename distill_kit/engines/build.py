"""Build the two DeepSpeed engines: a trained student and a frozen, sharded teacher."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import deepspeed
import torch
from torch import nn

from distill_kit.config import TrainingConfig
from distill_kit.engines import fp8, overflow, schedule
from distill_kit.engines.deepspeed_config import zero_stage
from distill_kit.engines.head import headless_forward
from distill_kit.engines.models import TORCH_DTYPES


class StudentWithLoss(nn.Module):
    """The student plus the loss module's own parameters (e.g. hidden-state projections), if any.

    Wrapping them in one module lets DeepSpeed's optimizer train, clip and checkpoint both, while the
    forward is the student's alone; export takes ``.student`` and leaves the loss behind. A loss without
    parameters stays outside: ZeRO-3 hooks every submodule and would expect it inside the engine's forward.
    """

    def __init__(self, student: nn.Module, loss: nn.Module):
        super().__init__()
        self.student = student
        self.loss = loss if any(True for _ in loss.parameters()) else None

    def forward(self, head: bool = True, **inputs: Any) -> Any:
        """``head=False``: the body only, and the head handed to the loss (``engines/head.py``)."""
        return self.student(**inputs) if head else headless_forward(self.student, **inputs)


def build_student(
    model: nn.Module, loss: nn.Module, ds_config: Mapping[str, Any], training: TrainingConfig
) -> deepspeed.DeepSpeedEngine:
    """The student's training engine: its optimizer from its DeepSpeed config, its learning-rate schedule the
    run's (``engines/schedule.py``; DeepSpeed steps it after every applied optimizer step)."""
    module = StudentWithLoss(model, loss)
    if module.loss is not None and zero_stage(ds_config) == 3:
        raise ValueError(
            f"loss {type(loss).__name__} has trainable parameters, which a ZeRO-3 student cannot hold outside "
            "its forward; use a ZeRO-2 student config (zero_optimization.stage: 2)."
        )
    module.train()
    trainable = [p for p in module.parameters() if p.requires_grad]
    config = {key: value for key, value in ds_config.items() if key != "scheduler"}  # the run's schedule runs
    engine, *_ = deepspeed.initialize(model=module, model_parameters=trainable, config=config,
                                      lr_scheduler=lambda optimizer: schedule.scheduler(optimizer, training))
    overflow.fuse_overflow_check(engine)  # the same bf16 non-finite check, without ~2,000 launches a step
    overflow.fuse_grad_norm(engine)  # the same clipping norm in one kernel (CUDA)
    return engine


def build_teacher(
    model: nn.Module, ds_config: Mapping[str, Any], dtype: str, device: torch.device
) -> nn.Module:
    """The frozen teacher: a ZeRO-3 inference engine (each rank holds 1/N of it) or a replicated module.

    DeepSpeed builds an optimizer-free engine only for stage 3; ZeRO-1/2 exist to shard optimizer state,
    which a frozen model has none of, and refuse to build without one. Stages 0-2 therefore give a plain
    replicated module in the run's dtype.
    """
    model.requires_grad_(False)
    model.eval()
    if not any(True for _ in model.parameters()):
        return model  # no weights to shard or place: a captured teacher (distill_kit/offline/captured_teacher.py)
    if fp8.is_fp8(model):
        return model  # loaded onto its device in FP8 (engines/fp8.py), replicated; a dtype cast would undo it
    if zero_stage(ds_config) == 3:
        engine, *_ = deepspeed.initialize(model=model, config=dict(ds_config))
        engine.eval()
        return engine
    return model.to(device=device, dtype=TORCH_DTYPES[dtype])

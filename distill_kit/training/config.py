"""Typed settings of a distillation run that the DeepSpeed configs' ``"auto"`` values are filled from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from distill_kit.engines import fp8, kernels
from distill_kit.training.on_policy import OnPolicyConfig

DType = Literal["fp32", "bf16", "fp16"]
LRSchedule = Literal["linear", "cosine", "constant"]


@dataclass
class TrainingConfig:
    """What one optimizer step looks like and how the student learns.

    These are the values a user writes once; every ``"auto"`` in either DeepSpeed config is filled from
    them, so the two engines can never disagree about micro-batch size or precision.
    """

    max_steps: int = 100
    """Optimizer steps to take (each is ``gradient_accumulation_steps`` micro-batches per rank)."""
    micro_batch_size: int = 8
    """Sequences per rank per forward; the teacher engine uses the same."""
    gradient_accumulation_steps: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    """Steps of linear warm-up: step k of them uses lr * k / warmup_steps; 0 or 1 is the full lr at step 1."""
    lr_schedule: LRSchedule = "linear"
    """After warm-up: 'linear' or 'cosine' decay to min_lr_ratio * lr (reached just after the last step), or
    'constant'. The run's, whatever the DeepSpeed config says: the lr of every step is in training/schedule.py."""
    min_lr_ratio: float = 0.0
    """Where the decay ends, as a fraction of lr; e.g. 0.1 with cosine for a decay to 10%."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    dtype: DType = "fp32"
    """Precision of both engines: bf16 on modern GPUs; fp32 on the CPU, where bf16 matmuls are slow."""
    seed: int = 0
    log_every: int = 10
    checkpoint_dir: str | None = None
    """Where checkpoints go, one ``step_N`` folder each; None writes none (a signal then only stops the run)."""
    save_every: int = 0
    """Optimizer steps between checkpoints; 0 saves only after the last step and when a signal stops the run."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept; the oldest is deleted only once a newer one is complete."""
    max_bad_steps: int = 3
    """Non-finite (NaN/inf loss or gradient) steps in a row that stop the run; fewer are skipped and counted."""
    teacher_kernels: kernels.Kernels = "auto"
    """Faster kernels for the teacher (``distill_kit/engines/kernels.py``): liger (Liger-Kernel's RoPE, RMSNorm,
    SwiGLU; ``pip install distill-kit[liger]``), compile (``torch.compile`` per decoder layer), none; auto is liger
    on a GPU where Liger supports the architecture, else none."""
    teacher_precision: fp8.Precision = "auto"
    """The teacher's compute precision: auto (the run's dtype), bf16, or fp8: its decoder layers' linear layers in
    FP8 through torchao (row-wise scales), replicated on every rank whatever teacher_ds_config's stage, loaded a layer
    at a time; a CUDA GPU of compute capability 8.9+ (``distill_kit/engines/fp8.py``). Its auto teacher_kernels are
    compile."""
    student_kernels: kernels.Kernels = "auto"
    """The same choice for the student(s); auto is none for a student that samples on-policy (Liger's kernels stop
    its compiled decode step's CUDA graphs: ``on_policy.student_kernels``)."""
    fused_loss: bool = True
    """Run the student without its output head and let logit losses apply it chunk by chunk, so the full
    student logits (B x T x vocabulary) never exist (``losses/fused.py``). Used only where it is exact (a ZeRO-2
    student of a known architecture, no loss that reads full logits); the run's log says when it is not."""
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
    """Rows answered by the student's own samples (GKD) or the teacher's (sequence-level KD); off by default."""

    def __post_init__(self) -> None:
        checks = {
            "max_steps": self.max_steps >= 1,
            "micro_batch_size": self.micro_batch_size >= 1,
            "gradient_accumulation_steps": self.gradient_accumulation_steps >= 1,
            "lr": self.lr > 0,
            "warmup_steps": self.warmup_steps >= 0,
            "lr_schedule": self.lr_schedule in ("linear", "cosine", "constant"),
            "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
            "max_grad_norm": self.max_grad_norm >= 0,
            "dtype": self.dtype in ("fp32", "bf16", "fp16"),
            "log_every": self.log_every >= 1,
            "save_every": self.save_every >= 0,
            "keep_checkpoints": self.keep_checkpoints >= 1,
            "max_bad_steps": self.max_bad_steps >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise ValueError(f"invalid training settings: {values}")
        kernels.check(self.teacher_kernels, "teacher_kernels")
        kernels.check(self.student_kernels, "student_kernels")
        fp8.check(self.teacher_precision, "teacher_precision")
        self.betas = tuple(self.betas)
        if isinstance(self.on_policy, dict):
            self.on_policy = OnPolicyConfig(**self.on_policy)

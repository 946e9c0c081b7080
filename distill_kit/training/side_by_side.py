"""Independent models side by side: N models, no teacher, one loop over the same micro-batches.

The seed document's second case (Accelerate's "several different models at once"): each model has its
own DeepSpeed engine, config, optimizer and scheduler, and they share only the data. Each model's loss
gets, in the teacher slot, the *other* models' detached outputs: a loss that ignores the slot
(``cross_entropy``) trains each model exactly as it would train alone, and ``mutual_kl`` makes them teach
each other (deep mutual learning, ``losses/mutual.py``)::

    outputs = {name: self.forward(name, batch) for name in self.models}      # every model first
    losses = {name: self.compute_loss(name, out, self.peers(outputs, name), batch) ...}
    for name, loss in losses.items(): engine.backward(loss.total); engine.step()

All forwards come before any loss, so a mutual loss reads every peer at the same weights (the
simultaneous-update form of mutual learning); the cost is N models' activations alive at once. The loop around
the step, its records, checkpoints (each model's engine in ``step_N/<name>``, one manifest), ``resume()``,
signals and non-finite steps are the Distiller's (:class:`~distill_kit.training.loop.Trainer`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distill_kit.distiller import CONFIG_DIR, Batch
from distill_kit.engines import deepspeed_config, distributed, kernels
from distill_kit.engines import models as loading
from distill_kit.engines.build import build_student
from distill_kit.engines.deepspeed_config import TrainedConfig
from distill_kit.run import export
from distill_kit.training import nonfinite
from distill_kit.training.config import TrainingConfig
from distill_kit.training.loop import Trainer
from distill_kit.training.student_spec import StudentSpec, student_specs
from losses import DistillationLoss, LossOutput, build_loss


class SideBySide(Trainer):
    """N models trained together without a teacher, each its own engine; ``models`` as in
    :class:`~distill_kit.training.multi_student.MultiStudentDistiller`'s ``students``."""

    def __init__(
        self,
        models: Sequence[StudentSpec | Mapping[str, Any]],
        *,
        training: TrainingConfig | None = None,
        ds_config: str | Path | Mapping[str, Any] = CONFIG_DIR / "zero2_student.json",
        ds_overrides: Mapping[str, Any] | None = None,
    ):
        super().__init__(training)
        specs = student_specs(models)
        facts = {spec.name: loading.facts(spec.model) for spec in specs}
        configs, _ = deepspeed_config.prepare_group(
            {spec.name: TrainedConfig(spec.ds_config or ds_config, spec.training(self.training),
                                      facts[spec.name]["hidden_size"], {**(ds_overrides or {}), **spec.ds_overrides})
             for spec in specs},
            None, teacher_hidden_size=None, world_size=distributed.world_size(),
        )
        self.ds_configs: dict[str, dict[str, Any]] = configs
        self.losses: dict[str, DistillationLoss] = {
            spec.name: build_loss(spec.loss, **{f"student_{k}": v for k, v in facts[spec.name].items()})
            for spec in specs
        }
        needing_teacher = {name: type(loss).__name__ for name, loss in self.losses.items() if loss.needs_teacher}
        if needing_teacher:
            raise ValueError(
                f"losses {needing_teacher} read a teacher's outputs, and models side by side have no teacher: use "
                "cross_entropy, mutual_kl, or a weighted sum of them (or MultiStudentDistiller, with a teacher)"
            )
        self.models: dict[str, Any] = {}
        for spec in specs:
            loss, config = self.losses[spec.name], configs[spec.name]
            model = loading.load(spec.model, config, self.training.dtype, loss.needs_attentions)
            kernels.apply(model, self.training.student_kernels, "training.student_kernels")
            self.models[spec.name] = build_student(model, loss, config, spec.training(self.training))

    # ---- the hooks ---------------------------------------------------------------------------------------

    def model_inputs(self, name: str, batch: Batch) -> dict[str, Any]:
        """What model ``name`` is called with: no labels, and only the outputs its loss asks for."""
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": batch.get("attention_mask"),
            "output_hidden_states": self.losses[name].needs_hidden_states,
            "output_attentions": self.losses[name].needs_attentions,
        }

    def forward(self, name: str, batch: Batch) -> Any:
        return self.models[name](**self.model_inputs(name, batch))

    @staticmethod
    def peers(outputs: Mapping[str, Any], name: str) -> tuple[Any, ...]:
        """Every other model's outputs, detached: a loss may learn from them but never train them."""
        return tuple(_detached(out) for other, out in outputs.items() if other != name)

    def compute_loss(self, name: str, output: Any, peers: tuple[Any, ...], batch: Batch) -> LossOutput:
        return self.losses[name](output, peers, batch)

    def training_step(self, batch: Batch) -> dict[str, LossOutput]:
        """One micro-batch for every model: all forwards, all losses, then each model's backward and step.

        A non-finite loss makes DeepSpeed discard that model's update; the loop skips the step when every model
        discarded it, and stops naming them when only some did.
        """
        outputs = {name: self.forward(name, batch) for name in self.models}
        losses = {name: self.compute_loss(name, out, self.peers(outputs, name), batch) for name, out in outputs.items()}
        for name, loss in losses.items():
            self.models[name].backward(nonfinite.poison_if_not_finite(loss.total))
            self.models[name].step()
        return losses

    # ---- the loop (training/loop.py: Trainer) ----------------------------------------------------------------

    def engines(self) -> dict[str, Any]:
        return self.models

    def micro_batch(self, batch: Batch) -> dict[str, LossOutput]:
        return self.training_step(batch)

    # ---- export ------------------------------------------------------------------------------------------

    def module(self, name: str) -> nn.Module:
        """The bare model ``name`` (no engine, no loss parameters), e.g. for export."""
        return self.models[name].module.student

    def export(self, directory: str | Path, tokenizer: Any | None = None) -> dict[str, Path]:
        """Each bare model as a Hugging Face model directory, ``<directory>/<name>``."""
        return {name: export.export_student(self.module(name), Path(directory) / name, tokenizer)
                for name in self.models}


def _detached(output: Any) -> Any:
    """A model output (a ``ModelOutput`` dict of tensors and tuples of tensors) cut from autograd."""
    def cut(value: Any) -> Any:
        if torch.is_tensor(value):
            return value.detach()
        if isinstance(value, tuple):
            return tuple(cut(v) for v in value)
        return value
    return type(output)(**{key: cut(value) for key, value in output.items()})

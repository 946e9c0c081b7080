"""One trained model of a group, as a user or a run config's ``students: [...]`` entry describes it."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill_kit.engines.models import ModelSource
from distill_kit.training.config import TrainingConfig
from losses.registry import LossSpec


@dataclass(frozen=True)
class StudentSpec:
    """A model trained with others on the same batches: its own weights, loss, DeepSpeed config and lr.

    Everything that shapes a batch (micro-batch, accumulation, steps, precision) is the group's
    :class:`TrainingConfig`, because every engine steps on the same micro-batches; what an optimizer does
    with them is the model's own.
    """

    name: str
    """Label in logs (``<name>/loss``) and folder of its checkpoints and export (``<dir>/<name>``)."""
    model: ModelSource
    """A save_pretrained directory, a hub name or a built ``nn.Module``."""
    loss: LossSpec = "forward_kl"
    """A registered name, ``{name: ..., params}``, a weighted list, or ``pkg.module:Class``."""
    ds_config: str | Path | Mapping[str, Any] | None = None
    """This model's DeepSpeed config (JSON/HJSON, ``"auto"`` allowed); None takes the group's default."""
    ds_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Dotted keys written into its config over the group's overrides, e.g. ``{"zero_optimization.stage": 3}``."""
    lr: float | None = None
    """Its learning rate (fills its ``"auto"`` lr and warm-up peak); None takes ``training.lr``."""
    peft: Any = None
    """LoRA adapters to train instead of the whole model: ``{r, alpha, dropout, target_modules, export_merged}``,
    an ``AdapterConfig`` or a ``peft.PeftConfig`` (``engines/peft_student.py``); None trains every weight."""

    def __post_init__(self) -> None:
        if not (self.name and self.name.replace("-", "_").replace(".", "_").isidentifier()):
            raise ValueError(f"student name {self.name!r} must be a non-empty word (letters, digits, '_', '-', '.'): "
                             "it names the model's log keys and its checkpoint folder")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"student {self.name!r}: lr must be > 0, got {self.lr}")

    def training(self, group: TrainingConfig) -> TrainingConfig:
        """The group's settings with this model's own learning rate."""
        return group if self.lr is None else dataclasses.replace(group, lr=self.lr)


def spec_from(cls: type, entry: Any, kind: str) -> Any:
    """``entry`` as a ``cls`` spec: a spec is kept; a dict's keys are checked first (each unknown one named,
    with the closest known key), since a misspelt key would otherwise become a ``TypeError`` or be lost."""
    if not isinstance(entry, Mapping):
        return entry
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in entry if key not in fields]
    if unknown:
        hints = [f"{key!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(key, fields, 1))
                 else repr(key) for key in unknown]
        raise ValueError(f"unknown {kind} keys {', '.join(hints)}; a {kind} has {', '.join(fields)}")
    return cls(**entry)


def student_specs(entries: Sequence[StudentSpec | Mapping[str, Any]]) -> list[StudentSpec]:
    """Specs from specs or plain dicts (a run config's entries); unknown keys and repeated names are errors."""
    specs = [spec_from(StudentSpec, entry, "student") for entry in entries]
    if not specs:
        raise ValueError("no students: give at least one, e.g. [{name: small, model: path/to/student}]")
    names = [spec.name for spec in specs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"student names must differ (they name folders and log keys): {repeated} repeat")
    return specs

"""Experiment trackers a run reports to, as the Hugging Face Trainer's ``report_to``: TensorBoard, Weights & Biases,
MLflow. Each is optional (an extra), each is offline-safe by default, and each gets the run config as the run's
parameters and every training and evaluation scalar by step.

- ``tensorboard``: ``<output_dir>/tensorboard`` (``torch.utils.tensorboard``; ``pip install tensorboard``).
- ``wandb``: offline unless ``WANDB_MODE`` says otherwise (``wandb sync <output_dir>/wandb/offline-run-*`` uploads
  later); project ``WANDB_PROJECT`` or ``distill-kit``. ``pip install distill-kit[wandb]``.
- ``mlflow``: the tracking server in ``MLFLOW_TRACKING_URI`` if set, else a local SQLite store
  ``<output_dir>/mlflow.db`` (MLflow 3's recommended local backend; its file store is in maintenance mode and
  refused by default): ``mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db``. Experiment
  ``MLFLOW_EXPERIMENT_NAME`` or ``distill-kit``. ``pip install distill-kit[mlflow]``.

A resumed run continues the same tracker runs: their ids are kept in ``<output_dir>/trackers.json``. TensorBoard
drops the steps past the checkpoint (``purge_step``) and W&B ignores steps it already has; MLflow keeps both
copies of the steps the stopped run logged after its last checkpoint (its history is append-only).
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

IDS_FILE = "trackers.json"
PACKAGES = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "distill-kit[wandb]"),
            "mlflow": ("mlflow", "distill-kit[mlflow]")}
"""Each tracker: the module it imports, and what to pip install for it."""


def check(names: Sequence[str] | None) -> list[str]:
    """The trackers to open: ``names`` checked (known and installed), or with None TensorBoard when installed."""
    if names is None:
        return ["tensorboard"] if _importable("tensorboard") else []
    if list(names) == ["none"]:  # the Hugging Face Trainer's spelling of no trackers
        return []
    unknown = [name for name in names if name not in PACKAGES]
    if unknown:
        raise ValueError(f"report_to: unknown trackers {unknown}; choose from {sorted(PACKAGES)}, or [] for none")
    missing = [f"{name} (pip install {PACKAGES[name][1]})" for name in names if not _importable(name)]
    if missing:
        raise ValueError(f"report_to: not installed: {', '.join(missing)}; or leave it out of report_to")
    return list(dict.fromkeys(names))


def _importable(name: str) -> bool:
    try:
        importlib.import_module(PACKAGES[name][0])
    except ImportError:
        return False
    return True


def open_trackers(names: Sequence[str] | None, directory: str | Path, params: Mapping[str, Any],
                  resumed_at: int | None) -> list[Any]:
    """Start (or, after a resume, continue) each tracker's run; rank 0 only."""
    directory = Path(directory)
    ids_path = directory / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() and resumed_at is not None else {}
    chosen = check(names)
    opened = [OPENERS[name](directory, params, resumed_at, ids.get(name)) for name in chosen]
    ids = {name: tracker.run_id for name, tracker in zip(chosen, opened, strict=True) if tracker.run_id}
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1))
    return opened


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"training": {"lr": 1e-3}, "students": [{...}]}`` -> ``{"training.lr": 1e-3, "students.0.name": ...}``."""
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (list, tuple)) and tree and any(isinstance(v, (Mapping, list, tuple)) for v in tree):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


class TensorBoardTracker:
    run_id = None

    def __init__(self, directory: Path, params: Mapping[str, Any], resumed_at: int | None, run_id: str | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory / "tensorboard"), purge_step=resumed_at)
        self.writer.add_text("run_config", "\n".join(f"    {k}: {v}" for k, v in flatten(params).items()), 0)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, directory: Path, params: Mapping[str, Any], resumed_at: int | None, run_id: str | None):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "distill-kit"), name=directory.name,
                              dir=str(directory), config=dict(params), id=run_id, resume="allow" if run_id else None,
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new")
        self.run_id = self.run.id

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, directory: Path, params: Mapping[str, Any], resumed_at: int | None, run_id: str | None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(directory / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "distill-kit")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment_id, run_name=directory.name).info.run_id
            # MLflow caps a parameter value at 6000 characters and a batch at 100 parameters.
            values = [Param(k, json.dumps(v) if not isinstance(v, str) else v)
                      for k, v in flatten(params).items()]
            for start in range(0, len(values), 100):
                self.client.log_batch(run_id, params=[Param(p.key, p.value[:6000]) for p in values[start:start + 100]])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


OPENERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}

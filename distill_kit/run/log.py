"""What a run leaves to read while it runs: JSON lines, and the trackers of ``report_to`` (``trackers.py``;
by default TensorBoard when it is installed).

``train.jsonl`` gets one record per optimizer step, ``eval.jsonl`` one per evaluation. Both are appended,
so a resumed run continues the same files; on resume, records past the checkpoint's step (written by the
run that was stopped after its last checkpoint) are dropped, so every step appears once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distill_kit.engines import distributed
from distill_kit.run import trackers


class RunLog:
    """Rank 0 writes; the other ranks' calls do nothing."""

    def __init__(self, directory: str | Path, resumed_at: int | None = None,
                 report_to: Sequence[str] | None = None, params: Mapping[str, Any] | None = None):
        """``report_to`` names the trackers (None: TensorBoard when installed); ``params`` (the run config) is
        logged as each tracker run's parameters."""
        self.directory = Path(directory)
        self.train_path, self.eval_path = self.directory / "train.jsonl", self.directory / "eval.jsonl"
        self.trackers: list[Any] = []
        if not distributed.is_main():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in (self.train_path, self.eval_path):
            kept = [r for r in read(path) if resumed_at is not None and r["step"] <= resumed_at]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.trackers = trackers.open_trackers(report_to, self.directory, params or {}, resumed_at)

    def step(self, record: Mapping[str, Any]) -> None:
        self._append(self.train_path, record, "train")

    def evaluation(self, step: int, metrics: Mapping[str, Mapping[str, float]]) -> None:
        flat = {f"{model}/{name}": value for model, values in metrics.items() for name, value in values.items()}
        self._append(self.eval_path, {"step": step, "metrics": dict(metrics)}, "eval", flat)

    def evaluations(self) -> list[dict[str, Any]]:
        return read(self.eval_path)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()

    def _append(self, path: Path, record: Mapping[str, Any], prefix: str,
                scalars: Mapping[str, Any] | None = None) -> None:
        if not distributed.is_main():
            return
        with path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")
        values = {f"{prefix}/{key}": value for key, value in (scalars if scalars is not None else record).items()
                  if key != "step" and isinstance(value, (int, float))}
        for tracker in self.trackers:
            tracker.log(values, record["step"])


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []

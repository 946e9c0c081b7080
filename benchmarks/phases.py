"""Where a distillation step's time goes, measured without adding synchronisation to the step.

:class:`TimedDistiller` is the real :class:`~distill_kit.Distiller`; its hooks (teacher forward, student
forward, loss) and the student engine's ``backward`` and ``step`` only drop a CUDA event on the compute
stream as they finish. Events are read once, after the last step, so the timed steps run exactly as in
training: the only host waits are the ones the Distiller itself has (the finite-loss check and the
per-step log). On the CPU every op is synchronous and host clocks stand in for events.

Step wall time is taken on the host between step starts: each step ends with the Distiller's log
``.item()``, which waits for the device, so consecutive starts bracket one whole step, loop overhead
included, as a training run sees it.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from distill_kit import Distiller

# Boundaries in step order; each phase runs from the previous boundary to its own.
# "finite_check" is the Distiller's all-rank NaN check (one all-reduce and one host wait per micro-batch).
PHASES = ("teacher_forward", "student_forward", "loss", "finite_check", "backward", "optimizer_step")


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steps: list[dict[str, Any]] = []  # per step: host start time and one stamp per boundary

    def _stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_step(self) -> None:
        self.steps.append({"host_start": time.perf_counter(), "start": self._stamp()})

    def mark(self, boundary: str) -> None:
        self.steps[-1][boundary] = self._stamp()

    def _elapsed_ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def summary(self, host_end: float, skip: int) -> dict[str, Any]:
        """Medians over the steps after the first ``skip`` (warm-up); call after the device is idle."""
        starts = [s["host_start"] for s in self.steps] + [host_end]
        wall_ms = [(b - a) * 1e3 for a, b in zip(starts, starts[1:], strict=False)][skip:]
        phase_ms: dict[str, list[float]] = {name: [] for name in PHASES}
        for step in self.steps[skip:]:
            previous = step["start"]
            for name in PHASES:
                phase_ms[name].append(self._elapsed_ms(previous, step[name]))
                previous = step[name]
        medians = {name: statistics.median(values) for name, values in phase_ms.items()}
        step_ms = statistics.median(wall_ms)
        medians["other"] = max(0.0, step_ms - sum(medians.values()))
        return {"step_ms": step_ms, "step_ms_all": wall_ms, "phase_ms": medians}


class TimedDistiller(Distiller):
    """A Distiller whose phases are stamped; the step itself is the inherited one, unchanged."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.clock = StepClock(self.device)
        # The engine calls are not Distiller hooks; wrapping the two bound methods stamps them in place.
        self.student.backward = self._stamped("backward", self.student.backward)
        self.student.step = self._stamped("optimizer_step", self.student.step)

    def _stamped(self, boundary: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def stamped(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            self.clock.mark(boundary)
            return result
        return stamped

    def teacher_forward(self, batch):
        self.clock.start_step()
        out = super().teacher_forward(batch)
        self.clock.mark("teacher_forward")
        return out

    def student_forward(self, batch):
        out = super().student_forward(batch)
        self.clock.mark("student_forward")
        return out

    def compute_loss(self, student_out, teacher_out, batch):
        out = super().compute_loss(student_out, teacher_out, batch)
        self.clock.mark("loss")
        return out

    def check_finite(self, loss):
        super().check_finite(loss)
        self.clock.mark("finite_check")

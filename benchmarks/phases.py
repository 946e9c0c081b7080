"""Where a distillation step's time goes, measured without adding synchronisation to the step.

:class:`TimedDistiller` is the real :class:`~distill_kit.Distiller`; its hooks (teacher forward, student
forward, loss) and the student engine's ``backward`` and ``step`` only drop a CUDA event on the compute
stream as they finish. Events are read once, after the last step, so the timed steps run exactly as in
training: the only host waits are the ones the Distiller itself has. On the CPU every op is synchronous
and host clocks stand in for events.

A step's time runs from its start event to the next step's (the last one's to :meth:`StepClock.finish`),
so it includes the loop's own work between steps and any time the device waits for the host, as a
training run sees it.
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
PHASES = ("teacher_forward", "student_forward", "loss", "backward", "optimizer_step")


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steps: list[dict[str, Any]] = []  # per step: one stamp at its start and one per boundary
        self.end: Any = None

    def _stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _elapsed_ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def start_step(self) -> None:
        self.steps.append({"start": self._stamp()})

    def mark(self, boundary: str) -> None:
        self.steps[-1][boundary] = self._stamp()

    def finish(self) -> None:
        """Stamp the end of the last step; call right after training returns."""
        self.end = self._stamp()

    def summary(self, skip: int) -> dict[str, Any]:
        """Medians over the steps after the first ``skip`` (warm-up); call once the device is idle."""
        starts = [step["start"] for step in self.steps] + [self.end]
        step_ms = [self._elapsed_ms(a, b) for a, b in zip(starts, starts[1:], strict=False)][skip:]
        phase_ms = {name: [] for name in PHASES}
        for step in self.steps[skip:]:
            previous = step["start"]
            for name in PHASES:
                phase_ms[name].append(self._elapsed_ms(previous, step[name]))
                previous = step[name]
        medians = {name: statistics.median(values) for name, values in phase_ms.items()}
        median_step = statistics.median(step_ms)
        medians["other"] = max(0.0, median_step - sum(medians.values()))
        return {"step_ms": median_step, "step_ms_all": step_ms, "phase_ms": medians}


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

"""SIGTERM/SIGINT: finish the step, save, and leave cleanly on every rank.

A cluster preempts a job with SIGTERM (often to one process first), and a user stops one with Ctrl-C. Dying
inside a step would lose everything since the last checkpoint, and one rank leaving alone would leave the others
hanging in the teacher's collectives. So the handler only raises a flag; at the end of each step the ranks
all-reduce it and, if any rank was signalled, all of them save and return together. A second signal of the same
kind means "now": the handler from before any stop request is put back and the signal re-delivered (Ctrl-C twice
raises KeyboardInterrupt, a second SIGTERM ends the process), also when requests are nested (the CLI's around the
loop's): every active request hears the first signal, so none takes the second for a first.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import torch

from distill_kit.engines import distributed

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_ACTIVE: list[StopRequest] = []  # the requests in force, outermost first


class StopRequest:
    """While active (``with StopRequest(device) as stop``), SIGTERM and SIGINT ask the run to stop at step end."""

    def __init__(self, device: torch.device):
        self.device = device
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # Python handles signals only there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received == name:  # the second one: put back the handler from before all requests, re-deliver
            original = next((r._previous.get(signum) for r in _ACTIVE if signum in r._previous), None)
            signal.signal(signum, original if original is not None else signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        for request in _ACTIVE or [self]:
            request.received = name
        logger.warning("%s received on rank %d: finishing this step, then saving and stopping",
                       name, distributed.rank())

    def agreed(self) -> bool:
        """Whether any rank was signalled; a collective, so call it on every rank at the same point."""
        flag = torch.tensor(float(self.received is not None), device=self.device)
        return distributed.all_reduce_sum(flag).item() > 0

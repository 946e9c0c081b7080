"""DeepSpeed's non-finite-gradient check, as one multi-tensor reduction instead of seven kernels per parameter.

Under bf16, DeepSpeed 0.19's ZeRO-1/2 optimizer checks every gradient for NaN/inf before each step
(``bf16.check_grad_overflow``, on by default), and ``training/nonfinite.py`` relies on that check to discard a bad
step on every rank. It does so one tensor at a time (``amax``, ``amin``, two ``isfinite``, ``logical_and``,
``logical_not``, an add: about seven launches per parameter). For the 0.5B student's 290 tensors that is ~2,000
kernel launches, and the step is bound by the CPU issuing them, not by the GPU: ``benchmarks/optimizer_step.py``
measured it (``benchmarks/results/step.md``, "The optimizer step").

:func:`fuse_overflow_check` replaces that one method of the built optimizer with ``torch._foreach_norm(ord=inf)``
over the same gradients: the largest magnitude of each, NaN where a tensor holds a NaN and inf where it holds an
infinity, so one ``isfinite`` over the stacked maxima answers the same question in a handful of launches. The
answer is the same boolean, all-reduced by DeepSpeed's own ``has_overflow`` as before; the arithmetic of the step
does not change (no norm, no weight is computed differently). It is a patch on one method of a pinned library
version, so it checks that the method it replaces exists and does what it expects, and leaves the optimizer as it
is (with a log line) otherwise.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)

_METHOD = "has_overflow_partitioned_grads_serial"


def _fused(optimizer: Any) -> torch.Tensor:
    """True (as a 1-element tensor, as DeepSpeed's own returns) when any partitioned gradient holds NaN or inf."""
    grads = [grad for group in range(len(optimizer.bit16_groups))
             for grad in (optimizer.averaged_gradients[group] or []) if grad is not None and grad.numel()]
    if not grads:
        return torch.zeros(1, dtype=torch.bool)
    maxima = torch.stack(torch._foreach_norm(grads, ord=float("inf")))  # NaN propagates; -inf shows as inf
    return torch.isfinite(maxima).all().logical_not().reshape(1)


def fuse_overflow_check(engine: Any) -> bool:
    """Give ``engine``'s ZeRO-1/2 optimizer the fused check; True where it was applied. Where DeepSpeed does not
    check (fp32, or ``check_grad_overflow: false``) or its optimizer is not the one expected, nothing changes."""
    optimizer = getattr(engine, "optimizer", None)
    if not getattr(optimizer, "check_grad_overflow", False):
        return False
    if not all(hasattr(optimizer, name) for name in (_METHOD, "bit16_groups", "averaged_gradients")):
        logger.info("DeepSpeed's %s has no %s as 0.19 has: its per-tensor overflow check is kept",
                    type(optimizer).__name__, _METHOD)
        return False
    setattr(optimizer, _METHOD, types.MethodType(_fused, optimizer))
    return True

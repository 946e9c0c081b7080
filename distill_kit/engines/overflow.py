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

:func:`fuse_grad_norm` does the same for the gradient norm that clipping reads (``get_grad_norm_direct``: one
``linalg.vector_norm`` per tensor, each on an fp64 copy, ~580 launches for the 0.5B student, ~15 ms of CPU a step).
It takes every tensor's norm in one ``torch._foreach_norm`` and hands DeepSpeed's own method the vector of those
norms as a single tensor: the 2-norm of the per-tensor norms is the 2-norm of all the gradients, so DeepSpeed's
own reduction, all-reduce over the data-parallel ranks and non-finite masking run on it unchanged. The value is the
same norm, accumulated in another order (its rounding differs in the last bits of an fp64 sum, far below the
float32 clipping coefficient's). It applies on CUDA only: on the CPU ``_foreach_norm`` is a per-tensor loop itself,
and the CPU's runs (the embedded default's figures) keep DeepSpeed's exact arithmetic.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)

_METHOD = "has_overflow_partitioned_grads_serial"
_NORM = "get_grad_norm_direct"


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


def _fused_norm(optimizer: Any, gradients: list[torch.Tensor], params: list[Any], norm_type: float = 2) -> torch.Tensor:
    """DeepSpeed's ``get_grad_norm_direct`` over one tensor: the per-tensor 2-norms of ``gradients`` (those that are
    not ZeRO's alignment padding, paired with ``params`` as DeepSpeed pairs them), taken in one multi-tensor kernel."""
    original = type(optimizer).get_grad_norm_direct
    unpadded = [g for g in gradients if not getattr(g, "_zero_padding", False)]
    grads = unpadded[:len(params)]  # DeepSpeed zips them with the params: as many as there are params
    if float(norm_type) != 2.0 or not grads:
        return original(optimizer, gradients, params, norm_type)
    from deepspeed.runtime.zero.utils import get_norm_dtype

    norms = torch.stack(torch._foreach_norm([g.detach() for g in grads], 2, dtype=get_norm_dtype()))
    return original(optimizer, [norms], params[:1], norm_type)


def fuse_grad_norm(engine: Any) -> bool:
    """Give ``engine``'s ZeRO-1/2 optimizer the one-kernel gradient norm; True where it was applied: on CUDA, one
    model-parallel rank, no pipeline-replicated parameters (whose norms DeepSpeed counts once per stage)."""
    optimizer = getattr(engine, "optimizer", None)
    device = getattr(engine, "device", None)
    if optimizer is None or torch.device(device if device is not None else "cpu").type != "cuda":
        return False
    needed = (_NORM, "bit16_groups", "params_in_partition", "model_parallel_world_size")
    if not all(hasattr(optimizer, name) for name in needed) or optimizer.model_parallel_world_size != 1:
        logger.info("DeepSpeed's %s is not the ZeRO-1/2 optimizer of one model-parallel rank that %s expects: its "
                    "per-tensor gradient norm is kept", type(optimizer).__name__, _NORM)
        return False
    if any(getattr(p, "ds_pipe_replicated", False) for group in optimizer.params_in_partition for p in group):
        return False
    setattr(optimizer, _NORM, types.MethodType(_fused_norm, optimizer))
    return True

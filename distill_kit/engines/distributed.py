"""One start-up path for ``deepspeed``, ``torchrun`` and plain ``python`` launches."""

from __future__ import annotations

import atexit
import os
import socket
import warnings
from datetime import timedelta
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

LIBRARY_WARNINGS = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",)
"""Deprecation warnings that DeepSpeed's own calls raise (its ZeRO-3 gathers call torch's
``all_gather_into_tensor``), not ours: the user can change nothing about them, so they are not printed at every
run. Only these exact messages are filtered; any other warning, ours included, is printed as usual."""
for _message in LIBRARY_WARNINGS:
    warnings.filterwarnings("ignore", message=_message, category=FutureWarning)


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def init(timeout_s: float = 600.0) -> torch.device:
    """Join (or, under plain ``python``, create) the process group and return this rank's device.

    Plain ``python`` sets none of the rendezvous variables; DeepSpeed would then try MPI discovery, so a
    one-rank group is described here instead. The timeout bounds every collective: a rank that stops
    feeding the ZeRO-3 teacher makes the others fail loudly instead of waiting forever.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", _free_port())
    if not dist.is_initialized():
        deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s))
        atexit.register(_destroy)  # a group we created is gone before the interpreter tears down its threads
    accelerator = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
        return torch.device(accelerator.device_name(local_rank))
    return torch.device("cpu")


def shutdown() -> None:
    """End a finished job: wait for every rank, then destroy the process group.

    A group left for the interpreter's exit can abort the process after its work is done ("terminate called
    without an active exception", exit code 134), which fails every script that chains on the exit code.
    """
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()


def _destroy() -> None:
    """At exit, without a barrier: a rank that failed must not wait for the others."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a no-op on one); the value keeps its device, wherever the backend needs it to be
    (NCCL reduces only accelerator tensors, gloo only CPU ones)."""
    if world_size() > 1:
        reduced = value.to(get_accelerator().current_device_name(), copy=True)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        value = reduced.to(value.device)
    return value


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    """Maximum over ranks (a no-op on one), e.g. the padded length every rank's batch agrees on."""
    if world_size() > 1:
        reduced = value.to(get_accelerator().current_device_name(), copy=True)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        value = reduced.to(value.device)
    return value


def barrier() -> None:
    """Wait for every rank (a no-op on one): e.g. until all have written their part of a checkpoint."""
    if world_size() > 1:
        dist.barrier()


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank, so that all take the same decision (which checkpoint to load)."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if world_size() == 1:
        return [value]
    everyone: list[Any] = [None] * world_size()
    dist.all_gather_object(everyone, value)
    return everyone

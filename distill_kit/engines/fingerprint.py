"""The identity of a frozen teacher: a hash of its weights, the same whatever the ZeRO layout or world size.

Checkpoints record it and resume compares it, so that a student is never continued against another teacher.
"""

from __future__ import annotations

import hashlib

import deepspeed
from torch import nn

from distill_kit.engines import distributed, fp8


def teacher_fingerprint(teacher: nn.Module) -> str:
    """sha256 of the teacher's weights (names, shapes, dtypes, values), the same on every rank.

    Independent of the ZeRO layout and world size: each parameter is gathered whole in turn (one at a time, so
    memory stays at one layer's weights), and the hashing is spread round-robin over the ranks. Call it on every
    rank: the gathers are collectives. A teacher without weights (outputs read from a store) names itself with
    a ``teacher_sha256`` attribute instead.
    """
    module = getattr(teacher, "module", teacher)  # a DeepSpeed engine wraps the model
    if isinstance(getattr(module, "teacher_sha256", None), str):
        return module.teacher_sha256
    rank, world = distributed.rank(), distributed.world_size()
    mine: dict[int, str] = {}
    for index, (name, param) in enumerate(module.named_parameters()):
        with deepspeed.zero.GatheredParameters([param]):
            if index % world == rank:
                kind, tensors = fp8.fingerprint_tensor(param)  # an FP8 weight: its data and scales
                digest = hashlib.sha256(f"{name}|{tuple(param.shape)}|{kind}|".encode())
                fp8.digest_tensors(digest, tensors)
                mine[index] = digest.hexdigest()
    merged: dict[int, str] = {}
    for part in distributed.all_gather_object(mine):
        merged.update(part)
    return hashlib.sha256("".join(merged[i] for i in sorted(merged)).encode()).hexdigest()

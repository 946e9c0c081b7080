"""Watching what a loss builds, for tests: every ``F.linear`` output's row count while a block runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def linear_rows() -> Iterator[list[int]]:
    """The rows of every tensor ``torch.nn.functional.linear`` makes inside the block (a head's logits are one per
    chunk when the loss applies it chunk by chunk), in order."""
    rows: list[int] = []
    real = torch.nn.functional.linear

    def watched(*args, **kwargs):
        out = real(*args, **kwargs)
        rows.append(out.shape[0])
        return out

    torch.nn.functional.linear = watched
    try:
        yield rows
    finally:
        torch.nn.functional.linear = real

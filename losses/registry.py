"""Losses by name, and user losses by import path, built from config entries."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from typing import Any

from losses.base import DistillationLoss
from losses.divergences import ForwardKL

LOSSES: dict[str, type[DistillationLoss]] = {
    "forward_kl": ForwardKL,
}


def resolve(name: str) -> type[DistillationLoss]:
    """A registered name (``forward_kl``) or a user class by path (``my_pkg.losses:MyLoss``)."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot import loss {name!r}: {err}. Use 'package.module:ClassName'.") from err
        if not (isinstance(cls, type) and issubclass(cls, DistillationLoss)):
            raise TypeError(f"loss {name!r} must be a subclass of losses.base.DistillationLoss")
        return cls
    if name not in LOSSES:
        close = difflib.get_close_matches(name, LOSSES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown loss {name!r}.{hint} Registered losses: {', '.join(sorted(LOSSES))}; "
            "or give a class by import path, 'package.module:ClassName'."
        )
    return LOSSES[name]


def build_loss(spec: str | Mapping[str, Any] | DistillationLoss) -> DistillationLoss:
    """``"forward_kl"`` or ``{"name": "forward_kl", "temperature": 2.0}`` -> a loss module."""
    if isinstance(spec, DistillationLoss):
        return spec
    if isinstance(spec, str):
        return resolve(spec)()
    kwargs = dict(spec)
    name = kwargs.pop("name", None)
    if name is None:
        raise ValueError(f"loss entry {dict(spec)!r} has no 'name'; e.g. {{name: forward_kl, temperature: 1.0}}")
    cls = resolve(name)
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise TypeError(f"bad parameters for loss {name!r}: {err}") from err

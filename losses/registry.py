"""Losses by name, and user losses by import path, built from config entries.

Some losses need facts about the models (hidden widths for a projection, layer counts for a layer map).
The Distiller knows them and hands them to :func:`build_loss` as keyword arguments; each is passed to a
loss whose ``__init__`` names that parameter, and a value in the config entry wins. So a user loss gets
them by naming them too, and a loss that does not need them never sees them.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from losses.attention import AttentionKL
from losses.base import DistillationLoss
from losses.composite import WeightedSum
from losses.cross_tokenizer import CrossTokenizer
from losses.divergences import (
    ForwardKL,
    GeneralizedJSD,
    LogitMSE,
    ReverseKL,
    SkewForwardKL,
    SkewReverseKL,
    TotalVariation,
)
from losses.drafting import TargetVerified
from losses.hidden import HiddenCosine, HiddenMSE
from losses.mutual import MutualKL
from losses.policy import PolicyGradient
from losses.supervised import CrossEntropy

LOSSES: dict[str, type[DistillationLoss]] = {
    "forward_kl": ForwardKL,
    "reverse_kl": ReverseKL,
    "generalized_jsd": GeneralizedJSD,
    "skew_forward_kl": SkewForwardKL,
    "skew_reverse_kl": SkewReverseKL,
    "total_variation": TotalVariation,
    "logit_mse": LogitMSE,
    "cross_entropy": CrossEntropy,
    "hidden_mse": HiddenMSE,
    "hidden_cosine": HiddenCosine,
    "attention_kl": AttentionKL,
    "mutual_kl": MutualKL,
    "cross_tokenizer": CrossTokenizer,
    "policy_gradient": PolicyGradient,
    "target_verified": TargetVerified,
}

LossSpec = str | Mapping[str, Any] | DistillationLoss | Sequence[Mapping[str, Any]]


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


def _instantiate(name: str, kwargs: Mapping[str, Any], model_facts: Mapping[str, Any]) -> DistillationLoss:
    cls = resolve(name)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {**{k: v for k, v in model_facts.items() if k in accepted}, **kwargs}
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise TypeError(f"bad parameters for loss {name!r}: {err}") from err


def _split_entry(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    kwargs = {"name": spec} if isinstance(spec, str) else dict(spec)
    name = kwargs.pop("name", None)
    if name is None:
        raise ValueError(f"loss entry {dict(spec)!r} has no 'name'; e.g. {{name: forward_kl, temperature: 1.0}}")
    return name, kwargs


def _build_weighted_sum(entries: Sequence[Any], model_facts: Mapping[str, Any]) -> WeightedSum:
    terms = []
    for entry in entries:
        if not isinstance(entry, Mapping) or "weight" not in entry:
            raise ValueError(
                f"each entry of a loss list needs a 'weight', got {entry!r}; e.g. "
                "[{name: cross_entropy, weight: 0.5}, {name: forward_kl, weight: 0.5}]"
            )
        name, kwargs = _split_entry(entry)
        weight = kwargs.pop("weight")
        label = kwargs.pop("label", name.rpartition(":")[2])
        terms.append((label, weight, _instantiate(name, kwargs, model_facts)))
    return WeightedSum(terms)


def build_loss(spec: LossSpec, **model_facts: Any) -> DistillationLoss:
    """A loss module from a config entry.

    ``spec`` is a name (``"forward_kl"``), a dict (``{"name": "forward_kl", "temperature": 2.0}``), a
    user class by path (``"my_pkg.losses:MyLoss"``, alone or as a dict's ``name``), a ready module, or a
    list of dicts with ``weight`` (and optionally ``label``) keys, which builds a :class:`WeightedSum`.
    ``model_facts`` (``student_hidden_size``, ``teacher_hidden_size``, ``student_num_layers``,
    ``teacher_num_layers``) reach each loss whose ``__init__`` takes them.
    """
    if isinstance(spec, DistillationLoss):
        return spec
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return _build_weighted_sum(spec, model_facts)
    name, kwargs = _split_entry(spec)
    return _instantiate(name, kwargs, model_facts)

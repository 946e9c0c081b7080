"""Rewards by name, and user rewards by import path, each checked for what it asks before any work."""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distill_kit.errors import ConfigError

IDS = ("prompt_ids", "completion_ids")
"""Parameters a reward may name beside a record's fields: the prompt's and the sample's token ids."""

REWARDS: dict[str, Callable[..., Any] | str] = {
    "arithmetic": "distill_kit.tasks.arithmetic:check",
    "sorting": "distill_kit.tasks.sorting:check",
}
"""Registered rewards: a function, or where to import it from (the tasks' checkers, imported when first used, so
that this floor imports nothing above it)."""


def register(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``@register("format_ok")`` makes ``format_ok`` a reward name for run configs of this process."""
    if not name.isidentifier():
        raise ValueError(f"reward name {name!r} must be an identifier (letters, digits, '_')")

    def add(function: Callable[..., Any]) -> Callable[..., Any]:
        REWARDS[name] = function
        return function
    return add


@dataclass(frozen=True)
class RewardFunction:
    """A reward, resolved: its name as written, the function, and the keyword parameters it asks for."""

    name: str
    function: Callable[..., Any]
    asks: tuple[str, ...]
    """Keyword parameters beyond (prompt, completion): ids and record fields."""
    all_fields: bool = False
    """It takes ``**fields``: every field of the record."""
    fields: tuple[str, ...] = ()
    """The record fields it cannot do without (named, with no default): what every record of the data must hold."""

    def __call__(self, prompt: str, completion: str, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                 record: Mapping[str, Any] | None = None) -> float:
        """The reward of one sample as a float; ``ValueError`` naming the reward for anything that is not a finite
        number (the caller names the prompt)."""
        available = {"prompt_ids": list(prompt_ids), "completion_ids": list(completion_ids), **(record or {})}
        kwargs = dict(record or {}) if self.all_fields else {}
        kwargs |= {name: available[name] for name in self.asks if name in available}  # a default covers the rest
        value = self.function(prompt, completion, **kwargs)
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise ValueError(f"reward {self.name!r} returned {_shown(value)}; a reward returns a finite number (or a "
                             "bool) per sample")
        return float(value)


def resolve(name: str, key: str, fields: Collection[str] | None = None) -> RewardFunction:
    """The reward ``name`` (registered, or ``package.module:function``), its signature checked; ``fields``: the
    data's record fields when known, which every field the reward names must be among. One ``ConfigError`` naming
    ``key`` for each way it can fail."""
    function = _function(name, key)
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: {name!r} has no signature Python can read; give a plain function "
                          "reward(prompt, completion, ...) -> float") from None
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_args = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not takes_args:
        raise ConfigError(f"{key}: {name!r} takes {_signature_of(signature)}; a reward takes (prompt, completion) "
                          "first, then any of prompt_ids, completion_ids or a record's fields by name")
    if any(p.kind == p.POSITIONAL_ONLY for p in positional[2:]):
        raise ConfigError(f"{key}: {name!r} has positional-only parameters past (prompt, completion); name them so "
                          "that they can be passed by name")
    named = positional[2:] + [p for p in params if p.kind == p.KEYWORD_ONLY]
    asks = tuple(p.name for p in named)
    required = {p.name for p in named if p.default is p.empty}
    all_fields = any(p.kind == p.VAR_KEYWORD for p in params)
    reward = RewardFunction(name, function, asks, all_fields, tuple(n for n in asks if n in required and n not in IDS))
    if fields is not None:
        missing = [field for field in reward.fields if field not in fields]
        if missing:
            raise ConfigError(f"{key}: {name!r} asks for the record field(s) {missing}, which the data's records do "
                              f"not have (they have {sorted(fields)}); add them to every record, or drop the "
                              "parameter (prompt_ids and completion_ids are always given)")
    return reward


def _function(name: str, key: str) -> Callable[..., Any]:
    if ":" not in name and name not in REWARDS:
        close = difflib.get_close_matches(name, REWARDS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{key}: unknown reward {name!r}.{hint} Registered: {', '.join(sorted(REWARDS))}; or give "
                          "a function by import path, 'package.module:function'")
    target = REWARDS.get(name, name)
    if callable(target):
        return target
    module_name, _, attr = target.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # the module's own error, whatever it is, named once
        raise ConfigError(f"{key}: cannot import reward {target!r} ({type(err).__name__}: {err}); check that the "
                          "module is on PYTHONPATH, imports cleanly, and the function is spelled as in its file"
                          ) from None
    if not callable(function):
        raise ConfigError(f"{key}: {target!r} is a {type(function).__name__}, not a function")
    return function


def _signature_of(signature: inspect.Signature) -> str:
    return f"({', '.join(signature.parameters)})"


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"

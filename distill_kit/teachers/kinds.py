"""Which backend a :class:`~distill_kit.config.TeacherSpec` names, and its card: the one place that decides it.

``kind: auto`` reads it from ``model``: a built :class:`Teacher` is itself; ``pkg.module:Class`` is that class; a
folder holding a store's ``manifest.json`` (and no model ``config.json``) is a ``store``; an ``http(s)://`` URL a
``served`` teacher; anything else (a model folder, a hub name, an ``nn.Module``) an in-process ``engine``. Adding
a kind: one file with a :class:`Teacher` subclass, one entry in :data:`KINDS`.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from distill_kit.config import TeacherSpec, import_subclass
from distill_kit.errors import ConfigError
from distill_kit.teachers.base import Teacher, TeacherCard

KINDS = {"engine": "distill_kit.teachers.engine:EngineTeacher", "store": "distill_kit.teachers.store:StoreTeacher",
         "served": "distill_kit.teachers.served:ServedTeacher", "self": "distill_kit.teachers.self_teacher:SelfTeacher"}
"""Each named kind's class, by import path (imported only when used: a store run never imports DeepSpeed's engine)."""

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_import_path(value: object) -> bool:
    return isinstance(value, str) and bool(_IMPORT_PATH.match(value))


def import_class(path: str, key: str) -> type[Teacher]:
    """``pkg.module:Class``, which must be a :class:`Teacher` subclass; a ``ConfigError`` naming ``key`` otherwise."""
    return import_subclass(path, Teacher, key, "subclass it and write describe, __init__ and forward "
                           "(docs/teachers.md#kinds-of-teacher-and-a-teacher-of-your-own)")


def is_url(model: object) -> bool:
    """A model given as a server's address: a ``served`` teacher (the one copy of the rule)."""
    return isinstance(model, str) and model.startswith(("http://", "https://"))


def kind_of(spec: TeacherSpec) -> str:
    """The backend's name: ``spec.kind``, or read from ``spec.model`` when it is ``auto``."""
    if spec.kind != "auto":
        return spec.kind
    model = spec.model
    if isinstance(model, Teacher):
        return "instance"
    if isinstance(model, type) and issubclass(model, Teacher):
        return "class"
    if is_import_path(model):
        return model
    if is_url(model):
        return "served"  # a teacher server's address (teachers/served.py)
    if isinstance(model, str | Path) and (Path(model) / "manifest.json").is_file() and not (
            Path(model) / "config.json").is_file():
        return "store"
    if type(model).__name__ == "CapturedTeacher":  # a store opened in Python (offline/captured_teacher.py)
        return "store"
    return "engine"


def teacher_class(spec: TeacherSpec) -> type[Teacher]:
    """The class that builds ``spec``'s teacher."""
    kind, key = kind_of(spec), f"teachers[{spec.name}].kind"
    if kind == "instance":
        return type(spec.model)
    if kind == "class":
        return spec.model
    if kind in KINDS:
        module_name, _, class_name = KINDS[kind].partition(":")
        return getattr(importlib.import_module(module_name), class_name)
    if is_import_path(kind):
        return import_class(kind, key if spec.kind != "auto" else f"teachers[{spec.name}].model")
    raise ConfigError(f"{key}: {kind!r} is not a kind of teacher; choose auto, {', '.join(KINDS)}, or "
                      "pkg.module:Class (a distill_kit.teachers.Teacher subclass)")


def describe(spec: TeacherSpec) -> TeacherCard:
    """``spec``'s card, without loading a weight; unknown ``options`` are refused, naming the ones it takes."""
    cls = teacher_class(spec)
    unknown = sorted(set(spec.options) - set(cls.options))
    if unknown:
        raise ConfigError(f"teachers[{spec.name}].options: {unknown} are not options of a {cls.kind or cls.__name__} "
                          f"teacher; it takes {list(cls.options) or 'none'}")
    if isinstance(spec.model, Teacher):
        return spec.model.card
    return cls.describe(spec)

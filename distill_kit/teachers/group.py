"""The run's teachers as one part of the step: built in order, run once per micro-batch for every student.

Each teacher is a :class:`~distill_kit.teachers.base.Teacher` of its own kind (an engine, a store, yours); this
group only runs them and combines what they return: one output, ``{name: output}`` for several (each student's
:class:`~distill_kit.teachers.combine.TeacherEnsembleLoss` combines them), or, routed, each row's logits from its
own teacher. Checkpoints record every teacher's identity by name, and resume refuses other teachers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from distill_kit.config import TeacherSpec
from distill_kit.engines import distributed
from distill_kit.teachers.base import Teacher, TeacherCard, TeacherSetup
from distill_kit.teachers.kinds import teacher_class
from distill_kit.teachers.paged import Pager
from distill_kit.teachers.residency import PagingPlan
from losses.functional import mixture_logits


class Teachers:
    """The run's frozen teachers, in order (a ZeRO-3 forward is a collective: every rank runs the same ones).

    They are built one after another, each into its own shards, before any student: the large models must never
    exist unsharded next to the students.
    """

    def __init__(self, specs: Sequence[TeacherSpec], cards: Mapping[str, TeacherCard],
                 setups: Mapping[str, TeacherSetup], *, vocab_size: int | None = None,
                 paging: PagingPlan | None = None):
        """``cards`` and ``setups``: the plan's, by name. ``vocab_size``: the smallest teacher vocabulary (the
        plan's), which routed rows are compared on. ``paging``: the plan's, when the teachers are paged."""
        self.specs = {spec.name: spec for spec in specs}
        self.pager = None if paging is None else Pager(setups[specs[0].name].device, paging.slots, paging.disk_dir)
        """With ``training.teacher_residency: paged``: the teachers' weights off the device (``paged.py``)."""
        self.members: dict[str, Teacher] = {}
        for spec in specs:  # a paged teacher leaves the device before the next one loads
            teacher = spec.model if isinstance(spec.model, Teacher) else teacher_class(spec)(spec, cards[spec.name],
                                                                                               setups[spec.name])
            if self.pager is not None:
                self.pager.adopt(spec.name, teacher.module, paging.kept[spec.name])
            self.members[spec.name] = teacher
        self.vocab_size = vocab_size
        self._identities: dict[str, str] | None = None

    def __len__(self) -> int:
        return len(self.members)

    def attach(self, students: Mapping[str, Any]) -> None:
        """Hand every teacher the built students (a self-teacher is made of one: ``Teacher.attach``)."""
        for teacher in self.members.values():
            teacher.attach(students)

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The micro-batch keys some teacher reads besides the model inputs (``Teacher.batch_keys``)."""
        return tuple(dict.fromkeys(key for teacher in self.members.values() for key in teacher.batch_keys))

    def _own(self, teacher: Teacher, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        """``inputs`` without the batch keys only other teachers read."""
        extra = set(self.batch_keys) - set(teacher.batch_keys)
        return inputs if not extra else {k: v for k, v in inputs.items() if k not in extra}

    @property
    def first(self) -> Any:
        """The first teacher's model (an engine, a captured store's module): "the teacher" where one is meant."""
        first = next(iter(self.members.values()), None)
        return None if first is None else (first.module if first.module is not None else first)

    @property
    def ds_configs(self) -> dict[str, dict[str, Any] | None]:
        """Each teacher's DeepSpeed config as its engine was given it (None for a kind without one), by name."""
        return {name: teacher.ds_config for name, teacher in self.members.items()}

    def forward(self, inputs: Mapping[str, Any], route: torch.Tensor | None = None) -> Any:
        """Every teacher on the same inputs, without gradients: one output, or ``{name: output}``. With ``route``
        (``combine: route``: each row's teacher index) each teacher runs only over its rows, and the output holds
        every row's logits from its own teacher."""
        with torch.no_grad():
            if route is not None:
                return self.routed(inputs, route)
            outputs = {name: self._brought(name).forward(self._own(teacher, inputs))
                       for name, teacher in self.members.items()}
        return next(iter(outputs.values())) if len(outputs) == 1 else outputs

    @property
    def prefetches(self) -> bool:
        """Some teacher does something with the next micro-batch before its forward: a server answers it, a pager
        moves the next teacher in. The loop then reads a micro-batch ahead across steps too
        (``Trainer.reads_ahead``)."""
        return self.pager is not None or any(type(teacher).prefetch is not Teacher.prefetch
                                             for teacher in self.members.values())

    def prefetch(self, inputs: Mapping[str, Any], route: torch.Tensor | None = None) -> None:
        """Start every teacher that can (a server) on the next micro-batch's ``inputs``; the others do nothing.
        Routed (``route``: the next micro-batch's teacher per row), paged teachers start moving the next one in."""
        if route is not None:
            if self.pager is not None:
                names = list(self.members)
                for index in route.unique().tolist():
                    self.pager.prefetch(names[index])
            return
        for teacher in self.members.values():
            teacher.prefetch(self._own(teacher, inputs))

    def _brought(self, name: str) -> Teacher:
        """Teacher ``name``, on the device (paged: brought in, the one before it taken off)."""
        if self.pager is not None:
            self.pager.bring(name)
        return self.members[name]

    def routed(self, inputs: Mapping[str, Any], route: torch.Tensor) -> SimpleNamespace:
        """Each row's logits from the teacher ``route`` names for it (vocabularies cut to the smallest).

        A ZeRO-3 forward is a collective, so every rank runs the teachers any rank needs, in the same order: a rank
        with no row of one runs it over its first row and drops the result. The routed loader (``ChatLoader(route=
        ...)``) gives every rank one and the same teacher per micro-batch, so that never happens in a run of it.
        """
        names = list(self.members)
        needed = torch.zeros(len(names), device=route.device)
        needed[route.unique()] = 1
        if self.pager is None:  # paged teachers are replicated: no collective to join
            needed = distributed.all_reduce_max(needed)
        logits = None
        for index in needed.nonzero().flatten().tolist():
            rows = (route == index).nonzero().flatten()
            sub = rows if len(rows) else route.new_zeros(1)  # a forward this rank only joins
            teacher = self._brought(names[index])
            own = self._own(teacher, inputs)
            out = teacher.forward({k: v[sub] if torch.is_tensor(v) else v for k, v in own.items()})
            vocab = self.vocab_size or out.logits.shape[-1]
            if logits is None:
                logits = out.logits.new_zeros((route.shape[0], out.logits.shape[1], vocab))
            if len(rows):
                logits[rows] = out.logits[..., :vocab]
        return SimpleNamespace(logits=logits)

    def mixture(self, outputs: Any) -> Any:
        """What evaluation compares a student with: the one teacher (or each row's own, routed), or the teachers'
        weighted mixture at temperature 1 (vocabularies cut to the smallest)."""
        if type(outputs) is not dict:  # one output (a ModelOutput is a dict subclass), or routed rows
            return outputs
        total = sum(spec.weight for spec in self.specs.values())
        vocab = min(out.logits.shape[-1] for out in outputs.values())
        return SimpleNamespace(logits=mixture_logits([outputs[name].logits[..., :vocab] for name in self.specs],
                                                     [spec.weight / total for spec in self.specs.values()], 1.0))

    @property
    def identities(self) -> dict[str, str]:
        """Each teacher's identity by name (an engine's weight sha256: computed once, on every rank)."""
        if self.pager is None:
            return {name: teacher.identity for name, teacher in self.members.items()}
        if self._identities is None:  # each brought in once to be hashed, as its resident twin would be
            self._identities = {name: self._brought(name).identity for name in self.members}
        return dict(self._identities)

    @property
    def sha256(self) -> str | None:
        """What checkpoints record and resume compares: the one teacher's identity, or every teacher's by name."""
        if not self.members:
            return None
        if len(self.members) == 1:
            return next(iter(self.identities.values()))
        return ", ".join(f"{name}={sha}" for name, sha in self.identities.items())

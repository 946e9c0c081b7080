"""Teachers written outside the library against ``distill_kit.teachers.Teacher`` (each well under 80 lines), run
by import path: ``teachers: [{name: fixed, model: user_teachers:FixedTeacher, options: {vocab_size: 300}}]``."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from distill_kit.teachers import LOGITS, TOP_K, Teacher, TeacherCard
from losses.sparse import SparseTeacherLogits


class FixedTeacher(Teacher):
    """At every position the same next-token distribution: ``softmax(z)``, ``z`` drawn once from ``seed``."""

    kind = "user_teachers:FixedTeacher"
    options = ("vocab_size", "seed")

    @classmethod
    def describe(cls, spec) -> TeacherCard:
        return TeacherCard(kind=cls.kind, source=f"seed {spec.options.get('seed', 0)}", outputs=frozenset({LOGITS}),
                           vocab_size=int(spec.options.get("vocab_size", 300)), hidden_size=32, num_layers=1)

    def __init__(self, spec, card, setup):
        super().__init__(spec, card, setup)
        generator = torch.Generator().manual_seed(int(spec.options.get("seed", 0)))
        self.z = torch.randn(card.vocab_size, generator=generator)

    def forward(self, inputs: Mapping[str, Any]) -> Any:
        ids = inputs["input_ids"]
        return SimpleNamespace(logits=self.z.to(ids.device).expand(*ids.shape, -1))


class FixedTopKTeacher(FixedTeacher):
    """The same distribution, handed over as its top 8 log-probabilities (as a store or a server would)."""

    kind = "user_teachers:FixedTopKTeacher"

    @classmethod
    def describe(cls, spec) -> TeacherCard:
        card = super().describe(spec)
        return TeacherCard(kind=cls.kind, source=card.source, outputs=frozenset({TOP_K}), vocab_size=card.vocab_size)

    def forward(self, inputs: Mapping[str, Any]) -> Any:
        top = torch.log_softmax(self.z, -1).topk(8)
        shape = (*inputs["input_ids"].shape, 8)
        return SimpleNamespace(logits=SparseTeacherLogits(top.values.expand(shape), top.indices.expand(shape)))


class PrefetchingTeacher(FixedTeacher):
    """The fixed distribution, and a record of what it is told ahead (``prefetch``) and what it is asked
    (``forward``): the inputs' first token ids, in order."""

    kind = "user_teachers:PrefetchingTeacher"

    def __init__(self, spec, card, setup):
        super().__init__(spec, card, setup)
        self.prefetched: list[list[int]] = []
        self.asked: list[list[int]] = []

    def prefetch(self, inputs: Mapping[str, Any]) -> None:
        self.prefetched.append(inputs["input_ids"][:, 0].tolist())

    def forward(self, inputs: Mapping[str, Any]) -> Any:
        self.asked.append(inputs["input_ids"][:, 0].tolist())
        return super().forward(inputs)

"""A captured teacher: its outputs read from a store written once by ``scripts/capture_teacher.py``.

No weights are loaded and no teacher runs: each micro-batch's top-k log-probabilities (and the tail's mass, and the
captured hidden layers) are looked up by the block's tokens (``offline/captured_teacher.py``). So it returns top-k
targets, which the logit losses compare on the k ids (``losses/sparse.py``); it cannot generate, and it has no full
distribution to mix, route or evaluate a KL against: the plan refuses those uses before anything loads.

Options: ``tail_bucket`` (default true: k + 1 outcomes, the last "any other token", exact at temperature 1; false
renormalises over the k, at any temperature) and ``k`` (this run's k, checked against the store's).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distill_kit.config import TeacherSpec
from distill_kit.engines import models
from distill_kit.errors import ConfigError
from distill_kit.offline.captured_teacher import CapturedTeacher, teacher_config
from distill_kit.offline.store import Manifest
from distill_kit.teachers.base import HIDDEN_STATES, SAMPLED, TOP_K, TOP_K_TAIL, Teacher, TeacherCard, TeacherSetup


class StoreTeacher(Teacher):
    kind = "store"
    options = ("tail_bucket", "k")

    @classmethod
    def describe(cls, spec: TeacherSpec) -> TeacherCard:
        if isinstance(spec.model, CapturedTeacher):
            store, root, tail = spec.model.spec, spec.model.reader.root, spec.model.tail_bucket
        else:
            root, tail = Path(spec.model), bool(spec.options.get("tail_bucket", True))
            try:
                store = Manifest.load(root).spec
            except (FileNotFoundError, ValueError) as err:
                raise ConfigError(f"teachers[{spec.name}].model: {err}") from None
        config = teacher_config(store)
        text = config.get_text_config()
        sampled = store.targets == "sampled"
        outputs = ({SAMPLED} if sampled else {TOP_K} | ({TOP_K_TAIL} if tail else set())) | (
            {HIDDEN_STATES} if store.hidden_layers else set())
        return TeacherCard(kind=cls.kind, source=str(root), outputs=frozenset(outputs), vocab_size=store.vocab_size,
                           tokenizer_sha256=store.tokenizer_hash,
                           positions=models.positions(config), hidden_size=text.hidden_size,
                           num_layers=text.num_hidden_layers, eos_token_id=getattr(text, "eos_token_id", None),
                           model_type=config.model_type, config=config,
                           sample_temperature=store.temperature if sampled else None)

    def __init__(self, spec: TeacherSpec, card: TeacherCard, setup: TeacherSetup):
        super().__init__(spec, card, setup)
        self.captured = spec.model if isinstance(spec.model, CapturedTeacher) else CapturedTeacher(
            spec.model, k=spec.options.get("k"), tail_bucket=bool(spec.options.get("tail_bucket", True)))

    def forward(self, inputs: Mapping[str, Any]) -> Any:
        return self.captured(**inputs)

    @property
    def identity(self) -> str:
        return self.captured.teacher_sha256  # the captured teacher's weights' hash, as the live teacher's would be

    @property
    def module(self) -> CapturedTeacher:
        return self.captured

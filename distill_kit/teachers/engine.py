"""The in-process teacher: a model loaded into the training processes, frozen, as one DeepSpeed engine.

ZeRO-3 by default (each rank holds 1/N of it and every forward gathers a layer at a time), replicated at stages 0-2,
or replicated in FP8 (``training.teacher_precision: fp8``, ``engines/fp8.py``). It returns what its model returns:
full logits, or, when the plan chose it (``TeacherSetup.head_at_loss``), its final hidden states and its output head,
applied inside the loss chunk by chunk next to the student's (``engines/head.py``): the (tokens x vocabulary) logits
then never exist. It can generate (``sampler: teacher``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import deepspeed
from torch import nn

from distill_kit.config import TeacherSpec
from distill_kit.engines import fp8, head, kernels, models
from distill_kit.engines.build import build_teacher
from distill_kit.engines.fingerprint import teacher_fingerprint
from distill_kit.teachers.base import ATTENTIONS, HEAD, HIDDEN_STATES, LOGITS, Teacher, TeacherCard, TeacherSetup


class EngineTeacher(Teacher):
    kind = "engine"

    @classmethod
    def describe(cls, spec: TeacherSpec) -> TeacherCard:
        model = spec.model.module if isinstance(spec.model, deepspeed.DeepSpeedEngine) else spec.model
        config = models.model_config(model)  # the one read of its config in a run
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        facts = models.facts(config)
        model_type = getattr(config, "model_type", None)
        outputs = {LOGITS, HIDDEN_STATES, ATTENTIONS} | ({HEAD} if model_type in head.EXACT_HEADS else set())
        return TeacherCard(
            kind=cls.kind, source=str(model) if isinstance(model, str | Path) else type(model).__name__,
            outputs=frozenset(outputs), can_generate=True, engine=True, vocab_size=getattr(text, "vocab_size", None),
            tokenizer=str(model) if isinstance(model, str | Path) else None,  # a folder or a hub name
            positions=models.positions(config), hidden_size=facts["hidden_size"], num_layers=facts["num_layers"],
            eos_token_id=models.end_token(models.generation_config(model), config), model_type=model_type,
            config=config)

    def __init__(self, spec: TeacherSpec, card: TeacherCard, setup: TeacherSetup):
        super().__init__(spec, card, setup)
        training = setup.training
        if isinstance(spec.model, deepspeed.DeepSpeedEngine):  # built already (shared by Distillers): as it is
            self.engine: nn.Module = spec.model
        else:
            model = fp8.load_teacher(spec.model, setup.ds_config, training.dtype,
                                     fp8.resolve(training.teacher_precision, training.dtype), setup.need_attentions,
                                     setup.device, config=card.config)
            kernels.apply(model, fp8.run_teacher_kernels(training), "training.teacher_kernels",
                          liger=kernels.teacher_liger(training.on_policy))
            self.engine = build_teacher(model, setup.ds_config, training.dtype, setup.device)
        self._identity: str | None = None

    def forward(self, inputs: Mapping[str, Any]) -> Any:
        if self.setup.head_at_loss and not inputs.get("output_attentions"):
            return head.teacher_head_forward(self.engine, **inputs)
        return self.engine(**inputs)

    @property
    def identity(self) -> str:
        """sha256 of its weights (computed once, on every rank: the hash gathers ZeRO-3 shards)."""
        if self._identity is None:
            self._identity = teacher_fingerprint(self.engine)
        return self._identity

    @property
    def module(self) -> nn.Module:
        return self.engine

    @property
    def ds_config(self) -> dict[str, Any]:
        return dict(self.setup.ds_config)

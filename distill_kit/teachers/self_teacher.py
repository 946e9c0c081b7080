"""The student as its own teacher, reading a privileged prompt (kind ``self``): on-policy self-distillation.

SDFT (Shenfeld et al. 2026, "Self-Distillation Enables Continual Learning") and SDPO (arXiv 2601.20802): one network
in two roles. The student reads the plain prompt and (on-policy) samples; the teacher is the same network reading a
prompt that also carries the reference answer, a hint, a tool result or a longer system prompt
(``data/privileged.py``), and scores the student's tokens. The loss is any of the library's, on the answer tokens
only: the teacher's logits come back laid out as the student's row, position for position.

Which weights teach (``options.mode``), and what each costs:

* ``live``: the student's own weights as they are, without gradient. No copy: one more forward of the student's
  model per micro-batch (in eval mode, so no dropout), on rows longer by the privileged prompt.
* ``initial``: one frozen copy of the student's weights as the run built them (its initial weights, also on resume:
  the copy is made from the student before any checkpoint loads), in the student's dtype.
* ``ema``: a copy moved toward the student after each applied optimizer step, ``ema = decay * ema + (1 - decay) *
  student`` over the trained parameters, kept in float32 (a bf16 average at decay 0.99 would lose the updates
  smaller than its rounding) plus, under bf16/fp16, a working copy in the student's dtype for the forward. The
  average is saved with the student's engine (buffers of its module, written once by DeepSpeed and read by every
  rank), with the number of steps it holds, so a resumed run continues it exactly. The step is applied at the
  teacher's next forward (the engine's count of applied steps against the average's), which is the same average
  the step's end would give: the weights do not change between a step and the next forward.

Options: ``mode`` (``initial`` | ``ema`` | ``live``, default ``initial``), ``decay`` (``ema``: in (0, 1), default
0.99), ``privileged`` (the template: ``{role, content, replace}`` or a string, ``data/privileged.py``). The plan
refuses a run of several students, text data, packed rows, and a student under ZeRO-3 with a copy.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from distill_kit.config import TeacherSpec, TrainingConfig
from distill_kit.data import privileged
from distill_kit.data.privileged import PrivilegedTemplate
from distill_kit.engines.deepspeed_config import zero_stage
from distill_kit.engines.fingerprint import teacher_fingerprint
from distill_kit.errors import ConfigError
from distill_kit.teachers.base import LOGITS, Teacher, TeacherCard, TeacherSetup

MODES = ("initial", "ema", "live")


def settings(spec: TeacherSpec) -> tuple[str, float | None, PrivilegedTemplate]:
    """``(mode, decay, template)`` from the spec's options; a ``ConfigError`` naming the key otherwise."""
    where = f"teachers[{spec.name}].options"
    mode = spec.options.get("mode", "initial")
    if mode not in MODES:
        raise ConfigError(f"{where}.mode: {mode!r}; choose one of {list(MODES)}")
    decay = spec.options.get("decay")
    if decay is not None and mode != "ema":
        raise ConfigError(f"{where}.decay is read by mode: ema only, and mode is {mode!r}: drop it, or set mode: ema")
    if mode == "ema":
        decay = 0.99 if decay is None else decay
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay < 1:
            raise ConfigError(f"{where}.decay: {decay!r}; the average's decay must lie in (0, 1), e.g. 0.99")
    if "privileged" not in spec.options:
        raise ConfigError(f"{where}.privileged: a self-teacher needs the prompt it reads instead of the student's, "
                          "e.g. {role: user, content: '{prompt}\\n\\nA correct answer: {completion}'} "
                          "(docs/teachers.md#the-student-as-its-own-teacher)")
    return mode, decay, PrivilegedTemplate.parse(spec.options["privileged"], f"{where}.privileged")


def template_of(teachers: Sequence[TeacherSpec]) -> PrivilegedTemplate | None:
    """The privileged template the chat data must carry: the self-teacher's among ``teachers`` (None without one)."""
    found = [settings(t)[2] for t in teachers if t.kind == "self"]
    if len({(t.content, t.role, t.replace) for t in found}) > 1:
        raise ConfigError("several self-teachers with different privileged templates: the data carries one "
                          "privileged prompt a conversation; give them the same options.privileged")
    return found[0] if found else None


class _Average(nn.Module):
    """The EMA's float32 tensors and the applied steps they hold, as buffers: saved with the student's engine."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        for i, tensor in enumerate(tensors):
            self.register_buffer(f"w{i}", tensor)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [buffer for name, buffer in self.named_buffers() if name != "steps"]


class SelfTeacher(Teacher):
    kind = "self"
    options = ("mode", "decay", "privileged")
    batch_keys = privileged.BATCH_KEYS

    @classmethod
    def describe(cls, spec: TeacherSpec) -> TeacherCard:
        if spec.model is not None:  # a model here would be silently ignored: the student teaches
            raise ConfigError(f"teachers[{spec.name}].model: a self-teacher is the student itself and reads no model "
                              f"({spec.model!r}): drop model, or drop kind: self for a teacher of its own weights")
        mode, _, _ = settings(spec)
        return TeacherCard(kind=cls.kind, source=f"the student ({mode} weights)", outputs=frozenset({LOGITS}),
                           is_student=True)

    @classmethod
    def run_problems(cls, spec: TeacherSpec, card: TeacherCard, *, students: Sequence[Any],
                     training: TrainingConfig, data: Any) -> list[str]:
        where, problems = f"teachers[{spec.name}] (kind self)", []
        if len(students) != 1:
            problems.append(f"{where}: the teacher is the student's own network, and this run has {len(students)} "
                            "students: distil each in its own run")
        if getattr(data, "kind", "text") != "chat":
            problems.append(f"{where} reads a privileged prompt made from each chat record, and the data is not chat: "
                            "give chat records (docs/chat.md); from Python, pass data=DataFacts(kind='chat')")
        if getattr(data, "packing", False) or training.on_policy.pack_to:
            problems.append(f"{where}: {privileged.PACKING}")
        mode = spec.options.get("mode", "initial")
        stages = {s.name: zero_stage(s.ds_config) for s in students if isinstance(s.ds_config, Mapping)}
        if mode != "live" and 3 in stages.values():
            problems.append(f"{where}: mode {mode!r} copies the student's weights, and a ZeRO-3 student holds a shard "
                            "of them: use mode: live, or a ZeRO-2 student")
        return problems

    def __init__(self, spec: TeacherSpec, card: TeacherCard, setup: TeacherSetup):
        super().__init__(spec, card, setup)
        self.mode, self.decay, self.template = settings(spec)
        self.student: Any = None
        self.copy: nn.Module | None = None
        """The frozen copy (``initial``, ``ema``); None for ``live``."""
        self.average: _Average | None = None
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (student's, copy's), trained parameters only
        self._written = -1  # the average's steps last written into the copy (bf16/fp16: its working copy)
        self._initial_sha: str | None = None

    def attach(self, students: Mapping[str, Any]) -> None:
        if len(students) != 1:
            raise ConfigError(f"teachers[{self.spec.name}] (kind self) teaches its own student; the run has "
                              f"{len(students)}")
        self.student = next(iter(students.values()))
        if self.mode == "live":
            return
        if zero_stage(self.student.ds_config) == 3:
            raise ConfigError(f"teachers[{self.spec.name}]: mode {self.mode!r} copies the student's weights, and a "
                              "ZeRO-3 student holds a shard of them: use mode: live, or a ZeRO-2 student")
        model = self.student.model
        self.copy = copy.deepcopy(model).requires_grad_(False).eval()
        self._initial_sha = teacher_fingerprint(self.copy)
        if self.mode == "ema":
            copies = dict(self.copy.named_parameters())
            self._pairs = [(param, copies[name]) for name, param in model.named_parameters() if param.requires_grad]
            masters = [c.data if c.dtype == torch.float32 else c.detach().float().clone() for _, c in self._pairs]
            self.average = _Average(masters)  # float32 copies share storage with the copy's parameters
            self.student.engine.module.add_module(f"self_teacher_{self.spec.name}", self.average)
            self._written = 0

    # ---- the forward ---------------------------------------------------------------------------------------

    def forward(self, inputs: Mapping[str, Any]) -> Any:
        """The privileged rows' logits at the student's positions (``data/privileged.py``)."""
        if self.student is None:
            raise ConfigError(f"teachers[{self.spec.name}] (kind self) was never given its student: build it through "
                              "the Distiller, which attaches it (Teacher.attach)")
        rows = privileged.teacher_rows(inputs, self.pad_id)
        model = self.model
        self.update()
        was_training = model.training
        model.eval()
        try:
            out = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, use_cache=False)
        finally:
            model.train(was_training)
        return CausalLMOutput(logits=privileged.to_student_layout(out.logits, rows.index))

    @property
    def model(self) -> nn.Module:
        """The network that teaches: the student's own (``live``) or the copy."""
        return self.student.model if self.copy is None else self.copy

    @property
    def pad_id(self) -> int:
        config = self.student.model.config
        pad = getattr(config, "pad_token_id", None)
        pad = pad if pad is not None else getattr(config, "eos_token_id", None)
        return int(pad[0] if isinstance(pad, list | tuple) else pad or 0)

    @torch.no_grad()
    def update(self) -> None:
        """``ema``: move the average over the optimizer steps the student applied since it last moved (one per
        step in a run: the teacher forwards every micro-batch), and write it into the working copy."""
        if self.average is None:
            return
        engine = self.student.engine
        applied = int(engine.global_steps) - int(engine.skipped_steps)
        behind = applied - int(self.average.steps)
        if behind > 0:
            weight = 1.0 - self.decay ** behind  # k steps toward the same weights: one step of 1 - decay^k
            for master, (param, _) in zip(self.average.tensors, self._pairs, strict=True):
                master.lerp_(param.detach().to(master.dtype), weight)
            self.average.steps.fill_(applied)
        if int(self.average.steps) != self._written:  # moved, or loaded from a checkpoint
            for master, (_, working) in zip(self.average.tensors, self._pairs, strict=True):
                if working.data.data_ptr() != master.data_ptr():
                    working.data.copy_(master)
            self._written = int(self.average.steps)

    # ---- what checkpoints record ---------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        """Mode, decay and template; for a copy also the sha256 of the initial weights (a resume from another
        initial student is refused)."""
        template = hashlib.sha256(repr((self.template.content, self.template.role, self.template.replace))
                                  .encode()).hexdigest()[:16]
        parts = ["self", self.mode] + ([str(self.decay)] if self.mode == "ema" else []) + [f"template={template}"]
        return ":".join(parts + ([f"initial={self._initial_sha}"] if self._initial_sha else []))

    @property
    def module(self) -> nn.Module | None:
        return None if self.student is None else self.model

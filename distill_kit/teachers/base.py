"""What a teacher is: one small interface that every kind of teacher implements.

A run needs two things of a teacher, at two times:

* **before anything loads**, its :class:`TeacherCard`: what it is (vocabulary, tokenizer, positions, width and
  depth, end token), what it can return (:data:`OUTPUTS`) and whether it can generate. The plan
  (``training/plan.py``) reads only cards, so every use a teacher cannot serve (a mixture of top-k targets,
  ``sampler: teacher`` without generation, hidden-state losses without hidden states) is refused before any write.
* **while training**, the built :class:`Teacher`: its ``forward`` on a micro-batch's inputs, and its ``identity``
  (what checkpoints record and resume compares).

A new kind of teacher is one file: a :class:`Teacher` subclass with ``describe`` (the card, from the spec, without
loading weights), ``__init__`` (load it) and ``forward``. Name it in ``kinds.KINDS``, or give it to a run by import
path (``kind: pkg.module:Class`` in a run config; the class itself, or an instance, from Python).

What ``forward`` returns is an object with ``logits``, and ``hidden_states`` / ``attentions`` when asked for:

* ``logits`` a ``(B, T, V)`` tensor (``"logits"``),
* or :class:`losses.sparse.SparseTeacherLogits`, top-k log-probabilities (``"top_k"``; with the tail mass,
  ``"top_k_tail"``),
* or a :class:`losses.fused.HeadOutput`, final hidden states and the output head, applied inside the loss next to
  the student's so that the teacher's full logits never exist (``"head"``; its ``logits`` are made on demand).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from distill_kit.config import TeacherSpec, TrainingConfig

LOGITS, TOP_K, TOP_K_TAIL, HEAD = "logits", "top_k", "top_k_tail", "head"
HIDDEN_STATES, ATTENTIONS = "hidden_states", "attentions"
SAMPLED = "sampled"
OUTPUTS = (LOGITS, TOP_K, TOP_K_TAIL, HEAD, HIDDEN_STATES, ATTENTIONS, SAMPLED)
"""What a teacher may return: dense logits over the whole vocabulary; top-k log-probabilities (renormalised over the
k, or with the tail's mass as one more outcome); its final hidden states with the output head; every layer's hidden
states; attention maps; tokens sampled from its distribution (a sampled store: forward KL's unbiased estimate)."""


@dataclass(frozen=True)
class TeacherCard:
    """What the plan knows of a teacher without loading a weight; None where the kind cannot tell."""

    kind: str
    """The backend's name (``engine``, ``store``, ... or ``pkg.module:Class``)."""
    source: str
    """Where it comes from, as the report records it (a folder, a store, a URL, a class)."""
    outputs: frozenset[str]
    """What its forward can return (of :data:`OUTPUTS`)."""
    can_generate: bool = False
    """It can write samples (``training.on_policy.sampler: teacher``)."""
    engine: bool = False
    """It runs as a DeepSpeed engine in the training processes: the plan resolves a DeepSpeed config for it."""
    vocab_size: int | None = None
    """Rows of its logits (may be padded past the tokenizer's)."""
    tokenizer: str | None = None
    """A folder or hub name its tokenizer loads from: compared with every student's, and the run's tokenizer when it
    leads the run and none is given (``plan.run_tokenizer``). None: it names none (a run config must then give
    ``tokenizer:``)."""
    tokenizer_sha256: str | None = None
    """Its vocabulary's sha256 (``offline/fingerprints.tokenizer_fingerprint``) where it has no folder to compare
    (a store, a server): compared with the run's tokenizer."""
    positions: int | None = None
    """The longest row it reads (``max_position_embeddings``)."""
    hidden_size: int | None = None
    num_layers: int | None = None
    eos_token_id: int | None = None
    model_type: str | None = None
    config: Any = field(default=None, compare=False, repr=False)
    """Its model config (a ``PretrainedConfig``) where it has one: what a fresh student is built from."""
    sample_temperature: float | None = None
    """A sampled teacher's (``SAMPLED``): the temperature its tokens were drawn at, which its losses' must equal."""
    is_student: bool = False
    """It is the student's own network (a self-teacher): the run's tokenizer is then the student's."""

    @property
    def dense(self) -> bool:
        """It returns logits over the whole vocabulary (mixtures, routing and evaluation's KL need them)."""
        return LOGITS in self.outputs or HEAD in self.outputs

    def facts(self) -> dict[str, int | None]:
        """Width and depth, as losses are sized by them (``teacher_hidden_size``, ``teacher_num_layers``)."""
        return {"hidden_size": self.hidden_size, "num_layers": self.num_layers}


@dataclass(frozen=True)
class TeacherSetup:
    """What the plan hands a teacher to build itself: its resolved DeepSpeed config and the run's settings."""

    ds_config: Mapping[str, Any]
    training: TrainingConfig
    device: torch.device
    need_attentions: bool = False
    head_at_loss: bool = False
    """The plan chose to hand the losses the teacher's hidden states and head (``HEAD``) instead of its logits."""


class Teacher(ABC):
    """A frozen teacher of one kind. Subclasses write ``describe``, ``__init__`` and ``forward``."""

    kind: ClassVar[str] = ""
    """The backend's name in cards and errors; a class given by import path is named by that path."""
    options: ClassVar[tuple[str, ...]] = ()
    """The ``TeacherSpec.options`` keys it takes; any other key is refused by the plan."""
    batch_keys: ClassVar[tuple[str, ...]] = ()
    """Keys of the micro-batch its ``forward`` reads besides the model inputs (a self-teacher: the labels and its
    privileged prompts); only this kind's forward gets them."""

    @classmethod
    @abstractmethod
    def describe(cls, spec: TeacherSpec) -> TeacherCard:
        """Its card, from the spec alone (configs and manifests may be read; weights never are)."""

    @classmethod
    def run_problems(cls, spec: TeacherSpec, card: TeacherCard, *, students: Sequence[Any], training: TrainingConfig,
                     data: Any) -> list[str]:
        """Every use of this teacher the run cannot serve, beyond what its card says (the plan reports them with the
        rest, before anything loads): ``students`` the run's specs, ``data`` its ``DataFacts``. Default: none."""
        return []

    def __init__(self, spec: TeacherSpec, card: TeacherCard, setup: TeacherSetup):
        self.spec, self.card, self.setup = spec, card, setup

    def attach(self, students: Mapping[str, Any]) -> None:
        """Called once the run's students are built (``{name: training.student.Student}``), before any step or
        resume: a teacher made of a student (kind ``self``) takes it here. Others: nothing."""
        return None

    @abstractmethod
    def forward(self, inputs: Mapping[str, Any]) -> Any:
        """Its outputs on a micro-batch's inputs (``input_ids``, ``attention_mask``, ``position_ids`` when packed,
        ``output_hidden_states`` / ``output_attentions`` when a loss asked), without gradients."""

    def prefetch(self, inputs: Mapping[str, Any]) -> None:
        """Start on the next micro-batch's ``inputs`` and return at once (a server's request goes out while the
        students train on this one); ``forward`` on the same inputs then takes the answer. In-process: nothing."""
        return None

    def __call__(self, **inputs: Any) -> Any:
        with torch.no_grad():
            return self.forward(inputs)

    @property
    def identity(self) -> str:
        """What checkpoints record and ``resume`` compares: another teacher is refused. By default its source."""
        return f"{self.card.kind}:{self.card.source}"

    @property
    def module(self) -> Any:
        """The model behind it, where there is one (``distiller.teacher``; ``generate`` for ``sampler: teacher``)."""
        return None

    @property
    def ds_config(self) -> dict[str, Any] | None:
        """The DeepSpeed config its engine was given, where it has one (the report records it)."""
        return None

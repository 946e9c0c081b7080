"""A run's plan: every decision its parts will use, derived from the specs without loading a single weight.

:func:`make_plan` is pure (it reads model configs and store manifests, never weights) and is the one place where a
run's shape is decided and checked: each teacher's card (``teachers/``), each student's model config, losses and
DeepSpeed configs, which uses every teacher can serve, the tokenizer rule over every model, the rows every model
reads, the on-policy sample limit and packing, whether the teachers hand the losses their head, and the checkpoint
folder. The :class:`~distill_kit.distiller.Distiller` builds from it, from Python and from the CLI alike, and the
CLI's start-up checks (``run/validate.py``) report its problems: every problem at once, before anything is written.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import nn

from distill_kit.config import DeepSpeedSettings, StudentSpec, TeacherSpec, TrainingConfig, check_names
from distill_kit.data import chat
from distill_kit.engines import fp8, head, kernels, models, peft_student, quantize
from distill_kit.engines.deepspeed_config import DeepSpeedConfigError, FrozenConfig, TrainedConfig, prepare, zero_stage
from distill_kit.errors import ConfigError
from distill_kit.students import from_teacher
from distill_kit.teachers import ATTENTIONS, HEAD, HIDDEN_STATES, SAMPLED, TeacherCard, kinds, residency
from distill_kit.teachers.combine import Combine, TeacherEnsembleLoss, check_weights
from distill_kit.teachers.residency import PagingPlan
from distill_kit.teachers.tokenizers import fingerprint_problems, tokenizer_problems
from distill_kit.training import checkpoint, rewarding
from losses import DistillationLoss, build_loss


@dataclass(frozen=True)
class DataFacts:
    """What a plan needs of the data, decided once by whoever reads it (the CLI's data phase; Python: say it)."""

    kind: Literal["text", "chat"] = "text"
    """Chat records (prompts to answer, assistant-only loss) or text blocks: ``chat.detect_format``, called once."""
    block_size: int | None = None
    """Tokens per row every student reads (and every teacher, unless ``teacher_block_size``)."""
    packing: bool = False
    """``data.packing: true`` on chat data: conversations packed into rows of ``block_size``."""
    teacher_block_size: int | None = None
    """Teacher rows when the teacher has another tokenizer (paired blocks); None: ``block_size``."""


@dataclass
class Plan:
    """What a run will build, and every decision derived on the way."""

    students: list[StudentSpec]
    teachers: list[TeacherSpec]
    training: TrainingConfig
    """The run's settings with what the plan derived filled in: ``on_policy.max_length`` and ``pack_to``, and
    ``checkpoint_dir`` (``<output_dir>/checkpoints`` when an output folder is given)."""
    cards: dict[str, TeacherCard]
    """Each teacher's card (``teachers/base.py``), by name: what it is and what it can return."""
    student_configs: dict[str, Any]
    """Each student's model config (its own, or the lead teacher's with ``init`` / ``init_from_teacher``)."""
    losses: dict[str, DistillationLoss]
    """Each student's loss, sized by its model and its teachers' (several teachers: a ``TeacherEnsembleLoss``)."""
    student_ds_configs: dict[str, dict[str, Any]]
    """Each student's DeepSpeed config, every "auto" filled from the run, by student name."""
    teacher_ds_configs: dict[str, dict[str, Any]]
    """Each teacher's, by teacher name (the engine's; every kind gets one, used only by those that build engines)."""
    teacher_vocab_size: int | None
    """The smallest teacher vocabulary (None across tokenizers or without a teacher): no student's may exceed it,
    and routed rows are compared on it (a teacher's padded vocabulary is cut to it)."""
    adapters: dict[str, Any]
    """Each LoRA student's ``peft.PeftConfig``, by name (``engines/peft_student.py``)."""
    combine: Combine = "sum"
    """How several teachers teach: a sum of losses, one loss against their mixture, or each row its own (route)."""
    head_at_loss: dict[str, bool] = field(default_factory=dict)
    """Each teacher hands the losses its final hidden states and head instead of its logits (``HEAD``)."""
    notes: list[str] = field(default_factory=list)
    """What the plan decided that a user may want to read (logged once): a sample limit, why a head stays."""
    data: DataFacts = field(default_factory=DataFacts)
    keys: dict[str, str] = field(default_factory=dict)
    """Each student's key in records and checkpoints: the one-line form's is empty (records ``loss``, folder
    ``deepspeed``), a named student's is its name (``<name>/loss``, folder ``<name>``)."""
    paging: PagingPlan | None = None
    """With ``training.teacher_residency: paged``: each teacher's bytes, where it is kept and the device slots
    (``teachers/residency.py``)."""
    rewards: list[Any] = field(default_factory=list)
    """``training.rewards``' functions, resolved and their signatures checked (``training/rewarding.py``)."""
    lead: str | None = None
    """The lead teacher's name (:func:`lead_teacher`): the one that stands for "the teacher" where one model is
    meant. None without a teacher."""
    tokenizer: str | None = None
    """The run's tokenizer, a folder or hub name (:func:`run_tokenizer`): the one given, else the lead teacher's as
    its card names it. The CLI reads its data with it; None: no model of the run names one."""
    speculative: Any = None
    """The run's ``eval.speculative`` (a :class:`~distill_kit.config.SpeculativeConfig`) when it is on: each student
    evaluated as a drafter of the lead teacher (``training/speculative.py``); None: off."""

    @property
    def need_attentions(self) -> bool:
        """A loss reads attention maps: the models load with eager attention (fused kernels return none)."""
        return any(loss.needs_attentions for loss in self.losses.values())

    @property
    def checkpoint_dir(self) -> str | None:
        return self.training.checkpoint_dir


def make_plan(
    students: Sequence[StudentSpec],
    teachers: Sequence[TeacherSpec],
    *,
    training: TrainingConfig,
    world_size: int,
    combine: Combine = "sum",
    deepspeed: DeepSpeedSettings | None = None,
    data: DataFacts | None = None,
    output_dir: str | Path | None = None,
    tokenizer: str | None = None,
    evaluate: bool = False,
    vocab_map: Any = None,
    alone: bool = False,
    speculative: Any = None,
) -> Plan:
    """The plan of a run of ``students`` and ``teachers``; one ``ConfigError`` listing every problem, each with its fix.

    ``data``: what the data is (its kind, rows, packing). ``output_dir``: the run's folder; checkpoints go to
    ``<output_dir>/checkpoints`` unless ``training.checkpoint_dir`` says where. ``tokenizer``: the run's tokenizer
    (a folder or hub name) every model's is compared with; None: the plan decides (:func:`run_tokenizer`).
    ``evaluate``: the run evaluates its students against the teachers (the CLI's does). ``alone``: the one-line
    case, whose messages say "student" and "teacher" and whose records and checkpoint folder have the empty key.
    ``speculative``: an ``eval.speculative`` setting; when on, every student must be able to draft for the lead
    teacher (:func:`drafter_problems`).
    """
    deepspeed = deepspeed or DeepSpeedSettings()
    data = data or DataFacts()
    problems: list[str] = []
    check_shape(students, teachers, training, combine, vocab_map)
    cards = _cards(teachers, problems)
    if len(cards) < len(teachers):
        _raise(problems)  # a student built from the teacher, every loss and config: all follow from the cards
    lead = lead_teacher(teachers)
    lead_card = cards[lead.name] if lead is not None else None
    student_configs = {s.name: config for s in students
                       if (config := _student_config(s, lead_card, problems)) is not None}
    if len(cards) < len(teachers) or len(student_configs) < len(students):
        _raise(problems)  # the rest is sized by the models' configs
    problems += capability_problems(students, teachers, cards, training, combine)
    for spec in teachers:  # what a kind itself refuses of the run (a self-teacher: several students, text data)
        problems += kinds.teacher_class(spec).run_problems(spec, cards[spec.name], students=students,
                                                           training=training, data=data)
    losses = {}
    for s in students:
        try:
            losses[s.name] = student_loss(s, models.facts(student_configs[s.name]), teachers, cards, combine, vocab_map)
        except ConfigError as err:
            problems.append(str(err))
    problems += _loss_needs(losses, teachers, cards)
    problems += sampled_problems(losses, teachers, cards)
    rewards, found = rewarding.plan_rewards(training.rewards, losses, training.on_policy, [t.name for t in teachers],
                                            {name: card.dense for name, card in cards.items()}, combine,
                                            chat=data.kind == "chat")
    problems += found
    if not teachers:
        needing = sorted(name for name, loss in losses.items() if loss.needs_teacher)
        if needing:
            problems.append(f"students {needing}: their losses read a teacher's outputs, and this run has no "
                            "teacher: use cross_entropy, mutual_kl or a weighted sum of them, or add a teacher")
    training, notes = _derived_training(training, students, student_configs, cards, data, combine, output_dir,
                                        problems)
    problems += _position_problems(student_configs, cards, data)
    problems += _sampler_problems(students, teachers, cards, student_configs, training, vocab_map)
    if data.packing and combine == "route":
        problems.append(chat.ROUTED_PACKING)
    tokenizer = run_tokenizer(students, teachers, cards, tokenizer, across=vocab_map is not None)
    if vocab_map is None:
        problems += _tokenizer_problems(students, teachers, cards, tokenizer)
    try:
        student_ds, teacher_ds = _deepspeed_configs(students, teachers, student_configs, cards, training, deepspeed,
                                                    world_size, alone)
    except DeepSpeedConfigError as err:
        problems.append(str(err))
        student_ds, teacher_ds = {}, {}
    problems += _engine_problems(students, teachers, cards, student_configs, training)
    paging, found = residency.residency_problems(teachers, cards, training, combine,
                                                 {n: zero_stage(c) for n, c in teacher_ds.items() if c}, world_size)
    problems += found
    teacher_vocab = None if vocab_map is not None else min(
        (card.vocab_size for card in cards.values() if card.vocab_size), default=None)
    adapters = {}
    for spec in students:
        problems += vocabulary_problems(getattr(student_configs[spec.name], "vocab_size", None), teacher_vocab,
                                        spec.name)
        if spec.peft is not None and spec.model is None and spec.init_from_teacher is None:
            problems.append(f"students[{spec.name}].peft: LoRA adapters train on a frozen pretrained student, but "
                            "this student is built with random weights (init): its frozen base would stay noise. "
                            "Give model: a pretrained directory (or init_from_teacher), or drop peft to train every "
                            "weight")
        if spec.peft is not None and spec.name in student_ds:
            try:
                adapters[spec.name] = peft_student.check(spec.peft, zero_stage(student_ds[spec.name]))
                peft_student.check_targets(adapters[spec.name], student_configs[spec.name])
            except (ImportError, TypeError, ValueError) as err:
                problems.append(f"students[{spec.name}].peft: {err}")
        if spec.quantize is not None and spec.name in student_ds:  # engines/quantize.py: device, torchao, layers
            problems += [f"students[{spec.name}].quantize: {problem}" for problem in quantize.problems(
                spec.quantize, student_configs[spec.name], zero_stage=zero_stage(student_ds[spec.name]),
                peft=spec.peft is not None, module=spec.model if isinstance(spec.model, nn.Module) else None)]
    problems += feature_drafter_problems(students, teachers, cards, training, combine)
    speculative = speculative if speculative is not None and speculative.on else None
    if speculative is not None:
        problems += drafter_problems(students, teachers, cards, student_configs, vocab_map)
    if training.checkpoint_dir is not None:
        problems += checkpoint.folder_problems(training.checkpoint_dir, _checkpoint_bytes(students, student_configs,
                                                                                          training.dtype),
                                               training.keep_checkpoints)
    _raise(problems)
    if evaluate and any(not card.dense for card in cards.values()):
        notes.append("evaluation reports each student's own perplexity only: top-k teachers have no full "
                      "distribution to compare with (KL, top-1 agreement)")
    head_at_loss = {}
    for spec in teachers:
        reason = why_not_head_at_loss(cards[spec.name], losses.values(), training, combine)
        head_at_loss[spec.name] = reason is None
        if reason and HEAD in cards[spec.name].outputs and training.teacher_head_at_loss:
            notes.append(f"teacher {spec.name!r}: full logits materialised: {reason}")
    keys = {s.name: "" if alone else s.name for s in students}
    if paging is not None:
        notes.append(paging.describe())
    return Plan(list(students), list(teachers), training, cards, student_configs, losses, student_ds, teacher_ds,
                teacher_vocab, adapters, combine, head_at_loss, notes, data, keys, paging, rewards,
                lead=lead.name if lead is not None else None, tokenizer=tokenizer, speculative=speculative)


def drafter_problems(students: Sequence[StudentSpec], teachers: Sequence[TeacherSpec],
                     cards: Mapping[str, TeacherCard], student_configs: Mapping[str, Any], vocab_map: Any) -> list[str]:
    """``eval.speculative``: the lead teacher verifies each student's drafts token id by token id, so it must run
    in-process with its full distribution, and every student must share its tokenizer and vocabulary."""
    key = "eval.speculative"
    lead = lead_teacher(teachers)
    if lead is None:
        return [f"{key}: a drafter drafts for a teacher, and this run has none: drop {key} (prompts: 0) or add a "
                "teacher"]
    card = cards[lead.name]
    if not card.dense or not card.can_generate:
        return [f"{key}: teacher {lead.name!r} (a {card.kind} teacher) cannot verify drafts: speculative decoding "
                "needs the target's full next-token distribution at every drafted position, and it returns top-k "
                "targets only. Use a teacher that runs in-process (kind: engine), or drop eval.speculative"]
    if vocab_map is not None:
        return [f"{key}: the students use another tokenizer than teacher {lead.name!r}, so their drafts are not the "
                "teacher's tokens: a drafter must use its target's tokenizer. Drop student_tokenizer (the students "
                "take the teacher's), or drop eval.speculative"]
    problems = []
    for spec in students:
        vocab = getattr(student_configs.get(spec.name), "vocab_size", None)
        if vocab and card.vocab_size and vocab != card.vocab_size:
            problems.append(f"{key}: student {spec.name!r} has a vocabulary of {vocab} tokens and teacher "
                            f"{lead.name!r} of {card.vocab_size}: a drafter's token ids must be its target's, row for "
                            "row. Build the student with the teacher's "
                            "vocab_size (init, init_from_teacher), or drop eval.speculative")
    return problems


def feature_drafter_problems(students: Sequence[StudentSpec], teachers: Sequence[TeacherSpec],
                             cards: Mapping[str, TeacherCard], training: TrainingConfig, combine: str) -> list[str]:
    """A feature-reading drafter (``students[i].feature_drafter``) reads one teacher's hidden states at every
    position as its input, and shares that teacher's embedding and head: the teacher must run in-process with its
    hidden states; its drafts need the teacher's features, so it cannot sample alone (on-policy)."""
    readers = [spec.name for spec in students if spec.feature_drafter is not None]
    if not readers:
        return []
    key = f"students {readers}: feature_drafter"
    if len(teachers) != 1:
        return [f"{key} reads one teacher's hidden states, and this run has {len(teachers)} teachers: give exactly "
                "one teacher (the model it drafts for), or drop feature_drafter"]
    spec = teachers[0]
    card = cards[spec.name]
    problems = []
    if not card.dense or HIDDEN_STATES not in card.outputs or card.config is None:
        problems.append(f"{key}: teacher {spec.name!r} (a {card.kind} teacher) cannot give its hidden states at "
                        "every position (a captured store or a server returns top-k targets): the drafter reads "
                        "them as its input. Use a teacher that runs in-process (kind: engine), or a student that "
                        "does not read features (model, init, init_from_teacher)")
    if training.on_policy.fraction > 0 and training.on_policy.sampler == "student":
        problems.append(f"{key}: a feature-reading drafter cannot sample on its own (each draft reads the "
                        "teacher's features of the text before it), so it cannot be training.on_policy's sampler: "
                        "train it off-policy (on_policy.fraction: 0), or use sampler: teacher")
    return problems


def lead_teacher(teachers: Sequence[TeacherSpec]) -> TeacherSpec | None:
    """The teacher that stands for "the teacher" where one model is meant: the model a student's ``init`` and
    ``init_from_teacher`` start from, the sampler of ``sampler: teacher``, the run's tokenizer unless one is given.
    The first listed (None without a teacher)."""
    return teachers[0] if teachers else None


def run_tokenizer(students: Sequence[StudentSpec], teachers: Sequence[TeacherSpec], cards: Mapping[str, TeacherCard],
                  tokenizer: str | Path | None = None, *, across: bool = False) -> str | None:
    """The run's tokenizer (a folder or hub name): ``tokenizer`` when given; else the lead teacher's, as its card names
    it (a model folder or hub name, a served teacher's ``options.tokenizer``, what a teacher of one's own puts in its
    card); else, when the lead teacher is the student itself (a self-teacher) or there is no teacher, the first
    student's model (never ``across`` tokenizers: the students' own is another). None when none is named: a store, a
    server or a teacher of one's own whose card names none (the CLI, which reads its data with it, refuses the run)."""
    if tokenizer is not None:
        return str(tokenizer)
    lead = lead_teacher(teachers)
    card = cards.get(lead.name) if lead is not None else None
    if card is not None and card.tokenizer:
        return card.tokenizer
    if across or (card is not None and not card.is_student):
        return None
    return next((str(s.model) for s in students if isinstance(s.model, str | Path)), None)


def listed(message: str) -> list[str]:
    """A message of several problems (a line ending ``problems:``, then a ``  - `` line each) as its problems; a
    problem that lists its own (``DeepSpeed config problems:``) gives its items, without its heading."""
    head, *items = message.split("\n  - ")
    if not (items and head.endswith("problems:")):
        return [message]
    return [item for item in items if not item.endswith("problems:")]


def _raise(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))


def teacher_cards(teachers: Sequence[TeacherSpec]) -> dict[str, TeacherCard]:
    """Each teacher's card, by name; one ``ConfigError`` naming every teacher that has none."""
    problems: list[str] = []
    cards = _cards(teachers, problems)
    _raise(problems)
    return cards


def _cards(teachers: Sequence[TeacherSpec], problems: list[str]) -> dict[str, TeacherCard]:
    cards = {}
    for spec in teachers:
        try:
            cards[spec.name] = kinds.describe(spec)
        except ConfigError as err:
            problems.append(str(err))
        except (OSError, ValueError) as err:  # a folder without a model, a config transformers cannot read
            problems.append(f"teachers[{spec.name}].model: {err}")
    return cards


def _student_config(spec: StudentSpec, lead: TeacherCard | None, problems: list[str]) -> Any:
    """A student's model config: its own (read once), or the lead teacher's with ``init`` or cut by
    ``init_from_teacher``; None after recording why it cannot be had."""
    where = f"students[{spec.name}]"
    if spec.model is not None:
        try:
            return models.model_config(spec.model)
        except (OSError, ValueError) as err:
            problems.append(f"{where}.model: {err}")
            return None
    if lead is None or lead.config is None:
        problems.append(f"{where} has no model: give each a model (a directory, a hub name or an nn.Module), or build "
                        "it from a teacher with a model config (init, init_from_teacher)")
        return None
    try:
        if spec.init_from_teacher is not None:
            cut = spec.init_from_teacher
            from_teacher.check(cut, lead.config)
            text = lead.config.get_text_config()
            return from_teacher.student_config(lead.config, from_teacher.kept_layers(cut, text.num_hidden_layers),
                                               from_teacher.student_shape(cut, from_teacher.teacher_shape(lead.config)))
        unknown = [key for key in spec.init if not hasattr(lead.config, key)]
        if unknown:
            problems.append(f"{where}.init: {unknown} are not fields of the teacher's {type(lead.config).__name__}; "
                            "e.g. num_hidden_layers, hidden_size")
            return None
        config = copy.deepcopy(lead.config)
        config.update(student_init(spec, lead.config))
    except (ConfigError, ValueError) as err:
        problems.append(f"{where}.{'init_from_teacher' if spec.init_from_teacher else 'init'}: {err}"
                        if not str(err).startswith(where) else str(err))
        return None
    try:
        models.parameter_count(config)  # the model these values describe can be built (on the meta device)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a shape it cannot build
        problems.append(f"{where}.init {spec.init}: the teacher's config with these values does not build a model "
                        f"({type(err).__name__}: {err})")
        return None
    return config


def student_init(student: StudentSpec, teacher_config: Any) -> dict[str, Any]:
    """``init`` with ``head_dim`` derived when it changes the width or the heads but not ``head_dim``: the
    teacher's would otherwise stay (``hidden_size: 32`` with 2 heads would build 128-wide attention)."""
    init = dict(student.init)
    head_dim = getattr(teacher_config, "head_dim", None)
    if head_dim is None or "head_dim" in init:
        return init
    hidden, heads = teacher_config.hidden_size, teacher_config.num_attention_heads
    new = copy.deepcopy(teacher_config)
    new.update(init)
    if (new.hidden_size, new.num_attention_heads) == (hidden, heads):
        return init
    where = f"students[{student.name}].init"
    if head_dim * heads != hidden:
        raise ConfigError(f"{where} changes hidden_size/num_attention_heads, and the teacher's head_dim ({head_dim}) "
                          f"is not its hidden_size/num_attention_heads ({hidden}/{heads}); give head_dim too")
    if new.hidden_size % new.num_attention_heads:
        raise ConfigError(f"{where}: hidden_size {new.hidden_size} is not divisible by num_attention_heads "
                          f"{new.num_attention_heads}; change one of them, or give head_dim")
    return init | {"head_dim": new.hidden_size // new.num_attention_heads}


def capability_problems(students: Sequence[StudentSpec], teachers: Sequence[TeacherSpec],
                        cards: Mapping[str, TeacherCard], training: TrainingConfig, combine: Combine) -> list[str]:
    """Every use of a teacher its kind cannot serve, each naming the key and the fix."""
    problems = []
    sparse = [name for name, card in cards.items() if not card.dense]
    if combine in ("mixture", "route") and sparse:
        problems.append(f"combine: {combine} reads every teacher's full distribution, and {sparse} return top-k "
                        f"targets ({', '.join(cards[n].kind for n in sparse)}): use combine: sum, or teachers that "
                        "run in-process (kind: engine)")
    on_policy = training.on_policy
    lead = lead_teacher(teachers)
    if on_policy.fraction > 0 and on_policy.sampler == "teacher" and lead is not None:
        first = cards.get(lead.name)
        if first is not None and not first.can_generate:
            problems.append(f"training.on_policy.sampler: teacher, and the first teacher ({lead.name!r}, a "
                            f"{first.kind} teacher) cannot generate: use sampler: student, or list a teacher that "
                            "runs in-process first")
    return problems


def _loss_needs(losses: Mapping[str, DistillationLoss], teachers: Sequence[TeacherSpec],
                cards: Mapping[str, TeacherCard]) -> list[str]:
    """Hidden-state and attention losses need teachers that return them."""
    problems = []
    for student, loss in losses.items():
        for spec in teachers:
            card = cards[spec.name]
            for flag, output in (("needs_hidden_states", HIDDEN_STATES), ("needs_attentions", ATTENTIONS)):
                if getattr(loss, flag) and output not in card.outputs:
                    givers = ("an in-process engine; a store captured with --hidden-layers" if output == HIDDEN_STATES
                              else "an in-process engine: a store or a server holds no attentions")
                    problems.append(f"students[{student}].loss reads the teacher's {output.replace('_', ' ')}, and "
                                    f"teacher {spec.name!r} (a {card.kind} teacher) returns none: use a logit loss, "
                                    f"or a teacher that returns them ({givers})")
    return problems


def sampled_problems(losses: Mapping[str, DistillationLoss], teachers: Sequence[TeacherSpec],
                     cards: Mapping[str, TeacherCard]) -> list[str]:
    """A sampled teacher (a sampled store: tokens drawn at one temperature) gives forward KL's unbiased estimate at
    that temperature only: every logit term against it must be forward KL at the store's temperature."""
    from losses.base import LogitLoss

    problems = []
    for spec in teachers:
        card = cards[spec.name]
        if SAMPLED not in card.outputs:
            continue
        for student, loss in losses.items():
            own = loss.losses[spec.name] if isinstance(loss, TeacherEnsembleLoss) and spec.name in loss.losses else loss
            for term in own.modules():
                if not (isinstance(term, LogitLoss) and term.needs_teacher):
                    continue
                if not term.sampled_targets:
                    problems.append(f"students[{student}].loss: {term.name} against teacher {spec.name!r}, a sampled "
                                    "store: only forward KL has an unbiased estimate from sampled tokens; use "
                                    "forward_kl, a top-k store (any divergence) or a served teacher's payload: hidden")
                elif term.temperature != card.sample_temperature:
                    problems.append(f"students[{student}].loss: temperature {term.temperature:g}, and teacher "
                                    f"{spec.name!r}'s tokens were sampled at temperature {card.sample_temperature:g}: "
                                    f"set the loss's temperature to {card.sample_temperature:g}, or capture the store "
                                    f"again with --temperature {term.temperature:g}")
    return problems


def _derived_training(training: TrainingConfig, students: Sequence[StudentSpec], student_configs: Mapping[str, Any],
                      cards: Mapping[str, TeacherCard], data: DataFacts, combine: Combine,
                      output_dir: str | Path | None, problems: list[str]) -> tuple[TrainingConfig, list[str]]:
    """The run's settings with what follows from the models and the data filled in."""
    notes = []
    on_policy = training.on_policy
    if on_policy.fraction > 0:
        limits = {**{f"students[{n}]": models.positions(c) for n, c in student_configs.items()},
                  **{f"teachers[{n}]": card.positions for n, card in cards.items()}}
        limits = {name: limit for name, limit in limits.items() if limit is not None}
        fewest = min(limits.values(), default=None)
        if not on_policy.max_length and fewest is not None:
            on_policy = dataclasses.replace(on_policy, max_length=fewest)
            notes.append(f"on-policy rows (prompt + sample) are cut to {fewest} tokens: the fewest positions among "
                         "the run's models")
        elif fewest is not None and on_policy.max_length > fewest:
            short = min(limits, key=limits.get)
            problems.append(f"training.on_policy.max_length: {on_policy.max_length} tokens, but {short} reads at most "
                            f"{fewest} positions (max_position_embeddings): set it to {fewest} or less, or 0 (the "
                            "fewest positions among the run's models)")
        if not on_policy.pack_to and data.packing and data.kind == "chat" and data.block_size:
            on_policy = dataclasses.replace(on_policy, pack_to=data.block_size)
            notes.append(f"data.packing: the sampled micro-batches are packed into rows of {data.block_size} tokens "
                         "after sampling (training.on_policy.pack_to)")
        if on_policy.pack_to and combine == "route":
            problems.append("training.on_policy.pack_to with combine: route is not supported yet: a packed row would "
                            "hold conversations of several teachers. Set pack_to: 0 (and data.packing: false), or "
                            "combine: sum")
    return dataclasses.replace(training, on_policy=on_policy,
                               checkpoint_dir=checkpoint_folder(training, output_dir)), notes


def checkpoint_folder(training: TrainingConfig, output_dir: str | Path | None) -> str | None:
    """Where checkpoints go: ``training.checkpoint_dir``, else ``<output_dir>/checkpoints``, else nowhere."""
    if training.checkpoint_dir is not None or output_dir is None:
        return training.checkpoint_dir
    return str(Path(output_dir) / "checkpoints")


def _position_problems(student_configs: Mapping[str, Any], cards: Mapping[str, TeacherCard],
                       data: DataFacts) -> list[str]:
    """Every row a model reads fits its positions: ``data.block_size`` for the students and the teachers
    (``teacher_block_size`` for a teacher of another tokenizer). A longer row is read past what the model was
    trained on, or fails on an index."""
    if data.block_size is None:
        return []
    teacher_rows = (("teacher_block_size", data.teacher_block_size) if data.teacher_block_size is not None
                    else ("data.block_size", data.block_size))
    rows = [(f"students[{n}]", models.positions(c), ("data.block_size", data.block_size))
            for n, c in student_configs.items()]
    rows += [(f"teachers[{n}]", card.positions, teacher_rows) for n, card in cards.items()]
    return [f"{key}: {size} tokens per row, but {name} reads at most {limit} positions (max_position_embeddings "
            f"in its config): set {key} to {limit} or less"
            for name, limit, (key, size) in rows if limit is not None and size > limit]


def _sampler_problems(students: Sequence[StudentSpec], teachers: Sequence[TeacherSpec],
                      cards: Mapping[str, TeacherCard], student_configs: Mapping[str, Any], training: TrainingConfig,
                      vocab_map: Any) -> list[str]:
    """On-policy sampling: the sampling teacher takes part in the loss, the sampling model has an end token (samples
    must end), and that token and the pad token are ids of every vocabulary of the run."""
    on_policy = training.on_policy
    if on_policy.fraction == 0 or len(students) != 1:  # several sampling students: check_shape's refusal
        return []
    problems = []
    student, lead = students[0], lead_teacher(teachers)
    if on_policy.sampler == "teacher" and lead is not None:
        if lead.weight == 0:
            problems.append(f"training.on_policy.sampler: teacher samples from the first teacher ({lead.name}), "
                            "whose weight is 0: the student would learn from samples of a teacher its loss ignores. "
                            "List a teacher with weight > 0 first")
        source, eos = f"teachers[{lead.name}] ({cards[lead.name].source})", cards[lead.name].eos_token_id
    else:
        given = f" ({student.model})" if isinstance(student.model, str | Path) else ""
        source = f"students[{student.name}]{given}"
        eos = models.end_token(models.generation_config(student.model), student_configs[student.name])
    eos_key = "training.on_policy.eos_token_id"
    if on_policy.eos_token_id is not None:
        eos = on_policy.eos_token_id
    else:
        eos_key = f"the end token of {source} (eos_token_id)"
        if eos is None:
            problems.append(f"training.on_policy: {source} has no end token (no eos_token_id in its config or "
                            "generation config), so samples would never end; set training.on_policy.eos_token_id "
                            "(e.g. the tokenizer's eos_token_id)")
    sizes = [getattr(config, "vocab_size", None) for config in student_configs.values()]
    sizes += [card.vocab_size for card in cards.values()] if vocab_map is None else []  # else: the teacher's own ids
    vocab = min((size for size in sizes if size), default=None)
    for key, value in ((eos_key, eos), ("training.on_policy.pad_token_id", on_policy.pad_token_id)):
        if value is not None and vocab is not None and not 0 <= value < vocab:
            problems.append(f"{key}: {value} is outside the vocabulary (ids 0..{vocab - 1} in every model of the "
                            "run); give a token id of the tokenizer")
    return problems


def _checkpoint_bytes(students: Sequence[StudentSpec], student_configs: Mapping[str, Any], dtype: str) -> int | None:
    """About what one checkpoint of every student takes (weights and optimizer states); None when a model's size
    cannot be told."""
    total = 0
    for spec in students:
        try:
            parameters = (sum(p.numel() for p in spec.model.parameters()) if isinstance(spec.model, nn.Module)
                          else models.parameter_count(student_configs[spec.name]))
        except Exception:  # noqa: BLE001 - a config that builds no model is named by the checks that read it
            return None
        total += checkpoint.checkpoint_bytes(parameters, dtype)
    return total


def _tokenizer_problems(students: Sequence[StudentSpec], teachers: Sequence[TeacherSpec],
                        cards: Mapping[str, TeacherCard], tokenizer: str | None) -> list[str]:
    """Every student folder and teacher with a tokenizer has the run's vocabulary (logits are compared id by id);
    where the run's tokenizer cannot be read here (a hub name, or none), the first model folder that holds one stands
    for it."""
    others = [(f"students[{s.name}].model", s.model) for s in students if models.has_tokenizer(s.model)]
    others += [(f"teachers[{t.name}]", cards[t.name].tokenizer) for t in teachers
               if models.has_tokenizer(cards[t.name].tokenizer)]
    fingerprinted = [(f"teachers[{t.name}]", cards[t.name]) for t in teachers if not cards[t.name].tokenizer]
    if tokenizer is not None and models.has_tokenizer(tokenizer):
        label, others = "the run", [(name, source) for name, source in others if str(source) != tokenizer]
    elif others:
        (label, tokenizer), others = others[0], others[1:]
        label = "the student" if len(students) == 1 and label.startswith("students[") else label
    else:
        return []
    return tokenizer_problems((label, tokenizer), others) + fingerprint_problems(fingerprinted, tokenizer, label)


def _deepspeed_configs(students: Sequence[StudentSpec], teachers: Sequence[TeacherSpec],
                       student_configs: Mapping[str, Any], cards: Mapping[str, TeacherCard],
                       training: TrainingConfig, deepspeed: DeepSpeedSettings, world_size: int,
                       alone: bool) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every engine's DeepSpeed config, each "auto" filled from the run; all problems at once. A teacher that is no
    engine (a store, a server) gets none."""
    engines = [t for t in teachers if cards[t.name].engine]
    students_ds, teachers_ds = prepare(
        {s.name: TrainedConfig(s.ds_config or deepspeed.student, s.training(training),
                               models.facts(student_configs[s.name])["hidden_size"],
                               {**deepspeed.student_overrides, **s.ds_overrides}) for s in students},
        {t.name: FrozenConfig.of(t, cards[t.name].hidden_size, deepspeed,
                                 residency.ds_overrides(training.teacher_residency)) for t in engines},
        world_size=world_size,
        labels={s.name: "student" if alone else f"student {s.name!r}" for s in students}
        | {t.name: "teacher" if len(teachers) == 1 else f"teacher {t.name!r}" for t in engines})
    return students_ds, {t.name: teachers_ds.get(t.name, {}) for t in teachers}


def _engine_problems(students: Sequence[StudentSpec], teachers: Sequence[TeacherSpec],
                     cards: Mapping[str, TeacherCard], student_configs: Mapping[str, Any],
                     training: TrainingConfig) -> list[str]:
    """FP8 where it cannot run (the device, a layer, the size) and kernels an architecture lacks."""
    problems = []
    for spec in teachers:
        if cards[spec.name].kind == "engine" and type(spec.model).__name__ != "DeepSpeedEngine":
            try:
                source = spec.model if not isinstance(spec.model, str | Path) else cards[spec.name].config
                fp8.check_teacher(training.teacher_precision, training.dtype, source,
                                  "training.teacher_precision" if len(teachers) == 1 else
                                  f"training.teacher_precision (teacher {spec.name!r})")
            except ConfigError as err:
                problems.append(str(err))
    kinds_of = [("teacher", spec, cards[spec.name].model_type) for spec in teachers]
    kinds_of += [("student", spec, getattr(student_configs[spec.name], "model_type", None)) for spec in students]
    for kind, spec, model_type in kinds_of:
        try:
            kernels.check_model_type(getattr(training, f"{kind}_kernels"), model_type,
                                     f"training.{kind}_kernels ({kind} {spec.name!r})")
        except ConfigError as err:
            problems.append(str(err))
    return problems


def why_not_head_at_loss(card: TeacherCard, losses: Any, training: TrainingConfig, combine: Combine) -> str | None:
    """None when a teacher may hand the losses its final hidden states and head; otherwise why not (logged)."""
    if not training.teacher_head_at_loss:
        return "training.teacher_head_at_loss is off"
    if HEAD not in card.outputs:
        return f"the head is known to apply exactly only for model types {sorted(head.EXACT_HEADS)}"
    if combine in ("mixture", "route"):
        return f"combine: {combine} builds full distributions from the teachers' logits"
    refusing = sorted({type(loss).__name__ for loss in losses if not getattr(loss, "takes_teacher_head", False)})
    if refusing:
        return f"losses {refusing} read the teacher's full logits"
    return None


def vocabulary_problems(student_vocab: int | None, teacher_vocab: int | None, name: str) -> list[str]:
    """A teacher vocabulary padded past the student's is cut by the losses; a larger student one is an error."""
    if student_vocab and teacher_vocab and student_vocab > teacher_vocab:
        return [f"student {name!r}: its vocabulary ({student_vocab}) is larger than the teacher's ({teacher_vocab}): "
                "they cannot share a tokenizer. Build the student with the teacher's tokenizer and vocab_size, or, to "
                "distil across tokenizers, use loss cross_tokenizer with paired blocks and Distiller(..., vocab_map="
                "VocabMap.build(student_tokenizer, teacher_tokenizer)) (a run config: student_tokenizer)."]
    return []


def check_shape(students: Sequence[StudentSpec], teachers: Sequence[TeacherSpec], training: TrainingConfig,
                combine: Combine, vocab_map: Any) -> None:
    """The shapes a run cannot have, each with its fix (before any model is read)."""
    if not students:
        raise ConfigError("no students: give at least one, e.g. students=[StudentSpec(name='small', model=...)]")
    if combine not in ("sum", "mixture", "route"):
        raise ConfigError(f"combine: {combine!r} is not one of sum, mixture, route")
    check_names(students, "student")  # again for specs given to make_plan directly (config.specs checks them)
    check_names(teachers, "teacher")
    check_weights(teachers)
    on_policy = training.on_policy
    if on_policy.fraction > 0 and len(students) > 1:
        raise ConfigError(
            f"training.on_policy.fraction={on_policy.fraction} with {len(students)} students: each student would "
            "sample its own completions, so they could not share batches or the teachers' forward. Distil them in "
            "separate runs, or set training.on_policy.fraction: 0")
    if on_policy.fraction > 0 and on_policy.sampler == "teacher" and not teachers:
        raise ConfigError("training.on_policy.sampler: teacher, and this run has no teacher: use sampler: student")
    if combine == "route" and on_policy.fraction > 0 and on_policy.sampler == "teacher":
        raise ConfigError("combine: route with training.on_policy.sampler: teacher: each row would need its own "
                          "teacher's sample; use sampler: student (each sample is scored by its row's teacher)")
    if len(teachers) > 1 and vocab_map is not None:
        raise ConfigError("several teachers across tokenizers is not supported: every teacher must use the "
                          "student's tokenizer (drop student_tokenizer, or keep one teacher)")


def student_loss(spec: StudentSpec, facts: Mapping[str, Any], teachers: Sequence[TeacherSpec],
                 cards: Mapping[str, TeacherCard], combine: Combine, vocab_map: Any) -> DistillationLoss:
    """A student's loss, sized by its facts and its teachers': one loss per teacher combined by
    :class:`TeacherEnsembleLoss` when there are several, the plain loss for one teacher or none."""
    def built(teacher: TeacherSpec | None) -> DistillationLoss:
        sized = {f"student_{k}": v for k, v in facts.items()}
        if teacher is not None:
            sized |= {f"teacher_{k}": v for k, v in cards[teacher.name].facts().items()}
        try:
            return build_loss(spec.loss, **sized, vocab_map=vocab_map)
        except (KeyError, TypeError, ValueError) as err:
            message = err.args[0] if isinstance(err, KeyError) and err.args else err
            raise ConfigError(f"students[{spec.name}].loss: {message}") from None

    if len(teachers) <= 1 or combine == "route":  # routed: each row's logits come from its own teacher
        loss = built(teachers[0] if teachers else None)
        if combine == "route" and (loss.needs_hidden_states or loss.needs_attentions):
            raise ConfigError(f"students[{spec.name}].loss with combine: route: a routed teacher output holds each "
                              "row's logits only; hidden-state and attention losses compare one teacher's states: "
                              "use combine: sum")
        return loss
    try:
        return TeacherEnsembleLoss({t.name: built(t) for t in teachers}, {t.name: t.weight for t in teachers},
                                   combine)
    except ValueError as err:
        raise ConfigError(f"students[{spec.name}].loss with combine: {combine}: {err}") from None

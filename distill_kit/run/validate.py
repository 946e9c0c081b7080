"""Everything about a CLI run that can be checked before any work or any write, checked together.

A run that fails after its start has written ``run_identity.json``, tokenised the data or built the students
leaves a folder the same command, fixed, may no longer accept; and one problem at a time is slow to fix. So
:func:`validate` runs every check in :data:`CHECKS` on rank 0, before anything is loaded or written, and raises
one :class:`ConfigError` listing every problem (each names the setting or file and the fix); the other ranks
raise the same. A check is a function ``(Start) -> list[str]`` (its problems, none when fine): to check
something new up front, write one and append it to :data:`CHECKS`.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from distill_kit.config import TeacherSpec
from distill_kit.config import specs as config_specs
from distill_kit.data import blocks
from distill_kit.engines import deepspeed_config, distributed, models
from distill_kit.errors import ConfigError
from distill_kit.run import output_dir, run_config, student_tokenizer, trackers
from distill_kit.run.run_config import STDLIB_CORPUS, RunConfig
from distill_kit.tasks import harness
from distill_kit.teachers import TeacherCard
from distill_kit.teachers.combine import check_weights
from distill_kit.teachers.kinds import is_import_path, kind_of
from distill_kit.teachers.tokenizers import tokenizer_problems
from distill_kit.training import checkpoint
from distill_kit.training.plan import (
    DataFacts,
    Plan,
    checkpoint_folder,
    lead_teacher,
    listed,
    make_plan,
    run_tokenizer,
    teacher_cards,
)
from losses import registry as loss_registry


@dataclass
class Start:
    """What the checks look at: the run config, whether it resumes, and the run's plan (``training/plan.py``),
    made once from the specs: every model's config is read there, once, and the checks read the plan."""

    config: RunConfig
    resume: bool
    identity: dict[str, Any]
    """What must not change across a resume (``cli.run_identity``)."""
    plan: Plan | None = None
    """None until ``check_plan`` made it, or when it could not be made (its problems are reported)."""
    data: DataFacts | None = None
    """What the data is (``run_config.data_facts``: decided once, by the caller; made here when not given)."""

    def __post_init__(self) -> None:
        if self.data is None:
            self.data = run_config.data_facts(self.config)

    def students(self) -> dict[str, PretrainedConfig | None]:
        """Each student's model config, as the plan derived it (none without a plan)."""
        return dict(self.plan.student_configs) if self.plan is not None else {}

    def checkpoint_dir(self) -> str:
        return checkpoint_folder(self.config.training, self.config.output_dir)

    def tokenizer(self) -> str | None:
        """The run's tokenizer, the plan's decision (``tokenizer_of``; by the plan's rule over the cards where the
        plan could not be made, so that its problem is reported with the plan's): None when no model names one."""
        return tokenizer_of(self.config, self.plan)


def _local(path: str) -> bool:
    """Hub names are ``org/name``; anything else with a path separator or dot-prefix is a local path."""
    return path.startswith((".", "/", "~")) or path.count("/") != 1 or Path(path).exists()


def check_output_dir(start: Start) -> list[str]:
    """A live run in the folder (its lock), another run's checkpoints, a non-run folder, checkpoints without
    ``--resume``, nothing to ``--resume``; on ``--resume``: a checkpoint of another rank count, changed data."""
    config = start.config
    busy = output_dir.in_use(config.output_dir)
    if busy is not None:
        return [busy]
    try:
        output_dir.check(config.output_dir, start.identity, resume=start.resume,
                         checkpoint_dir=start.checkpoint_dir(), record=False)
    except ValueError as err:
        return [str(err)]
    if not start.resume:
        return []
    directory = start.checkpoint_dir()
    found, skipped = checkpoint.find_latest(directory)
    if found is None:
        return [f"--resume: {checkpoint.nothing_to_resume(directory, skipped)}"]
    problems = output_dir.data_changes(config.output_dir, data_fingerprint(config))
    saved = json.loads((found / checkpoint.MANIFEST).read_text()).get("world_size")
    if saved is not None and saved != distributed.world_size():
        problems.append(f"--resume: checkpoint {found} was written by {saved} ranks, and this start has "
                        f"{distributed.world_size()}: each rank's data position and random generators are its own. "
                        f"Resume on {saved} ranks (e.g. torchrun --nproc_per_node {saved} ...)")
    return problems


def data_fingerprint(config: RunConfig) -> dict[str, dict[str, str]]:
    """The local data files' content hashes (``output_dir.data_fingerprint``); none for the embedded corpus."""
    if config.data.train == STDLIB_CORPUS:
        return {}
    return output_dir.data_fingerprint({"data.train": config.data.train, "data.heldout": config.data.heldout})


def check_models(start: Start) -> list[str]:
    """The lead teacher and the students: each local folder exists and holds what it must; the run's tokenizer, as
    the plan decided it (``plan.run_tokenizer``), is named and holds a tokenizer (the CLI reads its data with it)."""
    config = start.config
    problems = []
    lead = lead_teacher(run_config.teacher_specs(config))
    lead_key = "teacher" if not config.teachers else f"teachers[{lead.name}].model"
    kind = kind_of(lead)  # the other teachers' folders: check_teachers; a self-teacher's: the student's, below
    sources = [(lead_key, lead.model)] if kind == "engine" else []
    sources += [(f"students[{s.name}].model", s.model) for s in config.students]
    for key, path in sources:
        if path is None or not _local(path):
            continue
        if not Path(path).is_dir():
            problems.append(f"{key}: {path!r} does not exist; give a save_pretrained directory or a hub name")
        elif not (Path(path) / "config.json").is_file():
            problems.append(f"{key}: the folder {path!r} holds no model (no config.json); give a directory "
                            "written by save_pretrained")
    if kind not in ("engine", "self"):  # a server (or a store) has no weights here to cut a student out of
        problems += [f"students[{s.name}].init_from_teacher cuts the student out of the teacher's weights, and the "
                     f"teacher {lead.model!r} holds no weights here (its kind: "
                     f"{'a class of its own' if ':' in kind else kind}): build it with init "
                     "(the teacher's config, e.g. init: {num_hidden_layers: 4}) or give model: a folder"
                     for s in config.students if s.init_from_teacher is not None]
    try:
        tokenizer = start.tokenizer()
    except ConfigError as err:  # a teacher whose card cannot be read: the plan's problem, but across tokenizers
        return problems + ([str(err)] if config.student_tokenizer else [])  # no plan is made here
    if tokenizer is None:
        problems.append(no_tokenizer(lead, (start.plan.cards if start.plan else teacher_cards([lead]))[lead.name]))
    elif tokenizer is not None and _local(tokenizer) and Path(tokenizer).is_dir() and not models.has_tokenizer(
            tokenizer):
        key = "tokenizer" if config.tokenizer else lead_key
        if kind == "self" and config.tokenizer is None:  # the plan's choice, not the user's
            key = f"students[{config.students[0].name}].model (the run's tokenizer: the student is its own teacher)"
        problems.append(f"{key}: the folder {tokenizer!r} holds no tokenizer (no tokenizer.json or "
                        "tokenizer_config.json); save it there with tokenizer.save_pretrained, or set tokenizer to one")
    return problems


def no_tokenizer(lead: TeacherSpec, card: TeacherCard) -> str:
    """The refusal of a run whose tokenizer no model names (the plan's ``tokenizer`` is None), with its fixes."""
    own = " (or have its describe return TeacherCard(..., tokenizer=...))" if is_import_path(card.kind) else ""
    fix = {"served": f" (or options.tokenizer in teachers[{lead.name}]: the folder of the served model's "
                     "tokenizer)",
           "store": " (a store records its tokenizer's sha256 only: the run's tokenizer is compared with it)"}.get(
        card.kind, own)
    return (f"teacher {lead.name!r} (a {card.kind} teacher, {card.source}) names no tokenizer, and the run reads its "
            "data with one: set tokenizer: the folder or hub name of the teachers' tokenizer" + fix)


def check_student_tokenizers(start: Start) -> list[str]:
    """With ``student_tokenizer`` (no plan before the vocabulary map): a student given as a folder with a tokenizer
    has the students' own, by the plan's rule (``teachers/tokenizers.py``). Otherwise the plan checks every model."""
    config = start.config
    if config.student_tokenizer is None:
        return []
    students = [(f"students[{s.name}].model", s.model) for s in config.students if s.model is not None]
    drafting = [] if not config.eval.speculative.on else [
        "eval.speculative: the students use their own tokenizer (student_tokenizer), so their drafts are not the "
        "teacher's tokens: a drafter must use its target's tokenizer. Drop student_tokenizer, or drop "
        "eval.speculative"]
    return drafting + tokenizer_problems(("student_tokenizer", config.student_tokenizer), students)


def run_plan(config: RunConfig, data: DataFacts) -> Plan:
    """The run's plan from its run config: exactly what the Distiller builds from (the CLI hands it over)."""
    return make_plan(list(config.students), run_config.teacher_specs(config), training=config.training,
                     combine=config.combine, world_size=distributed.world_size(),
                     deepspeed=run_config.deepspeed_settings(config), data=data, output_dir=config.output_dir,
                     tokenizer=config.tokenizer, evaluate=True, speculative=config.eval.speculative)


def tokenizer_of(config: RunConfig, plan: Plan | None) -> str | None:
    """The run's tokenizer, as its plan decided it; across tokenizers (no plan before the vocabulary map) by the
    plan's rule over the teacher's card, as the Distiller's plan will decide it."""
    if plan is not None:
        return plan.tokenizer
    teachers = run_config.teacher_specs(config)
    return run_tokenizer(config.students, teachers, teacher_cards(teachers), config.tokenizer,
                         across=config.student_tokenizer is not None)


def check_plan(start: Start) -> list[str]:
    """The run's plan (``training/plan.py``): every model's card and config, each student's loss, every engine's
    DeepSpeed config, what each teacher can serve, tokenizers, positions, on-policy limits, kernels, LoRA: all its
    problems at once. Across tokenizers the losses need the vocabulary map, made once the data is read
    (``student_tokenizer.config_problems`` checks what can be checked before)."""
    if start.config.student_tokenizer:
        return []
    try:
        start.plan = run_plan(start.config, start.data)
    except (ConfigError, deepspeed_config.DeepSpeedConfigError) as err:
        return listed(str(err))
    return []


def check_data(start: Start) -> list[str]:
    """The data files exist, can be read, are not empty and (text) are UTF-8: before anything is tokenised."""
    data = start.config.data
    if data.train == STDLIB_CORPUS:
        return []
    problems = [f"data.train: {p}" for p in blocks.check_files(data.train)]
    if data.heldout is not None:
        problems += [f"data.heldout: {p}" for p in blocks.check_files(data.heldout)]
    elif data.streaming:
        problems.append("data.streaming needs data.heldout files: a stream cannot be split by fraction")
    return problems


def check_checkpoint_disk(start: Start) -> list[str]:
    """Across tokenizers, where the plan is made once the vocabulary map exists: the checkpoint folder can be created
    and written. Otherwise the plan checks it, with its disk's room (``checkpoint.folder_problems``)."""
    if not start.config.student_tokenizer:
        return []
    return checkpoint.folder_problems(start.checkpoint_dir(), None, start.config.training.keep_checkpoints)


def check_harness(start: Start) -> list[str]:
    """``eval.harness``: lm-evaluation-harness installed and every task name known, before any training."""
    if not start.config.eval.harness.tasks:
        return []
    try:
        harness.check(start.config.eval.harness)
    except ConfigError as err:
        return [str(err)]
    return []


def check_trackers(start: Start) -> list[str]:
    """Every tracker in ``report_to`` is known and installed."""
    try:
        trackers.check(start.config.report_to)
    except ValueError as err:
        return [str(err)]
    return []


# ---- settings that need no model, and the models' sizes read from their configs ------------------------------


def check_students(start: Start) -> list[str]:
    """Across tokenizers (``student_tokenizer``), where the plan cannot build the losses before the vocabulary map
    exists: each cross_tokenizer term's parameters are ones it takes. Every other loss is ``check_plan``'s."""
    config, problems = start.config, []
    if config.student_tokenizer is None:
        return []
    for student in config.students:
        try:
            for name, params in _loss_entries(student.loss):
                if name == "cross_tokenizer":
                    inspect.signature(loss_registry.resolve(name).__init__).bind_partial(None, **params)
        except (ValueError, TypeError) as err:
            problems.append(f"students[{student.name}].loss: {err}")
    return problems


def _loss_entries(spec: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters) of each term of a loss spec: a name, ``{name, ...}`` or a list of ``{name, weight, ...}``."""
    if isinstance(spec, str):
        return [(spec, {})]
    if isinstance(spec, dict):
        params = dict(spec)
        name = params.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"loss entry {spec!r} has no 'name'; e.g. {{name: forward_kl, temperature: 1.0}}")
        return [(name, params)]
    if isinstance(spec, (list, tuple)):
        entries = []
        for entry in spec:
            (name, params), = _loss_entries(entry)
            entries.append((name, {k: v for k, v in params.items() if k not in ("weight", "label")}))
        return entries
    raise ValueError(f"expected a loss name, {{name: ..., params}} or a list of them, got {spec!r}")


def check_on_policy(start: Start) -> list[str]:
    """On-policy training on chat data (the prompts it answers), or on text data with ``prompt_tokens`` (each row's
    first tokens its prompt). The rest is the plan's: one student, a sampling teacher that can generate and takes
    part in the loss, an end token and a pad token inside every vocabulary."""
    config = start.config
    on_policy = config.training.on_policy
    if on_policy.fraction == 0:
        return []
    text = config.data.train == STDLIB_CORPUS or start.data.kind != "chat"
    if text and not on_policy.prompt_tokens:
        return [f"training.on_policy.fraction={on_policy.fraction} on text data (data.format: text): a sample answers "
                "a prompt, and a text row has none of its own. Set training.on_policy.prompt_tokens (e.g. 32: each "
                "row's first tokens are its prompt), give chat data (records with messages, or prompt/completion), "
                "or set training.on_policy.fraction: 0"]
    if not text and on_policy.prompt_tokens:
        return [f"training.on_policy.prompt_tokens={on_policy.prompt_tokens} on chat data: its rows answer their own "
                "prompts. Drop prompt_tokens (it is for text data)"]
    return []


def check_data_format(start: Start) -> list[str]:
    """Chat settings on chat data only: ``data.format: chat`` on plain-text files, ``student_tokenizer`` on chat
    data (not supported yet), and a held-out split is needed with answers (evaluation counts answer tokens)."""
    config = start.config
    if config.data.train == STDLIB_CORPUS:
        return []
    files = [config.data.train] if isinstance(config.data.train, str) else list(config.data.train)
    problems = []
    text_files = [f for f in files if Path(f).suffix.lower() in (".txt", ".text")]
    if config.data.format == "chat" and text_files:
        problems.append(f"data.format: chat, but data.train {text_files[0]!r} is plain text (a .txt file has no "
                        "records): give .jsonl/.json/.parquet records with messages (or prompt/completion), or set "
                        "data.format: text")
    elif config.student_tokenizer is not None and start.data.kind == "chat":
        problems.append("student_tokenizer works with text data only: chat data across tokenizers (a template per "
                        "tokenizer, aligned answers) is not supported yet. Drop student_tokenizer, or give text data "
                        "(data.format: text)")
    return problems


Check = Callable[[Start], list[str]]
CHECKS: list[Check] = [check_plan, check_output_dir, check_models, check_student_tokenizers, check_data,
                       check_data_format, check_students, check_on_policy, check_checkpoint_disk,
                       lambda start: student_tokenizer.config_problems(start.config), check_trackers, check_harness]
"""Run in this order on rank 0 by :func:`validate`; append a check to have it run up front too."""


def check_teachers(config: RunConfig, data: DataFacts) -> list[str]:
    """``teacher`` or ``teachers`` (not both, not neither); with ``teachers``: well-formed entries (names, models,
    weights), one tokenizer for all, each teacher's folder and DeepSpeed config, and a loss that
    ``combine`` can combine. Reads the config as given (``load`` leaves ``teacher`` out when ``teachers`` is given)."""
    if config.teachers is None:
        if config.teacher is None:
            return ["teacher: none given; give teacher: path/to/teacher, or several as teachers: [{name, model, "
                    "weight}, ...]"]
        if config.combine != "sum":
            return [f"combine: {config.combine} combines several teachers; give them as teachers: [...], or drop "
                    "combine"]
        return []
    if config.teacher is not None:
        return [f"teacher ({config.teacher!r}) and teachers are both given: a run has one teacher (teacher:) or "
                "several (teachers:); drop teacher:, or add it to teachers: as one more entry"]
    problems = []
    if not config.teachers:
        return ["teachers: no teachers: give at least one, e.g. [{name: big, model: path/to/teacher, weight: 1.0}], "
                "or one teacher as teacher: path/to/teacher"]
    try:
        specs = config_specs(TeacherSpec, config.teachers, "teacher")
        check_weights(specs)
    except ValueError as err:
        return [str(err) if str(err).startswith("teacher") else f"teachers: {err}"]
    if config.combine == "route" and config.data.train != STDLIB_CORPUS and data.kind != "chat":
        problems.append("combine: route sends each chat conversation to the teacher its record names "
                        f"(data.teacher_field {config.data.teacher_field!r}), and data.train is text: give chat "
                        "records, or combine: sum")
    elif config.combine == "route" and config.data.train == STDLIB_CORPUS:
        problems.append("combine: route needs chat records naming their teachers (data.teacher_field), and "
                        "data.train is the embedded text corpus: give data.train chat records, or combine: sum")
    if config.student_tokenizer is not None:
        problems.append("student_tokenizer with teachers: distilling across tokenizers (cross_tokenizer) takes one "
                        "teacher; drop student_tokenizer (every teacher then shares the students' tokenizer), or "
                        "distil from one teacher with teacher: and student_tokenizer")
    sources = [(f"teachers[{t.name}].model", t.model) for t in specs[1:] if kind_of(t) == "engine"]  # the first:
    for kind, path in sources:                                                                      # check_models
        if _local(path) and not (Path(path) / "config.json").is_file():
            problems.append(f"{kind}: {path!r} is not a save_pretrained directory (no config.json); give one, or a "
                            "hub name")
    return problems


def check_not_in_use(start: Start) -> list[str]:
    """A live run holds the folder (its lock): refused by name before any work."""
    busy = output_dir.in_use(start.config.output_dir)
    return [] if busy is None else [busy]


TASK_CHECKS: list[Check] = [check_not_in_use, check_plan, check_models, check_student_tokenizers, check_students,
                            check_harness]
"""A task benchmark's (``task.name``): it writes its own data and report, so only the models, the plan and the
harness that scores each seed's students (``eval.harness``)."""


def validate(config: RunConfig, resume: bool, identity: dict[str, Any], data: DataFacts,
             checks: list[Check] | None = None) -> Plan | None:
    """Run every check (``checks``, default ``CHECKS``) on rank 0; raise one ConfigError listing every problem, on
    every rank. Writes nothing. Returns the run's plan, on every rank (None across tokenizers: the Distiller makes
    it once the vocabulary map exists).

    ``check_teachers`` checks ``teacher`` and ``teachers`` as given; the other checks run once there is a teacher."""
    problems: list[str] = []
    plan = None
    if distributed.is_main():
        problems = check_teachers(config, data)
        start = Start(config, resume, identity, data=data)
        for check in (CHECKS if checks is None else checks) if run_config.teacher_specs(config) else []:
            problems += check(start)
        plan = start.plan
    problems = distributed.broadcast_object(problems)
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))
    if not distributed.is_main() and not config.student_tokenizer:
        plan = run_plan(config, data)  # pure: every rank makes the same one
    return plan

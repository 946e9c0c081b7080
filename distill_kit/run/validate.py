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
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from distill_kit.config import TeacherSpec
from distill_kit.config import specs as config_specs
from distill_kit.data import blocks, chat
from distill_kit.engines import deepspeed_config, distributed, models
from distill_kit.errors import ConfigError
from distill_kit.run import output_dir, run_config, student_tokenizer, trackers
from distill_kit.run.run_config import STDLIB_CORPUS, RunConfig
from distill_kit.tasks import harness
from distill_kit.teachers.combine import check_weights
from distill_kit.teachers.kinds import kind_of
from distill_kit.teachers.tokenizers import tokenizer_problems
from distill_kit.training import checkpoint
from distill_kit.training.plan import DataFacts, Plan, checkpoint_folder, make_plan
from losses import registry as loss_registry

# Bytes a checkpoint keeps per trained parameter beyond its weights: the optimizer's fp32 master copy and
# Adam's two moments (ZeRO-2/3 save all three in fp32).
OPTIMIZER_BYTES_PER_PARAMETER = 12
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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
    """Teacher, students and tokenizer: each local folder exists and holds what it must."""
    config = start.config
    problems = []
    # no teacher folder: the student is its own teacher (kind self; run_config.lead_teacher), the plan checks it
    lead = "self" if config.teacher is None else kind_of(TeacherSpec(name="teacher", model=config.teacher))
    sources = [("teacher", config.teacher)] if lead == "engine" else []
    sources += [(f"students[{s.name}].model", s.model) for s in config.students]
    for kind, path in sources:
        if path is None or not _local(path):
            continue
        if not Path(path).is_dir():
            problems.append(f"{kind}: {path!r} does not exist; give a save_pretrained directory or a hub name")
        elif not (Path(path) / "config.json").is_file():
            problems.append(f"{kind}: the folder {path!r} holds no model (no config.json); give a directory "
                            "written by save_pretrained")
    if lead not in ("engine", "self"):  # a server (or a store) has no weights here to cut a student out of
        problems += [f"students[{s.name}].init_from_teacher cuts the student out of the teacher's weights, and the "
                     f"teacher {config.teacher!r} holds no weights here (its kind: "
                     f"{'a class of its own' if ':' in lead else lead}): build it with init "
                     "(the teacher's config, e.g. init: {num_hidden_layers: 4}) or give model: a folder"
                     for s in config.students if s.init_from_teacher is not None]
    if lead == "served" and config.tokenizer is None:
        problems.append(f"teacher {config.teacher!r} is served: the run reads its data with a local tokenizer. Set "
                        "tokenizer: the folder of the served model's tokenizer (or options.tokenizer in teachers:)")
        return problems
    tokenizer = config.tokenizer or config.teacher
    if tokenizer is not None and _local(tokenizer) and Path(tokenizer).is_dir() and not any(
            (Path(tokenizer) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        key = "tokenizer" if config.tokenizer else "teacher"
        if lead == "self" and config.tokenizer == config.students[0].model:  # lead_teacher's choice, not the user's
            key = f"students[{config.students[0].name}].model (the run's tokenizer: the student is its own teacher)"
        problems.append(f"{key}: the folder {tokenizer!r} holds no tokenizer (no tokenizer.json or "
                        "tokenizer_config.json); save it there with tokenizer.save_pretrained, or set tokenizer to one")
    return problems


def check_student_tokenizers(start: Start) -> list[str]:
    """With ``student_tokenizer`` (no plan before the vocabulary map): a student given as a folder with a tokenizer
    has the students' own, by the plan's rule (``teachers/tokenizers.py``). Otherwise the plan checks every model."""
    config = start.config
    if config.student_tokenizer is None:
        return []
    students = [(f"students[{s.name}].model", s.model) for s in config.students if s.model is not None]
    return tokenizer_problems(("student_tokenizer", config.student_tokenizer), students)


def run_plan(config: RunConfig, data: DataFacts) -> Plan:
    """The run's plan from its run config: exactly what the Distiller builds from (the CLI hands it over)."""
    teachers = list(config.teachers) if config.teachers else [TeacherSpec(name="teacher", model=config.teacher)]
    return make_plan(list(config.students), teachers, training=config.training, combine=config.combine,
                     world_size=distributed.world_size(), deepspeed=run_config.deepspeed_settings(config), data=data,
                     output_dir=config.output_dir, tokenizer=config.tokenizer or teachers[0].model, evaluate=True)


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
        message = str(err)
        return message.split("\n  - ")[1:] if message.split("\n")[0].endswith("problems:") else [message]
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


def check_packing(start: Start) -> list[str]:
    """``data.packing: true`` packs chat conversations (data/chat.py), and with on-policy sampling the sampled
    micro-batches (``on_policy.pack_to``); a packed row would hold conversations of several teachers under
    ``combine: route``, which is not supported."""
    config = start.config
    if config.data.packing is not True or config.combine != "route" or config.data.train == STDLIB_CORPUS:
        return []
    return [chat.ROUTED_PACKING]


def check_checkpoint_disk(start: Start) -> list[str]:
    """The checkpoint folder can be written, and its disk has room for the checkpoints the run will keep."""
    directory = Path(start.checkpoint_dir())
    existing = checkpoint.nearest_existing(directory)
    if not existing.is_dir():
        return [f"training.checkpoint_dir {str(directory)!r} cannot be created: {existing} is not a folder"]
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".distill-kit-write-test-"):
            pass
    except OSError as err:
        return [f"training.checkpoint_dir {str(directory)!r} cannot be written: {existing}: {err.strerror or err}. "
                "Choose a folder you can write, or fix its permissions"]
    sizes = [_checkpoint_bytes(c, start.config.training.dtype) for c in start.students().values()]
    if any(size is None for size in sizes):
        return []
    kept = start.config.training.keep_checkpoints
    on_disk = sum(1 for p in directory.glob(checkpoint.PREFIX + "*")) if directory.is_dir() else 0
    needed = max(1, kept + 1 - on_disk) * sum(sizes)  # a new one is written before the oldest is deleted
    free = checkpoint.free_bytes(existing)
    if free < needed:
        return [f"training.checkpoint_dir {str(directory)!r}: its disk has {free / 1e9:.2f} GB free, but the run "
                f"needs about {needed / 1e9:.2f} GB for its checkpoints ({sum(sizes) / 1e9:.2f} GB each: weights "
                f"and optimizer states; {kept} kept, and one more while a new one is written). Free space, lower "
                "training.keep_checkpoints, or choose another training.checkpoint_dir"]
    return []


def _checkpoint_bytes(config: PretrainedConfig | None, dtype: str) -> int | None:
    """About what one student's checkpoint takes: its weights, and the optimizer's fp32 states."""
    if config is None:
        return None
    try:
        return models.parameter_count(config) * (WEIGHT_BYTES[dtype] + OPTIMIZER_BYTES_PER_PARAMETER)
    except Exception:  # noqa: BLE001 - check_student_init names a model that cannot be built
        return None

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
    """On-policy training: chat data (the prompts it answers), an end token and a pad token inside every
    vocabulary, and (sampler teacher) a sampling teacher that takes part in the loss. (One student: the plan's.)"""
    config = start.config
    on_policy = config.training.on_policy
    if on_policy.fraction == 0:
        return []
    problems = []
    where = f"training.on_policy.fraction={on_policy.fraction}"
    if config.data.train != STDLIB_CORPUS and start.data.kind != "chat":
        problems.append(f"{where} on text data (data.format: text): a sample answers a prompt, and packed text has "
                        "none. Give chat data (records with messages, or prompt/completion), or set "
                        "training.on_policy.fraction: 0")
    if on_policy.sampler == "teacher" and config.teachers and config.teachers[0].weight == 0:
        problems.append(f"training.on_policy.sampler: teacher samples from the first teacher "
                        f"({config.teachers[0].name}), whose weight is 0: the student would learn from samples of a "
                        "teacher its loss ignores. List a teacher with weight > 0 first")
    if start.plan is None and check_plan(start):
        return problems  # the plan's own problems are check_plan's to report
    plan = start.plan
    if plan is None:  # across tokenizers: the plan is made once the vocabulary map exists
        return problems
    teacher_card = next(iter(plan.cards.values()), None)
    student = plan.student_configs.get(config.students[0].name)
    sampling_source = config.teacher if on_policy.sampler == "teacher" else (config.students[0].model or config.teacher)
    vocabularies = [size for size in [teacher_card and teacher_card.vocab_size,
                                      *(getattr(c, "vocab_size", None) for c in plan.student_configs.values())] if size]
    vocab = min(vocabularies) if vocabularies else None
    eos = on_policy.eos_token_id
    eos_key = "training.on_policy.eos_token_id"
    if eos is None:
        eos = (teacher_card.eos_token_id if on_policy.sampler == "teacher" and teacher_card else
               models.end_token(models.generation_config(config.students[0].model), student))
        eos_key = f"the end token of {sampling_source!r} (eos_token_id)"
        if eos is None:
            problems.append(f"training.on_policy: {sampling_source!r} has no end token (no eos_token_id in its config "
                            "or generation config), so samples would never end; set training.on_policy.eos_token_id "
                            "(e.g. the tokenizer's eos_token_id)")
    for key, value in ((eos_key, eos), ("training.on_policy.pad_token_id", on_policy.pad_token_id)):
        if value is not None and vocab is not None and not 0 <= value < vocab:
            problems.append(f"{key}: {value} is outside the vocabulary (ids 0..{vocab - 1} in every model of the "
                            "run); give a token id of the tokenizer")
    return problems


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


def check_peft_students(start: Start) -> list[str]:
    """LoRA adapters go on a pretrained student: adapters on a random frozen base learn on noise. (Its
    ``target_modules`` are the plan's: ``check_plan``.)"""
    problems = []
    for student in start.config.students:
        if student.peft is not None and student.model is None and student.init_from_teacher is None:
            problems.append(f"students[{student.name}].peft: LoRA adapters train on a frozen pretrained student, but "
                            "this student is built with random weights (init): its frozen base would stay noise. "
                            "Give model: a pretrained directory (or init_from_teacher), or drop peft to train every "
                            "weight")
    return problems


Check = Callable[[Start], list[str]]
CHECKS: list[Check] = [check_plan, check_output_dir, check_models, check_student_tokenizers, check_data, check_packing,
                       check_data_format, check_students, check_on_policy, check_peft_students, check_checkpoint_disk,
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

    ``check_teachers`` reads the config as given; the other checks see the first of ``teachers`` as the teacher."""
    problems: list[str] = []
    plan = None
    lead = run_config.lead_teacher(config)
    if distributed.is_main():
        problems = check_teachers(config, data)
        start = Start(lead, resume, identity, data=data)
        taught = start.config.teacher is not None or run_config.self_taught(config)
        for check in (CHECKS if checks is None else checks) if taught else []:
            problems += check(start)
        plan = start.plan
    problems = distributed.broadcast_object(problems)
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))
    if not distributed.is_main() and not config.student_tokenizer:
        plan = run_plan(lead, data)  # pure: every rank makes the same one
    return plan

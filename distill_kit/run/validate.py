"""Everything about a CLI run that can be checked before any work or any write, checked together.

A run that fails after its start has written ``run_identity.json``, tokenised the data or built the students
leaves a folder the same command, fixed, may no longer accept; and one problem at a time is slow to fix. So
:func:`validate` runs every check in :data:`CHECKS` on rank 0, before anything is loaded or written, and raises
one :class:`ConfigError` listing every problem (each names the setting or file and the fix); the other ranks
raise the same. A check is a function ``(Start) -> list[str]`` (its problems, none when fine): to check
something new up front, write one and append it to :data:`CHECKS`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from distill_kit.config import StudentSpec, TeacherSpec
from distill_kit.config import specs as config_specs
from distill_kit.data import blocks, chat
from distill_kit.engines import deepspeed_config, distributed
from distill_kit.errors import ConfigError
from distill_kit.run import output_dir, run_config, student_tokenizer, trackers
from distill_kit.run.run_config import STDLIB_CORPUS, RunConfig
from distill_kit.students import from_teacher
from distill_kit.training import checkpoint
from distill_kit.training.on_policy import end_token
from distill_kit.training.on_policy import positions as on_policy_positions
from distill_kit.training.plan import make_plan
from distill_kit.training.teachers import check_weights, tokenizer_problems
from losses import registry as loss_registry

# Bytes a checkpoint keeps per trained parameter beyond its weights: the optimizer's fp32 master copy and
# Adam's two moments (ZeRO-2/3 save all three in fp32).
OPTIMIZER_BYTES_PER_PARAMETER = 12
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Start:
    """What the checks look at: the run config, whether it resumes, and the models' configs read once."""

    config: RunConfig
    resume: bool
    identity: dict[str, Any]
    """What must not change across a resume (``cli.run_identity``)."""
    _models: dict[str, PretrainedConfig | None] = field(default_factory=dict)

    def model_config(self, kind: str, source: str, init: dict[str, Any] | None = None) -> PretrainedConfig | None:
        """``source``'s config with ``init`` applied; None when it cannot be read (``check_models`` says why)."""
        if kind not in self._models:
            try:
                config = AutoConfig.from_pretrained(source)
                config.update(dict(init or {}))
            except Exception:  # noqa: BLE001 - check_models reports the cause
                config = None
            self._models[kind] = config
        return self._models[kind]

    def students(self) -> dict[str, PretrainedConfig | None]:
        """Each student's model config: its own, or the teacher's with its ``init`` overrides."""
        teacher = self.model_config("teacher", self.config.teacher)
        configs = {}
        for s in self.config.students:
            init = None
            if s.model is None:
                try:
                    init = student_init(s, teacher) if teacher is not None else s.init
                except ConfigError:  # check_student_init reports it
                    init = s.init
            configs[s.name] = self.model_config(f"students[{s.name}]", s.model or self.config.teacher, init)
        return configs


def _local(path: str) -> bool:
    """Hub names are ``org/name``; anything else with a path separator or dot-prefix is a local path."""
    return path.startswith((".", "/", "~")) or path.count("/") != 1 or Path(path).exists()


def student_init(student: StudentSpec, teacher_config: PretrainedConfig) -> dict[str, Any]:
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


def check_output_dir(start: Start) -> list[str]:
    """A live run in the folder (its lock), another run's checkpoints, a non-run folder, checkpoints without
    ``--resume``, nothing to ``--resume``; on ``--resume``: a checkpoint of another rank count, changed data."""
    config = start.config
    busy = output_dir.in_use(config.output_dir)
    if busy is not None:
        return [busy]
    try:
        output_dir.check(config.output_dir, start.identity, resume=start.resume,
                         checkpoint_dir=config.training.checkpoint_dir, record=False)
    except ValueError as err:
        return [str(err)]
    if not start.resume:
        return []
    directory = config.training.checkpoint_dir
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
    sources = [("teacher", config.teacher)] + [(f"students[{s.name}].model", s.model) for s in config.students]
    for kind, path in sources:
        if path is None or not _local(path):
            continue
        if not Path(path).is_dir():
            problems.append(f"{kind}: {path!r} does not exist; give a save_pretrained directory or a hub name")
        elif not (Path(path) / "config.json").is_file():
            problems.append(f"{kind}: the folder {path!r} holds no model (no config.json); give a directory "
                            "written by save_pretrained")
    tokenizer = config.tokenizer or config.teacher
    if _local(tokenizer) and Path(tokenizer).is_dir() and not any(
            (Path(tokenizer) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        problems.append(f"{'tokenizer' if config.tokenizer else 'teacher'}: the folder {tokenizer!r} holds no "
                        "tokenizer (no tokenizer.json or tokenizer_config.json); save it there with "
                        "tokenizer.save_pretrained, or set tokenizer to one")
    return problems


def check_student_tokenizers(start: Start) -> list[str]:
    """A student given as a folder with a tokenizer has the run's (``tokenizer``, or the teacher's), or with
    ``student_tokenizer`` the students' own: the same rule as the teachers' (``teachers.tokenizer_problems``)."""
    config = start.config
    students = [(f"students[{s.name}].model", s.model) for s in config.students if s.model is not None]
    if config.student_tokenizer is not None:
        return tokenizer_problems(("student_tokenizer", config.student_tokenizer), students)
    return tokenizer_problems(("the run", config.tokenizer or config.teacher), students)


def check_student_init(start: Start) -> list[str]:
    """``init`` overrides name fields of the teacher's config, and the model they describe can be built."""
    teacher = start.model_config("teacher", start.config.teacher)
    if teacher is None:
        return []
    problems = []
    for student in start.config.students:
        if student.model is not None:
            continue
        unknown = [key for key in student.init if not hasattr(teacher, key)]
        if unknown:
            problems.append(f"students[{student.name}].init: {unknown} are not fields of the teacher's "
                            f"{type(teacher).__name__}; e.g. num_hidden_layers, hidden_size")
            continue
        try:
            student_init(student, teacher)
        except ConfigError as err:
            problems.append(str(err))
            continue
        try:
            _parameters(start.students()[student.name])
        except Exception as err:  # noqa: BLE001 - transformers raises many types for a shape it cannot build
            problems.append(f"students[{student.name}].init {student.init}: the teacher's config with these "
                            f"values does not build a model ({type(err).__name__}: {err})")
    return problems


def check_cuts(start: Start) -> list[str]:
    """Every ``init_from_teacher`` checked against the teacher's config (architecture, layers, sizes)."""
    teacher = start.model_config("teacher", start.config.teacher)
    if teacher is None:
        return []
    problems = []
    for student in start.config.students:
        if student.init_from_teacher is not None:
            try:
                from_teacher.check(student.init_from_teacher, teacher)
            except ValueError as err:
                problems.append(f"students[{student.name}].init_from_teacher: {err}")
    return problems


def check_plan(start: Start) -> list[str]:
    """The run's plan (``training/plan.py``), made from the models' configs exactly as the Distiller makes it from
    their folders: each student's loss, every engine's DeepSpeed config (all problems at once), the run's shape,
    kernels, vocabularies, LoRA. Models that cannot be read are ``check_models``' and ``check_student_init``'s."""
    config = start.config
    students = start.students()
    teachers = list(config.teachers) if config.teachers else [TeacherSpec(name="teacher", model=config.teacher)]
    teacher_configs = {t.name: start.model_config(f"teachers[{t.name}]", t.model) for t in teachers}
    if any(c is None for c in [*students.values(), *teacher_configs.values()]) or config.student_tokenizer:
        return []  # across tokenizers the losses need the vocabulary map: student_tokenizer.config_problems
    try:
        make_plan([dataclasses.replace(s, model=students[s.name], init={}, init_from_teacher=None)
                   for s in config.students],
                  [dataclasses.replace(t, model=teacher_configs[t.name]) for t in teachers],
                  training=config.training, combine=config.combine, world_size=distributed.world_size(),
                  student_ds_config=config.student_ds_config, teacher_ds_config=config.teacher_ds_config,
                  student_ds_overrides=config.student_ds_overrides, teacher_ds_overrides=config.teacher_ds_overrides)
    except (ConfigError, deepspeed_config.DeepSpeedConfigError, ValueError, TypeError) as err:
        return [str(err)]
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
    directory = Path(start.config.training.checkpoint_dir)
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


def _hidden_size(config: PretrainedConfig) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)


def _parameters(config: PretrainedConfig) -> int:
    """Parameters of the model ``config`` describes, counted on the meta device (no memory, no time)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _checkpoint_bytes(config: PretrainedConfig | None, dtype: str) -> int | None:
    """About what one student's checkpoint takes: its weights, and the optimizer's fp32 states."""
    if config is None:
        return None
    try:
        return _parameters(config) * (WEIGHT_BYTES[dtype] + OPTIMIZER_BYTES_PER_PARAMETER)
    except Exception:  # noqa: BLE001 - check_student_init names a model that cannot be built
        return None

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
    if config.data.train != STDLIB_CORPUS and chat.detect_format(config.data) != "chat":
        problems.append(f"{where} on text data (data.format: text): a sample answers a prompt, and packed text has "
                        "none. Give chat data (records with messages, or prompt/completion), or set "
                        "training.on_policy.fraction: 0")
    if on_policy.sampler == "teacher" and config.teachers and config.teachers[0].weight == 0:
        problems.append(f"training.on_policy.sampler: teacher samples from the first teacher "
                        f"({config.teachers[0].name}), whose weight is 0: the student would learn from samples of a "
                        "teacher its loss ignores. List a teacher with weight > 0 first")
    sampling_source = config.teacher if on_policy.sampler == "teacher" else (
        config.students[0].model or config.teacher)
    sampling = (start.model_config("teacher", config.teacher) if on_policy.sampler == "teacher"
                else start.students().get(config.students[0].name))
    vocabularies = [c.vocab_size for c in [start.model_config("teacher", config.teacher), *start.students().values()]
                    if c is not None and getattr(c, "vocab_size", None)]
    vocab = min(vocabularies) if vocabularies else None
    eos = on_policy.eos_token_id
    eos_key = "training.on_policy.eos_token_id"
    if eos is None and sampling is not None:
        eos, eos_key = _end_token(sampling_source, sampling), f"the end token of {sampling_source!r} (eos_token_id)"
        if eos is None:
            problems.append(f"training.on_policy: {sampling_source!r} has no end token (no eos_token_id in its config "
                            "or generation config), so samples would never end; set training.on_policy.eos_token_id "
                            "(e.g. the tokenizer's eos_token_id)")
    for key, value in ((eos_key, eos), ("training.on_policy.pad_token_id", on_policy.pad_token_id)):
        if value is not None and vocab is not None and not 0 <= value < vocab:
            problems.append(f"{key}: {value} is outside the vocabulary (ids 0..{vocab - 1} in every model of the "
                            "run); give a token id of the tokenizer")
    return problems


def _end_token(source: str, config: PretrainedConfig) -> int | None:
    """The sampler's end token (``on_policy.end_token``), read from the model's folder."""
    generation = None
    if (Path(source) / "generation_config.json").is_file():
        try:
            generation = GenerationConfig.from_pretrained(source)
        except Exception:  # noqa: BLE001 - an unreadable generation config: the model config's end token
            pass
    return end_token(generation, config)


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
    elif config.student_tokenizer is not None and chat.detect_format(config.data) == "chat":
        problems.append("student_tokenizer works with text data only: chat data across tokenizers (a template per "
                        "tokenizer, aligned answers) is not supported yet. Drop student_tokenizer, or give text data "
                        "(data.format: text)")
    return problems


def check_positions(start: Start) -> list[str]:
    """Every row a model reads fits its positions (``max_position_embeddings``, read from its config; no weights
    loaded): ``data.block_size`` for the teacher(s) and the students, ``teacher_block_size`` for a teacher of
    another tokenizer. A longer row is scored past what the model was trained on, or fails on an index."""
    config, problems = start.config, []
    teacher_rows = ("teacher_block_size", config.teacher_block_size) if (
        config.student_tokenizer is not None and config.teacher_block_size is not None) else (
        "data.block_size", config.data.block_size)
    models: list[tuple[str, PretrainedConfig | None, tuple[str, int]]] = [
        ("teacher", start.model_config("teacher", config.teacher), teacher_rows)]
    models += [(f"students[{name}]", c, ("data.block_size", config.data.block_size))
               for name, c in start.students().items()]
    for name, model, (key, rows) in models:
        limit = on_policy_positions(model)
        if limit is not None and rows > limit:
            problems.append(f"{key}: {rows} tokens per row, but {name} reads at most {limit} positions "
                            f"(max_position_embeddings in its config): set {key} to {limit} or less")
    return problems


def row_limit(config: RunConfig) -> int | None:
    """The fewest positions among the run's models (teachers and students, from their configs): the longest row
    an on-policy sample may make (``training.on_policy.max_length`` when it is 0)."""
    start = Start(run_config.lead_teacher(config), False, {})
    configs = [start.model_config("teacher", start.config.teacher), *start.students().values()]
    configs += [_read_config(t.model) for t in config.teachers or ()][1:]
    limits = [limit for c in configs if (limit := on_policy_positions(c)) is not None]
    return min(limits) if limits else None


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
CHECKS: list[Check] = [check_output_dir, check_models, check_student_tokenizers, check_student_init, check_cuts,
                       check_data, check_packing, check_data_format, check_students, check_on_policy, check_positions,
                       check_peft_students, check_plan, check_checkpoint_disk,
                       lambda start: student_tokenizer.config_problems(start.config), check_trackers]
"""Run in this order on rank 0 by :func:`validate`; append a check to have it run up front too."""


def check_teachers(config: RunConfig) -> list[str]:
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
        return [f"teachers: {err}"]
    if config.combine == "route" and config.data.train != STDLIB_CORPUS and chat.detect_format(config.data) != "chat":
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
    sources = [(f"teachers[{t.name}].model", t.model) for t in config.teachers[1:]]  # the first is check_models'
    for kind, path in sources:
        if _local(path) and not (Path(path) / "config.json").is_file():
            problems.append(f"{kind}: {path!r} is not a save_pretrained directory (no config.json); give one, or a "
                            "hub name")
    if problems:
        return problems
    problems += _teacher_tokenizers(config)
    return problems


def _teacher_tokenizers(config: RunConfig) -> list[str]:
    """Every teacher reads the run's tokenizer (``tokenizer``, or the first teacher's): the same vocabulary
    (``teachers.tokenizer_problems``, the Python path's rule), and a model vocabulary no smaller than it."""
    from transformers import AutoTokenizer

    reference = config.tokenizer or config.teachers[0].model
    try:
        size = len(AutoTokenizer.from_pretrained(reference).get_vocab())
    except Exception:  # noqa: BLE001 - check_models names a folder without a tokenizer
        return []
    problems = tokenizer_problems(("the run", reference), [(f"teachers[{t.name}]", t.model) for t in config.teachers])
    for teacher in config.teachers:
        vocabulary = getattr(_read_config(teacher.model), "vocab_size", None)
        if vocabulary is not None and vocabulary < size:
            problems.append(f"teachers[{teacher.name}]: its vocabulary ({vocabulary}) is smaller than the run's "
                            f"tokenizer ({size} tokens): it cannot share the student's tokenizer. Use a teacher with "
                            "the student's tokenizer")
    return problems


def _read_config(source: str) -> PretrainedConfig | None:
    """A model's config, or None when it cannot be read (``check_models`` and ``check_teachers`` say why)."""
    try:
        return AutoConfig.from_pretrained(source)
    except Exception:  # noqa: BLE001 - transformers raises many types for a folder it cannot read
        return None


def _facts(config: PretrainedConfig) -> dict[str, int | None]:
    """What a loss is sized by (``models.facts``), from a config already read."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"hidden_size": _hidden_size(config),
            "num_layers": getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)}


TASK_CHECKS: list[Check] = [check_models, check_student_tokenizers, check_student_init, check_students, check_plan]
"""A task benchmark's (``task.name``): it writes its own data and report, so only the models and the plan."""


def validate(config: RunConfig, resume: bool, identity: dict[str, Any], checks: list[Check] | None = None) -> None:
    """Run every check (``checks``, default ``CHECKS``) on rank 0; raise one ConfigError listing every problem, on
    every rank. Writes nothing.

    ``check_teachers`` reads the config as given; the other checks see the first of ``teachers`` as the teacher."""
    problems: list[str] = []
    if distributed.is_main():
        problems = check_teachers(config)
        start = Start(run_config.lead_teacher(config), resume, identity)
        for check in (CHECKS if checks is None else checks) if start.config.teacher is not None else []:
            problems += check(start)
    problems = distributed.broadcast_object(problems)
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))

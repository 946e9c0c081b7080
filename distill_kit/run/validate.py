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
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from distill_kit.data import blocks
from distill_kit.engines import deepspeed_config, distributed, fp8, peft_student
from distill_kit.run import run_config, student_tokenizer, trackers
from distill_kit.run.run_config import STDLIB_CORPUS, ConfigError, RunConfig, StudentConfig
from distill_kit.students import from_teacher
from distill_kit.training import checkpoint
from losses import build_loss

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


def student_init(student: StudentConfig, teacher_config: PretrainedConfig) -> dict[str, Any]:
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
    """Another run's folder, a non-run folder, checkpoints without ``--resume``, nothing to ``--resume``."""
    try:
        checkpoint.check_output_dir(start.config.output_dir, start.identity, resume=start.resume, record=False)
    except ValueError as err:
        return [str(err)]
    if not start.resume:
        return []
    directory = start.config.training.checkpoint_dir
    found, skipped = checkpoint.find_latest(directory)
    return [] if found is not None else [f"--resume: {checkpoint.nothing_to_resume(directory, skipped)}"]


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


def check_deepspeed_configs(start: Start) -> list[str]:
    """Every student's DeepSpeed config and the teacher's, filled and checked together as the engines will be."""
    config = start.config
    teacher = start.model_config("teacher", config.teacher)
    students = start.students()
    if teacher is None or any(c is None for c in students.values()):
        return []
    trained = _trained_configs(config, students)
    try:
        deepspeed_config.prepare_group(trained, config.teacher_ds_config, teacher_hidden_size=_hidden_size(teacher),
                                       world_size=distributed.world_size(),
                                       teacher_overrides=config.teacher_ds_overrides)
    except (deepspeed_config.DeepSpeedConfigError, ValueError, TypeError) as err:
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


def check_checkpoint_disk(start: Start) -> list[str]:
    """The checkpoint folder can be written, and its disk has room for the checkpoints the run will keep."""
    directory = Path(start.config.training.checkpoint_dir)
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
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
    free = _free_bytes(existing)
    if free < needed:
        return [f"training.checkpoint_dir {str(directory)!r}: its disk has {free / 1e9:.2f} GB free, but the run "
                f"needs about {needed / 1e9:.2f} GB for its checkpoints ({sum(sizes) / 1e9:.2f} GB each: weights "
                f"and optimizer states; {kept} kept, and one more while a new one is written). Free space, lower "
                "training.keep_checkpoints, or choose another training.checkpoint_dir"]
    return []


def _free_bytes(path: Path) -> int:
    return os.statvfs(path).f_bavail * os.statvfs(path).f_frsize


def _trained_configs(config: RunConfig, students: dict[str, PretrainedConfig | None]) -> dict[str, Any]:
    """Each student's DeepSpeed config as its engine will get it: its own or the run's, its lr, its overrides."""
    return {f"student {s.name!r}": deepspeed_config.TrainedConfig(
        s.ds_config or config.student_ds_config,
        config.training if s.lr is None else dataclasses.replace(config.training, lr=s.lr),
        _hidden_size(students[s.name]) if students[s.name] is not None else None,
        {**config.student_ds_overrides, **s.ds_overrides}) for s in config.students}


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

def check_peft(start: Start) -> list[str]:
    """A student with ``peft`` adapters: the library is installed and the student's ZeRO stage is 0-2."""
    config, problems = start.config, []
    for student in config.students:
        if student.peft is not None:
            try:
                peft_student.preflight(student.peft, student.ds_config or config.student_ds_config,
                                       {**config.student_ds_overrides, **student.ds_overrides})
            except (ImportError, ValueError) as err:
                problems.append(f"students[{student.name}].peft: {err}")
    return problems


def check_trackers(start: Start) -> list[str]:
    """Every tracker in ``report_to`` is known and installed."""
    try:
        trackers.check(start.config.report_to)
    except ValueError as err:
        return [str(err)]
    return []


Check = Callable[[Start], list[str]]
def check_teacher_precision(start: Start) -> list[str]:
    """training.teacher_precision fp8: this machine has FP8 and torchao, every teacher's layers are covered, and
    each fits one GPU (``engines/fp8.py``), before a student is cut from a teacher or anything loads."""
    config, problems = start.config, []
    sources = [spec.model for spec in config.teachers] if config.teachers else [config.teacher]
    for source in sources:
        if _local(source) and not (Path(source) / "config.json").is_file():
            continue  # check_models reports it
        try:
            fp8.check_teacher(config.training.teacher_precision, config.training.dtype, source)
        except ConfigError as err:
            problems.append(str(err))
            if "GPU" in str(err) or "torchao" in str(err):
                break  # the same for every teacher
    return problems


CHECKS: list[Check] = [check_output_dir, check_models, check_teacher_precision, check_student_init, check_cuts,
                       check_data, check_deepspeed_configs, check_checkpoint_disk,
                       lambda start: student_tokenizer.config_problems(start.config), check_peft, check_trackers]
"""Run in this order on rank 0 by :func:`validate`; append a check to have it run up front too."""


def check_teachers(config: RunConfig) -> list[str]:
    """``teacher`` or ``teachers`` (not both, not neither); with ``teachers``: well-formed entries (names, models,
    weights), one student, one tokenizer for all, each teacher's folder and DeepSpeed config, and a loss that
    ``combine`` can combine. Reads the config as given (``load`` leaves ``teacher`` out when ``teachers`` is given)."""
    from distill_kit.training import teachers as multi_teacher  # the Distiller and DeepSpeed: only when needed

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
    missing = [f"teachers[{i}]" for i, t in enumerate(config.teachers) if t.name is None or t.model is None]
    if missing:
        return [f"{', '.join(missing)}: every teacher needs a name and a model, e.g. {{name: big, model: "
                "path/to/teacher, weight: 1.0}"]
    try:
        specs = multi_teacher.teacher_specs([{"name": t.name, "model": t.model, "weight": t.weight}
                                             for t in config.teachers])
    except ValueError as err:
        return [f"teachers: {err}"]
    if len(config.students) != 1:
        problems.append(
            f"teachers: several teachers teach one student, but students has {len(config.students)} "
            f"({', '.join(s.name for s in config.students)}): keep one entry in students (e.g. students: [{{name: "
            "distilled, init_from_teacher: {every: 2}}]), or distil the others in their own runs")
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
    lead = run_config.lead_teacher(config)
    students = Start(lead, False, {}).students()
    trained = _trained_configs(config, students)
    configs = {t.name: _read_config(t.model) for t in config.teachers}
    for teacher in config.teachers:
        if configs[teacher.name] is None:
            continue
        try:
            deepspeed_config.prepare_group(
                trained, teacher.ds_config or config.teacher_ds_config,
                teacher_hidden_size=_hidden_size(configs[teacher.name]), world_size=distributed.world_size(),
                teacher_overrides={**config.teacher_ds_overrides, **teacher.ds_overrides})
        except (deepspeed_config.DeepSpeedConfigError, ValueError, TypeError) as err:
            problems.append(f"teachers[{teacher.name}]: {err}")
    student, first = config.students[0], configs[specs[0].name]
    if config.combine == "mixture" and students[student.name] is not None and first is not None:
        try:
            multi_teacher.mixture_temperature(build_loss(
                student.loss, **{f"student_{k}": v for k, v in _facts(students[student.name]).items()},
                **{f"teacher_{k}": v for k, v in _facts(first).items()}))
        except (ValueError, TypeError) as err:
            problems.append(f"students[{student.name}].loss with combine: mixture: {err}")
    return problems


def _teacher_tokenizers(config: RunConfig) -> list[str]:
    """Every teacher reads the run's tokenizer (the first teacher's, or ``tokenizer``): the same vocabulary, and
    a model vocabulary no smaller than the students'. Folders without a tokenizer are compared by vocabulary size."""
    from transformers import AutoTokenizer

    reference = config.tokenizer or config.teachers[0].model
    try:
        vocabulary = AutoTokenizer.from_pretrained(reference).get_vocab()
    except Exception:  # noqa: BLE001 - check_models names a folder without a tokenizer
        return []
    problems = []
    for teacher in config.teachers:
        folder = Path(teacher.model)
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            theirs = AutoTokenizer.from_pretrained(teacher.model).get_vocab()
            if theirs != vocabulary:
                problems.append(
                    f"teachers[{teacher.name}]: its tokenizer differs from the run's ({reference!r}: {len(vocabulary)} "
                    f"tokens; {teacher.model!r}: {len(theirs)}, or other ids). Several teachers are compared with the "
                    "student token id by token id: use teachers that share the student's tokenizer (distilling across "
                    "tokenizers, loss cross_tokenizer with student_tokenizer, takes one teacher: teacher:)")
                continue
        size = getattr(_read_config(teacher.model), "vocab_size", None)
        if size is not None and size < len(vocabulary):
            problems.append(f"teachers[{teacher.name}]: its vocabulary ({size}) is smaller than the run's tokenizer "
                            f"({len(vocabulary)} tokens): it cannot share the student's tokenizer. Use a teacher "
                            "with the student's tokenizer")
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


def validate(config: RunConfig, resume: bool, identity: dict[str, Any]) -> None:
    """Run every check on rank 0; raise one ConfigError listing every problem, on every rank. Writes nothing.

    ``check_teachers`` reads the config as given; the other checks see the first of ``teachers`` as the teacher."""
    problems: list[str] = []
    if distributed.is_main():
        problems = check_teachers(config)
        start = Start(run_config.lead_teacher(config), resume, identity)
        for check in CHECKS if start.config.teacher is not None else []:
            problems += check(start)
    problems = distributed.broadcast_object(problems)
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))

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
from distill_kit.engines import deepspeed_config, distributed, peft_student
from distill_kit.run import student_tokenizer, trackers
from distill_kit.run.run_config import STDLIB_CORPUS, ConfigError, RunConfig, StudentConfig
from distill_kit.students import from_teacher
from distill_kit.training import checkpoint

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
    trained = {}
    for student in config.students:
        training = (config.training if student.lr is None else dataclasses.replace(config.training, lr=student.lr))
        trained[f"student {student.name!r}"] = deepspeed_config.TrainedConfig(
            student.ds_config or config.student_ds_config, training, _hidden_size(students[student.name]),
            {**config.student_ds_overrides, **student.ds_overrides})
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
CHECKS: list[Check] = [check_output_dir, check_models, check_student_init, check_cuts, check_data,
                       check_deepspeed_configs, check_checkpoint_disk,
                       lambda start: student_tokenizer.config_problems(start.config), check_peft, check_trackers]
"""Run in this order on rank 0 by :func:`validate`; append a check to have it run up front too."""


def validate(config: RunConfig, resume: bool, identity: dict[str, Any]) -> None:
    """Run every check on rank 0; raise one ConfigError listing every problem, on every rank. Writes nothing."""
    problems: list[str] = []
    if distributed.is_main():
        start = Start(config, resume, identity)
        for check in CHECKS:
            problems += check(start)
    problems = distributed.broadcast_object(problems)
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))

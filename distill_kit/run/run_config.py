"""The run config of ``scripts/distill.py``: typed sections, from defaults, a YAML/JSON file and flags.

Precedence: the dataclass defaults (which are the embedded default run), then ``--config FILE``, then
command-line overrides written ``--section.key value``, ``--section.key=value`` or ``section.key=value``.
Every key is checked against the dataclasses before anything runs: a misspelled key is an error that
suggests the closest valid one, and a value is converted to the field's type or rejected. The help text
of every field is its docstring in the source, so ``--help`` and the code never disagree.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from distill_kit.config import (
    DeepSpeedSettings,
    EvalConfig,
    FromTeacherConfig,
    HarnessConfig,
    StudentSpec,
    TaskConfig,
    TeacherSpec,
    TrainingConfig,
    _is_dataclass_type,
    _plain,
    _safe_load,
    _yaml_problem,
    build,
    field_docs,
)
from distill_kit.data.blocks import DataConfig
from distill_kit.errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parents[1]
DEFAULT_TEACHER = PACKAGE_DIR / "assets" / "default" / "teacher"
CONFIG_DIR = PACKAGE_DIR.parent / "configs"
STDLIB_CORPUS = "stdlib"


# The embedded default's student: the shipped teacher's Llama shape, smaller (0.94M parameters), trained on
# 512 training blocks (3% of the corpus: distillation helps most where data is scarce). The no-teacher
# baseline keeps random weights of this shape. Its figures: benchmarks/RESULTS.md.
DEFAULT_STUDENT_INIT = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
                        "num_key_value_heads": 2, "intermediate_size": 352, "tie_word_embeddings": True}
# The distilled student has the same shape, cut out of the teacher instead: every other layer (DistilBERT) and
# half of the width, by activation importance (Minitron; docs/students.md#students-cut-from-their-teacher).
# How close it comes to the teacher, per seed: benchmarks/RESULTS.md.
DEFAULT_STUDENT_CUT = FromTeacherConfig(every=2, hidden_size=128, intermediate_size=352, num_attention_heads=2,
                                        num_key_value_heads=2)


@dataclass(frozen=True)
class RunConfig:
    """A whole distillation run. The defaults are the embedded default: it runs offline on 2 CPU cores."""

    distiller: str | None = None
    """Your own Distiller subclass as 'pkg.module:Class' (e.g. one that overrides compute_loss); the run then uses
    it with the CLI's data, checkpoints, resume, evaluation and report. None: distill_kit.Distiller."""
    teacher: str | None = str(DEFAULT_TEACHER)
    """The frozen teacher: a save_pretrained directory or hub name (default: the shipped stdlib teacher). Left
    out when teachers is given (giving both is an error)."""
    teachers: tuple[TeacherSpec, ...] | None = None
    """Several frozen teachers of one student, instead of teacher: [{name, model, weight, ds_config}, ...]. The
    first stands for "the teacher" where one model is meant (tokenizer, a student's init, init_from_teacher);
    evaluation compares the student with their weighted mixture. None: the one teacher of teacher."""
    combine: Literal["sum", "mixture", "route"] = "sum"
    """With teachers: sum (sum_k w_k loss(student, teacher_k); needed by hidden-state and attention losses, and
    usual for teachers weighted by skill), mixture (the loss against sum_k w_k p_k, the ensemble target of Hinton
    et al. 2015; suits peers on one task, and reverse KL/JSD; same gradient as sum for forward KL), or route (each
    chat conversation taught by the teacher its record names under data.teacher_field: specialist teachers of
    their own domains; docs/teachers.md#routing-a-teacher-per-conversation)."""
    tokenizer: str | None = None
    """Tokenizer directory or hub name; None uses the (first) teacher's as its card names it (its folder or hub name;
    a served teacher's options.tokenizer), or the first student's when that teacher is the student itself (kind
    self); a teacher that names none (a store, a class of your own without one) needs it. Every model must share it."""
    student_tokenizer: str | None = None
    """The students' own tokenizer when it differs from the teacher's: a directory, a hub name, or 'bpe:<size>' (a
    byte-level BPE of that many tokens trained on data.train, cached in cache_dir). The run then distils across
    tokenizers: paired blocks, loss cross_tokenizer, bits per byte in the report (docs/losses.md#cross-tokenizer)."""
    teacher_block_size: int | None = None
    """With student_tokenizer: the most teacher tokens a block may hold (None: data.block_size). Raise it when the
    teacher's tokenizer is the finer one, or blocks are cut short to fit the teacher."""
    students: tuple[StudentSpec, ...] = (
        StudentSpec(name="distilled", init_from_teacher=DEFAULT_STUDENT_CUT, loss="forward_kl"),
        StudentSpec(name="no_teacher", init=DEFAULT_STUDENT_INIT, loss="cross_entropy"),
    )
    """The students trained together on the same batches, each its own DeepSpeed engine."""
    data: DataConfig = field(default_factory=lambda: DataConfig(
        train=STDLIB_CORPUS, block_size=256, max_train_blocks=512, max_heldout_blocks=128))
    """Training and held-out text. data.train 'stdlib' is this Python's standard library sources."""
    training: TrainingConfig = field(default_factory=lambda: TrainingConfig(
        max_steps=400, micro_batch_size=8, lr=3e-3, betas=(0.9, 0.95), warmup_steps=20))
    """Optimizer steps, batch, learning rate, precision; every "auto" in the DeepSpeed configs comes from here."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(every=100))
    task: TaskConfig = field(default_factory=TaskConfig)
    """A task benchmark instead of training on data: task.name runs its comparison of recipes
    (configs/arithmetic.yaml)."""
    student_ds_config: str = str(CONFIG_DIR / "zero2_student.json")
    """The students' DeepSpeed config (JSON/HJSON, "auto" allowed)."""
    teacher_ds_config: str = str(CONFIG_DIR / "zero3_teacher.json")
    """The teacher's DeepSpeed config; ZeRO-3 shards it, stage 0 replicates it."""
    student_ds_overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted DeepSpeed keys written into the students' config, e.g. {zero_optimization.stage: 3}."""
    teacher_ds_overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted DeepSpeed keys written into the teacher's config,
    e.g. {zero_optimization.stage3_prefetch_bucket_size: 5e8}."""
    output_dir: str | None = None
    """Checkpoints, exported students, logs and the report go here; None: a new runs/<date>-<time>."""
    cache_dir: str = ".cache"
    """Prepared corpora and other one-time work, reused by later runs."""
    report_to: tuple[str, ...] | None = None
    """Trackers besides the JSON lines: any of tensorboard, wandb (offline unless WANDB_MODE is set), mlflow (a
    local store in output_dir/mlruns unless MLFLOW_TRACKING_URI is set); each needs its package. None:
    TensorBoard when installed; []: none."""

    def __post_init__(self) -> None:
        """Rules between fields that need no model (the rest: ``validate.py``, before the run claims its folder)."""
        if self.teacher_block_size is not None and self.teacher_block_size < 2:
            raise ConfigError(f"teacher_block_size: {self.teacher_block_size} teacher tokens per block leave the "
                              "teacher no token to predict; give at least 2 (or null: data.block_size)")
        ignored = [key for key, unset in TASK_IGNORES.items() if getattr(self, key) != unset]
        if self.task.name is not None and ignored:  # a key a path does not read is refused, never recorded
            raise ConfigError(f"task.name: the {self.task.name} benchmark compares recipes of one teacher (teacher:) "
                              f"and reads none of {ignored}; drop them, or drop task.name to train with them")
        if self.task.name is not None and self.training.seed != 0 and self.training.seed not in self.task.seeds:
            raise ConfigError(f"training.seed: {self.training.seed} is not used by the task benchmark, which runs "
                              f"every recipe at each of task.seeds {list(self.task.seeds)}; give "
                              f"--task.seeds '[{self.training.seed}]' instead")
        drawn = [f"eval.harness.{key}" for key in ("seed", "examples", "limit")
                 if getattr(self.eval.harness, key) != getattr(HarnessConfig, key)]
        if self.task.name is not None and self.eval.harness.tasks and drawn:  # the seed's own prompts, all of them
            raise ConfigError(f"{', '.join(drawn)}: in a task benchmark the harness scores each seed's held-out "
                              "prompts, the checker's (task.heldout of them, drawn at each of task.seeds); drop "
                              f"{' and '.join(drawn)}, or set task.heldout for fewer prompts")
        own = [name for name in self.eval.harness.tasks if name.startswith("distill_kit_")]  # the checker's prompts
        shots, chat = self.eval.harness.num_fewshot, self.eval.harness.apply_chat_template
        changed = ([f"eval.harness.num_fewshot: {shots} puts {shots} solved examples before each prompt"] if shots
                   else []) + (["eval.harness.apply_chat_template: false sends each prompt without the chat template "
                                "the recipes are trained and checked with"] if chat is False else [])
        if self.task.name is not None and own and changed:  # the harness's score beside the checker's must agree
            keys = " and ".join(line.split(":")[0] for line in changed)
            raise ConfigError(f"{'; '.join(changed)}: in a task benchmark the harness scores {own} beside the "
                              "checker, which asks each prompt alone through the chat template, so the two columns "
                              f"would measure different things; drop {keys}, or {own} from eval.harness.tasks (the "
                              "harness's own tasks, e.g. gsm8k, may take them)")
        warmed = [r for r in self.task.recipes if r.startswith("on_policy_")]  # these start with warm_start_steps
        if self.task.name is not None and warmed and self.task.warm_start_steps >= self.training.max_steps:
            raise ConfigError(f"task.warm_start_steps: {self.task.warm_start_steps} SFT steps of training.max_steps "
                              f"{self.training.max_steps} leave the on-policy recipes no step of their own; give "
                              "task.warm_start_steps below training.max_steps, or raise training.max_steps")


# ---- field documentation, from the docstrings under each field ------------------------------------------






def _student_type(tp: Any) -> Any:
    """The dataclass inside ``tuple[X, ...]`` (or ``tuple[X, ...] | None``), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), None)
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if args and _is_dataclass_type(args[0]):
            return args[0]
    return None


def help_text() -> str:
    lines = [
        "usage: distill.py [--config FILE] [--print-config] [--resume] [--SECTION.KEY VALUE ...]",
        "",
        "Distil a frozen teacher into one or more students on DeepSpeed. With no arguments: the embedded",
        "default (the shipped stdlib teacher, a fresh student, and the same student without a teacher).",
        "",
        "  --config FILE      a YAML or JSON run config (its keys are the ones below)",
        "  --print-config     print the resolved config as YAML and exit",
        "  --resume           continue the run in output_dir from its latest complete checkpoint",
        "",
        "Config keys (override any as --key value; lists and dicts in YAML syntax):",
    ]

    def describe(defaults: Any, prefix: str) -> None:
        cls = type(defaults)
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if _is_dataclass_type(tp):
                lines.append(f"  {prefix}{f.name}.*  {docs.get(f.name, '')}".rstrip())
                describe(getattr(defaults, f.name), f"{prefix}{f.name}.")
                continue
            shown = json.dumps(_plain(getattr(defaults, f.name)), default=str)
            lines.append(f"  {prefix}{f.name} (default {shown})")
            if f.name in docs:
                lines.extend(textwrap.wrap(docs[f.name], 100, initial_indent=" " * 6, subsequent_indent=" " * 6))
            inner = _student_type(tp)
            if inner is not None:
                lines.append(f"      each entry has: {', '.join(x.name for x in dataclasses.fields(inner))}")
                for name, sub in typing.get_type_hints(inner).items():  # e.g. init_from_teacher's own keys
                    sub = next((a for a in typing.get_args(sub) if _is_dataclass_type(a)), None)
                    if sub is not None:
                        lines.append(f"      {name} (default null): {sub.__doc__.split('.')[0].strip()}.")
                        for key, doc in field_docs(sub).items():
                            lines.extend(textwrap.wrap(f"{name}.{key}: {doc}", 100, initial_indent=" " * 8,
                                                       subsequent_indent=" " * 10))

    describe(RunConfig(), "")
    return "\n".join(lines)


# ---- dicts <-> dataclasses -------------------------------------------------------------------------------




def to_dict(config: RunConfig) -> dict[str, Any]:
    return _plain(config)






def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _scalar(text: Any, key: str = "value") -> Any:
    """A command-line string as the number, bool or structure it spells (``5e8`` is a float here)."""
    if not isinstance(text, str):
        return text
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return _safe_load(text, key)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c``; inside a dict-typed field (ds overrides, student init) the rest of the key is kept whole."""
    parts = dotted.split(".")
    cls: Any = RunConfig
    node = tree
    for i, part in enumerate(parts[:-1]):
        tp = typing.get_type_hints(cls).get(part) if _is_dataclass_type(cls) else None
        if _is_dataclass_type(cls) and tp is None:
            build(cls, {part: None}, ".".join(parts[:i]) + ("." if i else ""))  # raises the unknown-key error
        if tp is not None and not _is_dataclass_type(tp):
            node[part] = dict(node.get(part, {})) | {".".join(parts[i + 1:]): _scalar(value, dotted)}
            return
        node = node.setdefault(part, {})
        cls = tp
    node[parts[-1]] = value


def parse_overrides(args: Sequence[str]) -> dict[str, Any]:
    """``--a.b 1``, ``--a.b=1`` and ``a.b=1`` -> a nested dict of raw values."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if "=" in arg:
            key, _, value = arg.lstrip("-").partition("=")
            i += 1
        elif arg.startswith("--") and i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 2
        else:
            raise ConfigError(f"cannot read argument {arg!r}: write --key value or key=value (see --help)")
        _set_dotted(tree, key, value)
    return tree


def load(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Defaults, then the file, then the overrides; a ConfigError on any unknown key or bad value."""
    tree = to_dict(RunConfig())
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"run config {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"run config {str(path)!r} is not valid YAML: {_yaml_problem(err)}") from None
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"run config {str(path)!r} must be a mapping of keys to values")
        tree = _merge(tree, loaded)
    else:
        loaded = {}
    given = _merge(dict(loaded), parse_overrides(overrides))
    tree = _merge(tree, given)
    if given.get("teachers") is not None and "teacher" not in given:
        tree["teacher"] = None  # the default teacher gives way to the user's teachers; both given is an error
    return build(RunConfig, tree)


TASK_IGNORES = {"teachers": None, "distiller": None, "student_tokenizer": None, "combine": "sum"}
"""Keys a task benchmark does not read (its recipes build their own runs), with their unset values."""


def deepspeed_settings(config: RunConfig) -> DeepSpeedSettings:
    """The run's four DeepSpeed keys as the one value the plan takes."""
    return DeepSpeedSettings(config.student_ds_config, config.teacher_ds_config, dict(config.student_ds_overrides),
                             dict(config.teacher_ds_overrides))


def data_facts(config: RunConfig) -> Any:
    """What the plan needs of the data, decided once per run: chat records or text (``chat.detect_format``), rows,
    packing, and the teacher's rows across tokenizers."""
    from distill_kit.data import chat
    from distill_kit.training.plan import DataFacts

    kind = "text" if config.data.train == STDLIB_CORPUS else chat.detect_format(config.data)
    return DataFacts(kind=kind, block_size=config.data.block_size, packing=config.data.packing is True and
                     kind == "chat", teacher_block_size=config.teacher_block_size if config.student_tokenizer else None)


def teacher_specs(config: RunConfig) -> list[TeacherSpec]:
    """The run's teachers as specs: ``teachers``, or the one of ``teacher`` (named ``teacher``). Which of them leads,
    and the run's tokenizer, are the plan's to decide (``training/plan.py``: ``lead_teacher``, ``run_tokenizer``)."""
    if config.teachers:
        return list(config.teachers)
    return [TeacherSpec(name="teacher", model=config.teacher)] if config.teacher is not None else []


def dump(config: RunConfig) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)

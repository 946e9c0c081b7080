"""The one place user DeepSpeed configs become engine configs.

Users write configs the way DeepSpeed and Accelerate document them: JSON or HJSON with trailing commas
and ``"auto"`` values. Here they are loaded, every ``"auto"`` is filled from the run's
:class:`~distill_kit.config.TrainingConfig` and the model's hidden size (the same rules transformers
uses), and every config is checked against the run (below). Every problem is gathered and
reported at once, each with its fix, because DeepSpeed itself silently ignores misplaced keys such as
``"zero_optimization.stage3_prefetch_bucket_size"`` written at the top level.

The run config is the one truth about how a model learns: a value a DeepSpeed config states explicitly
(``lr``, ``betas``, ``eps``, ``weight_decay``, ``gradient_clipping``, the scheduler's numbers, ``bf16``/``fp16``)
must equal the run's, or it is an error naming both; one it leaves out is written in from the run, so that
DeepSpeed's own defaults (AdamW's betas, no clipping) never run behind the run config's back. The learning-rate
schedule is distill-kit's own (``engines/schedule.py``): a ``"scheduler"`` section is checked against the run
and then removed, so the engine config holds exactly what DeepSpeed is given.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hjson

from distill_kit.config import DeepSpeedSettings, TeacherSpec, TrainingConfig
from distill_kit.errors import DeepSpeedConfigError

logger = logging.getLogger(__name__)

AUTO = "auto"
ZERO_STAGES = (0, 1, 2, 3)
# DeepSpeed scheduler types, by the training.lr_schedule they describe; distill-kit runs the schedule itself.
SCHEDULER_TYPES = {"WarmupDecayLR": "linear", "WarmupCosineLR": "cosine", "WarmupLR": "constant"}

# Top-level keys DeepSpeed 0.19 reads. DeepSpeed ignores anything else without a word.
KNOWN_TOP_LEVEL_KEYS = frozenset(
    """
    train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer scheduler fp16 bf16
    amp torch_autocast gradient_clipping prescale_gradients gradient_predivide_factor sparse_gradients
    zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer steps_per_print
    wall_clock_breakdown memory_breakdown dump_state flops_profiler activation_checkpointing sparse_attention
    data_efficiency curriculum_learning tensorboard wandb csv_monitor comet elasticity communication_data_type
    seq_parallel_communication_data_type checkpoint data_types compression_training autotuning aio pipeline
    disable_allgather dataloader_drop_last graph_harvesting mics_shard_size mics_hierarchical_params_gather
    eigenvalue progressive_layer_drop quantize_training weight_quantization hybrid_engine timers compile
    nebula use_data_before_expert_parallelism tensor_parallel sequence_parallel_size expert_parallel
    vocabulary_size zenflow load_universal_checkpoint use_node_local_storage deepcompile
    """.split()
)


def load(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A config from a dict, or a JSON/HJSON file (trailing commas and comments are fine)."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    path = Path(source)
    if not path.is_file():
        raise DeepSpeedConfigError(f"DeepSpeed config {str(path)!r} does not exist; pass a JSON/HJSON file or a dict")
    try:
        loaded = hjson.loads(path.read_text())
    except (hjson.HjsonDecodeError, ValueError) as err:
        raise DeepSpeedConfigError(f"cannot parse DeepSpeed config {str(path)!r}: {err}") from err
    if not isinstance(loaded, Mapping):
        raise DeepSpeedConfigError(f"DeepSpeed config {str(path)!r} must be a JSON object, got {type(loaded).__name__}")
    return json.loads(json.dumps(loaded))  # plain dicts, not hjson's OrderedDicts


def zero_stage(config: Mapping[str, Any], name: str = "DeepSpeed config") -> int:
    """The config's ZeRO stage; anything but 0, 1, 2 or 3 is an error naming the key."""
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise DeepSpeedConfigError(f"{name}: zero_optimization.stage is {stage!r}; it must be one of 0, 1, 2, 3 "
                                   "(a number: 2 for the student, 3 to shard the teacher)")
    return int(stage)


def set_dotted(config: dict[str, Any], dotted_key: str, value: Any) -> None:
    """Write ``"zero_optimization.stage3_prefetch_bucket_size"`` as the nested key DeepSpeed reads."""
    *parents, leaf = dotted_key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise DeepSpeedConfigError(f"cannot set {dotted_key!r}: {part!r} is not a section")
    node[leaf] = value


def _check_keys(config: Mapping[str, Any], name: str) -> list[str]:
    problems = []
    for key in config:
        if "." in key:
            problems.append(
                f"{name}: key {key!r} is dotted; DeepSpeed ignores it. Nest it instead, e.g. "
                f'{{"{key.split(".")[0]}": {{"{key.split(".", 1)[1]}": ...}}}}'
            )
        elif key not in KNOWN_TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(key, KNOWN_TOP_LEVEL_KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "remove it"
            problems.append(f"{name}: unknown key {key!r} (DeepSpeed would ignore it); {hint}")
    return problems


def _fill(node: Any, path: str, values: Mapping[str, Any], missing: list[str]) -> Any:
    if isinstance(node, dict):
        return {key: _fill(value, f"{path}.{key}" if path else key, values, missing) for key, value in node.items()}
    if node == AUTO:
        if path in values:
            return values[path]
        missing.append(path)
    return node


def auto_values(training: TrainingConfig, hidden_size: int | None, world_size: int, stage: int = 3) -> dict[str, Any]:
    """The value each ``"auto"`` key takes, by its dotted path. ZeRO-3 sizes follow transformers' rules.

    Below stage 3, ``reduce_bucket_size`` is DeepSpeed's own default (5e8), not transformers' hidden²: for a
    0.5B student hidden² (0.8M) means hundreds of tiny gradient reductions per backward, and 5e8 is faster
    (benchmarks/RESULTS.md).
    """
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "train_batch_size": training.micro_batch_size * training.gradient_accumulation_steps * world_size,
        "gradient_clipping": training.max_grad_norm,
        "bf16.enabled": training.dtype == "bf16",
        "fp16.enabled": training.dtype == "fp16",
        "optimizer.params.lr": training.lr,
        "optimizer.params.weight_decay": training.weight_decay,
        "optimizer.params.betas": list(training.betas),
        "optimizer.params.eps": training.eps,
        # The scheduler section is only checked (distill-kit runs engines/schedule.py), so these are the run's.
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_min_ratio": 0.0,
        "scheduler.params.warmup_max_lr": training.lr,
        "scheduler.params.warmup_num_steps": training.warmup_steps,
        "scheduler.params.total_num_steps": training.max_steps,
        "scheduler.params.cos_min_ratio": training.min_lr_ratio,
        "zero_optimization.stage3_max_live_parameters": int(1e9),
        "zero_optimization.stage3_max_reuse_distance": int(1e9),
    }
    if hidden_size:
        values |= {
            "zero_optimization.reduce_bucket_size": hidden_size * hidden_size if stage == 3 else int(5e8),
            "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
        }
    return values


def resolve(
    config: Mapping[str, Any],
    training: TrainingConfig,
    *,
    hidden_size: int | None,
    world_size: int,
    name: str,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Fill one config; return it and its problems (empty when it is ready for ``deepspeed.initialize``)."""
    config = copy.deepcopy(dict(config))
    for dotted_key, value in (overrides or {}).items():
        set_dotted(config, dotted_key, value)
    problems = _check_keys(config, name)
    for precision in ("bf16", "fp16"):  # unstated precision follows the run, like "auto"
        config.setdefault(precision, {"enabled": AUTO})
    try:
        stage = zero_stage(config, name)
    except DeepSpeedConfigError as err:
        problems.append(str(err))
        stage = 0
    missing: list[str] = []
    config = _fill(config, "", auto_values(training, hidden_size, world_size, stage), missing)
    problems += [f"{name}: cannot fill '{path}: auto'; give it a value" for path in missing]
    return config, problems


def _batch_keys(training: TrainingConfig, world_size: int) -> dict[str, int]:
    return {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "train_batch_size": training.micro_batch_size * training.gradient_accumulation_steps * world_size,
    }


def _disagrees(name: str, key: str, value: Any, field: str, want: Any) -> str:
    return (f"{name}: {key} is {value!r} but the run's training.{field} is {want!r}; set {key} to \"auto\" "
            f"(or leave it out), or training.{field} to {value!r}")


def _same(value: Any, want: Any) -> bool:
    if isinstance(want, (tuple, list)):
        return isinstance(value, (tuple, list)) and list(value) == list(want)
    return not isinstance(value, bool) and value == want


def _check_precision(config: Mapping[str, Any], training: TrainingConfig, name: str) -> list[str]:
    enabled = {kind: config.get(kind, {}).get("enabled", False) for kind in ("bf16", "fp16")}
    if enabled["bf16"] is True and enabled["fp16"] is True:
        return [f'{name}: bf16 and fp16 are both enabled; set both "enabled" to "auto" to follow training.dtype '
                f"({training.dtype!r})"]
    return [f"{name}: {kind}.enabled is {on!r} but the run's training.dtype is {training.dtype!r}; set "
            f"{kind}.enabled to \"auto\" (or leave it out)" + (f", or training.dtype to {kind!r}" if on is True else "")
            for kind, on in enabled.items() if on != (training.dtype == kind)]


def _check_agrees(config: dict[str, Any], training: TrainingConfig, world_size: int, name: str) -> list[str]:
    """A trained model's config against the run: batch, precision, optimizer, clipping and schedule."""
    problems = [
        f"{name}: {key} is {config[key]} but the run uses {want}; set it to {want} or to \"auto\""
        for key, want in _batch_keys(training, world_size).items() if key in config and config[key] != want
    ]
    problems += _check_precision(config, training, name)
    if "gradient_clipping" in config and not _same(config["gradient_clipping"], training.max_grad_norm):
        problems.append(_disagrees(name, "gradient_clipping", config["gradient_clipping"], "max_grad_norm",
                                   training.max_grad_norm))
    params = config.get("optimizer", {}).get("params", {})
    for key, field in {"lr": "lr", "weight_decay": "weight_decay", "betas": "betas", "eps": "eps"}.items():
        if key in params and not _same(params[key], getattr(training, field)):
            problems.append(_disagrees(name, f"optimizer.params.{key}", params[key], field, getattr(training, field)))
    if "scheduler" in config:
        problems += _check_scheduler(config["scheduler"], training, name)
    return problems


def _check_scheduler(section: Any, training: TrainingConfig, name: str) -> list[str]:
    """A scheduler section must describe the run's schedule; distill-kit then runs it (engines/schedule.py)."""
    kind = SCHEDULER_TYPES.get(section.get("type")) if isinstance(section, Mapping) else None
    if kind is None:
        return [f"{name}: scheduler {section!r} is not a schedule distill-kit runs; remove the section (the run's "
                "training.lr_schedule, warmup_steps and min_lr_ratio set the schedule) or use type "
                + ", ".join(f"{t} ({k})" for t, k in SCHEDULER_TYPES.items())]
    problems = []
    if kind != training.lr_schedule:
        problems.append(f"{name}: scheduler type {section['type']} is a {kind} schedule but the run's "
                        f"training.lr_schedule is {training.lr_schedule!r}; set training.lr_schedule to {kind!r}, "
                        "or remove the scheduler section")
    expected = {"warmup_max_lr": "lr", "warmup_num_steps": "warmup_steps", "total_num_steps": "max_steps",
                "cos_min_ratio": "min_lr_ratio"}
    for key, value in dict(section.get("params", {})).items():
        if key in expected:
            if not _same(value, getattr(training, expected[key])):
                problems.append(_disagrees(name, f"scheduler.params.{key}", value, expected[key],
                                           getattr(training, expected[key])))
        elif key in ("warmup_min_lr", "warmup_min_ratio"):
            if value != 0:
                problems.append(f"{name}: scheduler.params.{key} is {value!r}, but warm-up starts from 0 "
                                "(engines/schedule.py); set it to 0 or \"auto\"")
        elif key == "warmup_type":
            if value != "linear":
                problems.append(f"{name}: scheduler.params.warmup_type is {value!r}; the warm-up is linear, "
                                "set it to \"linear\" or leave it out")
        else:
            problems.append(f"{name}: scheduler.params.{key} is not a setting of the run's schedule; remove it")
    return problems


def _fill_from_run(config: dict[str, Any], training: TrainingConfig) -> None:
    """Write the run's values where a trained model's config is silent, so DeepSpeed's defaults never apply."""
    config.setdefault("gradient_clipping", training.max_grad_norm)
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict):
        params = optimizer.setdefault("params", {})
        params.setdefault("lr", training.lr)
        params.setdefault("weight_decay", training.weight_decay)
        if "adam" in str(optimizer.get("type", "")).lower() or "lamb" in str(optimizer.get("type", "")).lower():
            params.setdefault("betas", list(training.betas))
            params.setdefault("eps", training.eps)


def _teacher_takes_run_batch(config: dict[str, Any], training: TrainingConfig, world_size: int, name: str) -> None:
    """A frozen teacher never uses its batch keys, but DeepSpeed wants them consistent: the run's replace them."""
    for key, want in _batch_keys(training, world_size).items():
        if key in config and config[key] != want:
            logger.warning("%s: %s %s replaced by the run's %s (a frozen teacher does not use it)",
                           name, key, config[key], want)
            config[key] = want
    config.setdefault("train_micro_batch_size_per_gpu", training.micro_batch_size)


@dataclass(frozen=True)
class TrainedConfig:
    """A trained model's DeepSpeed config as the user gave it, and what its ``"auto"`` values come from."""

    source: str | Path | Mapping[str, Any]
    training: TrainingConfig
    """This model's settings; models trained together share the batch settings, so only lr may differ."""
    hidden_size: int | None
    overrides: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class FrozenConfig:
    """A frozen teacher's DeepSpeed config as the user gave it; its batch and precision are the run's."""

    source: str | Path | Mapping[str, Any]
    hidden_size: int | None
    overrides: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, spec: TeacherSpec, hidden_size: int | None, settings: DeepSpeedSettings,
           implied: Mapping[str, Any] | None = None) -> FrozenConfig:
        """``spec``'s config: its own ``ds_config`` or the run's teacher one, under the run's teacher overrides, its
        own, then ``implied`` (what the run's residency needs). The plan and offline capture both take a teacher's
        config from here and fill it with :func:`prepare`, so a teacher's engine is configured one way, whether it
        teaches or fills a store."""
        return cls(spec.ds_config or settings.teacher, hidden_size,
                   {**settings.teacher_overrides, **spec.ds_overrides, **(implied or {})})


def prepare(
    trained: Mapping[str, TrainedConfig],
    frozen: Mapping[str, FrozenConfig],
    *,
    world_size: int,
    labels: Mapping[str, str] | None = None,
    training: TrainingConfig | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every trained model's engine config and every frozen teacher's, by the same keys.

    All configs are filled and checked together, and one error lists every problem of every config: a
    run of several models should not fail on the second one's typo after the first has loaded. Keys name the
    models in the messages (``"student"`` gives "student DeepSpeed config: ..."). A teacher is never trained, but
    DeepSpeed still refuses an engine without ``train_micro_batch_size_per_gpu``, so it takes the run's batch keys
    (a value of its own is replaced, with a warning: a frozen engine never uses it); its precision must be the
    run's, like every trained model's. ``labels`` names a key's model in the messages instead of the key.
    ``training``: the settings the teachers follow; None: the first trained model's (a capture, which trains
    nothing, gives its own).
    """
    labels = labels or {}
    configs: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for label, request in trained.items():
        name = f"{labels.get(label, label)} DeepSpeed config"
        config, found = resolve(load(request.source), request.training, hidden_size=request.hidden_size,
                                world_size=world_size, name=name, overrides=request.overrides)
        if "optimizer" not in config:
            found.append(
                f'{name}: no "optimizer" section; add e.g. '
                '{"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}'
            )
        _fill_from_run(config, request.training)
        found += _check_agrees(config, request.training, world_size, name)
        config.pop("scheduler", None)  # checked against the run above; build.py runs engines/schedule.py
        configs[label] = config
        problems += found
    teachers: dict[str, dict[str, Any]] = {}
    training = training or (next(iter(trained.values())).training if trained else None)
    for label, request in frozen.items():
        name = f"{labels.get(label, label)} DeepSpeed config"
        config, found = resolve(load(request.source), training, hidden_size=request.hidden_size,
                                world_size=world_size, name=name, overrides=request.overrides)
        _teacher_takes_run_batch(config, training, world_size, name)
        config.pop("optimizer", None)  # a frozen engine needs none; DeepSpeed would build one
        config.pop("scheduler", None)
        problems += found + _check_precision(config, training, name)
        teachers[label] = config
    if problems:
        raise DeepSpeedConfigError("DeepSpeed config problems:\n  - " + "\n  - ".join(problems))
    return configs, teachers


def prepare_group(
    trained: Mapping[str, TrainedConfig],
    teacher: str | Path | Mapping[str, Any] | None,
    *,
    teacher_hidden_size: int | None,
    world_size: int,
    teacher_overrides: Mapping[str, Any] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """:func:`prepare` for trained models and at most one teacher (None without one)."""
    frozen = {} if teacher is None else {"teacher": FrozenConfig(teacher, teacher_hidden_size, teacher_overrides)}
    configs, teachers = prepare(trained, frozen, world_size=world_size)
    return configs, teachers.get("teacher")


def prepare_pair(
    student: str | Path | Mapping[str, Any],
    teacher: str | Path | Mapping[str, Any],
    training: TrainingConfig,
    *,
    student_hidden_size: int | None,
    teacher_hidden_size: int | None,
    world_size: int,
    student_overrides: Mapping[str, Any] | None = None,
    teacher_overrides: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The student's and the teacher's engine configs, filled and checked together (see :func:`prepare_group`)."""
    students, teacher_cfg = prepare_group(
        {"student": TrainedConfig(student, training, student_hidden_size, student_overrides)}, teacher,
        teacher_hidden_size=teacher_hidden_size, world_size=world_size, teacher_overrides=teacher_overrides,
    )
    return students["student"], teacher_cfg

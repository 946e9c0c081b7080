"""The one place user DeepSpeed configs become engine configs.

Users write configs the way DeepSpeed and Accelerate document them: JSON or HJSON with trailing commas
and ``"auto"`` values. Here they are loaded, every ``"auto"`` is filled from the run's
:class:`~distill_kit.training.config.TrainingConfig` and the model's hidden size (the same rules transformers
uses), and the student and teacher configs are checked against each other. Every problem is gathered and
reported at once, each with its fix, because DeepSpeed itself silently ignores misplaced keys such as
``"zero_optimization.stage3_prefetch_bucket_size"`` written at the top level.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hjson

from distill_kit.training.config import TrainingConfig

AUTO = "auto"

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


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that cannot drive an engine; the message lists every problem and its fix."""


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


def zero_stage(config: Mapping[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


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
    0.5B student hidden² (0.8M) means ~600 tiny gradient reductions per backward, and 5e8 measured 5.6%
    more tokens/s on 2xH200 (benchmarks/RESULTS.md).
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
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_max_lr": training.lr,
        # DeepSpeed's warmup schedulers reject 0 steps (and use at least 2).
        "scheduler.params.warmup_num_steps": max(1, training.warmup_steps),
        "scheduler.params.total_num_steps": training.max_steps,
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
    missing: list[str] = []
    config = _fill(config, "", auto_values(training, hidden_size, world_size, zero_stage(config)), missing)
    problems += [f"{name}: cannot fill '{path}: auto'; give it a value" for path in missing]
    return config, problems


def _check_agrees(config: dict[str, Any], training: TrainingConfig, world_size: int, name: str) -> list[str]:
    problems = []
    expected = {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "train_batch_size": training.micro_batch_size * training.gradient_accumulation_steps * world_size,
    }
    for key, want in expected.items():
        if key in config and config[key] != want:
            problems.append(
                f"{name}: {key} is {config[key]} but the run uses {want}; set it to {want} or to \"auto\""
            )
    return problems


@dataclass(frozen=True)
class TrainedConfig:
    """A trained model's DeepSpeed config as the user gave it, and what its ``"auto"`` values come from."""

    source: str | Path | Mapping[str, Any]
    training: TrainingConfig
    """This model's settings; models trained together share the batch settings, so only lr may differ."""
    hidden_size: int | None
    overrides: Mapping[str, Any] | None = None


def prepare_group(
    trained: Mapping[str, TrainedConfig],
    teacher: str | Path | Mapping[str, Any] | None,
    *,
    teacher_hidden_size: int | None,
    world_size: int,
    teacher_overrides: Mapping[str, Any] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Every trained model's engine config, and the frozen teacher's (None without a teacher).

    All configs are filled and checked together, and one error lists every problem of every config: a
    run of several models should not fail on the second one's typo after the first has loaded. Keys of
    ``trained`` name the models in the messages (``"student"`` gives "student DeepSpeed config: ...").
    The teacher is never trained, but DeepSpeed still refuses an engine without
    ``train_micro_batch_size_per_gpu``, so it inherits the run's; its batch keys must agree with the
    run's, since every engine sees the same micro-batches.
    """
    configs: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for label, request in trained.items():
        name = f"{label} DeepSpeed config"
        config, found = resolve(load(request.source), request.training, hidden_size=request.hidden_size,
                                world_size=world_size, name=name, overrides=request.overrides)
        found += _check_agrees(config, request.training, world_size, name)
        if "optimizer" not in config:
            found.append(
                f'{name}: no "optimizer" section; add e.g. '
                '{"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}'
            )
        configs[label] = config
        problems += found
    teacher_cfg = None
    if teacher is not None:
        training = next(iter(trained.values())).training
        name = "teacher DeepSpeed config"
        teacher_cfg, found = resolve(load(teacher), training, hidden_size=teacher_hidden_size,
                                     world_size=world_size, name=name, overrides=teacher_overrides)
        teacher_cfg.setdefault("train_micro_batch_size_per_gpu", training.micro_batch_size)
        teacher_cfg.pop("optimizer", None)  # a frozen engine needs none; DeepSpeed would build one
        teacher_cfg.pop("scheduler", None)
        problems += found + _check_agrees(teacher_cfg, training, world_size, name)
        problems += [
            f"{label} and teacher DeepSpeed configs disagree on precision (bf16, fp16): {label} "
            f"{_precision(config)}, teacher {_precision(teacher_cfg)}; set both to \"auto\""
            for label, config in configs.items() if _precision(config) != _precision(teacher_cfg)
        ]
    if problems:
        raise DeepSpeedConfigError("DeepSpeed config problems:\n  - " + "\n  - ".join(problems))
    return configs, teacher_cfg


def _precision(config: Mapping[str, Any]) -> tuple[bool, bool]:
    return config.get("bf16", {}).get("enabled", False), config.get("fp16", {}).get("enabled", False)


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

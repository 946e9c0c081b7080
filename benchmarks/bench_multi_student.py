"""Two (or N) students sharing one teacher forward against the same students in separate runs.

Both sides train the same students (same models, losses, configs, learning rates) on the same batches for
the same steps; the shared side is one one :class:`Distiller` of several students, the separate side one
:class:`Distiller` per student, run one after another, as a user without the shared mode would. Each
side is timed after ``warmup`` steps and reports student tokens/s (non-padding input tokens each student
trained on, summed over students and ranks, per second), the teacher forwards it ran, and peak memory.

GPU (2 GPUs; random-initialised models of a benchmark pair, or save_pretrained directories)::

    torchrun --nproc_per_node 2 benchmarks/bench_multi_student.py --pair qwen2-7b-0.5b --student a --student b \\
        --micro-batch 8 --out runs/multi
    torchrun --nproc_per_node 2 benchmarks/bench_multi_student.py --teacher T --student small=S1 --student big=S2 ...

CPU smoke (what the test suite runs, through :func:`compare`): tiny GPT-2s, 2 gloo ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pairs
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn
from transformers import AutoConfig

from distill_kit import DeepSpeedSettings, Distiller, TrainingConfig
from distill_kit.config import CONFIG_DIR, StudentSpec
from distill_kit.distiller import Batch
from distill_kit.engines import deepspeed_config, distributed
from distill_kit.engines.models import ModelSource

Source = ModelSource | Callable[[], nn.Module]
"""A path or hub name, or a factory of fresh modules: one built module cannot be wrapped by two engines."""


def _build(source: Source) -> ModelSource:
    return source() if callable(source) and not isinstance(source, nn.Module) else source


def _timed(trainer: Distiller, batches: list[Batch], warmup: int) -> dict[str, float]:
    """Seconds of the steps after ``warmup``, the teacher forwards they ran, and this run's peak memory."""
    teacher = getattr(trainer.teacher, "module", trainer.teacher)
    forwards = [0]
    hook = teacher.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    accelerator = get_accelerator()
    trainer.train(batches, until=warmup)
    accelerator.synchronize()
    torch.distributed.barrier()
    forwards[0] = 0
    start = time.perf_counter()
    trainer.train(batches)
    accelerator.synchronize()
    seconds = distributed.all_reduce_sum(torch.tensor(time.perf_counter() - start)).item() / distributed.world_size()
    hook.remove()
    peak = accelerator.max_memory_allocated() / 2**30 if accelerator.device_name() != "cpu" else 0.0
    return {"seconds": seconds, "teacher_forwards": forwards[0], "peak_gib": peak}


def _release() -> None:
    gc.collect()
    get_accelerator().empty_cache()
    if get_accelerator().device_name() != "cpu":
        get_accelerator().reset_peak_memory_stats()


def compare(
    teacher: Source,
    students: Sequence[StudentSpec],
    batches: list[Batch],
    training: TrainingConfig,
    *,
    warmup: int = 1,
    teacher_ds_config: Any = CONFIG_DIR / "zero3_teacher.json",
    student_ds_config: Any = CONFIG_DIR / "zero2_student.json",
) -> dict[str, Any]:
    """Shared-teacher vs separate runs of ``students``; ``batches`` are this rank's micro-batches.

    ``training.max_steps`` is the steps each side runs; the first ``warmup`` are not timed. A student's
    ``model`` may be a factory (see :data:`Source`), called once per side.
    """
    timed_steps = training.max_steps - warmup
    if timed_steps < 1:
        raise ValueError(f"max_steps ({training.max_steps}) must exceed warmup ({warmup}) to time anything")
    gas = training.gradient_accumulation_steps  # the timed steps read on from the warm-up's micro-batches
    timed = [batches[i % len(batches)] for i in range(warmup * gas, training.max_steps * gas)]
    local_tokens = sum(int(b["attention_mask"].sum()) for b in timed)
    tokens = distributed.all_reduce_sum(torch.tensor(float(local_tokens))).item() * len(students)

    shared = Distiller(teacher=_build(teacher), students=[replace(spec, model=_build(spec.model)) for spec in students],
                       training=training, teacher_ds_config=teacher_ds_config, student_ds_config=student_ds_config)
    shared_run = _timed(shared, batches, warmup)
    del shared
    _release()
    separate_runs = {}
    for spec in students:
        alone = Distiller(_build(spec.model), _build(teacher), loss=spec.loss, training=spec.training(training),
                          deepspeed=DeepSpeedSettings(student=spec.ds_config or student_ds_config,
                                                      teacher=teacher_ds_config,
                                                      student_overrides=dict(spec.ds_overrides)))
        separate_runs[spec.name] = _timed(alone, batches, warmup)
        del alone
        _release()
    separate_seconds = sum(run["seconds"] for run in separate_runs.values())
    return {
        "students": [spec.name for spec in students],
        "timed_steps": timed_steps,
        "shared": shared_run | {"tokens_per_s": tokens / shared_run["seconds"]},
        "separate": {
            "seconds": separate_seconds,
            "teacher_forwards": sum(run["teacher_forwards"] for run in separate_runs.values()),
            "peak_gib": max(run["peak_gib"] for run in separate_runs.values()),
            "tokens_per_s": tokens / separate_seconds,
            "runs": separate_runs,
        },
        "speedup": separate_seconds / shared_run["seconds"],
    }


def _random_batches(count: int, micro_batch: int, length: int, vocab: int, seed: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (micro_batch, length), generator=generator) for _ in range(count)]
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()} for x in ids]


def _pair_sources(name: str, training: TrainingConfig, device: torch.device) -> tuple[Source, Source, dict, dict]:
    """Factories of random-initialised models of a benchmark pair (``pairs.py``), and their filled configs: a
    7B teacher saved to disk only to be read back would cost minutes per side."""
    pair = pairs.PAIRS[name]
    student_cfg, teacher_cfg = deepspeed_config.prepare_pair(
        CONFIG_DIR / "zero2_student.json", CONFIG_DIR / "zero3_teacher.json", training,
        student_hidden_size=pair.student.hidden_size, teacher_hidden_size=pair.teacher.hidden_size,
        world_size=distributed.world_size(),
    )
    teacher = partial(pairs.build, pair.teacher, teacher_cfg, training.dtype, device, "sdpa")
    student = partial(pairs.build, pair.student, student_cfg, training.dtype, device, "sdpa")
    return teacher, student, teacher_cfg, student_cfg


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=sorted(pairs.PAIRS),
                        help="random-initialised models of a benchmark pair, instead of --teacher/--student")
    parser.add_argument("--teacher", help="save_pretrained directory or hub name")
    parser.add_argument("--student", action="append", metavar="NAME=PATH",
                        help="a student (repeat for several); with --pair, NAME alone (each a copy of the pair's)")
    parser.add_argument("--loss", default="forward_kl")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps, after the warm-up")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.student or (args.pair is None) == (args.teacher is None):
        parser.error("give --student (repeated) and either --pair or --teacher")
    device = distributed.init()
    training = TrainingConfig(max_steps=args.warmup + args.steps, micro_batch_size=args.micro_batch,
                              dtype=args.dtype, log_every=10**9)
    configs: dict[str, Any] = {}
    if args.pair:
        teacher, student, configs["teacher_ds_config"], configs["student_ds_config"] = _pair_sources(
            args.pair, training, device)
        students = [StudentSpec(entry.partition("=")[0], student, args.loss) for entry in args.student]
        vocab = pairs.PAIRS[args.pair].student.vocab_size
    else:
        teacher = args.teacher
        students = [StudentSpec(name, path, args.loss) for name, _, path in (s.partition("=") for s in args.student)]
        vocab = AutoConfig.from_pretrained(args.student[0].partition("=")[2]).vocab_size
    batches = _random_batches(training.max_steps, args.micro_batch, args.seq_len, vocab, seed=distributed.rank())
    result = compare(teacher, students, batches, training, warmup=args.warmup, **configs)
    if distributed.is_main():
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "multi_student.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

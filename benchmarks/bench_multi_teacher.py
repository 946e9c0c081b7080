"""What a second teacher costs: step time and peak memory of one student taught by 1 or N teachers.

Every teacher runs its forward every micro-batch, so the teacher share of the step grows with N. One mode per
process (peak memory is the process's): ``one`` (a Distiller), ``sum`` or ``mixture`` (a Distiller of several teachers
with ``--teachers`` copies of the teacher, equal weights). Reports the median step seconds after ``--warmup``
steps, the median CPU seconds this process spent per step (steadier than wall time on a shared CPU machine),
student tokens/s, and the process's peak resident memory (CPU) or peak accelerator memory.

CPU (the embedded default's shipped teacher and its default student shape)::

    for mode in one sum mixture; do python benchmarks/bench_multi_teacher.py --mode $mode --out runs/bench_mt; done
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator
from transformers import AutoConfig, AutoModelForCausalLM

from distill_kit import Distiller, TrainingConfig
from distill_kit.engines import distributed
from distill_kit.run.run_config import DEFAULT_STUDENT_INIT, DEFAULT_TEACHER


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["one", "sum", "mixture"], required=True)
    parser.add_argument("--teacher", default=str(DEFAULT_TEACHER))
    parser.add_argument("--teachers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    distributed.init()
    config = AutoConfig.from_pretrained(args.teacher)
    config.update(DEFAULT_STUDENT_INIT)
    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_config(config)
    training = TrainingConfig(max_steps=args.steps, micro_batch_size=args.micro_batch, lr=1e-3, warmup_steps=0)
    if args.mode == "one":
        distiller = Distiller(student, args.teacher, training=training)
    else:
        teachers = [{"name": f"t{i}", "model": args.teacher} for i in range(args.teachers)]
        distiller = Distiller(student, teachers=teachers, combine=args.mode, training=training)
    generator = torch.Generator().manual_seed(distributed.rank())
    batches = [{"input_ids": (ids := torch.randint(0, config.vocab_size, (args.micro_batch, args.length),
                                                   generator=generator)),
                "attention_mask": torch.ones_like(ids), "labels": ids} for _ in range(args.steps)]
    seconds, cpu_seconds = [], []
    for step in range(1, args.steps + 1):
        started, cpu_started = time.perf_counter(), time.process_time()
        distiller.train(batches, until=step)
        seconds.append(time.perf_counter() - started)
        cpu_seconds.append(time.process_time() - cpu_started)
    accelerator = get_accelerator()
    median = statistics.median(seconds[args.warmup:])
    result = {
        "mode": args.mode, "teachers": 1 if args.mode == "one" else args.teachers,
        "world_size": distributed.world_size(), "median_step_s": median,
        "median_step_cpu_s": statistics.median(cpu_seconds[args.warmup:]),
        "student_tokens_per_s": args.micro_batch * args.length * distributed.world_size() / median,
        "peak_memory_mib": (accelerator.max_memory_allocated() / 2**20 if accelerator.device_name() != "cpu"
                            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    if distributed.is_main():
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.mode}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result))


if __name__ == "__main__":
    main()

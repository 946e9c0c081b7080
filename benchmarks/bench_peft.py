"""A LoRA student against the same student trained whole: trained parameters, optimizer state, checkpoint size,
step time.

Both sides distil the same teacher into the same pretrained student on the same batches; the LoRA side trains
adapters (``peft``) on the frozen student. Reported per side: trained and frozen parameter counts, the elements
the ZeRO-2 optimizer holds on this rank (fp32 master copy and each Adam moment), the bytes of one checkpoint on
disk, and the median seconds of an optimizer step after ``--warmup`` steps.

CPU (the embedded default's shipped teacher as both teacher and student: a good model distilled further)::

    python benchmarks/bench_peft.py --out runs/bench_peft
    torchrun --nproc_per_node 2 benchmarks/bench_peft.py --out runs/bench_peft --r 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from distill_kit import Distiller, TrainingConfig
from distill_kit.engines import distributed, peft_student
from distill_kit.run.run_config import DEFAULT_TEACHER


def measure(teacher: str, student: str, peft: dict | None, steps: int, warmup: int, micro_batch: int,
            length: int, out: Path) -> dict:
    training = TrainingConfig(max_steps=steps, micro_batch_size=micro_batch, lr=1e-4, warmup_steps=0)
    distiller = Distiller(student, teacher, training=training, peft=peft)
    vocab = distiller.student_model.config.vocab_size
    generator = torch.Generator().manual_seed(distributed.rank())
    batches = [{"input_ids": (ids := torch.randint(0, vocab, (micro_batch, length), generator=generator)),
                "attention_mask": torch.ones_like(ids), "labels": ids} for _ in range(steps)]
    seconds = []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        distiller.train(batches, until=step)
        seconds.append(time.perf_counter() - started)
    optimizer = distiller.student.optimizer
    states = [s for s in optimizer.optimizer.state.values()]
    path = distiller.save(out / ("lora" if peft else "full"))
    return {
        **peft_student.parameter_counts(distiller.student.module),
        "optimizer_fp32_master_on_rank": sum(p.numel() for p in optimizer.single_partition_of_fp32_groups),
        "adam_moments_on_rank": sum(v.numel() for s in states for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")),
        "checkpoint_bytes": sum(p.stat().st_size for p in path.rglob("*") if p.is_file()),
        "median_step_s": statistics.median(seconds[warmup:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", default=str(DEFAULT_TEACHER))
    parser.add_argument("--student", default=str(DEFAULT_TEACHER))
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    distributed.init()
    common = dict(steps=args.steps, warmup=args.warmup, micro_batch=args.micro_batch, length=args.length,
                  out=args.out)
    results = {"full": measure(args.teacher, args.student, None, **common),
               f"lora_r{args.r}": measure(args.teacher, args.student, {"r": args.r, "alpha": 2.0 * args.r}, **common)}
    results["world_size"] = distributed.world_size()
    if distributed.is_main():
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_peft.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

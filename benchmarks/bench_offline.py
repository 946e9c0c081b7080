"""Offline distillation speed: a student trained from a captured teacher store against the live ZeRO-3 teacher.

In one launch, on the same GPUs, with the same student, data, loss and micro-batch:

1. ``online``: ZeRO-2 student + ZeRO-3 teacher (the Distiller's defaults), the teacher's forward every step;
2. ``capture``: the same ZeRO-3 teacher run once over exactly the blocks the timed runs read, into a store
   (``distill_kit/offline/capture.py``): its tokens/s and bytes per token on disk;
3. ``offline``: the same student trained from that store (``CapturedTeacher``): no teacher weights and no
   teacher forward, only reads of the top-k rows.

Both training runs are the real Distiller with per-phase clocks (``phases.TimedDistiller``), so the
"teacher_forward" phase of the offline run is the time spent reading the store. Results go to
``OUT/offline.json`` and ``OUT/offline.md``.

GPU (2x H200), the benchmark's pair (Qwen2-7B-shaped teacher, Qwen2-0.5B-shaped student, 151,936 ids)::

    torchrun --nproc_per_node 2 benchmarks/bench_offline.py --out runs/offline

CPU smoke (what the test suite runs)::

    torchrun --nproc_per_node 2 benchmarks/bench_offline.py --pair tiny --seq-len 32 --micro-batch 2 \\
        --warmup 1 --steps 2 --k 8 --dtype fp32 --out /tmp/offline
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import datasets
import deepspeed
import pairs  # this and phases: siblings in benchmarks/, on the path when the script runs
import torch
from phases import TimedDistiller

from distill_kit import TrainingConfig
from distill_kit.config import CONFIG_DIR
from distill_kit.data.blocks import BlockLoader
from distill_kit.engines import deepspeed_config, distributed
from distill_kit.offline.capture import CaptureConfig, capture
from distill_kit.offline.captured_teacher import CapturedTeacher

GIB = 2**30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(pairs.PAIRS), default="qwen2-7b-0.5b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--k", type=int, default=64, help="top tokens kept per position in the store")
    parser.add_argument("--values-dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    parser.add_argument("--no-tail", dest="tail_bucket", action="store_false",
                        help="renormalise over the top k instead of keeping the tail bucket")
    parser.add_argument("--loss", default="forward_kl")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--store", type=Path, help="where the store goes (default OUT/store)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def random_blocks(count: int, length: int, vocab: int, seed: int) -> datasets.Dataset:
    """Full-length random sequences as a block dataset: step time depends on shapes, not on the text."""
    ids = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(seed))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                       "labels": ids.tolist()})


def timed(teacher: Any, student_cfg: dict, teacher_cfg: dict, args: argparse.Namespace, training: TrainingConfig,
          batches: list[dict], device: torch.device) -> dict[str, Any]:
    """Train the benchmark's student for warm-up + timed steps against ``teacher``; tokens/s and phases."""
    cuda = device.type == "cuda"
    student = pairs.build(pairs.PAIRS[args.pair].student, student_cfg, args.dtype, device, "sdpa")
    distiller = TimedDistiller(student, teacher, loss={"name": args.loss}, training=training,
                               student_ds_config=student_cfg, teacher_ds_config=teacher_cfg)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    history = distiller.train(batches)
    distiller.clock.finish()
    summary = distiller.clock.summary(skip=args.warmup)
    tokens = args.micro_batch * args.seq_len
    result = {"tokens_per_s_per_gpu": tokens / (summary["step_ms"] / 1e3),
              "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
              "losses": [h["loss"] for h in history], **summary}
    for engine in (distiller.student, distiller.teacher):
        if isinstance(engine, deepspeed.DeepSpeedEngine):
            engine.destroy()
    del distiller, student
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> None:
    args = parse_args()
    device = distributed.init()
    pair, world, rank = pairs.PAIRS[args.pair], distributed.world_size(), distributed.rank()
    store = args.store or args.out / "store"
    training = TrainingConfig(max_steps=args.warmup + args.steps, micro_batch_size=args.micro_batch, dtype=args.dtype,
                              lr=1e-5, log_every=10**9)
    student_cfg, teacher_cfg = deepspeed_config.prepare_pair(
        CONFIG_DIR / "zero2_student.json", CONFIG_DIR / "zero3_teacher.json", training,
        student_hidden_size=pair.student.hidden_size, teacher_hidden_size=pair.teacher.hidden_size, world_size=world,
    )
    blocks = random_blocks(world * args.micro_batch * training.max_steps, args.seq_len, pair.student.vocab_size,
                           args.seed)
    batches = list(BlockLoader(blocks, args.micro_batch, rank=rank, world_size=world, shuffle=False))

    online = timed(pairs.build(pair.teacher, teacher_cfg, args.dtype, device, "sdpa"), student_cfg, teacher_cfg,
                   args, training, batches, device)
    gc.collect()
    teacher = pairs.build(pair.teacher, teacher_cfg, args.dtype, device, "sdpa")
    manifest = capture(teacher, None, blocks, store,
                       CaptureConfig(k=args.k, values_dtype=args.values_dtype, micro_batch_size=args.micro_batch,
                                     dtype=args.dtype), ds_config=teacher_cfg)
    del teacher
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    captured = CapturedTeacher(store, k=args.k, tail_bucket=args.tail_bucket)
    offline = timed(captured, student_cfg, teacher_cfg, args, training, batches, device)

    stats = manifest.stats
    result = {
        "meta": {"pair": args.pair, "description": pair.description, "world_size": world, "seq_len": args.seq_len,
                 "micro_batch": args.micro_batch, "k": args.k, "values_dtype": args.values_dtype,
                 "tail_bucket": args.tail_bucket, "dtype": args.dtype, "loss": args.loss,
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "command": f"torchrun --nproc_per_node {world} " + shlex.join(sys.argv)},
        "online": online,
        "capture": {**stats, "tokens_per_s_per_gpu": stats["tokens"] / world / stats["capture_s"]},
        "offline": offline,
        "offline_over_online": offline["tokens_per_s_per_gpu"] / online["tokens_per_s_per_gpu"],
    }
    if distributed.is_main():
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offline.json").write_text(json.dumps(result, indent=2))
        (args.out / "offline.md").write_text(table(result))
        print(table(result))


def table(result: dict[str, Any]) -> str:
    meta, capture_stats = result["meta"], result["capture"]
    return "\n".join([
        f"{meta['description']}, {meta['world_size']} x {meta['device']}, {meta['micro_batch']} x {meta['seq_len']} "
        f"tokens per micro-batch, {meta['dtype']}, {meta['loss']}; store k = {meta['k']} ({meta['values_dtype']} "
        f"values, tail bucket {meta['tail_bucket']}). `{meta['command']}`",
        "",
        "| run | tokens/s/GPU | step ms | teacher (or store read) ms | peak GiB |",
        "|---|---|---|---|---|",
        *(f"| {name} | {run['tokens_per_s_per_gpu']:,.0f} | {run['step_ms']:.1f} | "
          f"{run['phase_ms']['teacher_forward']:.1f} | "
          f"{'-' if run['peak_allocated_gib'] is None else format(run['peak_allocated_gib'], '.1f')} |"
          for name, run in (("online (ZeRO-3 teacher)", result["online"]), ("offline (store)", result["offline"]))),
        "",
        f"offline / online: {result['offline_over_online']:.2f}x. "
        f"Capture: {capture_stats['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
        f"{capture_stats['bytes_per_token']:.1f} bytes/token on disk "
        f"({capture_stats['top_k_bytes_per_token']:.1f} of them top-k values, ids and tail).",
        "",
    ])


if __name__ == "__main__":
    main()

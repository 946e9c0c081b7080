"""On-policy distillation speed: the student's generation, and a whole on-policy step against an off-policy one.

Two measurements, on random-initialised models (speed depends on shapes, not weights; see ``pairs.py``):

* ``generate``: new tokens/s per GPU of the student's sampler (``training/on_policy.py``: HF ``generate`` on the
  bare model), ``--prompt-len`` prompt tokens and ``--new-tokens`` sampled tokens per row (a random model almost
  never samples its end token, so every row runs to the end), static and dynamic KV cache, at each
  ``--gen-batch``;
* ``step``: the Distiller with its ZeRO-2 student and ZeRO-3 teacher on rows of ``prompt + answer``: off-policy
  (the data's answers) and on-policy (fraction 1: the student samples the answers, the teacher scores them).
  Reported per GPU: trained tokens/s (answer tokens the loss counts, and all tokens forwarded), and the share of
  the on-policy step spent generating.

GPU (one command per machine; results in benchmarks/RESULTS.md)::

    torchrun --nproc_per_node 2 benchmarks/bench_on_policy.py --pair qwen2-7b-0.5b --out runs/on_policy

CPU smoke::

    python benchmarks/bench_on_policy.py --pair tiny --prompt-len 8 --new-tokens 8 --gen-batch 2 --micro-batch 2 \\
        --warmup 1 --steps 1 --dtype fp32 --out /tmp/bench_on_policy
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pairs
import torch

from distill_kit import Distiller, TrainingConfig
from distill_kit.distiller import CONFIG_DIR
from distill_kit.engines import deepspeed_config, distributed
from distill_kit.training.on_policy import OnPolicyConfig, Sampler


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts(batch: int, length: int, vocab: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, vocab, (batch, length), generator=generator).to(device))


def measure_generation(args, device: torch.device) -> list[dict]:
    """New tokens/s of the student's sampler at each batch, static and dynamic cache (first call warms up)."""
    pair = pairs.PAIRS[args.pair]
    model = pairs.build(pair.student, {}, args.dtype, device, "sdpa").eval()
    results = []
    for batch in args.gen_batch:
        for cache in ("static", "dynamic"):
            config = OnPolicyConfig(fraction=1.0, max_new_tokens=args.new_tokens, temperature=1.0, cache=cache,
                                    eos_token_id=pair.student.vocab_size - 1, pad_token_id=0)
            sampler = Sampler(config, lambda: model)
            rows = prompts(batch, args.prompt_len, pair.student.vocab_size, args.seed, device)
            sampler.generate(rows)  # warm-up (and compilation, for the static cache)
            sync(device)
            started = time.perf_counter()
            samples = sampler.generate(rows)
            sync(device)
            seconds = time.perf_counter() - started
            new = sum(len(s) for s in samples)
            results.append({"batch": batch, "cache": cache, "new_tokens": new, "seconds": seconds,
                            "new_tokens_per_s": new / seconds})
            print(json.dumps(results[-1]), flush=True)
    return results


class Timed(Distiller):
    """The Distiller, with the time spent in ``make_batch`` (the sampling) added up."""

    make_batch_s = 0.0

    def make_batch(self, batch):
        sync(self.device)
        started = time.perf_counter()
        made = super().make_batch(batch)
        sync(self.device)
        self.make_batch_s += time.perf_counter() - started
        return made


def measure_step(args, device: torch.device, on_policy: bool) -> dict:
    pair = pairs.PAIRS[args.pair]
    sampling = OnPolicyConfig(fraction=1.0 if on_policy else 0.0, max_new_tokens=args.new_tokens, temperature=1.0,
                              eos_token_id=pair.student.vocab_size - 1, pad_token_id=0)
    training = TrainingConfig(max_steps=args.warmup + args.steps, micro_batch_size=args.micro_batch, dtype=args.dtype,
                              lr=1e-5, log_every=10**9, on_policy=sampling)
    student_cfg, teacher_cfg = deepspeed_config.prepare_pair(
        CONFIG_DIR / "zero2_student.json", CONFIG_DIR / "zero3_teacher.json", training,
        student_hidden_size=pair.student.hidden_size, teacher_hidden_size=pair.teacher.hidden_size,
        world_size=distributed.world_size())
    teacher = pairs.build(pair.teacher, teacher_cfg, args.dtype, device, "sdpa")
    student = pairs.build(pair.student, student_cfg, args.dtype, device, "sdpa")
    distiller = Timed(student, teacher, loss="forward_kl", training=training, student_ds_config=student_cfg,
                      teacher_ds_config=teacher_cfg)
    length = args.prompt_len + args.new_tokens
    generator = torch.Generator().manual_seed(args.seed + distributed.rank())
    batches = []
    for _ in range(training.max_steps):
        ids = torch.randint(1, pair.student.vocab_size - 1, (args.micro_batch, length), generator=generator)
        labels = ids.clone()
        labels[:, :args.prompt_len] = -100  # the prompt; on-policy replaces the answer with a sample
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    distiller.train(batches, until=args.warmup)
    distiller.make_batch_s = 0.0
    sync(device)
    started = time.perf_counter()
    distiller.train(batches)
    sync(device)
    seconds = (time.perf_counter() - started) / args.steps
    result = {"mode": "on-policy" if on_policy else "off-policy", "micro_batch": args.micro_batch,
              "step_s": seconds, "answer_tokens_per_s_per_gpu": args.micro_batch * args.new_tokens / seconds,
              "tokens_per_s_per_gpu": args.micro_batch * length / seconds,
              "generating_share": distiller.make_batch_s / args.steps / seconds}
    for engine in (distiller.student, distiller.teacher):
        if hasattr(engine, "destroy"):
            engine.destroy()
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(pairs.PAIRS), default="qwen2-7b-0.5b")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--gen-batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], choices=["generate", "step"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = distributed.init()
    results = {"command": " ".join(sys.argv), "world_size": distributed.world_size(),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if "generate" not in args.skip and distributed.is_main():
        results["generate"] = measure_generation(args, device)
    distributed.barrier()
    if "step" not in args.skip:
        results["step"] = [measure_step(args, device, on_policy=False), measure_step(args, device, on_policy=True)]
    if distributed.is_main():
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "on_policy.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

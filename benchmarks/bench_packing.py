"""Packed chat batches (``data.packing: true``) against length-grouped and random padding: counted tokens/s.

The same synthetic conversations go through three batchings, each with ``--micro-batch`` rows a micro-batch
(``--padded-micro-batch`` rows for the padded two, to compare steps of about the same positions):

* ``packed``: ``ChatLoader(packing=True)``, whole conversations in rows of up to ``--block-size`` tokens;
* ``grouped``: ``ChatLoader`` as today, rows of similar length in a micro-batch (the Hugging Face Trainer's grouping);
* ``random``: rows in a random order, each micro-batch right-padded to its longest.

Lengths: log-normal with median ``--median`` (256) and sigma ``--sigma`` (1.0), rounded and clipped to
[``--min-length``, ``--max-length``] = [32, 2048]: a long right tail (the default 2,000 draws: mean 402, median 256,
1.9% clipped at 2,048). The first 30% of each conversation is prompt (labels -100), the rest counts.

For each batching it reports the share of batch positions that are real tokens (over a whole epoch; needs no model)
and, unless ``--share-only``, counted tokens/s of the Distiller's own step (``phases.TimedDistiller``: ZeRO-2
student, ZeRO-3 teacher, forward KL on the counted tokens, the run's default kernels and fused head), one
micro-batch a step, the models built afresh for each batching; ``--steps 0`` times the epoch's second pass, after
an untimed first one in which every micro-batch shape is met once (a long run meets each length again and again).
Packed micro-batches go through the Distiller as a run's do (``chat.packed_model_inputs``: position_ids, no 2-D
mask, no cache).

CPU (a tiny Qwen2 pair, what fits a laptop)::

    PYTHONPATH=$PWD python benchmarks/bench_packing.py --pair tiny --steps 3 --warmup 1
    PYTHONPATH=$PWD python benchmarks/bench_packing.py --share-only

GPU (random-init Qwen2-7B-shaped teacher, Qwen2-0.5B-shaped student, bf16, sdpa)::

    PYTHONPATH=$PWD python benchmarks/bench_packing.py --pair qwen2-7b-0.5b --micro-batch 4 --steps 0 \
        --conversations 300
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
from pathlib import Path

import datasets
import pairs
import torch
from phases import TimedDistiller
from transformers import Qwen2Config

from distill_kit.config import CONFIG_DIR, TrainingConfig
from distill_kit.data import chat
from distill_kit.data.blocks import IGNORE_INDEX
from distill_kit.engines import deepspeed_config, distributed
from losses.base import valid_positions

PAIRS = {
    # (teacher, student) configs; vocabulary shared.
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
             dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2)),
    "qwen2-7b-0.5b": (dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                           num_key_value_heads=4),
                      dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                           num_key_value_heads=2)),
}
VOCAB = {"tiny": 512, "qwen2-7b-0.5b": 151936}
MODES = ("packed", "grouped", "random")


def lengths(args: argparse.Namespace) -> list[int]:
    generator = torch.Generator().manual_seed(args.seed)
    normal = torch.randn(args.conversations, generator=generator, dtype=torch.float64)
    drawn = torch.exp(torch.log(torch.tensor(float(args.median))) + args.sigma * normal).round()
    return drawn.clamp(args.min_length, args.max_length).long().tolist()


def dataset(sizes: list[int], vocab: int, seed: int) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(seed)
    rows = {name: [] for name in chat.FEATURES}
    for i, n in enumerate(sizes):
        ids = torch.randint(1, vocab, (n,), generator=generator).tolist()
        prompt = max(1, int(0.3 * n))
        labels = [IGNORE_INDEX] * prompt + ids[prompt:]
        for name, value in zip(chat.FEATURES, (ids, labels, n, n - prompt, f"synthetic {i}"), strict=True):
            rows[name].append(value)
    return datasets.Dataset.from_dict(rows, features=chat.FEATURES)


def batches(mode: str, data: datasets.Dataset, args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """One epoch's micro-batches of one rank (rank 0 of ``--world-size``)."""
    common = dict(pad_id=0, world_size=args.world_size, seed=args.seed)
    if mode == "packed":
        return list(chat.ChatLoader(data, args.micro_batch, packing=True, block_size=args.block_size, **common))
    rows_per_batch = args.padded_micro_batch or args.micro_batch
    if mode == "grouped":
        return list(chat.ChatLoader(data, rows_per_batch, **common))
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed)).tolist()
    size = rows_per_batch * args.world_size
    out = []
    for start in range(0, len(order) - size + 1, size):
        rows = data[order[start : start + rows_per_batch]]
        out.append(chat.pad_rows(rows["input_ids"], rows["labels"], 0))
    return out


def real_share(mode_batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Real tokens over all positions, and the tokens that count, over one epoch's micro-batches."""
    positions = sum(b["input_ids"].numel() for b in mode_batches)
    if "attention_mask" in mode_batches[0]:
        real = sum(int(b["attention_mask"].sum()) for b in mode_batches)
    else:
        real = sum(int(_packed_real(b)) for b in mode_batches)
    counted = sum(int(valid_positions(b).sum()) for b in mode_batches)
    return {"real_share": real / positions, "positions": positions, "real_tokens": real, "counted_tokens": counted,
            "micro_batches": len(mode_batches)}


def _packed_real(batch: dict[str, torch.Tensor]) -> int:
    """Real tokens of a packed batch: synthetic ids are never the pad id 0, so every 0 is padding."""
    return int((batch["input_ids"] != 0).sum())


def configs(pair: str, block_size: int) -> tuple[Qwen2Config, Qwen2Config]:
    teacher_kw, student_kw = PAIRS[pair]
    common = dict(vocab_size=VOCAB[pair], max_position_embeddings=max(block_size, 64), tie_word_embeddings=False)
    return Qwen2Config(**common, **teacher_kw), Qwen2Config(**common, **student_kw)


def step_times(mode_batches: list[dict], args: argparse.Namespace, device: torch.device) -> list[tuple[float, int]]:
    """(seconds, counted tokens) of each timed step: the Distiller's own step (ZeRO-2 student, ZeRO-3 teacher,
    forward KL, the run's default kernels and fused head), one micro-batch a step, on models built for this
    batching alone. ``--steps 0``: the epoch twice, the second pass timed."""
    steps, warmup = (args.steps, args.warmup) if args.steps else (len(mode_batches), len(mode_batches))
    timed = [mode_batches[(i - warmup) % len(mode_batches)] for i in range(warmup + steps)]
    dtype = "bf16" if device.type == "cuda" else "fp32"
    rows = mode_batches[0]["input_ids"].shape[0]
    training = TrainingConfig(max_steps=len(timed), micro_batch_size=rows, dtype=dtype, lr=1e-5,
                              log_every=10**9)
    teacher_config, student_config = configs(args.pair, args.block_size)
    student_ds, teacher_ds = deepspeed_config.prepare_pair(
        CONFIG_DIR / "zero2_student.json", CONFIG_DIR / "zero3_teacher.json", training,
        student_hidden_size=student_config.hidden_size, teacher_hidden_size=teacher_config.hidden_size,
        world_size=distributed.world_size())
    torch.manual_seed(0)
    teacher = pairs.build(teacher_config, teacher_ds, dtype, device, "sdpa")  # the teacher first, as a run loads
    student = pairs.build(student_config, student_ds, dtype, device, "sdpa")
    distiller = TimedDistiller(student, teacher, loss="forward_kl", training=training,
                               student_ds_config=student_ds, teacher_ds_config=teacher_ds)
    distiller.train(timed)
    distiller.clock.finish()
    seconds = [ms / 1e3 for ms in distiller.clock.summary(skip=warmup)["step_ms_all"]]
    for engine in (distiller.student, distiller.teacher):
        engine.destroy()
    del distiller, teacher, student
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [(s, int(valid_positions(b).sum())) for s, b in zip(seconds, timed[warmup:], strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(PAIRS), default="tiny")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--median", type=float, default=256)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--min-length", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--padded-micro-batch", type=int, default=None,
                        help="rows a micro-batch of the grouped and random batchings (default: --micro-batch); "
                        "e.g. 20 gives them about the positions a step of 4 packed rows of 2,048 has")
    parser.add_argument("--world-size", type=int, default=1, help="ranks the epoch is split over (rank 0 timed)")
    parser.add_argument("--steps", type=int, default=5, help="timed micro-batches; 0: the whole epoch's, on a second "
                        "pass after an untimed one (the same conversations in every batching, every shape seen once)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--share-only", action="store_true", help="only the share of real positions (no models)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    device = distributed.init() if not args.share_only else torch.device("cpu")
    sizes = lengths(args)
    data = dataset(sizes, VOCAB[args.pair], args.seed)
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name()
              if device.type == "cuda" else "cpu", "args": {k: str(v) for k, v in vars(args).items()},
              "lengths": {"mean": statistics.mean(sizes), "median": statistics.median(sizes), "max": max(sizes),
                          "at_max": sum(n == args.max_length for n in sizes)}, "modes": {}}
    per_mode = {mode: batches(mode, data, args) for mode in MODES}
    for mode, mode_batches in per_mode.items():
        entry = real_share(mode_batches)
        if not args.share_only:
            timed = step_times(mode_batches, args, device)
            per_step = statistics.median(tokens / seconds for seconds, tokens in timed)
            entry |= {"counted_tokens_per_s": per_step,
                      "counted_tokens_per_s_total": sum(t for _, t in timed) / sum(s for s, _ in timed)}
            print(f"{mode}: {entry['counted_tokens_per_s_total']:,.0f} counted tok/s", flush=True)
        result["modes"][mode] = entry
        if args.out:  # after each batching, so that a run cut short keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
    base = result["modes"]["grouped"].get("counted_tokens_per_s_total")
    print(f"lengths: mean {result['lengths']['mean']:.0f}, median {result['lengths']['median']:.0f}, "
          f"{result['lengths']['at_max']} of {len(sizes)} at {args.max_length}")
    for mode, entry in result["modes"].items():
        line = (f"{mode:8s} real positions {entry['real_share']:.1%}  micro-batches {entry['micro_batches']}  "
                f"counted tokens {entry['counted_tokens']}")
        if "counted_tokens_per_s_total" in entry:
            line += f"  counted tok/s {entry['counted_tokens_per_s_total']:,.0f}"
            line += f" ({entry['counted_tokens_per_s_total'] / base:.2f}x grouped)"
        print(line)


if __name__ == "__main__":
    main()

"""Packed chat batches (``data.packing: true``) against length-grouped and random padding: counted tokens/s.

The same synthetic conversations go through three batchings, each with ``--micro-batch`` rows a micro-batch:

* ``packed``: ``ChatLoader(packing=True)``, whole conversations in rows of up to ``--block-size`` tokens;
* ``grouped``: ``ChatLoader`` as today, rows of similar length in a micro-batch (the Hugging Face Trainer's grouping);
* ``random``: rows in a random order, each micro-batch right-padded to its longest.

Lengths: log-normal with median ``--median`` (256) and sigma ``--sigma`` (1.0), rounded and clipped to
[``--min-length``, ``--max-length``] = [32, 2048]: a long right tail (the default 2,000 draws: mean 402, median 256,
1.9% clipped at 2,048). The first 30% of each conversation is prompt (labels -100), the rest counts.

For each batching it reports the share of batch positions that are real tokens (over a whole epoch; needs no model)
and, unless ``--share-only``, counted tokens/s of a distillation step in plain PyTorch on one device: the teacher's
forward under no_grad, the student's forward, forward KL on the counted tokens (``losses``' ``forward_kl``), backward
and an AdamW step, median over ``--steps`` steps after ``--warmup``. Packed micro-batches are called as the
Distiller calls them (``chat.packed_model_inputs``: position_ids, no 2-D mask, no cache).

CPU (tiny Llama pair, what fits a laptop)::

    PYTHONPATH=$PWD python benchmarks/bench_packing.py --pair tiny --steps 3 --warmup 1
    PYTHONPATH=$PWD python benchmarks/bench_packing.py --share-only

GPU (random-init Qwen2-7B-shaped teacher, Qwen2-0.5B-shaped student, bf16, sdpa)::

    PYTHONPATH=$PWD python benchmarks/bench_packing.py --pair qwen2-7b-0.5b --micro-batch 4 --steps 0 \
        --conversations 300
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from distill_kit.data import chat
from distill_kit.data.blocks import IGNORE_INDEX
from losses import build_loss
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
    if mode == "grouped":
        return list(chat.ChatLoader(data, args.micro_batch, **common))
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed)).tolist()
    size = args.micro_batch * args.world_size
    out = []
    for start in range(0, len(order) - size + 1, size):
        rows = data[order[start : start + args.micro_batch]]
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


def models(pair: str, device: torch.device, dtype: torch.dtype, block_size: int):
    teacher_kw, student_kw = PAIRS[pair]
    common = dict(vocab_size=VOCAB[pair], max_position_embeddings=max(block_size, 64), tie_word_embeddings=False)
    torch.manual_seed(0)
    with device:  # initialised where they run: a 7B model's random init on the host takes minutes
        teacher = AutoModelForCausalLM.from_config(Qwen2Config(**common, **teacher_kw), dtype=dtype,
                                                   attn_implementation="sdpa").eval()
        student = AutoModelForCausalLM.from_config(Qwen2Config(**common, **student_kw), dtype=dtype,
                                                   attn_implementation="sdpa").train()
    return teacher, student


def step_times(mode_batches, teacher, student, args, device) -> list[tuple[float, int]]:
    """(seconds, counted tokens) of each timed step (one micro-batch a step)."""
    loss = build_loss("forward_kl")
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)
    out = []
    # --steps 0: the whole epoch, timed on its second pass. The first pass meets every micro-batch shape for the
    # first time (measured on an H200: ~0.35 s a step of one-time costs, which made grouped slower than random);
    # in a long run the lengths repeat and those costs are paid once.
    steps, warmup = (args.steps, args.warmup) if args.steps else (len(mode_batches), len(mode_batches))
    for i in range(warmup + steps):
        batch = {k: v.to(device) for k, v in mode_batches[(i - warmup) % len(mode_batches)].items()}
        inputs = {"input_ids": batch["input_ids"], "use_cache": False}  # as the Distiller calls them
        inputs |= chat.packed_model_inputs(batch) or {"attention_mask": batch["attention_mask"]}
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            t_out = teacher(**inputs)
        s_out = student(**inputs)
        loss(s_out, t_out, batch).total.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            out.append((time.perf_counter() - start, int(valid_positions(batch).sum())))
    return out


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
    parser.add_argument("--world-size", type=int, default=1, help="ranks the epoch is split over (rank 0 timed)")
    parser.add_argument("--steps", type=int, default=5, help="timed micro-batches; 0: the whole epoch's, on a second "
                        "pass after an untimed one (the same conversations in every batching, every shape seen once)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--share-only", action="store_true", help="only the share of real positions (no models)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = lengths(args)
    data = dataset(sizes, VOCAB[args.pair], args.seed)
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name()
              if device.type == "cuda" else "cpu", "args": {k: str(v) for k, v in vars(args).items()},
              "lengths": {"mean": statistics.mean(sizes), "median": statistics.median(sizes), "max": max(sizes),
                          "at_max": sum(n == args.max_length for n in sizes)}, "modes": {}}
    per_mode = {mode: batches(mode, data, args) for mode in MODES}
    pair = None if args.share_only else models(args.pair, device, dtype, args.block_size)
    for mode, mode_batches in per_mode.items():
        entry = real_share(mode_batches)
        if pair is not None:
            timed = step_times(mode_batches, *pair, args, device)
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
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

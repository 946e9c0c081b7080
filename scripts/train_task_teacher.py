"""Train a task's teacher (``distill_kit/assets/<task>/teacher``) on fresh examples every step.

Plain PyTorch (on a GPU when there is one), answer tokens only (the prompt is given), AdamW with warm-up and
cosine decay; the teacher sees a new seeded batch each step, so it learns the procedure rather than a fixed set
of answers. Every task shares the arithmetic task's character tokenizer, so its teachers can be routed together.
Greedy exact-match accuracy on held-out prompts is printed as it trains and stored in ``training.json``::

    python scripts/train_task_teacher.py                       # ~0.8M parameters, writes the shipped teacher
    python scripts/train_task_teacher.py --steps 200 --out /tmp/t   # a quick check
    python scripts/train_task_teacher.py --task sorting --hidden 64 --layers 2 ...   # training.json has the command
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from distill_kit.data import chat  # noqa: E402
from distill_kit.tasks import arithmetic, sorting  # noqa: E402
from distill_kit.tasks.evaluate import exact_match  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "distill_kit" / "assets"
TASKS = {"arithmetic": arithmetic, "sorting": sorting}


def teacher_config(tokenizer, hidden: int, layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="arithmetic")
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--max-seconds", type=float, default=float("inf"), help="stop early (and save) after this")
    parser.add_argument("--out", type=Path, default=None, help="default: distill_kit/assets/<task>/teacher")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    task = TASKS[args.task]
    args.out = args.out or ASSETS / args.task / "teacher"
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = task.build_tokenizer()
    model = LlamaForCausalLM(teacher_config(tokenizer, args.hidden, args.layers)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(args.steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(s / args.steps, 1.0)))))
    seeds = task.split_seeds(args.seed)
    stream = task.examples(seeds["teacher"])
    heldout = list(task.examples(seeds["heldout"], 500))
    started, log = time.time(), []
    for step in range(1, args.steps + 1):
        rows = [task.encode(tokenizer, next(stream)) for _ in range(args.batch)]
        batch = chat.pad_rows([ids for ids, _ in rows], [labels for _, labels in rows], tokenizer.pad_token_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        out_of_time = time.time() - started > args.max_seconds
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            accuracy = exact_match(model, tokenizer, heldout, check=task.check)
            log.append({"step": step, "loss": loss.item(), "exact_match": accuracy, "seconds": time.time() - started})
            print(json.dumps(log[-1]), flush=True)
        if out_of_time:
            break
    args.out.mkdir(parents=True, exist_ok=True)
    model.cpu().save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    record = {"command": " ".join(["python", *sys.argv]), "args": {k: str(v) for k, v in vars(args).items()},
              "machine": machine(device), "parameters": sum(p.numel() for p in model.parameters()),
              "seconds": time.time() - started, "final_exact_match": log[-1]["exact_match"], "log": log}
    (args.out / "training.json").write_text(json.dumps(record, indent=1))


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"1x {torch.cuda.get_device_name(device)}"
    return f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


if __name__ == "__main__":
    main()

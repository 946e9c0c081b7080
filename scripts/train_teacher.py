"""Train the embedded default's teacher: a small Llama-shaped model that really knows the stdlib corpus.

Run once, on a GPU (about a minute on one H200); the result is shipped in ``distill_kit/assets/default/teacher``
so that the default distillation needs no GPU and no network. Plain PyTorch on purpose: this is the
teacher's recipe, not a use of the framework, and it must run where DeepSpeed is not set up.

    python scripts/train_teacher.py                       # corpus + tokenizer + teacher, defaults below
    python scripts/train_teacher.py --steps 50 --device cpu --out /tmp/teacher   # a smoke test

Why these defaults (chosen against narrower, wider and longer-trained alternatives; the figures:
benchmarks/RESULTS.md): 256 wide x 8 layers keeps the shipped file small and a CPU forward cheap (it runs live
during the default distillation). 1,500 steps of 64 x 256 tokens is about six passes over the training split;
longer, the model memorises its training text and its held-out perplexity climbs.

The teacher never trains on the default student's slice (the first 512 training blocks): a teacher that did
memorised the student's text and gave near one-hot targets, teaching no more than the labels. The shipped
teacher was made with ``python scripts/train_teacher.py --corpus-dir .cache/corpus``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel

from distill_kit.data.blocks import IGNORE_INDEX, BlockLoader, DataConfig, build_splits
from distill_kit.data.corpus import DEFAULT_HELDOUT_FRACTION, CorpusSplits, write_corpus
from distill_kit.data.tokenizer import DEFAULT_VOCAB_SIZE, train_and_save

ASSETS = Path(__file__).resolve().parents[1] / "distill_kit" / "assets" / "default" / "teacher"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-dir", type=Path, default=Path(".cache/corpus"),
                        help="a folder with train.jsonl and heldout.jsonl, used as found (so a corpus written by "
                             "another Python can travel to the GPU machine); written from this Python's stdlib "
                             "if absent")
    parser.add_argument("--tokenizer", type=Path, default=ASSETS,
                        help="tokenizer folder; a new byte-level BPE is trained and saved there if it holds none")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="for a newly trained tokenizer")
    parser.add_argument("--out", type=Path, default=ASSETS, help="where the teacher (and a copy of the tokenizer) go")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=704, help="SwiGLU width (about 2.75 x hidden)")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak; small models take a high rate")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-blocks", type=int, default=512, help="held-out blocks per evaluation")
    parser.add_argument("--student-blocks", type=int, default=512,
                        help="leave out the first N training blocks: the embedded default student's slice")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


@torch.no_grad()
def perplexity(model: PreTrainedModel, loader: BlockLoader, device: torch.device) -> float:
    """Token-weighted held-out perplexity: exp(sum of next-token NLL / number of predicted tokens)."""
    model.eval()
    total, count = 0.0, 0
    for batch in loader:
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["labels"][:, 1:]
        nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), reduction="sum",
                              ignore_index=IGNORE_INDEX)
        total += nll.item()
        count += int((targets != IGNORE_INDEX).sum())
    loader.load_state_dict({"epoch": 0, "index": 0})
    model.train()
    return math.exp(total / count)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    splits_files = CorpusSplits(train=args.corpus_dir / "train.jsonl", heldout=args.corpus_dir / "heldout.jsonl")
    if not (splits_files.train.exists() and splits_files.heldout.exists()):
        splits_files = write_corpus(args.corpus_dir, heldout_fraction=DEFAULT_HELDOUT_FRACTION)
    if not (args.tokenizer / "tokenizer.json").exists():
        train_and_save(splits_files.train, args.tokenizer, args.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)

    splits = build_splits(
        DataConfig(train=str(splits_files.train), heldout=str(splits_files.heldout), block_size=args.block_size),
        tokenizer,
    )
    # The default student distils on the first --student-blocks blocks. A teacher that trained on them has
    # memorised them (perplexity ~3 there against ~18 on held-out text) and gives the student near one-hot
    # targets, which teach no more than the labels; so the teacher never sees them.
    train = BlockLoader(splits.train.select(range(args.student_blocks, len(splits.train))), args.batch_size,
                        seed=args.seed)
    heldout = splits.heldout.select(range(min(args.eval_blocks, len(splits.heldout))))
    evals = {
        "held-out": BlockLoader(heldout, args.batch_size, shuffle=False, drop_last=False),
        "student-slice": BlockLoader(splits.train.select(range(args.student_blocks)), args.batch_size,
                                     shuffle=False, drop_last=False),
    }

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=args.block_size,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"teacher: {params / 1e6:.2f}M parameters; train {len(splits.train)} blocks of {args.block_size}, "
          f"{len(train)} steps an epoch")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )

    def lr_at(step: int) -> float:  # linear warm-up, then cosine to a tenth of the peak
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    batches = iter(train)
    start = time.time()
    progress = tqdm(range(args.steps), desc="teacher", mininterval=5)
    for step in progress:
        batch = next(batches, None)
        if batch is None:  # epoch boundary: the loader's position has moved to the next epoch
            batches = iter(train)
            batch = next(batches)
        batch = {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_per_s = (step + 1) * args.batch_size * args.block_size / (time.time() - start)
        progress.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_per_s:.0f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            ppl = {name: perplexity(model, loader, device) for name, loader in evals.items()}
            tqdm.write(f"step {step + 1}: " + ", ".join(f"{name} ppl {value:.3f}" for name, value in ppl.items()))

    print(f"trained in {time.time() - start:.0f}s; final " + ", ".join(f"{k} ppl {v:.3f}" for k, v in ppl.items()))
    model.to(torch.bfloat16).save_pretrained(args.out)  # bf16 storage halves the shipped file
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()

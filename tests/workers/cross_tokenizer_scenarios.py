"""Cross-tokenizer distillation on real ranks; launched by tests/test_cross_tokenizer_ranks.py.

A teacher and a student with different hand-made BPEs, paired blocks, loss 0.5 CE + 0.5 cross_tokenizer,
ZeRO-2 student + ZeRO-3 teacher. The reference is a plain PyTorch loop on one process over the union of every
rank's micro-batches: per step, the sum of both terms over all of them divided by the step's student tokens,
AdamW, gradient clipping, a constant learning rate (``lr_schedule: constant``). (The loss's own math is checked
against float64 formulas in tests/test_cross_tokenizer_loss.py; here the reference calls it on the whole global
batch, for its sums.)
Held-out bits per byte, gathered from both ranks, is compared with the same quantity computed here.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_results import gathered, plain_adamw, plain_step, write  # noqa: E402
from tiny_models import gpt2_config  # noqa: E402
from tiny_tokenizers import bpe  # noqa: E402

from distill_kit import Distiller, TrainingConfig  # noqa: E402
from distill_kit.data.alignment import VocabMap  # noqa: E402
from distill_kit.data.blocks import BlockLoader  # noqa: E402
from distill_kit.data.paired_blocks import tokenize_to_paired_blocks  # noqa: E402
from distill_kit.engines import distributed  # noqa: E402
from distill_kit.engines.deepspeed_config import load  # noqa: E402
from losses import build_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STUDENT_CFG = load(ROOT / "configs/zero2_student.json")
TEACHER_CFG = load(ROOT / "configs/zero3_teacher.json")
STEPS, GAS, MBS, BLOCK = 3, 2, 2, 16
TRAINING = TrainingConfig(max_steps=STEPS, micro_batch_size=MBS, gradient_accumulation_steps=GAS,
                          lr=3e-3, weight_decay=0.01, max_grad_norm=0.5, log_every=100, lr_schedule="constant")
LOSS = [{"name": "cross_entropy", "weight": 0.5}, {"name": "cross_tokenizer", "weight": 0.5, "temperature": 2.0}]
# Two runs: the KL terms alone (uld_weight 0), whose gradient is smooth, must match the plain loop to float32
# rounding; with ULD, an |a - b| whose two sides are equal to float32 rounding (near-uniform rows at
# initialisation) can take either sign, and Adam turns one flipped sign into an lr-sized step of the few
# weights it touches: that run is held to its losses and a looser parameter bound.
ULD_WEIGHTS = (0.0, 1.0)


def texts(count: int, seed: int) -> list[str]:
    words = ["hello", "héllo", "help", "world", "def", "return", "  ", "x = 1", "é", "日本", "\n"]
    generator = torch.Generator().manual_seed(seed)
    return [" ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=generator).tolist())
            for _ in range(count)]


def micro_batches(blocks: datasets.Dataset) -> list[dict]:
    rows = blocks[:]
    return [{k: torch.tensor(v[i:i + MBS]) for k, v in rows.items()} for i in range(0, len(blocks) - MBS + 1, MBS)]


def main(out: Path, uld_weight: float, name: str) -> None:
    world, rank = distributed.world_size(), distributed.rank()
    student_tok, teacher_tok = bpe("h e", "l l", "he ll", "hell o", "Ġ hello"), bpe("l l", "ll o", "Ġ w", "r l")
    teacher_dir, student_dir = out / "models/teacher", out / "models/student"
    if distributed.is_main() and not teacher_dir.exists():
        torch.manual_seed(5)
        GPT2LMHeadModel(gpt2_config(64, 2, vocab=len(teacher_tok))).save_pretrained(teacher_dir)
        GPT2LMHeadModel(gpt2_config(32, 1, vocab=len(student_tok))).save_pretrained(student_dir)
    distributed.barrier()
    vocab_map = VocabMap.build(student_tok, teacher_tok)

    def paired(count: int, seed: int) -> datasets.Dataset:
        return tokenize_to_paired_blocks(datasets.Dataset.from_dict({"text": texts(count, seed)}), student_tok,
                                         teacher_tokenizer=teacher_tok, block_size=BLOCK, teacher_block_size=BLOCK)

    train = paired(16, 0).select(range(STEPS * GAS * world * MBS))
    all_batches = micro_batches(train)
    mine = [all_batches[(s * world + rank) * GAS + m] for s in range(STEPS) for m in range(GAS)]
    # with ULD, also the unmapped bucket and ULD on the unmapped tokens: every option of the loss
    options = {"uld_weight": 0.0} if not uld_weight else {"uld_weight": uld_weight, "unmapped": "bucket",
                                                          "unmapped_uld_weight": uld_weight}
    loss_spec = [LOSS[0], {**LOSS[1], **options}]
    distiller = Distiller(student_dir, teacher_dir, loss=loss_spec, training=TRAINING, vocab_map=vocab_map,
                          student_ds_config=STUDENT_CFG, teacher_ds_config=TEACHER_CFG)
    history = distiller.train(mine)
    heldout = paired(6, 1)
    loader = BlockLoader(heldout, MBS, rank=rank, world_size=world, shuffle=False, drop_last=False)
    metrics = distiller.evaluate(loader)
    ours = gathered(distiller.student_model.parameters())

    # ---- the reference: one process, plain PyTorch, the union of every rank's micro-batches ----
    def reference(dtype: torch.dtype) -> tuple[GPT2LMHeadModel, GPT2LMHeadModel, list, list[float]]:
        """The plain loop in ``dtype`` (float64: the trajectory without float32's rounding, tests/tolerances.py)."""
        student = GPT2LMHeadModel.from_pretrained(student_dir).to(dtype)
        teacher = GPT2LMHeadModel.from_pretrained(teacher_dir).to(dtype).eval()
        initial = [p.detach().clone() for p in student.parameters()]
        loss = build_loss(loss_spec, vocab_map=vocab_map).to(dtype)
        opt = plain_adamw(student.parameters(), TRAINING)
        losses = []
        for s in range(STEPS):
            step = all_batches[s * world * GAS:(s + 1) * world * GAS]
            tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in step)
            total = 0.0
            for b in step:
                with torch.no_grad():
                    t_out = teacher(input_ids=b["teacher_input_ids"], attention_mask=b["teacher_attention_mask"])
                s_out = student(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                total = total + loss(s_out, t_out, {**b, "loss_normalizer": 1.0}).total  # a sum over the tokens
            step_loss = total / tokens
            losses.append(plain_step(opt, step_loss, TRAINING.max_grad_norm))
        return student, teacher, initial, losses

    student, teacher, initial, ref_losses = reference(torch.float32)
    exact = [p.detach() for p in reference(torch.float64)[0].parameters()]

    def bits_per_byte(model: GPT2LMHeadModel, prefix: str) -> float:
        nll, size = 0.0, 0
        rows = heldout[:]
        for i in range(len(heldout)):
            ids, labels = torch.tensor([rows[f"{prefix}input_ids"][i]]), torch.tensor(rows[f"{prefix}labels"][i])
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=torch.tensor([rows[f"{prefix}attention_mask"][i]])).logits
            counted = labels[1:] != -100
            nll += F.cross_entropy(logits[0, :-1][counted], labels[1:][counted], reduction="sum").item()
            size += int(torch.tensor(rows[f"{prefix}token_bytes"][i])[1:][counted].sum())
        return nll / (math.log(2) * size)

    ref_params = [p.detach().clone() for p in student.parameters()]
    with torch.no_grad():  # held-out reference for *our* trained student, as the Distiller evaluated it
        for param, trained in zip(student.parameters(), ours, strict=True):
            param.copy_(trained)
    write(out, name, {
        "max_param_diff": max((a - b).abs().max().item() for a, b in zip(ours, ref_params, strict=True)),
        "ours_vs_float64": max((a.double() - b).abs().max().item() for a, b in zip(ours, exact, strict=True)),
        "ref_vs_float64": max((a.double() - b).abs().max().item() for a, b in zip(ref_params, exact, strict=True)),
        "max_param_change": max((a - b).abs().max().item() for a, b in zip(ours, initial, strict=True)),
        "losses": [h["loss"] for h in history], "ref_losses": ref_losses,
        "metrics": metrics,
        "ref_teacher_bpb": bits_per_byte(teacher, "teacher_"),
        "ref_student_bpb": bits_per_byte(student, ""),
        "kinds": sorted({k for b in all_batches for k in b["align_kind"].flatten().tolist()}),
    })


if __name__ == "__main__":
    distributed.init()
    for weight in ULD_WEIGHTS:
        main(Path(sys.argv[1]), weight, f"uld_{weight:g}")

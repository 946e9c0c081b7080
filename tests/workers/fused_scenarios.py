"""Fused student head vs the plain head in a real Distiller (ZeRO-2 student, ZeRO-3 teacher, accumulation);
launched by tests/test_losses_fused.py. Writes ``<out>/fused.rank<r>.json``."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_results import gathered, max_diff, saved_pair, write  # noqa: E402
from tiny_models import random_batches  # noqa: E402

from distill_kit import Distiller, TrainingConfig  # noqa: E402
from distill_kit.engines import distributed  # noqa: E402

TRAINING = TrainingConfig(max_steps=3, micro_batch_size=2, gradient_accumulation_steps=2, lr=3e-3,
                          weight_decay=0.01, max_grad_norm=0.5, log_every=100)
LOSS = [{"name": "cross_entropy", "weight": 0.5}, {"name": "forward_kl", "weight": 1.0, "temperature": 2.0}]


def main(out: Path) -> None:
    distributed.init()  # before saved_pair and the data's seed: both ask the rank
    teacher_dir, student_dir = saved_pair(out)
    data = random_batches(6, 2, 24, seed=11 + distributed.rank())
    results = {}
    for fused in (True, False):
        distiller = Distiller(student_dir, teacher_dir, loss=LOSS, training=replace(TRAINING, fused_loss=fused))
        torch.manual_seed(0)
        kind = type(distiller.student_forward(data[0])).__name__
        history = distiller.train(data)
        results[fused] = {"params": gathered(distiller.student_model.parameters()),
                          "losses": [h["loss"] for h in history], "eval": distiller.evaluate(data[:2]),
                          "fused_head": distiller.fused_head, "output": kind}
    write(out, "fused", {
        "max_param_diff": max_diff(results[True]["params"], results[False]["params"]),
        "max_param_change": max_diff(results[False]["params"], gathered(GPT2LMHeadModel.from_pretrained(student_dir))),
        **{f"{k}_{fused}": v[k] for fused, v in results.items() for k in ("losses", "eval", "fused_head", "output")},
    })


if __name__ == "__main__":
    main(Path(sys.argv[1]))

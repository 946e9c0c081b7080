"""Several teachers for one student on real ranks; launched by tests/test_multi_teacher.py.

One launch runs every scenario (each launch pays DeepSpeed's start-up). Each writes ``<out>/<name>.rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_results import gathered, max_diff, saved_model, saved_pair, write  # noqa: E402
from tiny_models import random_batches  # noqa: E402

from distill_kit import Distiller, TrainingConfig  # noqa: E402
from distill_kit.engines import distributed  # noqa: E402

STEPS, GAS, MBS, LENGTH = 3, 2, 2, 24
# Adam's eps well above float32 rounding of the gradients: the sum and the mixture differ in rounding only, and
# with eps 1e-8 Adam's first step turns a rounding-level gradient into a full +-lr update (a sign flip), which
# would hide the equality the tests check behind a few parameters' noise.
TRAINING = TrainingConfig(max_steps=STEPS, micro_batch_size=MBS, gradient_accumulation_steps=GAS,
                          lr=3e-3, eps=1e-4, weight_decay=0.01, max_grad_norm=0.5, warmup_steps=1, log_every=100)


def run(distiller, data) -> tuple[list[float], list[torch.Tensor]]:
    history = distiller.train(data)
    return [h["loss"] for h in history], gathered(distiller.student_model)


def one_teacher_equivalence(out: Path, a: Path, b: Path, student: Path) -> None:
    """Weights (1, 0) equal teacher a alone, for both ways of combining; (0.5, 0.5) under forward KL: the sum and
    the mixture have the same gradient, so the same weights, while the sum's value is higher by the teachers'
    weighted KL to their mixture."""
    data = random_batches(STEPS * GAS, MBS, LENGTH, seed=40 + distributed.rank())
    alone_losses, alone = run(Distiller(student, a, training=TRAINING), data)
    pair = [{"name": "a", "model": a, "weight": 1.0}, {"name": "b", "model": b, "weight": 0.0}]
    result = {}
    for combine in ("sum", "mixture"):
        losses, weights = run(Distiller(student, teachers=pair, combine=combine, training=TRAINING), data)
        result[combine] = {"loss_diff": max(abs(x - y) for x, y in zip(losses, alone_losses, strict=True)),
                           "param_diff": max_diff(weights, alone)}
    half = [{"name": "a", "model": a, "weight": 0.5}, {"name": "b", "model": b, "weight": 0.5}]
    summed = Distiller(student, teachers=half, combine="sum", training=TRAINING)
    sum_losses, sum_weights = run(summed, data)
    mix_losses, mix_weights = run(Distiller(student, teachers=half, combine="mixture", training=TRAINING), data)
    initial = gathered(GPT2LMHeadModel.from_pretrained(student))
    result["half"] = {"param_diff": max_diff(sum_weights, mix_weights), "param_change": max_diff(sum_weights, initial),
                      "sum_losses": sum_losses, "mixture_losses": mix_losses,
                      "parts": sorted(summed.history[-1])}
    write(out, "one_teacher_equivalence", result)


def identities(out: Path, a: Path, b: Path, student: Path) -> None:
    """Checkpoints name every teacher with its hash; resuming with the teachers swapped is refused."""
    data = random_batches(STEPS * GAS, MBS, LENGTH, seed=60 + distributed.rank())
    training = replace(TRAINING, checkpoint_dir=str(out / "ckpt"))
    pair = [{"name": "a", "model": a}, {"name": "b", "model": b}]
    first = Distiller(student, teachers=pair, training=training)
    first.train(data)
    manifest = json.loads((out / "ckpt/step_00000003/manifest.json").read_text())
    swapped = Distiller(student, teachers=[{"name": "a", "model": b}, {"name": "b", "model": a}],
                                    training=training)
    try:
        swapped.resume()
        refusal = None
    except ValueError as err:
        refusal = str(err)
    write(out, "identities", {"recorded": manifest["teacher_sha256"], "identities": first.teachers.identities,
                              "refusal": refusal, "eval": first.evaluate(data[:2])})


def main() -> None:
    out = Path(sys.argv[1])
    distributed.init()
    a, student = saved_pair(out)
    b = saved_model(out, "teacher_b", seed=4321, width=48, layers=2)
    one_teacher_equivalence(out, a, b, student)
    identities(out, a, b, student)


if __name__ == "__main__":
    main()

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
from rank_results import gathered, max_diff, plain_adamw, plain_step, saved_model, saved_pair, write  # noqa: E402
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


# Each global micro-batch's teachers: step 1 all rows teacher a, step 2 all teacher b (what the routed loader
# gives), step 3 mixed rows, and the last rank with no row of teacher a (it must still join a's ZeRO-3 forward).
ROUTES = [lambda rank: [0, 0], lambda rank: [1, 1], lambda rank: [0, 1] if rank == 0 else [1, 1]]
ROUTED_LRS = [3e-3, 2e-3, 1e-3]  # the documented schedule for 3 steps, warm-up 1: linear to 0 just after the last


def routed_reference(student_dir: Path, teachers: list[Path], all_batches: list[dict], world: int,
                     dtype: torch.dtype) -> tuple[list[torch.Tensor], list[float]]:
    """The routed distillation as a plain loop over the union of every rank's micro-batches, in ``dtype``: each
    row's forward KL against the teacher its ``teacher_id`` names, per token of the whole step."""
    student = GPT2LMHeadModel.from_pretrained(student_dir).to(dtype)
    models = [GPT2LMHeadModel.from_pretrained(path).to(dtype).eval() for path in teachers]
    opt = plain_adamw(student.parameters(), TRAINING)
    losses = []
    for s in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = ROUTED_LRS[s]
        total, tokens = 0.0, 0
        for b in all_batches[s * world * GAS:(s + 1) * world * GAS]:
            inputs = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
            s_logp = torch.log_softmax(student(**inputs).logits[:, :-1], -1)
            with torch.no_grad():
                every = torch.stack([torch.log_softmax(m(**inputs).logits[:, :-1], -1) for m in models])
            t_logp = every[b["teacher_id"], torch.arange(len(b["teacher_id"]))]  # each row from its own teacher
            valid = b["labels"][:, 1:] != -100
            total = total + ((t_logp.exp() * (t_logp - s_logp)).sum(-1) * valid).sum()
            tokens += int(valid.sum())
        losses.append(plain_step(opt, total / tokens, TRAINING.max_grad_norm))
    return [p.detach() for p in student.parameters()], losses


def routed(out: Path, a: Path, b: Path, student: Path) -> None:
    """combine: route against the plain loop above, on 2 ranks with ZeRO-3 teachers."""
    world, rank = distributed.world_size(), distributed.rank()
    all_batches = random_batches(STEPS * GAS * world, MBS, LENGTH, seed=70)
    for g, batch in enumerate(all_batches):
        batch["teacher_id"] = torch.tensor(ROUTES[g // (world * GAS)]((g // GAS) % world))
    mine = [all_batches[(s * world + rank) * GAS + m] for s in range(STEPS) for m in range(GAS)]
    distiller = Distiller(student, teachers=[{"name": "a", "model": a}, {"name": "b", "model": b}], combine="route",
                          training=TRAINING)
    history = distiller.train(mine)
    ours = gathered(distiller.student_model)
    ref, ref_losses = routed_reference(student, [a, b], all_batches, world, torch.float32)
    exact, _ = routed_reference(student, [a, b], all_batches, world, torch.float64)
    initial = gathered(GPT2LMHeadModel.from_pretrained(student))
    write(out, "routed", {
        "max_param_diff": max_diff(ours, ref), "max_param_change": max_diff(ref, initial),
        "ours_vs_float64": max((x.double() - y).abs().max().item() for x, y in zip(ours, exact, strict=True)),
        "ref_vs_float64": max((x.double() - y).abs().max().item() for x, y in zip(ref, exact, strict=True)),
        "losses": [h["loss"] for h in history], "ref_losses": ref_losses, "lrs": [h["lr"] for h in history],
        "eval": distiller.evaluate(mine[:2]),
    })


def main() -> None:
    out = Path(sys.argv[1])
    distributed.init()
    a, student = saved_pair(out)
    b = saved_model(out, "teacher_b", seed=4321, width=48, layers=2)
    one_teacher_equivalence(out, a, b, student)
    identities(out, a, b, student)
    routed(out, a, b, student)


if __name__ == "__main__":
    main()

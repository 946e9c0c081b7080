"""Distiller scenarios run on real ranks; launched by tests/test_distiller_ranks.py.

One launch runs several scenarios because every launch pays DeepSpeed's start-up. Each scenario writes
``<out>/<name>.rank<r>.json``; the pytest side asserts on those numbers.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path

import deepspeed
import torch
from transformers import GPT2LMHeadModel
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_results import gathered, plain_adamw, plain_kl, plain_step, saved_pair, write  # noqa: E402
from tiny_models import random_batches  # noqa: E402

from distill_kit import Distiller, TrainingConfig  # noqa: E402
from distill_kit.engines import distributed  # noqa: E402
from distill_kit.engines.deepspeed_config import load  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STUDENT_CFG = load(ROOT / "configs/zero2_student.json")
TEACHER_CFG = load(ROOT / "configs/zero3_teacher.json")
FIXTURES = ROOT / "tests/fixtures"

STEPS, GAS, MBS, LENGTH = 4, 2, 2, 24
TRAINING = TrainingConfig(max_steps=STEPS, micro_batch_size=MBS, gradient_accumulation_steps=GAS,
                          lr=3e-3, weight_decay=0.01, max_grad_norm=0.5, log_every=100)
# The documented schedule (engines/schedule.py), written out by hand for STEPS = 4: the lr factor of each step.
SCHEDULES = {
    # warm-up 0 and 1 are the full lr at step 1; a linear decay reaches 0 just after the last step
    "linear_warmup0": (dict(warmup_steps=0), [1.0, 0.75, 0.5, 0.25]),
    "linear_warmup1": (dict(warmup_steps=1), [1.0, 0.75, 0.5, 0.25]),
    # cosine to 10% after 2 warm-up steps: 0.1 + 0.9 * (1 + cos(pi * q)) / 2 at q = 1/3, 2/3
    "cosine_warmup2": (dict(warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1), [0.5, 1.0, 0.775, 0.325]),
}


def rank_batches(all_batches: list[dict], rank: int, world: int) -> list[dict]:
    """Step s uses global micro-batches [s*world*GAS, (s+1)*world*GAS); rank r takes its GAS of them."""
    return [all_batches[(s * world + rank) * GAS + m] for s in range(STEPS) for m in range(GAS)]



def reference_student(student_dir: Path, teacher_dir: Path, all_batches: list[dict], world: int, lrs: list[float],
                      dtype: torch.dtype = torch.float32):
    """The same distillation as a plain PyTorch loop over the union of every rank's micro-batches, step ``s``
    at lr ``lrs[s]``, in ``dtype`` (float64: the trajectory with float32's rounding taken out)."""
    student = GPT2LMHeadModel.from_pretrained(student_dir).to(dtype)
    teacher = GPT2LMHeadModel.from_pretrained(teacher_dir).to(dtype).eval()
    opt = plain_adamw(student.parameters(), TRAINING)
    losses = []
    for s in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lrs[s]
        step = all_batches[s * world * GAS:(s + 1) * world * GAS]
        total, tokens = 0.0, 0
        for b in step:
            kl, counted = plain_kl(student, teacher, b)
            total, tokens = total + kl, tokens + counted
        loss = total / tokens
        losses.append(plain_step(opt, loss, TRAINING.max_grad_norm))
    return [p.detach() for p in student.parameters()], losses



def equivalence(out: Path, name: str, student_cfg: dict, teacher_cfg: dict, pair: tuple[Path, Path],
                schedule: str) -> Distiller:
    """Distiller vs plain loop with the schedule written out: same student parameters after STEPS steps, same
    per-step losses, and the logged lr of each step the one the plain loop used."""
    teacher_dir, student_dir = pair
    world = distributed.world_size()
    settings, factors = SCHEDULES[schedule]
    lrs = [TRAINING.lr * f for f in factors]
    all_batches = random_batches(STEPS * GAS * world, MBS, LENGTH, seed=7)
    distiller = Distiller(student_dir, teacher_dir, training=replace(TRAINING, **settings),
                          student_ds_config=student_cfg, teacher_ds_config=teacher_cfg)
    history = distiller.train(rank_batches(all_batches, distributed.rank(), world))
    ours = gathered(distiller.student_model.parameters())
    ref, ref_losses = reference_student(student_dir, teacher_dir, all_batches, world, lrs)
    exact, _ = reference_student(student_dir, teacher_dir, all_batches, world, lrs, dtype=torch.float64)
    initial = GPT2LMHeadModel.from_pretrained(student_dir).parameters()
    write(out, name, {
        "max_param_diff": max((a - b).abs().max().item() for a, b in zip(ours, ref, strict=True)),
        # How far float32 rounding takes each run from the float64 trajectory, on this CPU (tests/tolerances.py)
        "ours_vs_float64": max((a.double() - b).abs().max().item() for a, b in zip(ours, exact, strict=True)),
        "ref_vs_float64": max((a.double() - b).abs().max().item() for a, b in zip(ref, exact, strict=True)),
        "max_param_change": max((a - b).abs().max().item() for a, b in zip(ref, initial, strict=True)),
        "losses": [h["loss"] for h in history],
        "ref_losses": ref_losses,
        "logged_lrs": [h["lr"] for h in history],
        "lrs": lrs,
        "student_zero3": all(hasattr(p, "ds_id") for p in distiller.student_model.parameters()),
        "teacher_is_engine": isinstance(distiller.teacher, deepspeed.DeepSpeedEngine),
    })
    return distiller


def teacher_sharding(out: Path, pair: tuple[Path, Path]) -> None:
    """ZeRO-2 student + ZeRO-3 teacher: the teacher is partitioned, frozen and unchanged; the loss falls."""
    teacher_dir, student_dir = pair
    training = TrainingConfig(max_steps=30, micro_batch_size=4, lr=1e-2, log_every=100)
    distiller = Distiller(student_dir, teacher_dir, training=training)
    params = list(distiller.teacher.module.parameters())
    local = sum(p.ds_tensor.numel() for p in params)
    full = sum(p.ds_numel for p in params)
    student_params = list(distiller.student_model.parameters())
    data = random_batches(8, 4, LENGTH, seed=100 + distributed.rank())
    before = distiller.evaluate(data[:2])
    history = distiller.train(data)
    after_eval = distiller.evaluate(data[:2])
    on_disk = GPT2LMHeadModel.from_pretrained(teacher_dir).state_dict()
    names = [n for n, _ in distiller.teacher.module.named_parameters()]
    after = dict(zip(names, gathered(params), strict=True))
    write(out, "teacher_sharding", {
        "local_fraction": local / full,
        "teacher_unchanged": all(torch.equal(after[n], on_disk[n].float()) for n in names),
        "teacher_requires_grad": any(p.requires_grad for p in params),
        "teacher_training_mode": distiller.teacher.module.training,
        "student_partitioned": any(hasattr(p, "ds_id") for p in student_params),
        "transformers_zero3_left_on": is_deepspeed_zero3_enabled(),
        "eval_kl_before": before["student"]["mean_kl"], "eval_kl_after": after_eval["student"]["mean_kl"],
        "eval_agreement_after": after_eval["student"]["top1_agreement"],
        "eval_tokens": after_eval["teacher"]["tokens"],
        "first_loss": sum(h["loss"] for h in history[:3]) / 3,
        "last_loss": sum(h["loss"] for h in history[-3:]) / 3,
    })


def persistence(out: Path, distiller: Distiller) -> None:
    """Two ZeRO-3 models in one process each keep their own persistence threshold."""
    def summary(module, config):
        threshold = config["zero_optimization"]["stage3_param_persistence_threshold"]
        return {"threshold": threshold,
                "wrong": [n for n, p in module.named_parameters() if p.ds_persist != (p.ds_numel <= threshold)],
                "persisted": sum(p.ds_persist for p in module.parameters())}
    write(out, "persistence", {
        "student": summary(distiller.student.module, distiller.student_ds_config),
        "teacher": summary(distiller.teacher.module, distiller.teacher_ds_config),
    })


def seed_configs(out: Path, pair: tuple[Path, Path]) -> None:
    """The seed document's two configs, verbatim (trailing commas, "auto", CPU-offloaded optimizer)."""
    teacher_dir, student_dir = pair
    training = TrainingConfig(max_steps=3, micro_batch_size=1, lr=1e-3, warmup_steps=1, lr_schedule="constant",
                              log_every=100)  # the seed config's WarmupLR: warm-up, then constant
    distiller = Distiller(student_dir, teacher_dir, training=training,
                          student_ds_config=FIXTURES / "seed_zero2_config.json",
                          teacher_ds_config=FIXTURES / "seed_zero3_config.json")
    history = distiller.train(random_batches(4, 1, LENGTH, seed=3))
    write(out, "seed_configs", {
        "optimizer": type(distiller.student.optimizer.optimizer).__name__,
        "offload": distiller.student.zero_cpu_offload(),
        "losses": [h["loss"] for h in history],
    })


def readme_subclass() -> type[Distiller]:
    """The README's subclassing example, executed as written."""
    readme = (ROOT / "README.md").read_text()
    code = next(block for block in readme.split("```python")[1:] if "class TopKDistiller" in block)
    namespace: dict = {}
    exec(code.split("```")[0], namespace)
    return namespace["TopKDistiller"]


def losses_and_hooks(out: Path, pair: tuple[Path, Path]) -> None:
    """A weighted sum with a learned projection and a user loss by path; the README's subclass."""
    teacher_dir, student_dir = pair
    spec = [{"name": "cross_entropy", "weight": 0.5}, {"name": "forward_kl", "weight": 0.5},
            {"name": "hidden_mse", "weight": 0.1}, {"name": "user_losses:HalfForwardKL", "weight": 1.0}]
    training = TrainingConfig(max_steps=20, micro_batch_size=4, lr=1e-2, log_every=100)
    data = random_batches(4, 4, LENGTH, seed=200 + distributed.rank())
    distiller = Distiller(student_dir, teacher_dir, loss=spec, training=training)
    projection = [p.detach().clone() for p in distiller.loss.parameters()]
    history = distiller.train(data)
    distiller.save(out / "ckpt")
    subclassed = readme_subclass()(student_dir, teacher_dir, training=training)
    sub_history = subclassed.train(data)
    states = torch.load(next((out / "ckpt").rglob("mp_rank_00_model_states.pt")), weights_only=False)
    write(out, "losses_and_hooks", {
        "parts": sorted(history[0]),
        "first": history[0]["loss"], "last": history[-1]["loss"],
        "projection_moved": any(not torch.equal(a, b) for a, b in zip(projection, distiller.loss.parameters(),
                                                                           strict=True)),
        "projection_in_checkpoint": any("projection" in k for k in states["module"]),
        "student_has_projection": any("projection" in n for n, _ in distiller.student_model.named_parameters()),
        "subclass_first": sub_history[0]["loss"], "subclass_last": sub_history[-1]["loss"],
        "subclass_parts": sorted(sub_history[0]),
    })


def main() -> None:
    out = Path(sys.argv[1])
    scenarios = sys.argv[2].split(",")
    distributed.init()
    pair = saved_pair(out)
    zero3_student = copy.deepcopy(STUDENT_CFG) | {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                   "stage3_param_persistence_threshold": "auto"}}
    zero0_teacher = {"zero_optimization": {"stage": 0}}
    if "zero2_zero3" in scenarios:
        equivalence(out, "zero2_zero3", STUDENT_CFG, TEACHER_CFG, pair, "linear_warmup0")
    if "teacher_sharding" in scenarios:
        teacher_sharding(out, pair)
    if "zero3_zero3" in scenarios:
        persistence(out, equivalence(out, "zero3_zero3", zero3_student, TEACHER_CFG, pair, "linear_warmup1"))
    if "zero2_zero0" in scenarios:
        cosine = copy.deepcopy(STUDENT_CFG) | {"scheduler": {"type": "WarmupCosineLR", "params": {
            "warmup_num_steps": "auto", "total_num_steps": "auto", "cos_min_ratio": 0.1, "warmup_type": "linear"}}}
        equivalence(out, "zero2_zero0", cosine, zero0_teacher, pair, "cosine_warmup2")
    if "losses_and_hooks" in scenarios:
        losses_and_hooks(out, pair)
    if "seed_configs" in scenarios:
        seed_configs(out, pair)


if __name__ == "__main__":
    main()

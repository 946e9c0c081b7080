"""Several models at once on real ranks; launched by tests/test_multi_student.py.

One launch runs every scenario (each launch pays DeepSpeed's start-up). Each writes
``<out>/<name>.rank<r>.json``; the pytest side asserts on those numbers.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_multi_student import compare  # noqa: E402
from rank_results import gathered, max_diff, saved_model, saved_pair, write  # noqa: E402
from tiny_models import random_batches  # noqa: E402

from distill_kit import Distiller, StudentSpec, TrainingConfig  # noqa: E402
from distill_kit.engines import distributed  # noqa: E402
from distill_kit.training.nonfinite import NonFiniteError  # noqa: E402
from losses import LossOutput  # noqa: E402

STEPS, GAS, MBS, LENGTH = 4, 2, 2, 24
TRAINING = TrainingConfig(max_steps=STEPS, micro_batch_size=MBS, gradient_accumulation_steps=GAS,
                          lr=3e-3, weight_decay=0.01, max_grad_norm=0.5, warmup_steps=2, log_every=100)
MIXED = [{"name": "cross_entropy", "weight": 0.5}, {"name": "reverse_kl", "weight": 0.5, "temperature": 2.0}]




def count_forwards(module: torch.nn.Module) -> list[int]:
    """A counter of ``module``'s forward calls (a DeepSpeed engine's forward calls its module's)."""
    calls = [0]
    getattr(module, "module", module).register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls



class Preempted(Distiller):
    """Sends this process SIGTERM inside the teacher forward of step ``sigterm_at``."""

    sigterm_at: int | None = None

    def teacher_forward(self, batch):
        if self.sigterm_at == self.step + 1:
            self.sigterm_at = None
            os.kill(os.getpid(), signal.SIGTERM)
        return super().teacher_forward(batch)


class Poisoned(Distiller):
    """A NaN loss for the models a micro-batch's ``poison`` names."""

    def compute_loss(self, student_out, teacher_out, batch, student=None):
        loss = super().compute_loss(student_out, teacher_out, batch, student)
        return LossOutput(loss.total * float("nan"), loss.parts) if student.name in batch.get("poison", ()) else loss


def per_model(history: list[dict], key: str) -> list[list[float]]:
    return [[record[f"{name}/{key}"] for name in ("small", "big")] for record in history]


def shared_teacher(out: Path, teacher: Path, students: dict[str, Path]) -> None:
    """Two students (sizes, losses, lrs differ) of one teacher vs two single-student Distillers; then the
    shared run stopped by SIGTERM resumes exactly, its export loads, its evaluation runs the teacher once."""
    data = random_batches(STEPS * GAS, MBS, LENGTH, seed=10 + distributed.rank())
    specs = [StudentSpec("small", students["small"]),
             {"name": "big", "model": students["big"], "loss": MIXED, "lr": 2e-3}]
    multi = Distiller(teacher=teacher, students=specs, training=TRAINING)
    teacher_calls = count_forwards(multi.teacher)
    history = multi.train(data, until=STEPS - 1)
    history += multi.train(data)  # the same data reads on from step STEPS - 1
    train_calls = teacher_calls[0]
    final = {name: gathered(s.model) for name, s in multi.students.items()}

    eval_batches = random_batches(3, MBS, LENGTH, seed=50 + distributed.rank())
    report = multi.evaluate(eval_batches)
    eval_calls = teacher_calls[0] - train_calls
    exported = multi.export(out / "export")

    # SIGTERM on the last rank inside step 3; a checkpoint every 2 steps. Resumed by a new group from the
    # signal's checkpoint (resume()), and by another from the periodic one (load(step_2)): both end as `multi`.
    training = replace(TRAINING, checkpoint_dir=str(out / "group_ckpt"), save_every=2, keep_checkpoints=3)
    interrupted = Preempted(teacher=teacher, students=specs, training=training)
    if distributed.rank() == distributed.world_size() - 1:
        interrupted.sigterm_at = 3
    interrupted.train(data)
    ckpt = Path(training.checkpoint_dir)
    stopped = {"by": interrupted.stopped_by, "step": interrupted.step,
               "checkpoints": sorted(p.name for p in ckpt.iterdir() if p.name != ".distill-kit.lock"),
               "files": sorted(p.name for p in (ckpt / "step_00000003").iterdir())}
    del interrupted
    resumed = Distiller(teacher=teacher, students=specs, training=training)
    resumed_from = resumed.resume()
    resumed_step = resumed.step
    resumed.train(data)  # given whole: the checkpoint's data position skips what steps 1-3 read
    periodic = Distiller(teacher=teacher, students=specs, training=TRAINING)
    periodic.load(ckpt / "step_00000002")
    periodic_step = periodic.step
    periodic.train(data)

    separate, separate_calls, lrs = {}, 0, {}
    for name, loss, lr in (("small", "forward_kl", TRAINING.lr), ("big", MIXED, 2e-3)):
        alone = Distiller(students[name], teacher, loss=loss, training=replace(TRAINING, lr=lr))
        calls = count_forwards(alone.teacher)
        alone_history = alone.train(data)
        separate[name] = gathered(alone.student_model)
        separate_calls += calls[0]
        lrs[name] = (multi.students[name].ds_config["optimizer"]["params"]["lr"],
                     alone_history[-1]["loss"], history[-1][f"{name}/loss"])
    initial = {name: gathered(GPT2LMHeadModel.from_pretrained(path)) for name, path in students.items()}
    write(out, "shared_teacher", {
        "max_param_diff": {n: max_diff(final[n], separate[n]) for n in final},
        "max_param_change": {n: max_diff(final[n], initial[n]) for n in final},
        "teacher_forwards": train_calls, "separate_teacher_forwards": separate_calls, "micro_batches": len(data),
        "eval_teacher_forwards": eval_calls, "eval_batches": len(eval_batches), "eval_keys": sorted(report),
        "lr_and_last_losses": lrs,
        "history_keys": sorted(history[0]),
        "stopped": stopped, "resumed_from": resumed_from.name, "resumed_step": resumed_step,
        "periodic_step": periodic_step,
        "losses": per_model(multi.history, "loss"), "lrs": per_model(multi.history, "lr"),
        "resumed_losses": per_model(resumed.history, "loss"), "resumed_lrs": per_model(resumed.history, "lr"),
        "periodic_losses": per_model(periodic.history, "loss"),
        "resumed_diff": {n: max_diff(final[n], gathered(s.model)) for n, s in resumed.students.items()},
        "periodic_diff": {n: max_diff(final[n], gathered(s.model)) for n, s in periodic.students.items()},
        "export_diff": {n: max_diff(final[n], gathered(GPT2LMHeadModel.from_pretrained(exported[n])))
                        for n in final},
    })


def side_by_side(out: Path, students: dict[str, Path]) -> None:
    """Two models without a teacher vs each trained alone; mutual learning; a group checkpoint; NaN steps."""
    data = random_batches(STEPS * GAS, MBS, LENGTH, seed=20 + distributed.rank())
    specs = [StudentSpec("small", students["small"], "cross_entropy"),
             StudentSpec("big", students["big"], "cross_entropy", lr=2e-3)]
    together = Distiller(students=specs, teachers=[], training=TRAINING)
    history = together.train(data)
    params = {name: gathered(together.students[name].model) for name in together.students}
    together.save(out / "sbs_ckpt")
    alone = {}
    for spec in specs:
        single = Distiller(students=[spec], teachers=[], training=TRAINING)
        single.train(data)
        alone[spec.name] = gathered(single.students[spec.name].model)
    reloaded = Distiller(students=specs, teachers=[], training=TRAINING)
    reloaded.load(out / "sbs_ckpt")

    mutual_loss = [{"name": "cross_entropy", "weight": 1.0}, {"name": "mutual_kl", "weight": 1.0}]
    mutual = Distiller(students=[replace(s, loss=mutual_loss) for s in specs], teachers=[], training=TRAINING)
    mutual_history = mutual.train(data)
    mutual_params = {name: gathered(mutual.students[name].model) for name in mutual.students}
    try:
        Distiller(students=[StudentSpec("kl", students["small"], "forward_kl")], teachers=[], training=TRAINING)
        refusal = ""
    except ValueError as err:
        refusal = str(err)

    # Step 2: both models' losses NaN (on rank 0 only): skipped together. Step 3 (attempted as step 2 again):
    # only big's (on the last rank): the models disagree, and the run stops naming big.
    poisoned = [dict(batch) for batch in data]
    poisoned[1 * GAS] |= {"poison": ("small", "big")} if distributed.rank() == 0 else {}
    poisoned[2 * GAS + 1] |= {"poison": ("big",)} if distributed.rank() == distributed.world_size() - 1 else {}
    faulty = Poisoned(students=specs, teachers=[], training=TRAINING)
    try:
        faulty.train(poisoned)
        disagreement = ""
    except NonFiniteError as err:
        disagreement = str(err)
    initial = {name: gathered(GPT2LMHeadModel.from_pretrained(path)) for name, path in students.items()}
    write(out, "side_by_side", {
        "max_param_diff": {n: max_diff(params[n], alone[n]) for n in params},
        "max_param_change": {n: max_diff(params[n], initial[n]) for n in params},
        "first_loss": history[0]["small/loss"], "last_loss": history[-1]["small/loss"],
        "reloaded_step": reloaded.step,
        "reloaded_diff": {n: max_diff(params[n], gathered(reloaded.students[n].model)) for n in params},
        "checkpoint_dirs": sorted(p.name for p in (out / "sbs_ckpt").iterdir() if p.name != ".distill-kit.lock"),
        "checkpoint_files": sorted(p.name for p in (out / "sbs_ckpt/step_00000004").iterdir()),
        "mutual_parts": sorted(mutual_history[0]),
        "mutual_kl": [h["small/mutual_kl"] for h in mutual_history],
        "mutual_vs_alone": {n: max_diff(mutual_params[n], alone[n]) for n in params},
        "refusal": refusal,
        "disagreement": disagreement, "poisoned_history": [[h["step"], h["skipped_steps"]] for h in faulty.history],
    })


def bench_smoke(out: Path, teacher: Path, students: dict[str, Path]) -> None:
    """The benchmark helper end to end on tiny models (numbers only, nothing about speed)."""
    training = TrainingConfig(max_steps=2, micro_batch_size=MBS, log_every=100)
    specs = [StudentSpec(name, path) for name, path in students.items()]
    write(out, "bench_smoke", compare(teacher, specs, random_batches(2, MBS, LENGTH, seed=30), training, warmup=1))


def main() -> None:
    out = Path(sys.argv[1])
    distributed.init()
    teacher, small = saved_pair(out)
    students = {"small": small, "big": saved_model(out, "student_big", seed=99, width=48, layers=2)}
    shared_teacher(out, teacher, students)
    side_by_side(out, students)
    bench_smoke(out, teacher, students)


if __name__ == "__main__":
    main()

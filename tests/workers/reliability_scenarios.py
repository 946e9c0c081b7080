"""Resume, preemption, non-finite steps and uneven data on real ranks; launched by tests/test_reliability.py.

Usage: ``reliability_scenarios.py OUT SCENARIO[,SCENARIO...]`` (``resume``, ``routed_resume``, ``nonfinite``,
``killed_save``, ``after_kill``, ``stall``). Each scenario writes ``<OUT>/<name>.rank<r>.json``
(``resume`` also writes ``uneven``: its uninterrupted run is the uneven-data one).
The ``killed_save`` and ``stall`` scenarios end their process on purpose (SIGKILL, a collective timeout).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_results import gathered, max_diff, write  # noqa: E402
from tiny_models import VOCAB, gpt2_config, random_batches, save_pair  # noqa: E402

from distill_kit import Distiller, TrainingConfig  # noqa: E402
from distill_kit.data import chat  # noqa: E402
from distill_kit.data.blocks import BlockLoader  # noqa: E402
from distill_kit.engines import distributed, fingerprint  # noqa: E402
from distill_kit.training import checkpoint  # noqa: E402
from distill_kit.training.nonfinite import NonFiniteError  # noqa: E402
from losses import LossOutput  # noqa: E402

MBS, GAS, LENGTH, STEPS = 2, 2, 16, 6
# Warm-up then decay, so a schedule that drifted by one step would change every later loss.
TRAINING = TrainingConfig(max_steps=STEPS, micro_batch_size=MBS, gradient_accumulation_steps=GAS, lr=3e-3,
                          warmup_steps=2, max_grad_norm=1.0, log_every=100)
# Named parts, so that an error can say which one went bad.
PARTS = [{"name": "forward_kl", "weight": 1.0}, {"name": "cross_entropy", "weight": 0.1}]
BLOCKS = 13  # not a multiple of any global batch: each epoch drops a block, and step 3 ends an epoch exactly



def rng_draws() -> list[float]:
    """One draw from each generator a checkpoint restores: equal only if all were restored."""
    return [random.random(), float(np.random.rand()), torch.rand(1).item()]


def models(out: Path) -> tuple[Path, Path, Path]:
    """Teacher, a student with dropout (so resuming must restore the torch generator), another teacher."""
    teacher = out / "models/teacher"
    student, other = out / "models/student_dropout", out / "models/other_teacher"
    if distributed.is_main():
        save_pair(out / "models")
        torch.manual_seed(5)
        config = gpt2_config(width=32, layers=1)
        config.resid_pdrop = config.embd_pdrop = 0.1
        GPT2LMHeadModel(config).save_pretrained(student)
        GPT2LMHeadModel(gpt2_config(width=64, layers=3)).save_pretrained(other)
    distributed.barrier()
    return teacher, student, other


def block_loader(seed: int = 3, blocks: int = BLOCKS, **kwargs) -> BlockLoader:
    rows = random_batches(1, blocks, LENGTH, seed=seed)[0]
    dataset = datasets.Dataset.from_dict({k: v.tolist() for k, v in rows.items()})
    return BlockLoader(dataset, MBS, rank=distributed.rank(), world_size=distributed.world_size(), seed=1, **kwargs)


class Faulty(Distiller):
    """Turns a batch marked ``poison: "loss"`` into a NaN loss and forward_kl part, ``"grad"`` into a NaN
    gradient with a finite loss; ``sigterm_at`` sends this process SIGTERM inside that step's teacher forward;
    counts teacher forwards, and draws from Python's and NumPy's generators as data augmentation would."""

    sigterm_at: int | None = None
    teacher_forwards = 0

    def teacher_forward(self, batch):
        self.teacher_forwards += 1
        random.random(), np.random.rand()
        if self.sigterm_at == self.step + 1:
            self.sigterm_at = None
            os.kill(os.getpid(), signal.SIGTERM)
        return super().teacher_forward(batch)

    def compute_loss(self, student_out, teacher_out, batch):
        loss = super().compute_loss(student_out, teacher_out, batch)
        if batch.get("poison") == "loss":
            nan = float("nan")
            return LossOutput(loss.total * nan, {**loss.parts, "forward_kl": loss.parts["forward_kl"] * nan})
        if batch.get("poison") == "grad":  # sqrt'(0) is inf, times 0: a NaN gradient, while the value stays finite
            weights = next(self.student.module.parameters())
            return LossOutput(loss.total + 0.0 * (weights * 0.0).sum().sqrt(), loss.parts)
        return loss


def resume(out: Path, teacher: Path, student: Path, other_teacher: Path) -> Faulty:
    """Uninterrupted vs SIGTERM at step 3 on the last rank (mid-step), then resumed in a new Distiller;
    returns the uninterrupted one."""
    reference = Faulty(student, teacher, training=TRAINING)
    hash_before = reference.teacher_sha256
    reference.train(block_loader())
    ref_draws, ref_params = rng_draws(), gathered(reference.student_model)
    hash_after = fingerprint.teacher_fingerprint(reference.teacher)

    training = replace(TRAINING, checkpoint_dir=str(out / "resume_ckpt"), save_every=4)
    interrupted = Faulty(student, teacher, training=training)
    if distributed.rank() == distributed.world_size() - 1:
        interrupted.sigterm_at = 3
    interrupted.train(block_loader())
    folder = Path(training.checkpoint_dir)
    stopped = {"by": interrupted.stopped_by, "step": interrupted.step,
               "checkpoints": sorted(p.name for p in folder.iterdir() if p.name != checkpoint.LOCK)}

    resumed = Faulty(student, teacher, training=training)
    path = resumed.resume()
    resumed.train(block_loader())  # a fresh loader, as a new process builds; the checkpoint positions it
    draws, params = rng_draws(), gathered(resumed.student_model)

    # The fingerprint of the teacher as a plain module equals that of its ZeRO-3 shards: it names the weights.
    other_hash = fingerprint.teacher_fingerprint(GPT2LMHeadModel.from_pretrained(other_teacher))
    plain_hash = fingerprint.teacher_fingerprint(GPT2LMHeadModel.from_pretrained(teacher))
    try:
        checkpoint.load(checkpoint.latest_complete(training.checkpoint_dir), resumed.student, teacher_sha256=other_hash)
        refusal = ""
    except ValueError as err:
        refusal = str(err)
    write(out, "resume", {
        "stopped": stopped, "resumed_from": path.name,
        "losses": [h["loss"] for h in resumed.history], "ref_losses": [h["loss"] for h in reference.history],
        "lrs": [h["lr"] for h in resumed.history], "ref_lrs": [h["lr"] for h in reference.history],
        "steps": [h["step"] for h in resumed.history],
        "max_param_diff": max_diff(params, ref_params), "draws": draws, "ref_draws": ref_draws,
        "teacher_hash_unchanged": hash_before == hash_after, "teacher_hash": hash_before,
        "plain_module_hash": plain_hash, "other_teacher_hash": other_hash, "refusal": refusal,
    })
    return reference


def routed_loader() -> chat.ChatLoader:
    """17 conversations of 4-15 tokens, every third one teacher ``b``'s, the rest ``a``'s: the routed loader's
    epochs (one teacher per global batch, a partial batch of each teacher dropped) end at different steps than the
    block loader's, and six steps run past the first epoch."""
    generator = torch.Generator().manual_seed(7)
    rows = {name: [] for name in chat.ROUTED_FEATURES}
    for i in range(17):
        n = int(torch.randint(4, 16, (1,), generator=generator))
        ids = torch.randint(1, VOCAB, (n,), generator=generator).tolist()
        for name, value in zip(chat.ROUTED_FEATURES, (ids, [-100] + ids[1:], n, n - 1, f"record {i}",
                                                      "b" if i % 3 == 0 else "a"), strict=True):
            rows[name].append(value)
    dataset = datasets.Dataset.from_dict(rows, features=chat.ROUTED_FEATURES)
    return chat.ChatLoader(dataset, MBS, pad_id=0, rank=distributed.rank(), world_size=distributed.world_size(),
                           seed=1, route=["a", "b"])


def routed_resume(out: Path, teacher: Path, student: Path, other_teacher: Path) -> None:
    """combine: route, uninterrupted vs SIGTERM at step 3 on the last rank and resumed in a new Distiller from a
    fresh routed loader: the loader's position and each row's teacher must come back with the checkpoint."""
    teachers = [{"name": "a", "model": teacher}, {"name": "b", "model": other_teacher}]
    reference = Faulty(student, teachers=teachers, combine="route", training=TRAINING)
    reference.train(routed_loader())
    training = replace(TRAINING, checkpoint_dir=str(out / "routed_ckpt"), save_every=4)
    interrupted = Faulty(student, teachers=teachers, combine="route", training=training)
    if distributed.rank() == distributed.world_size() - 1:
        interrupted.sigterm_at = 3
    interrupted.train(routed_loader())
    resumed = Faulty(student, teachers=teachers, combine="route", training=training)
    path = resumed.resume()
    resumed.train(routed_loader())
    write(out, "routed_resume", {
        "stopped_at": interrupted.step, "resumed_from": path.name, "steps": [h["step"] for h in resumed.history],
        "losses": [h["loss"] for h in resumed.history], "ref_losses": [h["loss"] for h in reference.history],
        "max_param_diff": max_diff(gathered(resumed.student_model), gathered(reference.student_model)),
        "draws": rng_draws(),
    })


def poisoned_steps(steps: int, poison: dict[int, tuple[int, int, str]]) -> list[dict]:
    """``steps`` steps of this rank's micro-batches; ``poison[step] = (rank, micro_batch, kind)``."""
    rank = distributed.rank()
    batches = random_batches(steps * GAS, MBS, LENGTH, seed=40 + rank)
    for step, (on_rank, micro, kind) in poison.items():
        if on_rank == rank:
            batches[step * GAS + micro] = {**batches[step * GAS + micro], "poison": kind}
    return batches


def nonfinite(out: Path, teacher: Path, student: Path) -> None:
    """Skipping poisoned steps equals never seeing their data; too many in a row stop with a named error.

    ``student`` has no dropout here: the skipped steps' forwards would otherwise draw extra dropout masks.
    """
    training = replace(TRAINING, max_steps=4)
    last = distributed.world_size() - 1
    data = poisoned_steps(6, {1: (last, 1, "loss"), 3: (0, 0, "grad")})
    skipping = Faulty(student, teacher, loss=PARTS, training=training)
    skipping.train(data)
    clean = [b for i, b in enumerate(data) if i // GAS not in (1, 3)]
    plain = Faulty(student, teacher, loss=PARTS, training=training)
    plain.train(clean)
    skipped = {
        "losses": [h["loss"] for h in skipping.history], "clean_losses": [h["loss"] for h in plain.history],
        "lrs": [h["lr"] for h in skipping.history], "clean_lrs": [h["lr"] for h in plain.history],
        "skipped": [h["skipped_steps"] for h in skipping.history],
        "max_param_diff": max_diff(gathered(skipping.student_model), gathered(plain.student_model)),
        "teacher_forwards": skipping.teacher_forwards,
    }

    stopping_cfg = replace(training, max_bad_steps=2, save_every=1, checkpoint_dir=str(out / "nan_ckpt"))
    stopping = Faulty(student, teacher, loss=PARTS, training=stopping_cfg)
    try:
        stopping.train(poisoned_steps(4, {s: (last, 0, "loss") for s in (1, 2, 3)}))
        error = ""
    except NonFiniteError as err:
        error = str(err)
    intact = checkpoint.latest_complete(stopping_cfg.checkpoint_dir)
    reloaded = plain  # done with: loading the checkpoint replaces all its state
    reloaded.resume(stopping_cfg.checkpoint_dir)
    write(out, "nonfinite", skipped | {
        "error": error, "stopped_at": stopping.step, "intact": intact.name if intact else None,
        "reloaded_step": reloaded.step, "reloaded_params_equal": max_diff(gathered(reloaded.student_model),
                                                                           gathered(stopping.student_model)) == 0,
    })


def uneven(out: Path, distiller: Faulty) -> None:
    """Odd-sized data over the ranks: training (``distiller`` was trained on :data:`BLOCKS` blocks) and
    evaluation run the same teacher forwards on each rank."""
    train_forwards = distiller.teacher_forwards
    # 5 held-out blocks: the last global batch gives rank 0 one block and rank 1 none (filler, no tokens).
    metrics = distiller.evaluate(block_loader(seed=9, blocks=5, shuffle=False, drop_last=False))
    write(out, "uneven", {"train_forwards": train_forwards,
                          "eval_forwards": distiller.teacher_forwards - train_forwards,
                          "student_ppl": metrics["student"]["perplexity"]})


def killed_save(out: Path, teacher: Path, student: Path) -> None:
    """Saves at step 2, then is SIGKILLed inside the save of step 4, just before its manifest is written."""
    training = replace(TRAINING, checkpoint_dir=str(out / "killed_ckpt"), save_every=2)
    original = checkpoint.write_atomic

    def write_then_die(path: Path, text: str) -> None:
        if path.parent.name.endswith(checkpoint.checkpoint_name(4)):
            os.kill(os.getpid(), signal.SIGKILL)
        original(path, text)

    checkpoint.write_atomic = write_then_die
    Distiller(student, teacher, training=training).train(block_loader())


def after_kill(out: Path, teacher: Path, student: Path) -> None:
    """Resume what ``killed_save`` left; compare with an uninterrupted run."""
    training = replace(TRAINING, checkpoint_dir=str(out / "killed_ckpt"), save_every=2)
    left = sorted(p.name for p in Path(training.checkpoint_dir).iterdir() if p.name != checkpoint.LOCK)
    resumed = Distiller(student, teacher, training=training)
    path = resumed.resume()
    resumed.train(block_loader())
    reference = Distiller(student, teacher, training=TRAINING)
    reference.train(block_loader())
    write(out, "after_kill", {
        "left": left, "resumed_from": path.name if path else None,
        "after": sorted(p.name for p in Path(training.checkpoint_dir).iterdir() if p.name != checkpoint.LOCK),
        "losses": [h["loss"] for h in resumed.history], "ref_losses": [h["loss"] for h in reference.history],
        "max_param_diff": max_diff(gathered(resumed.student_model), gathered(reference.student_model)),
    })


def stall(out: Path, teacher: Path, student: Path) -> None:
    """The last rank stops feeding the teacher; the others must fail within the collective timeout."""
    distiller = Distiller(student, teacher, training=TRAINING)
    loader = block_loader()
    if distributed.rank() == distributed.world_size() - 1:
        distiller.train(loader, until=1)
        time.sleep(120)
    started = time.monotonic()
    try:
        distiller.train(loader)
    finally:
        print(f"rank {distributed.rank()} failed after {time.monotonic() - started:.1f}s", flush=True)


def main() -> None:
    out, scenarios = Path(sys.argv[1]), sys.argv[2].split(",")
    distributed.init(timeout_s=5.0 if "stall" in scenarios else 600.0)
    teacher, student, other_teacher = models(out)
    if "resume" in scenarios:
        uneven(out, resume(out, teacher, student, other_teacher))
    if "routed_resume" in scenarios:
        routed_resume(out, teacher, student, other_teacher)
    if "nonfinite" in scenarios:
        nonfinite(out, teacher, out / "models/student")
    if "killed_save" in scenarios:
        killed_save(out, teacher, student)
    if "after_kill" in scenarios:
        after_kill(out, teacher, student)
    if "stall" in scenarios:
        stall(out, teacher, student)


if __name__ == "__main__":
    main()

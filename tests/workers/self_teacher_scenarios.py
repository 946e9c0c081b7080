"""Self-teacher (kind self) scenarios on a real DeepSpeed engine; launched by tests/test_self_teacher.py.

Each scenario writes ``<out>/<name>.rank<r>.json``. Batches are chat rows (a prompt, an answer) with a privileged
prompt per row of another length, as ``chat.ChatLoader`` makes them with a template.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_results import gathered, max_diff, saved_pair, write  # noqa: E402

from distill_kit import Distiller, TeacherSpec, TrainingConfig  # noqa: E402
from distill_kit.data import privileged  # noqa: E402
from distill_kit.engines import distributed  # noqa: E402
from distill_kit.training.on_policy import OnPolicyConfig  # noqa: E402
from distill_kit.training.plan import DataFacts  # noqa: E402

STEPS, GAS, MBS, DECAY = 4, 2, 3, 0.9
TRAINING = TrainingConfig(max_steps=STEPS, micro_batch_size=MBS, gradient_accumulation_steps=GAS, lr=1e-2,
                          weight_decay=0.01, max_grad_norm=1.0, log_every=100, lr_schedule="constant")
TEMPLATE = {"role": "user", "content": "{prompt} {completion}"}  # the batches below are made by hand: not read


def batches(count: int, seed: int) -> list[dict]:
    """Micro-batches of ``MBS`` rows (prompt 3-8 tokens, answer 4-6), each with a privileged prompt of 2-12 tokens."""
    generator = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> torch.Tensor:
        return torch.randint(1, 96, (int(torch.randint(low, high + 1, (1,), generator=generator)),),
                             generator=generator)

    out = []
    for _ in range(count):
        rows = [(draw(3, 8), draw(4, 6), draw(2, 12)) for _ in range(MBS)]
        length = max(len(p) + len(a) for p, a, _ in rows)
        ids, labels, mask = (torch.zeros(MBS, length, dtype=torch.long), torch.full((MBS, length), -100),
                             torch.zeros(MBS, length, dtype=torch.long))
        for i, (p, a, _) in enumerate(rows):
            ids[i, :len(p) + len(a)] = torch.cat([p, a])
            labels[i, len(p):len(p) + len(a)] = a
            mask[i, :len(p) + len(a)] = 1
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels}
                   | privileged.pad_prompts([q.tolist() for _, _, q in rows], 0))
    return out


def distiller(student: Path, mode: str, out: Path | None = None, **training) -> Distiller:
    options = {"mode": mode, "privileged": TEMPLATE} | ({"decay": DECAY} if mode == "ema" else {})
    return Distiller(student, teachers=[TeacherSpec(name="self", kind="self", options=options)], loss="forward_kl",
                     training=replace(TRAINING, checkpoint_dir=None if out is None else str(out), **training),
                     data=DataFacts(kind="chat"))


def storages(module: torch.nn.Module) -> dict[int, int]:
    """Bytes of each distinct storage its parameters and buffers live in, by address."""
    tensors = list(module.parameters()) + list(module.buffers())
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def memory(out: Path, _teacher: Path, student: Path) -> None:
    """What each mode holds beyond the student: live nothing, initial one copy, ema one copy (float32: the average
    saved with the engine is the copy's own storage, plus its step counter)."""
    result = {}
    for mode in ("live", "initial", "ema"):
        d = distiller(student, mode)
        teacher = d.teachers.members["self"]
        own = storages(d.student_model)
        copy = {ptr: n for ptr, n in storages(teacher.model).items() if ptr not in own}
        engine = {ptr: n for ptr, n in storages(d.student.module).items() if ptr not in own and ptr not in copy}
        result[mode] = {"student_bytes": sum(own.values()), "teacher_bytes_beyond_student": sum(copy.values()),
                        "engine_bytes_beyond_both": sum(engine.values()),
                        "teacher_is_student": teacher.model is d.student_model}
    write(out, "memory", result)


def frozen_and_average(out: Path, _teacher: Path, student: Path) -> None:
    """``initial`` keeps its weights while the student trains; ``ema`` equals the average computed by hand from the
    student's weights after each step; ``live`` scores with the student's weights of the moment."""
    data = batches(STEPS * GAS, seed=3)
    initial = distiller(student, "initial")
    before = gathered(initial.teachers.members["self"].model)
    initial.train(data)
    result = {"initial_drift": max_diff(gathered(initial.teachers.members["self"].model), before),
              "student_change": max_diff(gathered(initial.student_model), before)}

    ema = distiller(student, "ema")
    teacher = ema.teachers.members["self"]
    by_hand = [p.detach().clone() for p in ema.student_model.parameters()]
    formula = [p.detach().double() for p in ema.student_model.parameters()]
    for step in range(1, STEPS + 1):
        ema.train(data, until=step)
        for h, f, p in zip(by_hand, formula, ema.student_model.parameters(), strict=True):
            h.lerp_(p.detach(), 1 - DECAY)
            f.mul_(DECAY).add_(p.detach().double(), alpha=1 - DECAY)
    teacher.update()  # the last step's move happens at the next forward: asked for here
    average = list(teacher.model.parameters())
    result |= {"ema_vs_hand": max_diff(average, by_hand), "ema_vs_formula": max(
                   (a.double() - f).abs().max().item() for a, f in zip(average, formula, strict=True)),
               "ema_steps": int(teacher.average.steps), "ema_distance_to_student": max_diff(
                   average, list(ema.student_model.parameters()))}
    write(out, "frozen_and_average", result)


def resume(out: Path, _teacher: Path, student: Path) -> None:
    """``ema`` (and on-policy sampling at temperature 1): 2 steps, checkpoint, a new Distiller resumes to step 4;
    against 4 uninterrupted steps: the same losses, student weights and average."""
    on_policy = OnPolicyConfig(fraction=1.0, max_new_tokens=5, temperature=1.0, pad_token_id=0, eos_token_id=0)
    data = batches(STEPS * GAS, seed=5)
    whole = distiller(student, "ema", out / "whole", save_every=2, on_policy=on_policy)
    whole.train(data)
    whole.teachers.members["self"].update()
    first = distiller(student, "ema", out / "parts", save_every=2, on_policy=on_policy)
    first.train(data, until=2)
    torch.manual_seed(1234)  # a new process's generators would differ: the checkpoint must restore them
    second = distiller(student, "ema", out / "parts", save_every=2, on_policy=on_policy)
    resumed_from = second.resume()
    second.train(data)
    second.teachers.members["self"].update()
    write(out, "resume", {
        "resumed_from": str(resumed_from), "losses": [h["loss"] for h in second.history],
        "ref_losses": [h["loss"] for h in whole.history],
        "student_diff": max_diff(gathered(second.student_model), gathered(whole.student_model)),
        "ema_diff": max_diff(list(second.teachers.members["self"].model.parameters()),
                             list(whole.teachers.members["self"].model.parameters())),
        "ema_steps": [int(d.teachers.members["self"].average.steps) for d in (second, whole)],
        "ema_moved": max_diff(list(whole.teachers.members["self"].model.parameters()),
                              list(first.teachers.members["self"].model.parameters()))})


def main() -> None:
    out, scenarios = Path(sys.argv[1]), sys.argv[2].split(",")
    distributed.init()
    teacher, student = saved_pair(out)
    for name in scenarios:
        globals()[name](out, teacher, student)


if __name__ == "__main__":
    main()

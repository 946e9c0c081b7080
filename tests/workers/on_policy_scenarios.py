"""On-policy and sequence-level KD scenarios on real ranks; launched by tests/test_on_policy.py.

Each rank's prompts have other lengths than the other rank's (rank 0 short, rank 1 long), so the ranks sample
different lengths and only the agreed padding keeps the ZeRO-3 teacher's forwards in step. Each scenario writes
``<out>/<name>.rank<r>.json``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_results import Recording, gathered, max_diff, plain_adamw, plain_kl, plain_step, saved_pair, write  # noqa: E402

from distill_kit import Distiller, TrainingConfig  # noqa: E402
from distill_kit.engines import distributed  # noqa: E402
from distill_kit.training.on_policy import OnPolicyConfig  # noqa: E402

STEPS, GAS, MBS, NEW = 3, 2, 3, 10
TRAINING = TrainingConfig(max_steps=STEPS, micro_batch_size=MBS, gradient_accumulation_steps=GAS, lr=3e-3,
                          weight_decay=0.01, max_grad_norm=0.5, log_every=100, lr_schedule="constant")


def prompt_lengths(rank: int) -> tuple[int, int]:
    return (3, 5) if rank == 0 else (8, 11)


def rank_batches(rank: int, count: int, seed: int) -> list[dict]:
    """Micro-batches of rows [prompt alone, prompt + answer, prompt + answer], right-padded with 0 (the pad)."""
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    low, high = prompt_lengths(rank)
    out = []
    for _ in range(count):
        rows = []
        for kind in ("prompt", "answer", "answer"):
            prompt = torch.randint(1, 96, (int(torch.randint(low, high + 1, (1,), generator=generator)),),
                                   generator=generator)
            answer = torch.randint(1, 96, (4,), generator=generator) if kind == "answer" else torch.empty(0).long()
            rows.append((prompt, answer))
        length = max(len(p) + len(a) for p, a in rows)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for i, (p, a) in enumerate(rows):
            ids[i, :len(p) + len(a)] = torch.cat([p, a])
            labels[i, len(p):len(p) + len(a)] = a
            mask[i, :len(p) + len(a)] = 1
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out



def greedy(model: torch.nn.Module, prompt: torch.Tensor, eos: int, steps: int) -> list[int]:
    """Plain greedy decoding without a cache: the argmax of the full forward, token after token."""
    ids = prompt.tolist()
    out = []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            out.append(token)
            if token == eos:
                break
    return out


def reverse_kl_reference(student_dir: Path, teacher_dir: Path, made: list[list[dict]], eos: int):
    """Plain PyTorch over every rank's trained-on micro-batches: each sampled row re-decoded greedily by the
    reference student *at that step*, then reverse KL(student || teacher) per counted token, summed over the
    step's micro-batches and ranks and divided by their token count; AdamW, clipping as the engine does."""
    student = GPT2LMHeadModel.from_pretrained(student_dir)
    teacher = GPT2LMHeadModel.from_pretrained(teacher_dir).eval()
    opt = plain_adamw(student.parameters(), TRAINING)
    losses, mismatched = [], 0
    for s in range(STEPS):
        step = [b for rank in made for b in rank[s * GAS:(s + 1) * GAS]]
        student.eval()
        for b in step:  # every row whose labels start right after a prompt and end at eos or NEW tokens
            for i in range(b["input_ids"].shape[0]):
                counted = (b["labels"][i] != -100).nonzero().squeeze(1)
                if len(counted) and b["sampled"][i]:
                    sample = b["input_ids"][i, counted[0]:counted[-1] + 1].tolist()
                    mismatched += sample != greedy(student, b["input_ids"][i, :counted[0]], eos, NEW)
        student.train()
        total, tokens = 0.0, 0
        for b in step:
            kl, counted = plain_kl(student, teacher, b, reverse=True)
            total, tokens = total + kl, tokens + counted
        loss = total / tokens
        losses.append(plain_step(opt, loss, TRAINING.max_grad_norm))
    return [p.detach() for p in student.parameters()], losses, mismatched


def mark_sampled(data: list[dict], made: list[dict]) -> None:
    """Which rows the sampler replaced: their tokens or labels differ from the data's."""
    for original, trained in zip(data, made, strict=True):
        width = original["input_ids"].shape[1]
        same = ((trained["input_ids"][:, :width] == original["input_ids"]).all(1)
                & (trained["labels"][:, :width] == original["labels"]).all(1)
                & (trained["attention_mask"][:, width:] == 0).all(1))
        trained["sampled"] = (~same).tolist()


def equivalence(out: Path, teacher: Path, student: Path, generation_batch_size: int = 0,
                name: str = "equivalence") -> None:
    """Greedy on-policy reverse KL, fraction 2/3 (the prompt row and one answered row), against plain PyTorch."""
    plain = GPT2LMHeadModel.from_pretrained(student)
    first = rank_batches(1, 1, seed=5)[0]
    eos = greedy(plain, first["input_ids"][0, :int(first["attention_mask"][0].sum())], -1, NEW)[2]
    on_policy = OnPolicyConfig(fraction=2 / 3, max_new_tokens=NEW, temperature=0.0, eos_token_id=eos, pad_token_id=0,
                               generation_batch_size=generation_batch_size)
    data = rank_batches(distributed.rank(), STEPS * GAS, seed=5)
    distiller = Recording(student, teacher, loss="reverse_kl", training=replace(TRAINING, on_policy=on_policy))
    calls: list[int] = []  # rows of each generate call
    model = distiller.student_model
    generate = model.generate
    model.generate = lambda *args, **kwargs: calls.append(kwargs["input_ids"].shape[0]) or generate(*args, **kwargs)
    history = distiller.train(data)
    mark_sampled(data, distiller.made)
    made = distributed.all_gather_object(distiller.made)
    ref_params, ref_losses, mismatched = reverse_kl_reference(student, teacher, made, eos)
    write(out, name, {
        "generate_calls": calls,
        "losses": [h["loss"] for h in history], "ref_losses": ref_losses, "mismatched_samples": mismatched,
        "max_param_diff": max_diff(gathered(distiller.student_model), ref_params),
        "max_param_change": max_diff(gathered(distiller.student_model), list(plain.parameters())),
        "sampled_per_batch": [sum(b["sampled"]) for b in distiller.made],
        "unpadded": [b["unpadded"] for b in distiller.made],
        "padded": [b["input_ids"].shape[1] for b in distiller.made],
        "eos_ended": sum(int((b["labels"] == eos).any(1).sum()) for b in distiller.made),
        "counted_after_eos": sum(int(((b["labels"] == eos).int().cumsum(1) - (b["labels"] == eos).int() > 0)
                                     .logical_and(b["labels"] != -100).sum()) for b in distiller.made),
    })


def equivalence_step(out: Path, teacher: Path, student: Path) -> None:
    """The same, each step's 4 chosen rows (2 micro-batches x 2) sampled together in calls of 3 rows."""
    equivalence(out, teacher, student, generation_batch_size=3, name="equivalence_step")


def packed(out: Path, teacher: Path, student: Path) -> None:
    """pack_to: the greedy on-policy run of ``equivalence``, each sampled micro-batch packed into rows of up to 32
    tokens, against the same run unpacked: the same samples, losses and weights (float32 rounding apart)."""
    plain = GPT2LMHeadModel.from_pretrained(student)
    first = rank_batches(1, 1, seed=5)[0]
    eos = greedy(plain, first["input_ids"][0, :int(first["attention_mask"][0].sum())], -1, NEW)[2]
    runs = {}
    for pack_to in (0, 32):
        on_policy = OnPolicyConfig(fraction=2 / 3, max_new_tokens=NEW, temperature=0.0, eos_token_id=eos,
                                   pad_token_id=0, pack_to=pack_to)
        distiller = Recording(student, teacher, loss="reverse_kl", training=replace(TRAINING, on_policy=on_policy))
        history = distiller.train(rank_batches(distributed.rank(), STEPS * GAS, seed=5))
        runs[pack_to] = (history, gathered(distiller.student_model), distiller.made)
    (plain_history, plain_params, plain_made), (history, params, made) = runs[0], runs[32]
    write(out, "packed", {
        "losses": [h["loss"] for h in history], "ref_losses": [h["loss"] for h in plain_history],
        "max_param_diff": max_diff(params, plain_params),
        "max_param_change": max_diff(params, list(plain.parameters())),
        "packed_rows": [b["input_ids"].shape[0] for b in made], "rows": [b["input_ids"].shape[0] for b in plain_made],
        "shapes": [list(b["input_ids"].shape) for b in made], "has_positions": all("position_ids" in b for b in made),
        "counted": [int((b["labels"] != -100).sum()) for b in made],
        "ref_counted": [int((b["labels"] != -100).sum()) for b in plain_made],
    })


def fraction_zero(out: Path, teacher: Path, student: Path) -> None:
    """fraction 0 (other on-policy settings set) trains exactly as the off-policy Distiller."""
    data = rank_batches(distributed.rank(), STEPS * GAS, seed=6)
    off = Distiller(student, teacher, loss="reverse_kl", training=TRAINING)
    off_history = off.train(data)
    zero = Recording(student, teacher, loss="reverse_kl", training=replace(
        TRAINING, on_policy=OnPolicyConfig(fraction=0.0, sampler="teacher", max_new_tokens=NEW, temperature=0.7)))
    zero_history = zero.train(data)
    write(out, "fraction_zero", {
        "same_history": off_history == zero_history, "max_param_diff": max_diff(gathered(zero.student_model),
                                                                                 gathered(off.student_model)),
        "batches_untouched": all(all(torch.equal(made[k], given[k]) for k in given)
                                 for made, given in zip(zero.made, data, strict=True)),
    })


def resume(out: Path, teacher: Path, student: Path) -> None:
    """Sampled (temperature 1) on-policy: 2 steps, checkpoint, a new Distiller resumes to step 5; against 5
    uninterrupted steps: the same samples, losses and weights."""
    on_policy = OnPolicyConfig(fraction=1.0, max_new_tokens=NEW, temperature=1.0, top_k=50, pad_token_id=0)
    training = replace(TRAINING, max_steps=5, on_policy=on_policy, save_every=2)
    data = rank_batches(distributed.rank(), 5 * GAS, seed=7)
    whole = Recording(student, teacher, loss={"name": "generalized_jsd", "beta": 0.5},
                      training=replace(training, checkpoint_dir=str(out / "whole")))
    whole.train(data)
    first = Recording(student, teacher, loss={"name": "generalized_jsd", "beta": 0.5},
                      training=replace(training, checkpoint_dir=str(out / "parts")))
    first.train(data, until=2)
    torch.manual_seed(1234)  # a new process's generators would differ: the checkpoint must restore them
    second = Recording(student, teacher, loss={"name": "generalized_jsd", "beta": 0.5},
                       training=replace(training, checkpoint_dir=str(out / "parts")))
    second.resume()
    second.train(data)
    made = first.made + second.made
    write(out, "resume", {
        "losses": [h["loss"] for h in second.history], "ref_losses": [h["loss"] for h in whole.history],
        "same_samples": len(made) == len(whole.made) and all(
            torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
            for a, b in zip(made, whole.made, strict=True)),
        "max_param_diff": max_diff(gathered(second.student_model), gathered(whole.student_model)),
        "sampled_tokens": sum(int((b["labels"] != -100).sum()) for b in whole.made),
    })


def seq_kd(out: Path, teacher: Path, student: Path) -> None:
    """The ZeRO-3 teacher samples (synced generate) greedily; its samples equal plain greedy decoding."""
    plain = GPT2LMHeadModel.from_pretrained(teacher).eval()
    on_policy = OnPolicyConfig(fraction=1.0, sampler="teacher", max_new_tokens=NEW, temperature=0.0, pad_token_id=0)
    data = rank_batches(distributed.rank(), 2 * GAS, seed=8)
    distiller = Recording(student, teacher, loss="cross_entropy",
                          training=replace(TRAINING, max_steps=2, on_policy=on_policy))
    scoring = Scoring(student, teacher, loss="cross_entropy",
                      training=replace(TRAINING, max_steps=2, on_policy=on_policy))
    history = distiller.train(data)
    scoring.train(data)
    mismatched = 0
    for b in distiller.made:
        for i in range(b["input_ids"].shape[0]):
            counted = (b["labels"][i] != -100).nonzero().squeeze(1)
            mismatched += (b["input_ids"][i, counted[0]:counted[-1] + 1].tolist()
                           != greedy(plain, b["input_ids"][i, :counted[0]], plain.config.eos_token_id, NEW))
    write(out, "seq_kd", {"steps": len(history), "mismatched_samples": mismatched,
                          "unpadded": [b["unpadded"] for b in distiller.made],
                          "teacher_forwards": distiller.teacher_forwards, "scoring_teacher_forwards": scoring.scored,
                          "max_param_diff_vs_scoring": max_diff(gathered(distiller.student_model),
                                                                gathered(scoring.student_model))})


class Scoring(Distiller):
    """Runs the teacher's scoring forward every micro-batch, as a loss that reads it would (the result unused)."""

    scored = 0
    needs_teacher = True

    def teacher_forward(self, batch):
        self.scored += 1
        return super().teacher_forward(batch)



def main() -> None:
    out, scenarios = Path(sys.argv[1]), sys.argv[2].split(",")
    distributed.init()  # before saved_pair: it writes on rank 0 only once ranks know who they are
    teacher, student = saved_pair(out)
    for name in scenarios:
        globals()[name](out, teacher, student)


if __name__ == "__main__":
    main()

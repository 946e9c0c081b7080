"""A task benchmark: recipes of post-training distillation compared on what the student gets right.

Every recipe starts from the same initial student (the run's first ``students`` entry) and takes the same
``training.max_steps`` steps of ``training.micro_batch_size`` rows, each as its own :class:`Distiller` run::

    teacher                 the frozen teacher itself (the ceiling)
    sft                     cross-entropy on the labelled answers (no teacher: the baseline)
    forward_kl              forward KL to the teacher on the labelled answers (off-policy KD)
    seq_kd                  cross-entropy on the teacher's samples of the unlabelled prompts (sequence-level KD)
    on_policy_reverse_kl    SFT warm start, then reverse KL on the student's own samples of the prompts (GKD)
    on_policy_jsd           the same with generalized JSD, beta 0.5
    mixed                   reverse KL, rows half labelled answers, half student samples of prompts (fraction 0.5)

Each is scored by greedy exact-match accuracy on held-out prompts (the task's checker, the ``exact_match``
metric) and the teacher-student KL on the held-out reference answers; the table gives the share of the
SFT-to-teacher accuracy gap each recipe closes and its wall time (warm start included).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill_kit.distiller import Distiller
from distill_kit.engines import distributed
from distill_kit.run.run_config import ConfigError, RunConfig, to_dict
from distill_kit.tasks import arithmetic
from distill_kit.tasks.evaluate import exact_match
from distill_kit.training.on_policy import OnPolicyConfig

logger = logging.getLogger(__name__)
Rows = list[tuple[list[int], list[int]]]


class Batches:
    """Micro-batches drawn from pools of encoded rows, a new shuffle each epoch: ``shares`` rows from each pool
    per batch (e.g. 16 answered + 16 prompts). Re-iterable, so the loop reads as many epochs as it needs."""

    def __init__(self, pools: list[Rows], shares: list[int], pad_id: int, seed: int):
        self.pools, self.shares, self.pad_id, self.seed, self.epoch = pools, shares, pad_id, seed, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        rng = random.Random(self.seed * 1000 + self.epoch)
        self.epoch += 1
        orders = [rng.sample(range(len(pool)), len(pool)) for pool in self.pools]
        batches = min(len(pool) // share for pool, share in zip(self.pools, self.shares, strict=True))
        for b in range(batches):
            rows = [pool[i] for pool, order, share in zip(self.pools, orders, self.shares, strict=True)
                    for i in order[b * share:(b + 1) * share]]
            yield arithmetic.collate(rows, self.pad_id)


def run(config: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Every recipe in ``config.task.recipes``; writes ``<output_dir>/report.json`` and returns its summary."""
    from distill_kit.run.cli import prepare_student

    task = config.task
    if resume:
        raise ConfigError("--resume does not apply to a task benchmark (task.name): its recipes are short; rerun it")
    if distributed.world_size() != 1:
        raise ConfigError("the task benchmark runs on one process (its recipes are sized for a CPU); "
                          "run it with plain python")
    out = Path(config.output_dir)
    if (out / "report.json").exists():
        raise ConfigError(f"{out} already holds a report.json; give a new --output_dir")
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.teacher)
    init = prepare_student(config.students[0], config, tokenizer).model
    seeds = arithmetic.split_seeds(config.training.seed)
    labelled = list(arithmetic.examples(seeds["labelled"], task.labelled))
    prompts = list(arithmetic.examples(seeds["prompts"], task.prompts))
    heldout = list(arithmetic.examples(seeds["heldout"], task.heldout))
    arithmetic.write_jsonl(out / "data" / "labelled.jsonl", labelled, with_answers=True)
    arithmetic.write_jsonl(out / "data" / "prompts.jsonl", prompts, with_answers=False)
    arithmetic.write_jsonl(out / "data" / "heldout.jsonl", heldout, with_answers=True)
    answered = [arithmetic.encode(tokenizer, item) for item in labelled]
    unanswered = [arithmetic.encode(tokenizer, item, with_answer=False) for item in prompts]
    pad, mbs, seed = tokenizer.pad_token_id, config.training.micro_batch_size, config.training.seed
    heldout_batches = [arithmetic.collate([arithmetic.encode(tokenizer, i) for i in heldout[s:s + 100]], pad)
                       for s in range(0, len(heldout), 100)]
    data = {"labelled": lambda: Batches([answered], [mbs], pad, seed),
            "prompts": lambda: Batches([unanswered], [mbs], pad, seed),
            "mixed": lambda: Batches([answered, unanswered], [mbs - mbs // 2, mbs // 2], pad, seed)}
    sampling = dataclasses.replace(config.training.on_policy, max_new_tokens=task.max_new_tokens,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)

    def train(name: str, start: str, loss: Any, batches: str, steps: int, on_policy: OnPolicyConfig | None = None):
        training = dataclasses.replace(config.training, max_steps=steps, checkpoint_dir=None,
                                       on_policy=on_policy or OnPolicyConfig())
        distiller = Distiller(start, config.teacher, loss=loss, training=training,
                              student_ds_config=config.student_ds_config, teacher_ds_config=config.teacher_ds_config)
        distiller.train(data[batches]())
        return distiller

    def score(name: str, distiller: Distiller, seconds: float) -> dict[str, Any]:
        started = time.perf_counter()
        row = {"recipe": name, "exact_match": exact_match(distiller.student_model, tokenizer, heldout),
               "answer_kl": distiller.evaluate(heldout_batches)["student"]["mean_kl"], "train_seconds": seconds}
        logger.info("%s: %s (evaluated in %.1fs)", name, row, time.perf_counter() - started)
        return row

    steps, warm = config.training.max_steps, min(task.warm_start_steps, config.training.max_steps)
    on_policy = dataclasses.replace(sampling, fraction=1.0, sampler="student")
    recipes = {
        "sft": lambda: ("cross_entropy", "labelled", None, 0),
        "forward_kl": lambda: ("forward_kl", "labelled", None, 0),
        "seq_kd": lambda: ("cross_entropy", "prompts", dataclasses.replace(sampling, fraction=1.0, sampler="teacher"),
                           0),
        "on_policy_reverse_kl": lambda: ("reverse_kl", "prompts", on_policy, warm),
        "on_policy_jsd": lambda: ({"name": "generalized_jsd", "beta": 0.5}, "prompts", on_policy, warm),
        "mixed": lambda: ("reverse_kl", "mixed", dataclasses.replace(on_policy, fraction=0.5), 0),
    }
    rows: list[dict[str, Any]] = []
    warm_start: tuple[str, float] | None = None
    for name in task.recipes:
        if name == "teacher":
            started = time.perf_counter()
            teacher = AutoModelForCausalLM.from_pretrained(config.teacher)
            rows.append({"recipe": "teacher", "exact_match": exact_match(teacher, tokenizer, heldout),
                         "answer_kl": 0.0, "train_seconds": 0.0, "eval_seconds": time.perf_counter() - started})
            continue
        loss, batches, sampler, warm_steps = recipes[name]()
        start, seconds = init, 0.0
        if warm_steps:
            if warm_start is None:  # one warm start, shared by the on-policy recipes; its time is charged to each
                started = time.perf_counter()
                sft = train("warm_start", init, "cross_entropy", "labelled", warm_steps)
                path = out / "init" / "warm_start"
                sft.student_model.save_pretrained(path)
                warm_start = (str(path), time.perf_counter() - started)
            start, seconds = warm_start
        started = time.perf_counter()
        distiller = train(name, start, loss, batches, steps - warm_steps, sampler)
        rows.append(score(name, distiller, seconds + time.perf_counter() - started))
    summary = table(rows)
    summary["config"] = to_dict(config)
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    print(format_table(summary["rows"]))
    print(f"report: {out / 'report.json'}")
    return summary


def table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows with the share of the SFT-to-teacher accuracy gap each closes (when both were run)."""
    accuracy = {row["recipe"]: row["exact_match"] for row in rows}
    if "sft" in accuracy and "teacher" in accuracy and accuracy["teacher"] > accuracy["sft"]:
        for row in rows:
            row["gap_closed"] = (row["exact_match"] - accuracy["sft"]) / (accuracy["teacher"] - accuracy["sft"])
    best = max((r for r in rows if r["recipe"] not in ("teacher", "sft")), key=lambda r: r["exact_match"],
               default=None)
    return {"rows": rows, "best": best["recipe"] if best else None}


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'recipe':<22}{'exact match':>12}{'gap closed':>12}{'answer KL':>11}{'seconds':>9}"]
    for row in rows:
        gap = f"{row['gap_closed']:.0%}" if "gap_closed" in row else "-"
        lines.append(f"{row['recipe']:<22}{row['exact_match']:>12.1%}{gap:>12}{row['answer_kl']:>11.4f}"
                     f"{row['train_seconds']:>9.0f}")
    return "\n".join(lines)

"""A teacher per conversation, demonstrated: one student distilled from two task teachers by routing (issue #23).

Two shipped tasks, each with its own teacher (one character tokenizer): ``arithmetic`` (running sums,
``distill_kit/assets/arithmetic/teacher``) and ``sorting`` (eight digits in ascending order,
``distill_kit/assets/sorting/teacher``). Each task gives ``--labelled`` answered prompts, prompts without answers
(``--prompts``: arithmetic's and sorting's, 3:1, as the harder task needs the more steps) and ``--heldout`` held-out
prompts; every chat record names its task's teacher under ``teacher``. Every row
starts from the same initial student (one shape) and takes the same ``--steps`` steps of ``--micro-batch`` rows::

    teacher:<name>       the teacher alone, on both tasks (no training: the ceilings, and what a teacher knows of
                         the other task)
    sft                  cross-entropy on both tasks' labelled answers (no teacher)
    only_arithmetic      SFT warm start, then on-policy forward KL on both tasks' prompts, every sample scored by
                         the arithmetic teacher
    only_sorting         the same, every sample scored by the sorting teacher
    routed               the same, each sample scored by its own task's teacher (combine: route)

The distilled rows read the same routed loader (``ChatLoader(route=...)``: each micro-batch one task's
conversations), so they see the same prompts in the same order; only who scores the student's samples differs.
Each row is scored by greedy exact match on both tasks' held-out prompts (each task's exact checker)::

    python benchmarks/bench_routed_tasks.py --out runs/routed_tasks                # seeds 0, 1, 2: <out>/report.json
    python benchmarks/bench_routed_tasks.py --out runs/routed_quick --seeds 0      # one quick seed

Every figure is the mean over ``--seeds`` with its range (each seed a whole comparison under ``<out>/seed_<S>/``).
At the default 900 steps every row is on the same side of its task's transition at seeds 0, 1 and 2; at 500 the
routed row's arithmetic was not yet past it (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from distill_kit import Distiller, TrainingConfig
from distill_kit.data import chat
from distill_kit.data.blocks import DataConfig
from distill_kit.run import task_benchmark
from distill_kit.tasks import arithmetic, sorting
from distill_kit.tasks.evaluate import exact_match
from distill_kit.training.on_policy import OnPolicyConfig

ASSETS = Path(__file__).resolve().parents[1] / "distill_kit" / "assets"
TASKS = {"arithmetic": arithmetic, "sorting": sorting}
TEACHERS = {name: str(ASSETS / name / "teacher") for name in TASKS}
STUDENT = {"hidden_size": 96, "intermediate_size": 288, "num_hidden_layers": 3, "num_attention_heads": 3,
           "num_key_value_heads": 3}  # configs/arithmetic.yaml's student
ROWS = ("teachers", "sft", "only_arithmetic", "only_sorting", "routed")
ROUTE = list(TASKS)


def write_data(out: Path, seed: int, labelled: int, prompts: list[int], heldout: int) -> tuple[dict[str, Path], dict]:
    """Both tasks' records, each naming its task's teacher: labelled (answered), prompts (``prompts``: each task's
    count, in TASKS' order), held-out (answered)."""
    files, items = {}, {}
    for split, counts in (("labelled", [labelled] * 2), ("prompts", prompts), ("heldout", [heldout] * 2)):
        path = out / "data" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as handle:
            for (name, task), count in zip(TASKS.items(), counts, strict=True):
                drawn = list(task.examples(task.split_seeds(seed)[split], count))
                items[name, split] = drawn
                for item in drawn:
                    record = {"prompt": item.prompt, "teacher": name}
                    if split != "prompts":
                        record["completion"] = item.answer
                    handle.write(json.dumps(record) + "\n")
        files[split] = path
    return files, items


def splits(tokenizer, train: Path, heldout: Path) -> chat.ChatSplits:
    return chat.build_splits(DataConfig(train=str(train), heldout=str(heldout), format="chat", block_size=64),
                             tokenizer, route=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="each a whole comparison (data, initial student, batch order, sampling); the table gives "
                             "each row's mean over them, its range and every seed's value")
    parser.add_argument("--labelled", type=int, default=300, help="answered prompts per task")
    parser.add_argument("--prompts", type=int, nargs=2, default=[15000, 5000], metavar=("ARITHMETIC", "SORTING"),
                        help="prompts without answers of each task; their ratio is each task's share of the distilled "
                             "rows' micro-batches (arithmetic, the harder, gets 3/4)")
    parser.add_argument("--heldout", type=int, default=500, help="held-out prompts per task")
    parser.add_argument("--steps", type=int, default=900,
                        help="every row's steps; at 500 the routed row's arithmetic stayed before its transition")
    parser.add_argument("--warm-start-steps", type=int, default=50)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared 2-core machine two threads ran a step 30x slower)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    if (args.out / "report.json").exists():
        raise SystemExit(f"{args.out} already holds a report.json; give a new --out")
    per_seed = [{"seed": seed, "rows": run_seed(args, seed, args.out / f"seed_{seed}")} for seed in args.seeds]
    report = {"rows": aggregate(per_seed), "seeds": args.seeds, "per_seed": per_seed,
              "seconds": time.perf_counter() - began, "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(format_table(report["rows"]))
    print(f"whole comparison ({len(args.seeds)} seed(s)): {report['seconds']:.0f} s; {args.out / 'report.json'}")
    return report


def aggregate(per_seed: list[dict]) -> list[dict]:
    """Each row over the seeds: per task the mean exact match, its range and each seed's value
    (``task_benchmark.over_seeds``, as the arithmetic table reports them); mean seconds."""
    rows = []
    for first in per_seed[0]["rows"]:
        found = [next(r for r in entry["rows"] if r["row"] == first["row"]) for entry in per_seed]
        row = {"row": first["row"], "train_seconds": sum(r["train_seconds"] for r in found) / len(found)}
        for task in TASKS:
            row |= task_benchmark.over_seeds(task, [r[task] for r in found])
        rows.append(row)
    return rows


def run_seed(args: argparse.Namespace, seed: int, out: Path) -> list[dict]:
    """One whole comparison at ``seed``: its rows, each with both tasks' exact match and its seconds."""
    began = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(TEACHERS["arithmetic"])
    for name in TASKS:  # routing compares logits id by id: one tokenizer for every teacher and the student
        assert AutoTokenizer.from_pretrained(TEACHERS[name]).get_vocab() == tokenizer.get_vocab(), name
    files, items = write_data(out, seed, args.labelled, args.prompts, args.heldout)
    answered = splits(tokenizer, files["labelled"], files["heldout"])
    unanswered = splits(tokenizer, files["prompts"], files["heldout"]).train
    pad, mbs = chat.pad_id_of(tokenizer), args.micro_batch

    config = AutoConfig.from_pretrained(TEACHERS["arithmetic"])
    config.update(STUDENT)
    torch.manual_seed(seed)
    init = out / "init" / "student"
    AutoModelForCausalLM.from_config(config).save_pretrained(init)
    tokenizer.save_pretrained(init)

    def training(steps: int, on_policy: bool) -> TrainingConfig:
        sampling = OnPolicyConfig(fraction=1.0, sampler="student", temperature=1.0, cache="dynamic",
                                  max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=pad) if on_policy else OnPolicyConfig()
        return TrainingConfig(max_steps=steps, micro_batch_size=mbs, lr=args.lr, betas=(0.9, 0.98),
                              warmup_steps=min(20, steps), lr_schedule="cosine", log_every=50, seed=seed,
                              on_policy=sampling)

    def score(model) -> dict[str, float]:
        return {name: exact_match(model, tokenizer, items[name, "heldout"], args.max_new_tokens, check=task.check)
                for name, task in TASKS.items()}

    # single-teacher runs read the routed batches too (their teacher ignores teacher_id): the same prompts, same order
    labelled_batches = lambda: chat.ChatLoader(answered.train, mbs, pad_id=pad, seed=seed, route=ROUTE)  # noqa: E731
    prompt_batches = lambda: chat.ChatLoader(unanswered, mbs, pad_id=pad, seed=seed, route=ROUTE)  # noqa: E731
    rows, warm = [], None
    for row in args.rows:
        if row == "teachers":
            for name, path in TEACHERS.items():
                started = time.perf_counter()
                rows.append({"row": f"teacher:{name}", **score(AutoModelForCausalLM.from_pretrained(path)),
                             "train_seconds": 0.0, "eval_seconds": time.perf_counter() - started})
            continue
        started = time.perf_counter()
        if row == "sft":
            distiller = Distiller(str(init), TEACHERS["arithmetic"], loss="cross_entropy",
                                  training=training(args.steps, on_policy=False))
            distiller.train(labelled_batches())
            seconds = time.perf_counter() - started
        else:
            if warm is None:  # one SFT warm start, shared by the distilled rows; its time is charged to each
                sft = Distiller(str(init), TEACHERS["arithmetic"], loss="cross_entropy",
                                training=training(args.warm_start_steps, on_policy=False))
                sft.train(labelled_batches())
                warm = (out / "init" / "warm_start", time.perf_counter() - started)
                sft.student_model.save_pretrained(warm[0])
                started = time.perf_counter()
            steps = training(args.steps - args.warm_start_steps, on_policy=True)
            if row == "routed":
                distiller = Distiller(str(warm[0]), teachers=[{"name": n, "model": TEACHERS[n]} for n in ROUTE],
                                      combine="route", loss="forward_kl", training=steps)
            else:
                distiller = Distiller(str(warm[0]), TEACHERS[row.removeprefix("only_")], loss="forward_kl",
                                      training=steps)
            distiller.train(prompt_batches())
            seconds = warm[1] + time.perf_counter() - started
        evaluated = time.perf_counter()
        rows.append({"row": row, **score(distiller.student_model), "train_seconds": seconds,
                     "eval_seconds": time.perf_counter() - evaluated})
        print(json.dumps({"seed": seed} | rows[-1]), flush=True)
    print(f"seed {seed}: {time.perf_counter() - began:.0f} s", flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    """Mean exact match over the seeds with its range, per task."""
    lines = [f"{'row':<20}{'arithmetic':>12}{'range':>15}{'sorting':>10}{'range':>15}{'train s':>9}"]
    for r in rows:
        spans = [f"{r[t + '_min']:.1%}-{r[t + '_max']:.1%}" for t in TASKS]
        lines.append(f"{r['row']:<20}{r['arithmetic']:>12.1%}{spans[0]:>15}{r['sorting']:>10.1%}{spans[1]:>15}"
                     f"{r['train_seconds']:>9.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Student quality from a sampled store (RS-KD) against full logits and against top-k at the same bytes (issue 41).

Two tasks, three teachers, seeds 0, 1, 2 (``training.seed``: the student's initial weights and the order of the
batches; the stores are the same at every seed). Every (task, teacher, seed) cell is its own ``scripts/distill.py``
process, ``--jobs`` at once (one CPU thread each, or ``--device cuda``: every cell on the one GPU).

Tasks:

* ``default``: the embedded default's data and settings (``--steps`` instead of its 400); a student of the default's
  shape from random weights (a store has no weights to cut a student from).
* ``arithmetic``: the arithmetic task's teacher (``distill_kit/assets/arithmetic/teacher``) and its student shape and
  optimiser (``configs/arithmetic.yaml``), trained on ``--arithmetic-train`` worked answers and scored on 500
  held-out ones. A store holds text blocks (``capture_teacher.py`` reads no chat data), so each conversation is its
  chat-template text, one a row (``--no-packing``), and every token of it counts (the prompt's too).

Teachers, all the task's own teacher:

* ``full``: the teacher in process, its whole distribution;
* ``topk``: a top-k store at the sampled store's bytes (fp16 values, ids in the fewest bytes the vocabulary needs,
  fp16 tail; :data:`STORES`);
* ``sampled``: a sampled store, K draws at T = 1, fp16 values, ids as above, uint8 counts (5 K bytes a token with
  two-byte ids, 4 K with one-byte ones).

Each cell reports the student's held-out perplexity (the issue's metric) and its mean KL(teacher || student) on the
held-out tokens (``mean_kl``, scored after the run with the teacher in process: the quantity distillation
minimises); the table gives each teacher's mean and range over the seeds, and each seed's difference from the
full-logit student of the same seed (same initial weights, same batches: a paired difference, free of the spread
between seeds). Forward KL at T = 1 throughout.

    OMP_NUM_THREADS=1 python benchmarks/quality_sampled.py --tasks default arithmetic --jobs 5 --device cuda \\
        --out runs/q41                                  # the grid on one GPU (~6 min)
    OMP_NUM_THREADS=1 python benchmarks/quality_sampled.py --tasks default --seeds 0 --steps 3 --max-blocks 16 \\
        --arithmetic-train 64 --out /tmp/q41-tiny       # a smoke run on the CPU

Writes ``<out>/quality_sampled.json``; each cell's log and ``report.json`` under ``<out>/<task>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEACHERS = {"default": ROOT / "distill_kit" / "assets" / "default" / "teacher",
            "arithmetic": ROOT / "distill_kit" / "assets" / "arithmetic" / "teacher"}
STUDENTS = {
    "default": ("[{name: distilled, init: {hidden_size: 128, num_hidden_layers: 4, num_attention_heads: 2, "
                "num_key_value_heads: 2, intermediate_size: 352, tie_word_embeddings: true}, loss: forward_kl}]"),
    "arithmetic": ("[{name: distilled, init: {hidden_size: 96, intermediate_size: 288, num_hidden_layers: 3, "
                   "num_attention_heads: 3, num_key_value_heads: 3}, loss: forward_kl}]")}
TRAINING = {"default": [],
            "arithmetic": ["training.micro_batch_size=64", "training.lr=3.0e-3", "training.betas=[0.9,0.98]",
                           "training.warmup_steps=20", "training.lr_schedule=cosine"]}
BLOCK_SIZE = {"default": 256, "arithmetic": 64}
PACKING = {"default": [], "arithmetic": ["--no-packing"]}
STORES = {"default": {"topk": ["--k", "24"], "sampled": ["--targets", "sampled", "--k", "20", "--temperature", "1.0"]},
          "arithmetic": {"topk": ["--k", "5"], "sampled": ["--targets", "sampled", "--k", "4", "--temperature", "1.0"]}}
"""Per task, the two stores at (about) equal bytes a token: the default's 1,024-token vocabulary at ~100 bytes (top-k
24 with its tail: 24 x 4 + 2 = 98; 20 draws: 20 x 5 = 100); the arithmetic teacher's 19 tokens at ~20 (its whole
distribution is 38 bytes in fp16, so 100 bytes would hold it twice over; its ids take one byte: top-k 5 with its
tail 5 x 3 + 2 = 17, 4 draws 4 x 4 = 16)."""
NAMES = ("full", "topk", "sampled")


def run(command: list[str], log: Path, device: str) -> float:
    """One child process (its output in ``log``); its wall seconds. On the CPU it sees no GPU."""
    # keep any PYTHONPATH already set: on the GPU machine it is where DeepSpeed and the other wheels live
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"{command[0]} failed (exit {done.returncode}); its log: {log}")
    return time.perf_counter() - start


def data_files(task: str, out: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The task's training and held-out files."""
    if task == "default":
        from distill_kit.data.corpus import write_corpus

        splits = write_corpus(out / "cache" / "corpus")
        return Path(splits.train), Path(splits.heldout)
    from transformers import AutoTokenizer

    from distill_kit.tasks import arithmetic

    tokenizer, seeds = AutoTokenizer.from_pretrained(TEACHERS["arithmetic"]), arithmetic.split_seeds(0)
    paths = []
    for name, seed, count in (("train", seeds["labelled"], args.arithmetic_train), ("heldout", seeds["heldout"], 500)):
        path = out / "data" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as handle:
            for item in arithmetic.examples(seed, count):
                text = tokenizer.apply_chat_template(arithmetic.messages(item), tokenize=False)
                handle.write(json.dumps({"text": text}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def score(run_dir: Path, task: str, overrides: list[str]) -> float:
    """Mean KL(teacher || student) over the run's held-out tokens (its own held-out loader, the task's teacher in
    process): the score a store-trained run's report cannot give (its teacher is the store, which holds no
    held-out targets)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distill_kit.run import cli, run_config
    from distill_kit.training.evaluation import token_statistics
    from distill_kit.training.plan import DataFacts

    with tempfile.TemporaryDirectory() as scratch:
        config = run_config.load(None, [*overrides, f"output_dir={scratch}"])
        _, heldout = cli.build_loaders(config, cli.prepare_data(config), AutoTokenizer.from_pretrained(TEACHERS[task]),
                                       DataFacts())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    student = AutoModelForCausalLM.from_pretrained(run_dir / "students" / "distilled").to(device).eval()
    teacher = AutoModelForCausalLM.from_pretrained(TEACHERS[task]).to(device).eval()
    kls = []
    with torch.no_grad():
        for batch in heldout:
            batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            kls.append(token_statistics(student(**inputs).logits, teacher(**inputs).logits, batch)["kl"])
    return float(torch.cat(kls).double().mean())


def complete(store: Path) -> bool:
    manifest = store / "manifest.json"
    return manifest.exists() and json.loads(manifest.read_text())["complete"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", choices=sorted(TEACHERS), default=["default", "arithmetic"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once, each its own process")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of every cell")
    parser.add_argument("--max-blocks", type=int, default=512, help="the default task's training blocks (stored)")
    parser.add_argument("--arithmetic-train", type=int, default=20000, help="arithmetic training conversations")
    parser.add_argument("--only", nargs="+", help="run only these cells (e.g. default_full_s2), collect nothing")
    parser.add_argument("--collect", action="store_true", help="run nothing: the table of the cells already done")
    parser.add_argument("--score", nargs=3, metavar=("RUN_DIR", "TASK", "OVERRIDES_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.score:  # a cell's held-out KL, in a process of its own (the cells run side by side)
        run_dir, task, overrides = args.score
        print(json.dumps({"mean_kl": score(Path(run_dir), task, json.loads(overrides))}))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    files = {task: data_files(task, args.out / task, args) for task in args.tasks}

    def capture(job: tuple[str, str]) -> None:
        task, name = job
        train, heldout = files[task]
        store = args.out / task / name
        if not complete(store):
            blocks = args.max_blocks if task == "default" else args.arithmetic_train
            run(["scripts/capture_teacher.py", "--teacher", str(TEACHERS[task]), "--data", str(train), "--heldout",
                 str(heldout), "--block-size", str(BLOCK_SIZE[task]), "--max-blocks", str(blocks), *PACKING[task],
                 "--dtype", "fp32", "--values-dtype", "fp16", *STORES[task][name], "--out", str(store)],
                args.out / task / f"capture_{name}.log", args.device)

    def cell(job: tuple[str, str, int]) -> dict | None:
        try:
            return one_cell(job)
        except (RuntimeError, OSError, KeyError, ValueError) as err:  # one failed cell: the others still count
            print(f"cell {job}: {err}", flush=True)
            return None

    def one_cell(job: tuple[str, str, int]) -> dict:
        task, name, seed = job
        folder, (train, heldout) = args.out / task / f"{name}_s{seed}", files[task]
        teacher = ["--teacher", str(TEACHERS[task])] if name == "full" else [
            "--teacher", str(args.out / task / name), "--tokenizer", str(TEACHERS[task])]
        data = [] if task == "default" else [f"data.train={train}", f"data.heldout={heldout}",
                                             f"data.block_size={BLOCK_SIZE[task]}", "data.packing=false",
                                             f"data.max_train_blocks={args.arithmetic_train}",
                                             "data.max_heldout_blocks=500"]
        if task == "default":
            data.append(f"data.max_train_blocks={args.max_blocks}")
        overrides = [*TRAINING[task], *data, f"training.seed={seed}", f"training.max_steps={args.steps}",
                     f"cache_dir={args.out / task / 'cache'}"]
        seconds = None
        if not (folder / "report.json").exists():
            if args.collect:
                raise RuntimeError("not run")
            seconds = run(["scripts/distill.py", *teacher, "--students", STUDENTS[task], *overrides,
                           f"output_dir={folder}"], args.out / task / f"{name}_s{seed}.log", args.device)
        scored = folder / "heldout_kl.json"
        if not scored.exists():
            if args.collect:
                raise RuntimeError("not scored")
            log = args.out / task / f"{name}_s{seed}_score.log"
            run([str(Path(__file__).relative_to(ROOT)), "--out", str(args.out), "--score", str(folder), task,
                 json.dumps(overrides)], log, args.device)
            scored.write_text(log.read_text().strip().splitlines()[-1])
        row = json.loads((folder / "report.json").read_text())["summary"]["students"]["distilled"]
        return {"task": task, "teacher": name, "seed": seed, "perplexity": row["perplexity"],
                "mean_kl": json.loads(scored.read_text())["mean_kl"], "seconds": seconds}

    with ThreadPoolExecutor(args.jobs) as pool:
        if not args.collect:
            list(pool.map(capture, [(task, name) for task in args.tasks for name in STORES[task]]))
        # seed by seed: a grid cut short by its time limit leaves whole seeds of both tasks
        jobs = [(task, name, seed) for seed in args.seeds for task in args.tasks for name in NAMES]
        if args.only:
            jobs = [job for job in jobs if f"{job[0]}_{job[1]}_s{job[2]}" in args.only]
        cells = [c for c in pool.map(cell, jobs) if c is not None]
        print(f"{len(cells)} of {len(jobs)} cells done, {time.perf_counter() - began:.0f} s", flush=True)
    if args.only:
        print(json.dumps(cells))
        return
    table: dict = {}
    for task in args.tasks:
        table[task] = {}
        full = {c["seed"]: c for c in cells if c["task"] == task and c["teacher"] == "full"}
        for name in NAMES:  # the seeds whose full-logit cell is there too
            rows = [c for c in cells if c["task"] == task and c["teacher"] == name and c["seed"] in full]
            if not rows:
                continue
            table[task][name] = {metric: {"per_seed": [r[metric] for r in rows],
                                          "mean": statistics.mean(r[metric] for r in rows),
                                          "min": min(r[metric] for r in rows), "max": max(r[metric] for r in rows),
                                          # the same seed's full-logit student: same initial weights and batches
                                          "minus_full_per_seed": [r[metric] - full[r["seed"]][metric] for r in rows]}
                                 for metric in ("perplexity", "mean_kl")}
        table[task]["store_stats"] = {name: json.loads((args.out / task / name / "manifest.json").read_text())["stats"]
                                      for name in STORES[task] if complete(args.out / task / name)}
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "table": table, "cells": cells,
              "wall_s": time.perf_counter() - began}
    (args.out / "quality_sampled.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()

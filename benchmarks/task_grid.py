"""The arithmetic task table with every (column, recipe, seed) as its own process, many at once.

``python scripts/distill.py --config configs/arithmetic.yaml`` runs its recipes and seeds one after another in one
process; that is the CPU's way. A GPU runs these tiny models far below its capacity, so here each cell of the
grid is one CLI run (``--task.recipes '[r]' --task.seeds '[s]'`` and its column's settings), ``--jobs`` of them at
a time, and the cells are merged per column with the task benchmark's own ``task_benchmark.aggregate`` (mean over the
seeds, range, each seed's value). Columns (``COLUMNS``): ``fp32`` is the config as shipped (what the CPU table
runs); ``bf16`` and ``fp8`` run student and teacher in bf16, the teacher's linear layers in FP8 for ``fp8``::

    python benchmarks/task_grid.py --out runs/grid --jobs 16 \\
        --recipes teacher sft seq_kd on_policy_forward_kl forward_kl on_policy_reverse_kl on_policy_jsd mixed \\
        --also bf16:seq_kd,on_policy_forward_kl fp8:seq_kd,on_policy_forward_kl

Each cell's log and report stay under ``<out>/<column>/<recipe>_<seed>/``; the merged tables go to
``<out>/grid.json`` (rewritten as cells finish) and are printed. A failed cell is reported, not fatal.

Every other option is a run config override passed to each cell. With ``--eval.harness.tasks
'[distill_kit_arithmetic]'`` each cell also scores its student (the teacher cell: the teacher) with
lm-evaluation-harness on its seed's held-out prompts, the checker's, and each row carries ``harness_exact_match``
over the seeds beside the checker's ``exact_match`` (per example: each cell's ``seed_<S>/answers/<recipe>.jsonl``
and ``seed_<S>/harness/<recipe>/samples_distill_kit_arithmetic.jsonl``)::

    python benchmarks/task_grid.py --out runs/grid_harness --jobs 9 \\
        --recipes teacher sft seq_kd on_policy_forward_kl --eval.harness.tasks '[distill_kit_arithmetic]'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill_kit.run import task_benchmark  # noqa: E402

COLUMNS = {
    "fp32": [],
    "bf16": ["--training.dtype", "bf16", "--training.teacher_precision", "bf16"],
    "fp8": ["--training.dtype", "bf16", "--training.teacher_precision", "fp8"],
}


CELL_KEYS = {"task.seeds": "--seeds", "training.seed": "--seeds", "task.recipes": "--recipes", "output_dir": "--out",
             "config": "--config"}
"""What each cell's command sets itself (its seed, recipe, folder and config), with the grid's option for it: an
override of one would replace the cell's own value in every cell, silently (the CLI takes the last)."""


def overridden_cell_keys(overrides: list[str]) -> list[str]:
    """The CLI overrides (``--key value``, ``--key=value``, ``key=value``) that name a key of :data:`CELL_KEYS`, each
    as an error naming the grid's option instead."""
    problems = []
    for token in overrides:
        if not (token.startswith("--") or ("=" in token and not token.startswith("-"))):
            continue
        key = token.removeprefix("--").split("=", 1)[0]
        if key in CELL_KEYS:
            problems.append(f"{token.split('=', 1)[0]}: each cell sets {key} itself (its seed, recipe, folder and "
                            f"config), so an override would replace it in every cell; give {CELL_KEYS[key]} instead")
    return problems


def cells(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    grid = [(c, r, s) for c in args.columns for r in args.recipes for s in args.seeds]
    for extra in args.also:  # "fp8:seq_kd,on_policy_forward_kl"
        column, recipes = extra.split(":")
        grid += [(column, r, s) for r in recipes.split(",") for s in args.seeds]
    return grid


def run_cell(cell: tuple[str, str, int], args: argparse.Namespace) -> dict | None:
    column, recipe, seed = cell
    out = args.out / column / f"{recipe}_{seed}"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "scripts" / "distill.py"), "--config", str(args.config),
               "--output_dir", str(out), "--task.recipes", f"[{recipe}]", "--task.seeds", f"[{seed}]",
               *COLUMNS[column], *args.overrides]
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    with open(f"{out}.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    report = out / "report.json"
    if done.returncode or not report.exists():
        print(f"cell {column}/{recipe}/{seed} failed (exit {done.returncode}); log: {out}.log", flush=True)
        return None
    print(f"cell {column}/{recipe}/{seed} done", flush=True)
    return json.loads(report.read_text())


def merge(grid: list[tuple[str, str, int]], reports: dict, verbose: bool = False) -> dict:
    """Per column and recipe: ``task_benchmark.aggregate`` of the cells' own seed tables (each cell's ``per_seed``: one
    seed) over the seeds whose cell finished (``seeds`` says which), harness columns included; the gap closed where
    the column has SFT and teacher rows at the same seeds."""
    merged = {}
    for column in dict.fromkeys(c for c, _, _ in grid):
        rows = []
        for recipe in dict.fromkeys(r for c, r, _ in grid if c == column):
            done = [reports[c, r, s]["per_seed"][0] for c, r, s in grid
                    if (c, r) == (column, recipe) and reports.get((c, r, s))]
            if done:
                rows.append(task_benchmark.aggregate(done)["rows"][0] | {"seeds": [d["seed"] for d in done]})
        merged[column] = task_benchmark.table(rows)
        if verbose and rows:
            print(f"\n{column}:\n{task_benchmark.format_table(rows, rows[0]['seeds'])}")
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "arithmetic.yaml")
    parser.add_argument("--recipes", nargs="+", default=["teacher", "sft", "seq_kd", "on_policy_forward_kl"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--columns", nargs="+", choices=list(COLUMNS), default=["fp32"])
    parser.add_argument("--also", nargs="*", default=[], metavar="COLUMN:RECIPE,...",
                        help="more cells: these recipes (every seed) in that column")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads of each cell")
    args, args.overrides = parser.parse_known_args()  # the rest: CLI overrides for every cell (--training.x y)
    problems = overridden_cell_keys(args.overrides)
    if problems:
        parser.error("; ".join(problems))  # before any cell runs or any folder is made
    grid, began, reports, lock = cells(args), time.perf_counter(), {}, threading.Lock()
    args.out.mkdir(parents=True, exist_ok=True)

    def write(verbose: bool = False) -> dict:
        merged = {"columns": merge(grid, reports, verbose), "seconds": time.perf_counter() - began,
                  "settings": {c: COLUMNS[c] + args.overrides for c in dict.fromkeys(c for c, _, _ in grid)},
                  "cells": [{"column": c, "recipe": r, "seed": s, "ok": bool(reports.get((c, r, s)))}
                            for c, r, s in grid]}
        (args.out / "grid.json").write_text(json.dumps(merged, indent=2))
        return merged

    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_cell, cell, args): cell for cell in grid}
        for future in as_completed(futures):
            with lock:
                reports[futures[future]] = future.result()
                write()  # so that a run cut short still leaves every finished cell's figures
    merged = write(verbose=True)
    print(f"{len(grid)} cells, {sum(c['ok'] for c in merged['cells'])} done, {merged['seconds']:.0f} s; "
          f"{args.out / 'grid.json'}")


if __name__ == "__main__":
    main()

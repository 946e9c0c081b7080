"""What distillation adds to a quantized student: the teacher, PTQ, QAT without a teacher, and QAD (CPU or one GPU).

Four rows per task, each scored on the same held-out data, the quantized ones as their *exported* low-bit models
(``engines/quantize.py``: what would be served):

- ``teacher``: the full-precision model;
- ``ptq``: the teacher quantized as it is, no training (torchao's PTQ with the scheme's config);
- ``qat``: the teacher fake-quantised and trained on the data's labels alone (cross entropy), then exported;
- ``qad``: the same student trained on the teacher's logits (forward KL), then exported.

QAT and QAD are two students of one ``Distiller`` run (one teacher forward feeds both): the same initial weights,
batches, steps and learning rate; only the target differs. Per seed (the batch order), the share of the PTQ gap QAD
recovers is ``(ppl_ptq - ppl_qad) / (ppl_ptq - ppl_teacher)``; each quantized row also gives its mean KL from the
teacher and top-1 agreement with it on the held-out tokens (how far from the model it replaces, which labels can
improve on perplexity without being closer to: on data the teacher never trained on they teach the data). The table
gives means over the seeds with their range.

Each quantized row also gives the share of its quantised weights whose int4 value differs from PTQ's (``bins
moved``): training changes the served model only where a weight crosses a rounding boundary, and a run too short
or too gentle to move any leaves the exported model PTQ's, whatever its loss did.

Tasks: ``default`` (the embedded corpus and its 6.7M teacher; held-out perplexity on the held-out modules, which
neither the teacher nor the students trained on) and ``arithmetic`` (the task teacher; perplexity on the held-out
answers and greedy exact match by the task's checker). ``--train-slice`` says what the default task's students
train on: ``teacher`` (default) — blocks of the teacher's own training text (the training split past the first 512
blocks), the QAD setting: the student re-learns the function the teacher has, on the data it was made with;
``unseen`` — the default student's slice (the first 512 blocks), text the teacher never trained on, where labels
teach the data (QAT then improves on the teacher's own perplexity by fine-tuning, not by recovering it).

The grid (tasks x ``--schemes`` x ``--seeds``) runs one process per cell, ``--jobs`` at a time
(``OMP_NUM_THREADS=1`` each); ``--device cuda`` trains and scores on the GPU (a scoring that fails there is redone
on the CPU, and the cell says so). ``--sweep-lrs`` adds the first cell at other learning rates::

    OMP_NUM_THREADS=1 python benchmarks/qad_quality.py --tasks default arithmetic --seeds 0 1 2 \\
        --schemes int4_weight_only int8_dynamic_act_int4_weight --jobs 5 --out runs/qad_quality

Writes ``<out>/qad_quality.json`` (and ``<out>/cells/*.json``, one per cell, as each finishes) and prints the
tables; exported folders go under ``--work`` (default ``<out>/work``). ``--steps``, ``--lr``, ``--micro-batch``,
``--group-size`` size the run; ``--max-heldout`` limits the evaluation (the tests run the script at tiny sizes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEACHERS = {"default": ROOT / "distill_kit/assets/default/teacher",
            "arithmetic": ROOT / "distill_kit/assets/arithmetic/teacher"}
SCHEMES = ("int4_weight_only", "int8_dynamic_act_int4_weight")
ROWS = ("teacher", "ptq", "qat", "qad")
TEACHER_BLOCKS_FROM = 512
"""The embedded default's teacher trained on the training split past its first 512 blocks (``scripts/
train_teacher.py --student-blocks 512``): the first 512 are the default student's slice, text it never saw."""


def default_data(args: argparse.Namespace, out: Path, seed: int) -> tuple[Any, Any, Any]:
    """The embedded default's training blocks (``--train-slice``) and held-out blocks, tokenised as
    ``scripts/distill.py`` tokenises them."""
    from transformers import AutoTokenizer

    from distill_kit.data import blocks
    from distill_kit.run import cli, run_config

    config = run_config.load(None, [f"output_dir={out}", f"training.seed={seed}", "data.max_train_blocks=null",
                                    f"data.max_heldout_blocks={args.max_heldout}"])
    splits = blocks.build_splits(cli.prepare_data(config), AutoTokenizer.from_pretrained(TEACHERS["default"]))
    first = TEACHER_BLOCKS_FROM if args.train_slice == "teacher" else 0
    last = len(splits.train) if args.train_slice == "teacher" else TEACHER_BLOCKS_FROM
    last = min(last, first + args.max_train)
    return (blocks.BlockLoader(splits.train.select(range(first, last)), args.micro_batch, seed=seed),
            blocks.BlockLoader(splits.heldout, args.micro_batch, shuffle=False, drop_last=False), None)


def arithmetic_data(args: argparse.Namespace, out: Path, seed: int) -> tuple[Any, Any, Any]:
    """Labelled arithmetic answers (both students train on the same rows) and the held-out prompts with answers."""
    from transformers import AutoTokenizer

    from distill_kit.data import chat
    from distill_kit.run import task_benchmark
    from distill_kit.tasks import arithmetic

    tokenizer = AutoTokenizer.from_pretrained(TEACHERS["arithmetic"])
    seeds = arithmetic.split_seeds(seed)
    labelled = list(arithmetic.examples(seeds["labelled"], args.labelled))
    heldout = list(arithmetic.examples(seeds["heldout"], args.max_heldout))
    files = {name: arithmetic.write_jsonl(out / "data" / f"{name}.jsonl", items, with_answers=True)
             for name, items in (("labelled", labelled), ("heldout", heldout))}
    split = task_benchmark.chat_split(tokenizer, files["labelled"], files["heldout"])
    pad = chat.pad_id_of(tokenizer)
    return (chat.ChatLoader(split.train, args.micro_batch, pad_id=pad, seed=seed),
            chat.ChatLoader(split.heldout, 100, pad_id=pad, shuffle=False, drop_last=False),
            (tokenizer, heldout))


def forward(model):
    return lambda batch: model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def int_values(model) -> dict[str, Any]:
    """Each converted linear's integer weights (torchao's ``IntxUnpackedToInt8Tensor.qdata``), by layer name."""
    return {name: module.weight.qdata for name, module in model.named_modules()
            if hasattr(getattr(module, "weight", None), "qdata")}


def bins_moved(model, ptq_values: dict[str, Any]) -> float:
    """The share of the quantised weights whose integer value differs from PTQ's: what training changed in the
    served model (a weight that never crosses a rounding boundary exports as PTQ exported it)."""
    values = int_values(model)
    changed = sum(int((values[name] != ptq).sum()) for name, ptq in ptq_values.items())
    return changed / sum(ptq.numel() for ptq in ptq_values.values())


def score(teacher_dir: Path, exported: dict[str, Path], spec: Any, heldout: Any, checker: Any,
          device: Any) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """The four rows on the held-out data, on ``device``: the teacher, PTQ (the teacher converted with the scheme's
    config) and the two exported students loaded back as served (low-bit weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from distill_kit.engines import quantize
    from distill_kit.tasks import arithmetic
    from distill_kit.tasks.evaluate import accuracy, checked_answers
    from distill_kit.training import evaluation

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).to(device).eval()
    models = {"ptq": quantize.convert(teacher, spec),
              **{name: AutoModelForCausalLM.from_pretrained(path, device_map=device.type).eval()
                 for name, path in exported.items()}}
    with torch.no_grad(), quantize.unpatched_linear():
        figures = evaluation.evaluate_students({n: forward(m) for n, m in models.items()}, forward(teacher), heldout,
                                               device)
        rows = {name: {key: figures[name][key] for key in ("perplexity", "mean_kl", "top1_agreement")}
                for name in ("ptq", "qat", "qad")}
        rows["teacher"] = {"perplexity": figures["teacher"]["perplexity"], "evaluated_on": device.type}
        if checker is not None:
            tokenizer, items = checker
            for name, model in {"teacher": teacher, **models}.items():
                rows[name]["exact_match"] = accuracy(checked_answers(model, tokenizer, items, 32, arithmetic.check))
    return rows, models


def run_cell(task: str, scheme: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One cell of the grid: QAT and QAD trained in one run, then the four rows scored as served."""
    import torch

    from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig
    from distill_kit.config import DeepSpeedSettings, QuantizeConfig
    from distill_kit.engines import quantize
    from distill_kit.training.plan import DataFacts

    torch.manual_seed(seed)
    spec = QuantizeConfig(scheme, group_size=args.group_size, learn_scales=args.learn_scales)
    teacher_dir = TEACHERS[task]
    train, heldout, checker = (default_data if task == "default" else arithmetic_data)(args, out, seed)
    started = time.perf_counter()
    students = [StudentSpec(name="qad", model=str(teacher_dir), loss="forward_kl", quantize=spec),
                StudentSpec(name="qat", model=str(teacher_dir), loss="cross_entropy", quantize=spec)]
    distiller = Distiller(students=students, teachers=[TeacherSpec(name="teacher", model=str(teacher_dir))],
                          training=TrainingConfig(max_steps=args.steps, micro_batch_size=args.micro_batch, lr=args.lr,
                                                  warmup_steps=max(1, args.steps // 10), lr_schedule="cosine",
                                                  seed=seed, log_every=max(1, args.steps // 5)),
                          deepspeed=DeepSpeedSettings(teacher_overrides={"zero_optimization.stage": 0}),
                          data=DataFacts(kind="chat" if task == "arithmetic" else "text"))
    distiller.train(train)
    trained = time.perf_counter() - started
    exported = distiller.export(out / "students")
    losses = {name: [r[f"{name}/loss"] for r in distiller.history if f"{name}/loss" in r] for name in ("qad", "qat")}
    del distiller
    try:
        rows, models = score(teacher_dir, exported, spec, heldout, checker, torch.device(args.device))
    except Exception as err:  # noqa: BLE001 - a GPU evaluation that fails is redone on the CPU, and says so
        if args.device == "cpu":
            raise
        logging.warning("evaluation on %s failed (%r): evaluating on the CPU", args.device, err)
        rows, models = score(teacher_dir, exported, spec, heldout, checker, torch.device("cpu"))
        rows["teacher"]["evaluated_on"] = "cpu (the GPU evaluation failed)"
    ptq_values = int_values(models["ptq"])
    for name in ("qat", "qad"):
        rows[name].update(bins_moved=bins_moved(models[name], ptq_values), first_loss=losses[name][0],
                          last_loss=losses[name][-1])
    rows["qat"]["train_seconds"] = rows["qad"]["train_seconds"] = trained  # one run: both students
    rows["qad"]["weight_bytes"] = quantize.weight_bytes(exported["qad"])
    return rows


RESOLUTION = 1e-5
"""A perplexity gap smaller than this share of the teacher's is no gap: float32 evaluation resolves a mean NLL to
about 1e-7 of itself, and a teacher that PTQ leaves at exact match 1.0 (the arithmetic teacher) differs from its
quantized self by ~1e-8 in NLL; a "share recovered" of that is rounding noise, not a measurement."""


def recovered(rows: dict[str, dict[str, float]], key: str = "perplexity", row: str = "qad") -> float | None:
    """The share of the PTQ-teacher gap ``row`` closes (1: the teacher's figure; 0: PTQ's; None: no gap)."""
    gap = rows["ptq"][key] - rows["teacher"][key]
    return None if abs(gap) <= RESOLUTION * rows["teacher"][key] else (rows["ptq"][key] - rows[row][key]) / gap


def spread(values: list[float]) -> dict[str, Any]:
    return {"mean": mean(values), "min": min(values), "max": max(values), "seeds": values}


def summarize(per_seed: dict[int, dict[str, dict[str, float]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for row in ROWS:
        for key in ("perplexity", "mean_kl", "top1_agreement", "exact_match", "bins_moved"):
            values = [seeded[row][key] for seeded in per_seed.values() if key in seeded[row]]
            if values:
                summary.setdefault(row, {})[key] = spread(values)
    for row in ("qad", "qat"):
        shares = [r for seeded in per_seed.values() if (r := recovered(seeded, row=row)) is not None]
        summary[f"{row}_recovers_of_ptq_gap"] = spread(shares) if shares else None
    summary["qad_beats_qat_every_seed"] = all(s["qad"]["perplexity"] < s["qat"]["perplexity"]
                                              for s in per_seed.values())
    summary["qad_closer_to_teacher_than_qat_every_seed"] = all(s["qad"]["mean_kl"] < s["qat"]["mean_kl"]
                                                               for s in per_seed.values())
    return summary


def table(name: str, summary: dict[str, Any]) -> str:
    lines = [f"{name}: held-out perplexity (and exact match), mean (min-max) over seeds"]
    for row in ROWS:
        cells = [f"{summary[row]['perplexity']['mean']:.3f} ({summary[row]['perplexity']['min']:.3f}-"
                 f"{summary[row]['perplexity']['max']:.3f})"]
        for key, label, digits in (("mean_kl", "KL to teacher", 4), ("exact_match", "EM", 3),
                                   ("bins_moved", "bins moved", 4)):
            if key in summary[row]:
                v = summary[row][key]
                cells.append(f"{label} {v['mean']:.{digits}f} ({v['min']:.{digits}f}-{v['max']:.{digits}f})")
        lines.append(f"  {row:8s} " + "  ".join(cells))
    for row in ("qad", "qat"):
        if share := summary.get(f"{row}_recovers_of_ptq_gap"):
            lines.append(f"  {row.upper()} recovers {share['mean']:.0%} ({share['min']:.0%}-{share['max']:.0%}) of the "
                         "PTQ-teacher perplexity gap")
    lines.append(f"  QAD beats QAT at every seed: {summary['qad_beats_qat_every_seed']} (perplexity), "
                 f"{summary['qad_closer_to_teacher_than_qat_every_seed']} (KL to the teacher)")
    return "\n".join(lines)


Cell = tuple[str, str, int, float | str | None]
"""(task, scheme, seed, variant): None, the grid's cell; a number, a ``--sweep-lrs`` cell at that learning rate;
``"learned"``, a ``--learned-seeds`` cell (the same students with learned int4 scales)."""


def cell_name(task: str, scheme: str, seed: int, variant: float | str | None = None) -> str:
    suffix = "" if variant is None else "_learned" if variant == "learned" else f"_lr{variant:g}"
    return f"{task}_{scheme}_seed{seed}{suffix}"


def cell_command(cell: Cell, args: argparse.Namespace) -> list[str]:
    """This script, run for one cell, with the grid's sizes."""
    sizes = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in
             ("steps", "micro_batch", "group_size", "max_train", "max_heldout", "labelled", "train_slice")]
    task, scheme, seed, variant = cell
    lr = variant if isinstance(variant, float) else args.lr
    learned = ["--learn-scales"] if variant == "learned" or args.learn_scales else []
    return [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--work", str(args.work),
            "--device", args.device, *sizes, f"--lr={lr}", *learned, "--cell", task, scheme, str(seed),
            cell_name(*cell)]


def run_cells(cells: list[Cell], args: argparse.Namespace) -> list[str]:
    """Every cell not already written, ``--jobs`` processes at a time, one thread each (a cell's log beside its
    result); returns the cells that failed (the others run on)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    todo = [c for c in cells if not (args.out / "cells" / f"{cell_name(*c)}.json").exists()]

    def one(cell: Cell) -> int:
        log = args.work / f"{cell_name(*cell)}.log"
        with open(log, "w") as handle:
            code = subprocess.call(cell_command(cell, args), env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   cwd=ROOT)
        print(f"{cell_name(*cell)}: {'done' if code == 0 else f'FAILED (exit {code}), log {log}'}", flush=True)
        return code

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        failed = [c for c, code in zip(todo, pool.map(one, todo), strict=True) if code]
    for cell in failed:  # the grid is summarised without them; main exits non-zero
        print(f"--- {cell_name(*cell)}, the end of its log:\n" + "\n".join(
            (args.work / f"{cell_name(*cell)}.log").read_text().splitlines()[-15:]), flush=True)
    return [cell_name(*c) for c in failed]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work", type=Path, help="exported folders and logs (default <out>/work)")
    parser.add_argument("--tasks", nargs="+", default=["default", "arithmetic"], choices=sorted(TEACHERS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--group-size", type=int, default=64,
                        help="64: the largest group dividing both teachers' widths (default 256, 704; arithmetic "
                             "128, 384)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--train-slice", default="teacher", choices=["teacher", "unseen"],
                        help="default task: the teacher's own training text, or the slice it never saw")
    parser.add_argument("--max-train", type=int, default=100_000, help="default task: at most this many blocks")
    parser.add_argument("--max-heldout", type=int, default=128, help="held-out blocks (default) or prompts")
    parser.add_argument("--labelled", type=int, default=2000, help="arithmetic: labelled answers trained on")
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once, one process (one thread) each")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the students train")
    parser.add_argument("--summarize-only", action="store_true",
                        help="run no cell: summarise the cells already under <out>/cells (a grid cut short)")
    parser.add_argument("--sweep-lrs", nargs="*", type=float, default=[],
                        help="also train the first task, scheme and seed at these rates (one cell each: a "
                             "learning-rate check beside the grid, reported apart from it)")
    parser.add_argument("--learn-scales", action="store_true",
                        help="every student learns its int4 scales (quantize.learn_scales: torchao's range learning)")
    parser.add_argument("--learned-seeds", nargs="*", type=int, default=[],
                        help="also train the first task and scheme with learned scales at these seeds (reported "
                             "apart from the grid, against the same seeds' grid cells)")
    parser.add_argument("--cell", nargs=4, metavar=("TASK", "SCHEME", "SEED", "NAME"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.work = args.work or args.out / "work"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.cell:  # a child: one cell, its JSON written last (a cell file means a finished cell)
        task, scheme, seed, name = args.cell[0], args.cell[1], int(args.cell[2]), args.cell[3]
        logging.basicConfig(level=logging.WARNING)
        rows = run_cell(task, scheme, seed, args, args.work / name)
        rows["lr"], rows["learn_scales"] = args.lr, args.learn_scales
        path = args.out / "cells" / f"{name}.json"
        path.write_text(json.dumps(rows, indent=2))
        return rows
    if (args.out / "qad_quality.json").exists():
        raise SystemExit(f"{args.out} already holds qad_quality.json; give a new --out")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU here; use --device cpu")
    (args.out / "cells").mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cells: list[Cell] = [(task, scheme, seed, None) for task in args.tasks for scheme in args.schemes
                         for seed in args.seeds]
    cells[1:1] = [(args.tasks[0], args.schemes[0], args.seeds[0], lr) for lr in args.sweep_lrs]  # early: few
    first_task = [i for i, c in enumerate(cells) if c[0] == args.tasks[0]][-1] + 1  # after the first task's cells
    cells[first_task:first_task] = [(args.tasks[0], args.schemes[0], seed, "learned") for seed in args.learned_seeds]
    if args.summarize_only:
        failed = [cell_name(*c) for c in cells if not (args.out / "cells" / f"{cell_name(*c)}.json").exists()]
    else:
        if "default" in args.tasks:  # tokenise once (the datasets cache), not once a cell
            default_data(args, args.work / "tokenise", 0)
        failed = run_cells(cells, args)
    results: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                        if k != "cell"}, "grids": {}, "failed_cells": failed}
    for task in args.tasks:
        for scheme in args.schemes:
            files = {seed: args.out / "cells" / f"{cell_name(task, scheme, seed)}.json" for seed in args.seeds}
            per_seed = {seed: json.loads(path.read_text()) for seed, path in files.items() if path.exists()}
            name = f"{task}/{scheme}"
            if not per_seed:
                continue
            results["grids"][name] = {"per_seed": per_seed, "summary": summarize(per_seed)}
            print(table(name, results["grids"][name]["summary"]), flush=True)
    learned = {c[2]: json.loads(p.read_text()) for c in cells if c[3] == "learned"
               and (p := args.out / "cells" / f"{cell_name(*c)}.json").exists()}
    if learned:
        name = f"{args.tasks[0]}/{args.schemes[0]}/learned_scales"
        results["grids"][name] = {"per_seed": learned, "summary": summarize(learned)}
        print(table(name, results["grids"][name]["summary"]), flush=True)
    sweep = {}
    for cell in cells:
        if isinstance(cell[3], float) and (path := args.out / "cells" / f"{cell_name(*cell)}.json").exists():
            rows = json.loads(path.read_text())
            sweep[cell[3]] = rows
            share = recovered(rows)
            print(f"lr {cell[3]:g} ({cell_name(*cell[:3])}): " + "  ".join(
                f"{row} perplexity {rows[row]['perplexity']:.3f} KL {rows[row]['mean_kl']:.4f} bins moved "
                f"{rows[row]['bins_moved']:.4f}" for row in ("qat", "qad"))
                + (f"  QAD recovers {share:.0%}" if share is not None else ""), flush=True)
    if sweep:
        main_cell = args.out / "cells" / f"{cell_name(*cells[0][:3])}.json"
        if main_cell.exists():
            sweep[args.lr] = json.loads(main_cell.read_text())
        results["lr_sweep"] = {"cell": cell_name(*cells[0][:3]), "by_lr": sweep}
    results["seconds"] = time.perf_counter() - started
    (args.out / "qad_quality.json").write_text(json.dumps(results, indent=2, default=str))
    if failed:
        raise SystemExit(f"{len(failed)} cell(s) failed or missing: {', '.join(failed)} (the others are in "
                         "qad_quality.json)")
    return results


if __name__ == "__main__":
    main()

"""What distillation adds to a quantized student: the teacher, PTQ, QAT without a teacher, and QAD, on the CPU.

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

Tasks: ``default`` (the embedded corpus and its 6.7M teacher; held-out perplexity on 128 blocks of 256 tokens) and
``arithmetic`` (the task teacher; perplexity on the held-out answers and greedy exact match by the task's checker)::

    OMP_NUM_THREADS=1 python benchmarks/qad_quality.py --tasks default arithmetic --seeds 0 1 2 \\
        --scheme int4_weight_only --out runs/qad_quality

Writes ``<out>/qad_quality.json`` and prints the table. ``--steps``, ``--lr``, ``--micro-batch``, ``--group-size``
size the run; ``--max-heldout`` limits the evaluation (the tests run the script at tiny sizes).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig  # noqa: E402
from distill_kit.config import DeepSpeedSettings, QuantizeConfig  # noqa: E402
from distill_kit.data import chat  # noqa: E402
from distill_kit.engines import quantize  # noqa: E402
from distill_kit.run import cli, run_config  # noqa: E402
from distill_kit.tasks import arithmetic, compare  # noqa: E402
from distill_kit.tasks.evaluate import accuracy, checked_answers  # noqa: E402
from distill_kit.training import evaluation  # noqa: E402
from distill_kit.training.plan import DataFacts  # noqa: E402

TEACHERS = {"default": ROOT / "distill_kit/assets/default/teacher",
            "arithmetic": ROOT / "distill_kit/assets/arithmetic/teacher"}
ROWS = ("teacher", "ptq", "qat", "qad")


def default_data(args: argparse.Namespace, out: Path, seed: int) -> tuple[Any, Any, Any]:
    """The embedded default's training slice and held-out blocks, as ``scripts/distill.py`` reads them."""
    config = run_config.load(None, [f"output_dir={out}", f"training.micro_batch_size={args.micro_batch}",
                                    f"training.seed={seed}", f"data.max_heldout_blocks={args.max_heldout}",
                                    f"data.max_train_blocks={args.max_train}"])
    data_config = cli.prepare_data(config)
    tokenizer = AutoTokenizer.from_pretrained(TEACHERS["default"])
    train, heldout = cli.build_loaders(config, data_config, tokenizer, DataFacts())
    return train, heldout, None


def arithmetic_data(args: argparse.Namespace, out: Path, seed: int) -> tuple[Any, Any, Any]:
    """Labelled arithmetic answers (both students train on the same rows) and the held-out prompts with answers."""
    tokenizer = AutoTokenizer.from_pretrained(TEACHERS["arithmetic"])
    seeds = arithmetic.split_seeds(seed)
    labelled = list(arithmetic.examples(seeds["labelled"], args.labelled))
    heldout = list(arithmetic.examples(seeds["heldout"], args.max_heldout))
    files = {name: arithmetic.write_jsonl(out / "data" / f"{name}.jsonl", items, with_answers=True)
             for name, items in (("labelled", labelled), ("heldout", heldout))}
    split = compare.chat_split(tokenizer, files["labelled"], files["heldout"])
    pad = chat.pad_id_of(tokenizer)
    return (chat.ChatLoader(split.train, args.micro_batch, pad_id=pad, seed=seed),
            chat.ChatLoader(split.heldout, 100, pad_id=pad, shuffle=False, drop_last=False),
            (tokenizer, heldout))


def forward(model: torch.nn.Module):
    return lambda batch: model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def run_seed(task: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, dict[str, float]]:
    spec = QuantizeConfig(args.scheme, group_size=args.group_size)
    teacher_dir = TEACHERS[task]
    train, heldout, checker = (default_data if task == "default" else arithmetic_data)(args, out, seed)
    started = time.perf_counter()
    students = [StudentSpec(name="qad", model=str(teacher_dir), loss="forward_kl", quantize=spec),
                StudentSpec(name="qat", model=str(teacher_dir), loss="cross_entropy", quantize=spec)]
    distiller = Distiller(students=students, teachers=[TeacherSpec(name="teacher", model=str(teacher_dir))],
                          training=TrainingConfig(max_steps=args.steps, micro_batch_size=args.micro_batch, lr=args.lr,
                                                  warmup_steps=min(10, args.steps), lr_schedule="cosine",
                                                  seed=seed, log_every=max(1, args.steps // 5)),
                          deepspeed=DeepSpeedSettings(teacher_overrides={"zero_optimization.stage": 0}),
                          data=DataFacts(kind="chat" if task == "arithmetic" else "text"))
    distiller.train(train)
    trained = time.perf_counter() - started
    exported = distiller.export(out / "students")
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    models = {"ptq": quantize.convert(teacher, spec),
              **{name: AutoModelForCausalLM.from_pretrained(path).eval() for name, path in exported.items()}}
    with torch.no_grad(), quantize.unpatched_linear():
        figures = evaluation.evaluate_students({n: forward(m) for n, m in models.items()}, forward(teacher), heldout,
                                               torch.device("cpu"))
        rows = {name: {key: figures[name][key] for key in ("perplexity", "mean_kl", "top1_agreement")}
                for name in ("ptq", "qat", "qad")}
        rows["teacher"] = {"perplexity": figures["teacher"]["perplexity"]}
        if checker is not None:
            tokenizer, items = checker
            for name, model in {"teacher": teacher, **models}.items():
                rows[name]["exact_match"] = accuracy(checked_answers(model, tokenizer, items, 32, arithmetic.check))
    rows["qat"]["train_seconds"] = rows["qad"]["train_seconds"] = trained  # one run: both students
    rows["qad"]["weight_bytes"] = quantize.weight_bytes(exported["qad"])
    return rows


RESOLUTION = 1e-5
"""A perplexity gap smaller than this share of the teacher's is no gap: float32 evaluation resolves a mean NLL to
about 1e-7 of itself, and a teacher that PTQ leaves at exact match 1.0 (the arithmetic teacher) differs from its
quantized self by ~1e-8 in NLL; a "share recovered" of that is rounding noise, not a measurement."""


def recovered(rows: dict[str, dict[str, float]], key: str = "perplexity") -> float | None:
    """The share of the PTQ-teacher gap QAD closes (1: the teacher's figure; 0: PTQ's; None: no gap to close)."""
    gap = rows["ptq"][key] - rows["teacher"][key]
    return None if abs(gap) <= RESOLUTION * rows["teacher"][key] else (rows["ptq"][key] - rows["qad"][key]) / gap


def summarize(per_seed: dict[int, dict[str, dict[str, float]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for row in ROWS:
        for key in ("perplexity", "mean_kl", "top1_agreement", "exact_match"):
            values = [seeded[row][key] for seeded in per_seed.values() if key in seeded[row]]
            if values:
                summary.setdefault(row, {})[key] = {"mean": mean(values), "min": min(values), "max": max(values),
                                                    "seeds": values}
    shares = [r for seeded in per_seed.values() if (r := recovered(seeded)) is not None]
    summary["qad_recovers_of_ptq_gap"] = {"mean": mean(shares), "min": min(shares), "max": max(shares),
                                          "seeds": shares} if shares else None
    summary["qad_beats_qat_every_seed"] = all(s["qad"]["perplexity"] < s["qat"]["perplexity"]
                                              for s in per_seed.values())
    summary["qad_closer_to_teacher_than_qat_every_seed"] = all(s["qad"]["mean_kl"] < s["qat"]["mean_kl"]
                                                               for s in per_seed.values())
    return summary


def table(task: str, summary: dict[str, Any]) -> str:
    lines = [f"{task}: held-out perplexity (and exact match), mean (min-max) over seeds"]
    for row in ROWS:
        cells = [f"{summary[row]['perplexity']['mean']:.3f} ({summary[row]['perplexity']['min']:.3f}-"
                 f"{summary[row]['perplexity']['max']:.3f})"]
        if "mean_kl" in summary[row]:
            kl = summary[row]["mean_kl"]
            cells.append(f"KL to teacher {kl['mean']:.4f} ({kl['min']:.4f}-{kl['max']:.4f})")
        if "exact_match" in summary[row]:
            em = summary[row]["exact_match"]
            cells.append(f"EM {em['mean']:.3f} ({em['min']:.3f}-{em['max']:.3f})")
        lines.append(f"  {row:8s} " + "  ".join(cells))
    share = summary["qad_recovers_of_ptq_gap"]
    if share:
        lines.append(f"  QAD recovers {share['mean']:.0%} ({share['min']:.0%}-{share['max']:.0%}) of the PTQ-teacher "
                     f"perplexity gap; beats QAT at every seed: {summary['qad_beats_qat_every_seed']} (perplexity), "
                     f"{summary['qad_closer_to_teacher_than_qat_every_seed']} (KL to the teacher)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tasks", nargs="+", default=["default", "arithmetic"], choices=sorted(TEACHERS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--scheme", default="int4_weight_only",
                        choices=["int4_weight_only", "int8_dynamic_act_int4_weight"])
    parser.add_argument("--group-size", type=int, default=64,
                        help="64: the largest group dividing the default teacher's widths (256, 704)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-4, help="a pretrained model's fine-tuning rate")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--max-train", type=int, default=512, help="default task: training blocks")
    parser.add_argument("--max-heldout", type=int, default=128, help="held-out blocks (default) or prompts")
    parser.add_argument("--labelled", type=int, default=2000, help="arithmetic: labelled answers trained on")
    args = parser.parse_args(argv)
    if (args.out / "qad_quality.json").exists():
        raise SystemExit(f"{args.out} already holds qad_quality.json; give a new --out")
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    results: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "torch_threads": torch.get_num_threads()}
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "qad_quality.partial.json"  # each seed as it finishes: a long CPU run keeps what it did
    for task in args.tasks:
        per_seed = {}
        for seed in args.seeds:
            per_seed[seed] = run_seed(task, seed, args, args.out / task / f"seed_{seed}")
            results[task] = {"per_seed": per_seed, "summary": summarize(per_seed)}
            partial.write_text(json.dumps(results, indent=2, default=str))
        print(table(task, results[task]["summary"]), flush=True)
    results["seconds"] = time.perf_counter() - started
    (args.out / "qad_quality.json").write_text(json.dumps(results, indent=2, default=str))
    partial.unlink()
    return results


if __name__ == "__main__":
    main()

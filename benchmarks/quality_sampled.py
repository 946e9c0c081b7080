"""Student quality from a sampled store (RS-KD) against full logits and against top-k at the same bytes (issue 41).

The embedded default's data, steps and settings; a student of the default's shape from random weights (a store has
no weights to cut a student from; ``benchmarks/results/served.md`` ran the same), forward KL at T = 1, at seeds
0, 1, 2 (``training.seed``: the student's initial weights and the order of the batches). Three teachers:

* ``full``: the teacher in process, its whole distribution;
* ``topk``: a top-k store at the sampled store's bytes: k = 24, fp16 values, uint16 ids, fp16 tail (24 x 4 + 2 = 98
  bytes a token at the 1,024-token vocabulary);
* ``sampled``: a sampled store, K = 20 draws at T = 1, fp16 values, uint16 ids, uint8 counts (20 x 5 = 100 bytes).

Held-out perplexity of each student, the mean and range over the seeds. CPU, one thread a run, ``--parallel`` runs
at once (each ~5-10 min on a shared 2-core machine)::

    OMP_NUM_THREADS=1 python benchmarks/quality_sampled.py --out /tmp/q41 --parallel 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "distill_kit" / "assets" / "default" / "teacher"
STUDENT = ("[{name: distilled, init: {hidden_size: 128, num_hidden_layers: 4, num_attention_heads: 2, "
           "num_key_value_heads: 2, intermediate_size: 352, tie_word_embeddings: true}, loss: forward_kl}]")
STORES = {"topk": ["--k", "24"], "sampled": ["--targets", "sampled", "--k", "20", "--temperature", "1.0"]}


def run(command: list[str], log: Path) -> None:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with log.open("w") as out:
        subprocess.run([sys.executable, *command], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                       check=True)


def perplexity(output_dir: Path) -> float:
    """The student's held-out perplexity at the end of the run (``report.json``'s summary)."""
    report = json.loads((output_dir / "report.json").read_text())
    return float(report["summary"]["students"]["distilled"]["perplexity"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--only", nargs="+", help="run only these runs (e.g. full_s2 topk_s1), collect nothing")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / "cache"
    from distill_kit.data.corpus import write_corpus

    splits = write_corpus(cache / "corpus")
    for name, flags in STORES.items():  # the two stores, captured once each from the in-process teacher
        if not (args.out / name / "manifest.json").exists() or not json.loads(
                (args.out / name / "manifest.json").read_text())["complete"]:
            run(["scripts/capture_teacher.py", "--teacher", str(TEACHER), "--data", str(splits.train), "--heldout",
                 str(splits.heldout), "--block-size", "256", "--max-blocks", "512", "--dtype", "fp32",
                 "--values-dtype", "fp16", *flags, "--out", str(args.out / name)], args.out / f"capture_{name}.log")
    teachers = {"full": [], "topk": ["--teacher", str(args.out / "topk"), "--tokenizer", str(TEACHER)],
                "sampled": ["--teacher", str(args.out / "sampled"), "--tokenizer", str(TEACHER)]}
    jobs = [(name, seed) for seed in args.seeds for name in teachers]
    if args.only:
        jobs = [(name, seed) for name, seed in jobs if f"{name}_s{seed}" in args.only]

    def one(job: tuple[str, int]) -> tuple[str, int, float]:
        name, seed = job
        folder = args.out / f"{name}_s{seed}"
        if not (folder / "report.json").exists():
            run(["scripts/distill.py", *teachers[name], "--students", STUDENT, f"training.seed={seed}",
                 f"training.max_steps={args.max_steps}", f"cache_dir={cache}", f"output_dir={folder}"],
                args.out / f"{name}_s{seed}.log")
        return name, seed, perplexity(folder)

    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(one, jobs))
    if args.only:
        print(json.dumps(results))
        return
    table = {}
    for name in teachers:
        values = [p for n, _, p in results if n == name]
        table[name] = {"per_seed": values, "mean": statistics.mean(values), "min": min(values), "max": max(values)}
    bytes_per_token = {name: json.loads((args.out / name / "manifest.json").read_text())["stats"]
                       for name in STORES}
    report = {"perplexity": table, "store_stats": bytes_per_token}
    (args.out / "quality_sampled.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Drafters for the embedded default's teacher: tau at gamma = 4 of one size and one initialisation, by objective.

Every drafter is the embedded default's student (0.94M parameters), cut from its teacher as ``make distill`` cuts it
(``DEFAULT_STUDENT_CUT``: every other layer, width pruned by activation importance), the same cut weights for every
objective of a seed. Rows of the corpus are ``prompt`` tokens of context and ``continuation`` tokens to learn: the
off-policy objectives learn the corpus's continuation, the on-policy ones replace it by the drafter's own sample
(``training.on_policy``: fraction 1, sampler student, temperature 1). Objectives (``OBJECTIVES``):

* ``no_teacher``: cross-entropy on the corpus (no teacher);
* ``forward_kl``: today's recipe, off-policy;
* ``total_variation``: off-policy, the acceptance objective (1 - TV is the acceptance rate of speculative sampling);
* ``on_policy_tv``: total variation on the drafter's own samples;
* ``target_verified``: on the drafter's own samples, total variation weighted by the chance the teacher reads and
  rejects each drafted token (``losses/drafting.py``).

Each drafter is then measured by exact greedy speculative decoding with the teacher as target
(``distill_kit/training/speculative.py``) on ``--prompts`` held-out prompts (the first ``prompt`` tokens of held-out
blocks), ``--new-tokens`` tokens each. One seed after another, each objective its own Distiller (one sampling student
per run); off-policy objectives share one run (one teacher forward for the three). Results: ``--out`` JSON, rewritten
after every run, and a table (mean over seeds and range)::

    OMP_NUM_THREADS=1 python benchmarks/drafter_grid.py --seeds 0 1 2 --steps 300 --out runs/drafters.json

or one process a seed, side by side, then ``--merge runs/d0.json runs/d1.json runs/d2.json --out runs/drafters.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig  # noqa: E402
from distill_kit.config import OnPolicyConfig  # noqa: E402
from distill_kit.data import blocks  # noqa: E402
from distill_kit.data.corpus import write_corpus  # noqa: E402
from distill_kit.run.run_config import DEFAULT_STUDENT_CUT, DEFAULT_TEACHER  # noqa: E402
from distill_kit.students.from_teacher import student_from_teacher  # noqa: E402
from distill_kit.training import speculative  # noqa: E402

OFF_POLICY = {"no_teacher": "cross_entropy", "forward_kl": "forward_kl", "total_variation": "total_variation"}
ON_POLICY = {"on_policy_tv": "total_variation",
             "target_verified": {"name": "target_verified", "gamma": 4, "rejected_weight": 1.0}}
OBJECTIVES = [*OFF_POLICY, *ON_POLICY]


def data(args: argparse.Namespace, tokenizer) -> blocks.DataSplits:
    splits = write_corpus(Path(args.cache) / "corpus")
    config = blocks.DataConfig(train=str(splits.train), heldout=str(splits.heldout),
                               block_size=args.prompt + args.continuation, max_train_blocks=args.train_blocks,
                               max_heldout_blocks=max(args.prompts, 8))
    return blocks.build_splits(config, tokenizer)


def with_prompts(loader, prompt: int):
    """Each row's first ``prompt`` tokens as its prompt (labels -100): the losses count the continuation only, and
    the on-policy sampler answers the prompt."""
    for batch in loader:
        batch = dict(batch)
        batch["labels"] = batch["labels"].clone()
        batch["labels"][:, :prompt] = -100
        yield batch


def train(students: dict, losses: dict, args: argparse.Namespace, splits, seed: int, on_policy: bool) -> dict:
    training = TrainingConfig(max_steps=args.steps, micro_batch_size=args.batch, lr=args.lr, betas=(0.9, 0.95),
                              warmup_steps=20, seed=seed, log_every=10**9,
                              on_policy=OnPolicyConfig(fraction=1.0, sampler="student",
                                                       max_new_tokens=args.continuation) if on_policy else
                              OnPolicyConfig())
    specs = [StudentSpec(name=name, model=students[name], loss=losses[name]) for name in losses]
    distiller = Distiller(students=specs, teachers=[TeacherSpec(name="teacher", model=str(DEFAULT_TEACHER))],
                          training=training)
    torch.manual_seed(seed)
    loader = blocks.BlockLoader(splits.train, args.batch, rank=0, world_size=1, seed=seed)

    def forever():
        while True:
            yield from with_prompts(loader, args.prompt)

    distiller.train(forever())
    return {name: distiller.students[name].model for name in losses}


def measure(teacher, drafters: dict, prompts: list[torch.Tensor], args: argparse.Namespace) -> dict:
    return speculative.evaluate_drafters(teacher, drafters, prompts, gamma=args.gamma, max_new_tokens=args.new_tokens,
                                         mode="greedy", latency_repeats=3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--objectives", nargs="+", default=OBJECTIVES, choices=OBJECTIVES)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--prompt", type=int, default=32, help="context tokens of each row and held-out prompt")
    parser.add_argument("--continuation", type=int, default=64, help="tokens learnt (or sampled) after the prompt")
    parser.add_argument("--train-blocks", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts tau is measured on")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per held-out prompt")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--cache", default=".cache")
    parser.add_argument("--out", default="runs/drafters.json")
    parser.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                        help="merge finished runs (one per seed, run side by side) into --out and print the table")
    args = parser.parse_args(argv)
    if args.merge:
        parts = [json.loads(Path(path).read_text()) for path in args.merge]
        merged = {"settings": parts[0]["settings"] | {"seeds": [s for p in parts for s in map(int, p["seeds"])]},
                  "seeds": {seed: figures for p in parts for seed, figures in p["seeds"].items()}}
        merged["table"] = table(merged)
        Path(args.out).write_text(json.dumps(merged, indent=2))
        print(json.dumps(merged["table"], indent=2))
        return 0
    torch.set_num_threads(1)

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TEACHER)
    splits = data(args, tokenizer)
    teacher = AutoModelForCausalLM.from_pretrained(DEFAULT_TEACHER).eval()
    prompts = [torch.tensor(row["input_ids"][:args.prompt]) for row in list(splits.heldout)[:args.prompts]]
    results: dict = {"settings": vars(args), "seeds": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        started = time.time()
        torch.manual_seed(seed)
        calibration = blocks.BlockLoader(splits.train, args.batch, rank=0, world_size=1, shuffle=False)
        cut = student_from_teacher(teacher, DEFAULT_STUDENT_CUT, calibration)
        figures = {"cut": measure(teacher, {"cut": cut}, prompts, args)["cut"]}
        runs = [({n: loss for n, loss in OFF_POLICY.items() if n in args.objectives}, False)]
        runs += [({n: loss}, True) for n, loss in ON_POLICY.items() if n in args.objectives]
        for losses, on_policy in runs:
            if not losses:
                continue
            trained = train({name: copy.deepcopy(cut) for name in losses}, losses, args, splits, seed, on_policy)
            figures |= measure(teacher, trained, prompts, args)
            results["seeds"][str(seed)] = figures | {"seconds": time.time() - started}
            out.write_text(json.dumps(results, indent=2))
        print(f"seed {seed}: " + ", ".join(f"{k} {v['tau']:.3f}" for k, v in figures.items() if isinstance(v, dict)),
              flush=True)
    results["table"] = table(results)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results["table"], indent=2))
    return 0


def table(results: dict) -> dict:
    """Per drafter: mean tau over seeds, its range, each seed's, and the ratio of the mean to forward KL's."""
    rows: dict = {}
    names = {k for figures in results["seeds"].values() for k, v in figures.items() if isinstance(v, dict)}
    for name in sorted(names):
        taus = [f[name]["tau"] for f in results["seeds"].values() if name in f]
        rows[name] = {"tau_mean": statistics.mean(taus), "tau_min": min(taus), "tau_max": max(taus), "taus": taus,
                      "acceptance_by_position_mean": [statistics.mean(a for a in x if a is not None) if any(
                          a is not None for a in x) else None for x in zip(
                          *[f[name]["acceptance_by_position"] for f in results["seeds"].values() if name in f],
                          strict=True)]}
    if "forward_kl" in rows:
        for row in rows.values():
            row["vs_forward_kl"] = row["tau_mean"] / rows["forward_kl"]["tau_mean"]
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

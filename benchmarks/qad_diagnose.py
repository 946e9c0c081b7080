"""Why a short QAD barely changes the served model: int4 bin widths against how far training moves a weight.

The exported int4 model changes only where a weight crosses a rounding boundary of its group's grid. This script
measures, for the embedded default's teacher and a scheme, (1) the bin widths (the group scales torchao's fake
quantiser computes) and the share of weights within a distance of a boundary, then (2) trains the fake-quantised
teacher on its own logits (forward KL, the QAD target) in a plain PyTorch loop — AdamW at a constant rate, no
DeepSpeed, so the step is the optimiser's and nothing else — printing, every ``--every`` steps, the share of
weights whose int4 value moved and the fake-quantised model's held-out perplexity and KL to the teacher. A
diagnosis, not the benchmark: the rows the report compares are ``benchmarks/qad_quality.py``'s (exported models,
the Distiller)::

    OMP_NUM_THREADS=1 python benchmarks/qad_diagnose.py --lr 3e-5 --steps 150 --train-slice teacher
    OMP_NUM_THREADS=1 python benchmarks/qad_diagnose.py --arithmetic-ptq   # does int4 PTQ cost arithmetic anything?

Prints only (a JSON line per evaluation and a summary line first).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from transformers import AutoModelForCausalLM  # noqa: E402

from distill_kit.config import QuantizeConfig  # noqa: E402
from distill_kit.engines import quantize  # noqa: E402


def grid_values(model: torch.nn.Module, names: list[str], group: int) -> dict[str, torch.Tensor]:
    """Each fake-quantised layer's weights on its own grid, ``w / scale`` per group, with the scale torchao's
    weight fake quantiser computes (it stores it on every call)."""
    out = {}
    for name in names:
        layer = model.get_submodule(name)
        weight = layer.weight.detach()
        layer.weight_fake_quantizer(weight)
        scale = layer.weight_fake_quantizer.scale.reshape(weight.shape[0], -1, 1)
        out[name] = weight.reshape(weight.shape[0], -1, group) / scale
    return out


def int_values(grid: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.round(x).clamp(-8, 7) for name, x in grid.items()}


def arithmetic_ptq() -> None:
    """Whether int4 PTQ costs the arithmetic teacher anything at all: exact match as it is and quantized."""
    import qad_quality
    from transformers import AutoTokenizer

    from distill_kit.tasks import arithmetic
    from distill_kit.tasks.evaluate import accuracy, checked_answers

    directory = qad_quality.TEACHERS["arithmetic"]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    items = list(arithmetic.examples(arithmetic.split_seeds(0)["heldout"], 200))
    teacher = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        print(json.dumps({"row": "teacher", "exact_match": accuracy(checked_answers(teacher, tokenizer, items, 32,
                                                                                    arithmetic.check))}), flush=True)
        # teacher-forced answers: the teacher's margin (top-1 minus top-2 logit) at each answer token, against how
        # far PTQ moves any logit there: an answer flips only where the move reaches the margin
        data_args = argparse.Namespace(labelled=8, max_heldout=200, micro_batch=8)
        _, heldout, _ = qad_quality.arithmetic_data(data_args, Path("/tmp/qad_diagnose_arith"), 0)
        batches = list(heldout)

        def answer_logits(model: torch.nn.Module) -> torch.Tensor:
            rows = []
            for batch in batches:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                rows.append(logits[:, :-1][batch["labels"][:, 1:] != -100])
            return torch.cat(rows)

        want = answer_logits(teacher)
        top2 = want.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        print(json.dumps({"row": "teacher", "answer_tokens": len(margin), "min_margin": margin.min().item(),
                          "median_margin": margin.median().item()}), flush=True)
        for scheme in ("int4_weight_only", "int8_dynamic_act_int4_weight"):
            for group in (128, 64, 32):
                model = quantize.convert(teacher, QuantizeConfig(scheme, group_size=group))
                em = accuracy(checked_answers(model, tokenizer, items, 32, arithmetic.check))
                moved = (answer_logits(model) - want).abs().max(dim=-1).values
                print(json.dumps({"row": "ptq", "scheme": scheme, "group_size": group, "exact_match": em,
                                  "max_logit_move": moved.max().item(),
                                  "max_move_over_margin": (moved / margin).max().item()}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheme", default="int4_weight_only", choices=["int4_weight_only",
                                                                         "int8_dynamic_act_int4_weight"])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--max-heldout", type=int, default=32)
    parser.add_argument("--train-slice", default="teacher", choices=["teacher", "unseen"])
    parser.add_argument("--learn-scales", action="store_true", help="quantize.learn_scales: learned int4 scales")
    parser.add_argument("--arithmetic-ptq", action="store_true",
                        help="instead: the arithmetic teacher's greedy exact match on 200 held-out prompts, as it is "
                             "and quantized (PTQ) at group sizes 128 (per channel for its 128-wide inputs), 64, 32, "
                             "and its logit margins on the answers against how far PTQ moves the logits")
    args = parser.parse_args(argv)
    import qad_quality

    if args.arithmetic_ptq:
        arithmetic_ptq()
        return

    torch.manual_seed(0)
    data_args = argparse.Namespace(max_heldout=args.max_heldout, train_slice=args.train_slice, max_train=100_000,
                                   micro_batch=args.micro_batch)
    train, heldout, _ = qad_quality.default_data(data_args, Path("/tmp/qad_diagnose"), 0)
    held = list(heldout)
    teacher = AutoModelForCausalLM.from_pretrained(qad_quality.TEACHERS["default"], dtype=torch.float32).eval()
    student = quantize.prepare(copy.deepcopy(teacher), QuantizeConfig(args.scheme, group_size=args.group_size,
                                                                           learn_scales=args.learn_scales))
    names = quantize.fake_quantized(student)
    grid = grid_values(student, names, args.group_size)
    start = int_values(grid)
    widths = torch.cat([layer.weight_fake_quantizer.scale.flatten() for layer in map(student.get_submodule, names)])
    # distance (in weight units) to the nearest rounding boundary: the half-integers of the grid, |frac(x) - 1/2|;
    # each group's largest weight sits at +-7.5 by the scale's definition (max |w| / 7.5), its value set by the
    # clamp to [-8, 7], not by a boundary: left out
    scales = {n: student.get_submodule(n).weight_fake_quantizer.scale.reshape(x.shape[0], -1, 1)
              for n, x in grid.items()}
    distance = torch.cat([((x - torch.floor(x) - 0.5).abs() * scales[n])[x.abs() < 7.5 - 1e-4]
                          for n, x in grid.items()])
    magnitude = torch.cat([student.get_submodule(n).weight.detach().abs().flatten() for n in names])
    print(json.dumps({"bin_width_median": widths.median().item(), "abs_weight_median": magnitude.median().item(),
                      "share_within": {f"{d:g}": (distance < d).float().mean().item()
                                       for d in (1e-4, 3e-4, 1e-3, 3e-3)}}), flush=True)

    def evaluate(model: torch.nn.Module) -> tuple[float, float]:
        nll = kl = count = 0.0
        with torch.no_grad():
            for batch in held:
                ids, labels = batch["input_ids"], batch["labels"][:, 1:]
                t = teacher(input_ids=ids).logits[:, :-1].log_softmax(-1)
                s = model(input_ids=ids).logits[:, :-1].log_softmax(-1)
                mask = labels != -100
                token_nll = -s.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
                nll += token_nll[mask].sum().item()
                kl += (t.exp() * (t - s)).sum(-1)[mask].sum().item()
                count += mask.sum().item()
        return math.exp(nll / count), kl / count

    ppl, kl = evaluate(teacher)
    print(json.dumps({"row": "teacher", "perplexity": ppl}), flush=True)
    ppl, kl = evaluate(student)
    print(json.dumps({"step": 0, "perplexity": ppl, "kl": kl, "bins_moved": 0.0}), flush=True)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    batches, started = iter(train), time.perf_counter()
    for step in range(1, args.steps + 1):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(train)
            batch = next(batches)
        with torch.no_grad():
            target = teacher(input_ids=batch["input_ids"]).logits.log_softmax(-1)
        logp = student(input_ids=batch["input_ids"]).logits.log_softmax(-1)
        loss = (target.exp() * (target - logp)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.every == 0 or step == args.steps:
            now = int_values(grid_values(student, names, args.group_size))
            moved = sum(int((now[n] != start[n]).sum()) for n in names) / sum(v.numel() for v in start.values())
            ppl, kl = evaluate(student)
            print(json.dumps({"step": step, "loss": loss.item(), "perplexity": ppl, "kl": kl, "bins_moved": moved,
                              "seconds": round(time.perf_counter() - started)}), flush=True)


if __name__ == "__main__":
    main()

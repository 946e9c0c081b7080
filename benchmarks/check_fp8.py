"""The FP8 teacher on the GPU: torchao's kernels against a float64 reference, and fidelity on trained teachers.

1. Kernels. For each linear shape of the 7B- and 72B-shaped teachers, torchao's row-wise FP8 linear
   (``engines/fp8.py:quantize_layer``) and the CPU stand-in (``FakeFloat8Linear``) against a float64 reference of
   the same quantisation (``quantize_rows``: float32 scales, e4m3 values; dequantised and multiplied in float64).
   Both differ from it by accumulation order and the bf16 output's rounding alone; the table also gives the
   distance of the plain bf16 linear from the unquantised float64 product, the error FP8 itself adds.
2. Fidelity on the shipped, trained teachers: the stdlib teacher on its held-out blocks (per-token
   KL(bf16 || FP8), top-1 agreement, perplexity of each) and the arithmetic teacher on its 500 held-out prompts
   (the same, over prompt + answer tokens, and greedy exact match of each). Each teacher in FP8 is loaded the way
   the Distiller loads it (``engines/fp8.py:load``: from the safetensors, a layer at a time).

Writes ``OUT/check_fp8.json``. GPU (1x H200)::

    python benchmarks/check_fp8.py --out runs/check_fp8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill_kit.data.blocks import build_splits
from distill_kit.engines import fp8
from distill_kit.run.cli import prepare_data
from distill_kit.run.run_config import DEFAULT_TEACHER, RunConfig
from distill_kit.tasks import arithmetic
from distill_kit.tasks.evaluate import exact_match

ARITHMETIC_TEACHER = DEFAULT_TEACHER.parent.parent / "arithmetic" / "teacher"
SHAPES = {  # (in, out) of the linear layers: Qwen2-7B and Qwen2-72B
    "7b_qkv": (3584, 3584), "7b_up": (3584, 18944), "7b_down": (18944, 3584),
    "72b_qkv": (8192, 8192), "72b_up": (8192, 29568), "72b_down": (29568, 8192),
}


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64: both operands quantised as the spec says (``quantize_rows``), dequantised, multiplied exactly."""
    qx, sx = fp8.quantize_rows(x)
    qw, sw = fp8.quantize_rows(weight)
    return (qx.double() * sx.double()) @ (qw.double() * sw.double()).t()


def check_kernels(tokens: int, device: torch.device) -> dict[str, dict[str, float]]:
    """Also torchao without fast accumulation (its default on Hopper keeps a partial sum in lower precision), to
    tell the quantisation's error from the accumulator's."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    rows = {}
    generator = torch.Generator(device).manual_seed(0)
    for name, (fan_in, fan_out) in SHAPES.items():
        linear = nn.Linear(fan_in, fan_out, bias=False, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.normal_(0, 0.02, generator=generator)
        x = torch.randn(tokens, fan_in, device=device, dtype=torch.bfloat16, generator=generator)
        exact = reference(x, linear.weight)
        plain = x.double() @ linear.weight.double().t()
        scale = exact.abs().mean().item()
        with torch.no_grad():
            bf16 = linear(x)
            fake = fp8.FakeFloat8Linear(linear)(x)
            slow = nn.Sequential(nn.Linear(fan_in, fan_out, bias=False, device=device, dtype=torch.bfloat16))
            slow[0].weight.copy_(linear.weight)
            quantize_(slow, Float8DynamicActivationFloat8WeightConfig(
                granularity=PerRow(), mm_config=Float8MMConfig(use_fast_accum=False)))
            precise = slow(x)
            holder = nn.Sequential(linear)
            fp8.quantize_layer(holder, "torchao")
            real = holder(x)
        rows[name] = {
            "torchao_vs_reference_max_rel": ((real.double() - exact).abs().max() / scale).item(),
            "torchao_vs_reference_mean_rel": ((real.double() - exact).abs().mean() / scale).item(),
            "torchao_no_fast_accum_vs_reference_max_rel": ((precise.double() - exact).abs().max() / scale).item(),
            "stand_in_vs_reference_mean_rel": ((fake.double() - exact).abs().mean() / scale).item(),
            "stand_in_vs_reference_max_rel": ((fake.double() - exact).abs().max() / scale).item(),
            "torchao_vs_stand_in_max_rel": ((real.double() - fake.double()).abs().max() / scale).item(),
            "fp8_vs_unquantised_mean_rel": ((exact - plain).abs().mean() / scale).item(),
            "bf16_vs_unquantised_max_rel": ((bf16.double() - plain).abs().max() / scale).item(),
        }
    return rows


def compare(bf16: nn.Module, quantised: nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Per-token KL(bf16 || FP8) and top-1 agreement over the positions with labels; each model's perplexity."""
    kl = agree = nll_bf16 = nll_fp8 = count = 0.0
    with torch.no_grad():
        for batch in batches:
            mask = batch["labels"][:, 1:] != -100
            p = F.log_softmax(bf16(input_ids=batch["input_ids"]).logits[:, :-1].float(), -1)[mask]
            q = F.log_softmax(quantised(input_ids=batch["input_ids"]).logits[:, :-1].float(), -1)[mask]
            target = batch["labels"][:, 1:][mask]
            kl += (p.exp() * (p - q)).sum().item()
            agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
            nll_bf16 -= p.gather(-1, target[:, None]).sum().item()
            nll_fp8 -= q.gather(-1, target[:, None]).sum().item()
            count += mask.sum().item()
    return {"tokens": count, "kl_bf16_fp8": kl / count, "top1_agreement": agree / count,
            "ppl_bf16": math.exp(nll_bf16 / count), "ppl_fp8": math.exp(nll_fp8 / count)}


def stdlib_batches(device: torch.device, blocks: int, micro_batch: int, cache: Path) -> list[dict[str, torch.Tensor]]:
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TEACHER)
    config = RunConfig(cache_dir=str(cache))
    data = dataclasses.replace(prepare_data(config), max_heldout_blocks=blocks)  # the embedded default's held-out
    heldout = build_splits(data, tokenizer).heldout
    heldout.set_format("torch")
    batches = []
    for start in range(0, len(heldout), micro_batch):
        rows = heldout[start:start + micro_batch]
        ids = rows["input_ids"].to(device)
        labels = rows["labels"].to(device) if "labels" in rows else ids.clone()
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def arithmetic_batches(items: list[arithmetic.Example], tokenizer, device: torch.device) -> list[dict[str, Any]]:
    """One example a row (lengths differ; no padding to mask): the answer's tokens carry labels."""
    batches = []
    for item in items:
        ids, labels = arithmetic.encode(tokenizer, item)
        batches.append({"input_ids": torch.tensor([ids], device=device),
                        "labels": torch.tensor([labels], device=device)})
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=2048, help="rows of x in the kernel check")
    parser.add_argument("--blocks", type=int, default=512, help="held-out stdlib blocks")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__,
              "transformers": transformers.__version__}, "kernels": check_kernels(args.tokens, device)}
    print(json.dumps(result["kernels"], indent=1), flush=True)

    bf16 = AutoModelForCausalLM.from_pretrained(DEFAULT_TEACHER, dtype=torch.bfloat16).to(device).eval()
    batches = stdlib_batches(device, args.blocks, 16, args.out / "cache")
    result["stdlib_teacher"] = {backend: compare(bf16, fp8.load(DEFAULT_TEACHER, device, backend=backend), batches)
                                for backend in ("torchao", "fake")}
    print(json.dumps(result["stdlib_teacher"], indent=1), flush=True)

    tokenizer = AutoTokenizer.from_pretrained(ARITHMETIC_TEACHER)
    items = list(arithmetic.examples(arithmetic.split_seeds(0)["heldout"], 500))
    bf16 = AutoModelForCausalLM.from_pretrained(ARITHMETIC_TEACHER, dtype=torch.bfloat16).to(device).eval()
    quantised = fp8.load(ARITHMETIC_TEACHER, device)
    result["arithmetic_teacher"] = compare(bf16, quantised, arithmetic_batches(items, tokenizer, device)) | {
        "exact_match_bf16": exact_match(bf16, tokenizer, items),
        "exact_match_fp8": exact_match(quantised, tokenizer, items)}
    print(json.dumps(result["arithmetic_teacher"], indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check_fp8.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Where a ZeRO-2 student's optimizer step goes, against what its bytes predict.

An fp32-master AdamW step over N parameters reads and writes the master weights, both moments and the gradient and
writes the bf16 weights back: about 30 bytes a parameter, so for the 0.5B student (494M parameters) ~14.8 GB, a few
milliseconds at HBM bandwidth. The step's breakdown (``bench_step.py``, column ``optimizer``) says far more. This
measures, in one launch on one GPU, the student alone (no teacher):

* ``ds``: ``engine.step()`` of a DeepSpeed ZeRO-2 bf16 engine as the project configures it (``configs/
  zero2_student.json``: ``torch_adam`` true, gradient clipping 1.0), and the same with each lever changed:
  ``fusedadam`` (DeepSpeed's own fused Adam, ``torch_adam`` false) and ``noclip`` (gradient clipping 0);
* ``fusedcheck``: DeepSpeed's bf16 non-finite-gradient check replaced by ``engines/overflow.py``'s one multi-tensor
  reduction; ``fused``: that and the gradient norm for clipping in one multi-tensor norm too (on CUDA), as the
  project's student engines run;
* ``torch_fused``: ``torch.optim.AdamW(fused=True)`` over an fp32 master copy plus the copy back to bf16: the
  floor a hand-written mixed-precision step would reach.

Each is the median of ``--steps`` CUDA-event timings after ``--warmup``; a ``torch.profiler`` table of the ``ds``
step's heaviest kernels and CPU ops says where the rest goes. Results: ``OUT/optimizer_step.json`` and ``.md``.

    python benchmarks/optimizer_step.py --out runs/optimizer     # GPU
    python benchmarks/optimizer_step.py --out /tmp/o --pair tiny --steps 2 --warmup 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import deepspeed
import torch
from pairs import PAIRS
from transformers import AutoModelForCausalLM

from distill_kit.engines import distributed, overflow


def ds_config(torch_adam: bool, clip: float, bf16: bool) -> dict[str, Any]:
    return {"bf16": {"enabled": bf16}, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0, "torch_adam": torch_adam}},
            "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 500_000_000},
            "gradient_clipping": clip, "steps_per_print": 10**9}


def timed(fn, steps: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of ``fn`` per call (a backward first, outside the timing, where ``fn`` needs one)."""
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            import time

            t = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - t) * 1e3
        if i >= warmup:
            times.append(elapsed)
    return times


def run_ds(config, torch_adam: bool, clip: float, args, device, fused_check: bool = False,
           fused_norm: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(torch_adam, clip, device.type == "cuda"))
    if fused_check:  # the project's engines/overflow.py, as build_student applies it
        overflow.fuse_overflow_check(engine)
    if fused_norm:
        overflow.fuse_grad_norm(engine)
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len), device=device)

    def backward() -> None:
        engine.backward(engine(input_ids=ids, use_cache=False).logits.float().mean())

    def step() -> None:
        engine.step()

    times = []
    for _ in range(args.warmup + args.steps):
        backward()
        times += timed(step, 1, 0, device)
    table = None
    if args.profile and device.type == "cuda":
        backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        table = {"cuda": prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15),
                 "cpu": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)}
    engine.destroy()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ms": statistics.median(times[args.warmup:]), "all_ms": times[args.warmup:], "profile": table}


def run_torch_fused(config, args, device) -> dict[str, Any]:
    """fp32 master copy + fused AdamW + bf16 copy back: the step's floor."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float().requires_grad_(True) for p in params]
    for m in master:
        m.grad = torch.randn_like(m) * 1e-3
    optimizer = torch.optim.AdamW(master, lr=1e-5, fused=device.type == "cuda")

    def step() -> None:
        optimizer.step()
        torch._foreach_copy_(params, master)

    with torch.no_grad():
        times = timed(step, args.steps, args.warmup, device)
    return {"ms": statistics.median(times), "all_ms": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pair", default="qwen2-7b-0.5b", choices=sorted(PAIRS))
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", default=True)
    args = parser.parse_args()
    device = distributed.init()
    config = PAIRS[args.pair].student
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    predicted_gb = parameters * 30 / 1e9
    result: dict[str, Any] = {"pair": args.pair, "parameters": parameters, "predicted_bytes_gb": predicted_gb,
                              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Cheapest first; DeepSpeed's FusedAdam JIT-builds a CUDA op (minutes, and it needs nvcc): last, and a variant
    # that fails is recorded with its error, the rest kept. Written after every variant (a timeout keeps the rest).
    variants = {"ds": lambda: run_ds(config, True, 1.0, args, device),
                "ds+noclip": lambda: run_ds(config, True, 0.0, args, device),
                "ds+fusedcheck": lambda: run_ds(config, True, 1.0, args, device, fused_check=True),
                "ds+fused": lambda: run_ds(config, True, 1.0, args, device, fused_check=True, fused_norm=True),
                "torch_fused": lambda: run_torch_fused(config, args, device),
                "ds+fusedadam": lambda: run_ds(config, False, 1.0, args, device),
                "ds+fusedadam+noclip": lambda: run_ds(config, False, 0.0, args, device)}
    for name, measure in variants.items():
        try:
            result[name] = measure()
        except Exception as error:  # a benchmark's variant, not a run: record it and go on
            result[name] = {"ms": None, "error": f"{type(error).__name__}: {error}"[:500]}
        write(out, args, parameters, predicted_gb, result)


def write(out: Path, args, parameters: int, predicted_gb: float, result: dict[str, Any]) -> None:
    (out / "optimizer_step.json").write_text(json.dumps(result, indent=2))
    lines = [f"{args.pair} student, {parameters / 1e6:.0f}M parameters; predicted ~{predicted_gb:.1f} GB moved a step",
             "", "| variant | optimizer step ms (median) |", "|---|---|"]
    lines += [f"| {name} | " + (f"{value['ms']:.1f}" if value.get("ms") is not None else value.get("error", ""))
              + " |" for name, value in result.items() if isinstance(value, dict)]
    for name, value in result.items():
        if isinstance(value, dict) and value.get("profile"):
            lines += ["", f"{name}:", "```", value["profile"]["cuda"], value["profile"]["cpu"], "```"]
    (out / "optimizer_step.md").write_text("\n".join(lines))



if __name__ == "__main__":
    main()

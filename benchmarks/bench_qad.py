"""What quantization-aware distillation costs and what its export serves at: one GPU, a student from its own self.

Two measurements, each against the same thing without quantization:

1. **The QAD step**: a student distilled from its own bf16 self (the QAD case: the student starts as the teacher,
   same weights), with its decoder layers fake-quantised (``students[i].quantize``) against the same step with no
   fake quantisation; tokens/s (median over the measured steps) and peak device memory. ``--teacher-precision fp8``
   runs the teacher in FP8 (``training.teacher_precision``) on every row; ``--step-rows`` lists the rows, each
   ``SCHEME[:TEACHER_PRECISION[:STUDENT_KERNELS]]`` (e.g. ``int4_weight_only:fp8``, from an FP8 teacher;
   ``int4_weight_only:auto:compile``, the student's layers under torch.compile).
2. **The exported model's decode**: the quantized student converted and written as ``engines/quantize.py`` writes it,
   loaded back with ``from_pretrained``, greedy decode tokens/s at ``--decode-batch`` rows against the bf16 model
   saved the usual way; and each folder's weight bytes on disk.

Shapes are built with random weights (step time and decode speed depend on shapes, not on what weights learned; the
GPU machine downloads nothing)::

    python benchmarks/bench_qad.py --out $OUT --shape qwen2-1.5b --schemes int4_weight_only \\
        int8_dynamic_act_int4_weight fp8 --micro-batch 8 --seq-len 1024 --steps 12 --warmup 4

On the CPU the tests run it at ``--shape tiny`` (schemes this device cannot run are reported as refused, with the
plan's reason). Writes ``<out>/bench_qad.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig  # noqa: E402
from distill_kit.config import DeepSpeedSettings, QuantizeConfig  # noqa: E402
from distill_kit.engines import quantize  # noqa: E402
from distill_kit.errors import ConfigError  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from pairs import QWEN2_VOCAB, qwen2  # noqa: E402

SHAPES = {
    "qwen2-1.5b": lambda: qwen2(1536, 8960, 28, 12, 2, QWEN2_VOCAB, tied=True),
    "tiny": lambda: LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=128,
                                tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0),
}


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def fresh_memory() -> None:
    """The last row's device memory freed and the peak counter reset (a GPU's figure; a CPU has no peak to read,
    and a full collection there costs seconds in a process holding many objects, e.g. the test suite's)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def parse_row(text: str, args: argparse.Namespace) -> dict[str, str | None]:
    """A step row, ``SCHEME[:TEACHER_PRECISION[:STUDENT_KERNELS[:TEACHER_KERNELS]]]`` (``none``: no fake
    quantisation), e.g. ``int4_weight_only:fp8`` (from an FP8 teacher), ``int4_weight_only:auto:compile`` (the
    student's decoder layers under torch.compile, fake-quantised linears included), ``none:fp8:auto:none`` (an eager
    FP8 teacher: no compile before the first step)."""
    fields = text.split(":")
    fields += [args.teacher_precision, args.student_kernels, args.teacher_kernels][len(fields) - 1:]
    scheme, precision, kernels, teacher_kernels = fields[:4]
    return {"scheme": None if scheme == "none" else scheme, "teacher_precision": precision, "student_kernels": kernels,
            "teacher_kernels": teacher_kernels}


def step(model: torch.nn.Module, row_spec: dict[str, str | None], args: argparse.Namespace) -> dict[str, Any]:
    """One row of (1): median tokens/s of a Distiller step, the student its own bf16 teacher's copy."""
    fresh_memory()
    scheme = row_spec["scheme"]
    dtype = "bf16" if torch.cuda.is_available() else "fp32"
    spec = QuantizeConfig(scheme, group_size=args.group_size) if scheme else None
    training = TrainingConfig(max_steps=args.warmup + args.steps, micro_batch_size=args.micro_batch, lr=1e-5,
                              dtype=dtype, student_kernels=row_spec["student_kernels"],
                              teacher_kernels=row_spec["teacher_kernels"],
                              teacher_precision=row_spec["teacher_precision"] if dtype == "bf16" else "auto")
    label = {"teacher_precision": training.teacher_precision, "student_kernels": training.student_kernels,
             "teacher_kernels": training.teacher_kernels}
    try:
        distiller = Distiller(students=[StudentSpec(name="s", model=copy.deepcopy(model), quantize=spec)],
                              teachers=[TeacherSpec(name="t", model=copy.deepcopy(model))], training=training,
                              deepspeed=DeepSpeedSettings(teacher_overrides={"zero_optimization.stage": 0}))
    except ConfigError as err:
        return {"scheme": scheme or "none", **label, "status": f"refused: {err}"}
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (ids := torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=generator)),
                "attention_mask": torch.ones_like(ids), "labels": ids} for _ in range(args.warmup + args.steps)]
    seconds = []
    for index in range(1, args.warmup + args.steps + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        distiller.train(batches, until=index)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds[args.warmup:])
    row = {"scheme": scheme or "none", **label, "status": "ok", "median_step_s": median,
           "tokens_per_s": args.micro_batch * args.seq_len / median, "peak_gib": peak_gib(),
           "fake_quantized_layers": len(quantize.fake_quantized(distiller.students["s"].model)),
           "losses": [r["s/loss"] for r in distiller.history]}
    del distiller
    return row


def decode(model: torch.nn.Module, scheme: str | None, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One row of (2): the folder written (under ``work``, deleted after), loaded back, greedy decode tokens/s and
    its weight bytes."""
    fresh_memory()
    folder = work / (scheme or "bf16")
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    source = copy.deepcopy(model).to(device=device(), dtype=dtype)
    if scheme is None:
        source.save_pretrained(folder, safe_serialization=True)
    else:
        spec = QuantizeConfig(scheme, group_size=args.group_size)
        problems = quantize.problems(spec, source.config, zero_stage=2, peft=False, module=source)
        if problems:
            return {"scheme": scheme, "status": f"refused: {problems[0]}"}
        quantize.save(quantize.prepare(source, spec), spec, folder)
    del source
    fresh_memory()
    # straight onto the device: FP8 and FP4 tensors are not built on a CPU
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device().type).eval()
    if args.compile:
        loaded.forward = torch.compile(loaded.forward, mode="max-autotune-no-cudagraphs")
    prompt = torch.randint(0, model.config.vocab_size, (args.decode_batch, 32),
                           generator=torch.Generator().manual_seed(1)).to(device())
    settings = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad(), quantize.unpatched_linear():
        loaded.generate(prompt, max_new_tokens=4, min_new_tokens=4, **settings)  # warm-up (and compile)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        loaded.generate(prompt, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens, **settings)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    row = {"scheme": scheme or "bf16", "status": "ok", "decode_tokens_per_s": args.decode_batch * args.decode_tokens
           / seconds, "weight_bytes": quantize.weight_bytes(folder), "peak_gib": peak_gib()}
    del loaded
    shutil.rmtree(folder)
    return row


def table(result: dict[str, Any]) -> str:
    lines = ["QAD step (student from its own bf16 self; ratio: against the row without fake quantisation with the "
             "same teacher precision and kernels):"]
    for row in result["step"]:
        name = (f"{row['scheme']} (teacher {row.get('teacher_precision')}/{row.get('teacher_kernels')}, student "
                f"{row.get('student_kernels')})")
        if row["status"] != "ok":
            lines.append(f"  {name:60s} {row['status']}")
            continue
        base = next((r for r in result["step"] if r["scheme"] == "none" and r["status"] == "ok"
                     and all(r.get(k) == row.get(k) for k in ("teacher_precision", "teacher_kernels",
                                                              "student_kernels"))), None)
        ratio = f"  {row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        memory = f"  peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else ""
        lines.append(f"  {name:60s} {row['tokens_per_s']:12,.0f} tokens/s{ratio}{memory}")
    lines.append("exported model, greedy decode:")
    bf16 = next((r for r in result["decode"] if r["scheme"] == "bf16" and r["status"] == "ok"), None)
    for row in result["decode"]:
        if row["status"] != "ok":
            lines.append(f"  {row['scheme']:30s} {row['status']}")
            continue
        ratio = f"  {row['decode_tokens_per_s'] / bf16['decode_tokens_per_s']:.2f}x" if bf16 else ""
        lines.append(f"  {row['scheme']:30s} {row['decode_tokens_per_s']:10,.1f} tokens/s{ratio}  "
                     f"{row['weight_bytes'] / 2**20:,.1f} MiB of weights")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--shape", default="qwen2-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--schemes", nargs="+", default=["int4_weight_only", "int8_dynamic_act_int4_weight", "fp8"])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--teacher-precision", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--student-kernels", default="auto", choices=["auto", "none", "liger", "compile"])
    parser.add_argument("--teacher-kernels", default="auto", choices=["auto", "none", "liger", "compile"])
    parser.add_argument("--step-rows", nargs="+", metavar="SCHEME[:TEACHER_PRECISION[:STUDENT_KERNELS]]",
                        help="the step rows, in order (default: none and each of --schemes), e.g. none:fp8 "
                             "int4_weight_only:fp8 int4_weight_only:auto:compile; a fourth field sets the teacher's "
                             "kernels (none:fp8:auto:none: an eager FP8 teacher)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--decode-batch", type=int, default=1)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="torch.compile the loaded models' forward")
    parser.add_argument("--skip", nargs="*", default=[], choices=["step", "decode"])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with torch.device(device()):
        model = AutoModelForCausalLM.from_config(SHAPES[args.shape]())
    model.to(torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    schemes: list[str | None] = [None, *args.schemes]
    result: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                              "parameters": sum(p.numel() for p in model.parameters()),
                              "command": "python benchmarks/bench_qad.py " + " ".join(sys.argv[1:] if argv is None
                                                                                       else argv)}
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row: a launch cut short keeps the rows it finished
        (args.out / "bench_qad.json").write_text(json.dumps(result, indent=2))

    result["step"], result["decode"] = [], []
    rows = [parse_row(text, args) for text in args.step_rows or ["none", *args.schemes]]
    for spec in [] if "step" in args.skip else rows:
        result["step"].append(step(model, spec, args))
        print(f"step row {spec}: {result['step'][-1].get('tokens_per_s', result['step'][-1]['status'])}", flush=True)
        save()
    with tempfile.TemporaryDirectory(prefix="bench_qad_") as work:  # the exported folders: GiB, not results
        for scheme in [] if "decode" in args.skip else schemes:
            result["decode"].append(decode(model, scheme, args, Path(work)))
            save()
    save()
    print(table(result))
    return result


if __name__ == "__main__":
    main()

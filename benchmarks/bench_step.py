"""Distillation step speed: ours (ZeRO-2 student + ZeRO-3 teacher) against ZeRO-3 for both, in one launch.

Modes, each built from scratch in turn on the same GPUs with the same data, loss and micro-batch:

* ``ours``: ZeRO-2 student, ZeRO-3 teacher (the Distiller's default configs);
* ``baseline``: ZeRO-3 for both; the student gets every setting ours has (including the ZeRO-3 settings
  given to the teacher) except its stage, so the comparison never favours ours by a weaker baseline;
* ``upper``: ZeRO-2 student and a replicated teacher (stage 0), when the teacher fits on one GPU: what
  ours would reach if sharding the teacher cost nothing.

A run is ``MODE[@MICRO_BATCH][+LEVER...]``, e.g. ``ours@16+fused``; the levers are in ``LEVERS``. Each
run reports tokens/s per GPU (median step after warm-up), MFU, peak memory per GPU and the step's split
into phases (``phases.py``). Before the runs, on a clean device, it measures the logit loss's memory
against the naive float32 one (``loss_memory.py``). Results go to ``OUT/bench.json``, ``results.md`` and
``chart.png`` (``report.py``).

Before the runs it also measures the student's head + loss from hidden states: naive, chunked and fused
(``loss_memory.measure_with_head``). Runs use plain HF kernels unless a run names ``liger`` or ``compile``, and
the fused student head unless it names ``unfused``.

The teacher's head at the loss (``training.teacher_head_at_loss``: its full logits never exist) is on unless a run
names ``teacherlogits``; ``--teacher-head both`` runs every run both ways in the same launch, and each run records
the setting and whether the teacher's forward really came back headless. ``--micro-batches`` finds the largest
micro-batch that fits: every run is tried at each of them in increasing order until one runs out of memory, and
``largest_micro_batch`` records the largest that ran, per run. Each run's peak memory is
``torch.cuda.max_memory_allocated`` after a reset, net of what earlier runs left behind.

GPU (2x H200; the second line is the headline run in RESULTS.md, the third the big-teacher pair, one process
per run)::

    torchrun --nproc_per_node 2 benchmarks/bench_step.py --out runs/bench
    torchrun --nproc_per_node 2 benchmarks/bench_step.py --out runs/bench --chunk-size 1024 --warmup 2 --steps 6 \
        --runs ours@16+bucket+liger baseline@16+bucket+liger ours@16+bucket+liger+unfused ours@32+bucket+liger
    torchrun --nproc_per_node 2 benchmarks/bench_step.py --pair qwen2-72b-0.5b --loss-memory-shape 0 \
        --chunk-size 1024 --out runs/b72_ours --runs ours@4+bucket+liger

The teacher's head at the loss against the teacher's full logits, up to the largest micro-batch each fits::

    torchrun --nproc_per_node 2 benchmarks/bench_step.py --out runs/teacher_head --loss-memory-shape 0 \
        --chunk-size 1024 --warmup 2 --steps 6 --runs ours+bucket+liger --teacher-head both \
        --micro-batches 16 24 32 40 48 64

CPU smoke (what the test suite runs)::

    torchrun --nproc_per_node 2 benchmarks/bench_step.py --pair tiny --seq-len 32 --micro-batch 2 \\
        --warmup 1 --steps 2 --loss-memory-shape 2,16 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import deepspeed
import loss_memory  # this and the other benchmarks/ siblings: the script's directory is on the path
import pairs
import report
import torch
import transformers
from naive_loss import NaiveForwardKL
from phases import TimedDistiller
from transformers import AutoModelForCausalLM

from distill_kit import TrainingConfig
from distill_kit.config import CONFIG_DIR
from distill_kit.engines import deepspeed_config, distributed, fp8
from losses import build_loss

GIB = 2**30


@dataclass(frozen=True)
class Mode:
    student_stage: int
    teacher_stage: int
    description: str


MODES = {
    "ours": Mode(2, 3, "ZeRO-2 student + ZeRO-3 teacher"),
    "baseline": Mode(3, 3, "ZeRO-3 student + ZeRO-3 teacher"),
    "upper": Mode(2, 0, "ZeRO-2 student + replicated teacher"),
}

LEVERS = {
    "bucket": "student gradient reduce bucket 5e8 elements (DeepSpeed's default) instead of 'auto' = hidden^2",
    "fused": "fused AdamW kernel for the student (torch.optim.AdamW(fused=True)) instead of foreach",
    "naive": "naive full-vocabulary float32 forward KL instead of the chunked logit loss",
    "persist": "ZeRO-3 parameter persistence threshold 2e6 (teacher k/v projections stay whole)",
    "eager": "eager attention instead of SDPA (flash) attention",
    "autozero3": "the configs' 'auto' ZeRO-3 sizes instead of --zero3",
    "unfused": "training.fused_loss off: the student's full logits, then the chunked loss (the default before #12)",
    "liger": "Liger-Kernel RoPE, RMSNorm and SwiGLU in teacher and student (training.*_kernels: liger)",
    "compile": "torch.compile per decoder layer in teacher and student (training.*_kernels: compile)",
    "hpz": "ZeRO++ hierarchical partitioning for the teacher (zero_hpz_partition_size: this node's GPUs): its "
           "forward gathers stay inside a node; the multi-node remedy of RESULTS.md's model",
    "qwz": "ZeRO++ quantised weight all-gathers for the teacher (zero_quantized_weights): int8 gathers, half the "
           "bytes of bf16",
    "fp8": "the teacher in FP8 (training.teacher_precision: fp8): torchao row-wise, loaded a layer at a time, "
           "compiled per decoder layer whatever the kernels lever (which then reaches the student alone); "
           "replicated (with mode upper)",
    "dscheck": "DeepSpeed's own per-tensor bf16 non-finite-gradient check at the optimizer step, instead of "
               "engines/overflow.py's one multi-tensor reduction (the same answer)",
    "dsnorm": "DeepSpeed's own per-tensor gradient norm for clipping, instead of engines/overflow.py's one "
              "multi-tensor norm (the same norm, another summation order)",
    "teacherlogits": "training.teacher_head_at_loss off: the teacher's full logits (B x T x vocabulary), instead of "
                     "its head applied chunk by chunk at the loss",
}
TEACHER_HEAD = {"loss": "every run as named (the teacher's head at the loss unless it names teacherlogits)",
                "logits": "every run with the teacherlogits lever",
                "both": "every run both ways, one after the other"}


@dataclass(frozen=True)
class Run:
    mode: str
    micro_batch: int
    levers: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.mode}@{self.micro_batch}" + "".join(f"+{lever}" for lever in self.levers)


def parse_run(text: str, default_micro_batch: int) -> Run:
    head, *levers = text.split("+")
    mode, _, micro_batch = head.partition("@")
    if mode not in MODES or any(lever not in LEVERS for lever in levers):
        raise argparse.ArgumentTypeError(
            f"bad run {text!r}: MODE[@MICRO_BATCH][+LEVER...] with MODE in {sorted(MODES)} "
            f"and LEVER in {sorted(LEVERS)}"
        )
    return Run(mode, int(micro_batch) if micro_batch else default_micro_batch, tuple(sorted(levers)))


def with_lever(run: Run, lever: str) -> Run:
    return replace(run, levers=tuple(sorted({*run.levers, lever})))


def expand(runs: list[Run], teacher_head: str, micro_batches: list[int] | None) -> list[Run]:
    """The runs to make, in order: each as named, with ``--teacher-head``'s variants beside it and, given
    ``--micro-batches``, at each of them in increasing order (in place of its own micro-batch)."""
    out = []
    for run in runs:
        variants = {"loss": [run], "logits": [with_lever(run, "teacherlogits")],
                    "both": [run, with_lever(run, "teacherlogits")]}[teacher_head]
        for variant in dict.fromkeys(variants):  # a run that names teacherlogits already: once
            out += [replace(variant, micro_batch=m) for m in sorted(set(micro_batches))] if micro_batches else [variant]
    return out


def shape_key(run: Run) -> str:
    """A run's label without its micro-batch: the runs a micro-batch search compares."""
    return run.mode + "".join(f"+{lever}" for lever in run.levers)


def largest_micro_batches(runs: list[dict[str, Any]]) -> dict[str, int]:
    """The largest micro-batch that ran, per run (``shape_key``)."""
    largest: dict[str, int] = {}
    for run in runs:
        if run["status"] == "ok":
            key = run["mode"] + "".join(f"+{lever}" for lever in run["levers"])
            largest[key] = max(largest.get(key, 0), run["micro_batch"])
    return largest


def teacher_head_pairs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run beside its ``teacherlogits`` twin (the same micro-batch): peak memory and tokens/s of both."""
    done = {(r["mode"], r["micro_batch"], tuple(r["levers"])): r for r in runs if r["status"] == "ok"}
    out = []
    for (mode, micro_batch, levers), run in done.items():
        twin = done.get((mode, micro_batch, tuple(sorted({*levers, "teacherlogits"}))))
        if "teacherlogits" not in levers and twin:
            out.append({"head_at_loss": run["label"], "full_logits": twin["label"],
                        "peak_allocated_gib": [run["peak_allocated_gib"], twin["peak_allocated_gib"]],
                        "tokens_per_s_per_gpu": [run["tokens_per_s_per_gpu"], twin["tokens_per_s_per_gpu"]],
                        "teacher_output": [run["teacher_output"], twin["teacher_output"]]})
    return out


def parse_setting(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, e.g. stage3_prefetch_bucket_size=5e8, got {text!r}")
    return f"zero_optimization.{key}", int(float(value))


def ds_overrides(run: Run, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Student and teacher config overrides for one run; ZeRO-3 settings reach every ZeRO-3 model alike."""
    mode = MODES[run.mode]
    zero3 = {} if "autozero3" in run.levers else dict(args.zero3)
    if "persist" in run.levers:
        zero3["zero_optimization.stage3_param_persistence_threshold"] = int(2e6)
    student = {"zero_optimization.stage": mode.student_stage}
    if mode.student_stage == 3:
        student |= zero3
    if "bucket" in run.levers:
        student["zero_optimization.reduce_bucket_size"] = int(5e8)
    if "fused" in run.levers:
        student["optimizer.params.fused"] = True
    teacher = {"zero_optimization.stage": mode.teacher_stage} | (zero3 if mode.teacher_stage == 3 else {})
    if "hpz" in run.levers:
        teacher["zero_optimization.zero_hpz_partition_size"] = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "qwz" in run.levers:
        teacher["zero_optimization.zero_quantized_weights"] = True
    return student, teacher


def random_batches(count: int, micro_batch: int, length: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(0, vocab, (micro_batch, length), generator=generator)),
             "attention_mask": torch.ones_like(ids)} for _ in range(count)]


def max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    if distributed.world_size() > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.item()


def release(distiller: TimedDistiller) -> None:
    """Give back both engines' hooks and buffers, so that the next mode starts on an empty device."""
    for engine in (distiller.student, distiller.teacher):
        if isinstance(engine, deepspeed.DeepSpeedEngine):
            engine.destroy()


def observe_teacher(distiller: TimedDistiller) -> list[str]:
    """The type of every teacher output the step gets (``HeadOutput``: the teacher ran without its head), recorded
    by wrapping the instance's hook, so that a run says what it measured whatever the setting asked for."""
    seen: list[str] = []
    forward = distiller.teacher_forward

    def observed(batch: Any) -> Any:
        out = forward(batch)
        seen.append(type(out).__name__)
        return out

    distiller.teacher_forward = observed
    return seen


def measure(run: Run, args: argparse.Namespace, facts: dict[str, Any], device: torch.device) -> dict[str, Any]:
    pair, cuda = pairs.PAIRS[args.pair], device.type == "cuda"
    result: dict[str, Any] = {"label": run.label, "mode": run.mode, "description": MODES[run.mode].description,
                              "micro_batch": run.micro_batch, "levers": list(run.levers)}
    if MODES[run.mode].teacher_stage < 3 and cuda:
        need = facts["teacher_params"] * (1 if "fp8" in run.levers else pairs.TORCH_DTYPES[args.dtype].itemsize)
        total = torch.cuda.get_device_properties(device).total_memory
        if need > total:
            return result | {"status": f"out of memory (not attempted): a replicated teacher's weights alone "
                                       f"need {need / GIB:.0f} GiB per GPU, the GPU has {total / GIB:.0f} GiB"}
    kernels = next((lever for lever in ("liger", "compile") if lever in run.levers), "none")
    in_fp8 = "fp8" in run.levers
    training = TrainingConfig(max_steps=args.warmup + args.steps, micro_batch_size=run.micro_batch, dtype=args.dtype,
                              lr=1e-5, log_every=10**9, fused_loss="unfused" not in run.levers,
                              teacher_kernels="auto" if in_fp8 else kernels,  # FP8: compile (engines/fp8.py)
                              student_kernels=kernels, teacher_precision="fp8" if in_fp8 else "auto",
                              teacher_head_at_loss="teacherlogits" not in run.levers)
    result["teacher_head_at_loss"] = training.teacher_head_at_loss
    student_overrides, teacher_overrides = ds_overrides(run, args)
    student_cfg, teacher_cfg = deepspeed_config.prepare_pair(
        CONFIG_DIR / "zero2_student.json", CONFIG_DIR / "zero3_teacher.json", training,
        student_hidden_size=pair.student.hidden_size, teacher_hidden_size=pair.teacher.hidden_size,
        world_size=distributed.world_size(), student_overrides=student_overrides, teacher_overrides=teacher_overrides,
    )
    loss = NaiveForwardKL() if "naive" in run.levers else build_loss({"name": args.loss, "chunk_size": args.chunk_size})
    attention = "eager" if "eager" in run.levers else "sdpa"
    # DeepSpeed 0.19.8 keeps a destroyed ZeRO-3 engine's partitions reachable, so earlier modes can leave
    # memory behind; it is never touched again, and peaks are reported net of it.
    left_before = torch.cuda.memory_allocated(device) if cuda else 0
    build_start = time.perf_counter()
    # Teacher first, as the Distiller loads it: the large model must never sit unsharded beside the student.
    teacher = (fp8.load(pair.teacher, device, need_attentions=attention == "eager",
                        weights=fp8.random_weights(pair.teacher.initializer_range, args.seed)) if in_fp8 else
               pairs.build(pair.teacher, teacher_cfg, args.dtype, device, attention))
    teacher_bytes = torch.cuda.memory_allocated(device) - left_before if cuda else None
    student = pairs.build(pair.student, student_cfg, args.dtype, device, attention)
    distiller = TimedDistiller(student, teacher, loss=loss, training=training,
                               student_ds_config=student_cfg, teacher_ds_config=teacher_cfg)
    result["build_s"] = time.perf_counter() - build_start
    for lever, method in (("dscheck", "has_overflow_partitioned_grads_serial"), ("dsnorm", "get_grad_norm_direct")):
        if lever in run.levers:  # the instance's fused method removed: DeepSpeed's class method answers again
            vars(distiller.student.optimizer).pop(method, None)
    try:
        result |= timed_training(distiller, training, run, args, facts, device, left_before)
    finally:  # also when a step runs out of memory: the next run must not find these engines on the device
        release(distiller)
        del distiller, teacher, student
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    result["teacher_weights_gib"] = None if teacher_bytes is None else teacher_bytes / GIB
    result["kernels"] = kernels
    result["memory_left_gib"] = torch.cuda.memory_allocated(device) / GIB if cuda else None
    return result


def timed_training(distiller: TimedDistiller, training: TrainingConfig, run: Run, args: argparse.Namespace,
                   facts: dict[str, Any], device: torch.device, left_before: int) -> dict[str, Any]:
    """The built Distiller trained on random batches: speed, peak memory, phases, compiles, what the teacher gave."""
    cuda = device.type == "cuda"
    batches = random_batches(training.max_steps, run.micro_batch, args.seq_len,
                             distiller.student_model.config.vocab_size, seed=args.seed + distributed.rank())
    teacher_outputs = observe_teacher(distiller)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    torch._dynamo.utils.counters.clear()
    history = distiller.train(batches)
    compiled = dict(torch._dynamo.utils.counters["stats"])  # graphs compiled, and why any frame broke
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    distiller.clock.finish()
    if cuda:
        torch.cuda.synchronize(device)
    summary = distiller.clock.summary(skip=args.warmup)
    tokens = run.micro_batch * args.seq_len * training.gradient_accumulation_steps
    tokens_per_s = tokens / (summary["step_ms"] / 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - left_before) / GIB if cuda else None
    reserved = torch.cuda.max_memory_reserved(device) / GIB if cuda else None
    flops = facts["flops_per_token"] * tokens_per_s
    return {
        "status": "ok",
        # The first step compiles (torch.compile per decoder layer); what it took beyond a later step's time.
        "first_step_extra_s": (distiller.clock.summary(skip=0)["step_ms_all"][0] - summary["step_ms"]) / 1e3,
        "dynamo_unique_graphs": compiled.get("unique_graphs", 0), "dynamo_graph_breaks": breaks,
        "mfu_fp8_peak": flops / (args.peak_fp8_tflops * 1e12),
        "tokens_per_step_per_gpu": tokens,
        "tokens_per_s_per_gpu": tokens_per_s,
        "mfu_spec": flops / (args.peak_tflops * 1e12),
        "mfu_measured": flops / (args.measured_tflops * 1e12),
        "peak_allocated_gib": None if peak is None else max_over_ranks(peak, device),
        "peak_reserved_gib_with_earlier": None if reserved is None else max_over_ranks(reserved, device),
        "left_by_earlier_modes_gib": left_before / GIB,
        "attention": distiller.student_model.config._attn_implementation,
        "optimizer": type(distiller.student.optimizer.optimizer).__name__,
        "fused_head": distiller.fused_head,
        "teacher_output": sorted(set(teacher_outputs)),  # ["HeadOutput"]: the teacher ran without its head
        "losses": [h["loss"] for h in history],
        **summary,
    }


def model_facts(pair: pairs.Pair) -> dict[str, Any]:
    """Parameter counts from shapes alone (meta tensors, no memory) and the model FLOPs per trained token."""
    with torch.device("meta"):
        teacher = pairs.parameter_count(AutoModelForCausalLM.from_config(pair.teacher))
        student = pairs.parameter_count(AutoModelForCausalLM.from_config(pair.student))
    # 6 N for the student (forward + backward), 2 N for the teacher (forward only).
    return {"teacher_params": teacher, "student_params": student, "flops_per_token": 6 * student + 2 * teacher}


def launch_command() -> str:
    script = "benchmarks/bench_step.py " + shlex.join(sys.argv[1:])
    if "LOCAL_WORLD_SIZE" in os.environ:
        return f"torchrun --nproc_per_node {os.environ['LOCAL_WORLD_SIZE']} {script}"
    return f"python {script}"


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{distributed.world_size()}x {torch.cuda.get_device_name(device)}"
    return f"{distributed.world_size()} CPU ranks (gloo)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for bench.json, results.md, chart.png")
    parser.add_argument("--pair", choices=sorted(pairs.PAIRS), default="qwen2-7b-0.5b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU for runs that name none")
    parser.add_argument("--runs", nargs="+", default=["ours", "baseline", "upper"],
                        help="MODE[@MICRO_BATCH][+LEVER...]; levers: "
                        + "; ".join(f"{k}: {v}" for k, v in LEVERS.items()))
    parser.add_argument("--teacher-head", choices=sorted(TEACHER_HEAD), default="loss",
                        help="; ".join(f"{k}: {v}" for k, v in TEACHER_HEAD.items()))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=None,
                        help="try every run at each of these micro-batches, in increasing order, until one runs out "
                        "of memory (in place of the runs' own); largest_micro_batch records the largest that ran")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPUs, fp32 on CPUs")
    parser.add_argument("--loss", default="forward_kl", help="a registered logit loss")
    parser.add_argument("--chunk-size", type=int, default=4096, help="the logit loss's rows per float32 chunk")
    parser.add_argument("--zero3", type=parse_setting, nargs="*",
                        default=[parse_setting("stage3_prefetch_bucket_size=5e8"),
                                 parse_setting("stage3_max_live_parameters=3e9")],
                        help="ZeRO-3 settings for every ZeRO-3 model, KEY=VALUE under zero_optimization")
    parser.add_argument("--loss-memory-shape", default="8,2048",
                        help="BATCH,LENGTH for the loss-memory measurement; 0 skips it")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H200 dense bf16 spec")
    parser.add_argument("--peak-fp8-tflops", type=float, default=1979.0, help="H200 dense FP8 spec")
    parser.add_argument("--measured-tflops", type=float, default=790.0, help="bf16 matmul measured on an H200")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.micro_batches and min(args.micro_batches) < 1:
        parser.error(f"--micro-batches must all be >= 1, got {args.micro_batches}")
    args.runs = expand([parse_run(text, args.micro_batch) for text in args.runs], args.teacher_head,
                       args.micro_batches)
    return args


def loss_memory_rows(args: argparse.Namespace, pair: pairs.Pair, device: torch.device) -> tuple[Any, Any]:
    """The logit loss on given logits (chunked vs naive), and the student's head + loss (chunked, fused, naive)."""
    if args.loss_memory_shape == "0":
        return None, None
    batch, length = (int(x) for x in args.loss_memory_shape.split(","))
    shape, dtype = (batch, length, pair.student.vocab_size), pairs.TORCH_DTYPES[args.dtype]
    chunks = sorted({args.chunk_size, 1024}, reverse=True)

    def loss(chunk: int):
        return build_loss({"name": args.loss, "chunk_size": chunk})

    memory = loss_memory.measure({f"ours_chunk{chunk}": loss(chunk) for chunk in chunks}, NaiveForwardKL(), shape,
                                 device, dtype)
    with_head = {"chunked_chunk1024": (loss(1024), False),
                 **{f"fused_chunk{chunk}": (loss(chunk), True) for chunk in chunks}}
    memory_head = loss_memory.measure_with_head(with_head, NaiveForwardKL(), shape, pair.student.hidden_size, device,
                                                dtype)
    return memory, memory_head


def main() -> None:
    args = parse_args()
    device = distributed.init()
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    transformers.logging.set_verbosity_error()
    pair = pairs.PAIRS[args.pair]
    facts = model_facts(pair)
    memory, memory_head = loss_memory_rows(args, pair, device)
    result = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(device),
            "command": launch_command(),
            "pair": pair.description,
            "world_size": distributed.world_size(),
            "seq_len": args.seq_len,
            "dtype": args.dtype,
            "loss": f"{args.loss} (chunk {args.chunk_size})",
            "teacher_head": args.teacher_head,
            "micro_batches": args.micro_batches,
            "zero3": {k.removeprefix("zero_optimization."): v for k, v in args.zero3},
            "warmup": args.warmup,
            "steps": args.steps,
            "peak_tflops": args.peak_tflops,
            "measured_tflops": args.measured_tflops,
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                         "transformers": transformers.__version__},
            **facts,
        },
        "loss_memory": memory,
        "loss_memory_head": memory_head,
        "runs": [],
    }
    ran_out: dict[str, int] = {}  # per shape_key, the smallest micro-batch that ran out of memory
    for run in args.runs:
        described = {"label": run.label, "mode": run.mode, "micro_batch": run.micro_batch, "levers": list(run.levers)}
        if run.micro_batch >= ran_out.get(shape_key(run), run.micro_batch + 1):
            result["runs"].append(described | {"status": f"not attempted: micro-batch {ran_out[shape_key(run)]} "
                                                         "ran out of memory"})
        else:
            try:
                result["runs"].append(measure(run, args, facts, device))
            except torch.OutOfMemoryError as err:  # every rank runs the same shapes, so all of them land here
                result["runs"].append(described | {"status": "out of memory",
                                                   "error": str(err).splitlines()[0][:300]})
                ran_out[shape_key(run)] = min(run.micro_batch, ran_out.get(shape_key(run), run.micro_batch))
            gc.collect()  # outside the handler, once the failed run's frames are gone
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["largest_micro_batch"] = largest_micro_batches(result["runs"])
        result["teacher_head"] = teacher_head_pairs(result["runs"])
        if distributed.is_main():  # after every run, so that a run cut short by a time limit keeps the others
            report.write_outputs(result, args.out)
            print(report.markdown(result), flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()

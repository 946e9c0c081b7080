"""Paged routed teachers on one GPU: tokens/s against steps per switch, beside one resident teacher and ZeRO-3 offload.

Four Qwen2.5-14B-shaped bf16 teachers (Qwen2 architecture, 14.8B parameters, 27.5 GiB each, 110 GiB together: more
than one H200 holds beside a student) and a Qwen2-0.5B-shaped student, random weights (speed depends on shapes, not
on what the weights learned), ``combine: route``, forward KL, sequences of ``--seq-len`` tokens. Three parts, each in
its own process (so that one part's pinned host memory is given back before the next):

* ``resident``: one teacher, replicated on the GPU, every step routed to it: the ceiling (no switching).
* ``paged``: the four teachers ``training.teacher_residency: paged``, two device slots; ``--pinned`` of them in pinned
  host memory, the rest on disk (``--disk-dir``), read back through the pager's pinned staging buffers. The route
  switches teacher every k steps for each k of ``--steps-per-switch``, the teachers in turn; the route order is known
  in advance (as a routed loader's epoch order is), and after each switch the pager is told the next teacher
  (``pager.prefetch``) so that its transfer overlaps the current teacher's steps (``--no-prefetch``: it is not).
* ``offload``: DeepSpeed ZeRO-3 ``offload_param: {device: cpu, pin_memory: true}`` (``teacher_residency: offload``),
  ``--offload-teachers`` teachers at ``--offload-steps-per-switch``: every forward fetches every layer from the host,
  so its cost per step does not depend on the switching.

Each part reports tokens/s (the mean step over the timed window: a switch's cost lands on a few steps, which a median
would hide), its median step, peak GPU memory, and for ``paged`` what was kept where, switches, the bytes moved and
the time the steps waited for them. Outputs: ``OUT/bench.json`` and ``OUT/results.md``.

GPU (one H200, about 6 minutes; copy runs/paged back)::

    mkdir -p runs/paged && python benchmarks/bench_paged.py --out runs/paged 2>&1 | tee runs/paged/log.txt

CPU smoke (what the test suite runs, seconds)::

    python benchmarks/bench_paged.py --pair tiny --seq-len 32 --micro-batch 2 --warmup 1 --steps-per-switch 1 2 \\
        --window 4 --offload-steps 2 --out /tmp/bench_paged
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pairs  # this and the other benchmarks/ siblings: the script's directory is on the path
import torch
import transformers
from phases import TimedDistiller

from distill_kit import DeepSpeedSettings, StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.config import CONFIG_DIR
from distill_kit.engines import deepspeed_config, distributed
from distill_kit.teachers import residency

GIB = 2**30
TEACHERS = 4
SHAPES = {
    # Qwen2.5-14B's shape (Qwen2 architecture): 48 layers, hidden 5120, 40 query / 8 key-value heads, vocabulary
    # padded to 152,064; and Qwen2-0.5B's for the student (the losses cut the teacher's vocabulary to its 151,936).
    "qwen2-14b-0.5b": pairs.Pair(pairs.qwen2(5120, 13824, 48, 40, 8, pairs.QWEN2_72B_VOCAB, tied=False),
                                 pairs.qwen2(896, 4864, 24, 14, 2, pairs.QWEN2_VOCAB, tied=True),
                                 "4 x Qwen2.5-14B-shaped teachers, Qwen2-0.5B-shaped student"),
    "tiny": pairs.PAIRS["tiny"],
}


class ScheduledDistiller(TimedDistiller):
    """The timed Distiller, told the route in advance: after each teacher forward it asks the pager to start on the
    next teacher the route switches to (what a routed loader's known epoch order allows)."""

    schedule: list[int] = []
    prefetch = True

    def teacher_forward(self, batch: Any) -> Any:
        out = super().teacher_forward(batch)
        pager = self.teachers.pager
        if pager is not None and self.prefetch:
            now = self.schedule[self.step]
            upcoming = next((t for t in self.schedule[self.step + 1:] if t != now), None)
            if upcoming is not None:
                pager.prefetch(list(self.teachers.members)[upcoming])
        return out


def batches_for(schedule: list[int], args: argparse.Namespace, vocab: int, seed: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for teacher in schedule:
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=generator)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
                    "teacher_id": torch.full((args.micro_batch,), teacher, dtype=torch.long)})
    return out


def build_teachers(count: int, config: Any, ds_config: dict[str, Any], args: argparse.Namespace,
                   device: torch.device) -> list[torch.nn.Module]:
    """Random-initialised teachers on the GPU (far faster than on the CPU); ZeRO-3 ones partitioned as built."""
    teachers = []
    for index in range(count):
        torch.manual_seed(args.seed + index)
        teachers.append(pairs.build(config, ds_config, args.dtype, device, "sdpa"))
    return teachers


def timed(distiller: ScheduledDistiller, batches: list[dict[str, Any]], steps: int, tokens_per_step: int,
          device: torch.device) -> dict[str, Any]:
    """``steps`` more steps; the mean and median step of them, from the clock's events (read once, at the end)."""
    first = len(distiller.clock.steps)
    started = time.perf_counter()
    distiller.train(batches, until=distiller.step + steps)
    distiller.clock.finish()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - started
    step_ms = distiller.clock.summary(skip=first)["step_ms_all"][:steps]
    mean = statistics.fmean(step_ms)
    return {"steps": steps, "tokens_per_s": tokens_per_step / (mean / 1e3), "mean_step_ms": mean,
            "median_step_ms": statistics.median(step_ms), "wall_s": wall, "step_ms_all": step_ms}


def run_part(args: argparse.Namespace) -> dict[str, Any]:
    device = distributed.init()
    cuda = device.type == "cuda"
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    transformers.logging.set_verbosity_error()
    pair = SHAPES[args.pair]
    count = {"resident": 1, "paged": TEACHERS, "offload": args.offload_teachers}[args.part]
    residency_name = {"resident": "resident", "paged": "paged", "offload": "offload"}[args.part]
    kept = max(0, min(args.pinned, TEACHERS))
    sizes = residency.teacher_bytes(residency_card(pair.teacher), args.dtype)
    # The pinned budget: --pinned teachers and half of one more (so the next one goes to disk).
    paging = {"slots": 2, "host_gib": (kept * sizes + sizes // 2) / GIB, "disk_dir": args.disk_dir}
    training = TrainingConfig(max_steps=10**6, micro_batch_size=args.micro_batch, dtype=args.dtype, lr=1e-5,
                              log_every=10**9, teacher_kernels="none", student_kernels="none",
                              teacher_residency=residency_name, teacher_paging=paging)
    overrides = {"zero_optimization.stage": 0} | residency.ds_overrides(residency_name)
    student_cfg, teacher_cfg = deepspeed_config.prepare_pair(
        CONFIG_DIR / "zero2_student.json", CONFIG_DIR / "zero3_teacher.json", training,
        student_hidden_size=pair.student.hidden_size, teacher_hidden_size=pair.teacher.hidden_size,
        world_size=1, teacher_overrides=overrides)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    build_started = time.perf_counter()
    teachers = build_teachers(count, pair.teacher, teacher_cfg, args, device)
    student = pairs.build(pair.student, student_cfg, args.dtype, device, "sdpa")
    distiller = ScheduledDistiller(
        students=[StudentSpec(name="s", model=student, loss="forward_kl")],
        teachers=[TeacherSpec(name=f"t{i}", model=teacher) for i, teacher in enumerate(teachers)],
        combine="route", training=training,
        deepspeed=DeepSpeedSettings(student=student_cfg, teacher=teacher_cfg))
    del teachers
    distiller.prefetch = not args.no_prefetch
    build_peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    if cuda:  # the steps' peak, not the teachers' while they were built on the GPU and moved off it
        torch.cuda.reset_peak_memory_stats(device)
    result: dict[str, Any] = {"part": args.part, "teachers": count, "build_s": time.perf_counter() - build_started,
                              "teacher_gib_each": sizes / GIB}
    if distiller.plan.paging is not None:
        result["kept"] = distiller.plan.paging.kept
        result["where"] = distiller.plan.paging.describe()
        print(result["where"], flush=True)
    tokens = args.micro_batch * args.seq_len
    vocab = pair.student.vocab_size
    if args.part == "resident":
        schedule = [0] * (args.warmup + args.window)
        distiller.schedule = schedule
        batches = batches_for(schedule, args, vocab, args.seed)
        distiller.train(batches, until=args.warmup)
        result["runs"] = [{"label": "resident", "steps_per_switch": None} | timed(distiller, batches, args.window,
                                                                                   tokens, device)]
    elif args.part == "paged":
        schedule, windows = [0] * args.warmup, []
        turn = 0
        for k in args.steps_per_switch:  # each window starts at a switch, the teachers in turn
            steps = -(-max(args.window, 2 * k) // k) * k  # whole runs of k, two switches at least
            window = []
            while len(window) < steps:
                turn = (turn + 1) % TEACHERS
                window += [turn] * k
            windows.append((k, len(schedule), steps))
            schedule += window
        distiller.schedule = schedule
        batches = batches_for(schedule, args, vocab, args.seed)
        distiller.train(batches, until=args.warmup)
        pager = distiller.teachers.pager
        result["runs"] = []
        for k, start, steps in windows:
            before = dict(pager.stats)
            run = timed(distiller, batches, steps, tokens, device)
            visited = sorted({f"t{t}" for t in schedule[start:start + steps]})
            result["runs"].append({"label": f"paged k={k}", "steps_per_switch": k, "teachers_visited": visited,
                                   "disk_teachers_visited": [t for t in visited if result["kept"][t] == "disk"],
                                   **{f"pager_{key}": pager.stats[key] - before[key] for key in pager.stats}} | run)
        pager.close()
    else:
        k = args.offload_steps_per_switch
        steps = max(args.offload_steps, k)
        schedule = [0] * args.warmup + [(i // k) % count for i in range(steps)]
        distiller.schedule = schedule
        batches = batches_for(schedule, args, vocab, args.seed)
        distiller.train(batches, until=args.warmup)
        result["runs"] = [{"label": f"ZeRO-3 offload_param k={k}", "steps_per_switch": k}
                          | timed(distiller, batches, steps, tokens, device)]
    result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    result["build_peak_allocated_gib"] = build_peak
    return result


def residency_card(config: Any) -> Any:
    """A card with only a config: what ``residency.teacher_bytes`` reads."""
    from distill_kit.teachers.base import TeacherCard

    return TeacherCard(kind="engine", source="bench", outputs=frozenset(), config=config)


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    resident = next((run for part in result["parts"] if part.get("part") == "resident" for run in part["runs"]), None)
    lines = [f"### {meta['date']}, {meta['machine']}: paged routed teachers", "",
             f"{meta['pair']}; {meta['dtype']}, sequence {meta['seq_len']}, micro-batch {meta['micro_batch']}, "
             f"forward KL, combine: route. Command: `{meta['command']}`.", ""]
    for part in result["parts"]:
        if "where" in part:
            lines += [f"Kept: {part['where']}.", ""]
        if part.get("error"):
            lines += [f"Part {part['part']}: failed: {part['error']}", ""]
    lines += ["| run | steps per switch | tokens/s | of resident | mean step ms | median step ms | waited s | "
              "teachers (disk) | peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for part in result["parts"]:
        for run in part.get("runs", []):
            share = f"{run['tokens_per_s'] / resident['tokens_per_s']:.0%}" if resident else "-"
            visited = ", ".join(run.get("teachers_visited", [])) or "-"
            disk = run.get("disk_teachers_visited")
            lines.append(
                f"| {run['label']} | {run['steps_per_switch'] or '-'} | {run['tokens_per_s']:,.0f} | {share} | "
                f"{run['mean_step_ms']:.0f} | {run['median_step_ms']:.0f} | "
                f"{run.get('pager_wait_s', 0):.2f} | {visited}{' (disk: ' + ', '.join(disk) + ')' if disk else ''} | "
                f"{part['peak_allocated_gib'] or 0:.1f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for bench.json and results.md")
    parser.add_argument("--pair", choices=sorted(SHAPES), default="qwen2-14b-0.5b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps-per-switch", type=int, nargs="+", default=[1, 2, 8, 32])
    parser.add_argument("--window", type=int, default=8,
                        help="timed steps per steps-per-switch value (at least two switches' worth)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pinned", type=int, default=3, help="teachers kept in pinned host memory; the rest on disk")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(), help="where the other teachers' copies go")
    parser.add_argument("--no-prefetch", action="store_true", help="do not tell the pager the next teacher")
    parser.add_argument("--offload-teachers", type=int, default=2)
    parser.add_argument("--offload-steps-per-switch", type=int, default=8)
    parser.add_argument("--offload-steps", type=int, default=16)
    parser.add_argument("--parts", nargs="+", default=["resident", "paged", "offload"],
                        choices=["resident", "paged", "offload"])
    parser.add_argument("--part", choices=["resident", "paged", "offload"], help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPUs, fp32 on CPUs")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:  # one part, in this process
        (args.out / f"part_{args.part}.json").write_text(json.dumps(run_part(args), indent=1))
        return
    cuda = torch.cuda.is_available()
    result = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": torch.cuda.get_device_name(0) if cuda else "CPU",
        "command": "python benchmarks/bench_paged.py " + " ".join(sys.argv[1:]),
        "pair": SHAPES[args.pair].description, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "dtype": args.dtype or ("bf16" if cuda else "fp32"), "host_gib": residency.available_memory().host / GIB,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}, "parts": []}
    for part in args.parts:
        started = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--part", part], env=env, check=False)
        path = args.out / f"part_{part}.json"
        if done.returncode == 0 and path.is_file():
            result["parts"].append(json.loads(path.read_text()))
        else:
            result["parts"].append({"part": part, "error": f"exit status {done.returncode}", "runs": []})
        result["parts"][-1]["part_s"] = time.perf_counter() - started
        (args.out / "bench.json").write_text(json.dumps(result, indent=1))
        (args.out / "results.md").write_text(markdown(result))
    print(markdown(result), flush=True)


if __name__ == "__main__":
    main()

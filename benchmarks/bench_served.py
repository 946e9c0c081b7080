"""A served teacher against the in-process one: tokens/s of the student's step, and what parsing a response costs.

Two parts, in one launch:

1. ``parse``: a response for 32 x 1,024 positions at k = 64 (2M entries), as vLLM's JSON (``prompt_logprobs``, the
   serialisation ``served_protocol.parse_vllm`` reads) and as the project's binary ``/v1/topk`` body: bytes, and the
   CPU seconds to parse each into targets (median of ``--repeats``).
2. ``step``: the same student step (forward, forward-KL, backward, AdamW) fed by (a) the teacher in process on the
   same GPU (dense logits, the Distiller's default path), (b) the same teacher served by ``scripts/serve_teacher.py``
   in its own process on the same GPU (``--random-weights``: the shape, random weights, as ``pairs.py`` builds it)
   at each ``--k``, at each prefetch depth (``--prefetch-depths``: 0 none; d: the next d micro-batches' requests
   sent before the student's step on this one). Reported: tokens/s, served / in-process, and the share of the step
   spent waiting on the teacher (``ServedTeacher.waited_s`` over the timed steps' wall time).
3. The whole distribution at a distance (issue 41): (c) the in-process teacher with its head applied at the loss
   (``engines/head.py:teacher_head_forward``, what the Distiller runs for a logit loss), and (d) the served teacher's
   ``payload: hidden`` (final hidden states over HTTP, the head applied at the loss) at each depth;
   ``hidden_vs_in_process`` names the best (d) row and its ratio to (c) (the issue's target: >= 0.85), then
   ``--rounds`` - 1 more rounds of (c) and that row, and the median ratio. Every served row reports
   ``bytes_per_token`` (the answers' bytes over the positions asked; the head's one-time fetch left out) and each
   hidden row ``phases_s``: the mean seconds of each phase of its timed requests, the server's (``server_lock``,
   ``server_forward``, ``server_copy``, ``server_encode``, from its timing header) and the client's (``sent``,
   ``head``: until the answer's headers, ``body``: reading it, ``check``: to the device and checked there).
   ``setup_s``: when the models were built and the server (started first, loading meanwhile) answered.

GPU (one H200; the issue's acceptance: 7B-shaped teacher -> 0.5B student, 1,024 tokens)::

    python benchmarks/bench_served.py --pair qwen2-7b-0.5b --seq-len 1024 --micro-batch 8 --k 20 64 \
        --prefetch-depths 0 1 2 --top-k-depths 1 --rounds 3 --out runs/served

CPU smoke (tiny shapes, seconds)::

    python benchmarks/bench_served.py --pair tiny --seq-len 32 --micro-batch 2 --steps 3 --warmup 1 --k 8 \\
        --device cpu --dtype fp32 --parse-positions 2048 --out /tmp/served
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pairs  # a sibling in benchmarks/
import torch

from distill_kit.config import TeacherSpec
from distill_kit.teachers import served_protocol as protocol
from distill_kit.teachers.base import TeacherSetup
from distill_kit.teachers.kinds import describe
from distill_kit.teachers.served import ServedTeacher
from losses import build_loss

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen2-7b-0.5b", choices=sorted(pairs.PAIRS))
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--k", type=int, nargs="+", default=[20, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--rows-per-request", type=int, default=8)
    parser.add_argument("--parse-positions", type=int, default=32 * 1024, help="positions in the parse test")
    parser.add_argument("--parse-k", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-step", action="store_true", help="the parse part only")
    parser.add_argument("--payloads", nargs="+", choices=("top_k", "hidden"), default=["top_k", "hidden"],
                        help="which served payloads the step part runs")
    parser.add_argument("--prefetch-depths", type=int, nargs="+", default=[0, 1],
                        help="each served payload runs once per depth: 0 no prefetch, d the next d micro-batches' "
                             "requests sent before the student's step (at most 3)")
    parser.add_argument("--top-k-depths", type=int, nargs="+", help="top-k's depths (default: --prefetch-depths)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="the hidden comparison (the head row, then the best served hidden row) this many times "
                             "in all; the median ratio is the figure")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="no further top-k row or round once this many seconds passed")
    parser.add_argument("--no-dense", action="store_true",
                        help="skip the in-process dense-logit row (the hidden payload's baseline is the head row)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


# ---------------------------------------------------------------------------------------------------- parse


def parse_cost(positions: int, k: int, repeats: int, vocab: int = 151_936) -> dict[str, Any]:
    """One response of ``positions`` targets at ``k``, as vLLM JSON and as the binary body: size and parse time."""
    rng = np.random.default_rng(0)
    length = min(positions, 1024)
    prompts = [rng.integers(0, vocab, length + 1).tolist() for _ in range(max(1, positions // length))]
    n = sum(len(p) - 1 for p in prompts)
    ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(n)]).astype(np.int32)
    values = np.sort(np.log(rng.dirichlet(np.ones(k * 4), n)[:, :k]).astype(np.float32), axis=-1)[:, ::-1]
    tails = protocol.derived_tail(values)
    choices, row = [], 0
    for index, prompt in enumerate(prompts):
        positions_json: list[Any] = [None]
        for j in range(1, len(prompt)):
            entry = {str(int(t)): {"logprob": float(v), "rank": r + 1, "decoded_token": None}
                     for r, (t, v) in enumerate(zip(ids[row], values[row], strict=True))}
            entry.setdefault(str(prompt[j]), {"logprob": float(values[row, -1]) - 1.0, "rank": k + 5,
                                              "decoded_token": None})
            positions_json.append(entry)
            row += 1
        choices.append({"index": index, "text": "", "prompt_logprobs": positions_json, "prompt_token_ids": prompt})
    body_json = json.dumps({"object": "text_completion", "model": "m", "choices": choices}).encode()
    body_bin = protocol.encode_topk(prompts, k, ids, values, tails)

    def timed(api: str, body: bytes) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            protocol.parse(api, body, prompts, k)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    json_s, bin_s = timed("vllm", body_json), timed("distill_kit", body_bin)
    return {"positions": n, "k": k, "json_bytes": len(body_json), "binary_bytes": len(body_bin),
            "json_parse_s": json_s, "binary_parse_s": bin_s, "json_over_binary": json_s / max(bin_s, 1e-9)}


# ----------------------------------------------------------------------------------------------------- step


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def batches(count: int, batch: int, length: int, vocab: int, device: torch.device) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        out.append({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
                    "labels": ids.to(device)})
    return out


def run_steps(student, optimizer, loss, data, warmup, teacher_of, prefetch=None, depth: int = 1) -> float:
    """Seconds of the steps after ``warmup``; ``teacher_of(batch)`` gives the teacher's output, ``prefetch(batch)``
    the early request for the next ``depth`` micro-batches (sent before the student's step on this one)."""
    start = time.perf_counter()
    for i, batch in enumerate(data):
        if i == warmup:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            start = time.perf_counter()
        teacher_out = teacher_of(batch)
        if prefetch is not None:
            for ahead in data[i + 1:i + 1 + depth]:
                prefetch(ahead)
        out = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        value = loss(out, teacher_out, batch).total
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def wait_healthy(port: int, server: subprocess.Popen, limit_s: float = 900) -> float:
    """Seconds until the server at ``port`` answers ``/health`` (it loads while the models here are built)."""
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        if server.poll() is not None:
            raise RuntimeError(f"the teacher server exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the teacher server did not come up in {limit_s} s")


def phases(timings: list[dict[str, float]]) -> dict[str, float]:
    """The mean seconds of each phase of the timed requests (``Transport.timings``)."""
    names = sorted({name for t in timings for name in t})
    return {name: statistics.mean(t.get(name, 0.0) for t in timings) for name in names} | {"requests": len(timings)}


def step_benchmark(args: argparse.Namespace, save=lambda results: None) -> dict[str, Any]:
    """The step part; ``save(results so far)`` after each served row (a run cut short keeps what it measured)."""
    device, pair = torch.device(args.device), pairs.PAIRS[args.pair]
    began = time.perf_counter()
    folder = tempfile.mkdtemp()
    pair.teacher.save_pretrained(folder)
    port = free_port()
    server = subprocess.Popen(  # started first: it loads while the models here are built
        [sys.executable, str(ROOT / "scripts" / "serve_teacher.py"), folder, "--random-weights", "--port",
         str(port), "--device", args.device, "--dtype", args.dtype, "--max-k", str(max(args.k))],
        env=os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    try:
        return _step_benchmark(args, device, pair, port, server, began, save)
    finally:
        server.kill()
        server.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def _step_benchmark(args, device, pair, port, server, began, save) -> dict[str, Any]:
    data = batches(args.warmup + args.steps, args.micro_batch, args.seq_len, pair.student.vocab_size, device)
    tokens = args.steps * args.micro_batch * args.seq_len
    positions = len(data) * args.micro_batch * (args.seq_len - 1)
    student = pairs.build(pair.student, {}, args.dtype, device, "sdpa")
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)
    loss = build_loss({"name": "forward_kl", "chunk_size": 1024})
    results: dict[str, Any] = {}

    teacher = pairs.build(pair.teacher, {}, args.dtype, device, "sdpa").eval().requires_grad_(False)
    built = time.perf_counter() - began
    results["setup_s"] = {"models_built": built, "server_up": built + wait_healthy(port, server)}
    print(f"setup: {results['setup_s']}", flush=True)

    def in_process(batch):
        with torch.no_grad():
            return teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    def in_process_head(batch):
        from distill_kit.engines.head import teacher_head_forward

        with torch.no_grad():
            return teacher_head_forward(teacher, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    def in_process_row(name: str, teacher_of) -> dict[str, Any]:
        wall = run_steps(student, optimizer, loss, data, args.warmup, teacher_of)
        row = {"tokens_per_s": tokens / wall, "step_s": wall / args.steps}
        print(f"{name}: {row}", flush=True)
        return row

    def served_row(payload: str, k: int | None, depth: int, base: dict[str, Any]) -> dict[str, Any]:
        options = {"wait_s": 900, "rows_per_request": args.rows_per_request, "timeout_s": 600}
        options |= {"payload": "hidden"} if payload == "hidden" else {"k": k}
        spec = TeacherSpec(name="served", model=f"http://127.0.0.1:{port}", options=options)
        made = time.perf_counter()
        served = ServedTeacher(spec, describe(spec), TeacherSetup({}, None, device))
        made = time.perf_counter() - made
        received = served.transport.received  # the head's one-time fetch left out
        waited, timed = [0.0], [0]

        def teacher_of(batch):
            if batch is data[args.warmup]:
                waited[0] = served.waited_s  # the timed steps' wait only
                timed[0] = len(served.transport.timings)
            return served.forward(batch)

        wall = run_steps(student, optimizer, loss, data, args.warmup, teacher_of,
                         served.prefetch if depth else None, depth)
        row = {"tokens_per_s": tokens / wall, "step_s": wall / args.steps, "prefetch_depth": depth,
               "waiting_share": (served.waited_s - waited[0]) / wall,
               "vs_in_process": base["step_s"] / (wall / args.steps),
               "bytes_per_token": (served.transport.received - received) / positions, "client_setup_s": made}
        if payload == "hidden":
            row["phases_s"] = phases(list(served.transport.timings)[timed[0]:])
        served.close()
        return row

    if not args.no_dense:
        results["in_process"] = in_process_row("in_process", in_process)
    if "hidden" in args.payloads:
        results["in_process_head"] = in_process_row("in_process_head", in_process_head)
    runs = [("hidden", None, depth) for depth in args.prefetch_depths if "hidden" in args.payloads]
    runs += [("top_k", k, depth) for k in args.k if "top_k" in args.payloads
             for depth in (args.top_k_depths if args.top_k_depths is not None else args.prefetch_depths)]
    for payload, k, depth in runs:
        name = (f"served_k{k}" if payload == "top_k" else "served_hidden") + (
            "" if not depth else "_prefetch" if depth == 1 else f"_prefetch{depth}")
        if payload == "top_k" and time.perf_counter() - began > args.budget_s:
            print(f"{name}: past --budget-s {args.budget_s}, not run", flush=True)
            continue
        results[name] = served_row(payload, k, depth,
                                   results["in_process_head" if payload == "hidden" else "in_process"])
        print(f"{name}: {results[name]}", flush=True)
        save(results)
    hidden = {name: row["vs_in_process"] for name, row in results.items() if name.startswith("served_hidden")}
    if hidden:
        best = max(hidden, key=hidden.get)
        rounds = [{"in_process_head_step_s": results["in_process_head"]["step_s"],
                   "served_step_s": results[best]["step_s"], "ratio": hidden[best]}]
        for number in range(1, args.rounds):  # the comparison again: the head row, then the best served row
            if time.perf_counter() - began > args.budget_s:
                print(f"round {number + 1}: past --budget-s {args.budget_s}, not run", flush=True)
                break
            base = in_process_row(f"round {number + 1} in_process_head", in_process_head)
            row = served_row("hidden", None, results[best]["prefetch_depth"], base)
            rounds.append({"in_process_head_step_s": base["step_s"], "served_step_s": row["step_s"],
                           "ratio": row["vs_in_process"], "phases_s": row["phases_s"]})
            save(results | {"rounds_so_far": rounds})
            print(f"round {number + 1}: {rounds[-1]}", flush=True)
        results["hidden_vs_in_process"] = {"row": best, "rounds": rounds,
                                           "median": statistics.median(r["ratio"] for r in rounds)}
    results["wall_s"] = time.perf_counter() - began
    return results


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                              "parse": parse_cost(args.parse_positions, args.parse_k, args.repeats)}
    print(json.dumps(report["parse"], indent=1), flush=True)
    if not args.skip_step:
        def save(step: dict[str, Any]) -> None:
            (args.out / "served.json").write_text(json.dumps(report | {"step": step, "partial": True}, indent=1))

        report["step"] = step_benchmark(args, save)
        print(json.dumps(report["step"], indent=1), flush=True)
    (args.out / "served.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

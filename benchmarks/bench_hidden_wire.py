"""The ``/v1/hidden`` round trip at a 7B teacher's answer size, on the CPU: what serialising, the wire, parsing and
checking cost, the model's forward aside (issue 41).

A real ``scripts/serve_teacher.py`` on 127.0.0.1 serves a Qwen2-shaped model built to be cheap and wide: hidden
size 3,584 (Qwen2-7B's), one layer of one 8-wide attention head and an 8-wide MLP, bf16, random weights, so one
request of 8 rows x 1,024 tokens answers 8 x 1,023 x 3,584 x 2 = 58.7 MB, as the 7B teacher's does, after a forward
of a fraction of a second. Two clients ask it for the same micro-batch ``--requests`` times each, one after another:

* ``before``: what the client did before this benchmark existed, written out here: httpx's streamed read (64 KiB
  chunks, joined), the values copied out of the body (``numpy.astype``), the finite and scale checks as
  ``abs().amax()`` on the host in bfloat16, and the (B, T, H) tensor assembled on the host by index assignment;
* ``after``: ``ServedTeacher.forward`` (``payload: hidden``): the body read by the socket into one buffer
  (``served_wire.py``), the checks on the values' bits (``served_protocol.hidden_peaks``), one ``index_copy_``.

Reported per client: the median wall seconds of a micro-batch, the client process's CPU seconds (all its threads)
per micro-batch, and the server's phases (its timing header). The server's own side changed too (one device->host
copy of the gathered rows, one copy into the body, where it copied row by row and twice more): ``server_*`` here is
the new server's for both clients.

    OMP_NUM_THREADS=1 python benchmarks/bench_hidden_wire.py --out /tmp/wire
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill_kit.config import TeacherSpec  # noqa: E402
from distill_kit.teachers import served_protocol as protocol  # noqa: E402
from distill_kit.teachers.base import TeacherSetup  # noqa: E402
from distill_kit.teachers.kinds import describe  # noqa: E402
from distill_kit.teachers.served import ServedTeacher, prompts_of  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=3584)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def write_model(folder: str, hidden_size: int) -> None:
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=512, hidden_size=hidden_size, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=1, num_key_value_heads=1, head_dim=8, max_position_embeddings=4096,
                tie_word_embeddings=False, torch_dtype="bfloat16").save_pretrained(folder)


def cpu_seconds() -> float:
    return time.process_time()  # this process, every thread


def before(served: ServedTeacher, batch: dict) -> dict[str, float]:
    """The client's steps before: httpx read, copy out, host bf16 checks, host assembly."""
    times, start = {}, time.perf_counter()
    segments = prompts_of(batch)
    prompts = [tokens.tolist() for _, tokens, _ in segments]
    transport = served.transport

    async def read() -> bytes:  # Transport._fetch's read, timed: the head (the server's work), then the body
        async with transport.client.stream("POST", transport.url + "/v1/hidden", json={"prompts": prompts}) as reply:
            times["head"] = time.perf_counter() - start
            chunks = [chunk async for chunk in reply.aiter_bytes()]
            assert reply.status_code == 200
            return b"".join(chunks)

    body = transport.submit(read()).result()
    times["body"] = time.perf_counter() - start - times["head"]
    mark = time.perf_counter()
    weight = served.head.weight
    hidden_size = int(weight.shape[1])
    begin, n = protocol.hidden_layout(body, len(body), prompts, hidden_size, "bfloat16")
    hidden = protocol.from_bytes(body, "bfloat16", n * hidden_size, begin).reshape(n, hidden_size)
    peak = hidden.abs().amax(-1).float()
    assert bool(torch.isfinite(peak).all())
    assert not bool(protocol.scale_over(peak, hidden_size, *served.head_bound, hidden.dtype).any())
    times["check"] = time.perf_counter() - mark
    mark = time.perf_counter()
    rows, length = batch["input_ids"].shape
    out = torch.zeros((rows, length, hidden_size), dtype=weight.dtype)
    for (row, _, positions), states in zip(segments, hidden.split([len(p) - 1 for p in prompts]), strict=True):
        out[row, torch.as_tensor(positions[:-1])] = states
    times["assemble"] = time.perf_counter() - mark
    times["total"] = time.perf_counter() - start
    return times


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp()
    write_model(folder, args.hidden_size)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "serve_teacher.py"), folder, "--random-weights", "--port", str(port),
         "--device", "cpu", "--dtype", "bf16", "--threads", str(args.server_threads)],
        env=os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    try:
        spec = TeacherSpec(name="served", model=f"http://127.0.0.1:{port}",
                           options={"payload": "hidden", "wait_s": 300, "timeout_s": 300, "rows_per_request": args.rows,
                                    "max_in_flight": 1})
        served = ServedTeacher(spec, describe(spec), TeacherSetup({}, None, torch.device("cpu")))
        ids = torch.randint(0, 512, (args.rows, args.seq_len), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
                        "answer_bytes": None}
        for name in ("before", "after"):
            walls, cpus, parts = [], [], []
            for number in range(args.requests + 1):  # the first: a warm-up
                cpu, start = cpu_seconds(), time.perf_counter()
                if name == "before":
                    part = before(served, batch)
                else:
                    served.forward(batch)
                    part = dict(served.transport.timings[-1])
                wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
                if number:
                    walls.append(wall)
                    cpus.append(cpu)
                    parts.append(part)
            report[name] = {"wall_s": statistics.median(walls), "client_cpu_s": statistics.median(cpus),
                            "walls_s": walls,
                            "phases_s": {key: statistics.median(p[key] for p in parts) for key in parts[0]}}
            print(name, json.dumps(report[name]), flush=True)
        report["answer_bytes"] = served.transport.timings[-1]["bytes"]
        served.close()
    finally:
        server.kill()
        server.wait(timeout=60)
    server_phases = {k: v for k, v in report["after"]["phases_s"].items() if k.startswith("server_")}
    report["server_phases_s"] = server_phases
    report["client_cpu_before_over_after"] = report["before"]["client_cpu_s"] / max(report["after"]["client_cpu_s"],
                                                                                     1e-9)
    (args.out / "hidden_wire.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("answer_bytes", "server_phases_s", "client_cpu_before_over_after")}))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()

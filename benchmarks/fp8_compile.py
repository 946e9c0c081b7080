"""Where an FP8 teacher's compile time goes: a few Qwen2-7B-shaped decoder layers, loaded and quantised as a run
loads them (``engines/fp8.load``), compiled, one scoring forward timed cold and then warm.

Each ``--variants`` entry runs in its own process (``--one``), against an inductor cache folder of its own unless it
repeats an earlier entry's name (then it reads that entry's cache: what a second launch on the same machine sees):

* ``layer``: what a run does (``kernels.apply(model, "compile")``: ``torch.compile`` per decoder layer);
* ``linear``: only each quantised linear layer compiled (the activation's quantisation fused with its matmul);
* ``eager``: nothing compiled (FP8 matmuls with eager scaling and casting).

For each: the first forward's seconds, a warm forward's milliseconds (median of 5), dynamo's graphs and breaks, and
dynamo's own table of where the compile time went (``torch._dynamo.utils.compile_times``). GPU::

    python benchmarks/fp8_compile.py --out runs/fp8_compile --variants layer layer linear eager
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def measure(variant: str, layers: int, batch: int, seq_len: int, pair: str = "qwen2-7b-0.5b") -> dict:
    """One variant in this process (``--one``); the ``tiny`` pair runs on the CPU with the FP8 stand-in."""
    import torch
    from pairs import PAIRS
    from torch import nn

    from distill_kit.engines import fp8, kernels, models

    config = copy.deepcopy(PAIRS[pair].teacher)
    config.num_hidden_layers = layers
    cpu = pair == "tiny"
    device = torch.device("cpu" if cpu else "cuda")
    model = fp8.load(config, device, weights=fp8.random_weights(config.initializer_range),
                     backend="fake" if cpu else "torchao")
    if variant == "layer":
        kernels.apply(model, "compile")
    elif variant == "linear":
        for layer in models.decoder_layers(model):
            for module in layer.modules():
                if isinstance(module, nn.Linear | fp8.FakeFloat8Linear):
                    module.compile()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)

    sync = (lambda: None) if cpu else torch.cuda.synchronize

    def forward() -> float:
        sync()
        began = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        sync()
        return time.perf_counter() - began

    torch._dynamo.utils.counters.clear()
    first = forward()
    warm = statistics.median(forward() for _ in range(5))
    stats = dict(torch._dynamo.utils.counters["stats"])
    return {"variant": variant, "layers": layers, "tokens": batch * seq_len, "first_forward_s": first,
            "warm_forward_ms": warm * 1e3, "first_minus_warm_s": first - warm,
            "dynamo_unique_graphs": stats.get("unique_graphs", 0),
            "dynamo_graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "compile_times": torch._dynamo.utils.compile_times(repr="str", aggregate=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", nargs="+", default=["layer", "layer", "linear", "eager"],
                        choices=["layer", "linear", "eager"])
    parser.add_argument("--pair", choices=["qwen2-7b-0.5b", "tiny"], default="qwen2-7b-0.5b",
                        help="the teacher's shape; tiny: the CPU, with the FP8 stand-in")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=600, help="seconds each variant may take")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.layers, args.batch, args.seq_len, args.pair)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    caches, results = {}, []
    for variant in args.variants:
        seen = variant in caches
        cache = caches.setdefault(variant, tempfile.mkdtemp(prefix=f"inductor-{variant}-"))
        command = [sys.executable, __file__, "--out", str(args.out), "--one", variant, "--layers", str(args.layers),
                   "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--pair", args.pair]
        began = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                                  env=os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache})
            result = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                "variant": variant, "error": done.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            result = {"variant": variant, "error": f"over {args.timeout:.0f} s"}
        result |= {"inductor_cache": "warm (an earlier entry's)" if seen else "cold",
                   "process_s": time.perf_counter() - began}
        results.append(result)
        (args.out / "fp8_compile.json").write_text(json.dumps(results, indent=2))
        print({k: v for k, v in result.items() if k != "compile_times"}, flush=True)
        print(result.get("compile_times", ""), flush=True)


if __name__ == "__main__":
    main()

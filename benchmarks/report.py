"""Turn a ``bench_step.py`` result JSON into the RESULTS.md table and the chart.

The benchmark calls :func:`write_outputs` itself; run this file on a JSON fetched from the GPU machine to
redraw the chart and append the table to ``benchmarks/RESULTS.md``::

    python benchmarks/report.py runs/bench/bench.json --append benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SHARES = {  # column -> phases summed into it
    "teacher fwd": ("teacher_forward",),
    "student fwd+loss": ("student_forward", "loss"),
    "backward": ("backward",),
    "optimizer": ("optimizer_step",),
    "other": ("other",),
}


def shares(run: dict[str, Any]) -> dict[str, float]:
    """Each column's fraction of the median step (phase medians; 'other' is the rest of the wall time)."""
    phase_ms = run["phase_ms"]
    return {column: sum(phase_ms[p] for p in phases) / run["step_ms"] for column, phases in SHARES.items()}


def ratios(result: dict[str, Any]) -> list[tuple[str, float]]:
    """ours / baseline tokens per second, for every pair of runs that differ only in the mode."""
    done = {(r["mode"], r["micro_batch"], tuple(r["levers"])): r for r in result["runs"] if r["status"] == "ok"}
    out = []
    for (mode, micro_batch, levers), run in done.items():
        baseline = done.get(("baseline", micro_batch, levers))
        if mode == "ours" and baseline:
            out.append((run["label"], run["tokens_per_s_per_gpu"] / baseline["tokens_per_s_per_gpu"]))
    return out


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"### {meta['date']} · {meta['machine']} · {meta['pair']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Sequence length {meta['seq_len']}, {meta['world_size']} GPUs, {meta['dtype']}, "
        f"loss {meta['loss']}, ZeRO-3 settings {meta['zero3']}; {meta['warmup']} warm-up + {meta['steps']} timed "
        f"steps, medians. N_teacher {meta['teacher_params'] / 1e6:,.1f}M, "
        f"N_student {meta['student_params'] / 1e6:,.1f}M; "
        f"MFU = (6 N_s + 2 N_t) tokens / time / peak, peak {meta['peak_tflops']:.0f} TFLOP/s (dense bf16 spec) "
        f"and {meta['measured_tflops']:.0f} (measured bf16 matmul).",
        "",
        "| run | tok/s/GPU | MFU spec | MFU measured | peak mem GiB | step ms | "
        + " | ".join(SHARES) + " |",
        "|---" * (6 + len(SHARES)) + "|",
    ]
    for run in result["runs"]:
        if run["status"] != "ok":
            lines.append(f"| {run['label']} | {run['status']} |" + " |" * (5 + len(SHARES)))
            continue
        memory = run["peak_allocated_gib"]
        lines.append(
            f"| {run['label']} | {run['tokens_per_s_per_gpu']:,.0f} | {run['mfu_spec']:.1%} "
            f"| {run['mfu_measured']:.1%} "
            f"| {'-' if memory is None else f'{memory:.1f}'} | {run['step_ms']:.0f} | "
            + " | ".join(f"{value:.0%}" for value in shares(run).values()) + " |"
        )
    lines.append("")
    for label, ratio in ratios(result):
        lines.append(f"- {label} / baseline: **{ratio:.2f}x** tokens/s")
    memory = result["loss_memory"]
    if memory is not None and memory["naive"]["peak_above_inputs_gib"] is not None:
        lines.append(
            f"- Logit loss forward+backward, {memory['batch']}x{memory['length']} tokens, vocab {memory['vocab']:,}, "
            "peak memory above the bf16 logits (the bf16 student-logit gradient included): naive float32 "
            f"{memory['naive']['peak_above_inputs_gib']:.2f} GiB ({memory['naive']['seconds'] * 1e3:.0f} ms); "
            + "; ".join(f"{name} {memory[name]['peak_above_inputs_gib']:.2f} GiB "
                        f"({memory[name]['seconds'] * 1e3:.0f} ms) = **{ratio:.0%} of naive**"
                        for name, ratio in memory["over_naive"].items())
        )
    head = result.get("loss_memory_head")
    if head is not None and head["naive"]["peak_above_inputs_gib"] is not None:
        lines.append(
            f"- Student head + logit loss forward+backward from {head['batch']}x{head['length']} final hidden states "
            f"(width {head['hidden']}), peak memory above the inputs: naive float32 (full logits) "
            f"{head['naive']['peak_above_inputs_gib']:.2f} GiB ({head['naive']['seconds'] * 1e3:.0f} ms); "
            + "; ".join(f"{name} {head[name]['peak_above_inputs_gib']:.2f} GiB "
                        f"({head[name]['seconds'] * 1e3:.0f} ms) = **{ratio:.1%} of naive**"
                        for name, ratio in head["over_naive"].items())
        )
    return "\n".join(lines) + "\n"


def chart(result: dict[str, Any], path: Path) -> None:
    """Tokens/s per GPU per run, and each run's step split into phases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["status"] == "ok"]
    labels = [r["label"] for r in runs]
    fig, (speed, split) = plt.subplots(1, 2, figsize=(13, 0.6 * len(runs) + 2.5))
    speed.barh(labels, [r["tokens_per_s_per_gpu"] for r in runs], color="tab:blue")
    speed.set_xlabel("tokens/s per GPU")
    speed.invert_yaxis()
    left = [0.0] * len(runs)
    for column, phases in SHARES.items():
        widths = [sum(r["phase_ms"][p] for p in phases) for r in runs]
        split.barh(labels, widths, left=left, label=column)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    split.set_xlabel("ms per step (median)")
    split.invert_yaxis()
    split.legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"{meta['pair']} · {meta['machine']} · seq {meta['seq_len']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(result))
    chart(result, out / "chart.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="bench.json written by bench_step.py")
    parser.add_argument("--chart", type=Path, help="where to draw the chart (default: beside the JSON)")
    parser.add_argument("--append", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    result = json.loads(args.json.read_text())
    chart(result, args.chart or args.json.with_suffix(".png"))
    text = markdown(result)
    if args.append:
        with args.append.open("a") as handle:
            handle.write("\n" + text)
    print(text)


if __name__ == "__main__":
    main()

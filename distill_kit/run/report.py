"""The run's report: did distillation help? Printed, written as JSON, and drawn as loss curves.

A distillation framework has to show its students beat the same student trained on the same tokens
without a teacher; when the run trains such a student (loss ``cross_entropy`` alone), the report
states each distilled student's held-out perplexity against it and against the teacher.

Which figures compare: perplexity is per token of a model's own tokenizer, so it compares only models that share
one. When the students' tokenizer differs from the teacher's (the evaluation then leaves out top-1 agreement and
KL), the report compares across tokenizers by bits per byte only: ``summary["comparable"]`` says so, the gap to
the teacher is measured in bits per byte, and the teacher's perplexity is not printed next to the students'.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

NO_TEACHER_LOSS = "cross_entropy"
REWARD_FIGURES = ("reward_mean", "reward_std", "no_signal", "sample_length", "teacher_advantage", "entropy")
"""What a run with rewards records per step beside each student's loss (``losses/policy.py``), kept in the report's
histories, summarised over the first and last tenth of the steps, and drawn in the curves' third panel."""


def no_teacher_students(losses: Mapping[str, Any]) -> list[str]:
    """Students whose only loss is hard-label cross-entropy: the baseline a distilled student must beat."""
    return [name for name, loss in losses.items() if loss == NO_TEACHER_LOSS or loss == {"name": NO_TEACHER_LOSS}]


def summarize(final: Mapping[str, Mapping[str, float]], losses: Mapping[str, Any],
              inits: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Each student's final metrics; ``inits`` says where each started (random, teacher, pretrained). Against the
    first no-teacher student that starts from random weights (the baseline), every other student also gets
    the fraction of the baseline-to-teacher perplexity gap it closes (and bits per byte where measured)."""
    inits = inits or {}
    baselines = [n for n in no_teacher_students(losses) if inits.get(n, "random") == "random"]
    across = across_tokenizers(final)
    metric = "bits_per_byte" if across else "perplexity"  # what compares with the teacher
    own = final.get("teacher", {})  # none when the teachers give top-k targets only (a store, a server)
    teacher = own.get(metric)
    summary: dict[str, Any] = {"teacher_perplexity": own.get("perplexity"), "students": {},
                               "comparable": ["bits_per_byte"] if across else ["perplexity", "bits_per_byte"]}
    if "bits_per_byte" in own:
        summary["teacher_bits_per_byte"] = own["bits_per_byte"]
    for name in losses:
        row = dict(final[name])
        if name in inits:
            row["init"] = inits[name]
        if baselines and name != baselines[0]:
            base = final[baselines[0]]["perplexity"]
            row["no_teacher_perplexity"] = base
            row["perplexity_reduction_vs_no_teacher"] = 1.0 - row["perplexity"] / base
            ours, theirs = row[metric], final[baselines[0]][metric]
            if teacher is not None:
                row["gap_closed"] = (theirs - ours) / (theirs - teacher) if theirs != teacher else float("nan")
            if "bits_per_byte" in row:
                row["no_teacher_bits_per_byte"] = final[baselines[0]]["bits_per_byte"]
        summary["students"][name] = row
    return summary


def reward_summary(history: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Each reward figure's mean over the first and the last tenth of the steps (at least one step each): where the
    run started and where it ended; empty without rewards."""
    if not history or "reward_mean" not in history[0]:
        return {}
    tenth = max(1, len(history) // 10)
    return {f"{key}_{part}": sum(r[key] for r in rows) / len(rows)
            for part, rows in (("first", history[:tenth]), ("last", history[-tenth:]))
            for key in REWARD_FIGURES if key in rows[0]}


def serve_commands(teacher: str, drafter: str | Path, gamma: int, method: str = "draft_model") -> dict[str, str]:
    """How vLLM and SGLang serve ``teacher`` with the exported student ``drafter`` as its draft model, ``gamma`` drafts
    a round (flags read in their sources: vLLM's ``vllm/config/speculative.py`` SpeculativeConfig, method
    ``draft_model``, or ``eagle3`` for a feature-reading drafter; SGLang's ``server_args.py``, algorithm
    ``STANDALONE`` or ``EAGLE3``; docs/drafters.md#serving)."""
    spec = json.dumps({"model": str(drafter), "num_speculative_tokens": gamma, "method": method})
    algorithm = "EAGLE3" if method == "eagle3" else "STANDALONE"
    return {"vllm": f"vllm serve {teacher} --speculative-config '{spec}'",
            "sglang": f"python -m sglang.launch_server --model-path {teacher} --speculative-algorithm {algorithm} "
                      f"--speculative-draft-model-path {drafter} --speculative-num-steps {gamma} "
                      f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {gamma + 1}"}


def add_drafting(summary: Mapping[str, Any], teacher: Mapping[str, Any] | None, students_dir: Path) -> None:
    """Each student measured as a drafter (``speculative_*`` figures) records the teacher it drafts for (name, model,
    sha256 of its weights) and the commands that serve its exported folder as that teacher's draft model."""
    if teacher is None:
        return
    for name, row in summary["students"].items():
        if "speculative_tau" in row:
            row["drafts_for"] = {k: teacher.get(k) for k in ("name", "model", "sha256")}
            row["serve"] = serve_commands(str(teacher.get("model")), students_dir / name, row["speculative_gamma"],
                                          row.get("speculative_method", "draft_model"))


def across_tokenizers(final: Mapping[str, Mapping[str, float]]) -> bool:
    """Whether the students were evaluated on another tokenizer than the teacher's: bits per byte measured, and no
    KL (which needs one vocabulary; ``evaluation.py`` leaves it out exactly then)."""
    students = [row for name, row in final.items() if name != "teacher"]
    return bool(students) and all("bits_per_byte" in row and "mean_kl" not in row for row in students)


def _cell(row: Mapping[str, Any], key: str, width: int, digits: int) -> str:
    return f"{row[key]:>{width}.{digits}f}" if key in row else f"{'-':>{width}}"


def table(summary: Mapping[str, Any]) -> str:
    across = "perplexity" not in summary.get("comparable", ["perplexity"])
    teacher = {} if across or summary["teacher_perplexity"] is None else {"perplexity": summary["teacher_perplexity"]}
    if "teacher_bits_per_byte" in summary:
        teacher["bits_per_byte"] = summary["teacher_bits_per_byte"]
    ppl = "ppl own tok" if across else "held-out ppl"
    lines = [f"{'model':<14}{'init':>9}{ppl:>14}{'bits/byte':>11}{'top-1 agree':>13}{'KL to teacher':>15}"]
    for name, row in {"teacher": teacher, **summary["students"]}.items():
        lines.append(f"{name:<14}{row.get('init', ''):>9}{_cell(row, 'perplexity', 14, 3)}"
                     f"{_cell(row, 'bits_per_byte', 11, 4)}{_cell(row, 'top1_agreement', 13, 3)}"
                     f"{_cell(row, 'mean_kl', 15, 4)}")
    for name, row in summary["students"].items():
        if "no_teacher_bits_per_byte" in row:
            lines.append(f"{name}: held-out bits per byte {row['bits_per_byte']:.4f} vs "
                         f"{row['no_teacher_bits_per_byte']:.4f} without the teacher (teacher: "
                         f"{summary['teacher_bits_per_byte']:.4f}"
                         + (f"; {100 * row['gap_closed']:.1f}% of the gap closed)" if across else ")"))
        elif "gap_closed" in row:
            lines.append(f"{name}: held-out perplexity {row['perplexity']:.3f} vs {row['no_teacher_perplexity']:.3f} "
                         f"without the teacher ({100 * row['perplexity_reduction_vs_no_teacher']:.1f}% lower; "
                         f"{100 * row['gap_closed']:.1f}% of the gap to the teacher closed)")
    for name, row in summary["students"].items():
        if "speculative_tau" in row:
            by_position = " ".join("-" if a is None else f"{a:.2f}" for a in row["speculative_acceptance_by_position"])
            lines.append(f"{name}: as a drafter of the teacher ({row['speculative_mode']}, gamma "
                         f"{row['speculative_gamma']}, {row['speculative_prompts']} held-out prompts): tau "
                         f"{row['speculative_tau']:.3f} tokens a round, acceptance by position {by_position}, "
                         f"predicted speed-up {row['speculative_predicted_speedup']:.2f}x on this device")
    for name, row in summary["students"].items():
        if "reward_mean_last" in row:
            lines.append(f"{name}: reward {row['reward_mean_first']:.4g} -> {row['reward_mean_last']:.4g} (first and "
                         f"last tenth of the steps), groups without signal {row['no_signal_first']:.0%} -> "
                         f"{row['no_signal_last']:.0%}, sample length {row['sample_length_last']:.1f} tokens")
    if across:
        lines.append("the students' tokenizer is not the teacher's: compare by bits per byte; perplexity is per token "
                     "of each model's own tokenizer and compares only the students with one another")
    if "harness" in summary:
        lines.append(harness_table(summary["harness"]))
    return "\n".join(lines)


def harness_table(harness: Mapping[str, Any]) -> str:
    """lm-evaluation-harness scores (``distill_kit/tasks/harness``): a row per model, a column per task and metric."""
    columns = list(dict.fromkeys(key for row in harness["models"].values() for key in row))
    shots = "each task's default shots" if harness.get("num_fewshot") is None else f"{harness['num_fewshot']}-shot"
    limit = f", first {harness['limit']} examples per task" if harness.get("limit") else ""
    lines = [f"lm-evaluation-harness {harness['lm_eval']} ({shots}{limit})",
             f"{'model':<14}" + "".join(f"{c:>{max(len(c) + 2, 10)}}" for c in columns)]
    for name, row in harness["models"].items():
        lines.append(f"{name:<14}" + "".join(_cell(row, c, max(len(c) + 2, 10), 4) for c in columns))
    return "\n".join(lines)


def plot(path: Path, histories: Mapping[str, Sequence[Mapping[str, float]]],
         evaluations: Sequence[Mapping[str, Any]]) -> None:
    """Left: each student's training loss by step. Right: held-out perplexity by step, teacher dashed. With rewards,
    a third panel: each student's mean reward by step."""
    rewarded = {name: h for name, h in histories.items() if h and "reward_mean" in h[0]}
    fig, (left, right, *more) = plt.subplots(1, 3 if rewarded else 2, figsize=(16.5 if rewarded else 11, 4))
    for name, history in rewarded.items():
        more[0].plot([r["step"] for r in history], [r["reward_mean"] for r in history], label=name)
    if rewarded:
        more[0].set(title="mean reward of the samples", xlabel="optimizer step", ylabel="reward")
        more[0].legend()
    for name, history in histories.items():
        left.plot([r["step"] for r in history], [r["loss"] for r in history], label=name)
    left.set(title="training loss (each student's own objective)", xlabel="optimizer step", ylabel="loss")
    left.legend()
    # Bits per byte where measured: it is the one measure that compares models with different tokenizers.
    teacher_final = evaluations[-1]["metrics"].get("teacher", {}) if evaluations else {}
    metric = "bits_per_byte" if "bits_per_byte" in teacher_final else "perplexity"
    for name in histories:
        points = [(e["step"], e["metrics"][name][metric]) for e in evaluations if name in e["metrics"]]
        if points:
            right.plot(*zip(*points, strict=True), marker="o", label=name)
    if evaluations:
        if metric in teacher_final:
            right.axhline(teacher_final[metric], color="k", linestyle="--", label="teacher")
    label = metric.replace("_", " ")
    right.set(title=f"held-out {label}", xlabel="optimizer step", ylabel=label, yscale="log")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out_dir: Path, config: Mapping[str, Any], losses: Mapping[str, Any],
          histories: Mapping[str, Sequence[Mapping[str, float]]], evaluations: Sequence[Mapping[str, Any]],
          extra: Mapping[str, Any], inits: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``report.json`` and ``loss_curves.png`` in ``out_dir``; returns the summary."""
    summary = summarize(evaluations[-1]["metrics"], losses, inits)
    for name, history in histories.items():
        summary["students"].get(name, {}).update(reward_summary(history))
    add_drafting(summary, next(iter(extra.get("teachers") or []), None), out_dir / "students")
    report = {"summary": summary, "evaluations": list(evaluations), "histories": dict(histories),
              "config": dict(config), **extra}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    plot(out_dir / "loss_curves.png", histories, evaluations)
    return summary

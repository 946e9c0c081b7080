"""Score a finished run's exported students (and, once, its teacher) with lm-evaluation-harness; the scores go into
the run's report.json and its table. The settings are the run's own eval.harness, each overridable here:

    python scripts/evaluate_run.py runs/arith --tasks distill_kit_arithmetic,distill_kit_sorting --limit 100
    python scripts/evaluate_run.py runs/qwen-small --tasks gsm8k --offline false    # the harness's own tasks (network)
    python scripts/evaluate_run.py runs/qwen-small --teacher false                  # students only
    python scripts/evaluate_run.py runs/arith_bench --tasks distill_kit_arithmetic   # a task benchmark's folder

A task benchmark's folder (configs/arithmetic.yaml) is scored seed by seed, each seed's students on that seed's
held-out prompts (the task checker's), as a run with eval.harness.tasks would have; its table gains the harness's
columns beside the checker's.

Keys (as in the run config's eval.harness): tasks, num_fewshot, limit, batch_size, teacher, apply_chat_template,
offline, examples, seed. Needs lm-eval: pip install 'distill-kit[eval]'. docs/run.md#lm-evaluation-harness.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from distill_kit.config import HarnessConfig, build
from distill_kit.errors import ConfigError
from distill_kit.run import report, task_benchmark
from distill_kit.tasks import harness


def settings(run_dir: Path, args: Sequence[str]) -> HarnessConfig:
    """The run's eval.harness (from its report.json), with ``--key value`` pairs over it."""
    path = run_dir / "report.json"
    saved = json.loads(path.read_text()).get("config", {}).get("eval", {}).get("harness", {}) if path.is_file() else {}
    values = dict(saved)
    if len(args) % 2:
        raise ConfigError(f"give each setting as --key value, got {list(args)}")
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if not flag.startswith("--"):
            raise ConfigError(f"expected --key value, got {flag!r}")
        key = flag[2:].replace("-", "_").removeprefix("eval.harness.")
        if key == "tasks" and not value.lstrip().startswith("["):
            value = [name.strip() for name in value.split(",") if name.strip()]
        values[key] = value
    return build(HarnessConfig, values, "eval.harness.")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    run_dir = Path(args[0])
    try:
        config = settings(run_dir, args[1:])
        # a task benchmark: each seed's students on that seed's prompts, as the run scores them
        if task_benchmark.is_task_report(run_dir):
            summary = task_benchmark.rescore_with_harness(run_dir, config)
            print(task_benchmark.format_table(summary["rows"], summary["seeds"]))
            print(f"report: {run_dir / 'report.json'}; each seed's harness answers: {run_dir}/seed_<S>/harness")
            return 0
        scores = harness.evaluate_run(run_dir, config)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    summary = harness.add_to_report(run_dir, scores)
    if summary is not None:
        print(report.harness_table(summary["harness"]))
        print(f"report: {run_dir / 'report.json'}; each model's harness results and answers: {run_dir / 'harness'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

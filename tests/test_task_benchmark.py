"""The arithmetic task (generator, checker, tokenizer), its metric, the on-policy settings' errors, and a tiny
run of the task comparison through ``scripts/distill.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launch import ROOT
from test_cli import _main_error

from distill_kit import Distiller
from distill_kit.config import TrainingConfig
from distill_kit.data import chat
from distill_kit.data.blocks import DataConfig
from distill_kit.run import run_config
from distill_kit.run.task_benchmark import aggregate, format_table, table
from distill_kit.tasks import arithmetic
from distill_kit.training import evaluation
from distill_kit.training.on_policy import OnPolicyConfig

SCRIPT = ROOT / "scripts/distill.py"
TEACHER = ROOT / "distill_kit/assets/arithmetic/teacher"


def test_examples_are_seeded_checked_and_in_range():
    first, again = list(arithmetic.examples(3, 200)), list(arithmetic.examples(3, 200))
    assert first == again and first != list(arithmetic.examples(4, 200))
    for item in first:
        assert arithmetic.check(item.prompt, item.answer)
        assert not arithmetic.check(item.prompt, item.answer.rsplit("#", 1)[0] + f"#{(item.value + 1) % 100}")
        steps = item.answer.split("#")[0].split(",")
        assert len(steps) == arithmetic.STEPS
        assert all(0 <= int(step.split("=")[1]) <= 99 for step in steps)
    assert not arithmetic.check("12+3+4+5+6+7", "no answer")


def test_hand_encoding_is_the_chat_pipelines(tmp_path):
    """The teacher script's one-id-per-character encoding equals the template rendered by the chat data pipeline
    (answer and end token counted, prompt and tags not), for answered records and for prompts."""
    tokenizer = arithmetic.build_tokenizer()
    items = list(arithmetic.examples(0, 20))
    path = arithmetic.write_jsonl(tmp_path / "answered.jsonl", items, with_answers=True)
    prompts = arithmetic.write_jsonl(tmp_path / "prompts.jsonl", items, with_answers=False)
    splits = chat.build_splits(DataConfig(train=str(path), heldout=str(prompts), format="chat", block_size=128),
                               tokenizer)
    for item, row in zip(items, splits.train, strict=True):
        assert (list(row["input_ids"]), list(row["labels"])) == arithmetic.encode(tokenizer, item)
    for item, row in zip(items, splits.heldout, strict=True):
        assert (list(row["input_ids"]), list(row["labels"])) == arithmetic.encode(tokenizer, item, with_answer=False)


def test_exact_match_metric():
    metric = evaluation.load_metric("exact_match")
    assert metric.compute(predictions=[True, False, True, True], references=[True] * 4)["exact_match"] == 0.75


def test_gap_closed_is_measured_from_sft_to_teacher():
    rows = table([{"recipe": "teacher", "exact_match": 0.9}, {"recipe": "sft", "exact_match": 0.1},
                  {"recipe": "mixed", "exact_match": 0.5}])
    assert [r["gap_closed"] for r in rows["rows"]] == pytest.approx([1.0, 0.0, 0.5])
    assert rows["best"] == "mixed"


def test_seeds_aggregate_to_mean_range_and_each_value():
    """Per recipe: the mean over the seeds, min and max, each seed's value in seed order; gap closed from the means,
    each seed's own beside it; the per-seed tables kept."""
    def seed(number, sft, seq_kd):
        return {"seed": number, "seconds": 1.0, "rows": table([
            {"recipe": "teacher", "exact_match": 1.0, "answer_kl": 0.0, "train_seconds": 0.0},
            {"recipe": "sft", "exact_match": sft, "answer_kl": 0.5, "train_seconds": 10.0},
            {"recipe": "seq_kd", "exact_match": seq_kd, "answer_kl": 0.1 * (number + 1),
             "train_seconds": 20.0 + number, "harness_exact_match": seq_kd},
        ])["rows"]}

    summary = aggregate([seed(0, 0.0, 0.5), seed(4, 0.2, 1.0), seed(7, 0.1, 0.3)])
    assert summary["seeds"] == [0, 4, 7] and [e["seed"] for e in summary["per_seed"]] == [0, 4, 7]
    teacher, sft, seq_kd = summary["rows"]
    assert seq_kd["exact_match"] == pytest.approx(0.6)
    assert (seq_kd["exact_match_min"], seq_kd["exact_match_max"]) == (0.3, 1.0)
    assert seq_kd["exact_match_per_seed"] == [0.5, 1.0, 0.3]
    assert seq_kd["answer_kl"] == pytest.approx((0.1 + 0.5 + 0.8) / 3)
    assert seq_kd["train_seconds"] == pytest.approx((20 + 24 + 27) / 3)
    assert sft["exact_match"] == pytest.approx(0.1) and teacher["exact_match"] == 1.0
    assert seq_kd["gap_closed"] == pytest.approx((0.6 - 0.1) / (1.0 - 0.1))
    assert seq_kd["gap_closed_per_seed"] == pytest.approx([0.5, 1.0, (0.3 - 0.1) / 0.9])
    assert summary["best"] == "seq_kd"
    printed = format_table(summary["rows"], summary["seeds"])
    assert "30.0%-100.0%" in printed and "50.0% 100.0% 30.0%" in printed and "seeds 0,4,7" in printed
    assert "range" not in format_table(aggregate([seed(0, 0.0, 0.5)])["rows"], [0])  # one seed: the plain table
    # a harness column: over the seeds like the checker's; a row the harness did not score prints '-'
    assert seq_kd["harness_exact_match_per_seed"] == [0.5, 1.0, 0.3] and "harness_exact_match" not in teacher
    lines = printed.splitlines()
    assert "harness" in lines[0] and "60.0%  50.0% 100.0% 30.0%" in lines[3] and " - " in lines[1]


def test_bad_on_policy_settings_are_named():
    with pytest.raises(ValueError, match=r"on_policy.fraction=1.5, on_policy.top_p=0"):
        OnPolicyConfig(fraction=1.5, top_p=0)
    with pytest.raises(run_config.ConfigError, match="training.on_policy.sampler: 'peer' is not one of"):
        run_config.load(None, ["--training.on_policy.sampler", "peer"])
    with pytest.raises(run_config.ConfigError, match="task.recipes: unknown"):
        run_config.load(None, ["--task.recipes", "[sft, rlhf]"])
    with pytest.raises(run_config.ConfigError, match=r"task.seeds: \[1, 1\]; give one or more distinct"):
        run_config.load(None, ["--task.seeds", "[1, 1]"])
    with pytest.raises(run_config.ConfigError, match="training.seed: 5 is not used by the task benchmark"):
        run_config.load(str(ROOT / "configs/arithmetic.yaml"), ["--training.seed", "5"])
    for key, value in (("distiller", "no_such_pkg.kd:TopKDistiller"), ("combine", "mixture")):
        with pytest.raises(run_config.ConfigError, match=rf"reads none of \['{key}'\]; drop them"):
            run_config.load(str(ROOT / "configs/arithmetic.yaml"), [f"{key}={value}"])
    assert TrainingConfig(on_policy={"fraction": 0.5}).on_policy.fraction == 0.5


def test_several_on_policy_students_are_refused_before_loading():
    with pytest.raises(ValueError, match="each student would sample its own completions"):
        Distiller(teacher="no/such/teacher", students=[{"name": "a", "model": "x"}, {"name": "b", "model": "y"}],
                  training=TrainingConfig(on_policy={"fraction": 1.0}))


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, without any process-group variables this process may have set."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env | {"OMP_NUM_THREADS": "1"})


def test_task_comparison_runs_and_writes_the_table(tmp_path):
    """Three rows at two seeds, two steps each, on a handful of examples: report.json holds the mean rows and each
    seed's table, each seed's students in its own folder; a second run into the same folder and --resume are
    refused before any work."""
    args = [str(SCRIPT), "--config", str(ROOT / "configs/arithmetic.yaml"), "--output_dir", str(tmp_path / "run"),
            "--training.max_steps", "2", "--training.micro_batch_size", "4", "--task.labelled", "8",
            "--task.prompts", "8", "--task.heldout", "8", "--task.warm_start_steps", "1",
            "--task.recipes", "[teacher, sft, on_policy_forward_kl]", "--task.seeds", "[0, 1]"]
    done = _run(args, 600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [r["recipe"] for r in report["rows"]] == ["teacher", "sft", "on_policy_forward_kl"]
    assert report["seeds"] == [0, 1] and [e["seed"] for e in report["per_seed"]] == [0, 1]
    assert report["rows"][0]["exact_match"] == 1.0  # the shipped teacher solves the held-out prompts
    for row in report["rows"]:
        values = [next(r for r in e["rows"] if r["recipe"] == row["recipe"])["exact_match"] for e in report["per_seed"]]
        assert row["exact_match_per_seed"] == values and row["exact_match"] == pytest.approx(sum(values) / 2)
        assert (row["exact_match_min"], row["exact_match_max"]) == (min(values), max(values))
        assert "gap_closed" in row and row["answer_kl"] >= 0
    assert report["seconds"] >= sum(e["seconds"] for e in report["per_seed"])
    assert all((tmp_path / "run" / f"seed_{s}" / "students" / "sft" / "config.json").is_file() for s in (0, 1))
    assert "range" in done.stdout and "seeds 0,1" in done.stdout
    # Refusals, in this process (nothing loads before them): the same command again, --resume, and an FP8 teacher
    # on a machine without a GPU, whose start-up checks come before the benchmark's first write.
    assert "already holds a report.json" in _main_error(*args[1:])
    assert "--resume does not apply to a task benchmark" in _main_error(*args[1:], "--resume")
    fresh = [*args[1:4], str(tmp_path / "fp8"), *args[5:], "--training.teacher_precision", "fp8"]
    assert "teacher_precision 'fp8': no CUDA GPU" in _main_error(*fresh)
    assert not (tmp_path / "fp8").exists()


def test_sampling_without_an_end_token_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from distill_kit.training.on_policy import Sampler

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=None,
                                       eos_token_id=None))
    model.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="set training.on_policy.eos_token_id"):
        _ = Sampler(OnPolicyConfig(fraction=1.0), lambda: model).eos_token_id
    assert Sampler(OnPolicyConfig(fraction=1.0, eos_token_id=3), lambda: model).pad_token_id == 3


def test_the_task_grid_runs_each_cell_and_merges_them_per_column(tmp_path):
    """benchmarks/task_grid.py: each (column, recipe, seed) cell is its own CLI run (two here, side by side), and
    grid.json holds per column each recipe's mean over the seeds that finished (``merge``, below on made-up cells),
    harness columns included, with the gap closed where SFT and teacher rows are both there."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import task_grid

    args = [str(ROOT / "benchmarks/task_grid.py"), "--out", str(tmp_path / "grid"), "--jobs", "2",
            "--recipes", "teacher", "sft", "--seeds", "0", "--training.max_steps", "2",
            "--training.micro_batch_size", "4", "--task.labelled", "8", "--task.prompts", "8", "--task.heldout", "8"]
    done = _run(args, 600)
    assert done.returncode == 0, done.stderr[-3000:]
    grid = json.loads((tmp_path / "grid" / "grid.json").read_text())
    assert all(cell["ok"] for cell in grid["cells"]) and len(grid["cells"]) == 2
    rows = {row["recipe"]: row for row in grid["columns"]["fp32"]["rows"]}
    assert rows["teacher"]["exact_match"] == 1.0 and rows["sft"]["gap_closed"] == 0.0

    def cell(seed: int, value: float) -> dict:  # a cell's report.json: its own seed's table under per_seed
        return {"per_seed": [{"seed": seed, "rows": [{"recipe": "x", "exact_match": value, "answer_kl": 0.0,
                                                      "train_seconds": 1.0, "harness_exact_match": value}]}]}

    cells = [("fp8", "sft", 0), ("fp8", "sft", 1), ("fp8", "sft", 2)]
    merged = task_grid.merge(cells, {cells[0]: cell(0, 0.2), cells[1]: None, cells[2]: cell(2, 0.4)})
    (row,) = merged["fp8"]["rows"]  # seed 1's cell failed: the mean is over the two that finished
    assert row["seeds"] == [0, 2] and row["exact_match_per_seed"] == [0.2, 0.4]
    assert row["exact_match"] == pytest.approx(0.3) and (row["exact_match_min"], row["exact_match_max"]) == (0.2, 0.4)
    assert row["harness_exact_match_per_seed"] == [0.2, 0.4]  # the harness's column, merged alike
    assert row["harness_exact_match"] == pytest.approx(0.3)

"""The arithmetic task (generator, checker, tokenizer), its metric, the on-policy settings' errors, and a tiny
run of the task comparison through ``scripts/distill.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launch import ROOT

from distill_kit import Distiller
from distill_kit.config import TrainingConfig
from distill_kit.data import chat
from distill_kit.data.blocks import DataConfig
from distill_kit.run import run_config
from distill_kit.tasks import arithmetic
from distill_kit.tasks.compare import table
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


def test_bad_on_policy_settings_are_named():
    with pytest.raises(ValueError, match=r"on_policy.fraction=1.5, on_policy.top_p=0"):
        OnPolicyConfig(fraction=1.5, top_p=0)
    with pytest.raises(run_config.ConfigError, match="training.on_policy.sampler: 'peer' is not one of"):
        run_config.load(None, ["--training.on_policy.sampler", "peer"])
    with pytest.raises(run_config.ConfigError, match="task.recipes: unknown"):
        run_config.load(None, ["--task.recipes", "[sft, rlhf]"])
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
    """Four rows, two steps each, on a handful of examples: report.json holds the rows; a second run into the
    same folder and --resume are refused before any work."""
    args = [str(SCRIPT), "--config", str(ROOT / "configs/arithmetic.yaml"), "--output_dir", str(tmp_path / "run"),
            "--training.max_steps", "2", "--training.micro_batch_size", "4", "--task.labelled", "8",
            "--task.prompts", "8", "--task.heldout", "8", "--task.warm_start_steps", "1",
            "--task.recipes", "[teacher, sft, on_policy_reverse_kl, on_policy_forward_kl]"]
    done = _run(args, 600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [r["recipe"] for r in report["rows"]] == ["teacher", "sft", "on_policy_reverse_kl", "on_policy_forward_kl"]
    assert report["rows"][0]["exact_match"] == 1.0  # the shipped teacher solves the held-out prompts
    assert all("gap_closed" in r and r["answer_kl"] >= 0 for r in report["rows"])
    assert report["seconds"] >= sum(r["train_seconds"] for r in report["rows"][:2])
    again = _run(args, 300)
    assert again.returncode != 0 and "already holds a report.json" in again.stderr
    resumed = _run([*args, "--resume"], 300)
    assert resumed.returncode != 0 and "--resume does not apply to a task benchmark" in resumed.stderr


def test_sampling_without_an_end_token_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from distill_kit.training.on_policy import Sampler

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=None,
                                       eos_token_id=None))
    model.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="set training.on_policy.eos_token_id"):
        _ = Sampler(OnPolicyConfig(fraction=1.0), lambda: model).eos_token_id
    assert Sampler(OnPolicyConfig(fraction=1.0, eos_token_id=3), lambda: model).pad_token_id == 3

"""Rewards through ``scripts/distill.py``: a run whose reward reads a field of each record, and every bad input
refused before any write, in one line, without a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import DISTILL, ROOT, run_ranks

from distill_kit.run import cli
from distill_kit.tasks import arithmetic

TEACHER = ROOT / "distill_kit/assets/arithmetic/teacher"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Arithmetic prompts whose records carry their final value as ``answer``; held-out records answered."""
    root = tmp_path_factory.mktemp("reward_data")
    with (root / "train.jsonl").open("w") as handle:
        for item in arithmetic.examples(11, 64):
            handle.write(json.dumps({"prompt": item.prompt, "answer": str(item.value)}) + "\n")
    arithmetic.write_jsonl(root / "heldout.jsonl", list(arithmetic.examples(12, 8)), with_answers=True)
    return root


def args(data: Path, out: Path, *extra: str) -> list[str]:
    return [f"teacher={TEACHER}", f"output_dir={out}", f"data.train={data / 'train.jsonl'}",
            f"data.heldout={data / 'heldout.jsonl'}", "data.block_size=64", "training.max_steps=2",
            "training.micro_batch_size=4", "training.on_policy.fraction=1.0", "training.on_policy.max_new_tokens=8",
            "training.on_policy.samples_per_prompt=2", "eval.max_batches=1",
            "--students", "[{name: s, init: {num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64, "
            "num_attention_heads: 2, num_key_value_heads: 2}, loss: {name: policy_gradient, teacher: 1.0, "
            "reward: 1.0}}]", *extra]


REWARD = ["--training.rewards.functions", "[{name: user_rewards:matches_answer}]"]


@pytest.mark.slow
def test_a_run_scores_its_samples_with_a_reward_that_reads_each_records_field(data, tmp_path):
    run_ranks(DISTILL, args(data, tmp_path / "run", *REWARD), nprocs=0)
    records = [json.loads(line) for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("s/reward_mean", "s/reward_std", "s/no_signal", "s/sample_length", "s/entropy",
                "s/teacher_advantage", "s/policy_gradient"):
        assert all(key in r for r in records), key
    assert all(0.0 <= r["s/reward_mean"] <= 1.0 and 0.0 <= r["s/no_signal"] <= 1.0 for r in records)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert set(report["histories"]["s"][0]) >= {"step", "loss", "reward_mean", "no_signal", "entropy"}
    student = report["summary"]["students"]["s"]
    assert student["reward_mean_first"] == records[0]["s/reward_mean"]  # 2 steps: a tenth is one step
    assert student["reward_mean_last"] == records[1]["s/reward_mean"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--training.rewards.functions", "[{name: no_such_module:f}]"],
     "training.rewards.functions[0].name: cannot import reward 'no_such_module:f'"),
    (["--training.rewards.functions", "[{name: user_rewards:one_argument}]"],
     "a reward takes (prompt, completion) first"),
    (["--training.rewards.functions", "[{name: user_rewards:needs_reference}]"],
     "asks for the record field(s) ['reference'], which not every record of data.train"),
    (["training.micro_batch_size=5", *REWARD], "samples_per_prompt=2 does not divide training.micro_batch_size=5"),
    (["training.on_policy.fraction=0.0", "training.on_policy.samples_per_prompt=1", *REWARD],
     "training.rewards score the student's own samples, and this run has none"),
    ([], "policy_gradient has reward: 1.0, and the run has no rewards"),
    (["training.on_policy.fraction=0.0", "training.on_policy.samples_per_prompt=1",
      "training.on_policy.updates_per_rollout=2"], "updates_per_rollout=2 trains on each step's samples again, and "
     "on_policy.fraction=0 samples nothing"),
    (["training.on_policy.updates_per_rollout=0", *REWARD], "on_policy.updates_per_rollout=0"),
])
def test_bad_reward_settings_are_refused_before_any_write(data, tmp_path, extra, message):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        cli.main(args(data, out, *extra))
    assert message in str(stop.value) and str(stop.value).startswith("config error:")
    assert "\n" not in str(stop.value).split("problems:")[0]  # one line (several problems: one line each)
    assert not out.exists()

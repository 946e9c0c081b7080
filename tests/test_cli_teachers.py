"""``teachers: [...]`` in the run config: CLI runs of one student of two teachers, and their start-up errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import ROOT, run_ranks
from safetensors.torch import load_file
from test_cli import _main_error, write_texts  # the CLI's error message, caught in this process; local text
from tiny_models import gpt2_config
from transformers import GPT2LMHeadModel

from distill_kit.data.tokenizer import train_tokenizer

SCRIPT = ROOT / "scripts/distill.py"
STEPS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Two teachers with different weights and one tokenizer, a third with another tokenizer, and text files."""
    root = tmp_path_factory.mktemp("teachers")
    texts = write_texts(root)
    tokenizers = {"a": train_tokenizer(texts, vocab_size=300), "other": train_tokenizer(texts[:5], vocab_size=280)}
    tokenizers["b"] = tokenizers["a"]
    for seed, (name, tokenizer) in enumerate(tokenizers.items()):
        torch.manual_seed(seed)
        GPT2LMHeadModel(gpt2_config(width=48, layers=2, vocab=len(tokenizer))).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {"root": root, **{name: root / name for name in tokenizers}}


def _args(tiny: dict[str, Path], out: Path, *, steps: int = STEPS) -> list[str]:
    """One student of width 32 from the (first) teacher's config; evaluations at 2 and 4; warm-up 20 > 4 steps."""
    return [
        f"output_dir={out}", f"cache_dir={tiny['root'] / 'cache'}",
        f"data.train={tiny['root'] / 'train.txt'}", f"data.heldout={tiny['root'] / 'heldout.txt'}",
        "data.block_size=32", "data.max_train_blocks=64", "data.max_heldout_blocks=12",
        f"training.max_steps={steps}", "training.micro_batch_size=2", "training.lr=3e-3", "eval.every=2",
        "--students", "[{name: distilled, init: {n_layer: 1, n_embd: 32}, loss: forward_kl}]",
    ]


def _teachers(tiny: dict[str, Path], weights: tuple[float, float] = (1.0, 0.0)) -> list[str]:
    return ["--teachers", f"[{{name: a, model: {tiny['a']}, weight: {weights[0]}}}, "
                          f"{{name: b, model: {tiny['b']}, weight: {weights[1]}}}]"]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]


def _student(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "students" / "distilled" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory) -> dict[str, Path]:
    """Through ``scripts/distill.py`` (in this process, ``launch.run_here``: a start of its own would add ~7 s of
    imports each): the first teacher alone (teacher:), both weighted (1, 0) for STEPS steps, and both stopped at
    STEPS / 2 then resumed to STEPS."""
    root = tmp_path_factory.mktemp("runs")
    out = {name: root / name for name in ("one", "two", "resumed")}
    run_ranks(SCRIPT, [*_args(tiny, out["one"]), f"teacher={tiny['a']}"], nprocs=0)
    run_ranks(SCRIPT, [*_args(tiny, out["two"]), *_teachers(tiny)], nprocs=0)
    run_ranks(SCRIPT, [*_args(tiny, out["resumed"], steps=STEPS // 2), *_teachers(tiny)], nprocs=0)
    run_ranks(SCRIPT, [*_args(tiny, out["resumed"]), *_teachers(tiny), "--resume"], nprocs=0)
    return out


def test_two_teachers_weighted_one_and_zero_train_as_the_first_alone(runs):
    """Bit for bit: the step's loss is 1 * loss_a + 0 * loss_b, which is loss_a exactly in IEEE arithmetic (loss_b is
    finite), and the 0-weighted term adds exact zeros to every gradient; both runs build the student from the same
    seed, read the same batches and step the same ZeRO-2 engine. So the logged losses and the exported student are
    equal, not merely close."""
    one, two = _records(runs["one"]), _records(runs["two"])
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert [r["distilled/loss"] for r in two] == [r["distilled/loss"] for r in one]
    assert [r["distilled/a"] for r in two] == [r["distilled/loss"] for r in one]
    # teacher b ran every step and was logged; its loss is another model's (so the test would see it leak in)
    assert all(r["distilled/b"] != r["distilled/a"] for r in two)
    expected, got = _student(runs["one"]), _student(runs["two"])
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert any(not torch.equal(expected[name], tensor) for name, tensor in
               load_file(runs["two"] / "init" / "distilled" / "model.safetensors").items())  # it did train


def test_a_resumed_two_teacher_run_equals_the_uninterrupted_one(runs):
    """Stopped after its step-2 checkpoint, resumed with the longer max_steps (the warm-up, 20 steps, covers the
    run, so max_steps does not change the lr of any step): the same records, evaluations and student, exactly."""
    assert _records(runs["resumed"]) == _records(runs["two"])
    uninterrupted, resumed = (json.loads((runs[n] / "report.json").read_text()) for n in ("two", "resumed"))
    assert resumed["evaluations"] == uninterrupted["evaluations"]
    assert [e["step"] for e in resumed["evaluations"]] == [2, 4]
    expected, got = _student(runs["two"]), _student(runs["resumed"])
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_report_and_checkpoints_record_every_teacher(runs, tiny):
    report = json.loads((runs["two"] / "report.json").read_text())
    teachers = report["teachers"]
    assert [(t["name"], t["model"], t["weight"]) for t in teachers] == [("a", str(tiny["a"]), 1.0),
                                                                        ("b", str(tiny["b"]), 0.0)]
    assert len({t["sha256"] for t in teachers}) == 2 and all(len(t["sha256"]) == 64 for t in teachers)
    manifest = json.loads((runs["two"] / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json").read_text())
    assert manifest["teacher_sha256"] == ", ".join(f"{t['name']}={t['sha256']}" for t in teachers)
    # the one-teacher run records its teacher the same way, with the hash its checkpoints hold
    (single,) = json.loads((runs["one"] / "report.json").read_text())["teachers"]
    assert single["sha256"] == teachers[0]["sha256"]
    assert set(report["deepspeed_configs"]["teachers"]) == {"a", "b"}
    assert report["config"]["teacher"] is None and len(report["config"]["teachers"]) == 2
    assert set(report["summary"]["students"]) == {"distilled"}


@pytest.mark.parametrize(("extra", "message"), [
    (lambda t: [f"teacher={t['a']}", *_teachers(t)],
     "and teachers are both given: a run has one teacher (teacher:) or several (teachers:); drop teacher:"),
    (lambda t: ["--teachers", "[]"], "teachers: no teachers: give at least one"),
    (lambda t: ["--teachers", f"[{{name: a, model: {t['a']}}}, {{name: a, model: {t['b']}}}]"],
     "teachers: the names ['a'] are given more than once"),
    (lambda t: _teachers(t, (1.0, -0.5)), "teacher 'b': weight must be a finite number >= 0, got -0.5"),
    (lambda t: _teachers(t, (0.0, 0.0)), "teachers: every teacher has weight 0: give at least one a weight > 0"),
    (lambda t: ["--teachers", f"[{{name: a, model: {t['a']}}}, {{name: o, model: {t['other']}}}]"],
     "teachers[o]: its tokenizer differs from the run's ("),
    (lambda t: [*_teachers(t), "--students", f"[{{name: s, model: {t['other']}, loss: forward_kl}}]"],
     "students[s].model: its tokenizer differs from the run's ("),
    (lambda t: [f"teacher={t['a']}", "--students", f"[{{name: s, model: {t['other']}, loss: forward_kl}}]"],
     "students[s].model: its tokenizer differs from the run's ("),
    (lambda t: ["--teachers", "[{name: a}]"], "teachers[0]: teacher 'a' has no model: give model: path/to/teacher"),
    (lambda t: [*_teachers(t), "combine=mixture", "--students", "[{name: s, init: {n_layer: 1}, loss: hidden_mse}]"],
     "students[s].loss with combine: mixture: combine: mixture averages the teachers' distributions; hidden-state"),
    (lambda t: [f"teacher={t['a']}", "combine=mixture"], "combine: mixture combines several teachers; give them as"),
    (lambda t: ["teacher=null"], "teacher: none given; give teacher: path/to/teacher, or several as teachers:"),
    (lambda t: [*_teachers(t), "task.name=arithmetic", "task.warm_start_steps=1"],
     "task.name: the arithmetic benchmark compares recipes of one teacher (teacher:) and reads none of ['teachers']"),
    (lambda t: [*_teachers(t), "student_tokenizer=bpe:300"],
     "student_tokenizer with teachers: distilling across tokenizers (cross_tokenizer) takes one teacher"),
])
def test_teacher_config_errors_stop_before_any_write(tiny, tmp_path, extra, message):
    out = tmp_path / "run"
    got = _main_error(*_args(tiny, out), *extra(tiny))
    assert message in got, got
    assert not out.exists()


def test_the_tokenizer_error_names_the_cross_tokenizer_route(tiny, tmp_path):
    got = _main_error(*_args(tiny, tmp_path / "run"), "--teachers",
                      f"[{{name: a, model: {tiny['a']}}}, {{name: o, model: {tiny['other']}}}]")
    assert "use teachers and students that share the student's tokenizer" in got
    assert "loss cross_tokenizer with student_tokenizer, takes one teacher: teacher:" in got
    assert not (tmp_path / "run").exists()

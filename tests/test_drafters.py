"""Students as drafters of their teacher: the plan refuses what cannot draft before anything loads, every evaluation
measures each student's tau (``eval.speculative``), and the report records the teacher it drafts for with the
commands that serve it. The decoding itself: tests/test_speculative.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_tokenizers import bpe
from transformers import GPT2Config

from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.config import SpeculativeConfig, build
from distill_kit.errors import ConfigError
from distill_kit.run import report
from distill_kit.training.plan import make_plan
from tests.tiny_models import random_batches, save_pair

ON = SpeculativeConfig(prompts=2, gamma=2, max_new_tokens=4, prompt_tokens=4)


def _model(path: Path, tokenizer, **fields) -> Path:
    GPT2Config(**{"vocab_size": len(tokenizer), "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 64,
                  "bos_token_id": 0, "eos_token_id": 0, **fields}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    tokenizer = bpe("d e", "de f")
    return {"teacher": _model(root / "teacher", tokenizer), "student": _model(root / "student", tokenizer),
            "vocab": len(tokenizer)}


def plan(students, teachers, speculative=ON):
    return make_plan(students, teachers, training=TrainingConfig(max_steps=1, micro_batch_size=2), world_size=1,
                     speculative=speculative)


def test_gamma_below_one_is_refused_when_the_config_is_read():
    with pytest.raises(ConfigError, match="eval.speculative.gamma: 0"):
        build(SpeculativeConfig, {"prompts": 4, "gamma": 0}, "eval.speculative.")


def test_a_drafter_of_another_vocabulary_is_refused(folders):
    teacher = [TeacherSpec(model=str(folders["teacher"]))]
    smaller = StudentSpec(name="small", init={"vocab_size": folders["vocab"] - 3, "n_layer": 1})
    with pytest.raises(ConfigError, match="vocabulary of .* tokens and teacher"):
        plan([smaller], teacher)
    plan([smaller], teacher, speculative=SpeculativeConfig())  # off: the same run is a plain distillation
    assert plan([StudentSpec(model=str(folders["student"]))], teacher).speculative == ON


def test_a_teacher_that_cannot_verify_and_no_teacher_are_refused(folders, monkeypatch):
    from distill_kit.teachers import served

    info = {"vocab_size": folders["vocab"], "config": GPT2Config(vocab_size=folders["vocab"]).to_dict(),
            "max_top_k": 8}
    monkeypatch.setattr(served, "server_info", lambda url, opts, named: info)
    server = TeacherSpec(name="srv", model="http://127.0.0.1:9", kind="served",
                         options={"tokenizer": str(folders["teacher"])})
    with pytest.raises(ConfigError, match="cannot verify drafts"):
        plan([StudentSpec(model=str(folders["student"]))], [server])
    with pytest.raises(ConfigError, match="drafts for a teacher, and this run has none"):
        plan([StudentSpec(model=str(folders["student"]), loss="cross_entropy")], [])


@pytest.mark.slow  # builds DeepSpeed engines, loads the evaluate metrics: ~5 s alone on 2 cores, off the fast tier
def test_every_evaluation_measures_each_student_as_a_drafter(tmp_path):
    teacher, student = save_pair(tmp_path)
    distiller = Distiller(students=[StudentSpec(name="s", model=str(student))],
                          teachers=[TeacherSpec(model=str(teacher))],
                          training=TrainingConfig(max_steps=1, micro_batch_size=2), speculative=ON)
    figures = distiller.evaluate(random_batches(2, 2, 12, seed=0), max_batches=1)
    assert 1 <= figures["s"]["speculative_tau"] <= ON.gamma + 1
    assert figures["s"]["speculative_prompts"] == 2 and len(figures["s"]["speculative_acceptance_by_position"]) == 2
    assert figures["s"]["perplexity"] > 0  # beside the usual figures

    summary = report.summarize(figures, {"s": "forward_kl"})
    record = {"name": "teacher", "model": str(teacher), "sha256": "ab" * 32}
    report.add_drafting(summary, record, tmp_path / "students")
    row = summary["students"]["s"]
    assert row["drafts_for"] == record
    assert f"--speculative-draft-model-path {tmp_path / 'students' / 's'}" in row["serve"]["sglang"]
    assert '"num_speculative_tokens": 2' in row["serve"]["vllm"]
    assert "s: as a drafter of the teacher (greedy, gamma 2, 2 held-out prompts): tau" in report.table(summary)


def test_students_with_their_own_tokenizer_cannot_draft():
    from types import SimpleNamespace

    from distill_kit.config import EvalConfig
    from distill_kit.run import validate
    from distill_kit.run.run_config import RunConfig

    config = RunConfig(student_tokenizer="bpe:300", eval=EvalConfig(speculative=ON))
    problems = validate.check_student_tokenizers(SimpleNamespace(config=config))
    assert any("a drafter must use its target's tokenizer" in p for p in problems)
    off = RunConfig(student_tokenizer="bpe:300")
    assert validate.check_student_tokenizers(SimpleNamespace(config=off)) == []

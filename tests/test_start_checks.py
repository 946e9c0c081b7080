"""The rules a start is checked against before it claims its output folder (``run/validate.py``, the run
config's own rules), on inputs other than the ones issue 24 lists: each breaks when its rule does.

Models here are config-only folders (``config.json``, no weights): no check reads weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, PreTrainedTokenizerFast

from distill_kit.errors import ConfigError, DataError
from distill_kit.run import cli, report, run_config, student_tokenizer, validate
from distill_kit.training import checkpoint, evaluation


def _model_dir(path: Path, **fields) -> Path:
    GPT2Config(**{"vocab_size": 50, "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 64,
                  "bos_token_id": 0, "eos_token_id": 49, **fields}).save_pretrained(path)
    return path


@pytest.fixture()
def setup(tmp_path):
    (tmp_path / "train.txt").write_text("some text\n")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    return {"root": tmp_path, "teacher": _model_dir(tmp_path / "teacher")}


def _start(setup, *args: str, resume: bool = False) -> validate.Start:
    config = run_config.load(None, [f"teacher={setup['teacher']}", f"output_dir={setup['root'] / 'run'}",
                                    f"data.train={setup['root'] / 'train.txt'}", "data.block_size=32",
                                    "--students", "[{name: s, init: {n_layer: 1}}]", *args])
    config = cli.with_output_dir(config, resume)
    return validate.Start(config, resume, cli.run_identity(config))


# ---- 2: every row a model reads fits its positions --------------------------------------------------------


def test_rows_longer_than_a_models_positions_are_refused_naming_the_model_and_the_fix(setup):
    assert validate.check_plan(_start(setup, "data.block_size=64")) == []
    student, problem = validate.check_plan(_start(setup, "data.block_size=65"))  # the student is as wide
    assert student.startswith("data.block_size: 65 tokens per row, but students[s] reads at most 64")
    assert problem == ("data.block_size: 65 tokens per row, but teachers[teacher] reads at most 64 positions "
                       "(max_position_embeddings in its config): set data.block_size to 64 or less")
    narrow = _start(setup, "data.block_size=40", "--students", "[{name: short, init: {n_positions: 40, n_layer: 1}}]")
    assert validate.check_plan(narrow) == []
    wide = _start(setup, "data.block_size=48", "--students", "[{name: short, init: {n_positions: 40, n_layer: 1}}]")
    (problem,) = validate.check_plan(wide)
    assert problem.startswith("data.block_size: 48 tokens per row, but students[short] reads at most 40 positions")


def test_the_plan_sets_and_checks_the_on_policy_row_limit_against_every_model(setup):
    chat = [f"data.train={setup['root'] / 'chat.jsonl'}", "training.on_policy.fraction=0.5",
            "--students", "[{name: short, init: {n_positions: 40, n_layer: 1}}]"]
    start = _start(setup, *chat)
    assert validate.check_plan(start) == []
    assert start.plan.training.on_policy.max_length == 40  # the fewest positions among the run's models
    (problem,) = validate.check_plan(_start(setup, *chat, "training.on_policy.max_length=41"))
    assert problem.startswith("training.on_policy.max_length: 41 tokens, but students[short] reads at most 40")


# ---- 4 and 5: settings that need no training, found before the claim ----------------------------------------


def test_every_rule_that_reads_one_model_reads_every_model(setup):
    """Positions, the on-policy limit and routing's packing are the plan's, over every teacher (not the first
    alone): a second teacher of fewer positions is named, with the fix; an explicit limit is held to the same."""
    root = setup["root"]
    short = _model_dir(root / "short", n_positions=48)
    teachers = ["teacher=null", "--teachers", f"[{{name: a, model: {setup['teacher']}}}, {{name: b, model: {short}}}]"]
    (problem,) = validate.check_plan(_start(setup, *teachers, "data.block_size=64",
                                            "--students", "[{name: s, init: {n_layer: 1}}]"))
    assert problem.startswith("data.block_size: 64 tokens per row, but teachers[b] reads at most 48 positions")
    chat = [f"data.train={root / 'chat.jsonl'}", "data.block_size=32", "training.on_policy.fraction=0.5"]
    (problem,) = validate.check_plan(_start(setup, *teachers, *chat, "training.on_policy.max_length=60"))
    assert problem.startswith("training.on_policy.max_length: 60 tokens, but teachers[b] reads at most 48")
    routed = validate.check_plan(_start(setup, *teachers, *chat, "combine=route", "training.on_policy.pack_to=32"))
    assert any(p.startswith("training.on_policy.pack_to with combine: route is not supported yet") for p in routed)


def test_a_teachers_mistake_is_named_once_without_a_doubled_prefix(setup):
    twice = f"[{{name: a, model: {setup['teacher']}}}, {{name: a, model: {setup['teacher']}}}]"
    config = run_config.load(None, ["teacher=null", "--teachers", twice])
    (problem,) = validate.check_teachers(config, validate.DataFacts())
    assert problem.startswith("teachers: the names ['a'] are given more than once")
    assert "teachers: teachers" not in problem


def test_a_data_file_deleted_before_a_resume_is_named_once_as_missing(setup):
    root = setup["root"]
    (root / "heldout.txt").write_text("other text\n")
    args = (f"data.heldout={root / 'heldout.txt'}",)
    start = _start(setup, *args)
    from distill_kit.run import output_dir
    out = Path(start.config.output_dir)
    output_dir.check(out, start.identity, resume=False)
    output_dir.record_data(out, validate.data_fingerprint(start.config))
    (root / "heldout.txt").unlink()
    resumed = _start(setup, *args, resume=True)
    assert output_dir.data_changes(out, validate.data_fingerprint(resumed.config)) == []
    (problem,) = validate.check_data(resumed)
    assert problem.startswith("data.heldout: ") and "heldout.txt" in problem


@pytest.mark.parametrize(("students", "message"), [
    ("[{name: s, init: {n_layer: 1}, loss: {name: reverse_kl, temprature: 2}}]",
     "students[s].loss: bad parameters for loss 'reverse_kl'"),
    ("[{name: s, init: {n_layer: 1}, loss: [{name: cross_entropy, weight: 1}, {name: jsd, weight: 1}]}]",
     "students[s].loss: unknown loss 'jsd'"),
    ("[{name: s, init: {n_layer: 1}, loss: [{name: cross_entropy, weight: 1}, {name: cross_tokenizer, weight: 1}]}]",
     "students[s].loss: cross_tokenizer distils across two tokenizers, and no map between their vocabularies"),
    ("[{name: a, init: {n_layer: 1}}, {name: b, init: {n_layer: 1}}, {name: a, init: {n_embd: 8}}]",
     "students: the names ['a'] are given more than once"),
])
def test_student_and_loss_mistakes_are_found_up_front(setup, students, message):
    start = _start(setup, "--students", students)
    problems = validate.check_students(start) + validate.check_plan(start)
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_on_policy_rules(setup):
    """The data rule is the CLI's (Python says what its data is); the token rules are the plan's
    (``test_the_four_refusals_run_from_python`` has the Distiller refuse the same)."""
    root = setup["root"]
    chat = [f"data.train={root / 'chat.jsonl'}", "training.on_policy.fraction=0.5"]
    assert validate.check_on_policy(_start(setup, *chat)) == []
    assert validate.check_plan(_start(setup, *chat)) == []
    (problem,) = validate.check_plan(_start(setup, *chat, "training.on_policy.pad_token_id=50"))
    assert problem.startswith("training.on_policy.pad_token_id: 50 is outside the vocabulary (ids 0..49")
    (problem,) = validate.check_plan(_start(setup, *chat, f"teacher={_model_dir(root / 'wide', eos_token_id=70)}"))
    assert "(eos_token_id): 70 is outside the vocabulary" in problem  # the sampling student's, from the teacher
    endless = _model_dir(root / "endless", eos_token_id=None)
    (problem,) = validate.check_plan(_start(setup, *chat, f"teacher={endless}"))
    assert "has no end token" in problem and "set training.on_policy.eos_token_id" in problem
    (problem,) = validate.check_on_policy(_start(setup, "training.on_policy.fraction=0.25"))
    assert problem.startswith("training.on_policy.fraction=0.25 on text data")
    assert "training.on_policy.prompt_tokens" in problem
    assert validate.check_on_policy(_start(setup, "training.on_policy.fraction=0.25",
                                           "training.on_policy.prompt_tokens=8")) == []
    (problem,) = validate.check_on_policy(_start(setup, *chat, "training.on_policy.prompt_tokens=8"))
    assert problem.startswith("training.on_policy.prompt_tokens=8 on chat data")
    two = _start(setup, *chat, "--students", "[{name: a, init: {n_layer: 1}}, {name: b, init: {n_layer: 1}}]")
    assert validate.check_on_policy(two) == []
    (problem,) = validate.check_plan(two)  # one rule, the plan's: the Distiller refuses the same
    assert problem.startswith("training.on_policy.fraction=0.5 with 2 students")


def test_a_sampling_teacher_that_the_loss_ignores_is_refused(setup):
    second = _model_dir(setup["root"] / "second")
    config = run_config.load(None, [
        "teacher=null", "--teachers", f"[{{name: quiet, model: {setup['teacher']}, weight: 0}}, "
        f"{{name: loud, model: {second}, weight: 1}}]", f"data.train={setup['root'] / 'chat.jsonl'}",
        "training.on_policy.fraction=1", "training.on_policy.sampler=teacher", "data.block_size=32",
        "--students", "[{name: s}]"])
    (problem,) = validate.check_plan(validate.Start(config, False, {}))
    assert problem.startswith("training.on_policy.sampler: teacher samples from the first teacher (quiet)")


def test_lora_needs_a_pretrained_base_and_existing_target_modules(setup):
    (problem,) = validate.check_plan(_start(setup, "--students", "[{name: s, init: {n_layer: 1}, peft: {}}]"))
    assert problem.startswith("students[s].peft: LoRA adapters train on a frozen pretrained student, but this")
    pretrained = f"[{{name: s, model: {setup['teacher']}, peft: {{target_modules: [c_attn, c_proj]}}}}]"
    assert validate.check_plan(_start(setup, "--students", pretrained)) == []
    pretrained = pretrained.replace("c_proj", "c_prj")
    (problem,) = validate.check_plan(_start(setup, "--students", pretrained))  # the Distiller's plan, from configs
    assert problem.startswith("students[s].peft: target_modules: ['c_prj'] name no module of the student")
    assert "'c_proj'" in problem


def test_chat_settings_on_the_wrong_data(setup):
    (problem,) = validate.check_data_format(_start(setup, "data.format=chat"))
    assert problem.startswith(f"data.format: chat, but data.train {str(setup['root'] / 'train.txt')!r} is plain")
    (problem,) = validate.check_data_format(_start(setup, f"data.train={setup['root'] / 'chat.jsonl'}",
                                                   "student_tokenizer=bpe:300"))
    assert problem.startswith("student_tokenizer works with text data only")


@pytest.mark.parametrize(("args", "message"), [
    (["--students", "[{name: fast, lr: 0}]"], "students[fast].lr: 0"),
    (["eval.max_batches=-3"], "eval.max_batches: -3 batches would evaluate nothing"),
    (["teacher_block_size=0"], "teacher_block_size: 0 teacher tokens per block"),
    (["task.name=arithmetic", "task.warm_start_steps=400", "training.max_steps=300"],
     "task.warm_start_steps: 400 SFT steps of training.max_steps 300"),
    (["task.max_new_tokens=-1"], "task.max_new_tokens: -1 tokens"),
])
def test_settings_out_of_range_name_their_key_at_load(args, message):
    with pytest.raises(ConfigError, match=f"^(task: )?{message.replace('[', '.').replace(']', '.')}"):
        run_config.load(None, args)


def test_resume_on_another_rank_count_is_refused_before_any_engine(setup, monkeypatch):
    start = _start(setup, resume=True)
    out = Path(start.config.output_dir)
    from distill_kit.run import output_dir
    output_dir.check(out, start.identity, resume=False)
    written = checkpoint.save(start.checkpoint_dir(), {}, step=3, trainer_state={}, rank_state={},
                              teacher_sha256=None, keep_last=1)
    assert validate.check_output_dir(start) == []
    monkeypatch.setattr(validate.distributed, "world_size", lambda: 4)
    (problem,) = validate.check_output_dir(start)
    assert problem.startswith(f"--resume: checkpoint {written} was written by 1 ranks, and this start has 4")


# ---- 1: no figure over nothing, and the report says what compares ---------------------------------------------


class _Logits:
    def __init__(self, logits):
        self.logits = logits


def test_an_evaluation_over_no_counted_token_is_an_error():
    batch = {"input_ids": torch.ones(2, 6, dtype=torch.long), "attention_mask": torch.ones(2, 6, dtype=torch.long),
             "labels": torch.full((2, 6), -100)}
    forward = lambda batch: _Logits(torch.zeros(2, 6, 7))  # noqa: E731
    with pytest.raises(DataError, match="the held-out evaluation counted no token in 3 batches"):
        evaluation.evaluate_students({"s": forward}, forward, [batch] * 3, torch.device("cpu"), max_batches=3)
    batch["labels"][0, 3] = 2
    result = evaluation.evaluate_students({"s": forward}, forward, [batch], torch.device("cpu"))
    assert result["s"]["perplexity"] == pytest.approx(7.0)


def test_across_tokenizers_the_report_compares_by_bits_per_byte_only():
    final = {"teacher": {"perplexity": 9.0, "bits_per_byte": 1.0},
             "kd": {"perplexity": 2.0, "bits_per_byte": 1.5}, "ce": {"perplexity": 3.0, "bits_per_byte": 2.0}}
    summary = report.summarize(final, {"kd": "cross_tokenizer", "ce": "cross_entropy"})
    assert summary["comparable"] == ["bits_per_byte"]
    assert summary["students"]["kd"]["gap_closed"] == pytest.approx(0.5)  # (2.0 - 1.5) / (2.0 - 1.0) in bits/byte
    printed = report.table(summary)
    assert "9.000" not in printed and "compare by bits per byte" in printed
    same = {name: {**row, "mean_kl": 0.1} if name != "teacher" else row for name, row in final.items()}
    assert "9.000" in report.table(report.summarize(same, {"kd": "forward_kl", "ce": "cross_entropy"}))


def test_a_student_tokenizer_whose_ids_do_not_carry_the_text_is_refused():
    letters = {c: i for i, c in enumerate("[UNK] a b c".split())}
    tokenizer = Tokenizer(models.WordLevel(letters, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    problem = student_tokenizer.coverage_problem(fast, ["the quick brown fox jumps over a lazy dog"])
    assert problem is not None and "are the one id 0 '[UNK]' (its unknown token)" in problem
    assert student_tokenizer.coverage_problem(fast, ["abcabcab c"]) is None

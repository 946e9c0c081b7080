"""The plan, not the CLI, decides: the run's lead teacher and tokenizer come from the teachers' cards
(``training/plan.py``: ``lead_teacher``, ``run_tokenizer``), and the CLI reads them off the plan; the refusals the CLI
once made alone (on-policy tokens, LoRA on a random student, routed packing, the checkpoint folder's room) are the
plan's, so ``Distiller(...)`` makes them too, before any model loads or anything is written.

Models here are config-only folders (``config.json`` and a tokenizer, no weights): nothing reads weights."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from tiny_tokenizers import bpe
from transformers import GPT2Config

from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.config import OnPolicyConfig
from distill_kit.data import chat
from distill_kit.errors import ConfigError
from distill_kit.offline.capture import CaptureConfig, fill_store
from distill_kit.run import cli
from distill_kit.teachers import LOGITS, Teacher, TeacherCard, served
from distill_kit.training import checkpoint
from distill_kit.training.plan import DataFacts, make_plan

SELF = {"mode": "initial", "privileged": "{prompt} (answer: {completion})"}


class NamedTeacher(Teacher):
    """A teacher of one's own whose card names its tokenizer (``options.tokenizer``)."""

    kind = "test_plan_decides:NamedTeacher"
    options = ("tokenizer", "vocab_size")

    @classmethod
    def describe(cls, spec) -> TeacherCard:
        return TeacherCard(kind=cls.kind, source="named", outputs=frozenset({LOGITS}),
                           vocab_size=spec.options["vocab_size"], tokenizer=spec.options["tokenizer"])

    def forward(self, inputs: Mapping[str, Any]) -> Any:  # never called: nothing here trains
        raise AssertionError


def _model(path: Path, tokenizer: Any = None, **fields) -> Path:
    GPT2Config(**{"vocab_size": 257, "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 64,
                  "bos_token_id": 0, "eos_token_id": 0, **fields}).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Any]:
    """Two teachers and a student sharing one tokenizer, a store captured with it, text and chat records."""
    root = tmp_path_factory.mktemp("decides")
    tokenizer = bpe("d e", "de f")
    found = {"root": root, "vocab": len(tokenizer), "tokenizer": tokenizer}
    for name in ("a", "b", "student"):
        found[name] = _model(root / name, tokenizer, vocab_size=len(tokenizer))
    (root / "train.txt").write_text("def f(x): return x\n" * 20)
    (root / "chat.jsonl").write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    blocks = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 2, "attention_mask": [[1] * 4] * 2,
                                         "labels": [[1, 2, 3, 4]] * 2}).with_format("torch")

    def rows(batch, real):  # any top-k: the card reads the manifest only
        count = int(batch["attention_mask"][:real].sum())
        return torch.zeros(count, 2), torch.zeros(count, 2, dtype=torch.long), torch.zeros(count), {}

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64)
    fill_store(rows, "teacher", "0" * 64, config.to_dict(), tokenizer, blocks, root / "store", CaptureConfig(k=2))
    found["store"] = root / "store"
    return found


@pytest.fixture()
def a_server(models, monkeypatch):
    """A served teacher's answer to the describe call, without a server: its model config and tokenizer hash."""
    info = {"model": "tiny", "max_model_len": 64, "vocab_size": models["vocab"],
            "tokenizer_sha256": served.vocabulary_sha256(models["tokenizer"]),
            "config": GPT2Config(vocab_size=models["vocab"], n_embd=16, n_layer=1, n_head=2).to_dict()}
    monkeypatch.setattr(served, "server_info", lambda url, opts, named: info)


# Each case: its teachers as a run config writes them, its student, the settings given, and whether it reads chat
# data. The same specs go to make_plan from Python.
CASES = {
    "a local teacher": ("TEACHER", "INIT", {}, False),
    "several teachers": ([{"name": "a", "model": "A"}, {"name": "b", "model": "B"}], "STUDENT", {}, False),
    "a served teacher": ([{"name": "srv", "model": "http://127.0.0.1:9", "options": {"tokenizer": "A"}}], "STUDENT",
                         {}, False),
    "a store": ("STORE", "STUDENT", {}, False),
    "a store and a tokenizer": ("STORE", "STUDENT", {"tokenizer": "STUDENT"}, False),
    "a teacher of one's own": ([{"name": "own", "model": "user_teachers:FixedTeacher",
                                 "options": {"vocab_size": "VOCAB"}}], "STUDENT", {}, False),
    "a teacher of one's own and a tokenizer": ([{"name": "own", "model": "user_teachers:FixedTeacher",
                                                 "options": {"vocab_size": "VOCAB"}}], "STUDENT",
                                               {"tokenizer": "A"}, False),
    "a teacher of one's own naming its tokenizer": ([{"name": "own", "model": "test_plan_decides:NamedTeacher",
                                                      "options": {"vocab_size": "VOCAB", "tokenizer": "A"}}],
                                                    "STUDENT", {}, False),
    "the student itself": ([{"name": "self", "kind": "self", "options": SELF}], "STUDENT", {}, True),
}


def _filled(value: Any, models: dict[str, Any]) -> Any:
    """The case with its placeholders replaced by the fixture's paths."""
    if isinstance(value, list):
        return [_filled(v, models) for v in value]
    if isinstance(value, dict):
        return {k: _filled(v, models) for k, v in value.items()}
    names = {"TEACHER": models["a"], "A": models["a"], "B": models["b"], "STORE": models["store"],
             "STUDENT": models["student"], "VOCAB": models["vocab"]}
    return (int(names[value]) if value == "VOCAB" else str(names[value])) if value in names else value


def _students(value: str, models: dict[str, Any]) -> list[dict]:
    """One student: the pretrained folder (``STUDENT``) or fresh weights of the lead teacher's shape (``INIT``)."""
    return [{"name": "s", "model": str(models["student"])} if value == "STUDENT" else
            {"name": "s", "init": {"n_layer": 1}}]


class _Stop(Exception):
    pass


def _cli_decides(args: list[str], monkeypatch) -> tuple[str | None, str] | str:
    """What the CLI runs with: the lead teacher of the plan it built from and the tokenizer its data phase loads,
    caught as the data phase starts (nothing is trained); or its one-line refusal."""
    seen: dict[str, Any] = {}
    validate = cli.validate.validate

    def kept(*given, **kwargs):
        seen["plan"] = validate(*given, **kwargs)
        return seen["plan"]

    def data_phase(config, data, tokenizer_source, rewards=()):
        seen["tokenizer"] = tokenizer_source
        raise _Stop

    monkeypatch.setattr(cli.validate, "validate", kept)
    monkeypatch.setattr(cli, "prepare_loaders", data_phase)
    try:
        cli.main(args)
    except _Stop:
        return seen["plan"].lead, seen["tokenizer"]
    except SystemExit as refused:
        return str(refused)
    raise AssertionError("the CLI neither refused nor reached its data phase")


@pytest.mark.parametrize("case", CASES)
def test_make_plan_and_the_cli_decide_the_same_lead_teacher_and_tokenizer(case, models, a_server, tmp_path,
                                                                         monkeypatch):
    teachers, students, given, chat_data = CASES[case]
    teachers, given, students = _filled(teachers, models), _filled(given, models), _students(students, models)
    data = models["root"] / ("chat.jsonl" if chat_data else "train.txt")
    args = [f"output_dir={tmp_path / 'run'}", f"data.train={data}", "data.block_size=32", "report_to=[]",
            "--students", json.dumps(students), *(f"{k}={v}" for k, v in given.items())]
    args += [f"teacher={teachers}"] if isinstance(teachers, str) else ["--teachers", json.dumps(teachers)]
    specs = [TeacherSpec(name="teacher", model=teachers)] if isinstance(teachers, str) else [
        TeacherSpec(**t) for t in teachers]
    python = make_plan([StudentSpec(**s) for s in students], specs, training=TrainingConfig(), world_size=1,
                       data=DataFacts(kind="chat" if chat_data else "text", block_size=32),
                       tokenizer=given.get("tokenizer"))
    assert python.lead == specs[0].name
    decided = _cli_decides(args, monkeypatch)
    if python.tokenizer is None:  # no model names one: the CLI, which reads its data with it, refuses before a write
        assert isinstance(decided, str) and decided.startswith("config error: "), decided
        assert f"teacher {python.lead!r}" in decided and "names no tokenizer" in decided
        assert "set tokenizer: the folder or hub name of the teachers' tokenizer" in decided
        assert not (tmp_path / "run").exists()
    else:
        assert decided == (python.lead, python.tokenizer)


def test_a_teacher_of_your_own_without_a_tokenizer_is_refused_at_start_naming_the_fix(models, tmp_path, capsys):
    """Not a transformers traceback from the loaders: one line, before any write, naming the card's field too."""
    out = tmp_path / "run"
    own = [{"name": "own", "model": "user_teachers:FixedTeacher", "options": {"vocab_size": models["vocab"]}}]
    with pytest.raises(SystemExit) as refused:
        cli.main([f"output_dir={out}", f"data.train={models['root'] / 'train.txt'}", "data.block_size=32",
                  "--teachers", json.dumps(own), "--students", json.dumps(_students("STUDENT", models))])
    message = str(refused.value)
    assert message == ("config error: teacher 'own' (a user_teachers:FixedTeacher teacher, seed 0) names no "
                       "tokenizer, and the run reads its data with one: set tokenizer: the folder or hub name of the "
                       "teachers' tokenizer (or have its describe return TeacherCard(..., tokenizer=...))")
    assert "Traceback" not in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit) as refused:  # with another of the plan's problems: both at once
        cli.main([f"output_dir={out}", f"data.train={models['root'] / 'train.txt'}", "data.block_size=99",
                  "--teachers", json.dumps(own), "--students", json.dumps(_students("STUDENT", models))])
    assert str(refused.value).startswith("config error: 2 problems:\n  - data.block_size: 99 tokens per row")
    assert "\n  - teacher 'own' (a user_teachers:FixedTeacher teacher, seed 0) names no tokenizer" in str(refused.value)


# ---- the four refusals, from Python ----------------------------------------------------------------------------


def _distiller(models: dict[str, Any], **kwargs) -> Distiller:
    return Distiller(**{"students": [StudentSpec(name="s", model=str(models["student"]))],
                        "teachers": [TeacherSpec(name="a", model=str(models["a"]))], **kwargs})


def test_on_policy_tokens_are_checked_from_python(models, tmp_path):
    chat_rows = DataFacts(kind="chat", block_size=32)
    vocab = models["vocab"]
    with pytest.raises(ConfigError, match=rf"^training.on_policy.pad_token_id: {vocab + 3} is outside the vocabulary "
                                          rf"\(ids 0..{vocab - 1} in every model of the run\)"):
        _distiller(models, data=chat_rows,
                   training=TrainingConfig(on_policy=OnPolicyConfig(fraction=0.5, pad_token_id=vocab + 3)))
    endless = _model(tmp_path / "endless", models["tokenizer"], vocab_size=vocab, eos_token_id=None)
    with pytest.raises(ConfigError, match=r"^training.on_policy: students\[s\] has no end token .* set "
                                          r"training.on_policy.eos_token_id"):
        Distiller(students=[StudentSpec(name="s", init={"n_layer": 1})],
                  teachers=[TeacherSpec(name="a", model=endless)], data=chat_rows,
                  training=TrainingConfig(on_policy=OnPolicyConfig(fraction=0.5)))
    with pytest.raises(ConfigError, match=r"sampler: teacher samples from the first teacher \(a\), whose weight is 0"):
        _distiller(models, data=chat_rows,
                   teachers=[TeacherSpec(name="a", model=str(models["a"]), weight=0.0),
                             TeacherSpec(name="b", model=str(models["b"]))],
                   training=TrainingConfig(on_policy=OnPolicyConfig(fraction=0.5, sampler="teacher")))


def test_lora_on_a_random_student_is_refused_from_python(models):
    with pytest.raises(ConfigError, match=r"^students\[s\].peft: LoRA adapters train on a frozen pretrained student, "
                                          r"but this student is built with random weights \(init\)"):
        _distiller(models, students=[StudentSpec(name="s", init={"n_layer": 1}, peft={"r": 4})])


def test_routed_packing_is_refused_from_python(models):
    with pytest.raises(ConfigError) as refused:
        _distiller(models, teachers=[TeacherSpec(name="a", model=str(models["a"])),
                                     TeacherSpec(name="b", model=str(models["b"]))],
                   combine="route", data=DataFacts(kind="chat", block_size=32, packing=True))
    assert str(refused.value) == chat.ROUTED_PACKING


def test_a_checkpoint_folder_without_room_or_not_writable_is_refused_from_python(models, tmp_path, monkeypatch):
    """Before anything loads or is written: the output folder is not even made."""
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=r"^training.checkpoint_dir '.*a_file/run/checkpoints' cannot be created: "
                                          r".*a_file is not a folder"):
        _distiller(models, output_dir=tmp_path / "a_file" / "run")
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1000)
    with pytest.raises(ConfigError, match=r"its disk has 0.00 GB free, but the run needs about .* GB for its "
                                          r"checkpoints \(.* GB each: weights and optimizer states; 2 kept"):
        _distiller(models, output_dir=tmp_path / "run", training=TrainingConfig(keep_checkpoints=2))
    assert not (tmp_path / "run").exists()


def test_the_plan_decides_for_python_alone_too(models):
    """Without a tokenizer given: the lead teacher's folder, else (a module teacher) none; a student-only run: the
    first student's."""
    plan = make_plan([StudentSpec(name="s", model=str(models["student"]))],
                     [TeacherSpec(name="b", model=str(models["b"])), TeacherSpec(name="a", model=str(models["a"]))],
                     training=TrainingConfig(), world_size=1)
    assert (plan.lead, plan.tokenizer) == ("b", str(models["b"]))
    alone = make_plan([StudentSpec(name="s", model=str(models["student"]), loss="cross_entropy")], [],
                      training=TrainingConfig(), world_size=1)
    assert (alone.lead, alone.tokenizer) == (None, str(models["student"]))
    from transformers import GPT2LMHeadModel

    module = GPT2LMHeadModel(GPT2Config(vocab_size=models["vocab"], n_embd=16, n_layer=1, n_head=2, n_positions=64,
                                        bos_token_id=0, eos_token_id=0))
    built = make_plan([StudentSpec(name="s", model=str(models["student"]))], [TeacherSpec(name="m", model=module)],
                      training=TrainingConfig(), world_size=1)
    assert (built.lead, built.tokenizer) == ("m", None)  # a module names no tokenizer; nor is the student's taken


"""``scripts/distill.py``: config handling, and a tiny real run on 1 rank (python) and 2 ranks (deepspeed)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launch import ROOT, clean_environment, run_ranks
from tiny_models import save_cli_teacher
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill_kit.data import blocks
from distill_kit.data.tokenizer import train_tokenizer
from distill_kit.engines import models
from distill_kit.run import cli, run_config, validate

SCRIPT = ROOT / "scripts/distill.py"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=clean_environment())


def write_texts(root: Path) -> list[str]:
    """Local text (Python sources of the standard library and of this project): train.txt and heldout.txt in
    ``root``; returns the texts, for training a tokenizer on them."""
    sources = sorted(Path(json.__file__).parent.glob("*.py")) + sorted(Path(run_config.__file__).parent.glob("*.py"))
    texts = [p.read_text() for p in sources]
    (root / "train.txt").write_text("\n".join(texts[1:]))
    (root / "heldout.txt").write_text(texts[0])
    return texts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A teacher with its own tokenizer, and train/held-out text files, all local."""
    root = tmp_path_factory.mktemp("tiny")
    texts = write_texts(root)
    tokenizer = train_tokenizer(texts, vocab_size=300)
    teacher = save_cli_teacher(root / "teacher", tokenizer)
    return {"root": root, "teacher": teacher}


def _run_args(tiny: dict[str, Path], out: Path) -> list[str]:
    return [
        f"teacher={tiny['teacher']}", f"output_dir={out}", f"cache_dir={out / 'cache'}",
        f"data.train={tiny['root'] / 'train.txt'}", f"data.heldout={tiny['root'] / 'heldout.txt'}",
        "data.block_size=32", "data.max_train_blocks=64", "data.max_heldout_blocks=12",
        "training.max_steps=6", "training.micro_batch_size=2", "training.lr=3e-3", "eval.every=3",
        "--students", "[{name: distilled, init: {n_layer: 1, n_embd: 32}, loss: forward_kl},"
        " {name: no_teacher, init: {n_layer: 1, n_embd: 32}, loss: cross_entropy}]",
    ]


def _heldout_perplexity(model_dir: Path, tiny: dict[str, Path]) -> float:
    """Perplexity of an exported student over every held-out block, with plain transformers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = blocks.DataConfig(train=str(tiny["root"] / "train.txt"), heldout=str(tiny["root"] / "heldout.txt"),
                               block_size=32, max_heldout_blocks=12)
    heldout = blocks.build_splits(config, tokenizer).heldout.with_format("torch")
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for row in heldout:
            logits = model(input_ids=row["input_ids"][None], attention_mask=row["attention_mask"][None]).logits[0, :-1]
            labels = row["labels"][1:]
            keep = labels != -100
            nll += F.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
            tokens += int(keep.sum())
    return math.exp(nll / tokens)


def test_tiny_run_end_to_end(tiny, tmp_path):
    """1 rank under plain python: report, curves, exported students, resume. (Two ranks under the deepspeed
    launcher, with research code's Distiller subclass: tests/test_chat_data.py::test_cli_trains_on_chat_data;
    streamed data split over ranks: tests/test_data.py::test_streaming_loader_gives_equal_complete_batches.)"""
    out = tmp_path / "run"
    # A start that fails (here: a record that is not text, found only when the data is read) claims nothing:
    # the same command, fixed, then runs in that folder.
    bad = tmp_path / "heldout.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 12}\n')
    message = _main_error(*_run_args(tiny, out), f"data.heldout={bad}")
    assert "data: " in message and "heldout.jsonl: record 1 (counting from 0) has text=12, not a string" in message
    assert not (out / "run_identity.json").exists() and not (out / "init").exists()
    run_ranks(SCRIPT, _run_args(tiny, out), nprocs=0)
    report = json.loads((out / "report.json").read_text())
    students = report["summary"]["students"]
    assert set(students) == {"distilled", "no_teacher"}
    assert "perplexity_reduction_vs_no_teacher" in students["distilled"]
    assert [e["step"] for e in report["evaluations"]] == [3, 6]
    # The engines ran the run config's optimizer settings, and the report says so.
    engine = report["deepspeed_configs"]["students"]["distilled"]
    assert engine["optimizer"]["params"]["betas"] == report["config"]["training"]["betas"] == [0.9, 0.95]
    assert engine["gradient_clipping"] == report["config"]["training"]["max_grad_norm"]
    assert [r["distilled/lr"] for r in _jsonl(out / "train.jsonl")] == pytest.approx(
        [3e-3 * f for f in (1 / 20, 2 / 20, 3 / 20, 4 / 20, 5 / 20, 6 / 20)], rel=1e-12)  # warm-up 20 > 6 steps
    for name in students:
        # The exported student reloads and reproduces the perplexity measured on the model in training.
        exported = _heldout_perplexity(out / "students" / name, tiny)
        assert exported == pytest.approx(students[name]["perplexity"], rel=1e-4)
    assert [r["step"] for r in _jsonl(out / "train.jsonl")] == list(range(1, 7))
    # The same folder again: refused without --resume; with it, the run continues from its last checkpoint.
    again = _main_error(*_run_args(tiny, out), "training.max_steps=9")
    assert "holds checkpoints of this run: resume it (--resume)" in again
    # --resume that finds nothing to resume (a mistyped checkpoint folder) is an error naming where it looked,
    # and leaves the run's logs, report and students as they were.
    before = {name: (out / name).read_bytes() for name in ("train.jsonl", "eval.jsonl", "report.json")}
    message = _main_error(*_run_args(tiny, out), f"training.checkpoint_dir={out / 'checkpoitns'}", "--resume")
    assert f"there is no checkpoint to resume in {out / 'checkpoitns'}" in message
    message = _main_error(*_run_args(tiny, tmp_path / "not-a-run"), "--resume")
    assert f"output directory {tmp_path / 'not-a-run'} holds no run to resume" in message
    assert not (tmp_path / "not-a-run").exists()
    # --resume whose checkpoints are all corrupt stops too, instead of starting again from step 0.
    corrupt = tmp_path / "corrupt"
    shutil.copytree(out, corrupt)
    for step in (corrupt / "checkpoints").glob("step_*"):
        (step / "rank00000.json").write_text("{}")
    message = _main_error(*_run_args(tiny, corrupt), "--resume")
    assert f"no checkpoint in {corrupt / 'checkpoints'} can be loaded" in message
    assert "step_00000006: rank00000.json has 2 bytes" in message
    assert {name: (out / name).read_bytes() for name in before} == before
    # What a save on a full disk leaves (an unfinished .partial-*) is cleared by the next start, not by hand.
    (out / "checkpoints/.partial-step_00000009/deepspeed").mkdir(parents=True)
    run_ranks(SCRIPT, [*_run_args(tiny, out), "training.max_steps=9", "--resume"], nprocs=0)
    assert not list((out / "checkpoints").glob(".partial-*"))
    assert [r["step"] for r in _jsonl(out / "train.jsonl")] == list(range(1, 10))
    assert [e["step"] for e in json.loads((out / "report.json").read_text())["evaluations"]] == [3, 6, 9]
    other = _main_error(*_run_args(tiny, out), "training.lr=1e-2", "--resume")
    assert "holds another run (training.lr: 0.003 -> 0.01)" in other


def _main_error(*args: str) -> str:
    """The message the CLI stops with (in this process: nothing is loaded before these errors). The rendezvous
    variables a one-rank start sets are put back, so that ranks launched later pick their own port."""
    environment = dict(os.environ)
    try:
        with pytest.raises(SystemExit) as stopped:
            cli.main(list(args))
    finally:
        os.environ.clear()
        os.environ.update(environment)
    assert isinstance(stopped.value.code, str) and stopped.value.code.startswith("config error: ")
    return stopped.value.code


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_help_lists_every_field(capsys):
    assert cli.main(["--help"]) == 0
    printed = capsys.readouterr().out
    for key in ("training.lr", "training.micro_batch_size", "data.block_size", "eval.every", "students",
                "teacher_ds_overrides", "output_dir"):
        assert key in printed


def test_print_config_applies_file_then_flags(tmp_path, capsys):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("training:\n  lr: 0.01\n  max_steps: 7\nteacher_ds_config: other.json\n")
    assert cli.main(["--config", str(run_file), "--training.lr", "2e-3", "--print-config"]) == 0
    out = capsys.readouterr().out
    printed = out[out.index("teacher:"):]
    import yaml
    config = yaml.safe_load(printed)
    assert config["training"]["lr"] == 2e-3 and config["training"]["max_steps"] == 7
    assert config["teacher_ds_config"] == "other.json"


@pytest.mark.parametrize(("args", "message"), [
    (["--training.lrr", "1"], "unknown config key 'training.lrr': did you mean 'training.lr'?"),
    (["--trainig.lr", "1"], "unknown config key 'trainig': did you mean 'training'?"),
    (["--training.max_steps", "many"], "training.max_steps: expected int"),
    (["--config", "no/such/run.yaml"], "run config 'no/such/run.yaml' does not exist"),
    (["--training.dtype", "fp8"], "training.dtype: 'fp8' is not one of"),
    (["teacher=/no/such/teacher"], "teacher: '/no/such/teacher' does not exist"),
])
def test_bad_input_is_a_clear_error(args, message):
    assert message in _main_error(*args)  # in this process: a Python start for each costs ~6 s of the suite


def test_the_script_stops_on_bad_input_with_its_message_alone():
    """What a user of ``scripts/distill.py`` sees: a non-zero exit and the message, no traceback."""
    done = _cli("--training.lrr", "1")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "unknown config key 'training.lrr': did you mean 'training.lr'?" in done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--training.max_steps", "1.05e1"], "training.max_steps: expected an integer, got '1.05e1'"),
    (["--training.lr", "inf"], "training.lr: expected a finite number, got 'inf'"),
    (["--training.lr", "nan"], "training.lr: expected a finite number, got 'nan'"),
    (["--students", "[{name: a"], "students: cannot read '[{name: a' as YAML (line 1, column 10"),
])
def test_bad_values_are_refused_at_load(args, message):
    with pytest.raises(run_config.ConfigError, match=re.escape(message)):
        run_config.load(None, args)
    assert run_config.load(None, ["--training.max_steps", "1e1"]).training.max_steps == 10


def test_bad_yaml_files_are_refused_naming_file_and_line(tmp_path):
    (tmp_path / "inf.yaml").write_text("training:\n  lr: .inf\n")
    with pytest.raises(run_config.ConfigError, match="training.lr: expected a finite number, got inf"):
        run_config.load(tmp_path / "inf.yaml")
    (tmp_path / "broken.yaml").write_text("training:\n  lr: [1, 2\n  max_steps: 3\n")
    with pytest.raises(run_config.ConfigError, match=r"broken.yaml' is not valid YAML: line 3, column 12"):
        run_config.load(tmp_path / "broken.yaml")


def test_every_start_problem_is_found_before_any_work_or_write(tiny, tmp_path):
    """Models, init, data, DeepSpeed configs and the checkpoint disk, all reported at once, nothing written."""
    (tmp_path / "empty_teacher").mkdir()
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "run"
    args = [*_run_args(tiny, out), f"data.heldout={tmp_path / 'latin1.txt'}",
            "--student_ds_overrides", "{gradient_clipingg: 1.0}",
            f"training.checkpoint_dir={tmp_path / 'a_file' / 'checkpoints'}"]
    message = _main_error(*args)
    assert "4 problems" in message  # the DeepSpeed key in each of the two students' configs, the data, the disk
    assert "data.heldout: " in message and "latin1.txt is not UTF-8 text: line 1 has the byte 0xe9" in message
    assert "unknown key 'gradient_clipingg' (DeepSpeed would ignore it); did you mean 'gradient_clipping'?" in message
    assert f"training.checkpoint_dir '{tmp_path / 'a_file' / 'checkpoints'}' cannot be created" in message
    assert "students: " not in message and not out.exists()
    message = _main_error(*_run_args(tiny, out), f"teacher={tmp_path / 'empty_teacher'}")
    assert f"teacher: the folder '{tmp_path / 'empty_teacher'}' holds no model (no config.json)" in message
    message = _main_error(*_run_args(tiny, out), "--students", "[{name: s, init: {n_layer: 1, n_embdd: 32}}]")
    assert "students[s].init: ['n_embdd'] are not fields of the teacher's GPT2Config" in message
    message = _main_error(*_run_args(tiny, out), "--students", "[{name: s, init: {n_layer: 1, n_embd: 33}}]")
    assert "students[s].init {'n_layer': 1, 'n_embd': 33}: the teacher's config with these values does not build" \
        in message  # 33 channels over the teacher's 4 heads
    assert not out.exists()


def test_a_checkpoint_disk_without_room_is_refused_naming_the_sizes(tiny, tmp_path, monkeypatch):
    config = run_config.load(None, [*_run_args(tiny, tmp_path / "run"), "training.keep_checkpoints=2"])
    config = cli.with_output_dir(config, resume=False)
    start = validate.Start(config, resume=False, identity=cli.run_identity(config))
    assert validate.check_plan(start) == []  # the plan's check (the Distiller's too: test_plan_decides.py)
    # Two 1-layer students of width 32 on a 300-token vocabulary, fp32: weights and three fp32 optimizer states.
    parameters = sum(models.parameter_count(c) for c in start.students().values())
    each = parameters * (4 + 12)
    monkeypatch.setattr(validate.checkpoint, "free_bytes", lambda path: 3 * each - 1)
    (problem,) = validate.check_plan(start)
    assert f"needs about {3 * each / 1e9:.2f} GB for its checkpoints ({each / 1e9:.2f} GB each" in problem
    monkeypatch.setattr(validate.checkpoint, "free_bytes", lambda path: 3 * each)
    assert validate.check_plan(start) == []


def test_streaming_needs_held_out_files(tiny, tmp_path):
    config = run_config.load(None, [*_run_args(tiny, tmp_path / "run"), "data.streaming=true", "data.heldout=null"])
    start = validate.Start(cli.with_output_dir(config, resume=False), resume=False, identity={})
    assert validate.check_data(start) == ["data.streaming needs data.heldout files: a stream cannot be split by "
                                          "fraction"]


def test_too_little_data_is_a_config_error_and_claims_nothing(tiny, tmp_path):
    out = tmp_path / "run"
    message = _main_error(*_run_args(tiny, out), "data.max_train_blocks=1")
    assert "data: the dataset has 1 blocks but one global batch needs world_size (1) x micro_batch_size (2)" in message
    assert not (out / "run_identity.json").exists()


@pytest.mark.parametrize(("value", "message"), [
    ("tests.user_distillers", "distiller: 'tests.user_distillers' is not an import path; write 'pkg.module:Class'"),
    ("tests.no_such_module:X", "distiller: cannot import 'tests.no_such_module:X'"),
    ("tests.user_distillers:NotADistiller", "is not a subclass of distill_kit.distiller.Distiller; subclass it"),
])
def test_a_distiller_that_cannot_run_is_a_config_error_before_any_work(tmp_path, value, message):
    config = run_config.load(None, [f"distiller={value}", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(run_config.ConfigError, match=re.escape(message)):
        cli.distiller_class(config)
    assert cli.distiller_class(run_config.load(None, ["distiller=tests.user_distillers:MarkedDistiller"])).__name__ \
        == "MarkedDistiller"


def test_a_distiller_module_that_fails_to_import_is_one_config_error(tmp_path, monkeypatch):
    """Any error the module raises while imported (here a SyntaxError) is the one message, never a traceback."""
    (tmp_path / "broken_kd.py").write_text("class Broken(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = run_config.load(None, ["distiller=broken_kd:Broken", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(run_config.ConfigError, match=r"distiller: cannot import 'broken_kd:Broken' \(SyntaxError"):
        cli.distiller_class(config)


def test_a_run_a_signal_stopped_exits_with_its_own_status(monkeypatch):
    """A run stopped by SIGTERM/SIGINT (its checkpoint saved, ``run`` returns None) is not finished: exit status
    ``cli.STOPPED``, neither 0 (done) nor 1 (an error)."""
    monkeypatch.setattr(cli, "run", lambda config, resume=False: None)
    monkeypatch.setattr(cli.distributed, "shutdown", lambda: None)  # this worker's process group serves later tests
    assert cli.main(["--training.max_steps", "1"]) == cli.STOPPED == 3

"""Capture's output folder and a server that stops mid-capture (``offline/capture.py``, ``scripts/capture_teacher.py``,
``teachers/served_capture.py``), in this process: no model loads, the served client is a stub at its boundary.

Checked: a folder of the user's own files, a manifest.json of the user's, a file, a store of another format and a
store started with other arguments are each refused in one line naming what is there (and what differs, with the flag
that sets it) and the fix, before anything loads and with the folder left as it was; a server that stops answering
part-way gives one line saying that the same command, run again, resumes, and running it again does.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import GPT2Config

from distill_kit.errors import ConfigError, TeacherUnavailable
from distill_kit.offline import capture as capture_module
from distill_kit.offline.capture import CaptureConfig, fill_store, out_problem
from distill_kit.offline.store import Manifest, parts
from distill_kit.teachers import served_capture

ROOT = Path(__file__).resolve().parents[1]
VOCAB, LENGTH = 64, 8


def script():
    spec = importlib.util.spec_from_file_location("capture_teacher", ROOT / "scripts/capture_teacher.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blocks(count: int = 6) -> datasets.Dataset:
    ids = torch.arange(count * LENGTH).reshape(count, LENGTH) % (VOCAB - 1) + 1
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * LENGTH] * count,
                                       "labels": ids.tolist()})


def rows(k: int):
    """Top-k rows of a made-up teacher for a micro-batch's first ``real`` blocks."""
    def make(batch, real):
        n = int(batch["attention_mask"][:real].sum())
        values = torch.log_softmax(torch.randn(n, k), -1) - 1.0
        return values, torch.arange(k).repeat(n, 1), torch.full((n,), -1.5), {}
    return make


def store(root: Path, teacher: str = "teachers/a", k: int = 4, **config) -> Path:
    settings = CaptureConfig(k=k, micro_batch_size=2, batches_per_part=1, dtype="fp32") if not config else \
        CaptureConfig(**{"k": k, "micro_batch_size": 2, "batches_per_part": 1, "dtype": "fp32", **config})
    fill_store(rows(k), teacher, "sha-a", GPT2Config(vocab_size=VOCAB).to_dict(), None, blocks(), root, settings)
    return root


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def argv(monkeypatch, out: Path, *extra: str, teacher: str = "teachers/a") -> None:
    monkeypatch.setattr(sys, "argv", ["capture_teacher.py", "--teacher", teacher, "--tokenizer", "no/such-tokenizer",
                                      "--data", "x.txt", "--out", str(out), *extra])


@pytest.fixture()
def nothing_loads(monkeypatch):
    """A capture script that got past its folder check would load a tokenizer: here that fails the test."""
    module = script()

    def loads(*args, **kwargs):
        raise AssertionError("the script loaded a tokenizer before refusing its --out")

    monkeypatch.setattr(module.AutoTokenizer, "from_pretrained", loads)
    return module


def test_a_folder_of_the_users_own_files_is_not_written_into(tmp_path, monkeypatch, nothing_loads):
    """Not a store: one unrelated file; a manifest.json that is the user's (a web app's); --out naming a file."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text(json.dumps({"name": "my app", "icons": []}))
    (tmp_path / "file.bin").write_bytes(b"x")
    for out, message in ((notes, r"is not a teacher store \(no manifest.json\) and holds other files \(todo.txt\); "
                                 r"a capture will not write into it: give --out a new or empty folder"),
                         (app, r"is not a teacher store: its manifest.json is not one scripts/capture_teacher.py "
                               r"writes \(no spec or format_version\); a capture will not write into it"),
                         (tmp_path / "file.bin", r"is a file, not a folder: give --out a new folder")):
        before = snapshot(tmp_path)
        argv(monkeypatch, out)
        with pytest.raises(SystemExit) as stopped:
            nothing_loads.main()
        assert re.search(message, str(stopped.value)) and "format None" not in str(stopped.value)
        assert snapshot(tmp_path) == before
    assert out_problem(tmp_path / "new", {}) is None and out_problem(tmp_path / "new2", {"k": 4}) is None
    (tmp_path / "empty").mkdir()
    assert out_problem(tmp_path / "empty", {"k": 4}) is None


def test_a_store_started_otherwise_is_refused_naming_each_difference_and_its_flag(tmp_path, monkeypatch,
                                                                                   nothing_loads):
    """Another teacher and another k (the flags: refused before anything loads); another teacher hash and dataset
    (known once loaded: refused by the capture itself, before any part is written); another store format."""
    root = store(tmp_path / "store")
    before = snapshot(root)
    argv(monkeypatch, root, "--k", "8", "--micro-batch-size", "2", "--batches-per-part", "1",
         teacher="teachers/b")
    with pytest.raises(SystemExit) as stopped:
        nothing_loads.main()
    message = str(stopped.value)
    assert "holds a teacher store started with other arguments, so this capture cannot resume it" in message
    assert "teacher: store 'teachers/a', now 'teachers/b' (--teacher)" in message
    assert "k: store 4, now 8 (--k)" in message
    assert "Give --out another folder for these arguments, or the arguments the store was started with" in message
    with pytest.raises(ConfigError, match=r"teacher_hash: store 'sha-a', now 'sha-b' \(--teacher's weights\)"
                                          r"(.|\n)*dataset: store '[0-9a-f]+:6', now '[0-9a-f]+:5' \(the blocks"):
        fill_store(rows(4), "teachers/a", "sha-b", GPT2Config(vocab_size=VOCAB).to_dict(), None, blocks(5), root,
                   CaptureConfig(k=4, micro_batch_size=2, batches_per_part=1, dtype="fp32"))
    assert snapshot(root) == before
    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps(manifest | {"format_version": 2}))
    before = snapshot(root)
    argv(monkeypatch, root, "--k", "4", "--micro-batch-size", "2", "--batches-per-part", "1")
    with pytest.raises(SystemExit, match="holds a teacher store of format 2, and this version of distill-kit reads "
                                         "format 1: capture the teacher again into a new folder"):
        nothing_loads.main()
    assert snapshot(root) == before


class StubServer:
    """The served client as ``served_capture`` uses it, answering made-up top-k rows, ``answers`` calls in all
    (the first is capture's one-token probe); after that it stops, as the client does when its server is gone."""

    def __init__(self, answers: int, k: int = 4):
        self.answers, self.k, self.calls = answers, k, 0

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(served_capture.served, "server_info", lambda *args: {"max_k": 20})
        config = GPT2Config(vocab_size=VOCAB, n_positions=64)
        monkeypatch.setattr(served_capture.kinds, "describe", lambda spec: SimpleNamespace(config=config))
        monkeypatch.setattr(served_capture, "fingerprint_problems", lambda *args: [])
        real = served_capture.ServedTeacher
        made = type("Stubbed", (), {"options": real.options, "__new__": lambda cls, spec, card, setup: self})
        monkeypatch.setattr(served_capture, "ServedTeacher", made)

    identity = "sha-served"

    def forward(self, inputs):
        self.calls += 1
        if self.calls > self.answers:
            raise TeacherUnavailable(  # the client's own words, written for a training run
                "the teacher server at http://127.0.0.1:9 has not answered for 5 s (retries_s=5; last: ConnectError: "
                "[Errno 111] Connection refused). The run stops here after a checkpoint: restart the server, then "
                "resume with --resume")
        batch, length = inputs["input_ids"].shape
        values = torch.log_softmax(torch.randn(batch, length, self.k), -1) - 1.0
        return SimpleNamespace(logits=SimpleNamespace(log_probs=values, ids=torch.arange(self.k).expand_as(values),
                                                      log_tail=torch.full((batch, length), -1.5)))

    def close(self) -> None:
        pass


def test_a_server_that_stops_mid_capture_is_one_line_and_the_same_command_resumes(tmp_path, monkeypatch):
    """Six blocks, two a micro-batch, a part each: the server answers the probe and two micro-batches, then is gone.
    One line names the server and its last error, says the same command resumes (no --resume flag, no run's
    checkpoint); run again, the capture does the third micro-batch only and completes."""
    module = script()
    tokenizer = SimpleNamespace(name_or_path="stub", get_vocab=lambda: {})
    monkeypatch.setattr(module.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tokenizer)
    monkeypatch.setattr(module, "build_splits", lambda data, tok: SimpleNamespace(train=blocks(), heldout=None))
    monkeypatch.setattr(capture_module, "tokenizer_fingerprint", lambda tok: "tok-sha")
    out = tmp_path / "store"
    argv(monkeypatch, out, "--k", "4", "--micro-batch-size", "2", "--batches-per-part", "1",
         teacher="http://127.0.0.1:9")
    StubServer(answers=3).install(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        module.main()
    message = str(stopped.value)
    assert message.startswith("capture_teacher.py: --teacher http://127.0.0.1:9 stopped answering mid-capture: the "
                              "teacher server at http://127.0.0.1:9 has not answered for 5 s (retries_s=5; last: "
                              "ConnectError: [Errno 111] Connection refused). The parts finished so far are kept in")
    assert message.endswith("run the same command again; it resumes at the last finished part")
    assert "--resume" not in message and "checkpoint" not in message and "\n" not in message
    assert len(list(parts(out))) == 2 and not Manifest.load(out).complete
    again = StubServer(answers=100)
    again.install(monkeypatch)
    module.main()
    assert again.calls == 1 + 1  # the probe, then the one micro-batch not yet stored
    assert len(list(parts(out))) == 3 and Manifest.load(out).complete

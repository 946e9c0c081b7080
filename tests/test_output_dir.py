"""The output folder's guard (``run/output_dir.py``): one live run per folder (the lock), its identity, its
data, and a failed start that never blocks the same command, fixed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from distill_kit.errors import ConfigError
from distill_kit.run import cli, output_dir

RUN = {"teacher": "t", "training": {"lr": 1e-3, "max_steps": 10}}


def _checkpoint(folder: Path) -> None:
    """What makes a folder hold a run worth keeping: a complete checkpoint (its manifest)."""
    (folder / "step_00000001").mkdir(parents=True)
    (folder / "step_00000001" / "manifest.json").write_text("{}")


def test_output_dir_guard(tmp_path):
    out = tmp_path / "out"
    output_dir.check(out, RUN, resume=False)  # new: the identity is recorded
    output_dir.check(out, RUN, resume=False)  # same run, no checkpoint yet: fine
    _checkpoint(out / "ckpt")
    with pytest.raises(ConfigError, match=r"holds checkpoints of this run: resume it \(--resume\)"):
        output_dir.check(out, RUN, resume=False)
    output_dir.check(out, RUN, resume=True)
    other = {"teacher": "t", "training": {"lr": 2e-3, "max_steps": 10}}
    with pytest.raises(ConfigError, match=r"holds another run \(training.lr: 0.001 -> 0.002\)"):
        output_dir.check(out, other, resume=True)
    (tmp_path / "stranger").mkdir()
    (tmp_path / "stranger/notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no run_identity.json: it is not a distill-kit run"):
        output_dir.check(tmp_path / "stranger", RUN, resume=False)


def test_a_folder_without_a_checkpoint_is_taken_over_and_one_with_a_checkpoint_elsewhere_is_not(tmp_path):
    """A start that failed after its claim left an identity, built students and a lock file, but no checkpoint:
    another identity takes it over (and nothing it built is reused); a checkpoint in training.checkpoint_dir,
    outside the folder, still makes it another run."""
    out, first = tmp_path / "out", {"teacher": "t", "students": [{"name": "s", "loss": "forward_kl"}]}
    fixed = {"teacher": "t", "students": [{"name": "s", "loss": "reverse_kl"}]}
    with output_dir.Lock(out):
        output_dir.check(out, first, resume=False)
        (out / "init" / "s").mkdir(parents=True)
    output_dir.check(out, fixed, resume=False, record=False)  # the check before the claim accepts it, writes nothing
    assert json.loads((out / "run_identity.json").read_text()) == first and (out / "init" / "s").is_dir()
    output_dir.check(out, fixed, resume=False)
    assert json.loads((out / "run_identity.json").read_text()) == fixed and not (out / "init").exists()
    elsewhere = tmp_path / "checkpoints"
    _checkpoint(elsewhere)
    with pytest.raises(ConfigError, match=r"holds another run \(students: .*put those settings back"):
        output_dir.check(out, first, resume=False, checkpoint_dir=elsewhere)
    with pytest.raises(ConfigError, match="holds another run"):  # nothing to resume of another identity either
        output_dir.check(tmp_path / "out", first, resume=True)


def test_a_second_start_is_refused_naming_pid_and_host_and_clears_nothing(tmp_path):
    out = tmp_path / "out"
    checkpoints = out / "checkpoints"
    with output_dir.Lock(out):
        output_dir.check(out, RUN, resume=False)
        (checkpoints / ".partial-step_00000007").mkdir(parents=True)  # the running run's save in progress
        holder = f"pid {os.getpid()} on host {socket.gethostname()}"
        assert holder in output_dir.in_use(out)
        config = SimpleNamespace(training=SimpleNamespace(checkpoint_dir=str(checkpoints)))
        with pytest.raises(ConfigError, match=f"is in use by a run that is still going \\({holder}"):
            cli._claim(out, config, RUN, True, cli.contextlib.ExitStack())
        assert (checkpoints / ".partial-step_00000007").is_dir()
    assert output_dir.in_use(out) is None  # released at the end of the run
    with output_dir.Lock(out):
        pass


def test_the_lock_of_a_process_that_died_does_not_block(tmp_path):
    """Another process holds the folder's flock (as a run's rank 0 does) and names itself; killed with SIGKILL,
    which runs no cleanup, it leaves the lock file behind, and the next start takes it."""
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, json, os, sys\n"
        f"f = open({str(out / output_dir.LOCK)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "f.write(json.dumps({'pid': os.getpid(), 'host': 'node-7', 'since': 'noon'})); f.flush()\n"
        "print('locked', flush=True); sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on host node-7, since noon"):
            output_dir.Lock(out).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / output_dir.LOCK).exists() and output_dir.in_use(out) is None
    with output_dir.Lock(out):
        output_dir.check(out, RUN, resume=False)  # the lock file alone does not make the folder "not a run"


def test_resume_on_changed_data_is_refused_naming_the_file(tmp_path):
    train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    train.write_text('{"text": "a"}\n')
    heldout.write_text('{"text": "b"}\n')
    splits = {"data.train": [str(train)], "data.heldout": str(heldout)}
    output_dir.record_data(tmp_path, output_dir.data_fingerprint(splits))
    assert output_dir.data_changes(tmp_path, output_dir.data_fingerprint(splits)) == []
    train.write_text('{"text": "A"}\n')  # same size, same path, other content
    (problem,) = output_dir.data_changes(tmp_path, output_dir.data_fingerprint(splits))
    assert problem.startswith(f"data.train: the content of {train} differs from what the run")

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

from distill_kit.errors import CheckpointError, ConfigError
from distill_kit.run import cli, output_dir
from distill_kit.training import checkpoint

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


# ---- every folder a run writes is that run's -------------------------------------------------------------

OTHER = {"teacher": "t", "training": {"lr": 2e-3, "max_steps": 10}}


def _hold(folder: Path, output: str = "elsewhere") -> subprocess.Popen:
    """Another process holding ``folder``'s lock, as a live run's rank 0 does; stop it with SIGKILL."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, json, os, sys\n"
        f"f = open({str(folder / output_dir.LOCK)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        f"f.write(json.dumps({{'pid': os.getpid(), 'host': 'node-3', 'since': 'noon', 'output_dir': {output!r}}}))\n"
        "f.flush(); print('locked', flush=True); sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_checkpoint_folder_is_one_runs_while_it_runs_and_after(tmp_path):
    """Two output folders, one training.checkpoint_dir: the second start is refused by name while the first runs
    (its lock) and once the first has saved (its claim), whatever its settings; an unclaimed folder of checkpoints
    is no new run's either. A claimed folder without checkpoints and without a live run is taken over."""
    shared, first, second = tmp_path / "shared", tmp_path / "first", tmp_path / "second"
    with output_dir.Lock(first):
        output_dir.check(first, RUN, resume=False, checkpoint_dir=shared)
        assert json.loads((shared / output_dir.OWNER).read_text())["identity"] == RUN
        for identity in (RUN, OTHER):  # the same settings do not make it the same run
            with pytest.raises(ConfigError, match=f"training.checkpoint_dir '{shared}' is in use by a run that is "
                                                  f"still going \\(pid {os.getpid()} .*the run in {first}\\): give "
                                                  "this run a checkpoint folder of its own"):
                output_dir.check(second, identity, resume=False, checkpoint_dir=shared, record=False)
        config = SimpleNamespace(training=SimpleNamespace(checkpoint_dir=str(shared)))
        with pytest.raises(ConfigError, match="is in use by a run that is still going"):
            cli._claim(second, config, OTHER, False, cli.contextlib.ExitStack())
    _checkpoint(shared)
    output_dir.check(second, OTHER, resume=False, checkpoint_dir=tmp_path / "own")  # a run of its own...
    for resume in (False, True):  # ...that names the shared folder, to start over or to resume from
        with pytest.raises(ConfigError, match=f"'{shared}' holds checkpoints of the run in {first} \\(its claim: "
                                              r"\.distill-kit-owner\.json\): this run would prune them"):
            output_dir.check(second, OTHER, resume=resume, checkpoint_dir=shared, record=False)
    output_dir.check(first, RUN, resume=True, checkpoint_dir=shared)  # its own run resumes
    unclaimed = tmp_path / "unclaimed"
    _checkpoint(unclaimed)
    with pytest.raises(ConfigError, match=f"'{unclaimed}' holds checkpoints of another run \\(no claim names"):
        output_dir.check(tmp_path / "new", OTHER, resume=False, checkpoint_dir=unclaimed)
    assert not (tmp_path / "new").exists()  # refused before any write
    empty = tmp_path / "empty"
    output_dir.check(tmp_path / "third", RUN, resume=False, checkpoint_dir=empty)
    output_dir.check(second, OTHER, resume=False, checkpoint_dir=empty)  # the third saved nothing, and is gone
    assert json.loads((empty / output_dir.OWNER).read_text())["output_dir_absolute"] == os.path.realpath(second)


def test_a_run_folder_inside_another_runs_folder_is_refused(tmp_path):
    """Not only the same folder: a checkpoint folder inside another run's output (its default checkpoints/, before
    that run saved anything, or a cache folder in it) or inside another run's checkpoint folder, an output folder
    inside either, are refused; a checkpoint folder inside its own output folder is the default and fine."""
    first, second = tmp_path / "first", tmp_path / "second"
    output_dir.check(first, RUN, resume=False, checkpoint_dir=first / "checkpoints")
    for folder in (first / "checkpoints", first / ".cache" / "ckpt"):
        with pytest.raises(ConfigError, match=f"training.checkpoint_dir '{folder}' is inside {first}, the output "
                                              "folder of a run: its saves would prune"):
            output_dir.check(second, OTHER, resume=False, checkpoint_dir=folder)
    with pytest.raises(ConfigError, match=f"'{first}' is the output folder of a run"):
        output_dir.check(second, OTHER, resume=False, checkpoint_dir=first)
    with pytest.raises(ConfigError, match=f"'{first / 'checkpoints' / 'mine'}' is inside {first / 'checkpoints'}, "
                                          "the checkpoint folder of the run in"):
        output_dir.check(tmp_path / "third", OTHER, resume=False, checkpoint_dir=first / "checkpoints" / "mine")
    for inside in (first / "runs" / "b", first / "checkpoints" / "b"):
        with pytest.raises(ConfigError, match=f"output_dir '{inside}' is inside .*Give an output_dir outside it"):
            output_dir.check(inside, OTHER, resume=False, checkpoint_dir=tmp_path / "ckpt_b")
    assert not (second / output_dir.RUN_IDENTITY).exists() and not (tmp_path / "ckpt_b").exists()
    output_dir.check(first, RUN, resume=False, checkpoint_dir=first)  # checkpoints in the output folder itself


def test_a_run_moved_with_its_checkpoints_resumes(tmp_path):
    """The claim names the output folder relative to the checkpoint folder: the two moved together stay one run."""
    out = tmp_path / "a" / "out"
    output_dir.check(out, RUN, resume=False, checkpoint_dir=out / "checkpoints")
    _checkpoint(out / "checkpoints")
    moved = tmp_path / "b"
    (tmp_path / "a").rename(moved)
    output_dir.check(moved / "out", RUN, resume=True, checkpoint_dir=moved / "out" / "checkpoints")


class _Engine:
    """Writes one file the way DeepSpeed's engine does: under ``<dir>/<tag>``."""

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        (Path(save_dir) / tag).mkdir(parents=True)
        (Path(save_dir) / tag / "model_states.pt").write_bytes(b"weights")


def test_no_save_writes_or_clears_a_folder_another_run_writes(tmp_path):
    """A live process holds the checkpoint folder's lock (a run that claimed it, or a save of a Python-API run):
    its .partial-* is its save in progress, not a leftover; a save of this process into it is refused, writing
    nothing. Once that process is gone, the same .partial-* is a leftover and is cleared."""
    folder = tmp_path / "ckpt"
    in_progress = folder / ".partial-step_00000040"
    in_progress.mkdir(parents=True)
    holder = _hold(folder, output="/runs/other")
    try:
        checkpoint.remove_leftovers(folder)
        assert in_progress.is_dir()
        with pytest.raises(CheckpointError, match=f"checkpoint folder {folder} is in use by another run \\(pid "
                                                  f"{holder.pid} on host node-3, since noon, the run in /runs/other\\)"
                                                  ": nothing was written"):
            checkpoint.save(folder, _Engine(), step=40, trainer_state={}, rank_state={}, teacher_sha256=None,
                            keep_last=2)
        assert sorted(p.name for p in folder.iterdir()) == [".distill-kit.lock", in_progress.name]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    checkpoint.save(folder, _Engine(), step=41, trainer_state={}, rank_state={}, teacher_sha256=None, keep_last=2)
    assert sorted(p.name for p in folder.iterdir()) == [".distill-kit.lock", "step_00000041"]

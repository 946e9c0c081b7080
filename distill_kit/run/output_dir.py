"""The output folder's identity: which run it holds, who is running in it now, and what its data was.

A CLI run owns its output folder for as long as it runs. Three things make that hold:

* **the lock** (:class:`Lock`): rank 0 holds an exclusive ``fcntl.flock`` on ``<output_dir>/.distill-kit.lock``
  from the claim to the end of the run. The operating system drops it when the process dies, however it dies
  (SIGKILL, out of memory, a lost node), so a stale lock never blocks a resume; a second start while the first
  is alive is refused naming the other run's pid and host, before it touches anything (a second start used to
  delete the first run's in-progress ``.partial-step_*`` save as a "leftover"). Leftovers are cleared only
  under the lock.
* **the identity** (``run_identity.json``, :func:`check`): the settings that must not change across a resume. A
  folder whose identity differs *and that holds a checkpoint* is another run and is refused; one without a
  checkpoint holds nothing worth keeping (a start that failed before its first save) and is taken over, so that
  a failed start never blocks the same command, fixed.
* **the data's fingerprint** (``data_fingerprint.json``, :func:`data_changes`): the sha256 of every local data
  file's content, recorded at the claim. A resume on changed data would continue from a data position that means
  other text; it is refused, naming the file.

This is the CLI's concern, not the checkpoints': ``training/checkpoint.py`` writes and reads checkpoints only.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distill_kit.errors import ConfigError
from distill_kit.training import checkpoint

logger = logging.getLogger(__name__)

RUN_IDENTITY = "run_identity.json"
DATA_FINGERPRINT = "data_fingerprint.json"
LOCK = ".distill-kit.lock"
MANIFEST = "manifest.json"  # a complete checkpoint's last file (training/checkpoint.py)
DERIVED = ("init", "vocab_map.json")
"""What a start writes from its identity before training (students built from the teacher's config, the
cross-tokenizer map): removed when a folder is taken over, so that a new identity never reuses them."""
HASH_CHUNK = 1 << 24


# ---- the lock -------------------------------------------------------------------------------------------


def _holder(handle: Any) -> str:
    """Who holds the lock, in words, from what it wrote into the lock file."""
    try:
        handle.seek(0)
        record = json.loads(handle.read() or "{}")
    except (OSError, ValueError):
        record = {}
    if not record:
        return "another process"
    return f"pid {record.get('pid')} on host {record.get('host')}, since {record.get('since')}"


def _refusal(directory: Path, holder: str) -> ConfigError:
    return ConfigError(f"output_dir {str(directory)!r} is in use by a run that is still going ({holder}): wait for "
                       "it to finish or stop it (it saves a checkpoint on SIGTERM) before resuming, or give another "
                       "--output_dir")


def in_use(directory: str | Path) -> str | None:
    """Why ``directory`` cannot be claimed now (a live run holds its lock), or None. Creates nothing: a check
    before the claim. The answer can change at once; :class:`Lock` is what decides."""
    path = Path(directory) / LOCK
    try:
        handle = path.open("r+")
    except OSError:  # no lock file (or unreadable: the claim will say so)
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return str(_refusal(Path(directory), _holder(handle)))
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


class Lock:
    """An exclusive lock on the output folder, held from :meth:`acquire` to :meth:`release` (or the process's
    death: the OS releases a ``flock`` with its file). The lock file stays: deleting it would let a third start
    lock a new file while the second still holds the old one."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.handle: Any = None

    def acquire(self) -> Lock:
        self.directory.mkdir(parents=True, exist_ok=True)
        handle = (self.directory / LOCK).open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(handle)
            handle.close()
            raise _refusal(self.directory, holder) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
        handle.flush()
        self.handle = handle
        return self

    def release(self) -> None:
        if self.handle is not None:
            self.handle.seek(0)
            self.handle.truncate()  # no holder named while no one holds it
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---- the identity ---------------------------------------------------------------------------------------


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def has_checkpoint(directory: str | Path, checkpoint_dir: str | Path | None = None) -> bool:
    """Whether the run's folders hold a complete checkpoint's manifest: the only thing a start cannot redo."""
    folders = [Path(directory)] + ([Path(checkpoint_dir)] if checkpoint_dir is not None else [])
    return any(folder.is_dir() and any(folder.rglob(MANIFEST)) for folder in folders)


def _ours(entry: Path) -> bool:
    return entry.name == LOCK


def check(directory: str | Path, run_identity: Mapping[str, Any], *, resume: bool,
          checkpoint_dir: str | Path | None = None, record: bool = True) -> None:
    """Refuse an output folder that holds another run's checkpoints; record this run's identity.

    ``run_identity`` is what must not change across a resume (the run config without logging settings). A folder
    with the same identity is accepted when resuming, and when not resuming as long as it holds no checkpoint
    (starting over would mix two runs' checkpoints). A folder with another identity but no checkpoint is taken
    over (its identity-derived files, :data:`DERIVED`, removed). ``resume`` in a folder that holds no run is an
    error. With ``record=False`` nothing is written or removed (a check before the claim). Call it on rank 0, under
    the :class:`Lock` when recording.
    """
    directory = Path(directory)
    identity = json.loads(json.dumps(run_identity, default=str))  # as it will read back from disk
    path = directory / RUN_IDENTITY
    checkpointed = has_checkpoint(directory, checkpoint_dir)
    if path.is_file():
        saved, current = _flatten(json.loads(path.read_text())), _flatten(identity)
        changed = [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
                   for key in sorted(saved.keys() | current.keys()) if saved.get(key) != current.get(key)]
        if changed and (checkpointed or resume):
            raise ConfigError(
                f"output directory {directory} holds another run ({'; '.join(changed)}). Choose a new output "
                "directory, or put those settings back to resume that run."
            )
        if not changed:
            if not resume and checkpointed:
                raise ConfigError(
                    f"output directory {directory} holds checkpoints of this run: resume it (--resume), or choose "
                    "a new output directory to start over."
                )
            return
        if not record:
            return
        logger.warning("output directory %s holds a start of another run that saved no checkpoint (%s): taking it "
                       "over", directory, "; ".join(changed))
        for name in DERIVED:
            derived = directory / name
            if derived.is_dir():
                shutil.rmtree(derived)
            elif derived.exists():
                derived.unlink()
        checkpoint.write_atomic(path, json.dumps(identity, indent=1, sort_keys=True))
        return
    if resume:
        raise ConfigError(
            f"--resume: output directory {directory} holds no run to resume (no {RUN_IDENTITY}). Give the stopped "
            "run's output_dir, or leave out --resume to start a new run."
        )
    if directory.is_dir() and any(not _ours(entry) for entry in directory.iterdir()):
        raise ConfigError(
            f"output directory {directory} is not empty and holds no {RUN_IDENTITY}: it is not a distill-kit run. "
            "Choose an empty or new output directory."
        )
    if not record:
        return
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint.write_atomic(path, json.dumps(identity, indent=1, sort_keys=True))


# ---- the data -------------------------------------------------------------------------------------------


def data_fingerprint(splits: Mapping[str, str | Sequence[str] | None]) -> dict[str, dict[str, str]]:
    """``{"data.train": {file: sha256}, ...}`` over the local files of each split: their content, not their paths'
    times, so the same bytes copied elsewhere match and any changed byte does not. A hub dataset (no local file)
    has no entry: its revision is the hub's to pin."""
    prints: dict[str, dict[str, str]] = {}
    for key, files in splits.items():
        paths = [files] if isinstance(files, str) else list(files or [])
        local = [Path(p) for p in paths if Path(p).is_file()]
        if local:
            prints[key] = {str(p): checkpoint.file_sha256(p) for p in local}
    return prints


def record_data(directory: str | Path, fingerprint: Mapping[str, Any]) -> None:
    checkpoint.write_atomic(Path(directory) / DATA_FINGERPRINT, json.dumps(fingerprint, indent=1, sort_keys=True))


def data_changes(directory: str | Path, fingerprint: Mapping[str, Mapping[str, str]]) -> list[str]:
    """How the data differs from what the run in ``directory`` started on, one line per split (none when the same,
    or when the run recorded no fingerprint: a folder of an older version)."""
    path = Path(directory) / DATA_FINGERPRINT
    if not path.is_file():
        return []
    saved = json.loads(path.read_text())
    problems = []
    for key in sorted(saved.keys() | fingerprint.keys()):
        before, now = saved.get(key, {}), fingerprint.get(key, {})
        if before == now:
            continue
        changed = sorted(f for f in before.keys() | now.keys() if before.get(f) != now.get(f))
        problems.append(f"{key}: the content of {', '.join(changed)} differs from what the run in {directory} "
                        "started on (sha256 in data_fingerprint.json): the checkpoint's data position would point "
                        "into other text. Put the data back as it was to resume, or start a new run in another "
                        "output_dir")
    return problems

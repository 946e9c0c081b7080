"""The output folder's identity: which run it holds, who is running in it now, and what its data was.

A CLI run owns its output folder for as long as it runs. Three things make that hold:

* **the lock** (:class:`Lock`): rank 0 holds an exclusive ``fcntl.flock`` on ``<output_dir>/.distill-kit.lock``
  from the claim to the end of the run. The operating system drops it when the process dies, however it dies
  (SIGKILL, out of memory, a lost node), so a stale lock never blocks a resume; a second start while the first
  is alive is refused naming the other run's pid and host, before it touches anything (a second start used to
  delete the first run's in-progress ``.partial-step_*`` save as a "leftover"). Leftovers are cleared only
  under the lock. The run's checkpoint folder is claimed with it (:func:`check`): its lock is held too, and a claim
  file (:data:`OWNER`) names the run, so two runs never share one, at the same time or one after the other.
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

import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distill_kit.errors import ConfigError
from distill_kit.training import checkpoint

logger = logging.getLogger(__name__)

RUN_IDENTITY = "run_identity.json"
DATA_FINGERPRINT = "data_fingerprint.json"
LOCK = checkpoint.LOCK
OWNER = ".distill-kit-owner.json"
"""In a run's checkpoint folder: which output folder (relative to it, so the two move together) and identity
it belongs to."""
MANIFEST = "manifest.json"  # a complete checkpoint's last file (training/checkpoint.py)
DERIVED = ("init", "vocab_map.json")
"""What a start writes from its identity before training (students built from the teacher's config, the
cross-tokenizer map): removed when a folder is taken over, so that a new identity never reuses them."""
HASH_CHUNK = 1 << 24


# ---- the lock -------------------------------------------------------------------------------------------


def _refusal(directory: Path, holder: str) -> ConfigError:
    return ConfigError(f"output_dir {str(directory)!r} is in use by a run that is still going ({holder}): wait for "
                       "it to finish or stop it (it saves a checkpoint on SIGTERM) before resuming, or give another "
                       "--output_dir")


def in_use(directory: str | Path) -> str | None:
    """Why ``directory`` cannot be claimed now (a live run holds its lock), or None. Creates nothing: a check
    before the claim. The answer can change at once; :class:`Lock` is what decides."""
    holder = checkpoint.probe(directory)
    return None if holder is None else str(_refusal(Path(directory), holder))


_LOCKS: dict[str, Lock] = {}
"""The output folders this process holds, by real path: :func:`check` adds the run's other folders to their claim."""


class Lock:
    """An exclusive lock on the output folder, held from :meth:`acquire` to :meth:`release` (or the process's
    death: the OS releases a ``flock`` with its file), and on every other folder the run writes that :func:`check`
    claims while it is held (the checkpoint folder). The lock files stay: deleting one would let a third start
    lock a new file while the second still holds the old one."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.handle: Any = None
        self.claimed: dict[str, Any] = {}  # the run's other folders: real path -> their lock file

    def acquire(self) -> Lock:
        handle, holder = checkpoint.try_lock(self.directory)
        if handle is None:
            raise _refusal(self.directory, holder or "another process") from None
        self.handle = handle
        key = os.path.realpath(self.directory)
        checkpoint._HELD[key], _LOCKS[key] = handle, self
        return self

    def claim(self, directory: Path, key: str) -> None:
        """Hold ``directory``'s lock too, until :meth:`release`; ``key`` names it in the refusal."""
        real = os.path.realpath(directory)
        if real in checkpoint._HELD:  # the output folder itself, or claimed already
            return
        handle, holder = checkpoint.try_lock(directory, {"output_dir": str(self.directory.absolute())})
        if handle is None:
            raise ConfigError(f"{key} {str(directory)!r} is in use by a run that is still going ({holder}): give "
                              f"this run its own {key}")
        checkpoint._HELD[real] = self.claimed[real] = handle

    def release(self) -> None:
        for real, handle in self.claimed.items():
            checkpoint._HELD.pop(real, None)
            checkpoint.unlock(handle)
        self.claimed = {}
        if self.handle is not None:
            key = os.path.realpath(self.directory)
            checkpoint._HELD.pop(key, None)
            _LOCKS.pop(key, None)
            checkpoint.unlock(self.handle)
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
    return entry.name in (LOCK, OWNER)


def _changes(saved: Mapping[str, Any], identity: Mapping[str, Any]) -> list[str]:
    saved, current = _flatten(saved), _flatten(identity)
    return [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
            for key in sorted(saved.keys() | current.keys()) if saved.get(key) != current.get(key)]


def _owner(folder: Path) -> dict[str, Any] | None:
    """The claim in a checkpoint folder (:data:`OWNER`), its output folder resolved; None when it has none."""
    if not (folder / OWNER).is_file():  # no claim (or ``folder`` is no folder at all: a file on the path)
        return None
    try:
        owner = json.loads((folder / OWNER).read_text())
        owner["resolved"] = os.path.realpath(folder / owner["output_dir"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return {"output_dir": "?", "resolved": "an unreadable claim", "identity": None}
    return owner


def _a_run(folder: Path) -> str | None:
    """Whose folder ``folder`` is: ``"the output folder of a run"`` or ``"the checkpoint folder of the run in X"``;
    None when it is no run's."""
    if (folder / RUN_IDENTITY).is_file():
        return "the output folder of a run"
    owner = _owner(folder)
    if owner is not None:
        return f"the checkpoint folder of the run in {owner['resolved']}"
    return None


def folder_problems(directory: str | Path, identity: Mapping[str, Any], *, resume: bool,
                    checkpoint_dir: str | Path | None) -> list[str]:
    """Why the run of ``directory`` (``identity``) may not write where it would, each with its fix: its output
    folder inside another run's folder; its checkpoint folder inside another run's folder, claimed by another run
    (another output folder, or another identity) that still runs or holds checkpoints there, or holding
    checkpoints no claim names while this is a new start. Reads only."""
    directory = Path(directory)
    out = os.path.realpath(directory)
    problems = []
    for parent in Path(out).parents:
        whose = _a_run(parent)
        if whose is not None:
            problems.append(f"output_dir {str(directory)!r} is inside {parent}, {whose}: that run's saves and "
                            "clean-ups would meet this one's. Give an output_dir outside it")
            break
    if checkpoint_dir is None:
        return problems
    folder = Path(checkpoint_dir)
    real = Path(os.path.realpath(folder))
    key, fix = "training.checkpoint_dir", ("give this run a checkpoint folder of its own (or leave training."
                                           "checkpoint_dir out: <output_dir>/checkpoints)")
    for parent in [real, *real.parents]:
        if str(parent) == out:  # inside this run's output folder (checked above)
            break
        whose = None if parent == real and not (parent / RUN_IDENTITY).is_file() else _a_run(parent)
        if whose is not None:
            here = "is" if parent == real else f"is inside {parent},"
            return problems + [f"{key} {str(folder)!r} {here} {whose}: its saves would prune, clear and resume "
                               f"that run's checkpoints. {fix[0].upper()}{fix[1:]}"]
    owner = _owner(real)
    own = owner is not None and owner["resolved"] == out
    if owner is not None and own and owner.get("identity") not in (None, identity) and has_checkpoint(real):
        changed = "; ".join(_changes(owner["identity"], identity))
        return problems + [f"{key} {str(folder)!r} holds checkpoints of another run in this output folder "
                           f"({changed}): {fix}, or put those settings back to resume that run"]
    lock = _LOCKS.get(out)  # this run's own claims (under its Lock) are not another run's
    mine = lock is not None and (str(real) == out or str(real) in lock.claimed)
    busy = None if mine else checkpoint.probe(real)
    if busy is not None and not own:
        return problems + [f"{key} {str(folder)!r} is in use by a run that is still going ({busy}): {fix}"]
    if owner is not None and not own and has_checkpoint(real):
        return problems + [f"{key} {str(folder)!r} holds checkpoints of the run in {owner['resolved']} (its claim: "
                           f"{OWNER}): this run would prune them, and --resume would load them as its own. {fix}"]
    if owner is None and not resume and has_checkpoint(real) and not (directory / RUN_IDENTITY).is_file():
        return problems + [f"{key} {str(folder)!r} holds checkpoints of another run (no claim names this run's "
                           f"output_dir): a new run would prune them, and --resume would load them as its own. {fix}"]
    return problems


def _claim_checkpoints(directory: Path, identity: Mapping[str, Any], checkpoint_dir: Path) -> None:
    """Write the claim into the checkpoint folder and, under this process's :class:`Lock` of ``directory``, hold
    the folder's lock too until the run ends."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    lock = _LOCKS.get(os.path.realpath(directory))
    if lock is not None:
        lock.claim(checkpoint_dir, "training.checkpoint_dir")
    claim = {"output_dir": os.path.relpath(os.path.realpath(directory), os.path.realpath(checkpoint_dir)),
             "output_dir_absolute": os.path.realpath(directory), "identity": identity}
    checkpoint.write_atomic(checkpoint_dir / OWNER, json.dumps(claim, indent=1, sort_keys=True))


def check(directory: str | Path, run_identity: Mapping[str, Any], *, resume: bool,
          checkpoint_dir: str | Path | None = None, record: bool = True) -> None:
    """Refuse an output folder that holds another run's checkpoints; record this run's identity.

    ``run_identity`` is what must not change across a resume (the run config without logging settings). A folder
    with the same identity is accepted when resuming, and when not resuming as long as it holds no checkpoint
    (starting over would mix two runs' checkpoints). A folder with another identity but no checkpoint is taken
    over (its identity-derived files, :data:`DERIVED`, removed). ``resume`` in a folder that holds no run is an
    error. With ``record=False`` nothing is written or removed (a check before the claim). Call it on rank 0, under
    the :class:`Lock` when recording.

    The checkpoint folder is the run's too (:func:`folder_problems`): recording writes the run's claim into it
    (:data:`OWNER`) and, under the :class:`Lock`, holds its lock until the run ends, so another run that names it
    is refused by name, and no save of another run clears this one's save in progress as a leftover.
    """
    directory = Path(directory)
    identity = json.loads(json.dumps(run_identity, default=str))  # as it will read back from disk
    problems = folder_problems(directory, identity, resume=resume, checkpoint_dir=checkpoint_dir)
    claim = _owner(Path(checkpoint_dir)) if checkpoint_dir is not None else None
    if claim is None or claim.get("resolved") == os.path.realpath(directory):
        # its own checkpoint folder (or an unclaimed one): the output folder's verdict names what changed
        _check_output(directory, identity, resume=resume, checkpoint_dir=checkpoint_dir, record=False)
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems:\n" + "\n".join(f"- {p}" for p in problems))
    if not record:
        return
    _check_output(directory, identity, resume=resume, checkpoint_dir=checkpoint_dir, record=True)
    if checkpoint_dir is not None:
        _claim_checkpoints(directory, identity, Path(checkpoint_dir))


def _check_output(directory: Path, identity: Mapping[str, Any], *, resume: bool,
                  checkpoint_dir: str | Path | None, record: bool) -> None:
    """:func:`check` of the output folder itself."""
    path = directory / RUN_IDENTITY
    checkpointed = has_checkpoint(directory, checkpoint_dir)
    if path.is_file():
        changed = _changes(json.loads(path.read_text()), identity)
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
        changed = sorted(f for f in before.keys() | now.keys() if before.get(f) != now.get(f) and Path(f).exists())
        if not changed:  # only files that are gone: the data check names each missing file, once
            continue
        problems.append(f"{key}: the content of {', '.join(changed)} differs from what the run in {directory} "
                        "started on (sha256 in data_fingerprint.json): the checkpoint's data position would point "
                        "into other text. Put the data back as it was to resume, or start a new run in another "
                        "output_dir")
    return problems

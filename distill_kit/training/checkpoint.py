"""Checkpoints that are written atomically, verified before loading, and continue a run exactly.

DeepSpeed's ``save_checkpoint`` keeps the student engine: weights, optimizer and scheduler state, and the loss
module's parameters (they live inside the engine). Continuing *exactly* needs what it does not keep: the step,
the log history, every rank's data position and random generators (Python, NumPy, torch CPU and accelerator),
and the identity of the teacher the student was trained against. Layout of a checkpoint directory::

    step_00000100/              one complete checkpoint
        deepspeed/...           the engine's files (DeepSpeed tag "deepspeed"); a group's: <name>/... each
        rank00000.pt, ...       each rank's random generators and data position
        trainer_state.json      step, history, counters
        manifest.json           written last: each file's size and sha256, the step, world size, teacher hash,
                                the engines' folders
    .partial-step_00000110/     a save in progress, or what a killed process left behind

Every rank writes into ``.partial-step_N``; after a barrier rank 0 hashes the files into the manifest and renames
the directory to ``step_N`` (one atomic rename), then deletes the oldest beyond ``keep_last``. A process killed at
any moment therefore leaves the previous checkpoints untouched, and one whose manifest is missing or does not match
its files is skipped with a warning, never loaded. All ranks must reach the same directory (a shared filesystem,
which DeepSpeed's own resume of sharded optimizer states needs anyway).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

from distill_kit.engines import distributed, peft_student

logger = logging.getLogger(__name__)

PREFIX = "step_"
PARTIAL = ".partial-"
DELETING = ".deleting-"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
DEEPSPEED_TAG = "deepspeed"
RUN_IDENTITY = "run_identity.json"
FORMAT = 1
HASH_CHUNK = 1 << 24  # bytes read at a time when hashing: bounds memory for multi-GB shards
Engines = deepspeed.DeepSpeedEngine | Mapping[str, deepspeed.DeepSpeedEngine]
"""One engine (kept in ``deepspeed/``), or several, each kept in the folder it is keyed by."""


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _by_folder(engines: Engines) -> dict[str, deepspeed.DeepSpeedEngine]:
    """Engines by the folder each is kept in; a folder may not take the name of a checkpoint's own files."""
    engines = dict(engines) if isinstance(engines, Mapping) else {DEEPSPEED_TAG: engines}
    clashing = [name for name in engines
                if name in (MANIFEST, TRAINER_STATE) or (name.startswith("rank") and name.endswith(".pt"))]
    if clashing:
        raise ValueError(f"models named {clashing} would clash with a checkpoint's own files; rename them")
    return engines


def _frozen_bases(engines: Mapping[str, deepspeed.DeepSpeedEngine]) -> dict[str, str]:
    """The sha256 of each PEFT student's frozen base, by folder: its checkpoint holds only the adapters."""
    return {folder: peft_student.frozen_parameters_sha256(engine.module)
            for folder, engine in engines.items() if _is_peft(engine)}


def _is_peft(engine: deepspeed.DeepSpeedEngine) -> bool:
    return peft_student.is_peft(getattr(engine, "module", engine))


def _step_of(path: Path) -> int | None:
    suffix = path.name[len(PREFIX):]
    return int(suffix) if path.name.startswith(PREFIX) and suffix.isdigit() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    """Write-then-rename, flushed to disk: a reader sees the whole file or none."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (the directory entry itself is data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Rename first, then delete: a delete killed half-way leaves no half checkpoint under a ``step_`` name."""
    doomed = path.with_name(DELETING + path.name)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


# ---- what DeepSpeed does not keep ------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """This rank's random generators: dropout masks and any sampling continue as if never interrupted."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state:
        get_accelerator().set_rng_state(state["accelerator"])


def teacher_fingerprint(teacher: nn.Module) -> str:
    """sha256 of the teacher's weights (names, shapes, dtypes, values), the same on every rank.

    Independent of the ZeRO layout and world size: each parameter is gathered whole in turn (one at a time, so
    memory stays at one layer's weights), and the hashing is spread round-robin over the ranks. Call it on every
    rank: the gathers are collectives. A teacher without weights (outputs read from a store) names itself with
    a ``teacher_sha256`` attribute instead.
    """
    module = getattr(teacher, "module", teacher)  # a DeepSpeed engine wraps the model
    if isinstance(getattr(module, "teacher_sha256", None), str):
        return module.teacher_sha256
    rank, world = distributed.rank(), distributed.world_size()
    mine: dict[int, str] = {}
    for index, (name, param) in enumerate(module.named_parameters()):
        with deepspeed.zero.GatheredParameters([param]):
            if index % world == rank:
                values = param.detach().cpu().contiguous().reshape(-1)
                digest = hashlib.sha256(f"{name}|{tuple(param.shape)}|{values.dtype}|".encode())
                digest.update(values.view(torch.uint8).numpy().tobytes())
                mine[index] = digest.hexdigest()
    merged: dict[int, str] = {}
    for part in distributed.all_gather_object(mine):
        merged.update(part)
    return hashlib.sha256("".join(merged[i] for i in sorted(merged)).encode()).hexdigest()


# ---- writing ---------------------------------------------------------------------------------------------


def save(
    directory: str | Path,
    engines: Engines,
    *,
    step: int,
    trainer_state: Mapping[str, Any],
    rank_state: Mapping[str, Any],
    teacher_sha256: str | None,
    keep_last: int,
) -> Path:
    """Write ``<directory>/step_<step>`` atomically; every rank calls this (the engines' saves are collective).

    ``engines`` is one engine or several by name (a group's models: each engine in ``<name>/``, one manifest for
    all). ``rank_state`` is this rank's own (random generators, data position); ``trainer_state`` is rank 0's;
    ``teacher_sha256`` is None for models trained without a teacher. A
    complete checkpoint of the same step is kept rather than rewritten: that happens only when steps were
    skipped since, and resuming from it replays those skips identically.
    """
    directory, engines = Path(directory), _by_folder(engines)
    final = directory / checkpoint_name(step)
    partial = directory / (PARTIAL + final.name)
    keep = False
    if distributed.is_main():
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in [*directory.glob(PARTIAL + "*"), *directory.glob(DELETING + "*")]:
            shutil.rmtree(leftover)
        if final.exists():
            keep = verify(final) is None
            if not keep:
                _remove(final)
    if distributed.broadcast_object(keep):
        return final
    for folder, engine in engines.items():  # a PEFT student's frozen base is not saved: its sha256 is, below
        adapters_only = {"exclude_frozen_parameters": True} if _is_peft(engine) else {}
        engine.save_checkpoint(str(partial), tag=folder, save_latest=False, **adapters_only)
    frozen = _frozen_bases(engines)
    partial.mkdir(parents=True, exist_ok=True)
    torch.save(dict(rank_state), partial / _rank_file(distributed.rank()))
    distributed.barrier()  # every rank's files are on disk
    if distributed.is_main():
        (partial / TRAINER_STATE).write_text(json.dumps(trainer_state))
        files = sorted(p for p in partial.rglob("*") if p.is_file())
        manifest = {
            "format": FORMAT, "step": step, "world_size": distributed.world_size(), "teacher_sha256": teacher_sha256,
            "models": sorted(engines), **({"frozen_base_sha256": frozen} if frozen else {}),
            "files": {str(p.relative_to(partial)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
        }
        _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1))
        os.replace(partial, final)
        _fsync_dir(directory)
        _prune(directory, keep_last)
    distributed.barrier()  # no rank runs ahead of a checkpoint that is not yet in place
    return final


def _prune(directory: Path, keep_last: int) -> None:
    """Delete complete checkpoints older than the newest ``keep_last``; incomplete ones are left to inspect."""
    complete = sorted((p for p in directory.iterdir() if _step_of(p) is not None and (p / MANIFEST).is_file()),
                      key=_step_of)
    for old in complete[:-keep_last]:
        _remove(old)


# ---- finding and reading ---------------------------------------------------------------------------------


def verify(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` must not be loaded, or None when every file matches its manifest."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return "it has no manifest (its save did not finish)"
    except (ValueError, KeyError, TypeError) as err:
        return f"its manifest is unreadable ({err})"
    for relative, expected in files.items():  # sizes first: cheap, and catch truncation
        file = path / relative
        if not file.is_file():
            return f"{relative} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{relative} has {file.stat().st_size} bytes, the manifest says {expected['bytes']}"
    for relative, expected in files.items():
        if _sha256(path / relative) != expected["sha256"]:
            return f"{relative} does not match its sha256 in the manifest"
    return None


def latest_complete(directory: str | Path) -> Path | None:
    """The newest checkpoint under ``directory`` whose files all match its manifest; None if there is none.

    Incomplete or corrupt ones are skipped with a warning (never loaded), so a save killed half-way costs only
    the steps since the previous checkpoint.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for leftover in sorted(directory.glob(PARTIAL + "*")):
        logger.warning("ignoring %s: a save that did not finish", leftover)
    for path in sorted((p for p in directory.iterdir() if _step_of(p) is not None), key=_step_of, reverse=True):
        reason = verify(path)
        if reason is None:
            return path
        logger.warning("skipping checkpoint %s: %s", path, reason)
    return None


def load(
    path: str | Path, engines: Engines, *, teacher_sha256: str | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load the engines (as :func:`save` took them) from the checkpoint at ``path``; returns (trainer state,
    this rank's state).

    Every rank calls this. It refuses a checkpoint of other models, trained against another teacher or on another
    number of ranks (each rank's data position and generators belong to its rank) before anything is loaded.
    """
    path, engines = Path(path), _by_folder(engines)
    manifest = json.loads((path / MANIFEST).read_text())
    saved_models = manifest.get("models", [DEEPSPEED_TAG])
    if saved_models != sorted(engines):
        raise ValueError(
            f"checkpoint {path} holds the models {saved_models}, but this run trains {sorted(engines)} "
            "(a single Distiller's is 'deepspeed'). Resume it with the models it was saved with."
        )
    if manifest["teacher_sha256"] != teacher_sha256:
        raise ValueError(
            f"checkpoint {path} was trained against teacher sha256 {manifest['teacher_sha256']}, but this run's "
            f"teacher is sha256 {teacher_sha256}. Resume with the teacher it was trained against, or start a new "
            "run in another output directory."
        )
    if manifest["world_size"] != distributed.world_size():
        raise ValueError(
            f"checkpoint {path} was written by {manifest['world_size']} ranks; this run has "
            f"{distributed.world_size()}. Resume on {manifest['world_size']} ranks: each rank's data position "
            "and random generators are its own."
        )
    frozen = _frozen_bases(engines)
    if manifest.get("frozen_base_sha256", {}) != frozen:
        raise ValueError(
            f"checkpoint {path} holds adapters trained on frozen base weights with sha256 "
            f"{manifest.get('frozen_base_sha256', {})}, but this run's are {frozen}. Resume with the student model "
            "(and peft settings) the run was started with."
        )
    for folder, engine in engines.items():
        loaded, _ = engine.load_checkpoint(str(path), tag=folder,
                                           **({"load_module_strict": False} if folder in frozen else {}))
        if loaded is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {path / folder}")
    trainer_state = json.loads((path / TRAINER_STATE).read_text())
    rank_state = torch.load(path / _rank_file(distributed.rank()), weights_only=False)
    return trainer_state, rank_state


# ---- the output directory --------------------------------------------------------------------------------


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_output_dir(directory: str | Path, run_identity: Mapping[str, Any], *, resume: bool) -> None:
    """Refuse an output directory that holds another run; record this run's identity in a new one.

    ``run_identity`` is what must not change across a resume (e.g. the run config without logging settings);
    it is stored as ``run_identity.json``. A directory with the same identity is accepted when resuming, and
    also when not resuming as long as it holds no checkpoint (starting over would mix two runs' checkpoints).
    Call it on rank 0 before training, then barrier.
    """
    directory = Path(directory)
    identity = json.loads(json.dumps(run_identity, default=str))  # as it will read back from disk
    path = directory / RUN_IDENTITY
    if path.is_file():
        saved, current = _flatten(json.loads(path.read_text())), _flatten(identity)
        changed = [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
                   for key in sorted(saved.keys() | current.keys()) if saved.get(key) != current.get(key)]
        if changed:
            raise ValueError(
                f"output directory {directory} holds another run ({'; '.join(changed)}). Choose a new output "
                "directory, or put those settings back to resume that run."
            )
        if not resume and any(directory.rglob(MANIFEST)):
            raise ValueError(
                f"output directory {directory} holds checkpoints of this run: resume it (--resume), or choose a "
                "new output directory to start over."
            )
        return
    if directory.is_dir() and any(directory.iterdir()):
        raise ValueError(
            f"output directory {directory} is not empty and holds no {RUN_IDENTITY}: it is not a distill-kit run. "
            "Choose an empty or new output directory."
        )
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps(identity, indent=1, sort_keys=True))

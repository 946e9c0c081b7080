"""Checkpoints that are written atomically, verified before loading, and continue a run exactly.

DeepSpeed's ``save_checkpoint`` keeps the student engine: weights, optimizer and scheduler state, and the loss
module's parameters (they live inside the engine). Continuing *exactly* needs what it does not keep: the step,
the log history, every rank's data position and random generators (Python, NumPy, torch CPU and accelerator),
and the identity of the teacher the student was trained against. Layout of a checkpoint directory::

    step_00000100/              one complete checkpoint
        deepspeed/...           the engine's files (DeepSpeed tag "deepspeed"); a group's: <name>/... each
        rank00000.json, ...     each rank's random generators and data position; its tensors (the torch and
        rank00000.safetensors   accelerator generators) in safetensors: nothing in a run's state can run code
        trainer_state.json      step, history, counters
        manifest.json           written last: each file's size and sha256, the step, world size, teacher hash,
                                the engines' folders
    .partial-step_00000110/     a save in progress, or what a killed process left behind

Every rank writes into ``.partial-step_N``; after a barrier rank 0 hashes the files into the manifest and renames
the directory to ``step_N`` (one atomic rename), then deletes verified checkpoints older than the newest
``keep_last`` verified ones (a corrupt one never takes a slot, and is left to inspect). A process killed at
any moment therefore leaves the previous checkpoints untouched, and one whose manifest is missing or does not match
its files is skipped with a warning, never loaded. All ranks must reach the same directory (a shared filesystem,
which DeepSpeed's own resume of sharded optimizer states needs anyway).

Trust: this module writes and reads its own state only as JSON and safetensors, which cannot execute code when
loaded (a checkpoint of the older pickle format is read with ``torch.load(weights_only=True)``). The engines' own
files under ``deepspeed/`` (or ``<name>/``) are DeepSpeed's pickles, which DeepSpeed 0.19 reads with
``torch.load(weights_only=False)``; :func:`load` swaps that for ``weights_only=True`` allowing only the plain
types of ``safe_load.DEEPSPEED_GLOBALS`` (``training/safe_load.py``). What still needs trust: docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import safetensors.torch
import torch
from deepspeed.accelerator import get_accelerator

from distill_kit.engines import distributed, peft_student
from distill_kit.errors import CheckpointError
from distill_kit.training import safe_load

logger = logging.getLogger(__name__)

PREFIX = "step_"
PARTIAL = ".partial-"
DELETING = ".deleting-"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
DEEPSPEED_TAG = "deepspeed"
FORMAT = 2
"""2: each rank's state as JSON + safetensors. 1: as a pickle (``rank*.pt``), read only with weights_only."""
TENSOR = "__tensor__"  # a rank state's JSON names a tensor kept in its safetensors file so
FULL_DISK_BYTES = 16 << 20  # below this a failed write is a full disk, whatever the writer said
HASH_CHUNK = 1 << 24  # bytes read at a time when hashing: bounds memory for multi-GB shards
LOCK = ".distill-kit.lock"
"""A folder's lock file: whoever holds its ``flock`` writes into the folder (a run's output or checkpoint folder)."""
Engines = deepspeed.DeepSpeedEngine | Mapping[str, deepspeed.DeepSpeedEngine]
"""One engine (kept in ``deepspeed/``), or several, each kept in the folder it is keyed by."""


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _rank_file(rank: int, suffix: str = ".json") -> str:
    return f"rank{rank:05d}{suffix}"


def _by_folder(engines: Engines) -> dict[str, deepspeed.DeepSpeedEngine]:
    """Engines by the folder each is kept in; a folder may not take the name of a checkpoint's own files."""
    engines = dict(engines) if isinstance(engines, Mapping) else {DEEPSPEED_TAG: engines}
    clashing = [name for name in engines
                if name in (MANIFEST, TRAINER_STATE) or (name.startswith("rank") and name.endswith((".pt", ".json",
                                                                                              ".safetensors")))]
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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, text: str) -> None:
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
    """This rank's random generators: dropout masks and any sampling continue as if never interrupted.

    Plain values and tensors only (see :func:`_encode`), so that the state can be stored without pickle.
    """
    version, internal, gauss_next = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": [version, list(internal), gauss_next],
             "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached_gaussian)],
             "torch": torch.get_rng_state()}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "accelerator" in state:
        get_accelerator().set_rng_state(state["accelerator"])


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """``value`` as JSON, its tensors moved to ``tensors`` (and named in the JSON): no pickle, so nothing a
    run directory holds can run code when it is read back. Tuples come back as lists."""
    if torch.is_tensor(value):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous()
        return {TENSOR: name}
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"rank state {where or '.'}: keys must be strings to be stored as JSON")
        return {key: _encode(item, tensors, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(item, tensors, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"rank state {where or '.'}: a {type(value).__name__} cannot be stored safely; "
                    "keep rank states to JSON values and tensors")


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {TENSOR}:
            return tensors[value[TENSOR]]
        return {key: _decode(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    return value


def _write_rank_state(directory: Path, rank: int, state: Mapping[str, Any]) -> None:
    tensors: dict[str, torch.Tensor] = {}
    encoded = json.dumps(_encode(state, tensors, ""))
    safetensors.torch.save_file(tensors, str(directory / _rank_file(rank, ".safetensors")))
    (directory / _rank_file(rank)).write_text(encoded)


def _read_rank_state(directory: Path, rank: int, format_: int) -> dict[str, Any]:
    """This rank's state; a format-1 (pickle) one only through ``weights_only``, which runs no code."""
    if format_ >= 2:
        tensors = safetensors.torch.load_file(str(directory / _rank_file(rank, ".safetensors")))
        return _decode(json.loads((directory / _rank_file(rank)).read_text()), tensors)
    return safe_load.pickled_rank_state(directory / _rank_file(rank, ".pt"))


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
    directory = Path(directory)
    with contextlib.ExitStack() as held:
        other = held.enter_context(writing(directory)) if distributed.is_main() else None
        return _save(directory, engines, step=step, trainer_state=trainer_state, rank_state=rank_state,
                     teacher_sha256=teacher_sha256, keep_last=keep_last, other=other)


def _save(directory: Path, engines: Engines, *, step: int, trainer_state: Mapping[str, Any],
          rank_state: Mapping[str, Any], teacher_sha256: str | None, keep_last: int, other: str | None) -> Path:
    """:func:`save`, rank 0 holding the folder's lock (``other``: who holds it instead; then nothing is written)."""
    engines = _by_folder(engines)
    final = directory / checkpoint_name(step)
    partial = directory / (PARTIAL + final.name)
    keep, problem = False, None
    if distributed.is_main():
        if other is not None:
            problem = (f"checkpoint folder {directory} is in use by another run ({other}): nothing was written. Give "
                       "each run its own training.checkpoint_dir")
        else:
            remove_leftovers(directory)
            if final.exists():
                keep = verify(final) is None
                if not keep:
                    _remove(final)
    keep, problem = distributed.broadcast_object((keep, problem))
    if problem is not None:
        raise CheckpointError(problem)
    if keep:
        return final
    try:
        for folder, engine in engines.items():  # a PEFT student's frozen base is not saved: its sha256 is, below
            if _is_peft(engine):
                with _without_frozen_aliases(engine):
                    engine.save_checkpoint(str(partial), tag=folder, save_latest=False, exclude_frozen_parameters=True)
            else:
                engine.save_checkpoint(str(partial), tag=folder, save_latest=False)
        partial.mkdir(parents=True, exist_ok=True)
        _write_rank_state(partial, distributed.rank(), rank_state)
    except (OSError, RuntimeError) as err:
        raise CheckpointError(f"could not write checkpoint {partial}: {write_failure(err, directory)}") from None
    frozen = _frozen_bases(engines)
    distributed.barrier()  # every rank's files are on disk
    if distributed.is_main():
        (partial / TRAINER_STATE).write_text(json.dumps(trainer_state))
        files = sorted(p for p in partial.rglob("*") if p.is_file())
        manifest = {
            "format": FORMAT, "step": step, "world_size": distributed.world_size(), "teacher_sha256": teacher_sha256,
            "models": sorted(engines), **({"frozen_base_sha256": frozen} if frozen else {}),
            "files": {str(p.relative_to(partial)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
                      for p in files},
        }
        write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1))
        os.replace(partial, final)
        _fsync_dir(directory)
        _VERIFIED[str(final)] = _signature(final, manifest["files"])  # just hashed: no need to hash it again
        _prune(directory, keep_last, written=final)
    distributed.barrier()  # no rank runs ahead of a checkpoint that is not yet in place
    return final


@contextmanager
def _without_frozen_aliases(engine: deepspeed.DeepSpeedEngine) -> Iterator[None]:
    """While saving, the engine's module state leaves out every name of every frozen parameter.

    DeepSpeed's ``exclude_frozen_parameters`` deletes the names ``named_parameters()`` yields, and that skips a
    shared tensor's second name: a model with tied embeddings (GPT-2, most small Llamas and Qwens) would keep its
    frozen embedding, as ``lm_head.weight``, in every checkpoint of a PEFT student (vocabulary x width: often more
    than the adapters). It is frozen and comes back from the base on resume (loaded non-strict), like the rest.
    """
    frozen = {name for name, param in engine.module.named_parameters(remove_duplicate=False)
              if not param.requires_grad}
    full = engine.module_state_dict

    def module_state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
        state = full(*args, **kwargs)
        for name in frozen & set(state):
            del state[name]
        return state

    engine.module_state_dict = module_state_dict
    try:
        yield
    finally:
        del engine.module_state_dict


# ---- who writes a folder: its lock ---------------------------------------------------------------------


_HELD: dict[str, Any] = {}
"""The folders whose lock this process holds (real path -> the open lock file): a run's claims (``run/output_dir.py``)
and the folder of a save in progress. A ``flock`` belongs to its open file, so a second open in this process would
conflict with the first: whoever asks here first."""


def holder(handle: Any) -> str:
    """Who holds a lock, in words, from what the holder wrote into the lock file."""
    try:
        handle.seek(0)
        record = json.loads(handle.read() or "{}")
    except (OSError, ValueError):
        record = {}
    if not record:
        return "another process"
    who = f"pid {record.get('pid')} on host {record.get('host')}, since {record.get('since')}"
    return who + (f", the run in {record['output_dir']}" if record.get("output_dir") else "")


def try_lock(directory: str | Path, note: Mapping[str, Any] | None = None) -> tuple[Any, str | None]:
    """Take ``directory``'s lock (creating the folder): ``(open lock file, None)``, or ``(None, who holds it)``. The
    holder's pid, host and time (and ``note``) go into the lock file. The lock file stays when released: deleting it
    would let a third process lock a new file while the second still holds the old one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    handle = (directory / LOCK).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = holder(handle)
        handle.close()
        return None, who
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S"), **(note or {})}))
    handle.flush()
    return handle, None


def unlock(handle: Any) -> None:
    handle.seek(0)
    handle.truncate()  # no holder named while no one holds it
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


def locked_by_other(directory: str | Path) -> str | None:
    """Who else holds ``directory``'s lock now (a live process, or another claim of this one), or None: free, or
    held by this process's claim. Creates nothing."""
    return None if held_here(directory) else probe(directory)


def probe(directory: str | Path) -> str | None:
    """Who holds ``directory``'s lock now, whoever it is (this process's claims too), or None. Creates nothing;
    the answer can change at once: taking the lock is what decides."""
    try:
        handle = (Path(directory) / LOCK).open("r+")
    except OSError:  # no lock file: no one ever claimed it
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder(handle)
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def held_here(directory: str | Path) -> bool:
    return os.path.realpath(directory) in _HELD


@contextmanager
def writing(directory: str | Path) -> Iterator[str | None]:
    """Hold ``directory``'s lock while the body writes: yields None, or who else holds it (then write nothing).
    A lock this process already holds (the run's claim) is kept as it is."""
    key = os.path.realpath(directory)
    if key in _HELD:
        yield None
        return
    handle, who = try_lock(directory)
    if handle is None:
        yield who
        return
    _HELD[key] = handle
    try:
        yield None
    finally:
        del _HELD[key]
        unlock(handle)


def remove_leftovers(directory: str | Path) -> None:
    """Delete what killed saves and deletes left (``.partial-*``, ``.deleting-*``): never loadable, and on a
    full disk they take the space the next save needs. Call on rank 0 only, before writing.

    Only a folder no other live process writes has leftovers: while another holds its lock (a run that claimed it,
    or a save in progress), a ``.partial-*`` there may be its save, and nothing is removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    with writing(directory) as other:
        if other is not None:
            logger.warning("not clearing leftovers in %s: another run writes there (%s)", directory, other)
            return
        for leftover in [*directory.glob(PARTIAL + "*"), *directory.glob(DELETING + "*")]:
            logger.warning("removing %s: what a save or delete that did not finish left", leftover)
            shutil.rmtree(leftover)


def write_failure(err: BaseException, directory: str | Path) -> str:
    """Why a write into ``directory`` failed, in words, with what to do: the cause it really was.

    A full disk says so even when DeepSpeed's C++ writer reports only "basic_ios::clear: iostream error" (no
    errno), judged by the space left. A file or folder that vanished during the write was deleted by someone
    else, not lost to a full disk; a refused permission is a permission."""
    errno_ = err.errno if isinstance(err, OSError) else None
    resume = "then resume (--resume) from the last checkpoint (the unfinished one is cleared)"
    if errno_ == errno.ENOSPC or free_bytes(directory) < FULL_DISK_BYTES:
        return (f"no space left on device. {disk_space(directory)}; free space or choose another "
                f"training.checkpoint_dir, {resume}")
    if isinstance(err, FileNotFoundError) or errno_ == errno.ENOENT:
        return (f"{type(err).__name__}: {err}: a file or folder of the save went away while it was written "
                f"(something else deletes in {directory}: another run sharing it, or a clean-up). Give this run a "
                f"training.checkpoint_dir nothing else writes, {resume}")
    if isinstance(err, PermissionError) or errno_ in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{type(err).__name__}: {err}: make {directory} writable or choose another training.checkpoint_dir"
    return (f"{type(err).__name__}: {err}. {disk_space(directory)}; if the disk filled, free space or choose "
            f"another training.checkpoint_dir, {resume}")


def nearest_existing(directory: str | Path) -> Path:
    """``directory``, or its nearest parent that exists (where a folder still to be made would go)."""
    existing = Path(directory).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def free_bytes(directory: str | Path) -> int:
    """Space left on the disk that holds ``directory`` (or would hold it)."""
    return shutil.disk_usage(nearest_existing(directory)).free


OPTIMIZER_BYTES_PER_PARAMETER = 12
"""Bytes a checkpoint keeps per trained parameter beyond its weights: the optimizer's fp32 master copy and Adam's two
moments (ZeRO-2/3 save all three in fp32)."""
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def checkpoint_bytes(parameters: int, dtype: str) -> int:
    """About what one student's checkpoint takes: its weights in ``dtype``, and the optimizer's fp32 states."""
    return parameters * (WEIGHT_BYTES[dtype] + OPTIMIZER_BYTES_PER_PARAMETER)


def folder_problems(directory: str | Path, each: int | None, keep: int) -> list[str]:
    """Before a run starts: its checkpoint folder can be created and written, and its disk has room for ``keep``
    checkpoints of ``each`` bytes and one more while a new one is written (None: the size is not known). Nothing is
    left behind (the write test's file is removed)."""
    directory = Path(directory)
    existing = nearest_existing(directory)
    if not existing.is_dir():
        return [f"training.checkpoint_dir {str(directory)!r} cannot be created: {existing} is not a folder"]
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".distill-kit-write-test-"):
            pass
    except OSError as err:
        return [f"training.checkpoint_dir {str(directory)!r} cannot be written: {existing}: {err.strerror or err}. "
                "Choose a folder you can write, or fix its permissions"]
    if each is None:
        return []
    on_disk = sum(1 for _ in directory.glob(PREFIX + "*")) if directory.is_dir() else 0
    needed = max(1, keep + 1 - on_disk) * each  # a new one is written before the oldest is deleted
    free = free_bytes(existing)
    if free < needed:
        return [f"training.checkpoint_dir {str(directory)!r}: its disk has {free / 1e9:.2f} GB free, but the run "
                f"needs about {needed / 1e9:.2f} GB for its checkpoints ({each / 1e9:.2f} GB each: weights "
                f"and optimizer states; {keep} kept, and one more while a new one is written). Free space, lower "
                "training.keep_checkpoints, or choose another training.checkpoint_dir"]
    return []


def disk_space(directory: str | Path) -> str:
    """How much space the disk holding ``directory`` (or its nearest existing parent) has left, in words."""
    existing = nearest_existing(directory)
    return f"{free_bytes(existing) / 1e9:.2f} GB free on the disk of {existing}"


def _prune(directory: Path, keep_last: int, written: Path) -> None:
    """Delete verified checkpoints older than the newest ``keep_last`` verified ones.

    Only a checkpoint whose files match its manifest takes one of the ``keep_last`` places or is deleted: a
    corrupt one (it fails :func:`verify`) is never counted, so it cannot push out the checkpoint just written,
    and is left to inspect with a warning. ``written`` (the checkpoint just saved) is never deleted, even when
    checkpoints of later steps (of a run resumed from an earlier one) are on disk.
    """
    steps = sorted((p for p in directory.iterdir() if _step_of(p) is not None and (p / MANIFEST).is_file()),
                   key=_step_of, reverse=True)
    kept = 0
    for path in steps:
        reason = verify(path)
        if reason is not None:
            logger.warning("checkpoint %s is corrupt (%s): it is not counted among the %d kept, nor deleted",
                           path, reason, keep_last)
        elif kept < keep_last or path == written:
            kept += 1
        else:
            _remove(path)
            _VERIFIED.pop(str(path), None)


# ---- finding and reading ---------------------------------------------------------------------------------


_VERIFIED: dict[str, tuple] = {}
"""Checkpoints this process hashed and found whole, with each file's size and modification time then: pruning
re-verifies the kept checkpoints at every save, and re-hashing unchanged multi-GB files each time would be slow."""


def _signature(path: Path, files: Mapping[str, Any]) -> tuple:
    stats = [(path / relative).stat() for relative in sorted(files)]
    return tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in stats) + ((path / MANIFEST).stat().st_mtime_ns,)


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
    signature = _signature(path, files)
    if _VERIFIED.get(str(path)) == signature:
        return None
    for relative, expected in files.items():
        if file_sha256(path / relative) != expected["sha256"]:
            return f"{relative} does not match its sha256 in the manifest"
    _VERIFIED[str(path)] = signature
    return None


def latest_complete(directory: str | Path) -> Path | None:
    """The newest checkpoint under ``directory`` whose files all match its manifest; None if there is none.

    Incomplete or corrupt ones are skipped with a warning (never loaded), so a save killed half-way costs only
    the steps since the previous checkpoint.
    """
    return find_latest(directory)[0]


def find_latest(directory: str | Path) -> tuple[Path | None, list[str]]:
    """:func:`latest_complete`, and why each newer checkpoint was skipped (``"<path>: <reason>"``)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None, []
    for leftover in sorted(directory.glob(PARTIAL + "*")):
        logger.warning("ignoring %s: a save that did not finish", leftover)
    skipped = []
    for path in sorted((p for p in directory.iterdir() if _step_of(p) is not None), key=_step_of, reverse=True):
        reason = verify(path)
        if reason is None:
            return path, skipped
        logger.warning("skipping checkpoint %s: %s", path, reason)
        skipped.append(f"{path}: {reason}")
    return None, skipped


def nothing_to_resume(directory: str | Path, skipped: list[str]) -> str:
    """Why a resume from ``directory`` found no checkpoint to load, with what to do."""
    if skipped:
        return (f"no checkpoint in {directory} can be loaded: " + "; ".join(skipped) + ". Each is kept to inspect; "
                "restore it from a copy, or start a new run in another output directory.")
    return (f"there is no checkpoint to resume in {directory}. Check output_dir and training.checkpoint_dir "
            "(they must be the stopped run's), or leave out --resume to start a new run.")


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
    problem = None
    try:  # before any engine loads: a refused state file must leave the engines untouched
        rank_state = _read_rank_state(path, distributed.rank(), manifest.get("format", 1))
    except Exception as err:  # JSON, safetensors and pickle raise many types; each means "cannot use it"
        problem = str(err) if isinstance(err, ValueError) else f"cannot read this rank's state in {path}: {err}"
    problems = [p for p in distributed.all_gather_object(problem) if p is not None]
    if problems:  # every rank stops together, none is left waiting in the engines' collectives
        raise ValueError(problems[0])
    with safe_load.weights_only(engines.values()):
        for folder, engine in engines.items():
            loaded, _ = engine.load_checkpoint(str(path), tag=folder,
                                               **({"load_module_strict": False} if folder in frozen else {}))
            if loaded is None:
                raise FileNotFoundError(f"DeepSpeed found no checkpoint in {path / folder}")
    trainer_state = json.loads((path / TRAINER_STATE).read_text())
    return trainer_state, rank_state

"""Paged teachers: routed teachers kept off the device, each brought on for the micro-batches routed to it.

Why: with ``combine: route`` a micro-batch needs one teacher, and the routed loader gives every rank one teacher per
micro-batch, so the others' weights need not be on the device. Keeping all of them resident costs the sum of their
weights on every device; DeepSpeed's ZeRO-3 ``offload_param`` keeps them on the host but fetches every layer of the
teacher at every forward. Paging moves a teacher's weights once per switch of teacher, so with k micro-batches per
switch it moves 1/k of what offload moves, and the move can overlap the previous teacher's micro-batches.

The layout: each teacher's parameters and buffers end to end (each at a :data:`ALIGN`-byte offset) in one flat byte
buffer, kept in pinned host memory or, for teachers past the host budget, in a file on disk that is read back through
two small pinned staging buffers. The device holds ``slots`` byte buffers the size of the largest teacher. The
teacher brought in has its parameters and buffers as views into one slot; every other teacher's are empty
placeholders, so a teacher's weights are on the device only while it is brought in, and a forward of a teacher that
is not fails at once. With two slots, :meth:`Pager.prefetch` fills the other slot from a worker thread on a side
CUDA stream while the current teacher computes; :meth:`Pager.bring` then only waits for what is left of it. On the
CPU (device = cpu) the same code runs, the copies synchronous.

Disk copies: each process writes its teachers' files into a folder of its own in ``disk_dir``
(:class:`CopyFolder`: ``distill_kit_paged-<pid>-<random>``, a marker file saying what it is, and a lock file the
process holds with ``flock`` while it lives). The folder goes when the pager closes or the interpreter exits; a
process killed outright (``kill -9``, the OOM killer) leaves it, and the next pager started on the same
``disk_dir`` removes every such folder whose lock nobody holds, logging each with its size. Only folders with the
marker are touched; anything else in ``disk_dir`` is the user's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

ALIGN = 256
"""Byte alignment of every tensor in a flat buffer: a view's address is as aligned as a fresh allocation's (CUDA
and CPU allocators align to at least this much), so kernels take the same paths as for the resident teacher."""
STAGING_BYTES = 256 * 2**20
"""Each of the two pinned staging buffers a disk teacher is read through."""
PREFIX = "distill_kit_paged-"
"""How the name of a process's folder of disk copies begins (:class:`CopyFolder`)."""
MARKER = "distill_kit_paged.json"
"""The file that marks a folder as a pager's: only folders holding it (and named :data:`PREFIX`...) are removed."""
LOCK = "owner.lock"
"""The file the owning process holds an exclusive ``flock`` on while it lives (the kernel drops it at its death)."""

logger = logging.getLogger(__name__)


@dataclass
class Layout:
    """Where each of a module's tensors sits in its flat buffer: (owners, offset, shape, dtype) per tensor."""

    entries: list[tuple[list[tuple[nn.Module, str, bool]], int, torch.Size, torch.dtype]] = field(default_factory=list)
    nbytes: int = 0

    @classmethod
    def of(cls, module: nn.Module) -> Layout:
        """Every distinct parameter and buffer once (tied weights share an entry), with every (module, name) that
        holds it."""
        owners: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, bool]]]] = {}
        for sub in module.modules():
            for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
                for name, tensor in table.items():
                    if tensor is not None:
                        owners.setdefault(id(tensor), (tensor, []))[1].append((sub, name, is_param))
        layout, offset = cls(), 0
        for tensor, holders in owners.values():
            layout.entries.append((holders, offset, tensor.shape, tensor.dtype))
            offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        layout.nbytes = offset
        return layout

    def tensors(self) -> list[torch.Tensor]:
        """The module's tensors now, in layout order."""
        holders = [entry[0][0] for entry in self.entries]
        return [(sub._parameters if is_param else sub._buffers)[name] for sub, name, is_param in holders]

    def bind(self, flat: torch.Tensor | None) -> None:
        """Point every tensor at its bytes in ``flat`` (a device slot), or at an empty placeholder (None)."""
        for holders, offset, shape, dtype in self.entries:
            size = shape.numel() * dtype.itemsize
            view = (torch.empty(0, dtype=dtype) if flat is None else
                    flat[offset:offset + size].view(dtype).view(shape))
            for sub, name, is_param in holders:
                if is_param:
                    sub._parameters[name].data = view  # the one Parameter every tied holder shares
                else:
                    sub._buffers[name] = view


@dataclass
class _Slot:
    buffer: torch.Tensor
    holds: str | None = None
    """The teacher whose bytes it has (or is receiving)."""
    loading: Future | None = None
    ready: Any = None
    """A CUDA event recorded after its bytes arrived (None on the CPU)."""
    released: Any = None
    """A CUDA event recorded on the compute stream after the last forward that read it."""


class Pager:
    """Teachers' weights off the device, one at a time on it (see the module's docstring)."""

    def __init__(self, device: torch.device, slots: int = 2, disk_dir: str | Path | None = None):
        self.device, self.slot_count = torch.device(device), slots
        self.cuda = self.device.type == "cuda"
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.layouts: dict[str, Layout] = {}
        self.host: dict[str, torch.Tensor] = {}
        """Each host-kept teacher's flat buffer (pinned on a CUDA run)."""
        self.files: dict[str, Path] = {}
        """Each disk-kept teacher's file."""
        self.folder: CopyFolder | None = None
        """This pager's folder in ``disk_dir`` (made at the first disk-kept teacher)."""
        self.slots: list[_Slot] = []
        self.bound: str | None = None
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pager")
        self.staging: list[torch.Tensor] = []
        self.staging_free: list[Any] = [None, None]
        self.stats = {"switches": 0, "bytes_moved": 0, "wait_s": 0.0, "prefetched": 0}
        if self.disk_dir is not None:  # what killed runs left there
            remove_abandoned(self.disk_dir)

    # ---- taking teachers off the device ----------------------------------------------------------------

    def adopt(self, name: str, module: nn.Module, kept: str = "host") -> None:
        """Copy ``module``'s weights into its host buffer (``kept`` ``host``) or its file (``disk``), and leave it
        with placeholders: the memory it held (host or device) is given back."""
        layout = Layout.of(module)
        if kept == "host":
            flat = _pinned(layout.nbytes) if self.cuda else torch.empty(layout.nbytes, dtype=torch.uint8)
            for (_, offset, shape, dtype), tensor in zip(layout.entries, layout.tensors(), strict=True):
                size = shape.numel() * dtype.itemsize
                flat[offset:offset + size].copy_(_bytes(tensor))
            self.host[name] = flat
        elif kept == "disk":
            if self.disk_dir is None:
                raise ValueError("a disk-kept teacher needs the pager's disk_dir")
            if self.folder is None:
                self.folder = CopyFolder(self.disk_dir)
            path = self.folder.path / f"{name}.bin"
            with open(path, "wb") as handle:
                for (_, offset, _, _), tensor in zip(layout.entries, layout.tensors(), strict=True):
                    handle.seek(offset)
                    handle.write(_bytes(tensor).cpu().numpy().data)
                handle.truncate(layout.nbytes)
            self.files[name] = path
        else:
            raise ValueError(f"kept must be 'host' or 'disk', got {kept!r}")
        layout.bind(None)
        self.layouts[name] = layout
        if self.cuda:
            torch.cuda.empty_cache()  # the adopted teacher's device copy, if it had one

    # ---- bringing one on ----------------------------------------------------------------------------------

    def bring(self, name: str) -> None:
        """Make ``name`` the teacher on the device (its tensors views into a slot), waiting for its bytes."""
        if self.bound == name:
            return
        started = time.perf_counter()
        self._allocate()
        slot = next((s for s in self.slots if s.holds == name), None)
        if slot is None:
            slot = self._load_into(self._spare(), name)
        else:
            self.stats["prefetched"] += 1
        self._unbind()
        if slot.loading is not None:
            slot.loading.result()  # the worker's copies are queued (CUDA) or done (CPU)
            slot.loading = None
        if slot.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
        self.layouts[name].bind(slot.buffer)
        self.bound = name
        self.stats["switches"] += 1
        self.stats["wait_s"] += time.perf_counter() - started

    def prefetch(self, name: str) -> None:
        """Start moving ``name`` into the spare slot and return at once; nothing with one slot, or when it is on
        the device or on its way already."""
        if self.slot_count < 2 or self.bound == name or any(s.holds == name for s in self.slots):
            return
        self._allocate()
        self._load_into(self._spare(), name)

    def _allocate(self) -> None:
        """The device slots, made at the first bring (after every teacher is adopted, so that a teacher built on
        the device never sits there beside them)."""
        if not self.slots:
            size = max(layout.nbytes for layout in self.layouts.values())
            self.slots = [_Slot(torch.empty(size, dtype=torch.uint8, device=self.device))
                          for _ in range(self.slot_count)]

    def _spare(self) -> _Slot:
        """The slot a new teacher goes into: the one not bound (with one slot, the only one, unbound first)."""
        if self.slot_count == 1:
            self._unbind()
            return self.slots[0]
        return next(s for s in self.slots if self.bound is None or s.holds != self.bound)

    def _unbind(self) -> None:
        if self.bound is None:
            return
        slot = next(s for s in self.slots if s.holds == self.bound)
        if self.cuda:  # what is queued on the compute stream still reads it: a copy into it waits for this
            slot.released = torch.cuda.current_stream(self.device).record_event()
        self.layouts[self.bound].bind(None)
        self.bound = None

    def _load_into(self, slot: _Slot, name: str) -> _Slot:
        if slot.loading is not None:
            slot.loading.result()  # another teacher still arriving there: let it finish first
        slot.holds, slot.ready = name, None
        slot.loading = self.worker.submit(self._copy, slot, name)
        self.stats["bytes_moved"] += self.layouts[name].nbytes
        return slot

    def _copy(self, slot: _Slot, name: str) -> None:
        """(The worker thread.) ``name``'s bytes into ``slot``: one copy from pinned host memory, or the file read
        in chunks through the two staging buffers, each chunk's copy queued while the next is read."""
        nbytes = self.layouts[name].nbytes
        stream = self.stream
        if stream is not None and slot.released is not None:
            stream.wait_event(slot.released)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if name in self.host:
                slot.buffer[:nbytes].copy_(self.host[name], non_blocking=True)
            else:
                self._read_file(self.files[name], slot.buffer, nbytes)
            if stream is not None:
                slot.ready = stream.record_event()

    def _read_file(self, path: Path, target: torch.Tensor, nbytes: int) -> None:
        if not self.staging:
            self.staging = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        with open(path, "rb", buffering=0) as handle:
            for index, start in enumerate(range(0, nbytes, STAGING_BYTES)):
                which, size = index % 2, min(STAGING_BYTES, nbytes - start)
                if self.staging_free[which] is not None:
                    self.staging_free[which].synchronize()  # its previous chunk has reached the device
                staging = self.staging[which]
                view, done = memoryview(staging.numpy()), 0
                while done < size:  # a read may return fewer bytes than asked for
                    done += handle.readinto(view[done:size])
                target[start:start + size].copy_(staging[:size], non_blocking=True)
                self.staging_free[which] = torch.cuda.current_stream(self.device).record_event() if self.cuda else None

    def close(self) -> None:
        """Stop the worker and delete the disk copies (their folder)."""
        self.worker.shutdown(wait=True)
        if self.folder is not None:
            self.folder.remove()
        if self.cuda:
            for flat in self.host.values():
                torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())))
        self.host.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to tidy
            pass


class CopyFolder:
    """One process's folder of disk copies in ``disk_dir``, owned while the process lives (module docstring).

    Made as ``<disk_dir>/distill_kit_paged-<pid>-<random>``: the lock file is created and locked first, the marker
    written after, so a folder with a marker and a free lock is one whose owner is gone. Removed by :meth:`remove`,
    and at the latest when the interpreter exits."""

    def __init__(self, disk_dir: str | Path):
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=disk_dir))
        self.lock = os.open(self.path / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else can hold it
        owner = {"made_by": "distill_kit", "what": "disk copies of paged teachers' weights", "pid": os.getpid(),
                 "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (self.path / MARKER).write_text(json.dumps(owner) + "\n")
        self._finalizer = weakref.finalize(self, _remove_own, self.path, self.lock)

    def remove(self) -> None:
        """Delete the folder and give up its lock (once; again does nothing)."""
        self._finalizer()


def _remove_own(path: Path, lock: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock)


def remove_abandoned(disk_dir: str | Path) -> list[tuple[Path, int]]:
    """Remove the folders of disk copies in ``disk_dir`` whose owner is gone (a pager's process killed before it
    could tidy): only folders named :data:`PREFIX`... that hold the :data:`MARKER` of this host, and whose
    :data:`LOCK` nobody holds. Each removed folder is logged with its size; folders another host made (a shared
    ``disk_dir``: its lock may not tell) are named, never removed. Returns what was removed: (folder, bytes)."""
    removed, elsewhere = [], []
    try:
        candidates = sorted(p for p in Path(disk_dir).glob(f"{PREFIX}*") if p.is_dir() and not p.is_symlink())
    except OSError:
        return []
    for folder in candidates:
        owner = _owner(folder)
        if owner is None:
            continue  # not a pager's folder: the user's, whatever its name
        if owner.get("host") != socket.gethostname():
            elsewhere.append(f"{folder} (pid {owner.get('pid')} on {owner.get('host')})")
            continue
        size = _removed_if_abandoned(folder)
        if size is not None:
            removed.append((folder, size))
            logger.warning("paged teachers: removed %s (%s), the disk copies of a run that ended without "
                           "removing them (pid %s, started %s)", folder,
                           f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB",
                           owner.get("pid"), owner.get("started"))
    if elsewhere:
        logger.warning("paged teachers: %s holds disk copies of runs on other hosts, left as they are: %s; remove "
                       "each once its run has ended", disk_dir, "; ".join(elsewhere))
    try:
        older = [(p, p.stat().st_size) for p in Path(disk_dir).glob("distill_kit_paged_*.bin")
                 if p.is_file() and not p.is_symlink()]
    except OSError:
        older = []
    if older:  # an earlier version's copies, loose in disk_dir with no owner recorded: named, never removed
        logger.warning("paged teachers: %s holds %d file(s) named like an earlier distill-kit's disk copies (%s, "
                       "%.1f GiB), which recorded no owner and are left as they are: delete them if no run of that "
                       "version is going", disk_dir, len(older), ", ".join(p.name for p, _ in older[:3]),
                       sum(size for _, size in older) / 2**30)
    return removed


def _owner(folder: Path) -> dict[str, Any] | None:
    """The marker's contents, or None when the folder holds no pager's marker."""
    try:
        owner = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and owner.get("made_by") == "distill_kit" else None


def _removed_if_abandoned(folder: Path) -> int | None:
    """Remove ``folder`` if its lock is free (its owner gone), holding the lock meanwhile; its bytes, or None."""
    try:
        lock = os.open(folder / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        lock = None  # a removal cut short (the lock file went first): nobody holds it
    except OSError:
        return None
    try:
        if lock is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its process lives (or a lock this filesystem cannot take: leave it)
                return None
        try:
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
            shutil.rmtree(folder)
        except FileNotFoundError:
            return None  # another start removed it first
        except OSError as err:
            logger.warning("paged teachers: could not remove %s, the disk copies of a run that has ended: %s",
                           folder, err)
            return None
        return size
    finally:
        if lock is not None:
            os.close(lock)


def _pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory, registered with CUDA as they are: PyTorch's pinned allocator rounds a
    request up to a power of two (a 27.5 GiB teacher would take 32 GiB)."""
    flat = torch.empty(nbytes, dtype=torch.uint8)
    torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 0)))
    return flat


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (where it is)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)

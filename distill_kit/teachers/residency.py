"""Where the teachers' weights live (``training.teacher_residency``), decided and checked before anything loads.

``resident``: on the device the whole run (the teacher's DeepSpeed config: ZeRO-3 shards or replicated). ``paged``:
each teacher in pinned host memory or, past the host budget, in a file on disk, brought onto the device for the
micro-batches routed to it (``teachers/paged.py``). ``offload``: DeepSpeed's ZeRO-3 ``offload_param`` to pinned CPU
memory, which fetches every layer of the teacher at every forward. The plan (``training/plan.py``) asks
:func:`residency_problems` for every residency that cannot fit, with the numbers and the fix in one line each, from
the teachers' cards (parameter counts from their configs, on the meta device), the device's and the host's
available memory (:func:`available_memory`) and the disk's free space; and :func:`ds_overrides` for the DeepSpeed
keys a residency implies (paged teachers are replicated modules; offload is ZeRO-3 with ``offload_param``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distill_kit.config import TeacherSpec, TrainingConfig
from distill_kit.engines import models
from distill_kit.engines.models import TORCH_DTYPES
from distill_kit.teachers.base import TeacherCard

GIB = 2**30
LOAD_MARGIN = 4 * GIB
"""Host memory the automatic pinned budget leaves free besides room to load the largest teacher: the process, the
data, the students' host-side state."""


@dataclass(frozen=True)
class Memory:
    """Bytes available where weights can go, as this rank sees them."""

    device: int
    """Free on this rank's device (``torch.cuda.mem_get_info``); on a CPU run, the host's available memory."""
    host: int
    """The host's available memory (``psutil``'s ``available``), shared by ``local_ranks`` ranks."""
    local_ranks: int = 1
    """Ranks on this host (``LOCAL_WORLD_SIZE``): each keeps its own host copy of its paged teachers."""


def available_memory() -> Memory:
    """This rank's figures now (tests replace this function with fixed figures)."""
    import psutil  # DeepSpeed's dependency

    host = psutil.virtual_memory().available
    device = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else host
    return Memory(device=device, host=host, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def disk_free(folder: str | Path) -> int:
    return shutil.disk_usage(folder).free


@dataclass(frozen=True)
class PagingPlan:
    """What paging will build: its device slots, each teacher's bytes and where its copy is kept."""

    slots: int
    bytes: dict[str, int]
    """Each teacher's weights (parameters x the run's dtype), by name."""
    kept: dict[str, str]
    """``host`` (pinned) or ``disk``, by name, in the teachers' order."""
    disk_dir: str

    def describe(self) -> str:
        """One line for the run's log: what is kept where."""
        where = ", ".join(f"{name} ({self.bytes[name] / GIB:.1f} GiB) on {place}" for name, place in self.kept.items())
        return (f"paged teachers: {where}; {self.slots} device slot(s) of {max(self.bytes.values()) / GIB:.1f} GiB"
                + (f"; disk copies in {self.disk_dir}" if "disk" in self.kept.values() else ""))


def gib(value: int | float) -> str:
    return f"{value / GIB:.1f} GiB"


def teacher_bytes(card: TeacherCard, dtype: str) -> int | None:
    """A teacher's weights in the run's dtype, from its config (None without one)."""
    if card.config is None:
        return None
    return models.parameter_count(card.config) * TORCH_DTYPES[dtype].itemsize


def ds_overrides(residency: str) -> dict[str, Any]:
    """The teacher DeepSpeed keys a residency implies, over the user's: a paged teacher is a replicated module
    (stage 0); ``offload`` is ZeRO-3 with its parameters in pinned CPU memory."""
    if residency == "paged":
        return {"zero_optimization.stage": 0}
    if residency == "offload":
        return {"zero_optimization.stage": 3, "zero_optimization.offload_param.device": "cpu",
                "zero_optimization.offload_param.pin_memory": True}
    return {}


def residency_problems(teachers: Sequence[TeacherSpec], cards: Mapping[str, TeacherCard], training: TrainingConfig,
                       combine: str, stages: Mapping[str, int], world_size: int,
                       memory: Memory | None = None) -> tuple[PagingPlan | None, list[str]]:
    """The paging plan (paged runs) and every reason the residency cannot fit, each naming the numbers and the fix.

    ``stages``: each engine teacher's ZeRO stage as its DeepSpeed config resolved. ``memory``: the figures to
    check against (default :func:`available_memory`, read only when there is an engine teacher to place)."""
    residency = training.teacher_residency
    engines = [t for t in teachers if cards[t.name].engine]
    if not engines:
        if residency != "resident":
            return None, [f"training.teacher_residency: {residency} places in-process teachers' weights, and this "
                          "run has none (a store, a server or the student itself): use resident"]
        return None, []
    if residency == "paged":
        return _paged(teachers, cards, training, combine, memory)
    if training.teacher_precision == "fp8":
        if residency == "offload":
            return None, ["training.teacher_residency: offload with training.teacher_precision: fp8: an FP8 teacher "
                          "is a replicated module, not a ZeRO-3 engine; use resident or teacher_precision: auto"]
        return None, []
    sizes = {t.name: teacher_bytes(cards[t.name], training.dtype) for t in engines}
    if any(size is None for size in sizes.values()):
        return None, []
    memory = memory or available_memory()
    if residency == "offload":  # each rank holds its 1/world of every teacher in pinned host memory
        need = sum(sizes.values()) // world_size * memory.local_ranks
        if need > memory.host:
            return None, [f"training.teacher_residency: offload keeps {gib(need)} of teacher weights in pinned host "
                          f"memory ({memory.local_ranks} rank(s) on this host), and the host has {gib(memory.host)} "
                          "available: use teacher_residency: paged (combine: route) or more hosts"]
        return None, []
    if not torch.cuda.is_available():  # a plan made off the GPU machine (a login node) says nothing of its devices
        return None, []
    per_rank = {name: size // world_size if stages.get(name) == 3 else size for name, size in sizes.items()}
    if sum(per_rank.values()) > memory.device + _on_device(engines, per_rank):
        fix = ("training.teacher_residency: paged (one teacher on the device at a time)" if combine == "route" else
               "combine: route with training.teacher_residency: paged, or training.teacher_residency: offload")
        return None, [f"training.teacher_residency: resident needs {gib(sum(per_rank.values()))} of teacher weights "
                      f"on each device ({', '.join(f'{n} {gib(b)}' for n, b in per_rank.items())}), and the device "
                      f"has {gib(memory.device)} free: use {fix}, or ZeRO-3 teachers over more ranks"]
    return None, []


def _paged(teachers: Sequence[TeacherSpec], cards: Mapping[str, TeacherCard], training: TrainingConfig,
           combine: str, memory: Memory | None) -> tuple[PagingPlan | None, list[str]]:
    key, paging = "training.teacher_residency: paged", training.teacher_paging
    problems = []
    if combine != "route":
        problems.append(f"{key} brings one teacher onto the device for the micro-batches routed to it, and combine: "
                        f"{combine} runs every teacher on every micro-batch: use combine: route, or teacher_residency: "
                        "resident (or offload)")
    others = [t.name for t in teachers if not cards[t.name].engine or type(t.model).__name__ == "DeepSpeedEngine"]
    if others:
        problems.append(f"{key}: teachers {others} are not models this run loads (a store, a server, the student, a "
                        "built DeepSpeed engine): page only model teachers (kind: engine), or use resident")
    if training.teacher_precision == "fp8":
        problems.append(f"{key} with training.teacher_precision: fp8 is not supported: use teacher_precision: auto")
    sizes = {t.name: teacher_bytes(cards[t.name], training.dtype) for t in teachers if t.name not in others}
    unknown = [name for name, size in sizes.items() if size is None]
    if unknown:
        problems.append(f"{key}: teachers {unknown} have no model config to size them by: give a model folder or a "
                        "module with .config")
    if problems:
        return None, problems
    memory = memory or available_memory()
    largest = max(sizes.values())
    need, free = paging.slots * largest, memory.device + _on_device(teachers, sizes)
    if need > free:
        fix = (f"set training.teacher_paging.slots: 1 ({gib(largest)})" if paging.slots == 2 and largest <=
               free else "use a device with more memory, or resident ZeRO-3 teachers over more ranks")
        problems.append(f"{key} needs {paging.slots} device slot(s) of the largest teacher ({gib(largest)}) = "
                        f"{gib(need)}, and the device has {gib(free)} free: {fix}")
    host = memory.host // max(memory.local_ranks, 1)
    if paging.host_gib and paging.host_gib * GIB > host:
        problems.append(f"training.teacher_paging.host_gib: {paging.host_gib} GiB, and the host has {gib(host)} "
                        f"available per rank ({memory.local_ranks} rank(s) on it): set host_gib to {host / GIB:.0f} "
                        "or less, or 0 (automatic)")
    budget = int(paging.host_gib * GIB) if paging.host_gib else max(host - largest - LOAD_MARGIN, 0)
    kept, used = {}, 0
    for name, size in sizes.items():
        fits = used + size <= budget
        kept[name] = "host" if fits else "disk"
        used += size if fits else 0
    disk_dir = paging.disk_dir or tempfile.gettempdir()
    on_disk = {name: sizes[name] for name, place in kept.items() if place == "disk"}
    if on_disk:
        if not Path(disk_dir).is_dir():
            problems.append(f"training.teacher_paging.disk_dir: {disk_dir!r} is not a folder, and teachers "
                            f"{list(on_disk)} ({gib(sum(on_disk.values()))}) do not fit the pinned budget of "
                            f"{gib(budget)}: create it, or name another")
        elif not os.access(disk_dir, os.W_OK | os.X_OK):  # read-only (a read-only mount too, even for root)
            problems.append(f"training.teacher_paging.disk_dir: {disk_dir!r} cannot be written to (read-only, or "
                            f"another user's), and teachers {list(on_disk)} ({gib(sum(on_disk.values()))}) are kept "
                            f"there, past the pinned budget of {gib(budget)}: point disk_dir at a folder this user "
                            "can write, on a disk with that much free")
        elif sum(on_disk.values()) > (free := disk_free(disk_dir)):
            problems.append(f"{key}: teachers {list(on_disk)} ({gib(sum(on_disk.values()))}) do not fit the pinned "
                            f"host budget ({gib(budget)} of {gib(host)} available), and training.teacher_paging."
                            f"disk_dir ({disk_dir}) has {gib(free)} free: point disk_dir at a disk with "
                            f"{gib(sum(on_disk.values()))} free, or fewer teachers")
    if problems:
        return None, problems
    return PagingPlan(slots=paging.slots, bytes=sizes, kept=kept, disk_dir=disk_dir), []


def _on_device(teachers: Sequence[TeacherSpec], sizes: Mapping[str, int]) -> int:
    """Bytes of the teachers given as modules already on a GPU (built there): the device's free memory does not
    count them, and placing them gives them back (paging moves them off; resident, they stay where they are)."""
    def on_gpu(model: Any) -> bool:
        first = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
        return first is not None and first.device.type == "cuda"

    return sum(sizes.get(t.name, 0) for t in teachers if on_gpu(t.model))

"""Paged routed teachers (``training.teacher_residency: paged``): the same losses as resident teachers, one teacher on
the device slots at a time, and every residency that cannot fit refused by the plan before anything loads.

In one process on the CPU (device = cpu: the device slots are host buffers and the copies synchronous, through the
same code as on a GPU).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import gpt2_config, random_batches
from transformers import GPT2LMHeadModel

from distill_kit import DeepSpeedSettings, Distiller, StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.errors import ConfigError
from distill_kit.teachers import kinds, paged, residency
from distill_kit.teachers.paged import Layout, Pager
from distill_kit.training.plan import make_plan

GIB = 2**30
STEPS, GAS, MBS, LENGTH = 4, 2, 2, 16
# Each micro-batch's teachers: runs of one teacher (switches inside a step and at a step's start), then mixed rows.
ROUTES = [[0, 0], [0, 0], [1, 1], [1, 1], [2, 2], [0, 0], [1, 1], [0, 2]]
TRAINING = TrainingConfig(max_steps=STEPS, micro_batch_size=MBS, gradient_accumulation_steps=GAS, lr=3e-3,
                          log_every=100)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three tiny GPT-2 teachers of different widths (so their flat buffers differ in size) and a student."""
    root = tmp_path_factory.mktemp("paged")
    paths = {}
    for name, seed, width, layers in (("a", 1, 64, 2), ("b", 2, 48, 2), ("c", 3, 32, 3), ("student", 4, 32, 1)):
        torch.manual_seed(seed)
        GPT2LMHeadModel(gpt2_config(width=width, layers=layers)).save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def teacher_specs(models):
    return [TeacherSpec(name=name, model=models[name]) for name in ("a", "b", "c")]


def routed_batches():
    batches = random_batches(len(ROUTES), MBS, LENGTH, seed=5)
    return [batch | {"teacher_id": torch.tensor(route)} for batch, route in zip(batches, ROUTES, strict=True)]


def train(models, training, **kwargs):
    distiller = Distiller(students=[StudentSpec(name="s", model=models["student"])], teachers=teacher_specs(models),
                          combine="route", training=training, **kwargs)
    history = distiller.train(routed_batches())
    return distiller, [h["s/loss"] for h in history], [p.detach().clone() for p in distiller.student_model.parameters()]


def test_paged_routed_losses_equal_resident_teachers_bitwise(models, tmp_path):
    """Paging changes where a teacher's weights are, never their values, shapes or the kernels that read them (each
    tensor at a 256-byte-aligned offset, as an allocation is): the teachers' logits, so the losses and the trained
    student, are the resident teachers' to the bit. Teacher a pinned on the host, b and c on disk (a budget of a
    alone), two device slots; switches inside steps, at steps' starts and within a micro-batch of mixed rows."""
    replicated = DeepSpeedSettings(teacher_overrides={"zero_optimization.stage": 0})
    _, resident_losses, resident = train(models, TRAINING, deepspeed=replicated)
    a_bytes = sizes(models)["a"]
    paging = {"slots": 2, "host_gib": a_bytes / GIB, "disk_dir": str(tmp_path)}
    paged_training = dataclasses.replace(TRAINING, teacher_residency="paged", teacher_paging=paging)
    distiller, paged_losses, paged = train(models, paged_training)
    assert distiller.plan.paging.kept == {"a": "host", "b": "disk", "c": "disk"}
    assert paged_losses == resident_losses
    assert all(torch.equal(x, y) for x, y in zip(paged, resident, strict=True))
    stats = distiller.teachers.pager.stats
    assert stats["switches"] >= 6 and stats["prefetched"] >= 1, stats  # the next micro-batch's teacher, prefetched


def test_only_the_brought_teacher_has_weights_and_they_sit_in_a_slot(models, tmp_path):
    """At every teacher forward of a routed run, the teacher running has every tensor inside one of the pager's
    device slots, and every other teacher has none at all (empty placeholders): no storage beyond the slots."""
    paging = {"slots": 2, "disk_dir": str(tmp_path)}
    training = dataclasses.replace(TRAINING, max_steps=2, teacher_residency="paged", teacher_paging=paging)
    distiller = Distiller(students=[StudentSpec(name="s", model=models["student"])], teachers=teacher_specs(models),
                          combine="route", training=training)
    pager, members = distiller.teachers.pager, distiller.teachers.members
    seen = []

    def checked(name, forward):
        def run(inputs):
            slots = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.numel()) for s in pager.slots]
            for other, teacher in members.items():
                tensors = list(teacher.module.parameters()) + list(teacher.module.buffers())
                if other == name:
                    assert all(any(lo <= t.data_ptr() < hi for lo, hi in slots) for t in tensors)
                else:
                    assert all(t.numel() == 0 for t in tensors), other
            seen.append(name)
            return forward(inputs)
        return run

    for name, teacher in members.items():
        teacher.forward = checked(name, teacher.forward)
    distiller.train(routed_batches())
    assert seen == ["a", "a", "b", "b"]
    assert len(pager.slots) == 2


def test_a_pager_brings_one_module_at_a_time_with_one_slot():
    """One slot: the teacher brought in replaces the last; its values come back exactly, tied weights stay tied."""
    torch.manual_seed(0)
    modules = {n: GPT2LMHeadModel(gpt2_config(width=w, layers=1)).eval() for n, w in (("x", 32), ("y", 64))}
    modules["x"].lm_head.weight = modules["x"].transformer.wte.weight
    before = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in modules.items()}
    pager = Pager(torch.device("cpu"), slots=1)
    for name, module in modules.items():
        pager.adopt(name, module)
    assert all(p.numel() == 0 for m in modules.values() for p in m.parameters())
    for name in ("y", "x", "y"):
        pager.bring(name)
        other = "x" if name == "y" else "y"
        assert all(torch.equal(v, before[name][k]) for k, v in modules[name].state_dict().items())
        assert all(p.numel() == 0 for p in modules[other].parameters())
    assert modules["x"].lm_head.weight is modules["x"].transformer.wte.weight
    assert len(pager.slots) == 1 and pager.slots[0].buffer.numel() == max(x.nbytes for x in pager.layouts.values())
    assert Layout.of(modules["x"]).nbytes % 256 == 0


# ---- the plan's refusals, with faked memory figures -------------------------------------------------------------

def plan(models, monkeypatch, memory, combine="route", disk=10 * GIB, **training):
    monkeypatch.setattr(residency, "available_memory", lambda: memory)
    monkeypatch.setattr(residency, "disk_free", lambda folder: disk)
    return make_plan([StudentSpec(name="s", model=models["student"])], teacher_specs(models),
                     training=dataclasses.replace(TRAINING, **training), world_size=1, combine=combine)


def sizes(models):
    return {n: residency.teacher_bytes(kinds.describe(TeacherSpec(name=n, model=models[n])), "fp32")
            for n in ("a", "b", "c")}


def test_the_plan_places_teachers_host_first_then_disk(models, monkeypatch, tmp_path):
    size = sizes(models)
    memory = residency.Memory(device=GIB, host=size["a"] + size["b"] + max(size.values()) + residency.LOAD_MARGIN)
    made = plan(models, monkeypatch, memory, teacher_residency="paged",
                teacher_paging={"disk_dir": str(tmp_path)})
    assert made.paging.kept == {"a": "host", "b": "host", "c": "disk"}
    assert made.paging.bytes == size
    assert all(made.teacher_ds_configs[n]["zero_optimization"]["stage"] == 0 for n in "abc")  # replicated
    assert any(note.startswith("paged teachers: a (") for note in made.notes)


def test_the_plan_refuses_slots_the_device_cannot_hold(models, monkeypatch):
    largest = max(sizes(models).values())
    memory = residency.Memory(device=int(1.5 * largest), host=100 * GIB)
    with pytest.raises(ConfigError, match=r"needs 2 device slot\(s\) of the largest teacher .* free: set "
                                          r"training.teacher_paging.slots: 1"):
        plan(models, monkeypatch, memory, teacher_residency="paged")
    memory = residency.Memory(device=largest // 2, host=100 * GIB)
    with pytest.raises(ConfigError, match="use a device with more memory"):
        plan(models, monkeypatch, memory, teacher_residency="paged", teacher_paging={"slots": 1})


def test_the_plan_refuses_disk_copies_the_disk_cannot_hold(models, monkeypatch, tmp_path):
    memory = residency.Memory(device=GIB, host=0)  # nothing pinned: every teacher to disk
    with pytest.raises(ConfigError, match=r"teachers \['a', 'b', 'c'\] .* do not fit the pinned host budget .* "
                                          r"has 0.0 GiB free: point disk_dir at a disk"):
        plan(models, monkeypatch, memory, disk=0, teacher_residency="paged",
             teacher_paging={"disk_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="host_gib: 64 GiB, and the host has 1.0 GiB available per rank"):
        plan(models, monkeypatch, residency.Memory(device=GIB, host=GIB), teacher_residency="paged",
             teacher_paging={"host_gib": 64})


def test_the_plan_refuses_paging_without_route_and_resident_teachers_the_device_cannot_hold(models, monkeypatch):
    with pytest.raises(ConfigError, match="combine: sum runs every teacher on every micro-batch: use combine: route"):
        plan(models, monkeypatch, residency.Memory(device=GIB, host=GIB), combine="sum", teacher_residency="paged")
    monkeypatch.setattr(residency.torch.cuda, "is_available", lambda: True)  # the figures a GPU would give
    with pytest.raises(ConfigError, match=r"resident needs .* of teacher weights on each device .* use "
                                          r"training.teacher_residency: paged"):
        plan(models, monkeypatch, residency.Memory(device=1000, host=GIB))
    with pytest.raises(ConfigError, match="offload keeps .* in pinned host memory"):
        plan(models, monkeypatch, residency.Memory(device=GIB, host=1000), teacher_residency="offload")
    made = plan(models, monkeypatch, residency.Memory(device=GIB, host=GIB), teacher_residency="offload")
    offload = made.teacher_ds_configs["a"]["zero_optimization"]
    assert offload["stage"] == 3 and offload["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_the_disk_dir_must_be_writable_and_is_refused_before_anything_is_written(models, monkeypatch, tmp_path):
    """A read-only disk_dir (a read-only mount refuses even root, so os.access is faked here) is the plan's
    refusal, made before the Distiller builds anything and before the CLI claims its output folder: nothing is
    written in disk_dir. A disk_dir no teacher is kept in is not asked about."""
    denied = str(tmp_path)
    real_access = os.access
    monkeypatch.setattr(residency.os, "access", lambda path, mode: str(path) != denied and real_access(path, mode))
    memory = residency.Memory(device=GIB, host=0)  # nothing pinned: every teacher to disk
    with pytest.raises(ConfigError, match=r"training.teacher_paging.disk_dir: '.*' cannot be written to .* teachers "
                                          r"\['a', 'b', 'c'\] .* point disk_dir at a folder this user can write"):
        plan(models, monkeypatch, memory, teacher_residency="paged", teacher_paging={"disk_dir": denied})
    training = dataclasses.replace(TRAINING, teacher_residency="paged", teacher_paging={"disk_dir": denied})
    with pytest.raises(ConfigError, match="cannot be written to"):
        Distiller(students=[StudentSpec(name="s", model=models["student"])], teachers=teacher_specs(models),
                  combine="route", training=training)
    assert list(tmp_path.iterdir()) == []
    roomy = residency.Memory(device=GIB, host=100 * GIB)  # every teacher pinned: disk_dir unused
    assert set(plan(models, monkeypatch, roomy, teacher_residency="paged",
                    teacher_paging={"disk_dir": denied}).paging.kept.values()) == {"host"}


def _dies(folder: paged.CopyFolder) -> None:
    """What a kill -9 leaves: the folder, its lock released by the kernel, no exit handler run."""
    folder._finalizer.detach()
    os.close(folder.lock)


def test_the_next_start_removes_only_copies_whose_owner_is_gone(tmp_path, caplog):
    """In disk_dir: a dead run's copies (marker, free lock), a live run's (lock held, here by this process through
    another open file), one from another host, the user's folder named like a pager's but without the marker, and
    the user's other files. A new pager removes the dead run's copies alone and logs them with their size; its own
    copies go when it closes."""
    dead = paged.CopyFolder(tmp_path)
    (dead.path / "a.bin").write_bytes(bytes(3 * 2**20))
    _dies(dead)
    live = paged.CopyFolder(tmp_path)
    (live.path / "b.bin").write_bytes(b"live")
    remote = paged.CopyFolder(tmp_path)
    marker = remote.path / paged.MARKER
    marker.write_text(marker.read_text().replace('"host": "', '"host": "another-host-'))
    _dies(remote)
    lookalike = tmp_path / f"{paged.PREFIX}4242-mine"
    lookalike.mkdir()
    (lookalike / paged.LOCK).write_text("")  # a lock file but no marker: not the project's
    (tmp_path / "notes").mkdir()
    (tmp_path / "distill_kit_paged_a_7f00.bin").write_bytes(b"a user's file")
    with caplog.at_level(logging.WARNING, logger=paged.__name__):
        pager = Pager(torch.device("cpu"), disk_dir=tmp_path)
    assert not dead.path.exists()
    assert all(p.exists() for p in (live.path / "b.bin", remote.path, lookalike, tmp_path / "notes",
                                    tmp_path / "distill_kit_paged_a_7f00.bin"))
    assert f"removed {dead.path} (3.0 MiB)" in caplog.text
    assert "runs on other hosts, left as they are" in caplog.text and str(remote.path) in caplog.text
    assert "1 file(s) named like an earlier distill-kit's disk copies (distill_kit_paged_a_7f00.bin" in caplog.text
    torch.manual_seed(0)
    pager.adopt("x", GPT2LMHeadModel(gpt2_config(width=32, layers=1)), kept="disk")
    own = pager.folder.path
    assert (own / "x.bin").is_file() and (own / paged.MARKER).is_file()
    assert paged.remove_abandoned(tmp_path) == []  # a live pager's folder (and the live run's) are kept
    pager.close()
    assert not own.exists() and live.path.exists()
    live.remove()
    assert not live.path.exists()


KILLED = """
import sys, time, torch
from torch import nn
from distill_kit.teachers.paged import Pager
pager = Pager(torch.device("cpu"), disk_dir=sys.argv[1])
pager.adopt("t", nn.Linear(64, 64), kept="disk")
print("FOLDER", pager.folder.path, flush=True)
time.sleep(120)
"""


def test_a_run_killed_with_sigkill_leaves_copies_the_next_start_removes(tmp_path):
    """A real process holding a pager's disk copy, killed with SIGKILL (no handler runs): its folder stays, and the
    next pager on the same disk_dir removes it."""
    process = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                               env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        line = next(line for line in process.stdout if line.startswith("FOLDER "))  # after any import's chatter
        folder = Path(line.removeprefix("FOLDER ").strip())
        assert (folder / "t.bin").is_file()
        pager = Pager(torch.device("cpu"), disk_dir=tmp_path)  # the owner lives: kept
        assert folder.exists()
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    deadline = time.monotonic() + 10
    while folder.exists() and time.monotonic() < deadline:  # the kernel releases the lock as the process goes
        Pager(torch.device("cpu"), disk_dir=tmp_path).close()
        time.sleep(0.1)
    assert not folder.exists() and list(tmp_path.iterdir()) == []
    pager.close()

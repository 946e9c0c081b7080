"""Paged routed teachers (``training.teacher_residency: paged``): the same losses as resident teachers, one teacher on
the device slots at a time, and every residency that cannot fit refused by the plan before anything loads.

In one process on the CPU (device = cpu: the device slots are host buffers and the copies synchronous, through the
same code as on a GPU).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import gpt2_config, random_batches
from transformers import GPT2LMHeadModel

from distill_kit import DeepSpeedSettings, Distiller, StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.errors import ConfigError
from distill_kit.teachers import kinds, residency
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

"""The reliability pieces on their own, in one process: checkpoint files, the output-directory guard, random
generators, the teacher fingerprint, non-finite steps, signals, and the bad-input checks they add."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from launch import clean_environment
from torch import nn

from distill_kit import TrainingConfig
from distill_kit.engines import fingerprint
from distill_kit.errors import CheckpointError
from distill_kit.training import checkpoint
from distill_kit.training.loop import Trainer
from distill_kit.training.nonfinite import NonFiniteError, NonFiniteSteps, poison_if_not_finite
from distill_kit.training.plan import vocabulary_problems
from distill_kit.training.preemption import StopRequest

HASH = "a" * 64


class FakeEngine:
    """Writes and reads one weights file the way DeepSpeed's engine does: under ``<dir>/<tag>``."""

    def __init__(self, weights: bytes = b"weights"):
        self.weights, self.loaded_from = weights, None

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        (Path(save_dir) / tag).mkdir(parents=True)
        (Path(save_dir) / tag / "model_states.pt").write_bytes(self.weights)

    def load_checkpoint(self, load_dir: str, tag: str):
        self.loaded_from = Path(load_dir) / tag
        return str(self.loaded_from), {}


def save(directory: Path, step: int, keep_last: int = 2, engine: FakeEngine | None = None) -> Path:
    return checkpoint.save(directory, engine or FakeEngine(), step=step, trainer_state={"step": step, "history": []},
                           rank_state={"data": step}, teacher_sha256=HASH, keep_last=keep_last)


def _names(folder: Path) -> list[str]:
    """What a checkpoint folder holds, less its lock file (held during each save)."""
    return sorted(p.name for p in folder.iterdir() if p.name != checkpoint.LOCK)


def test_save_writes_everything_then_the_manifest_and_keeps_the_last_n(tmp_path):
    for step in (1, 2, 3):
        path = save(tmp_path, step)
    assert path == tmp_path / "step_00000003"
    assert _names(tmp_path) == ["step_00000002", "step_00000003"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["teacher_sha256"] == HASH and manifest["world_size"] == 1
    assert set(manifest["files"]) == {"deepspeed/model_states.pt", "rank00000.json", "rank00000.safetensors",
                                      "trainer_state.json"}
    assert checkpoint.verify(path) is None


def test_a_complete_checkpoint_of_the_same_step_is_kept_and_leftovers_are_cleared(tmp_path):
    first = save(tmp_path, 4, engine=FakeEngine(b"first"))
    (tmp_path / ".partial-step_00000009").mkdir()  # what a killed save leaves
    save(tmp_path, 4, engine=FakeEngine(b"second"))
    assert (first / "deepspeed/model_states.pt").read_bytes() == b"first"
    assert not (tmp_path / ".partial-step_00000009").exists()


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda p: (p / "manifest.json").unlink(), "no manifest"),
    (lambda p: (p / "rank00000.json").unlink(), "rank00000.json is missing"),
    (lambda p: (p / "deepspeed/model_states.pt").write_bytes(b"weightz"), "does not match its sha256"),
    (lambda p: (p / "deepspeed/model_states.pt").write_bytes(b"w"), "has 1 bytes, the manifest says 7"),
    (lambda p: (p / "manifest.json").write_text("{"), "manifest is unreadable"),
])
def test_incomplete_or_corrupt_checkpoints_are_skipped_with_a_warning(tmp_path, caplog, damage, reason):
    save(tmp_path, 1)
    damage(save(tmp_path, 2))
    (tmp_path / ".partial-step_00000003").mkdir()
    with caplog.at_level(logging.WARNING, logger="distill_kit.training.checkpoint"):
        assert checkpoint.latest_complete(tmp_path) == tmp_path / "step_00000001"
    assert reason in caplog.text
    assert ".partial-step_00000003: a save that did not finish" in caplog.text
    assert checkpoint.latest_complete(tmp_path / "nothing-here") is None


def test_load_refuses_another_teacher_or_world_size_before_touching_the_engine(tmp_path):
    path = save(tmp_path, 1)
    engine = FakeEngine()
    with pytest.raises(ValueError, match=f"teacher sha256 {HASH}, but this run's teacher is sha256 {'b' * 64}"):
        checkpoint.load(path, engine, teacher_sha256="b" * 64)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(manifest | {"world_size": 2}))
    with pytest.raises(ValueError, match="written by 2 ranks; this run has 1. Resume on 2 ranks"):
        checkpoint.load(path, engine, teacher_sha256=HASH)
    assert engine.loaded_from is None
    (path / "manifest.json").write_text(json.dumps(manifest))
    trainer_state, rank_state = checkpoint.load(path, engine, teacher_sha256=HASH)
    assert trainer_state["step"] == 1 and rank_state == {"data": 1}
    assert engine.loaded_from == path / "deepspeed"


def test_a_group_checkpoint_keeps_each_engine_in_its_folder_under_one_manifest(tmp_path):
    group = {"small": FakeEngine(b"s"), "big": FakeEngine(b"b")}
    path = checkpoint.save(tmp_path, group, step=2, trainer_state={"step": 2}, rank_state={"data": 2},
                           teacher_sha256=None, keep_last=1)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["models"] == ["big", "small"] and manifest["teacher_sha256"] is None
    assert set(manifest["files"]) == {"big/model_states.pt", "small/model_states.pt", "rank00000.json",
                                      "rank00000.safetensors", "trainer_state.json"}
    loaded = {"small": FakeEngine(), "big": FakeEngine()}
    assert checkpoint.load(path, loaded, teacher_sha256=None)[0] == {"step": 2}
    assert loaded["big"].loaded_from == path / "big" and loaded["small"].loaded_from == path / "small"
    other = {"small": FakeEngine(), "tiny": FakeEngine()}
    with pytest.raises(ValueError, match=r"models \['big', 'small'\], but this run trains \['small', 'tiny'\]"):
        checkpoint.load(path, other, teacher_sha256=None)
    with pytest.raises(ValueError, match="single Distiller's is 'deepspeed'"):
        checkpoint.load(path, FakeEngine(), teacher_sha256=None)
    assert all(engine.loaded_from is None for engine in other.values())
    with pytest.raises(ValueError, match=r"models named \['manifest.json'\] would clash"):
        checkpoint.save(tmp_path, {"manifest.json": FakeEngine()}, step=3, trainer_state={}, rank_state={},
                        teacher_sha256=None, keep_last=1)


def test_random_generators_round_trip(tmp_path):
    random.gauss(0, 1), np.random.randn()  # cached Gaussians are part of the state too
    state = checkpoint.capture_rng()
    first = [random.random(), np.random.rand(), torch.rand(3), random.gauss(0, 1), np.random.randn()]
    path = checkpoint.save(tmp_path, FakeEngine(), step=1, trainer_state={}, rank_state={"rng": state},
                           teacher_sha256=None, keep_last=1)
    checkpoint.restore_rng(checkpoint.load(path, FakeEngine(), teacher_sha256=None)[1]["rng"])  # via JSON files
    again = [random.random(), np.random.rand(), torch.rand(3), random.gauss(0, 1), np.random.randn()]
    assert first[:2] + first[3:] == again[:2] + again[3:] and torch.equal(first[2], again[2])


def test_teacher_fingerprint_names_the_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    before = fingerprint.teacher_fingerprint(model)
    assert fingerprint.teacher_fingerprint(model) == before
    with torch.no_grad():
        model[1].bias[0] += 1e-7
    assert fingerprint.teacher_fingerprint(model) != before


def test_a_non_finite_loss_gets_non_finite_gradients_and_a_finite_one_is_untouched():
    weight = torch.tensor([2.0], requires_grad=True)
    loss = (weight * 3).sum()
    assert poison_if_not_finite(loss).item() == loss.item()
    poison_if_not_finite(loss).backward()
    assert weight.grad.item() == 3.0
    weight.grad = None
    poison_if_not_finite((weight * float("inf")).sum() - float("inf")).backward()
    assert weight.grad.isnan().all()


def test_non_finite_steps_are_counted_then_stop_the_run_naming_step_and_part():
    guard = NonFiniteSteps(stop_after=2)
    assert guard.counts(1, {"loss": 1.0, "kl": 1.0}, applied=True)
    assert not guard.counts(2, {"loss": float("nan"), "kl": float("nan"), "ce": 1.0}, applied=False)
    assert guard.counts(2, {"loss": 1.0}, applied=True)  # a good step resets the run of bad ones
    assert not guard.counts(3, {"loss": 1.0}, applied=False)  # finite loss, non-finite gradient
    with pytest.raises(NonFiniteError, match=r"step 3: non-finite kl, loss on at least one rank; 2 bad steps"):
        guard.counts(3, {"loss": float("inf"), "kl": float("inf"), "ce": 1.0}, applied=False)
    assert guard.skipped == 3
    scaled = NonFiniteSteps(stop_after=1, loss_scaling=True)  # fp16: a scaler overflow is routine
    assert not scaled.counts(1, {"loss": 1.0}, applied=False) and scaled.skipped == 0
    with pytest.raises(NonFiniteError, match="step 5: non-finite loss .* the optimizer step was taken anyway"):
        NonFiniteSteps(stop_after=3).counts(5, {"loss": float("nan")}, applied=True)  # e.g. ZeRO stage 0, fp32


def test_a_group_skips_a_step_only_when_every_model_discarded_it():
    guard = NonFiniteSteps(stop_after=3)
    record = {"small/loss": 1.0, "big/loss": float("nan"), "big/kl": float("nan")}
    assert guard.all_or_none(4, {"small": True, "big": True}, record)
    assert not guard.all_or_none(4, {"small": False, "big": False}, record)
    with pytest.raises(NonFiniteError, match=r"step 4: models \['big'\] discarded their optimizer step \(non-finite "
                                             r"big/kl, big/loss on at least one rank\) while \['small'\] took theirs"):
        guard.all_or_none(4, {"small": True, "big": False}, record)
    finite = {"small/loss": 1.0, "big/loss": 2.0}
    with pytest.raises(NonFiniteError, match="a non-finite gradient with a finite loss"):
        guard.all_or_none(4, {"small": True, "big": False}, finite)
    # fp16: a model's loss-scale overflow (finite loss) drops only its update; a NaN loss still stops the run
    scaled = NonFiniteSteps(stop_after=3, loss_scaling=True)
    assert scaled.all_or_none(4, {"small": True, "big": False}, finite)
    with pytest.raises(NonFiniteError, match=r"models \['big'\] discarded"):
        scaled.all_or_none(4, {"small": True, "big": False}, record)


@pytest.fixture()
def python_sigint():
    """Python's own Ctrl-C handler while the test runs (a pytest-xdist worker ignores SIGINT): what a run has."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_signal_becomes_a_request_and_a_second_one_interrupts(python_sigint):
    previous = signal.getsignal(signal.SIGINT)
    with StopRequest(torch.device("cpu")) as stop:
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGTERM" and stop.agreed()
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is previous


@pytest.mark.parametrize("field", ["save_every", "keep_checkpoints", "max_bad_steps", "max_steps", "lr"])
def test_training_settings_out_of_range_are_named(field):
    with pytest.raises(ValueError, match=f"invalid training settings: {field}=-1"):
        TrainingConfig(**{field: -1})


def test_a_student_vocabulary_larger_than_the_teachers_is_refused():
    (problem,) = vocabulary_problems(120, 96, "student")
    assert "vocabulary (120) is larger than the teacher's (96)" in problem
    assert vocabulary_problems(96, 128, "student") == []  # a padded teacher vocabulary is cut by the losses


def _reseal(path: Path, **manifest_changes) -> None:
    """Recompute a checkpoint's manifest over its files, as someone handing over a crafted directory would."""
    manifest = json.loads((path / "manifest.json").read_text()) | manifest_changes
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest["files"] = {str(p.relative_to(path)): {"bytes": p.stat().st_size, "sha256": checkpoint.file_sha256(p)}
                         for p in files}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_corrupt_checkpoints_never_push_out_the_one_just_written(tmp_path, caplog):
    """Corrupt checkpoints of later steps take none of the kept places: each new one stays, older ones go."""
    for step in (5, 6):
        (save(tmp_path, step) / "deepspeed/model_states.pt").write_bytes(b"weightz")
    save(tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="distill_kit.training.checkpoint"):
        save(tmp_path, 2)
        save(tmp_path, 3)
    assert _names(tmp_path) == ["step_00000002", "step_00000003", "step_00000005",
                                                           "step_00000006"]
    assert "step_00000006 is corrupt (deepspeed/model_states.pt does not match its sha256" in caplog.text
    # A verified checkpoint of a later step does not push out the one just written either.
    save(tmp_path / "later", 9)
    save(tmp_path / "later", 8)
    save(tmp_path / "later", 4, keep_last=1)
    assert _names(tmp_path / "later") == ["step_00000004", "step_00000009"]


class _OneEngineTrainer(Trainer):
    def __init__(self, directory: Path):
        super().__init__(TrainingConfig(checkpoint_dir=str(directory)))
        self.engine = FakeEngine()

    def engines(self):
        return {"": self.engine}


def test_resume_refuses_a_folder_whose_checkpoints_are_all_corrupt(tmp_path):
    trainer = _OneEngineTrainer(tmp_path)
    assert trainer.resume() is None  # nothing saved yet: a fresh start
    (save(tmp_path, 3) / "rank00000.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no checkpoint in .* can be loaded: .*step_00000003: rank00000.json has 2 "
                                         r"bytes.* restore it from a copy, or start a new run"):
        trainer.resume()
    assert trainer.step == 0 and trainer.engine.loaded_from is None


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_state_file_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    path = save(tmp_path / "ckpt", 1)
    # The pickle format of older checkpoints is read with weights_only: a payload that runs code is refused ...
    torch.save({"rng": _RunsCode(marker)}, path / "rank00000.pt")
    _reseal(path, format=1)
    engine = FakeEngine()
    with pytest.raises(ValueError, match="refusing .*rank00000.pt: it holds more than plain state"):
        checkpoint.load(path, engine, teacher_sha256=HASH)
    assert not marker.exists() and engine.loaded_from is None
    # ... and today's format never unpickles anything, whatever files a directory holds.
    _reseal(path, format=checkpoint.FORMAT)
    assert checkpoint.load(path, engine, teacher_sha256=HASH)[1] == {"data": 1}
    assert not marker.exists()


def test_an_older_pickled_state_still_resumes_exactly(tmp_path):
    path = save(tmp_path, 1)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expected = [random.random(), np.random.rand(), torch.rand(3)]
    torch.save({"rng": state, "micro_batches_seen": 4, "loader": None}, path / "rank00000.pt")
    for name in ("rank00000.json", "rank00000.safetensors"):
        (path / name).unlink()
    _reseal(path, format=1)
    rank_state = checkpoint.load(path, FakeEngine(), teacher_sha256=HASH)[1]
    checkpoint.restore_rng(rank_state["rng"])
    again = [random.random(), np.random.rand(), torch.rand(3)]
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2]) and rank_state["micro_batches_seen"] == 4


def test_rank_state_holds_only_json_and_tensors(tmp_path):
    with pytest.raises(TypeError, match=r"rank state .data: a set cannot be stored safely"):
        checkpoint.save(tmp_path, FakeEngine(), step=1, trainer_state={}, rank_state={"data": {1}},
                        teacher_sha256=None, keep_last=1)


def test_a_second_ctrl_c_interrupts_through_nested_stop_requests(python_sigint):
    """The CLI holds a request around the loop's own: the second Ctrl-C must still interrupt, and a second
    SIGTERM must still end the process (the handler from before both is put back)."""
    previous = signal.getsignal(signal.SIGINT)
    with StopRequest(torch.device("cpu")) as outer:
        with pytest.raises(KeyboardInterrupt), StopRequest(torch.device("cpu")) as inner:
            os.kill(os.getpid(), signal.SIGINT)
            assert inner.received == outer.received == "SIGINT"
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is previous
    code = ("import os, signal, time, torch\n"
            "from distill_kit.training.preemption import StopRequest\n"
            "with StopRequest(torch.device('cpu')), StopRequest(torch.device('cpu')):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(1)\n"
            "print('survived')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=clean_environment() | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == -signal.SIGTERM and "survived" not in done.stdout, done.stderr


class _FullDisk(FakeEngine):
    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos; basic_ios::clear: iostream "
                           "error")


def test_a_failed_save_names_the_folder_the_cause_and_the_free_space(tmp_path, monkeypatch):
    """One message, no chained tracebacks (``from None``); a full disk says so even when DeepSpeed's C++ writer
    reports only an iostream error."""
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*\.partial-step_00000004: RuntimeError: "
                                              r".*iostream error\. [0-9.]+ GB free on the disk of .*free space or "
                                              r"choose another") as raised:
        save(tmp_path, 4, engine=_FullDisk())
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    monkeypatch.setattr(checkpoint, "free_bytes", lambda directory: 4096)  # the disk filled during the save
    with pytest.raises(CheckpointError, match=r"partial-step_00000004: no space left on device\. "):
        save(tmp_path, 4, engine=_FullDisk())
    monkeypatch.undo()
    save(tmp_path, 5)  # the next save clears what the failed one left
    assert _names(tmp_path) == ["step_00000005"]


class _Vanished(FakeEngine):
    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        raise FileNotFoundError(2, "No such file or directory", f"{save_dir}/{tag}/mp_rank_00_model_states.pt")


class _ReadOnly(FakeEngine):
    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        raise PermissionError(13, "Permission denied", save_dir)


def test_a_failed_save_names_its_real_cause_not_the_disk(tmp_path):
    """A file deleted under the save (another process cleaning the folder) or a refused permission is said as
    such, with its own fix: not "free space", on a disk with plenty of it."""
    with pytest.raises(CheckpointError) as raised:
        save(tmp_path, 4, engine=_Vanished())
    message = str(raised.value)
    assert "FileNotFoundError" in message and "went away while it was written" in message
    assert "training.checkpoint_dir nothing else writes" in message and "free space" not in message
    with pytest.raises(CheckpointError, match=r"PermissionError: .*make .* writable") as raised:
        save(tmp_path, 4, engine=_ReadOnly())
    assert "free space" not in str(raised.value)


class _DeepSpeedLikeEngine(FakeEngine):
    """Saves and loads its weights through DeepSpeed's own checkpoint engine, as a real engine does."""

    def __init__(self, payload: object):
        super().__init__()
        self.payload, self.checkpoint_engine, self.loaded = payload, TorchCheckpointEngine(), None

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        (Path(save_dir) / tag).mkdir(parents=True)
        self.checkpoint_engine.save(self.payload, str(Path(save_dir) / tag / "optim_states.pt"))

    def load_checkpoint(self, load_dir: str, tag: str):
        self.loaded = self.checkpoint_engine.load(str(Path(load_dir) / tag / "optim_states.pt"))
        return super().load_checkpoint(load_dir, tag)


def test_deepspeed_files_are_read_without_running_code(tmp_path):
    """DeepSpeed unpickles its files with weights_only=False; during load() they are read with weights_only and
    only the plain types its ZeRO states hold."""
    state = {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0), "exp_avg": torch.ones(3)}
    path = checkpoint.save(tmp_path / "ckpt", _DeepSpeedLikeEngine(state), step=1, trainer_state={}, rank_state={},
                           teacher_sha256=None, keep_last=1)
    engine = _DeepSpeedLikeEngine(None)
    checkpoint.load(path, engine, teacher_sha256=None)
    assert engine.loaded["zero_stage"] is ZeroStageEnum.gradients and torch.equal(engine.loaded["exp_avg"],
                                                                                  torch.ones(3))
    assert engine.checkpoint_engine.load.__func__ is TorchCheckpointEngine.load  # DeepSpeed's own again after
    marker = tmp_path / "ran"
    torch.save({"exp_avg": _RunsCode(marker)}, path / "deepspeed/optim_states.pt")
    _reseal(path)
    with pytest.raises(ValueError, match="refusing DeepSpeed checkpoint file .*optim_states.pt: it holds more than"):
        checkpoint.load(path, _DeepSpeedLikeEngine(None), teacher_sha256=None)
    assert not marker.exists()

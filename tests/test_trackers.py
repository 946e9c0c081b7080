"""Trackers of ``report_to``: each writes the run config as parameters and every scalar by step to a local store,
and a resumed run continues the same tracker run. MLflow and W&B are the real libraries (offline); TensorBoard is
not installed here, so it is checked against a stand-in ``SummaryWriter``."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from launch import clean_environment

from distill_kit.run import run_config, trackers
from distill_kit.run.log import RunLog

PARAMS = run_config.to_dict(run_config.RunConfig())


def write_run(directory: Path, report_to: list[str]) -> tuple[dict, dict]:
    """Three steps and an evaluation; then resumed at step 2 and step 3 logged again. Returns the run ids (first
    and resumed) by tracker."""
    log = RunLog(directory, report_to=report_to, params=PARAMS)
    for step in (1, 2, 3):
        log.step({"step": step, "small/loss": 1.0 / step, "small/lr": 0.1, "skipped_steps": 0})
    log.evaluation(3, {"small": {"perplexity": 12.5}, "teacher": {"perplexity": 4.0}})
    first = {name: t.run_id for name, t in zip(report_to, log.trackers, strict=True)}
    log.close()
    resumed = RunLog(directory, resumed_at=2, report_to=report_to, params=PARAMS)
    resumed.step({"step": 3, "small/loss": 0.25, "small/lr": 0.1, "skipped_steps": 0})
    again = {name: t.run_id for name, t in zip(report_to, resumed.trackers, strict=True)}
    resumed.close()
    return first, again


def test_mlflow_writes_params_and_metrics_to_a_local_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first, again = write_run(tmp_path / "run", ["mlflow"])
    assert first == again  # the resumed run continues the same MLflow run
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    run = client.get_run(first["mlflow"])
    assert run.data.params["training.max_steps"] == str(PARAMS["training"]["max_steps"])
    assert run.data.params["students.0.name"] == PARAMS["students"][0]["name"]
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/small/loss")]
    assert sorted(history) == [(1, 1.0), (2, 0.5), (3, 0.25), (3, 1 / 3)]  # step 3 again after the resume
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/small/perplexity")] == [
        (3, 12.5)]
    assert run.info.status == "FINISHED"


WANDB_RUN = """
import json, sys
from pathlib import Path
from distill_kit.run import run_config
from distill_kit.run.log import RunLog
log = RunLog(Path(sys.argv[1]), report_to=["wandb"], params=run_config.to_dict(run_config.RunConfig()))
run = log.trackers[0].run
seen = {"mode": run.settings.mode, "max_steps": run.config["training"]["max_steps"]}
log.step({"step": 1, "small/loss": 0.123456, "skipped_steps": 0})
log.close()
print(json.dumps(seen))
"""


def test_wandb_writes_an_offline_run_with_the_config(tmp_path):
    """In a fresh interpreter: W&B's background service shares the process with whatever ran before."""
    pytest.importorskip("wandb")
    env = {k: v for k, v in clean_environment().items() if k != "WANDB_MODE"} | {  # offline by default
        "WANDB_SILENT": "true", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    directory = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", WANDB_RUN, str(directory)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"mode": "offline", "max_steps": PARAMS["training"]["max_steps"]}
    files = list((directory / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    data = files[0].read_bytes()  # W&B's record log: protobuf, whose strings are stored as written
    assert b"train/small/loss" in data and b"0.123456" in data and b"max_steps" in data
    assert trackers.IDS_FILE in {p.name for p in directory.iterdir()}


def test_tensorboard_gets_every_scalar_and_drops_steps_past_a_resume(tmp_path, monkeypatch):
    calls: list[tuple] = []

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            calls.append(("open", Path(log_dir).name, purge_step))

        def add_text(self, tag, text, step):
            calls.append(("text", tag, "training.max_steps" in text))

        def add_scalar(self, tag, value, step):
            calls.append(("scalar", tag, value, step))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    write_run(tmp_path / "run", ["tensorboard"])
    assert calls[:2] == [("open", "tensorboard", None), ("text", "run_config", True)]
    assert ("scalar", "train/small/loss", 0.5, 2) in calls and ("scalar", "eval/teacher/perplexity", 4.0, 3) in calls
    assert ("open", "tensorboard", 2) in calls  # the resumed writer purges steps after 2
    assert not any(c[0] == "scalar" and c[1] == "train/step" for c in calls)


def test_the_default_opens_tensorboard_only_when_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert trackers.check(None) == []
    assert trackers.check(["none"]) == [] and trackers.check([]) == []


def test_bad_report_to_is_a_config_error_before_any_work(tmp_path, monkeypatch):
    """One of the CLI's up-front checks (validate.py: they run before anything is loaded or written)."""
    from distill_kit.run import validate

    config = run_config.load(None, ["report_to=[wandb, neptune]", f"output_dir={tmp_path / 'a'}"])
    assert validate.check_trackers(validate.Start(config, False, {})) == [
        "report_to: unknown trackers ['neptune']; choose from ['mlflow', 'tensorboard', 'wandb'], or [] for none"]
    monkeypatch.setitem(sys.modules, "mlflow", None)
    config = run_config.load(None, ["report_to=[mlflow]", f"output_dir={tmp_path / 'b'}"])
    (problem,) = validate.check_trackers(validate.Start(config, False, {}))
    assert "not installed: mlflow (pip install distill-kit[mlflow])" in problem
    assert validate.check_trackers in validate.CHECKS

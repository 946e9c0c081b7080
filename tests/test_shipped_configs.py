"""Every config the project ships passes every start-up check, the CLI's own way: a field renamed or a rule added
without the shipped configs following would otherwise reach their users as a refusal (or worse) at their first run.

Each config runs through ``cli.main`` up to the point where work would start (the data phase, or a task benchmark's
first recipe), where the test stops it: every check before it ran and passed, nothing is trained."""

from __future__ import annotations

from pathlib import Path

import pytest

from distill_kit.run import cli, task_benchmark

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml"))


class _WorkWouldStart(Exception):
    pass


def _stop(*args, **kwargs):
    raise _WorkWouldStart


def test_the_configs_are_found():
    assert {"configs/arithmetic.yaml", "configs/runs/drafter.yaml"} <= set(CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
def test_a_shipped_config_passes_every_check(config, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "prepare_loaders", _stop)
    monkeypatch.setattr(task_benchmark, "run", _stop)
    with pytest.raises(_WorkWouldStart):
        cli.main(["--config", str(ROOT / config), "--output_dir", str(tmp_path / "run")])
    out = tmp_path / "run"  # the checks wrote nothing (a task benchmark has locked its folder by then)
    assert not out.exists() or [p.name for p in out.iterdir()] == [".distill-kit.lock"]

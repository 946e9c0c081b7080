"""What a user reads: no library's deprecation warning at every run, and the task grid refuses an override that
would silently replace each cell's own seed (or recipe, folder, config)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launch import clean_environment

ROOT = Path(__file__).resolve().parents[1]


def test_deepspeeds_deprecated_gather_prints_nothing_and_other_warnings_still_do():
    """DeepSpeed's ZeRO-3 gathers call torch's deprecated ``all_gather_into_tensor``: the real call, through the
    run's own start-up, prints no warning; a deprecation of ours (another message) still does."""
    code = ("import warnings, torch, torch.distributed as dist\n"
            "from distill_kit.engines import distributed\n"
            "distributed.init()\n"
            "out = torch.zeros(2)\n"
            "dist.all_gather_into_tensor(out, torch.ones(2))\n"
            "warnings.warn('old_setting is deprecated', FutureWarning)\n"
            "print('gathered', out.tolist())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=clean_environment())
    assert done.returncode == 0 and "gathered [1.0, 1.0]" in done.stdout, done.stderr[-2000:]
    assert "all_gather_into_tensor` is deprecated" not in done.stderr
    assert "old_setting is deprecated" in done.stderr


def test_the_task_grid_refuses_a_seed_override_before_any_cell_runs(tmp_path):
    """The CLI path: one clear line, exit 2 (argparse's), no traceback, no folder."""
    out = tmp_path / "grid"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/task_grid.py"), "--out", str(out), "--seeds", "0",
                           "--training.max_steps", "2", "--task.seeds", "[7]"], capture_output=True, text=True,
                          timeout=300, env=clean_environment())
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--task.seeds: each cell sets task.seeds itself" in done.stderr and "give --seeds instead" in done.stderr
    assert not out.exists()  # refused before any cell ran or any folder was made


@pytest.mark.parametrize("override, option", [
    (["--task.seeds=[7]"], "--seeds"), (["task.seeds=[7]"], "--seeds"), (["--training.seed", "7"], "--seeds"),
    (["--task.recipes", "[sft]"], "--recipes"), (["--output_dir", "elsewhere"], "--out"),
    (["--config", "x"], "--config")])
def test_the_task_grid_names_each_key_a_cell_sets(override, option):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import task_grid

    (problem,) = task_grid.overridden_cell_keys(override)
    assert "each cell sets" in problem and f"give {option} instead" in problem


def test_the_task_grid_keeps_other_overrides():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import task_grid

    assert task_grid.overridden_cell_keys(["--training.max_steps", "2", "--task.labelled", "8", "data.seed=3"]) == []

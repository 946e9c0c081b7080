"""Every seed a run config takes is refused outside what numpy's generators take (0 .. 2**32 - 1) when the config
is read: before anything is written, not once the run has begun (numpy raises from ``np.random.seed``)."""

from __future__ import annotations

import numpy as np
import pytest

from distill_kit.config import SEEDS, TaskConfig, TrainingConfig
from distill_kit.data.blocks import DataConfig
from distill_kit.errors import ConfigError
from distill_kit.run import cli, run_config

KEYS = {"training.seed": "--training.seed", "data.seed": "--data.seed", "eval.harness.seed": "--eval.harness.seed"}


def test_the_range_is_numpys():
    np.random.seed(SEEDS - 1)
    with pytest.raises(ValueError):
        np.random.seed(SEEDS)


@pytest.mark.parametrize("key", sorted(KEYS))
@pytest.mark.parametrize("value", [str(SEEDS), str(2**64), "-1"])
def test_every_seed_key_is_refused_outside_numpys_range(key, value):
    with pytest.raises(ConfigError, match=f"{key}: {value} is not a seed; give a whole number from 0 to 4294967295"):
        run_config.load(None, [KEYS[key], value])
    assert run_config.load(None, [KEYS[key], str(SEEDS - 1)]) is not None


def test_task_seeds_name_the_bad_one():
    with pytest.raises(ConfigError, match=r"task.seeds\[1\]: 4294967296 is not a seed; give a whole number from 0"):
        run_config.load(None, ["--task.seeds", f"[0, {SEEDS}]"])
    with pytest.raises(ConfigError, match=r"task.seeds\[0\]: True is not a seed"):
        TaskConfig(seeds=(True,))
    with pytest.raises(ConfigError, match="training.seed: 4294967296 is not a seed"):
        TrainingConfig(seed=SEEDS)
    with pytest.raises(ConfigError, match="data.seed: -5 is not a seed"):
        DataConfig(train="t.jsonl", seed=-5)


def test_the_cli_refuses_it_before_writing_anything(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="config error: task.seeds\\[0\\]: 4294967296 is not a seed") as stopped:
        cli.main(["--task.seeds", f"[{SEEDS}]", "--output_dir", str(out)])
    assert isinstance(stopped.value.code, str) and not out.exists()

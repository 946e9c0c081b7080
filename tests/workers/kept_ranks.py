"""Ranks kept for a whole pytest process: the torchrun job behind ``launch.run_ranks``'s several-rank launches.

Each several-rank launch used to start its own torchrun job: ~7 s of imports (torch, DeepSpeed, transformers) per
rank, a rendezvous and DeepSpeed's start-up, before any scenario ran. ``tests/launch.py`` starts this script under
torchrun once, at a pytest process's first such launch, and hands it each launch as a request; every rank runs the
requested script as torchrun would have run it (``__main__``, its arguments in ``sys.argv``, its folder first on the
path, the launch's environment), one request after another, in the same process group.

Between requests each rank puts back what a script may change: the environment, the working directory, the path,
``sys.argv``, the root logger and transformers' verbosity, torch's default generator (seeded as a fresh interpreter
seeds it); a script's ``distributed.shutdown()`` keeps the group (as ``launch.run_here`` does on one rank).

The requests, in ``FOLDER`` (given by the launch): ``request.<n>.json`` holds ``{"script", "args", "env"}``; rank
``r`` writes the script's output (both file descriptors, so C++ output too) to ``<n>.rank<r>.out`` and ``.err``,
then ``<n>.rank<r>.json``: ``{"ok": ...}``. A rank whose script failed is not reused: the launch ends the whole job
(the other rank may wait in a collective) and the next launch starts another. A rank leaves by itself once the
pytest process (``OWNER``) or its torchrun is gone.

    python -m torch.distributed.run --nproc_per_node=N tests/workers/kept_ranks.py FOLDER OWNER
"""

from __future__ import annotations

import gc
import json
import logging
import os
import runpy
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import torch
import transformers

from distill_kit.engines import distributed

FRESH_SEED = torch.initial_seed()  # what torch's default generator starts from in a new interpreter
POLL_S = 0.02


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run(script: str, args: list[str], env: dict[str, str], torchrun_env: dict[str, str]) -> bool:
    """``script`` as ``__main__`` with ``args``, the launch's environment plus torchrun's variables; whether it
    ended well (returned, or exited 0). Everything listed in the module's docstring is put back after it."""
    environment, argv, path, cwd = dict(os.environ), list(sys.argv), list(sys.path), os.getcwd()
    root = logging.getLogger()
    handlers, level, verbosity = list(root.handlers), root.level, transformers.logging.get_verbosity()
    os.environ.clear()
    os.environ.update(env | torchrun_env)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    torch.manual_seed(FRESH_SEED)
    try:
        with mock.patch.object(distributed, "shutdown", lambda: None):
            runpy.run_path(script, run_name="__main__")
        return True
    except SystemExit as stop:
        if stop.code in (0, None):
            return True
        print(f"{script} exited with {stop.code}", file=sys.stderr)
        return False
    except BaseException:  # noqa: BLE001 - a KeyboardInterrupt too: reported, and this rank is not reused
        print(f"[rank{distributed.rank()}]: Traceback (most recent call last):", file=sys.stderr)
        traceback.print_exc()
        return False
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environment)
        sys.argv, sys.path[:] = argv, path
        root.handlers[:] = handlers
        root.setLevel(level)
        transformers.logging.set_verbosity(verbosity)
        if "torch._dynamo" in sys.modules:  # compiled graphs and recompile counts start empty, as in a new process
            torch._dynamo.reset()
        gc.collect()


def captured(folder: Path, name: str, request: dict, torchrun_env: dict[str, str]) -> bool:
    """:func:`run` with file descriptors 1 and 2 in ``<name>.out`` and ``<name>.err``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(folder / f"{name}.out", "w") as out, open(folder / f"{name}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            return run(request["script"], request["args"], request["env"], torchrun_env)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def main() -> None:
    folder, owner = Path(sys.argv[1]), int(sys.argv[2])
    launched = json.loads((folder / "launch_env.json").read_text())
    torchrun_env = {k: v for k, v in os.environ.items() if launched.get(k) != v}  # RANK, MASTER_PORT, ...
    torchrun = os.getppid()
    distributed.init()
    rank = distributed.rank()
    (folder / f"rank{rank}.pid").write_text(str(os.getpid()))
    n = 0
    while True:
        request = folder / f"request.{n}.json"
        while not request.exists():
            if not alive(owner) or os.getppid() != torchrun:
                return
            time.sleep(POLL_S)
        ok = captured(folder, f"{n}.rank{rank}", json.loads(request.read_text()), torchrun_env)
        status = folder / f"{n}.rank{rank}.json"
        status.with_suffix(".tmp").write_text(json.dumps({"ok": ok}))
        status.with_suffix(".tmp").replace(status)
        if not ok:
            return
        n += 1


if __name__ == "__main__":
    main()

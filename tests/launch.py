"""Start real ranks for a test: our own processes over gloo, never a harness that may skip them."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_environment() -> dict[str, str]:
    """This process's environment without the rendezvous variables a one-rank start in it may have set: a
    child must pick its own port, not the one this process's group still listens on."""
    return {key: value for key, value in os.environ.items() if key not in RENDEZVOUS}


DISTILL = ROOT / "scripts" / "distill.py"


def run_here(script: str | Path, args: list[str]) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` on one rank, in this process: what the script runs (``scripts/distill.py``:
    ``cli.main``; any other: the file as ``__main__``, its folder first on the path, ``sys.argv`` its arguments),
    without a second interpreter importing torch, DeepSpeed and transformers again (~7 s a start on a 2-core machine).

    Its stdout, stderr and INFO log lines are captured as a subprocess's would be; the environment (the rendezvous
    variables a start sets), ``sys.argv`` and ``sys.path`` are put back after it, so that ranks launched later pick
    their own port; the process group is kept (a script ends by destroying it, and DeepSpeed keeps the first group it
    saw for the next engine built in this process). A run that stops with an error fails the calling test with what
    it printed, as ``run_ranks`` does. Tests of the process itself (its exit status, signals, a kill, no traceback on
    stderr) start the script with ``run_ranks(..., in_process=False)``.
    """
    import runpy
    from unittest import mock

    from distill_kit.engines import distributed
    from distill_kit.run import cli

    script = Path(script).resolve()
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root, environment, argv, path = logging.getLogger(), dict(os.environ), list(sys.argv), list(sys.path)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                mock.patch.object(distributed, "shutdown", lambda: None):
            if script == DISTILL:
                code = cli.main(list(args))
            else:
                sys.argv = [str(script), *args]
                sys.path.insert(0, str(script.parent))
                runpy.run_path(str(script), run_name="__main__")
                code = 0
    except SystemExit as stop:
        code = stop.code
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        os.environ.clear()
        os.environ.update(environment)
        sys.argv, sys.path[:] = argv, path
    done = subprocess.CompletedProcess([str(script), *args], 0 if code in (0, None) else 1, out.getvalue(),
                                       err.getvalue() + ("" if code in (0, None) else f"\n{code}"))
    if done.returncode:
        raise AssertionError(f"{script} {args} stopped: {code}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done


def run_ranks(script: str | Path, args: list[str], nprocs: int, timeout: float = 300,
              launcher: str = "torchrun", in_process: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nprocs`` ranks (``torchrun`` or ``deepspeed``), or plain ``python`` when ``nprocs`` is 0
    (one rank: in this process, :func:`run_here`, unless ``in_process`` is False).

    A non-zero exit or a timeout fails the calling test, with the ranks' output in the message.
    """
    if not nprocs and in_process:
        return run_here(script, args)
    if nprocs and launcher == "deepspeed":
        command = [str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={nprocs}", "--no_local_rank",
                   f"--master_port={free_port()}", str(script), *args]
    elif nprocs:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nprocs}",
                   f"--master_port={free_port()}", str(script), *args]
    else:
        command = [sys.executable, str(script), *args]
    env = clean_environment() | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{command} timed out after {timeout}s:\n{err.stdout}\n{err.stderr}") from err
    if done.returncode != 0 and not _teardown_abort_only(done, nprocs):
        raise AssertionError(f"{command} exited with {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done


TEARDOWN_ABORT = "terminate called without an active exception"


def _teardown_abort_only(done: subprocess.CompletedProcess, nprocs: int) -> bool:
    """A rank that finished its work and then aborted while the interpreter tore down gloo's threads (a C++
    ``std::terminate`` after ``main`` returned; seen about once in 40 launches on this 2-core machine): not a
    failure of the code under test, whose results the caller reads and asserts on (a rank that did not finish
    wrote none). Any Python traceback from a rank still fails the launch."""
    worker_traceback = re.search(r"\[rank\d+\]: Traceback" if nprocs else r"Traceback", done.stderr)
    return TEARDOWN_ABORT in done.stderr and worker_traceback is None

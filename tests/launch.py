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
    variables a start sets), ``sys.argv``, ``sys.path`` and torch's thread count are put back after it, so that ranks
    launched later pick their own port; the process group is kept (a script ends by destroying it, and DeepSpeed
    keeps the first group it saw for the next engine built in this process). A run that stops with an error fails the
    calling test with what it printed, as ``run_ranks`` does. Tests of the process itself (its exit status, signals,
    a kill, no traceback on stderr) start the script with ``run_ranks(..., in_process=False)``.
    """
    import runpy
    from unittest import mock

    import torch

    from distill_kit.engines import distributed
    from distill_kit.run import cli

    script = Path(script).resolve()
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root, environment, argv, path = logging.getLogger(), dict(os.environ), list(sys.argv), list(sys.path)
    threads = torch.get_num_threads()  # a script may set its own (benchmarks/bench_routed_tasks.py --threads)
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
        torch.set_num_threads(threads)
    done = subprocess.CompletedProcess([str(script), *args], 0 if code in (0, None) else 1, out.getvalue(),
                                       err.getvalue() + ("" if code in (0, None) else f"\n{code}"))
    if done.returncode:
        raise AssertionError(f"{script} {args} stopped: {code}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done


def run_ranks(script: str | Path, args: list[str], nprocs: int, timeout: float = 300,
              launcher: str = "torchrun", in_process: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nprocs`` ranks (``torchrun`` or ``deepspeed``), or plain ``python`` when ``nprocs`` is 0
    (one rank: in this process, :func:`run_here`, unless ``in_process`` is False).

    Under torchrun the script runs on this process's kept ranks (:class:`KeptRanks`: one torchrun job started at
    the first such launch, each launch's script run in it as torchrun would run it), unless ``in_process`` is
    False: then it gets a job of its own, for tests of the processes themselves (a rank that stalls, an exit status).
    A failure or a timeout fails the calling test, with the ranks' output in the message.
    """
    if not nprocs and in_process:
        return run_here(script, args)
    env = clean_environment() | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if nprocs and launcher == "torchrun" and in_process:
        return KeptRanks.of(nprocs, env).run(Path(script), args, env, timeout)
    if nprocs and launcher == "deepspeed":
        command = [str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={nprocs}", "--no_local_rank",
                   f"--master_port={free_port()}", str(script), *args]
    elif nprocs:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nprocs}",
                   f"--master_port={free_port()}", str(script), *args]
    else:
        command = [sys.executable, str(script), *args]
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


class KeptRanks:
    """One torchrun job of ``nprocs`` ranks kept for this process's several-rank launches
    (tests/workers/kept_ranks.py, whose docstring says what each rank does and puts back between launches).

    Every launch after the first saves the job's start-up (each rank's imports, the rendezvous, DeepSpeed's
    start-up: ~15 s of CPU for two ranks on this 2-core machine). A launch that fails or times out ends the job (a
    rank may wait in a collective for the failed one); the next launch starts another. The job ends with this
    process, or by itself once this process is gone.
    """

    _kept: dict[int, KeptRanks] = {}
    SCRIPT = ROOT / "tests" / "workers" / "kept_ranks.py"
    GRACE_S = 2.0  # after one rank fails: how long the others may take to report theirs before the job is ended

    @classmethod
    def of(cls, nprocs: int, env: dict[str, str]) -> KeptRanks:
        kept = cls._kept.get(nprocs)
        if kept is None or kept.process.poll() is not None:
            if kept is not None:
                kept.close()
            kept = cls._kept[nprocs] = cls(nprocs, env)
        return kept

    def __init__(self, nprocs: int, env: dict[str, str]):
        import atexit
        import json
        import tempfile

        self.nprocs, self.requests = nprocs, 0
        self.folder = Path(tempfile.mkdtemp(prefix="kept-ranks-"))
        (self.folder / "launch_env.json").write_text(json.dumps(env))
        self.command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nprocs}",
                        f"--master_port={free_port()}", str(self.SCRIPT), str(self.folder), str(os.getpid())]
        self.log = open(self.folder / "torchrun.log", "w")  # noqa: SIM115 - open for the job's life
        self.process = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        atexit.register(self.close)

    def run(self, script: Path, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        import json
        import time

        n, self.requests = self.requests, self.requests + 1
        request = self.folder / f"request.{n}.json"
        request.with_suffix(".tmp").write_text(json.dumps({"script": str(script), "args": list(args), "env": env}))
        request.with_suffix(".tmp").replace(request)
        command = [*self.command[:-3], str(script), *args]
        deadline, failed_at = time.monotonic() + timeout, None
        while True:
            done = {r: json.loads(p.read_text()) for r in range(self.nprocs)
                    if (p := self.folder / f"{n}.rank{r}.json").exists()}
            if len(done) == self.nprocs and all(d["ok"] for d in done.values()):
                return subprocess.CompletedProcess(command, 0, self._output(n, "out"), self._output(n, "err"))
            if failed_at is None and any(not d["ok"] for d in done.values()):
                failed_at = time.monotonic()
            ended = self.process.poll() is not None
            if ended or len(done) == self.nprocs or (failed_at and time.monotonic() - failed_at > self.GRACE_S):
                break
            if time.monotonic() > deadline:
                stdout, stderr = self._output(n, "out"), self._output(n, "err")
                self.close()
                raise AssertionError(f"{command} timed out after {timeout}s:\n{stdout}\n{stderr}")
            time.sleep(0.02)
        failed = sorted(r for r, d in done.items() if not d["ok"])
        stdout, stderr = self._output(n, "out"), self._output(n, "err")
        log = (self.folder / "torchrun.log").read_text(errors="replace") if ended else ""
        self.close()
        raise AssertionError(f"{command} exited with 1 (kept ranks {failed} failed):\n{stdout[-4000:]}\n"
                             f"{(stderr + log)[-8000:]}")

    @classmethod
    def close_all(cls) -> None:
        for kept in list(cls._kept.values()):
            kept.close()

    def _output(self, n: int, stream: str) -> str:
        paths = [self.folder / f"{n}.rank{r}.{stream}" for r in range(self.nprocs)]
        return "".join(p.read_text(errors="replace") for p in paths if p.exists())

    def close(self) -> None:
        """Kill the ranks (each in a session of its own, started by torchrun) and torchrun; forget the job."""
        import shutil
        import signal

        for r in range(self.nprocs):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((self.folder / f"rank{r}.pid").read_text()), signal.SIGKILL)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()
        if KeptRanks._kept.get(self.nprocs) is self:
            del KeptRanks._kept[self.nprocs]
        shutil.rmtree(self.folder, ignore_errors=True)

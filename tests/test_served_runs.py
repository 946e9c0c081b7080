"""A served teacher through the CLI, in this process, against the project's server started as a real process on
127.0.0.1 (scripts/serve_teacher.py on the shipped default teacher, fp32, CPU; no mock of HTTP).

Checked: a run against the server gives, step for step, the losses (and the exported student) of the same run
with the in-process teacher's top-k (:class:`LocalTopK`: the teacher's forward on each micro-batch, the top-k of its
log_softmax by ``offline/capture.top_k``), bitwise; the server killed mid-run stops the run cleanly (its message, a
checkpoint of the last whole step, the records up to it), and ``--resume`` against the restarted server ends where
the uninterrupted run ends, bitwise; a served teacher whose tokenizer is not the run's is refused before anything
is written. Gradient accumulation 2: the next micro-batch's teacher request is prefetched within a step and
across steps. Every server is
killed at the end. About 2 minutes on 2 shared CPU cores, most of it the servers' and the engines' start-up.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_cli import write_texts  # local text: the standard library's json package and this project's run/
from test_served_teacher import KEY_ENV, TEACHER, running_server
from tiny_tokenizers import bpe
from transformers import AutoModelForCausalLM

from distill_kit.engines import models
from distill_kit.errors import ConfigError, TeacherFault
from distill_kit.offline.capture import top_k
from distill_kit.run import cli, run_config
from distill_kit.teachers import TOP_K, TOP_K_TAIL, Teacher, TeacherCard
from distill_kit.teachers.served import ServedTeacher, prompts_of
from losses.sparse import SparseTeacherLogits

K = 20  # the client's default k (stock vLLM's --max-logprobs)
STEPS = 6


class LocalTopK(Teacher):
    """The in-process reference: the teacher folder's model (fp32) run on each micro-batch, and at every position
    but each row's last the top-k of its log_softmax with the tail's log mass (zeros elsewhere, as a served
    teacher's targets hold)."""

    kind = "test_served_runs:LocalTopK"
    options = ("folder", "k")

    @classmethod
    def describe(cls, spec) -> TeacherCard:
        folder = spec.options["folder"]
        config = models.model_config(folder)
        return TeacherCard(kind=cls.kind, source=folder, outputs=frozenset({TOP_K, TOP_K_TAIL}),
                           vocab_size=config.vocab_size, tokenizer=folder, positions=config.max_position_embeddings,
                           hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                           eos_token_id=config.eos_token_id, model_type=config.model_type, config=config)

    def __init__(self, spec, card, setup):
        super().__init__(spec, card, setup)
        self.k = int(spec.options["k"])
        self.model = AutoModelForCausalLM.from_pretrained(spec.options["folder"], dtype=torch.float32).eval()

    def forward(self, inputs: Mapping[str, Any]) -> Any:
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids) if mask is None else mask).logits
        values, top, tails = (torch.zeros((*ids.shape, self.k)), torch.zeros((*ids.shape, self.k), dtype=torch.long),
                              torch.zeros(ids.shape))
        for row, _, positions in prompts_of(inputs):
            where = torch.as_tensor(positions[:-1])
            values[row, where], top[row, where], tails[row, where] = top_k(logits[row, where], self.k, 4096)
        return SimpleNamespace(logits=SparseTeacherLogits(values, top, tails))


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    write_texts(root)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the file (fp32, CPU, this process's thread count: CPU matmuls may sum in another order with
    another count), and a second one loading meanwhile that takes over the port when told (the restart after the
    kill: ~1 s, not a start-up)."""
    with running_server(tmp_path_factory.mktemp("served") / "restart") as srv:
        yield srv


def _args(texts: Path, out: Path, teacher: dict[str, Any], *extra: str) -> list[str]:
    """A 1-layer student of the teacher's config, 6 steps of 2 micro-batches of 2 rows of 32 tokens."""
    return [
        f"output_dir={out}", f"cache_dir={texts / 'cache'}", "report_to=[]",
        f"data.train={texts / 'train.txt'}", f"data.heldout={texts / 'heldout.txt'}", "data.block_size=32",
        "data.max_train_blocks=64", "data.max_heldout_blocks=8", f"training.max_steps={STEPS}",
        "training.micro_batch_size=2", "training.gradient_accumulation_steps=2", "training.lr=3e-3",
        "training.warmup_steps=2", "training.save_every=1", "eval.every=0", "eval.max_batches=2",
        "--students", "[{name: distilled, init: {num_hidden_layers: 1, hidden_size: 64, intermediate_size: 128, "
                      "num_attention_heads: 2, num_key_value_heads: 2}, loss: forward_kl}]",
        "--teachers", json.dumps([{"name": "t", **teacher}]), *extra]


def _served(url: str, **options) -> dict[str, Any]:
    return {"model": url, "options": {"k": K, "tokenizer": str(TEACHER), "api_key_env": KEY_ENV, "wait_s": 30,
                                      "retries_s": 2, "timeout_s": 30} | options}


def _run(args: list[str], resume: bool = False) -> Any:
    return cli.run(run_config.load(None, args), resume=resume)


def _losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["distilled/loss"]) for r in map(json.loads, (out / "train.jsonl").read_text().splitlines())]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "students" / "distilled" / "model.safetensors")


def _checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def served_run(server, texts, tmp_path_factory) -> Path:
    """The uninterrupted run against the server; every micro-batch but the first is prefetched: each step's second
    during its first, and the next step's first during its second (the loop reads it ahead)."""
    out = tmp_path_factory.mktemp("runs") / "served"
    prefetched, send = [], ServedTeacher.prefetch
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ServedTeacher, "prefetch", lambda self, inputs: prefetched.append(1) or send(self, inputs))
        assert _run(_args(texts, out, _served(server.url))) is not None
    assert len(prefetched) == 2 * STEPS - 1
    return out


def test_a_tokenizer_other_than_the_runs_is_refused_before_any_write(server, texts, tmp_path):
    other = tmp_path / "other_tokenizer"
    bpe("d e", "i m").save_pretrained(other)
    out = tmp_path / "out"
    cases = [  # the run's tokenizer is another one; the served model's is said to be another one; one URL, no folder
        (_args(texts, out, _served(server.url), f"tokenizer={other}"), "its tokenizer differs from the run's"),
        (_args(texts, out, _served(server.url, tokenizer=str(other))), r"is not teachers\[t\]\.options\.tokenizer's"),
        (_args(texts, out, {"model": server.url, "options": {"api_key_env": KEY_ENV}}, f"tokenizer={other}"),
         "vocabulary sha256 .* differs from the run's"),
        (_args(texts, out, {"model": server.url, "options": {"api_key_env": KEY_ENV}}),
         r"names no tokenizer, .* set tokenizer: .* \(or options.tokenizer in teachers\[t\]"),
    ]
    for args, match in cases:
        with pytest.raises(ConfigError, match=match):
            _run(args)
        assert not out.exists()


def test_served_losses_equal_the_in_process_teachers_top_k_bitwise(served_run, texts, tmp_path):
    """Same batches, same k, same fp32 forward of the same (2, 32) micro-batch with the same threads: the targets are
    the same floats (tests/test_served_teacher.py checks them position by position), so the whole run is."""
    reference = tmp_path / "in_process"
    _run(_args(texts, reference, {"model": LocalTopK.kind, "options": {"folder": str(TEACHER), "k": K}},
               f"tokenizer={TEACHER}"))
    assert _losses(served_run) == _losses(reference) and len(_losses(reference)) == STEPS
    ours, theirs = _weights(served_run), _weights(reference)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    report = json.loads((served_run / "report.json").read_text())
    assert report["teachers"][0]["model"].startswith("http://127.0.0.1:")


def test_a_server_killed_mid_run_stops_it_cleanly_and_resume_ends_as_the_uninterrupted_run(
        server, served_run, texts, tmp_path):
    out = tmp_path / "killed"
    args = _args(texts, out, _served(server.url))
    killed = threading.Event()

    def kill_after_step_two() -> None:  # the run is in this thread (signal handlers need the main one)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            records = out / "train.jsonl"
            if records.is_file() and len(records.read_text().splitlines()) >= 2:
                server.kill()
                killed.set()
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_after_step_two, daemon=True)
    watcher.start()
    with pytest.raises(TeacherFault) as failed:  # stopped, no report: an error (the CLI exits 1 with its message)
        _run(args)
    watcher.join(timeout=10)
    assert killed.is_set()
    stopped = len(_losses(out))
    assert 2 <= stopped < STEPS
    message = str(failed.value)
    assert message.startswith("stopped by the teacher being unavailable") and "has not answered" in message
    assert f"at step {stopped}; checkpoint saved. Continue with: --output_dir {out} --resume" in message
    assert _checkpoints(out)[-1] == stopped  # the last whole step, nothing of the unfinished one
    assert _losses(out) == _losses(served_run)[:stopped]
    assert not (out / "report.json").exists()

    server.restart()
    assert _run(args, resume=True) is not None
    assert _losses(out) == _losses(served_run)
    ours, theirs = _weights(out), _weights(served_run)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)

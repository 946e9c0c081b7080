"""A served teacher against servers that answer wrongly, slowly or too much: a stub of our own (``Stub``: a
threaded ``http.server`` on 127.0.0.1 that answers what each test tells it, no model) and the project's server app
in this process (``build_app`` on a fake model, through Starlette's test client).

Checked, on inputs issue 39 did not list: every value of an answer (log-probabilities above 0, +inf, NaN, a
position all -inf, masses past 1, a tail that does not make 1; ids = the vocabulary size, negative, repeated; a
dict or a string where the schema has a list or a number; one answer too few, a row short) is refused before
anything trains on it, by one error that names the server's URL and the field; a body one byte past
``max_response_bytes`` is refused (with and without a Content-Length) and one of exactly the cap is read; a server
that trickles its answer (headers or body) is cut off at ``timeout_s``, whole-request; a run whose server turns bad
mid-run stops after the checkpoint of its last whole step with a non-zero exit and no traceback, and resumes
against the same weights on another port; the server refuses what is too large (HTTP 413), an empty prompt list
(400), a wrong key (in constant time), serves no API docs, holds one batch's logits at a time, and will not bind
another interface without a key unless told. The stubs stop with their test; each test is bounded by its own
deadlines (timeout_s, wait_s), a few seconds at most; the CLI test ~40 s on 2 shared cores.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import math
import re
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from launch import DISTILL, ROOT, clean_environment
from test_cli import write_texts

from distill_kit.config import TeacherSpec
from distill_kit.errors import TeacherResponseError
from distill_kit.teachers import served
from distill_kit.teachers import served_protocol as protocol
from distill_kit.teachers.base import TeacherSetup
from distill_kit.teachers.kinds import describe
from distill_kit.teachers.served import ServedTeacher, TeacherTimeout

TEACHER = ROOT / "distill_kit" / "assets" / "default" / "teacher"
VOCAB, K = 1024, 8
BATCH = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]),
         "attention_mask": torch.ones(2, 6, dtype=torch.long)}
"""Two prompts of 6 tokens: 10 positions asked for, rows 0-4 the first prompt's, 5-9 the second's."""


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    length: bool = True
    """Send a Content-Length (else: the body until the connection closes)."""
    trickle_s: float = 0.0
    """Seconds between single bytes of the body (or, with ``trickle_headers``, of the whole answer)."""
    trickle_headers: bool = False


class Stub:
    """A teacher server that answers what ``answer(path, request, number)`` returns: the project's ``/info`` and
    vLLM's ``/v1/models`` from ``info``, every POST from ``answer``. It runs on 127.0.0.1 in daemon threads until
    :meth:`close`; a trickle stops at close or after 10 s."""

    def __init__(self, info: dict, answer: Callable[[str, dict, int], Reply]):
        self.info, self.answer, self.requests = info, answer, 0
        self.stopped = threading.Event()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                models = {"object": "list", "data": [{"id": "stub", "max_model_len": 4096, "distill_kit": stub.info}]}
                documents = {"/info": stub.info, "/v1/models": models}
                self.reply(Reply(body=json.dumps(documents[self.path]).encode()) if self.path in documents
                           else Reply(404, b"{}"))

            def do_POST(self) -> None:  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                stub.requests += 1
                self.reply(stub.answer(self.path, request, stub.requests))

            def reply(self, reply: Reply) -> None:
                head = (f"HTTP/1.1 {reply.status} Stub\r\nContent-Type: application/octet-stream\r\n"
                        + (f"Content-Length: {len(reply.body)}\r\n" if reply.length else "Connection: close\r\n")
                        + "\r\n").encode()
                slow, fast = (head + reply.body, b"") if reply.trickle_headers else (reply.body, head)
                if not reply.trickle_s:
                    slow, fast = b"", head + reply.body
                try:
                    self.wfile.write(fast)
                    self.wfile.flush()
                    deadline = time.monotonic() + 10
                    for byte in range(len(slow)):
                        if stub.stopped.is_set() or time.monotonic() > deadline:
                            break
                        self.wfile.write(slow[byte:byte + 1])
                        self.wfile.flush()
                        time.sleep(reply.trickle_s)
                except OSError:  # the client hung up: what a deadline does
                    pass
                self.close_connection = not reply.length or bool(slow)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def stub(answer: Callable[[str, dict, int], Reply], **info) -> Iterator[Stub]:
    running = Stub({"model": "stub", "vocab_size": VOCAB, "max_k": 64, "max_model_len": 4096} | info, answer)
    try:
        yield running
    finally:
        running.close()


def targets(request: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Answers a teacher could give: at every position ids k apart from the token's, half the mass on the k, half
    in the tail."""
    k, rows = request["k"], [p[1:] for p in request["prompts"]]
    ids = np.asarray([[(t + r * 37) % VOCAB for r in range(k)] for row in rows for t in row], dtype=np.int32)
    values = np.full(ids.shape, math.log(0.5 / k), dtype=np.float32)
    return ids, values, np.full(len(ids), math.log(0.5), dtype=np.float32)


def topk_answer(change: Callable[[np.ndarray, np.ndarray, np.ndarray], None] = lambda *_: None,
                ) -> Callable[[str, dict, int], Reply]:
    """``/v1/topk`` answers of :func:`targets`, changed by ``change(ids, log_probs, log_tail)`` first."""
    def answer(path: str, request: dict, number: int) -> Reply:
        ids, values, tail = targets(request)
        change(ids, values, tail)
        return Reply(body=protocol.encode_topk(request["prompts"], request["k"], ids, values, tail))
    return answer


def vllm_document(request: dict) -> dict:
    """vLLM's answer (served_protocol's docstring) holding :func:`targets`: the prompt's own token ranked first."""
    choices = []
    for index, prompt in enumerate(request["prompt"]):
        k = request["prompt_logprobs"]
        positions = [None] + [{str((t + r * 37) % VOCAB): {"logprob": math.log(0.5 / k), "rank": r + 1,
                                                           "decoded_token": None} for r in range(k)}
                              for t in prompt[1:]]
        choices.append({"index": index, "text": "", "prompt_logprobs": positions, "prompt_token_ids": prompt})
    return {"id": "cmpl-stub", "object": "text_completion", "model": "stub", "choices": choices}


def teacher(url: str, **options) -> ServedTeacher:
    spec = TeacherSpec(name="t", model=url, options={"k": K, "wait_s": 2, "retries_s": 0, "timeout_s": 5} | options)
    return ServedTeacher(spec, describe(spec), TeacherSetup(ds_config={}, training=None, device=torch.device("cpu")))


def refused(url: str, error: type[Exception] = TeacherResponseError, **options) -> str:
    """The one error ``forward`` raises on the stub at ``url``, which must name the server (its URL, the config key)."""
    client = teacher(url, **options)
    try:
        with pytest.raises(error) as caught:
            client.forward(BATCH)
    finally:
        client.close()
    message = str(caught.value)
    assert url in message and message.startswith("teachers[t].model: "), message
    return message


# ------------------------------------------------------------------------------------------ every value checked


def _set(array: str, where: tuple, value: float) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    def change(ids: np.ndarray, values: np.ndarray, tail: np.ndarray) -> None:
        {"ids": ids, "log_probs": values, "log_tail": tail}[array][where] = value
    return change


@pytest.mark.parametrize("change, field", [
    (_set("log_probs", (3, 2), 0.5), r"prompt 0, position 3: log_probs\[3\] \(rank 3\) = 0.5: above 0"),
    (_set("log_probs", (7, 0), math.inf), r"prompt 1, position 2: log_probs\[7\] \(rank 1\) = inf: above 0"),
    (_set("log_probs", (1, 4), math.nan), r"log_probs\[1\] \(rank 5\) = nan: NaN"),
    (_set("log_probs", (6, slice(None)), -math.inf), r"log_probs\[6\]: every one of the k values is -inf"),
    (_set("log_probs", (0, slice(None)), math.log(0.2)), r"log_probs\[0\]: the k probabilities sum to 1.6"),
    (_set("ids", (9, 7), VOCAB), r"ids\[9\] \(rank 8\) = 1024: not a token id; ids are in \[0, 1024\)"),
    (_set("ids", (2, 0), -3), r"ids\[2\] \(rank 1\) = -3: not a token id"),
    (lambda ids, values, tail: ids.__setitem__((4, 5), ids[4, 0]), r"ids\[4\]: an id given twice in one position"),
    (_set("log_tail", (8,), 0.0), r"log_tail\[8\] = 0.0: .* makes 1.5, not 1"),
    (_set("log_tail", (5,), math.nan), r"log_tail\[5\] = nan"),
], ids=["log-prob +0.5", "+inf", "NaN", "all -inf", "mass 1.6", "id = vocab", "negative id", "repeated id",
        "tail 1", "tail NaN"])
def test_every_value_of_an_answer_is_checked_and_the_error_names_the_server_and_the_field(change, field):
    with stub(topk_answer(change)) as server:
        message = refused(server.url)
    assert re.search(field, message), message
    assert "the run stops after a checkpoint of the last whole step" in message and "--resume" in message


def test_a_good_answer_passes_whole():
    """The checks' other side: the stub's answer, -inf where a teacher rules a token out, and the vocabulary's last
    id, are trained on as sent."""
    def edge(ids: np.ndarray, values: np.ndarray, tail: np.ndarray) -> None:
        ids[0, 1], values[0, 1], values[0, 0] = VOCAB - 1, -math.inf, math.log(0.5 / K) + 1e-4  # within the slack
        tail[0] = math.log(1 - np.exp(values[0].astype(np.float64)).sum())
    with stub(topk_answer(edge)) as server:
        client = teacher(server.url)
        got = client.forward(BATCH).logits
        client.close()
    want_ids, want_values, _ = targets({"k": K, "prompts": BATCH["input_ids"].tolist()})
    assert int(got.ids[0, 0, 1]) == VOCAB - 1 and got.log_probs[0, 0, 1] == -math.inf
    assert torch.equal(got.ids[1, :5], torch.from_numpy(want_ids[5:]).long())
    assert not got.ids[:, 5].any()  # each prompt's last position: nothing asked, zeros


def _vllm(change: Callable[[dict], None]) -> Callable[[str, dict, int], Reply]:
    def answer(path: str, request: dict, number: int) -> Reply:
        document = vllm_document(request)
        change(document)
        return Reply(body=json.dumps(document).encode())
    return answer


def _logprob(document: dict, value: object) -> None:
    entry = document["choices"][1]["prompt_logprobs"][2]
    entry[next(iter(entry))]["logprob"] = value


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(choices={"0": d["choices"][0]}), r"choices is an object \(.*\) where a list belongs"),
    (lambda d: _logprob(d, [-0.1]), r"choices\[1\]\.prompt_logprobs\[2\]\['13'\]\.logprob is a list .* where a "
                                    r"number belongs"),
    (lambda d: _logprob(d, "-0.1"), r"choices\[1\]\.prompt_logprobs\[2\]\['13'\]\.logprob is a string"),
    (lambda d: _logprob(d, True), r"choices\[1\]\.prompt_logprobs\[2\]\['13'\]\.logprob is true where a number"),
    (lambda d: _logprob(d, 0.25), r"prompt 1, position 1: choices\[1\]\.prompt_logprobs\[2\]\[\.\.\.\]\.logprob "
                                  r"\(rank 1\) = 0.25: above 0"),
    (lambda d: d["choices"].pop(), r"choices has 1 entries, 2 asked for"),
    (lambda d: d["choices"][0]["prompt_logprobs"].pop(), r"choices\[0\]\.prompt_logprobs has 5 entries, 6 asked"),
    (lambda d: d["choices"][0]["prompt_logprobs"][3].clear(), r"choices\[0\]\.prompt_logprobs\[3\]: the answer is "
                                                              "for other tokens"),
    (lambda d: [v.update(logprob=-9999.0) for v in d["choices"][0]["prompt_logprobs"][4].values()],
     r"choices\[0\]\.prompt_logprobs\[4\]\[\.\.\.\]\.logprob: every one of the k values is -inf"),
], ids=["dict for list", "list for number", "string for number", "true for number", "log-prob +0.25",
        "one choice short", "a position short", "other tokens", "all -inf"])
def test_vllms_json_of_the_wrong_types_or_counts_is_refused_naming_the_field(change, field):
    with stub(_vllm(change)) as server:
        message = refused(server.url, api="vllm")
    assert re.search(field, message), message


@pytest.mark.parametrize("reply, field", [
    (lambda body: Reply(body=body[:-4]), r"the /v1/topk answer is cut off or padded: \d+ bytes"),
    (lambda body: Reply(body=b"<html><body>Service Unavailable</body></html>"), "not a distill_kit top-k body"),
    (lambda body: Reply(body=body[:10]), "cut off: its header says"),
    (lambda body: Reply(status=500, body=b"Internal Server Error"), "HTTP 500 to /v1/topk .*Internal Server Error"),
], ids=["a row short", "an HTML page", "cut in the header", "HTTP 500"])
def test_a_short_or_foreign_body_is_refused_naming_the_server(reply, field):
    good = topk_answer()
    with stub(lambda path, request, number: reply(good(path, request, number).body)) as server:
        message = refused(server.url)
    assert re.search(field, message), message


# ------------------------------------------------------------------------------------- size cap and deadline


@pytest.mark.parametrize("length", [True, False], ids=["Content-Length", "until close"])
def test_a_body_one_byte_over_max_response_bytes_is_refused_and_one_at_the_cap_is_read(length):
    size = len(topk_answer()("/v1/topk", {"prompts": BATCH["input_ids"].tolist(), "k": K}, 1).body)
    good = topk_answer()
    with stub(lambda path, request, number: Reply(body=good(path, request, number).body, length=length)) as server:
        message = refused(server.url, max_response_bytes=size - 1)
        assert re.search(rf"larger than teachers\[t\]\.options\.max_response_bytes = {size - 1} bytes", message)
        client = teacher(server.url, max_response_bytes=size)
        assert client.forward(BATCH).logits.ids.shape == (2, 6, K)
        client.close()


@pytest.mark.parametrize("headers", [False, True], ids=["body trickled", "headers trickled"])
def test_a_server_that_trickles_its_answer_is_cut_off_at_the_whole_requests_deadline(headers):
    """One byte every 0.2 s: each read returns well within any per-read timeout; only a deadline on the whole
    request ends it. timeout_s = 1: the error comes at ~1 s (2.5 s: the bound on a loaded machine)."""
    good = topk_answer()
    with stub(lambda path, request, number: Reply(body=good(path, request, number).body, trickle_s=0.2,
                                                  trickle_headers=headers)) as server:
        start = time.monotonic()
        message = refused(server.url, TeacherTimeout, timeout_s=1)
        assert time.monotonic() - start < 2.5
    assert "did not answer /v1/topk within timeout_s=1 s (2 prompts, 12 tokens)" in message
    assert "raise teachers[t].options.timeout_s" in message


@pytest.mark.parametrize("headers", [False, True], ids=["body trickled", "headers trickled"])
def test_an_answer_read_into_a_buffer_is_cut_off_at_the_whole_requests_deadline_too(headers, monkeypatch):
    """The fast path (``served_wire.py``, every answer taken by it here) under the same deadline as httpx's."""
    from distill_kit.teachers import served_wire

    monkeypatch.setattr(served_wire, "SMALL", 0)
    with stub(lambda *_: Reply(body=b"x" * 64, trickle_s=0.2, trickle_headers=headers)) as server:
        transport = served.Transport(server.url, served.DEFAULTS | {"timeout_s": 1},
                                     served.Labels("teachers[t].model", "teachers[t].options"))
        start = time.monotonic()
        try:
            with pytest.raises(TeacherTimeout, match=r"did not answer /v1/hidden within timeout_s=1 s"):
                transport.submit(transport.fetch_into("/v1/hidden", {"prompts": [[1, 2]]},
                                                      lambda n: torch.empty(n, dtype=torch.uint8))).result()
            assert time.monotonic() - start < 2.5
        finally:
            transport.close()


def test_the_key_over_plain_http_to_another_host_is_warned_of_once(caplog):
    named = served.Labels("teachers[t].model", "teachers[t].options")
    with caplog.at_level(logging.WARNING, logger=served.LOG.name):
        for url in ("http://10.20.30.40:8000", "http://10.20.30.40:8000", "https://10.20.30.41:8000",
                    "http://127.0.0.1:8000", "http://[::1]:8000", "http://localhost:8000"):
            served._warn_if_plain_http(url, named)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "http://10.20.30.40:8000" in warned[0] and "https://" in warned[0]


# ------------------------------------------------------------------------------------------------- the server


class FakeModel(torch.nn.Module):
    """Logits of a fixed random projection of the ids; remembers each forward's logits weakly, so a test can see
    which are still alive when the next forward runs."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)))
        self.made: list[weakref.ref] = []
        self.alive_at_forward: list[int] = []

    def forward(self, input_ids, attention_mask):
        self.alive_at_forward.append(sum(ref() is not None for ref in self.made))
        logits = self.table[input_ids] * 3
        self.made.append(weakref.ref(logits))
        return SimpleNamespace(logits=logits)


def _app(**limits):
    from fastapi.testclient import TestClient

    from distill_kit.teachers.served_server import Limits, Scorer, build_app

    model = FakeModel()
    info = {"model": "fake", "vocab_size": VOCAB, "max_k": 64, "max_model_len": 4096}
    app = build_app(Scorer(model, torch.device("cpu"), max_batch_tokens=64), info, api_key="sk-31",
                    limits=Limits(**limits))
    return TestClient(app, headers={"Authorization": "Bearer sk-31"}), model


def test_the_server_refuses_what_is_too_large_or_empty_and_serves_no_api_docs():
    client, _ = _app(rows=4, tokens=100, body_bytes=2000)
    post = client.post
    assert post("/v1/topk", json={"prompts": [], "k": 4}).status_code == 400
    empty = post("/v1/completions", json={"prompt": [], "prompt_logprobs": 4, "max_tokens": 1})
    assert empty.status_code == 400 and "empty" in empty.text
    rows = post("/v1/topk", json={"prompts": [[1, 2]] * 5, "k": 4})
    assert rows.status_code == 413 and "5 prompts in one request; this server takes at most 4" in rows.text
    tokens = post("/v1/topk", json={"prompts": [[1] * 60, [2] * 41], "k": 4})
    assert tokens.status_code == 413 and "101 prompt tokens in one request" in tokens.text
    body = json.dumps({"prompts": [[1, 2]], "k": 4, "pad": "x" * 2000}).encode()
    assert post("/v1/topk", content=body, headers={"Content-Type": "application/json"}).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield body[:1000]
        yield body[1000:]
    streamed = post("/v1/topk", content=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413 and "request body over 2000 bytes" in streamed.text
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path).status_code == 404
    wrong = client.get("/info", headers={"Authorization": "Bearer sk-32"})
    assert wrong.status_code == 401 and client.get("/info").status_code == 200
    assert post("/v1/topk", json={"prompts": [[1, 2, 3]] * 4, "k": 4}).status_code == 200  # at the caps

    post = _app(answer_bytes=8 * (8 * 4 + 4), json_entries=8 * 5)[0].post  # 8 positions at k = 4: 288 B, 40 entries
    assert post("/v1/topk", json={"prompts": [[1, 2, 3]] * 4, "k": 4}).status_code == 200
    big = post("/v1/topk", json={"prompts": [[1, 2, 3]] * 4, "k": 5})
    assert big.status_code == 413 and "the answer would hold 352 bytes, more than this server's 288" in big.text
    json_answer = {"prompt": [[1, 2, 3]] * 4, "prompt_logprobs": 4, "max_tokens": 1}
    assert post("/v1/completions", json=json_answer).status_code == 200
    big = post("/v1/completions", json=json_answer | {"prompt_logprobs": 5})
    assert big.status_code == 413 and "48 entries, more than this server's 40 (serve_teacher.py --max-json-entries)" \
        in big.text


def test_the_server_holds_one_batchs_logits_at_a_time_and_its_top_k_equals_the_whole_ones():
    from distill_kit.offline.capture import top_k
    from distill_kit.teachers.served_server import Scorer

    model = FakeModel()
    prompts = [[(7 * i + j) % VOCAB for j in range(20)] for i in range(9)]  # 9 x 20 tokens, batches of <= 64
    ids, values, tails = Scorer(model, torch.device("cpu"), max_batch_tokens=64).topk(prompts, 5)
    assert len(model.alive_at_forward) == 3 and model.alive_at_forward == [0, 0, 0]
    with torch.no_grad():
        whole = torch.cat([model.table[torch.tensor(p[:-1])] * 3 for p in prompts])
        want = top_k(whole, 5, 4096)
    assert np.array_equal(ids, want[1].int().numpy()) and np.array_equal(values, want[0].numpy())
    assert np.array_equal(tails, want[2].numpy())


def test_serving_another_interface_without_a_key_is_refused_unless_allowed(monkeypatch):
    import runpy

    module = runpy.run_path(str(ROOT / "scripts" / "serve_teacher.py"), run_name="serve_teacher")
    monkeypatch.delenv("DISTILL_KIT_TEACHER_API_KEY", raising=False)
    loads = []

    def load(args):  # the refusal comes first; past it, stop where the model would load
        loads.append(args)
        raise RuntimeError("loading")

    monkeypatch.setitem(module["main"].__globals__, "load", load)
    with pytest.raises(SystemExit, match=r"--host 0\.0\.0\.0 without --api-key lets anyone .*--allow-unauthenticated"):
        module["main"]([str(TEACHER), "--host", "0.0.0.0"])
    assert not loads  # refused before the model loads
    for allowed in (["--host", "0.0.0.0", "--allow-unauthenticated"], ["--host", "0.0.0.0", "--api-key", "k"],
                    ["--host", "127.0.0.1"], ["--host", "::1"]):
        with pytest.raises(RuntimeError, match="loading"):
            module["main"]([str(TEACHER), *allowed])
    assert module["loopback"]("127.0.0.2") and not module["loopback"]("10.0.0.1")


# --------------------------------------------------------------------------------------------------- a run


def _run_args(texts: Path, out: Path, url: str, **options) -> list[str]:
    """A 1-layer student of the stub's teacher config, 4 steps of one micro-batch of 2 rows of 32 tokens."""
    teacher_options = {"k": K, "tokenizer": str(TEACHER), "wait_s": 10, "retries_s": 0, "timeout_s": 30} | options
    return [
        f"output_dir={out}", f"cache_dir={texts / 'cache'}", "report_to=[]",
        f"data.train={texts / 'train.txt'}", f"data.heldout={texts / 'heldout.txt'}", "data.block_size=32",
        "data.max_train_blocks=16", "data.max_heldout_blocks=4", "training.max_steps=4",
        "training.micro_batch_size=2", "training.gradient_accumulation_steps=1", "training.save_every=1",
        "eval.every=0", "eval.max_batches=1",
        "--students", "[{name: distilled, init: {num_hidden_layers: 1, hidden_size: 64, intermediate_size: 128, "
                      "num_attention_heads: 2, num_key_value_heads: 2}, loss: forward_kl}]",
        "--teachers", json.dumps([{"name": "t", "model": url, "options": teacher_options}])]


def test_a_server_that_turns_bad_mid_run_stops_it_after_the_last_whole_step_and_resume_goes_on_elsewhere(
        tmp_path):
    """From its 3rd answer the stub gives a log-probability of +0.5: the run (a process of its own) stops with a
    non-zero status and one line, its checkpoint at step 2 (the step before the bad answer's), no report; resumed
    against the same weights (the same teacher_sha256) on another port, with another timeout_s, it ends."""
    from distill_kit.engines.models import model_config
    from distill_kit.run import cli, run_config

    write_texts(tmp_path)
    out = tmp_path / "run"
    facts = {"teacher_sha256": "0" * 64, "config": model_config(str(TEACHER)).to_dict()}
    good, bad = topk_answer(), topk_answer(_set("log_probs", (0, 0), 0.5))
    with stub(lambda path, request, number: (good if number <= 2 else bad)(path, request, number), **facts) as first:
        done = subprocess.run([sys.executable, str(DISTILL), *_run_args(tmp_path, out, first.url)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              env=clean_environment() | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (last,) = [line for line in done.stderr.splitlines() if line.startswith("teacher error: ")]
    assert last.startswith("teacher error: stopped by an answer of the teacher that cannot be trained on "), last
    assert first.url in last and "log_probs[0] (rank 1) = 0.5: above 0" in last
    assert f"at step 2; checkpoint saved. Continue with: --output_dir {out} --resume" in last
    assert max(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*")) == 2
    assert len((out / "train.jsonl").read_text().splitlines()) == 2 and not (out / "report.json").exists()

    with stub(good, **facts) as second:
        assert second.url != first.url
        summary = cli.run(run_config.load(None, _run_args(tmp_path, out, second.url, timeout_s=60)), resume=True)
    assert summary is not None and (out / "report.json").is_file()
    assert [json.loads(line)["step"] for line in (out / "train.jsonl").read_text().splitlines()] == [1, 2, 3, 4]



def test_a_hidden_state_or_head_answer_is_checked_whole_before_the_loss_sees_it():
    """payload: hidden (issue 41): the binary body's framing, tokens, width, dtype, length and every value; a scale
    whose logits would overflow; a head whose bytes do not hash to the server's head_sha256."""
    prompts = [[5, 6, 7], [8, 9]]
    good = torch.randn(3, 4)
    body = protocol.encode_hidden(prompts, good)
    assert torch.equal(protocol.decode_hidden(body, prompts, 4, "float32"), good)
    bad = good.clone()
    bad[2, 1] = float("nan")
    refusals = {b"<html>502</html>": "not a distill_kit body", body[:-1]: "cut off or padded",
                body + b"\0" * 4: "cut off or padded", protocol.encode_hidden(prompts, bad): r"hidden\[2\] holds a NaN"}
    for answer, match in refusals.items():
        with pytest.raises(TeacherResponseError, match=match):
            protocol.decode_hidden(answer, prompts, 4, "float32")
    for args, match in (((prompts, 5, "float32"), "hidden_size is 4"), ((prompts, 4, "bfloat16"), "dtype is"),
                        (([[5, 6, 7], [8, 10]], 4, "float32"), "other tokens")):
        with pytest.raises(TeacherResponseError, match=match):
            protocol.decode_hidden(body, *args)
    protocol.decode_hidden(body, prompts, 4, "float32", (1.0, 0.0))
    huge = protocol.encode_hidden(prompts, torch.full((3, 4), 1e30))
    with pytest.raises(TeacherResponseError, match=r"hidden\[0\] has max \|h\| = 1e\+30: .* could overflow float32"):
        protocol.decode_hidden(huge, prompts, 4, "float32", (1e9, 0.0))
    weight = torch.randn(6, 4).to(torch.bfloat16)
    sha = protocol.head_digest(weight, None)
    head = protocol.encode_head(weight, None)
    got, bias = protocol.decode_head(head, (6, 4), "bfloat16", sha)
    assert torch.equal(got, weight) and bias is None
    flipped = bytearray(head)
    flipped[-1] ^= 1
    with pytest.raises(TeacherResponseError, match="do not hash to the head_sha256"):
        protocol.decode_head(bytes(flipped), (6, 4), "bfloat16", sha)
    with pytest.raises(TeacherResponseError, match=r"says \{\"shape\": \[6, 4\].*said shape \[7, 4\]"):
        protocol.decode_head(head, (7, 4), "bfloat16", sha)


def test_a_rows_peak_read_from_its_bits_is_its_largest_magnitude_and_flags_every_non_finite_value():
    """``hidden_peaks`` (the client's check, on whatever device the values are) against float64 ``abs().max()``: equal
    for every dtype that travels, subnormals, zeros, signed values and each dtype's largest finite value included;
    a NaN (either sign, any payload) or an infinity anywhere in a row flags that row and no other."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        values = (torch.randn(6, 33, generator=g) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
        values[0, 5], values[1, 0], values[2] = info.max, -info.max, 0.0
        values[3, 7] = -info.smallest_normal / 4  # a subnormal: the row's largest magnitude
        values[3, :7] = values[3, 8:] = 0.0
        peak, bad = protocol.hidden_peaks(values)
        assert torch.equal(peak.double(), values.double().abs().amax(-1)) and not bad.any(), dtype
        for row, poison in ((1, float("nan")), (4, float("inf")), (5, -float("inf"))):
            values[row, 3] = poison
        values[2, 9] = -float("nan")
        _, bad = protocol.hidden_peaks(values)
        assert bad.tolist() == [False, True, True, False, True, True], dtype


def test_a_sampled_answer_is_checked_whole_before_the_loss_sees_it():
    """payload: sampled (issue 41): counts that do not sum to k, an id outside the vocabulary or repeated, a
    log-probability above 0 or -inf in a used slot, another k or temperature, a cut-off body: each refused."""
    prompts, k = [[5, 6, 7]], 3
    ids = np.array([[4, 9, 0], [2, 3, 7]], dtype=np.int32)
    values = np.log(np.array([[0.5, 0.1, 1.0], [0.2, 0.3, 0.1]], dtype=np.float32))
    counts = np.array([[2, 1, 0], [1, 1, 1]], dtype=np.uint8)
    good = protocol.encode_sample(prompts, k, 1.0, ids, values, counts)
    (parsed,) = protocol.decode_sample(good, prompts, k, 1.0, VOCAB)
    assert np.array_equal(parsed[0], ids) and np.array_equal(parsed[2], counts)

    def changed(array: str, where: tuple, value: float) -> bytes:
        arrays = {"ids": ids.copy(), "values": values.copy(), "counts": counts.copy()}
        arrays[array][where] = value
        return protocol.encode_sample(prompts, k, 1.0, arrays["ids"], arrays["values"], arrays["counts"])

    for body, match in ((changed("counts", (0, 0), 3), "position 0, slot 0: counts that do not sum to k"),
                        (changed("ids", (1, 2), VOCAB), "position 1, slot 2: an id outside the vocabulary"),
                        (changed("ids", (1, 1), 2), "position 1, slot 1: an id given twice"),
                        (changed("values", (0, 1), 0.5), "position 0, slot 1: a log-probability that is not finite"),
                        (changed("values", (1, 0), -np.inf), "position 1, slot 0: a log-probability"),
                        (good[:-1], "cut off or padded"), (b"<html>", "not a distill_kit body")):
        with pytest.raises(TeacherResponseError, match=match):
            protocol.decode_sample(body, prompts, k, 1.0, VOCAB)
    for args, match in (((prompts, 4, 1.0), "k and temperature"), ((prompts, k, 2.0), "k and temperature"),
                        (([[5, 6, 8]], k, 1.0), "other tokens")):
        with pytest.raises(TeacherResponseError, match=match):
            protocol.decode_sample(good, *args, VOCAB)
    # an unused slot (count 0) may hold anything: the loss gives it weight 0
    protocol.decode_sample(changed("values", (0, 2), 7.0), prompts, k, 1.0, VOCAB)

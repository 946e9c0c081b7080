"""A served teacher against the project's own server, started as a real process on 127.0.0.1 (no mock of HTTP).

One server (the shipped default teacher, fp32 on the CPU) serves the file; it is killed and replaced once, for the
death-and-restart test, by a second server process loaded meanwhile (binding the port when told), and every server
is killed at the end. Checked: its targets equal the in-process teacher's top-k
(bitwise through the binary endpoint, which scores the micro-batch as one padded batch as the in-process forward
does; within a float32 bound through the vLLM-compatible JSON, scored a prompt at a time), so the losses equal too;
a tokenizer other than the server's refused before anything is built; every fault (slow, empty, truncated,
non-JSON, other tokens, another k, down at start, died and restarted, gone for good); requests past its caps or
empty refused, no API docs served; the vLLM and SGLang fixtures,
written from their schemas, parse to the same targets; a store captured from the server equals an in-process
capture's, bitwise, and what it cannot serve is refused before any write. About 60 s on 2 shared CPU cores, most
of it imports and the server's start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from launch import free_port
from transformers import AutoModelForCausalLM

from distill_kit.config import TeacherSpec
from distill_kit.errors import ConfigError
from distill_kit.teachers import served_protocol as protocol
from distill_kit.teachers.base import TOP_K, TOP_K_TAIL, TeacherSetup
from distill_kit.teachers.kinds import describe, kind_of
from distill_kit.teachers.served import ServedTeacher, prompts_of
from distill_kit.teachers.tokenizers import fingerprint_problems
from losses import build_loss
from losses.sparse import SparseTeacherLogits

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "distill_kit" / "assets" / "default" / "teacher"
FIXTURES = Path(__file__).parent / "fixtures" / "served"
KEY, KEY_ENV = "sk-test-31", "DISTILL_KIT_TEST_TEACHER_KEY"
STARTUP_S = 180  # a bounded wait: importing torch, transformers and DeepSpeed on a busy 2-core machine
B, T, K = 4, 40, 8


class Server:
    """scripts/serve_teacher.py as a subprocess: start (waiting for /health), kill."""

    def __init__(self, port: int, go: Path):
        self.port, self.process, self.spare, self.go = port, None, None, go
        self.url = f"http://127.0.0.1:{port}"

    def launch(self, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / "serve_teacher.py"), str(TEACHER), "--port", str(self.port),
             "--api-key", KEY, "--device", "cpu", "--dtype", "fp32", "--max-k", "64", "--threads",
             str(torch.get_num_threads()), "--test-faults", *extra],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ | {"PYTHONPATH": str(ROOT)})

    def prepare_restart(self) -> None:
        """A second server process, loading now, that binds the same port once ``restart`` says so: the restart
        test then waits ~1 s for it, not a whole start-up."""
        self.spare = self.launch("--bind-when-exists", str(self.go))

    def start(self) -> Server:
        self.process = self.launch()
        return self.wait()

    def restart(self) -> Server:
        self.process, self.spare = self.spare, None
        self.go.touch()
        return self.wait()

    def wait(self) -> Server:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"the server did not come up within {STARTUP_S} s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self.process = None

    def kill_all(self) -> None:
        self.kill()
        if self.spare is not None and self.spare.poll() is None:
            self.spare.kill()
            self.spare.wait(timeout=30)
        self.spare = None

    def fault(self, mode: str, **kwargs) -> None:
        reply = httpx.post(self.url + "/test/fault", json={"mode": mode, **kwargs},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert reply.status_code == 200, reply.text


@contextlib.contextmanager
def running_server(restart_dir: Path):
    """A server up (and its replacement loading, for a restart), its key in the environment; all of it gone after."""
    os.environ[KEY_ENV] = KEY
    srv = Server(free_port(), restart_dir)
    try:
        srv.start()
        srv.prepare_restart()
        yield srv
    finally:
        srv.kill_all()
        os.environ.pop(KEY_ENV, None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("served") / "restart") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference():
    """The in-process teacher, as the server loads it (fp32, CPU, the same threads)."""
    return AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32).eval()


def batches(count: int = 2, seed: int = 0) -> list[dict]:
    """Ragged right-padded micro-batches, the first row of each full (so the padded width is the longest row's)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(1, 1024, (B, T), generator=g)
        lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
        lengths[0] = T
        mask = (torch.arange(T)[None] < lengths[:, None]).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def teacher(url: str, **options) -> ServedTeacher:
    spec = TeacherSpec(name="served", model=url, options={"k": K, "api_key_env": KEY_ENV, "wait_s": 5,
                                                          "retries_s": 5, "timeout_s": 30} | options)
    card = describe(spec)
    return ServedTeacher(spec, card, TeacherSetup(ds_config={}, training=None, device=torch.device("cpu")))


def in_process_top_k(model, batch) -> SparseTeacherLogits:
    """What a causal LM's logits[:, t] give at k: top-k of log_softmax in float32, and the tail's log mass."""
    from distill_kit.offline.capture import top_k

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    values, ids, tails = top_k(logits.reshape(-1, logits.shape[-1]), K, 4096)
    return SparseTeacherLogits(values.reshape(B, T, K), ids.reshape(B, T, K), tails.reshape(B, T))


def counted(batch) -> torch.Tensor:
    """Positions whose next token is real: the ones a served teacher fills and the losses count."""
    mask = torch.zeros_like(batch["attention_mask"], dtype=torch.bool)
    mask[:, :-1] = batch["attention_mask"][:, 1:].bool()
    return mask


# ------------------------------------------------------------------------------------------------ no server


def test_a_url_is_a_served_teacher():
    assert kind_of(TeacherSpec(model="http://127.0.0.1:8100")) == "served"
    assert kind_of(TeacherSpec(model="https://teacher.example:443/")) == "served"


def test_fixtures_written_from_the_schemas_parse_to_the_same_targets():
    prompts, k = [[5, 17, 3, 9], [6, 7]], 2
    vllm = protocol.parse("vllm", (FIXTURES / "vllm_completion_prompt_logprobs.json").read_bytes(), prompts, k)
    sglang = protocol.parse("sglang", (FIXTURES / "sglang_generate_input_logprobs.json").read_bytes(), prompts, k)
    expected_ids = [[[17, 4], [8, 11], [12, 9]], [[7, 2]]]
    expected_values = [[[-0.25, -1.75], [-0.5, -1.5], [-0.125, -np.inf]], [[-0.0625, -3.0]]]
    for parsed in (vllm, sglang):
        for got, ids, values in zip(parsed, expected_ids, expected_values, strict=True):
            np.testing.assert_array_equal(got.ids, ids)  # by rank; vLLM's extra prompt token (rank 7) dropped
            np.testing.assert_array_equal(got.log_probs, np.asarray(values, dtype=np.float32))
    with pytest.raises(protocol.TeacherResponseError, match="other tokens"):
        protocol.parse("vllm", (FIXTURES / "vllm_completion_prompt_logprobs.json").read_bytes(),
                       [[5, 17, 3, 10], [6, 7]], k)
    with pytest.raises(protocol.TeacherResponseError, match="other tokens"):
        protocol.parse("sglang", (FIXTURES / "sglang_generate_input_logprobs.json").read_bytes(),
                       [[5, 17, 4, 9], [6, 7]], k)
    with pytest.raises(protocol.TeacherResponseError, match="k = 3"):
        protocol.parse("sglang", (FIXTURES / "sglang_generate_input_logprobs.json").read_bytes(), prompts, 3)


def test_rows_become_prompts_and_targets_land_on_the_positions_that_predict_them():
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 8, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])  # right and left padding
    rows = prompts_of({"input_ids": ids, "attention_mask": mask})
    assert [(r, t.tolist(), p.tolist()) for r, t, p in rows] == [(0, [5, 6, 7], [0, 1, 2]), (1, [8, 9, 10], [2, 3, 4])]
    packed = {"input_ids": torch.tensor([[1, 2, 3, 4, 5, 0]]), "position_ids": torch.tensor([[0, 1, 0, 1, 2, 0]])}
    rows = prompts_of(packed)  # two conversations; the one-token padding segment predicts nothing counted
    assert [(t.tolist(), p.tolist()) for _, t, p in rows] == [([1, 2], [0, 1]), ([3, 4, 5], [2, 3, 4])]


def test_server_down_at_start_is_one_clear_error_naming_the_url_and_the_fix():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"no distill_kit teacher server answered at {url} within wait_s=1 s.*"
                                          "serve_teacher.py"):
        describe(TeacherSpec(name="t", model=url, options={"wait_s": 1}))
    assert time.monotonic() - start < 10


# ---------------------------------------------------------------------------------------------- one server


def test_card_reports_the_servers_model(server):
    card = describe(TeacherSpec(name="t", model=server.url, options={"k": K, "api_key_env": KEY_ENV,
                                                                     "tokenizer": str(TEACHER)}))
    assert card.kind == "served" and card.outputs == frozenset({TOP_K, TOP_K_TAIL}) and not card.can_generate
    assert card.vocab_size == 1024 and card.tokenizer == str(TEACHER) and card.num_layers == 8
    assert fingerprint_problems([("t", card)], str(TEACHER)) == []
    with pytest.raises(ConfigError, match="refused the API key"):
        describe(TeacherSpec(name="t", model=server.url, options={"wait_s": 0}))


def test_targets_equal_the_in_process_teachers_top_k_and_so_do_the_losses(server, reference):
    served = teacher(server.url, rows_per_request=B)
    loss = build_loss({"name": "forward_kl", "chunk_size": 16})
    student = torch.randn(B, T, 1024, generator=torch.Generator().manual_seed(1))
    for batch in batches():
        got, want = served(**batch).logits, in_process_top_k(reference, batch)
        keep = counted(batch)
        assert torch.equal(got.ids[keep], want.ids[keep])  # bitwise: the same padded batch, fp32, threads
        assert torch.equal(got.log_probs[keep], want.log_probs[keep])
        assert torch.equal(got.log_tail[keep], want.log_tail[keep])
        assert not got.log_probs[~keep].any()  # padding and each row's last position: zeros
        for tail in (True, False):
            pick = (lambda t: t) if tail else (lambda t: SparseTeacherLogits(t.log_probs, t.ids))
            ours = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=pick(got)), batch).total
            theirs = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=pick(want)), batch).total
            assert torch.equal(ours, theirs)
    served.close()


def test_vllm_json_and_row_by_row_requests_agree_within_a_float32_bound(server, reference):
    """The vLLM-compatible endpoint scores each prompt alone (a (1, L) forward, not the (B, T) batch): float32 sums
    in another order. Bound: the logits' rounding, ~ a few eps32 x |logit| (|logit| < 30 here), carried into
    log_softmax; 1e-4 is ~50x that and far below any difference of teachers."""
    batch = batches(1, seed=3)[0]
    want, keep = in_process_top_k(reference, batch), counted(batch)
    for api, rows in (("vllm", 2), ("distill_kit", 1)):
        got = teacher(server.url, api=api, rows_per_request=rows).forward(batch).logits
        assert (got.log_probs[keep] - want.log_probs[keep]).abs().max() < 1e-4
        gaps = want.log_probs[keep][:, :-1] - want.log_probs[keep][:, 1:]  # ids may swap only within a near-tie
        same = got.ids[keep] == want.ids[keep]
        assert bool(same.all()) or float(gaps.min()) < 1e-4
        tail = got.log_tail[keep]  # vLLM gives none: log(1 - sum) from the k values, to float32's resolution
        assert (tail.exp() - want.log_tail[keep].exp()).abs().max() < 1e-5


def test_the_server_refuses_empty_and_oversized_requests_and_serves_no_api_docs(server):
    """The real process at its default caps (served_server.Limits): 1,024 prompts, 262,144 tokens, a 4 MiB + 64 KiB
    body; each refused before any forward, with the flag that raises it."""
    def post(body: dict | bytes) -> httpx.Response:
        content = body if isinstance(body, bytes) else None
        return httpx.post(server.url + "/v1/topk", json=None if content else body, content=content, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})

    empty = post({"prompts": [], "k": 4})
    assert empty.status_code == 400 and "empty" in empty.text
    rows = post({"prompts": [[1, 2]] * 1025, "k": 4})
    assert rows.status_code == 413 and "at most 1024 (serve_teacher.py --max-request-rows)" in rows.text
    tokens = post({"prompts": [[1] * 4096] * 64 + [[1, 2]], "k": 4})
    assert tokens.status_code == 413 and "262146 prompt tokens in one request" in tokens.text
    body = post(b'{"prompts": [[1, 2]], "k": 4, "pad": "' + b"x" * (5 << 20) + b'"}')
    assert body.status_code == 413 and "--max-request-bytes" in body.text
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path, timeout=10).status_code == 404
    assert httpx.get(server.url + "/info", headers={"Authorization": f"Bearer {KEY}x"}, timeout=10).status_code == 401


def test_prefetch_sends_the_next_batch_early_and_forward_takes_its_answer(server):
    served = teacher(server.url, rows_per_request=2, max_in_flight=4)
    first, second = batches(2, seed=5)
    plain = served.forward(second).logits
    served.prefetch(second)
    assert len(served.pending) == 1
    served.forward(first)
    time.sleep(0.5)
    got = served.forward(second).logits
    assert not served.pending and torch.equal(got.log_probs, plain.log_probs) and torch.equal(got.ids, plain.ids)
    served.close()


def test_another_tokenizer_is_refused_before_anything_is_built(server, tmp_path):
    from tiny_tokenizers import bpe

    other = tmp_path / "other_tokenizer"
    bpe("a b").save_pretrained(other)
    with pytest.raises(ConfigError, match=r"tokenizer.*is not teachers\[t\]\.options\.tokenizer's"):
        describe(TeacherSpec(name="t", model=server.url, options={"api_key_env": KEY_ENV, "tokenizer": str(other)}))
    card = describe(TeacherSpec(name="t", model=server.url, options={"api_key_env": KEY_ENV}))
    (problem,) = fingerprint_problems([("t", card)], str(other))
    assert "differs" in problem
    assert list(tmp_path.iterdir()) == [other]  # nothing written


def test_a_store_captured_from_the_server_equals_one_captured_in_process(server, tmp_path):
    """The same blocks (full, padded, filler rows in the last micro-batch) at the same k, float32 values: the
    in-process capture (a ZeRO-3 engine on one rank) and the served one give the same manifest but its source, and
    the same parts, bitwise. Why bitwise: the server scores a micro-batch's real blocks as one right-padded fp32
    batch on the same threads, one column wider (the token sent after each block's end, which no earlier position
    attends to); the extra column and the filler rows not sent change only how many masked keys (weight exactly 0
    after the softmax) and rows there are, not the order of any real position's sums. A CPU build whose kernels
    sum in another order would need the float32 bound of the vLLM test above (1e-4) instead."""
    import datasets
    from safetensors.torch import load_file
    from tiny_tokenizers import bpe
    from transformers import AutoTokenizer

    from distill_kit.offline.capture import CaptureConfig, capture
    from distill_kit.teachers import served_capture

    ids = torch.randint(1, 1024, (6, T), generator=torch.Generator().manual_seed(11))
    mask = (torch.arange(T)[None] < torch.tensor([T, T // 2, T, 2, T, T - 1])[:, None]).long()
    blocks = datasets.Dataset.from_dict({"input_ids": (ids * mask).tolist(), "attention_mask": mask.tolist(),
                                        "labels": ids.masked_fill(mask == 0, -100).tolist()})
    tokenizer, options = AutoTokenizer.from_pretrained(TEACHER), {"api_key_env": KEY_ENV, "rows_per_request": B}
    config = CaptureConfig(k=K, values_dtype="fp32", micro_batch_size=B, batches_per_part=1, dtype="fp32")
    for bad, match in ((dataclasses.replace(config, k=65), r"--k 65: .* at most 64.*--k 64 or less"),
                       (dataclasses.replace(config, hidden_layers=(1,)), "--hidden-layers: a served teacher")):
        with pytest.raises(ConfigError, match=match):
            served_capture.capture(server.url, tokenizer, blocks, tmp_path / "refused", bad, options)
    other = tmp_path / "other_tokenizer"
    bpe("a b").save_pretrained(other)
    with pytest.raises(ConfigError, match="tokenizer .* differs from --tokenizer's"):
        served_capture.capture(server.url, AutoTokenizer.from_pretrained(other), blocks, tmp_path / "refused",
                               config, options)
    with socket.socket() as sock:  # a port nothing listens on: the client's error, in the script's flags
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ConfigError) as stopped:
        served_capture.capture(down, tokenizer, blocks, tmp_path / "refused", config, {"wait_s": 0.2})
    assert str(stopped.value).startswith(f"--teacher: no distill_kit teacher server answered at {down}")
    assert "--teacher-options api" in str(stopped.value) and "teachers[" not in str(stopped.value)
    assert not (tmp_path / "refused").exists()  # every refusal before any write

    local = capture(str(TEACHER), tokenizer, blocks, tmp_path / "local", config)
    served = served_capture.capture(server.url, tokenizer, blocks, tmp_path / "served", config, options)
    assert vars(served.spec) == vars(local.spec) | {"teacher": server.url}  # the weights' sha256 included
    assert (served.world_size, served.micro_batch_size, served.complete) == (1, B, True)
    parts = sorted(p.relative_to(tmp_path / "local") for p in (tmp_path / "local").rglob("*.safetensors"))
    assert len(parts) == 2 and parts == sorted(p.relative_to(tmp_path / "served")
                                               for p in (tmp_path / "served").rglob("*.safetensors"))
    for part in parts:
        want, got = load_file(tmp_path / "local" / part), load_file(tmp_path / "served" / part)
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name


# ------------------------------------------------------------------------ payload: hidden (issue 41)

DIVERGENCES = [{"name": "forward_kl"}, {"name": "forward_kl", "temperature": 2.0}, {"name": "reverse_kl"},
               {"name": "generalized_jsd", "beta": 0.5, "temperature": 1.5}, {"name": "skew_forward_kl"},
               {"name": "skew_reverse_kl"}, {"name": "total_variation"}, {"name": "logit_mse"}]


def hidden_teacher(url: str, **options) -> ServedTeacher:
    return teacher(url, payload="hidden", **options)


def full_rows(seed: int) -> dict:
    """A micro-batch of full rows (no padding): routed sub-batches then have the in-process forward's width too."""
    ids = torch.randint(1, 1024, (B, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def loss_and_grad(loss, student_logits: torch.Tensor, teacher_out, batch) -> tuple[torch.Tensor, torch.Tensor]:
    student = student_logits.clone().requires_grad_(True)
    total = loss(SimpleNamespace(logits=student), teacher_out, batch).total
    (grad,) = torch.autograd.grad(total, student)
    return total.detach(), grad


def test_hidden_states_from_the_server_give_the_in_process_head_at_the_loss_losses_bitwise(server, reference):
    """payload: hidden against the in-process teacher's head at the loss (``engines/head.py``) on the same padded
    micro-batch: the server runs the same body on the same (B, T) right-padded fp32 batch on the same threads, so the
    hidden states at every counted position are the same bits, the head (from the server, or read from the folder)
    is the same tensor, and every loss and gradient after is the same arithmetic: bitwise, for every divergence at
    T = 1, 1.5 and 2; ``combine: mixture`` and ``route``; evaluation's KL and top-1 agreement."""
    from distill_kit.engines.head import teacher_head_forward
    from distill_kit.teachers.base import HEAD
    from distill_kit.teachers.combine import TeacherEnsembleLoss
    from distill_kit.teachers.group import Teachers
    from distill_kit.training.evaluation import token_statistics

    served = hidden_teacher(server.url, rows_per_request=B)
    local = hidden_teacher(server.url, rows_per_request=B, head=str(TEACHER))
    assert served.card.outputs == frozenset({HEAD}) and served.card.dense
    assert torch.equal(served.head.weight, local.head.weight) and torch.equal(served.head.weight,
                                                                                 reference.lm_head.weight)
    student = torch.randn(B, T, 1024, generator=torch.Generator().manual_seed(3))
    batch = batches(1, seed=11)[0]
    keep = counted(batch)
    got = served(**batch)
    with torch.no_grad():
        want = teacher_head_forward(reference, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert torch.equal(got.hidden[keep], want.hidden[keep])
    for options in DIVERGENCES:
        loss = build_loss(options | {"chunk_size": 16})
        ours, our_grad = loss_and_grad(loss, student, got, batch)
        theirs, their_grad = loss_and_grad(loss, student, want, batch)
        assert torch.equal(ours, theirs) and torch.equal(our_grad, their_grad), options

    # combine: mixture (two teachers, one served twice with its head applied in full, as an in-process teacher's
    # logits are when a mixture reads them) and evaluation's statistics against the mixture
    with torch.no_grad():
        dense = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    for options in ({"name": "reverse_kl", "temperature": 2.0}, {"name": "generalized_jsd", "beta": 0.3}):
        mix = TeacherEnsembleLoss({"a": build_loss(options), "b": build_loss(options)}, {"a": 0.3, "b": 0.7},
                                  "mixture")
        fresh = [served(**batch), served(**batch)]  # logits built lazily, once each
        ours, our_grad = loss_and_grad(mix, student, {"a": fresh[0], "b": fresh[1]}, batch)
        theirs, their_grad = loss_and_grad(mix, student, {"a": dense, "b": dense}, batch)
        assert torch.equal(ours, theirs) and torch.equal(our_grad, their_grad), options
    ours, theirs = (token_statistics(student, out.logits, batch) for out in (served(**batch), dense))
    assert ours.keys() == theirs.keys() and all(torch.equal(torch.as_tensor(ours[k]), torch.as_tensor(theirs[k]))
                                                for k in ours)

    # combine: route: each row's logits from its own teacher, a served one and the in-process one's stand-in
    class InProcess:
        def forward(self, inputs):
            return reference(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])

    full = full_rows(seed=13)
    route = torch.tensor([0, 1, 1, 0])
    specs = [TeacherSpec(name="a", model=served), TeacherSpec(name="b", model=local)]
    group = Teachers(specs, {}, {}, vocab_size=1024)
    routed = group.forward({"input_ids": full["input_ids"], "attention_mask": full["attention_mask"]}, route)
    group.members = {"a": InProcess(), "b": InProcess()}
    group._own = lambda teacher, inputs: inputs
    plain = group.forward({"input_ids": full["input_ids"], "attention_mask": full["attention_mask"]}, route)
    assert torch.equal(routed.logits[:, :-1], plain.logits[:, :-1])
    loss = build_loss({"name": "generalized_jsd", "beta": 0.5})
    assert torch.equal(loss_and_grad(loss, student, routed, full)[1], loss_and_grad(loss, student, plain, full)[1])
    served.close()
    local.close()


def test_hidden_states_are_prefetched_as_top_k_are(server):
    served = hidden_teacher(server.url, rows_per_request=2, max_in_flight=4)
    first, second = batches(2, seed=5)
    plain = served.forward(second).hidden
    served.prefetch(second)
    assert len(served.pending) == 1
    served.forward(first)
    time.sleep(0.5)
    waited = served.waited_s
    got = served.forward(second)
    assert not served.pending and torch.equal(got.hidden, plain) and served.waited_s - waited < 0.5
    served.close()


def test_a_large_hidden_state_answer_read_into_a_buffer_is_the_same_and_checked_the_same(server, monkeypatch):
    """The fast path (``served_wire.py``: the body read by the socket straight into one buffer, kept-alive
    connections), taken here by every answer (``SMALL`` 0; a real one is ~59 MB): the same bits as through h11, the
    server's phase times recorded, and a cut-off, foreign or other-token answer refused with the same message."""
    from distill_kit.teachers import served_wire

    batch = batches(1, seed=7)[0]
    slow = hidden_teacher(server.url, rows_per_request=2)
    want = slow.forward(batch).hidden
    monkeypatch.setattr(served_wire, "SMALL", 0)
    fast = hidden_teacher(server.url, rows_per_request=2)
    try:
        assert torch.equal(fast.forward(batch).hidden, want) and torch.equal(fast.forward(batch).hidden, want)
        timings = list(fast.transport.timings)
        assert len(timings) == 4 and all(t["server_forward"] >= 0 and t["body"] >= 0 for t in timings)
        assert len(fast.transport.wire.idle) >= 1  # kept alive and reused
        for mode, match in (("truncate", "cut off or padded"), ("other_tokens", "other tokens"),
                            ("garbage", "not a distill_kit body")):
            server.fault(mode)
            with pytest.raises(protocol.TeacherResponseError, match=match):
                fast.forward(batch)
    finally:
        server.fault("none")
        slow.close()
        fast.close()


def test_what_payload_hidden_cannot_have_is_refused_before_anything_is_built(server, reference, tmp_path):
    other = tmp_path / "other_teacher"
    changed = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32)
    with torch.no_grad():
        changed.lm_head.weight[0, 0] += 1e-3  # tied: the embedding changes with it
    changed.save_pretrained(other)
    options = {"api_key_env": KEY_ENV, "payload": "hidden"}
    with pytest.raises(ConfigError, match=r"options\.head .*other_teacher.*sha256 \(\w{12}, in float32\) is not "
                                          r"the server's \(\w{12}\).*leave it out to take the head from the server"):
        describe(TeacherSpec(name="t", model=server.url, options=options | {"head": str(other)}))
    with pytest.raises(ConfigError, match=r"payload: hidden: a vllm server serves top-k log-probabilities "
                                          r"\(prompt_logprobs\), not hidden states: use .*payload: top_k"):
        describe(TeacherSpec(name="t", model=server.url, options=options | {"api": "vllm"}))
    with pytest.raises(ConfigError, match=r"k = 2000: above the teacher's vocabulary \(1024 tokens\)"):
        describe(TeacherSpec(name="t", model=server.url, options={"api_key_env": KEY_ENV, "k": 2000}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_teacher"]  # nothing else written


def test_a_sampled_store_captured_through_the_servers_hidden_states_draws_what_the_teacher_gives(server, reference,
                                                                                                   tmp_path):
    """--targets sampled from a URL: the server sends hidden states, the client applies the head and draws, seeded
    by each micro-batch's tokens as the in-process capture is (``offline/capture.py:targets_of``). Against the
    reference's own logits on the same micro-batches: the same draws (ids and counts; a draw could only move if a
    probability sat within float32 rounding of its uniform's boundary) and log-probabilities within 1e-4, the vLLM
    test's float32 bound: the head is applied to a (B, T + 1, H) batch here (the token sent after each block's end)
    and to (B, T, H) in process, whose matmuls may sum in another order."""
    import datasets
    from transformers import AutoTokenizer

    from distill_kit.offline.capture import CaptureConfig, targets_of
    from distill_kit.offline.captured_teacher import CapturedTeacher
    from distill_kit.teachers import served_capture

    ids = torch.randint(1, 1024, (3, T), generator=torch.Generator().manual_seed(12))
    mask = (torch.arange(T)[None] < torch.tensor([T, T // 2, T - 3])[:, None]).long()
    ids = ids * mask
    blocks = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                                         "labels": ids.masked_fill(mask == 0, -100).tolist()})
    config = CaptureConfig(k=16, values_dtype="fp32", micro_batch_size=2, batches_per_part=4, dtype="fp32",
                           targets="sampled", temperature=1.5)
    manifest = served_capture.capture(server.url, AutoTokenizer.from_pretrained(TEACHER), blocks, tmp_path / "store",
                                      config, {"api_key_env": KEY_ENV, "rows_per_request": B})
    assert (manifest.spec.targets, manifest.spec.temperature, manifest.complete) == ("sampled", 1.5, True)
    got = CapturedTeacher(tmp_path / "store")(input_ids=ids, attention_mask=mask).logits
    for rows in (slice(0, 2), slice(2, 3)):  # the capture's micro-batches
        with torch.no_grad():
            logits = reference(input_ids=ids[rows], attention_mask=mask[rows]).logits
        keep = mask[rows].bool()
        values, drawn, counts = targets_of(logits[keep], ids[rows], config)
        assert torch.equal(got.ids[rows][keep], drawn) and torch.equal(got.counts[rows][keep], counts.to(torch.uint8))
        torch.testing.assert_close(got.log_probs[rows][keep], values, rtol=0, atol=1e-4)


def test_sampled_tokens_from_the_server_are_draws_of_the_teachers_distribution(server, reference):
    """payload: sampled: K = 12 draws at T = 1.5 a position, their counts summing to K, their log-probabilities the
    reference's log_softmax(logits / T) within 1e-4 (the vLLM test's float32 bound: the server's forward may sum in
    another order), the same answer to the same request (seeded by its tokens); forward KL at T reads them."""
    from distill_kit.teachers.base import SAMPLED

    served = teacher(server.url, payload="sampled", k=12, temperature=1.5, rows_per_request=B)
    assert served.card.outputs == frozenset({SAMPLED}) and served.card.sample_temperature == 1.5
    batch = batches(1, seed=21)[0]
    keep = counted(batch)
    got = served(**batch).logits
    again = served(**batch).logits
    assert torch.equal(got.ids, again.ids) and torch.equal(got.counts, again.counts)
    assert bool((got.counts.sum(-1)[keep] == 12).all()) and not got.counts[~keep].any()
    with torch.no_grad():
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    log_p = torch.log_softmax(logits / 1.5, -1).gather(-1, got.ids)
    used = got.counts > 0
    torch.testing.assert_close(got.log_probs[used], log_p[used], rtol=0, atol=1e-4)
    student = SimpleNamespace(logits=torch.randn(B, T, 1024, generator=torch.Generator().manual_seed(2)))
    loss = build_loss({"name": "forward_kl", "temperature": 1.5})(student, SimpleNamespace(logits=got), batch)
    assert torch.isfinite(loss.total)
    with pytest.raises(ConfigError, match="temperature 2: only payload: sampled draws at a temperature"):
        describe(TeacherSpec(name="t", model=server.url, options={"api_key_env": KEY_ENV, "temperature": 2}))
    served.close()


def test_a_bad_hidden_state_answer_is_refused_never_trained_on(server):
    served = hidden_teacher(server.url, rows_per_request=B)
    try:
        for mode, match in (("garbage", "not a distill_kit body"), ("truncate", "cut off"),
                            ("other_tokens", "other tokens")):
            server.fault(mode)
            with pytest.raises(protocol.TeacherResponseError, match=match):
                served.forward(batches(1)[0])
    finally:
        server.fault("none")
        served.close()


@pytest.mark.parametrize("api", ["distill_kit", "vllm"])
@pytest.mark.parametrize("mode, match", [("empty", "empty body"), ("garbage", "not (JSON|a distill_kit top-k)"),
                                         ("truncate", "cut off|not JSON"), ("other_tokens", "other tokens"),
                                         ("other_k", "k = ")])
def test_a_bad_answer_is_refused_never_trained_on(server, api, mode, match):
    served = teacher(server.url, api=api, rows_per_request=B)
    server.fault(mode)
    try:
        with pytest.raises(protocol.TeacherResponseError, match=match):
            served.forward(batches(1)[0])
    finally:
        server.fault("none")
        served.close()


def test_a_slow_server_times_out_naming_its_figure(server):
    served = teacher(server.url, timeout_s=1)
    server.fault("slow", slow_s=3)
    try:
        timed_out = r"timeout_s=1 s.*raise teachers\[served\]\.options\.timeout_s"
        with pytest.raises(protocol.TeacherTimeout, match=timed_out):
            served.forward(batches(1)[0])
    finally:
        time.sleep(3)  # let the slow answers drain before the next test
        server.fault("none")
        served.close()


def test_a_server_that_dies_is_waited_for_and_one_that_stays_down_stops_the_run(server):
    """Kill the real server mid-run: the client retries while it restarts and gets the same targets; killed again
    and left down, the run gets TeacherUnavailable saying to resume."""
    batch = batches(1, seed=7)[0]
    served = teacher(server.url, retries_s=STARTUP_S, rows_per_request=B)
    before = served.forward(batch).logits
    server.kill()
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=served.forward(batch).logits))
    thread.start()
    time.sleep(1)
    assert thread.is_alive()  # retrying, not failed
    server.restart()
    thread.join(timeout=60)
    assert torch.equal(result["out"].log_probs, before.log_probs) and torch.equal(result["out"].ids, before.ids)
    served.close()

    served = teacher(server.url, retries_s=2)
    server.kill()
    start = time.monotonic()
    with pytest.raises(protocol.TeacherUnavailable, match=r"has not answered for \d+ s.*resume with --resume"):
        served.forward(batch)
    assert time.monotonic() - start < 15
    served.close()

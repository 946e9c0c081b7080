"""The project's own teacher server: an in-process teacher behind vLLM's completions API and a compact binary one.

``scripts/serve_teacher.py`` builds it; this module is what it serves (FastAPI on uvicorn):

* ``GET /health``; ``GET /info``: the model, its vocabulary size, ``tokenizer_sha256`` (the vocabulary's sha256,
  as ``offline/fingerprints.tokenizer_fingerprint`` computes it), ``teacher_sha256`` (its weights', as checkpoints
  record a teacher), ``max_k``, ``max_model_len`` and the model config (what a fresh student is built from);
  ``GET /v1/models``: vLLM's model list, with the same facts added to the entry.
* ``POST /v1/completions``: vLLM-compatible, for token-id prompts with ``prompt_logprobs`` (the fields and the
  serialisation of ``vllm/entrypoints/openai/completion/protocol.py``; one greedy token per prompt). So a client,
  or the tests, can use one code path against this server and a real vLLM.
* ``POST /v1/topk``: ``{"prompts": [[ids]], "k": k}`` -> the binary body of ``served_protocol.encode_topk``, with
  the tail's exact mass: parsing it costs a copy, where JSON costs a Python object per entry.
* ``POST /v1/hidden``: ``{"prompts": [[ids]]}`` -> each position's final hidden state (after the final norm, in
  the model's dtype), ``served_protocol.encode_hidden``; ``GET /v1/head``: the output head's weight and bias,
  ``served_protocol.encode_head``, whose sha256 ``/info`` reports as ``head_sha256``. The client applies the head at
  the loss, as an in-process teacher's head is applied (``losses/chunked.py:head_chunk_loss``): the whole
  distribution at H values a position. Only for models whose logits are exactly ``head(hidden)``
  (``engines/head.py:EXACT_HEADS``; ``/info``'s ``payloads`` says).
* ``POST /v1/sample``: ``{"prompts": [[ids]], "k": k, "temperature": t}`` -> per position k tokens drawn from the
  teacher at ``t`` (their distinct ids, log-probabilities and counts: ``served_protocol.encode_sample``), for forward
  KL's unbiased estimate (RS-KD), at 9 k bytes a position; seeded by the request's tokens.

Requests to the model are served one forward at a time (a lock): the client keeps several in flight so the next is
queued while one runs. With ``api_key``, every endpoint but ``/health`` wants ``Authorization: Bearer <key>``, as
``vllm serve --api-key`` does, compared in constant time. Nothing else answers: no ``/docs``, ``/redoc`` or
``/openapi.json``.

What one request may ask is capped (:class:`Limits`): its body's bytes (HTTP 413 as it arrives, before any parse),
its prompts, its tokens and its answer's size (HTTP 413, before any forward); an empty prompt list is HTTP 400.
The model's logits are reduced to the top k one batch of at most ``max_batch_tokens`` tokens at a time, so a
request's memory is one batch's logits, not every prompt's.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from torch import nn

from distill_kit.teachers import served_protocol as protocol

FAULTS = ("none", "slow", "empty", "garbage", "truncate", "other_tokens", "other_k")
"""Test aids (``serve_teacher.py --test-faults``, then ``POST /test/fault``): each makes the server misbehave as a
cluster's server can, without a restart per fault."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (``serve_teacher.py --max-request-*``). The client's defaults (8 rows
    a request) fit in them up to rows of 32,768 tokens."""

    rows: int = 1024
    """Prompts in one request."""
    tokens: int = 1 << 18
    """Prompt tokens in one request (262,144): 8 rows of 32,768; the forward runs them ``max_batch_tokens`` at a
    time, so this bounds the time a request holds the model, not its memory."""
    answer_bytes: int = 256 << 20
    """A ``/v1/topk`` answer's size (positions x (8 k + 4) bytes): the client's default ``max_response_bytes``, so
    what it would refuse is refused here first, before the forward (262,144 tokens at k = 20 are 43 MB)."""
    json_entries: int = 1 << 21
    """Positions x (k + 1) entries of a ``/v1/completions`` answer (2,097,152): each is a Python dict while the JSON
    is built (~0.5 KB with its text), so ~1 GB at the cap; 8 rows of 8,192 tokens at k = 20 are 1.4M."""
    body_bytes: int | None = None
    """The request body's size; None: 16 bytes a token of :attr:`tokens` plus 64 KiB (4 MiB + 64 KiB): a token id
    below 10^6 is at most 6 digits and ``", "`` in JSON (8 bytes), so twice that, and the rest of the JSON."""

    @property
    def body(self) -> int:
        return self.body_bytes if self.body_bytes is not None else 16 * self.tokens + (64 << 10)


class BodyLimit:
    """ASGI middleware: a request body past ``limit`` bytes is refused with HTTP 413 as it arrives (by its
    Content-Length, or counted as it is read), before anything parses it."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    def refusal(self) -> HTTPException:
        return HTTPException(status_code=413, detail=f"request body over {self.limit} bytes (serve_teacher.py "
                                                     "--max-request-bytes): send fewer rows a request "
                                                     "(the client's rows_per_request)")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            refusal = self.refusal()
            response = JSONResponse(status_code=refusal.status_code, content={"detail": refusal.detail})
            return await response(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if seen > self.limit:
                raise self.refusal()  # inside the body's read: FastAPI answers it as this 413
            return message

        await self.app(scope, counted, send)


class TopKRequest(BaseModel):
    prompts: list[list[int]]
    k: int


class HiddenRequest(BaseModel):
    prompts: list[list[int]]


class SampleRequest(BaseModel):
    prompts: list[list[int]]
    k: int
    temperature: float = 1.0


class CompletionRequest(BaseModel):
    """The fields of vLLM's ``CompletionRequest`` this server reads; others are ignored, as vLLM ignores none."""

    model: str | None = None
    prompt: list[int] | list[list[int]]
    prompt_logprobs: int | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    return_token_ids: bool | None = None
    logprobs: int | None = None
    echo: bool | None = False


class FaultRequest(BaseModel):
    mode: str = "none"
    after: int = 0
    """Scoring requests answered well before the fault starts."""
    slow_s: float = 30.0


class Scorer:
    """The model's top-k log-probabilities of token-id prompts, each prompt scored as its own right-padded row."""

    def __init__(self, model: nn.Module, device: torch.device, max_batch_tokens: int = 65536,
                 chunk_tokens: int = 2048):
        self.model, self.device = model.eval(), device
        self.max_batch_tokens, self.chunk_tokens = max_batch_tokens, chunk_tokens
        self.lock = threading.Lock()

    def batches(self, prompts: Sequence[Sequence[int]], hidden: bool = False, locked: bool = False
                ) -> Iterator[tuple[Sequence[Sequence[int]], torch.Tensor]]:
        """The prompts in right-padded batches of at most ``max_batch_tokens`` tokens (a longer prompt alone), each
        with its ``(rows, width, V)`` logits in the model's dtype (``hidden``: its ``(rows, width, H)`` final hidden
        states, after the final norm, what the head reads: the body's forward, as ``engines/head.py`` runs an
        in-process teacher's); a batch's go when the caller takes the next, so memory holds one batch's."""
        start = 0
        while start < len(prompts):
            longest, stop = 0, start
            while stop < len(prompts) and max(longest, len(prompts[stop])) * (stop - start + 1) <= max(
                    self.max_batch_tokens, len(prompts[stop])):
                longest, stop = max(longest, len(prompts[stop])), stop + 1
            group = prompts[start:stop]
            ids = torch.zeros((len(group), longest), dtype=torch.long)
            mask = torch.zeros((len(group), longest), dtype=torch.long)
            for row, prompt in enumerate(group):
                ids[row, :len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
                mask[row, :len(prompt)] = 1
            # no_grad here, not as a decorator: torch's generator wrapper keeps the last item it passed on, which
            # would keep this batch's logits alive through the next batch's forward
            with contextlib.nullcontext() if locked else self.lock, torch.no_grad():
                inputs = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
                logits = (self.model.base_model(**inputs).last_hidden_state if hidden
                          else self.model(**inputs).logits)
            yield group, logits
            del logits
            start = stop

    def logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each prompt's ``(L, V)`` logits (in the model's dtype): every prompt's kept, for a few short ones."""
        return [logits[row, :len(prompt)] for group, logits in self.batches(prompts)
                for row, prompt in enumerate(group)]

    @torch.no_grad()
    def topk(self, prompts: Sequence[Sequence[int]], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For every prompt's first ``L - 1`` positions, in order: ids (N, k) int32, log-probabilities (N, k)
        float32 and the tail's log mass (N,) float32, as ``offline/capture.top_k`` computes them, one batch at a
        time (the batch's logits dropped before the next forward)."""
        from distill_kit.offline.capture import top_k

        ids, values, tails = [], [], []
        for group, logits in self.batches(prompts):
            rows = torch.cat([logits[row, :len(prompt) - 1] for row, prompt in enumerate(group)])
            top_values, top_ids, top_tails = top_k(rows, k, self.chunk_tokens)
            del rows
            ids.append(top_ids.int().cpu())
            values.append(top_values.cpu())
            tails.append(top_tails.cpu())
            del logits  # before the next batch's forward: one batch's logits alive at a time
        return torch.cat(ids).numpy(), torch.cat(values).numpy(), torch.cat(tails).numpy()

    @torch.no_grad()
    def sample(self, prompts: Sequence[Sequence[int]], k: int, temperature: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For every prompt's first ``L - 1`` positions, in order: ``k`` tokens drawn at ``temperature``
        (``offline/capture.py:sample``): ids (N, k) int32, log-probabilities (N, k) float32, counts (N, k) uint8. The
        draws are seeded by the request's tokens, so the same request gets the same answer (a retried one too)."""
        from distill_kit.offline.capture import batch_generator, sample

        tokens = torch.as_tensor([t for prompt in prompts for t in prompt])
        generator = batch_generator(tokens, self.device)
        ids, values, counts = [], [], []
        for group, logits in self.batches(prompts):
            rows = torch.cat([logits[row, :len(prompt) - 1] for row, prompt in enumerate(group)])
            drawn_values, drawn_ids, drawn_counts = sample(rows, k, temperature, generator, self.chunk_tokens)
            del rows
            ids.append(drawn_ids.int().cpu())
            values.append(drawn_values.float().cpu())
            counts.append(drawn_counts.to(torch.uint8).cpu())
            del logits
        return torch.cat(ids).numpy(), torch.cat(values).numpy(), torch.cat(counts).numpy()

    def hidden(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, dict[str, float]]:
        """For every prompt's first ``L - 1`` positions, in order: the final hidden states (N, H) in the model's
        dtype, gathered on the device and copied to the host in one transfer (into pinned memory on a GPU, so the
        copy is one DMA), and the seconds each phase took: ``lock`` (waiting for the model), ``forward`` (the
        forwards and the gather), ``copy`` (device to host)."""
        cuda = self.device.type == "cuda"
        times = {"lock": 0.0, "forward": 0.0, "copy": 0.0}
        start = time.perf_counter()
        with self.lock:  # one request's batches together: its forwards, then its copy, then the next request
            times["lock"] = time.perf_counter() - start
            rows = [states[row, :len(prompt) - 1] for group, states in self.batches(prompts, hidden=True, locked=True)
                    for row, prompt in enumerate(group)]
            gathered = torch.cat(rows) if len(rows) > 1 else rows[0].contiguous()
            del rows
            if cuda:
                torch.cuda.synchronize(self.device)
            forwarded = time.perf_counter()
            times["forward"] = forwarded - start - times["lock"]
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=cuda)
            host.copy_(gathered, non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize(self.device)
            times["copy"] = time.perf_counter() - forwarded
        return host, times

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output head's weight (V, H) and bias (V,) or None, on the CPU in their dtype (an FP8 teacher's stays
        bf16: ``engines/fp8.py``)."""
        head = self.model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        return head.weight.detach().cpu(), None if bias is None else bias.detach().cpu()

    def vllm_positions(self, prompt: Sequence[int], k: int) -> tuple[list[Any], int]:
        """One prompt's ``prompt_logprobs`` as vLLM serialises them (``None``, then per token its top k by rank and
        the token itself with its true rank when not among them), and the greedy next token."""
        logits = self.logits([prompt])[0].float()
        log_p = F.log_softmax(logits, dim=-1)
        values, ids = log_p[:-1].topk(k, dim=-1)
        targets = torch.as_tensor(prompt[1:], dtype=torch.long, device=log_p.device)
        own = log_p[:-1].gather(-1, targets[:, None])[:, 0]
        ranks = (log_p[:-1] > own[:, None]).sum(-1) + 1
        positions: list[Any] = [None]
        for j in range(len(prompt) - 1):
            entry = {int(t): {"logprob": max(float(v), protocol.VLLM_NEG_INF), "rank": r + 1, "decoded_token": None}
                     for r, (v, t) in enumerate(zip(values[j].tolist(), ids[j].tolist(), strict=True))}
            if int(targets[j]) not in entry:
                entry[int(targets[j])] = {"logprob": max(float(own[j]), protocol.VLLM_NEG_INF),
                                          "rank": int(ranks[j]), "decoded_token": None}
            positions.append({str(t): v for t, v in entry.items()})
        return positions, int(log_p[-1].argmax())


def build_app(scorer: Scorer, info: dict[str, Any], *, api_key: str | None = None, test_faults: bool = False,
              limits: Limits | None = None) -> FastAPI:
    """The FastAPI app. ``info``: what ``/info`` reports (``model``, ``vocab_size``, ``tokenizer_sha256``, ...).
    ``limits``: what one request may ask (:class:`Limits`' defaults). ``test_faults``: adds ``POST /test/fault``
    (:class:`FaultRequest`), which makes every scoring request after the next ``after`` misbehave as ``mode`` says
    (tests only)."""
    limits = limits or Limits()
    app = FastAPI(title="distill-kit teacher server", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=limits.body)
    fault = {"mode": "none", "after": 0, "slow_s": 30.0, "count": 0}
    max_k = int(info["max_k"])
    expected = f"Bearer {api_key}".encode() if api_key is not None else None

    def authorised(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if expected is not None and not hmac.compare_digest(given, expected):  # constant time: no timing oracle
            raise HTTPException(status_code=401, detail="Unauthorized: send Authorization: Bearer <api key>")

    def checked(prompts: Any, k: int) -> list[list[int]]:
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]
        if not (isinstance(prompts, list) and all(isinstance(p, list) and p for p in prompts)):
            raise HTTPException(status_code=400, detail="prompt: give a list of non-empty token-id lists")
        if not prompts:
            raise HTTPException(status_code=400, detail="prompt: the list is empty; send at least one prompt")
        if len(prompts) > limits.rows:
            raise HTTPException(status_code=413, detail=f"{len(prompts)} prompts in one request; this server takes "
                                                        f"at most {limits.rows} (serve_teacher.py --max-request-rows):"
                                                        " send fewer rows a request (rows_per_request)")
        tokens = sum(map(len, prompts))
        if tokens > limits.tokens:
            raise HTTPException(status_code=413, detail=f"{tokens} prompt tokens in one request; this server takes "
                                                        f"at most {limits.tokens} (serve_teacher.py "
                                                        "--max-request-tokens): send fewer rows a request "
                                                        "(rows_per_request)")
        vocab = int(info["vocab_size"])
        if any(not (isinstance(t, int) and 0 <= t < vocab) for p in prompts for t in p):
            raise HTTPException(status_code=400, detail=f"prompt: token ids must be in [0, {vocab})")
        if not 1 <= k <= max_k:
            raise HTTPException(status_code=400, detail=f"k = {k}: this server gives 1 to {max_k} "
                                                        "(serve_teacher.py --max-k)")
        too_long = [len(p) for p in prompts if len(p) > int(info["max_model_len"])]
        if too_long:
            raise HTTPException(status_code=400, detail=f"prompt of {too_long[0]} tokens: longer than "
                                                        f"max_model_len {info['max_model_len']}")
        return prompts

    def faulty() -> str:
        fault["count"] += 1
        mode = fault["mode"] if fault["count"] > fault["after"] else "none"
        if mode == "slow":
            time.sleep(fault["slow_s"])
        return mode

    if test_faults:
        @app.post("/test/fault", dependencies=[Depends(authorised)])
        def set_fault(request: FaultRequest) -> dict[str, Any]:
            if request.mode not in FAULTS:
                raise HTTPException(status_code=400, detail=f"mode {request.mode!r}: one of {FAULTS}")
            fault.update(mode=request.mode, after=request.after, slow_s=request.slow_s, count=0)
            return {"mode": request.mode}

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/info", dependencies=[Depends(authorised)])
    def get_info() -> dict[str, Any]:
        return info | {"api": "distill_kit"}

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    def models() -> dict[str, Any]:
        entry = {"id": info["model"], "object": "model", "created": int(time.time()), "owned_by": "distill_kit",
                 "root": info["model"], "parent": None, "max_model_len": info["max_model_len"]}
        return {"object": "list", "data": [entry | {"distill_kit": get_info()}]}

    def too_large(what: str, size: int, cap: int, flag: str) -> None:
        if size > cap:
            raise HTTPException(status_code=413, detail=f"the answer would hold {size} {what}, more than this "
                                                        f"server's {cap} (serve_teacher.py {flag}): send fewer rows "
                                                        "a request (rows_per_request), or a smaller k")

    def asked(prompts: list[list[int]]) -> int:  # positions an answer holds
        return sum(len(p) - 1 for p in prompts)

    @app.post("/v1/topk", dependencies=[Depends(authorised)])
    def topk(request: TopKRequest) -> Response:
        prompts = checked(request.prompts, request.k)
        too_large("bytes", asked(prompts) * (8 * request.k + 4), limits.answer_bytes, "--max-answer-bytes")
        mode = faulty()
        k = _other_k(request.k, max_k) if mode == "other_k" else request.k
        scored = _other_tokens(prompts, info) if mode == "other_tokens" else prompts
        body = protocol.encode_topk(scored, k, *scorer.topk(scored, k))
        return Response(content=_broken(body, mode), media_type=protocol.BINARY_MEDIA_TYPE)

    hidden_ok = "hidden" in info.get("payloads", ())
    head_body: list[bytes] = []  # encoded once, on the first ask

    @app.post("/v1/hidden", dependencies=[Depends(authorised)])
    def hidden(request: HiddenRequest) -> Response:
        if not hidden_ok:
            raise HTTPException(status_code=400, detail="this server's model applies more than a linear head to its "
                                                        "final hidden states (engines/head.py EXACT_HEADS): ask "
                                                        "/v1/topk")
        prompts = checked(request.prompts, 1)
        too_large("bytes", asked(prompts) * int(info["hidden_size"]) * protocol.DTYPES[info["hidden_dtype"]][1],
                  limits.answer_bytes, "--max-answer-bytes")
        mode = faulty()
        scored = _other_tokens(prompts, info) if mode == "other_tokens" else prompts
        host, times = scorer.hidden(scored)
        start = time.perf_counter()
        body = protocol.encode_hidden(scored, host)
        times["encode"] = time.perf_counter() - start
        return Response(content=_broken(body, mode), media_type=protocol.HIDDEN_MEDIA_TYPE,
                        headers={protocol.TIMING_HEADER: protocol.timing_value(times)})

    @app.post("/v1/sample", dependencies=[Depends(authorised)])
    def sampled(request: SampleRequest) -> Response:
        prompts = checked(request.prompts, request.k)
        if request.k > 255 or not (0 < request.temperature < float("inf")):
            raise HTTPException(status_code=400, detail=f"k = {request.k} at temperature {request.temperature}: "
                                                        "draws are 1 to 255 a position (counts are one byte), at a "
                                                        "temperature > 0")
        too_large("bytes", asked(prompts) * 9 * request.k, limits.answer_bytes, "--max-answer-bytes")
        mode = faulty()
        scored = _other_tokens(prompts, info) if mode == "other_tokens" else prompts
        body = protocol.encode_sample(scored, request.k, request.temperature,
                                      *scorer.sample(scored, request.k, request.temperature))
        return Response(content=_broken(body, mode), media_type=protocol.BINARY_MEDIA_TYPE)

    @app.get("/v1/head", dependencies=[Depends(authorised)])
    def head() -> Response:
        if not hidden_ok:
            raise HTTPException(status_code=400, detail="this server gives no head: its model is not one whose "
                                                        "logits are its head's output")
        if not head_body:
            head_body.append(protocol.encode_head(*scorer.head()))
        return Response(content=head_body[0], media_type=protocol.HIDDEN_MEDIA_TYPE)

    @app.post("/v1/completions", dependencies=[Depends(authorised)])
    def completions(request: CompletionRequest) -> Response:
        if request.model not in (None, info["model"]):
            return JSONResponse(status_code=404, content={"error": {
                "message": f"The model `{request.model}` does not exist.", "type": "NotFoundError", "code": 404}})
        if request.prompt_logprobs is None or request.logprobs is not None or request.echo:
            raise HTTPException(status_code=400, detail="this server scores prompts: send prompt_logprobs: k, "
                                                        "max_tokens: 1, and no logprobs or echo")
        prompts = checked(request.prompt, request.prompt_logprobs)
        too_large("entries", asked(prompts) * (request.prompt_logprobs + 1), limits.json_entries,
                  "--max-json-entries")
        mode = faulty()
        k = _other_k(request.prompt_logprobs, max_k) if mode == "other_k" else request.prompt_logprobs
        choices = []
        for index, scored in enumerate(_other_tokens(prompts, info) if mode == "other_tokens" else prompts):
            positions, next_token = scorer.vllm_positions(scored, k)
            choices.append({"index": index, "text": "", "logprobs": None, "finish_reason": "length",
                            "stop_reason": None, "token_ids": [next_token] if request.return_token_ids else None,
                            "prompt_logprobs": positions,
                            "prompt_token_ids": scored if request.return_token_ids else None})
        tokens = sum(len(p) for p in prompts)
        document = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": info["model"], "choices": choices, "system_fingerprint": None,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens + len(prompts),
                              "completion_tokens": len(prompts), "prompt_tokens_details": None}}
        return Response(content=_broken(json.dumps(document).encode(), mode), media_type="application/json")

    return app


def _other_k(k: int, max_k: int) -> int:
    return k + 1 if k < max_k else k - 1


def _other_tokens(prompts: list[list[int]], info: dict[str, Any]) -> list[list[int]]:
    return [[(t + 1) % int(info["vocab_size"]) for t in p] for p in prompts]


def _broken(body: bytes, mode: str) -> bytes:
    """``body`` as a fault mode sends it (a test aid)."""
    if mode == "empty":
        return b""
    if mode == "garbage":
        return b"<html><body>502 Bad Gateway</body></html>"
    if mode == "truncate":
        return body[: len(body) // 2]
    return body

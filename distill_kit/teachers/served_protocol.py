"""What a served teacher's requests and responses are, in the three dialects the client speaks, parsed to one form.

For every prompt (a row's real tokens) of length ``L`` the client wants ``L - 1`` rows of top-k targets: row ``j``
is the teacher's distribution of token ``j + 1`` given tokens ``0..j``, what a causal LM's ``logits[:, j]`` mean.
The last token's prediction (past the row's end) is never asked for: no loss counts it (``losses.base``).

* **vLLM**, OpenAI-compatible ``POST /v1/completions`` (``vllm/entrypoints/openai/completion/protocol.py``):
  ``prompt`` a list of token-id lists, ``prompt_logprobs: k``, ``max_tokens: 1``. Each choice (one per prompt, in
  order) has ``prompt_logprobs``: a list as long as the prompt whose first entry is ``null`` (nothing predicts the
  first token) and whose entry ``j`` maps ``"token id"`` to ``{"logprob", "rank", "decoded_token"}``: the top k by
  rank 1..k, plus the prompt's own token ``j`` with its true rank when it is not among them (``k`` or ``k + 1``
  keys; ``-inf`` sent as ``-9999.0``). So entry ``j + 1`` is our row ``j``.
* **SGLang**, native ``POST /generate`` (``python/sglang/srt/managers/io_struct.py`` ``GenerateReqInput``):
  ``input_ids``, ``return_logprob``, ``logprob_start_len: 0``, ``top_logprobs_num: k``. Each item's ``meta_info``
  has ``input_token_logprobs`` (``[logprob|null, token_id, text|null]`` per prompt token, the first ``null``) and
  ``input_top_logprobs`` (per prompt token ``null`` or a list of ``[logprob, token_id, text|null]``, the first
  ``null``): again entry ``j + 1`` is our row ``j``. A log-probability of -inf may arrive as ``null`` (orjson writes
  it so), ``-Infinity`` or -9999; each reads as -inf.
* **distill_kit**, this project's ``POST /v1/topk`` (``scripts/serve_teacher.py``): a JSON request, a binary
  response of raw little-endian arrays after a small JSON header (:func:`encode_topk`): no per-entry parsing, and
  the tail's exact mass (a logsumexp over the other tokens, as the capture computes it).

Every parser refuses (:class:`TeacherResponseError`) a body that is empty, truncated, not JSON, for other tokens,
or of another k; nothing received is executed or unpickled (JSON and ``numpy.frombuffer`` of plain numbers only).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distill_kit.errors import TeacherResponseError, TeacherUnavailable

APIS = ("distill_kit", "vllm", "sglang")
MAGIC = b"DKT1"
"""The first bytes of a ``/v1/topk`` response; then a little-endian uint32 header length, the JSON header, arrays."""
BINARY_MEDIA_TYPE = "application/vnd.distill-kit.topk"
VLLM_NEG_INF = -9999.0
"""What vLLM sends for a log-probability of -inf (``clamp_prompt_logprobs``)."""


class TeacherTimeout(TeacherUnavailable):
    """One request took longer than ``timeout_s`` (its whole deadline); the message names the figure and how to
    raise it."""



@dataclass(frozen=True)
class PromptTargets:
    """One prompt's targets: ``L - 1`` rows, row ``j`` predicting token ``j + 1``.

    ``ids`` (L-1, k) int32, ``log_probs`` (L-1, k) float32 (log p at temperature 1, by rank), ``log_tail`` (L-1,)
    float32 (log of the mass outside the k ids) or None where the server gives none."""

    ids: np.ndarray
    log_probs: np.ndarray
    log_tail: np.ndarray | None = None


def tokens_digest(prompts: Sequence[Sequence[int]]) -> str:
    """sha256 of the prompts (their lengths, then their ids as little-endian int32): which tokens a response is for."""
    digest = hashlib.sha256(np.asarray([len(p) for p in prompts], dtype="<i4").tobytes())
    for prompt in prompts:
        digest.update(np.asarray(prompt, dtype="<i4").tobytes())
    return digest.hexdigest()


def derived_tail(log_probs: np.ndarray) -> np.ndarray:
    """log(1 - sum of the top-k probabilities), in float64, for servers that give no tail (vLLM, SGLang).

    Their top-k log-probabilities are normalised over the whole vocabulary, so the rest's mass is what they leave.
    Exact to float32's rounding of the k values (about 1e-7 of absolute mass): a tail far below that reads as 0
    (log -inf) and the tail bucket then asks the student for no mass outside the k ids."""
    rest = 1.0 - np.exp(log_probs.astype(np.float64)).sum(-1)
    with np.errstate(divide="ignore"):
        return np.log(np.clip(rest, 0.0, 1.0)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------- requests


def request_body(api: str, prompts: Sequence[Sequence[int]], k: int, model: str | None = None) -> dict[str, Any]:
    """The JSON body that asks ``api``'s server for ``prompts``' top-k prompt log-probabilities."""
    prompts = [list(map(int, p)) for p in prompts]
    if api == "vllm":
        # max_tokens 1: a completion must generate something; the one token costs one decode step.
        body: dict[str, Any] = {"prompt": prompts, "prompt_logprobs": k, "max_tokens": 1, "temperature": 1.0,
                                "return_token_ids": True}
        return body | ({"model": model} if model else {})
    if api == "sglang":
        return {"input_ids": prompts, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k,
                "return_text_in_logprobs": False}
    if api == "distill_kit":
        return {"prompts": prompts, "k": k}
    raise ValueError(f"api {api!r}: choose one of {', '.join(APIS)}")


ENDPOINTS = {"vllm": "/v1/completions", "sglang": "/generate", "distill_kit": "/v1/topk"}
INFO_ENDPOINTS = {"vllm": "/v1/models", "sglang": "/get_model_info", "distill_kit": "/info"}


def parse(api: str, body: bytes, prompts: Sequence[Sequence[int]], k: int) -> list[PromptTargets]:
    """``api``'s response ``body`` to ``prompts`` as one :class:`PromptTargets` per prompt, or a refusal."""
    if not body:
        raise TeacherResponseError("the teacher server answered with an empty body")
    if api == "distill_kit":
        return decode_topk(body, prompts, k)
    document = _json(body)
    return parse_vllm(document, prompts, k) if api == "vllm" else parse_sglang(document, prompts, k)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError) as err:
        head = body[:80].decode("utf-8", "replace")
        raise TeacherResponseError(f"the teacher server's answer is not JSON ({err}; it starts {head!r}): a "
                                   "truncated body, or another service on that port") from None


def _check_count(items: Any, prompts: Sequence[Sequence[int]], what: str) -> None:
    if not isinstance(items, list) or len(items) != len(prompts):
        got = len(items) if isinstance(items, list) else type(items).__name__
        raise TeacherResponseError(f"the teacher server returned {got} {what} for {len(prompts)} prompts")


def parse_vllm(document: Any, prompts: Sequence[Sequence[int]], k: int) -> list[PromptTargets]:
    """A vLLM ``CompletionResponse`` (module docstring) to targets; the prompt token at each position must be one of
    its keys (vLLM always includes it), so a response for other tokens is refused."""
    if not isinstance(document, dict) or "choices" not in document:
        raise TeacherResponseError(f"the vLLM response has no choices: {str(document)[:200]}")
    choices = sorted(document["choices"], key=lambda c: c.get("index", 0)) if isinstance(
        document["choices"], list) else document["choices"]
    _check_count(choices, prompts, "choices")
    out = []
    for number, (choice, prompt) in enumerate(zip(choices, prompts, strict=True)):
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and list(echoed) != list(prompt):
            raise TeacherResponseError(f"prompt {number}: the vLLM response is for other tokens (prompt_token_ids "
                                       "differ from the ones sent)")
        positions = choice.get("prompt_logprobs")
        if not isinstance(positions, list) or len(positions) != len(prompt):
            raise TeacherResponseError(f"prompt {number}: prompt_logprobs has "
                                       f"{len(positions) if isinstance(positions, list) else positions!r} entries "
                                       f"for {len(prompt)} tokens (was prompt_logprobs: {k} sent?)")
        ids = np.zeros((len(prompt) - 1, k), dtype=np.int32)
        values = np.zeros((len(prompt) - 1, k), dtype=np.float32)
        for j in range(1, len(prompt)):
            entry = positions[j]
            if not isinstance(entry, dict) or str(prompt[j]) not in entry:
                raise TeacherResponseError(f"prompt {number}, position {j}: the vLLM response is for other tokens "
                                           f"(token {prompt[j]} is not among its keys)")
            if not k <= len(entry) <= k + 1:
                raise TeacherResponseError(f"prompt {number}, position {j}: {len(entry)} log-probabilities for "
                                           f"k = {k} (another k: check vllm serve --max-logprobs >= {k})")
            ranked = sorted(((v.get("rank") or math.inf, -float(v["logprob"]), int(t)) for t, v in entry.items()))
            top = ranked[:k]
            ids[j - 1] = [t for _, _, t in top]
            values[j - 1] = [-lp for _, lp, _ in top]
        values[values <= VLLM_NEG_INF] = -np.inf
        out.append(PromptTargets(ids, values))
    return out


def parse_sglang(document: Any, prompts: Sequence[Sequence[int]], k: int) -> list[PromptTargets]:
    """SGLang's ``/generate`` batch response (a list, one item per prompt, module docstring) to targets; the
    ``input_token_logprobs`` ids must be the prompt's tokens."""
    items = document if isinstance(document, list) else [document]
    _check_count(items, prompts, "items")
    out = []
    for number, (item, prompt) in enumerate(zip(items, prompts, strict=True)):
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict) or "input_top_logprobs" not in meta:
            raise TeacherResponseError(f"prompt {number}: the SGLang response has no meta_info.input_top_logprobs "
                                       "(were return_logprob and top_logprobs_num sent?)")
        tokens = meta.get("input_token_logprobs")
        if tokens is not None and [int(t[1]) for t in tokens] != list(prompt):
            raise TeacherResponseError(f"prompt {number}: the SGLang response is for other tokens "
                                       "(input_token_logprobs ids differ from the ones sent)")
        positions = meta["input_top_logprobs"]
        if not isinstance(positions, list) or len(positions) != len(prompt):
            raise TeacherResponseError(f"prompt {number}: input_top_logprobs has "
                                       f"{len(positions) if isinstance(positions, list) else positions!r} entries "
                                       f"for {len(prompt)} tokens (was logprob_start_len: 0 sent?)")
        rows = positions[1:]
        if any(not isinstance(row, list) or len(row) != k for row in rows):
            bad = next(len(r) if isinstance(r, list) else r for r in rows if not isinstance(r, list) or len(r) != k)
            raise TeacherResponseError(f"prompt {number}: a position has {bad} log-probabilities for k = {k}")
        # orjson writes -inf as null
        array = np.asarray([[(-np.inf if lp is None else lp, tid) for lp, tid, *_ in row] for row in rows],
                           dtype=np.float64).reshape(-1, k, 2)
        values = array[..., 0].astype(np.float32)
        values[values <= VLLM_NEG_INF] = -np.inf
        out.append(PromptTargets(array[..., 1].astype(np.int32), values))
    return out


# ------------------------------------------------------------------------------------------------ binary form


def encode_topk(prompts: Sequence[Sequence[int]], k: int, ids: np.ndarray, log_probs: np.ndarray,
                log_tail: np.ndarray | None) -> bytes:
    """The ``/v1/topk`` body: ``MAGIC``, uint32 header length, JSON header, then ``ids`` (N, k) int32, ``log_probs``
    (N, k) float32 and ``log_tail`` (N,) float32, little-endian, N = sum of (L - 1) over the prompts in order."""
    header = json.dumps({"k": k, "lengths": [len(p) for p in prompts], "tokens_sha256": tokens_digest(prompts),
                         "tail": log_tail is not None}).encode()
    parts = [MAGIC, struct.pack("<I", len(header)), header, np.ascontiguousarray(ids, dtype="<i4").tobytes(),
             np.ascontiguousarray(log_probs, dtype="<f4").tobytes()]
    if log_tail is not None:
        parts.append(np.ascontiguousarray(log_tail, dtype="<f4").tobytes())
    return b"".join(parts)


def decode_topk(body: bytes, prompts: Sequence[Sequence[int]], k: int) -> list[PromptTargets]:
    """:func:`encode_topk`'s body back to targets, refused unless it is whole and for these prompts and this k."""
    if body[:4] != MAGIC or len(body) < 8:
        head = body[:80].decode("utf-8", "replace")
        raise TeacherResponseError(f"the teacher server's /v1/topk answer is not a distill_kit top-k body (it "
                                   f"starts {head!r}): another service, or a server of another version")
    (size,) = struct.unpack("<I", body[4:8])
    header = _json(body[8:8 + size])
    if not isinstance(header, dict) or header.get("k") != k:
        raise TeacherResponseError(f"the teacher server answered with k = {header.get('k')!r}; this run asked for "
                                   f"k = {k}")
    if header.get("lengths") != [len(p) for p in prompts] or header.get("tokens_sha256") != tokens_digest(prompts):
        raise TeacherResponseError("the teacher server's answer is for other tokens (its tokens_sha256 or lengths "
                                   "differ from the prompts sent)")
    n = sum(max(len(p) - 1, 0) for p in prompts)
    tail = bool(header.get("tail"))
    expected = 8 + size + n * k * 8 + (n * 4 if tail else 0)
    if len(body) != expected:
        raise TeacherResponseError(f"the teacher server's answer is truncated or padded: {len(body)} bytes, "
                                   f"{expected} expected for {n} positions at k = {k}")
    offset = 8 + size
    ids = np.frombuffer(body, dtype="<i4", count=n * k, offset=offset).reshape(n, k)
    values = np.frombuffer(body, dtype="<f4", count=n * k, offset=offset + n * k * 4).reshape(n, k)
    tails = np.frombuffer(body, dtype="<f4", count=n, offset=offset + n * k * 8) if tail else None
    out, start = [], 0
    for prompt in prompts:
        stop = start + max(len(prompt) - 1, 0)
        out.append(PromptTargets(ids[start:stop], values[start:stop], None if tails is None else tails[start:stop]))
        start = stop
    return out

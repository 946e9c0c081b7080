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

Every parser refuses (:class:`TeacherResponseError`, naming the field) a body that is empty, cut off, not JSON, of
other JSON types than the schema's, for other tokens, of another k or count; :func:`check_targets` then refuses
values that cannot be trained on (ids outside the vocabulary, log-probabilities NaN or above 0, masses past 1).
Nothing received is executed or unpickled (JSON and ``numpy.frombuffer`` of plain numbers only).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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


LOG_PROB_SLACK = 1e-3
"""How far above 0 a log-probability, or the log of a position's summed mass, may read and still count as <= 0.
A server's float32 log_softmax is ``x - logsumexp(x)``, each term rounded to eps32 = 2^-23 (~1.2e-7) of its size:
at logits up to ~1e3 that is ~1.2e-4 absolute, and 1e-3 is ~8x that. A value past it is no probability (a broken
or hostile server's +0.5), and the mass it lets through beyond 1 (e^0.001 - 1, 0.1%) is too little to matter."""

FIELDS = {
    "distill_kit": {"ids": "ids[{n}]", "log_probs": "log_probs[{n}]", "log_tail": "log_tail[{n}]"},
    "vllm": {"ids": "choices[{p}].prompt_logprobs[{e}] (its keys)",
             "log_probs": "choices[{p}].prompt_logprobs[{e}][...].logprob", "log_tail": "log_tail"},
    "sglang": {"ids": "[{p}].meta_info.input_top_logprobs[{e}][{r}][1]",
               "log_probs": "[{p}].meta_info.input_top_logprobs[{e}][{r}][0]", "log_tail": "log_tail"},
}
"""Where each checked value sits in ``api``'s answer, for the error: ``p`` the prompt, ``e`` the entry (our row
``j`` is entry ``j + 1`` in vLLM's and SGLang's lists, whose first is null), ``r`` the rank - 1, ``n`` the row of
the binary arrays."""


def parse(api: str, body: bytes, prompts: Sequence[Sequence[int]], k: int,
          vocab_size: int | None = None) -> list[PromptTargets]:
    """``api``'s response ``body`` to ``prompts`` as one :class:`PromptTargets` per prompt, every value checked
    (:func:`check_targets`), or a :class:`TeacherResponseError` naming the field. ``vocab_size``: the teacher's,
    the bound of its ids (None: only ``>= 0`` is checked)."""
    if not body:
        raise TeacherResponseError("the answer is an empty body")
    if api == "distill_kit":
        targets = decode_topk(body, prompts, k)
    else:
        document = _json(body)
        targets = parse_vllm(document, prompts, k) if api == "vllm" else parse_sglang(document, prompts, k)
    check_targets(targets, prompts, k, vocab_size, api)
    return targets


def check_targets(targets: Sequence[PromptTargets], prompts: Sequence[Sequence[int]], k: int,
                  vocab_size: int | None, api: str = "distill_kit") -> None:
    """Refuse targets that cannot be trained on, naming the prompt, the position and the field: another count or
    shape than asked for; ids outside ``[0, vocab_size)`` or repeated within a position; log-probabilities that are
    NaN or above 0 (past :data:`LOG_PROB_SLACK`), a position whose every value is -inf (no mass at all), k values
    whose probabilities sum past 1; a tail that is NaN or above 0, or that with the k does not make 1. ``-inf`` is a
    log-probability (a token the teacher rules out); ``+inf`` is none."""
    fields = FIELDS[api]
    if len(targets) != len(prompts):
        raise TeacherResponseError(f"{len(targets)} prompts answered for {len(prompts)} sent")
    start = 0
    for number, (target, prompt) in enumerate(zip(targets, prompts, strict=True)):
        rows = max(len(prompt) - 1, 0)

        def where(field: str, row: int, column: int | None = None, number: int = number, start: int = start) -> str:
            name = fields[field].format(p=number, e=row + 1, n=start + row, r="..." if column is None else column)
            return f"prompt {number}, position {row}: {name}" + ("" if column is None else f" (rank {column + 1})")

        ids, values, tail = target.ids, target.log_probs, target.log_tail
        for name, array, shape in (("ids", ids, (rows, k)), ("log_probs", values, (rows, k)),
                                   ("log_tail", tail, (rows,))):
            if array is not None and tuple(array.shape) != shape:
                raise TeacherResponseError(f"prompt {number}: {name} has shape {tuple(array.shape)}, {shape} asked "
                                           f"for ({len(prompt)} tokens at k = {k})")
        if not rows:
            continue
        if not np.issubdtype(ids.dtype, np.integer):
            raise TeacherResponseError(f"prompt {number}: ids are {ids.dtype}, not integers")
        high = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
        bad = (ids < 0) | (ids >= high)
        if bad.any():
            row, column = map(int, np.argwhere(bad)[0])
            bound = f"[0, {vocab_size}) (the teacher's vocabulary)" if vocab_size is not None else ">= 0"
            raise TeacherResponseError(f"{where('ids', row, column)} = {int(ids[row, column])}: not a token id; "
                                       f"ids are in {bound}")
        ordered = np.sort(ids, axis=-1)
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(-1)
        if repeated.any():
            row = int(np.flatnonzero(repeated)[0])
            raise TeacherResponseError(f"{where('ids', row)}: an id given twice in one position "
                                       f"({sorted(ids[row].tolist())})")
        wide = values.astype(np.float64)
        for bad, what in ((np.isnan(wide), "NaN, not a log-probability"),
                          (wide > LOG_PROB_SLACK, "above 0: a log-probability is <= 0")):
            if bad.any():
                row, column = map(int, np.argwhere(bad)[0])
                raise TeacherResponseError(f"{where('log_probs', row, column)} = {float(values[row, column])!r}: "
                                           f"{what}")
        empty = ~np.isfinite(wide).any(-1)
        if empty.any():
            row = int(np.flatnonzero(empty)[0])
            raise TeacherResponseError(f"{where('log_probs', row)}: every one of the k values is -inf (no "
                                       "probability at all); a finite top value is needed")
        with np.errstate(divide="ignore"):  # every value <= slack here: exp cannot overflow (9x faster than a
            mass = np.log(np.exp(wide).sum(-1))  # logaddexp.reduce, the same to float64's rounding)
        over = mass > LOG_PROB_SLACK
        if over.any():
            row = int(np.flatnonzero(over)[0])
            raise TeacherResponseError(f"{where('log_probs', row)}: the k probabilities sum to "
                                       f"{float(np.exp(mass[row])):.6g}, more than 1")
        if tail is not None:
            wide_tail = tail.astype(np.float64)
            with np.errstate(invalid="ignore"):  # a NaN tail: refused just below
                whole = np.logaddexp(mass, wide_tail)
            bad = np.isnan(wide_tail) | (wide_tail > LOG_PROB_SLACK) | (np.abs(whole) > LOG_PROB_SLACK)
            if bad.any():
                row = int(np.flatnonzero(bad)[0])
                raise TeacherResponseError(f"{where('log_tail', row)} = {float(tail[row])!r}: the tail's log mass "
                                           f"with the k's makes {float(np.exp(whole[row])):.6g}, not 1")
        start += rows


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        head = body[:80].decode("utf-8", "replace")
        raise TeacherResponseError(f"the answer is not JSON ({err}; it starts {head!r}): a cut-off body, an error "
                                   "page, or another service on that port") from None


def _number(value: Any, where: str) -> float:
    """A JSON number (-inf as vLLM's -9999, SGLang's null or -Infinity), or a refusal naming ``where``."""
    if value is None:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TeacherResponseError(f"{where} is {_shown(value)} where a number belongs")
    return float(value)


def _token(value: Any, where: str) -> int:
    """A JSON integer token id (vLLM's keys are its decimal strings), or a refusal naming ``where``."""
    if isinstance(value, str) and value.isdecimal() and len(value) < 24:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TeacherResponseError(f"{where} is {_shown(value)} where a token id belongs")
    if not -(1 << 31) <= value < 1 << 31:
        raise TeacherResponseError(f"{where} = {value}: not a token id (past int32)")
    return value


def _list(value: Any, where: str, length: int | None = None, sent: str = "") -> list:
    if not isinstance(value, list):
        raise TeacherResponseError(f"{where} is {_shown(value)} where a list belongs")
    if length is not None and len(value) != length:
        raise TeacherResponseError(f"{where} has {len(value)} entries, {length} asked for{sent}")
    return value


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise TeacherResponseError(f"{where} is {_shown(value)} where an object belongs")
    return value


def _shown(value: Any) -> str:
    """A received value as an error names it: its JSON type, and its text where short."""
    if isinstance(value, list | dict):
        kind = "a list" if isinstance(value, list) else "an object"
        return f"{kind} ({json.dumps(value, default=str)[:40]})"
    if isinstance(value, str):
        return f"a string {json.dumps(value[:40])}"
    return json.dumps(value)


def parse_vllm(document: Any, prompts: Sequence[Sequence[int]], k: int) -> list[PromptTargets]:
    """A vLLM ``CompletionResponse`` (module docstring) to targets; the prompt token at each position must be one of
    its keys (vLLM always includes it), so a response for other tokens is refused."""
    if not isinstance(document, dict) or "choices" not in document:
        raise TeacherResponseError(f"the vLLM answer has no choices: {str(document)[:200]}")
    choices = _list(document["choices"], "choices", len(prompts), " (one per prompt)")
    for number, choice in enumerate(choices):
        _dict(choice, f"choices[{number}]")
    if all(isinstance(c.get("index"), int) for c in choices):
        choices = sorted(choices, key=lambda c: c["index"])
    out = []
    for number, (choice, prompt) in enumerate(zip(choices, prompts, strict=True)):
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and echoed != list(prompt):
            raise TeacherResponseError(f"choices[{number}].prompt_token_ids: the answer is for other tokens than "
                                       "the ones sent")
        field = f"choices[{number}].prompt_logprobs"
        positions = _list(choice.get("prompt_logprobs"), field, len(prompt),
                          f" (one per prompt token; was prompt_logprobs: {k} sent?)")
        ids = np.zeros((len(prompt) - 1, k), dtype=np.int32)
        values = np.zeros((len(prompt) - 1, k), dtype=np.float32)
        for j in range(1, len(prompt)):
            entry = _dict(positions[j], f"{field}[{j}]")
            if str(prompt[j]) not in entry:
                raise TeacherResponseError(f"{field}[{j}]: the answer is for other tokens (token {prompt[j]} is not "
                                           "among its keys)")
            if not k <= len(entry) <= k + 1:
                raise TeacherResponseError(f"{field}[{j}]: {len(entry)} log-probabilities for k = {k} (another k: "
                                           f"check vllm serve --max-logprobs >= {k})")
            ranked = []
            for key, value in entry.items():  # the common case inline (a Python object per entry is the cost)
                logprob = value.get("logprob") if type(value) is dict else None
                rank = value.get("rank") if type(value) is dict else None
                if type(logprob) not in _NUMBERS or type(rank) not in _RANKS or not key.isdecimal() or len(key) > 9:
                    logprob, rank = _vllm_entry(key, value, f"{field}[{j}]")
                ranked.append((math.inf if rank is None else rank, -logprob, int(key)))
            top = sorted(ranked)[:k]
            ids[j - 1] = [t for _, _, t in top]
            values[j - 1] = [-lp for _, lp, _ in top]
        values[values <= VLLM_NEG_INF] = -np.inf
        out.append(PromptTargets(ids, values))
    return out


_NUMBERS = (float, int)
_RANKS = (int, type(None))
_LOGPROBS = (float, int, type(None))  # SGLang's null: -inf


def _vllm_entry(key: str, value: Any, field: str) -> tuple[float, int | None]:
    """One ``prompt_logprobs`` entry the fast path did not take: its log-probability and rank, or the refusal that
    names what is wrong with it."""
    at = f"{field}[{key!r}]"
    value = _dict(value, at)
    if "logprob" not in value:
        raise TeacherResponseError(f"{at}.logprob: missing")
    rank = value.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise TeacherResponseError(f"{at}.rank is {_shown(rank)} where an integer (or null) belongs")
    _token(key, f"{field} key")
    return _number(value["logprob"], f"{at}.logprob"), rank


def parse_sglang(document: Any, prompts: Sequence[Sequence[int]], k: int) -> list[PromptTargets]:
    """SGLang's ``/generate`` batch response (a list, one item per prompt, module docstring) to targets; the
    ``input_token_logprobs`` ids must be the prompt's tokens."""
    items = document if isinstance(document, list) else [document]
    _list(items, "the answer", len(prompts), " (one item per prompt)")
    out = []
    for number, (item, prompt) in enumerate(zip(items, prompts, strict=True)):
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict) or "input_top_logprobs" not in meta:
            raise TeacherResponseError(f"[{number}].meta_info.input_top_logprobs: missing (were return_logprob and "
                                       "top_logprobs_num sent?)")
        field = f"[{number}].meta_info"
        tokens = meta.get("input_token_logprobs")
        if tokens is not None:
            tokens = _list(tokens, f"{field}.input_token_logprobs", len(prompt), " (one per prompt token)")
            echoed = []
            for i, entry in enumerate(tokens):
                entry = _list(entry, f"{field}.input_token_logprobs[{i}]")
                echoed.append(_token(entry[1] if len(entry) > 1 else None, f"{field}.input_token_logprobs[{i}][1]"))
            if echoed != list(prompt):
                raise TeacherResponseError(f"{field}.input_token_logprobs: the answer is for other tokens (its ids "
                                           "differ from the ones sent)")
        positions = _list(meta["input_top_logprobs"], f"{field}.input_top_logprobs", len(prompt),
                          " (one per prompt token; was logprob_start_len: 0 sent?)")
        ids = np.zeros((len(prompt) - 1, k), dtype=np.int32)
        values = np.zeros((len(prompt) - 1, k), dtype=np.float32)
        for j in range(1, len(prompt)):
            at = f"{field}.input_top_logprobs[{j}]"
            row = _list(positions[j], at)
            if len(row) != k:
                raise TeacherResponseError(f"{at}: {len(row)} log-probabilities for k = {k} (another k)")
            for r, pair in enumerate(row):
                if not (type(pair) is list and len(pair) > 1 and type(pair[0]) in _LOGPROBS and type(pair[1]) is int
                        and -(1 << 31) <= pair[1] < 1 << 31):  # the common case inline; else name the problem
                    pair = _list(pair, f"{at}[{r}]")
                    if len(pair) < 2:
                        raise TeacherResponseError(f"{at}[{r}] has {len(pair)} entries, [logprob, token_id, ...] "
                                                   "needed")
                    pair = (_number(pair[0], f"{at}[{r}][0]"), _token(pair[1], f"{at}[{r}][1]"))
                values[j - 1, r] = -math.inf if pair[0] is None else pair[0]
                ids[j - 1, r] = pair[1]
        values[values <= VLLM_NEG_INF] = -np.inf
        out.append(PromptTargets(ids, values))
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
        raise TeacherResponseError(f"the /v1/topk answer is not a distill_kit top-k body (it starts {head!r}): an "
                                   "error page, another service, or a server of another version")
    (size,) = struct.unpack("<I", body[4:8])
    if 8 + size > len(body):
        raise TeacherResponseError(f"the /v1/topk answer is cut off: its header says {size} bytes, {len(body) - 8} "
                                   "follow")
    header = _json(body[8:8 + size])
    if not isinstance(header, dict):
        raise TeacherResponseError(f"the /v1/topk header is {_shown(header)} where an object belongs")
    if header.get("k") != k or isinstance(header.get("k"), bool):
        raise TeacherResponseError(f"the /v1/topk header's k is {_shown(header.get('k'))}; this run asked for "
                                   f"k = {k}")
    if header.get("lengths") != [len(p) for p in prompts] or header.get("tokens_sha256") != tokens_digest(prompts):
        raise TeacherResponseError("the /v1/topk header's tokens_sha256 or lengths differ from the prompts sent: "
                                   "the answer is for other tokens")
    tail = header.get("tail", False)
    if not isinstance(tail, bool):
        raise TeacherResponseError(f"the /v1/topk header's tail is {_shown(tail)} where true or false belongs")
    n = sum(max(len(p) - 1, 0) for p in prompts)
    expected = 8 + size + n * k * 8 + (n * 4 if tail else 0)
    if len(body) != expected:
        raise TeacherResponseError(f"the /v1/topk answer is cut off or padded: {len(body)} bytes, {expected} "
                                   f"expected for {n} positions at k = {k}")
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


# ------------------------------------------------------------------------------------ hidden states and the head

HIDDEN_MAGIC = b"DKH1"
"""The first bytes of a ``/v1/hidden`` response: then a uint32 header length, the JSON header, (N, H) values."""
HEAD_MAGIC = b"DKW1"
"""The first bytes of a ``/v1/head`` response: then a uint32 header length, the JSON header, (V, H) weight, bias."""
HIDDEN_MEDIA_TYPE = "application/vnd.distill-kit.hidden"
DTYPES = {"float32": ("<f4", 4), "bfloat16": ("<u2", 2), "float16": ("<f2", 2)}
"""The dtypes a hidden state or head may travel in: name -> (the little-endian array type of its raw bytes, bytes an
element). bfloat16 has no numpy type: its bytes travel as uint16 and are viewed as ``torch.bfloat16`` again."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (a key of :data:`DTYPES`), or a ValueError naming the ones that travel."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {name}: hidden states and heads travel as {', '.join(DTYPES)}")
    return name


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's raw little-endian bytes, in its own dtype (bfloat16's as its 16 bits)."""
    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().astype(tensor.numpy().dtype.newbyteorder("<"), copy=False).tobytes()


def from_bytes(body: bytes | memoryview, dtype: str, count: int, offset: int) -> torch.Tensor:
    """``count`` elements of ``dtype`` (a :data:`DTYPES` name) at ``offset`` of ``body``, as a fresh torch tensor."""
    kind, _ = DTYPES[dtype]
    array = np.frombuffer(body, dtype=kind, count=count, offset=offset).astype(kind[1:], copy=True)
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def head_digest(weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """sha256 of a head as it computes: its shape, its dtype's name, the weight's raw bytes, then the bias's (if
    any). The server's and a local copy's agree only when every bit of the head the loss applies does."""
    digest = hashlib.sha256(json.dumps({"shape": list(weight.shape), "dtype": dtype_name(weight.dtype),
                                        "bias": bias is not None}).encode())
    for rows in weight.detach().split(8192):  # a chunk at a time: a bf16 7B head is 1 GB
        digest.update(tensor_bytes(rows))
    if bias is not None:
        digest.update(tensor_bytes(bias))
    return digest.hexdigest()


def _framed(magic: bytes, header: dict[str, Any], *parts: bytes | memoryview, align: int = 1) -> bytes:
    """``magic``, the header's length, the JSON header (padded with spaces so the arrays start at a multiple of
    ``align`` bytes: a reader may then view them in place), then ``parts``."""
    encoded = json.dumps(header).encode()
    encoded += b" " * (-(8 + len(encoded)) % align)
    return b"".join([magic, struct.pack("<I", len(encoded)), encoded, *parts])


def _unframe(body: bytes | memoryview, magic: bytes, what: str,
             length: int | None = None) -> tuple[dict[str, Any], int]:
    """A framed body's JSON header and where its arrays start, or the refusal naming ``what`` was expected.
    ``length``: the whole body's bytes where ``body`` is only its start (a buffer read into)."""
    length = len(body) if length is None else length
    if bytes(body[:4]) != magic or length < 8:
        head = bytes(body[:80]).decode("utf-8", "replace")
        raise TeacherResponseError(f"the {what} answer is not a distill_kit body (it starts {head!r}): an error page, "
                                   "another service, or a server of another version")
    (size,) = struct.unpack("<I", bytes(body[4:8]))
    if 8 + size > length or size > 1 << 20:
        raise TeacherResponseError(f"the {what} answer is cut off: its header says {size} bytes, {length - 8} "
                                   "follow")
    header = _json(bytes(body[8:8 + size]))
    if not isinstance(header, dict):
        raise TeacherResponseError(f"the {what} header is {_shown(header)} where an object belongs")
    return header, 8 + size


TIMING_HEADER = "x-distill-kit-timing"
"""A ``/v1/hidden`` answer's header: the server's seconds per phase, ``lock=0.000012,forward=0.171,...``
(:func:`timing_value`), which the client records for the benchmarks; read as a number or ignored, never trusted."""


def timing_value(times: dict[str, float]) -> str:
    return ",".join(f"{name}={seconds:.6f}" for name, seconds in times.items())


def parse_timing(value: str | None) -> dict[str, float]:
    """:func:`timing_value`'s header back to ``{phase: seconds}``; what is not ``name=number`` is left out."""
    out = {}
    for item in (value or "").split(",")[:16]:
        name, _, number = item.partition("=")
        try:
            seconds = float(number)
        except ValueError:
            continue
        if name.isidentifier() and math.isfinite(seconds):
            out[name] = seconds
    return out


HIDDEN_ALIGN = 64
"""A ``/v1/hidden`` body's values start at a multiple of this many bytes (its header padded with spaces)."""


def encode_hidden(prompts: Sequence[Sequence[int]], hidden: torch.Tensor) -> bytes:
    """The ``/v1/hidden`` body: ``HIDDEN_MAGIC``, uint32 header length, JSON header (``lengths``, ``tokens_sha256``,
    ``hidden_size``, ``dtype``; padded to :data:`HIDDEN_ALIGN`), then ``hidden`` (N, H) raw in its dtype, N = sum of
    (L - 1) over the prompts: row ``j`` of a prompt is the final hidden state (after the final norm) at its token
    ``j``, whose head output predicts token ``j + 1``. A contiguous CPU tensor on a little-endian host is sent from
    its own memory (one copy, into the body), else through :func:`tensor_bytes`."""
    header = {"lengths": [len(p) for p in prompts], "tokens_sha256": tokens_digest(prompts),
              "hidden_size": int(hidden.shape[-1]), "dtype": dtype_name(hidden.dtype)}
    in_place = hidden.device.type == "cpu" and hidden.is_contiguous() and sys.byteorder == "little"
    values = memoryview(hidden.detach().reshape(-1).view(torch.uint8).numpy()) if in_place else tensor_bytes(hidden)
    return _framed(HIDDEN_MAGIC, header, values, align=HIDDEN_ALIGN)


def hidden_layout(body: bytes | memoryview, length: int, prompts: Sequence[Sequence[int]], hidden_size: int,
                  dtype: str) -> tuple[int, int]:
    """Where a ``/v1/hidden`` body of ``length`` bytes (``body``: at least its start) keeps its values, and how many
    rows: ``(start, N)``; refused unless it is whole, for these prompts, of this width and dtype."""
    if not length:
        raise TeacherResponseError("the answer is an empty body")
    header, start = _unframe(body, HIDDEN_MAGIC, "/v1/hidden", length)
    if header.get("lengths") != [len(p) for p in prompts] or header.get("tokens_sha256") != tokens_digest(prompts):
        raise TeacherResponseError("the /v1/hidden header's tokens_sha256 or lengths differ from the prompts sent: "
                                   "the answer is for other tokens")
    if header.get("hidden_size") != hidden_size or isinstance(header.get("hidden_size"), bool):
        raise TeacherResponseError(f"the /v1/hidden header's hidden_size is {_shown(header.get('hidden_size'))}; the "
                                   f"teacher's head reads {hidden_size}")
    if header.get("dtype") != dtype:
        raise TeacherResponseError(f"the /v1/hidden header's dtype is {_shown(header.get('dtype'))}; the server "
                                   f"said it serves {dtype} (its /info), the head's dtype")
    n = sum(max(len(p) - 1, 0) for p in prompts)
    expected = start + n * hidden_size * DTYPES[dtype][1]
    if length != expected:
        raise TeacherResponseError(f"the /v1/hidden answer is cut off or padded: {length} bytes, {expected} "
                                   f"expected for {n} positions of {hidden_size} {dtype} values")
    return start, n


def decode_hidden(body: bytes, prompts: Sequence[Sequence[int]], hidden_size: int, dtype: str,
                  head_abs_max: tuple[float, float] | None = None) -> torch.Tensor:
    """:func:`encode_hidden`'s body back to an (N, H) tensor, refused unless it is whole, for these prompts, of this
    width and dtype (:func:`hidden_layout`), every value finite and, given the head's ``(max |W|, max |b|)``, of a
    scale whose logits cannot overflow (:func:`check_hidden`)."""
    start, n = hidden_layout(body, len(body), prompts, hidden_size, dtype)
    hidden = from_bytes(body, dtype, n * hidden_size, start).reshape(n, hidden_size)
    check_hidden(hidden, head_abs_max)
    return hidden


_BITS = {torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000), torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
         torch.float16: (torch.int16, 0x7FFF, 0x7C00)}
"""Per dtype: the integer type of its bits, the mask that clears the sign, and the magnitude bits from which on a
value is an infinity or a NaN (every exponent bit set)."""


def hidden_peaks(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest |h| (float32, (N,)) and whether the row holds a NaN or an infinity ((N,) bool), from the
    values' bits: with the sign cleared, an IEEE float's bits order as its magnitude does, and every non-finite
    value's sit at or above the infinity's. Integer ops: exact, as fast on a CPU as on a GPU for bfloat16 (where
    ``abs().amax()`` on a CPU is ~10x slower), no float copy made, and on whatever device ``hidden`` is."""
    kind, mask, infinite = _BITS[hidden.dtype]
    bits = (hidden.view(kind) & mask).amax(-1)
    return bits.view(hidden.dtype).float(), bits >= infinite


def hidden_problems(hidden: torch.Tensor, head_abs_max: tuple[float, float] | None = None) -> torch.Tensor:
    """(N,) bool: the rows :func:`check_hidden` refuses, computed where ``hidden`` is without waiting on it."""
    peak, bad = hidden_peaks(hidden)
    if head_abs_max is not None:
        bad = bad | scale_over(peak, hidden.shape[-1], *head_abs_max, hidden.dtype)
    return bad


def check_hidden(hidden: torch.Tensor, head_abs_max: tuple[float, float] | None = None,
                 problems: torch.Tensor | None = None) -> None:
    """Refuse (N, H) hidden states holding a NaN or an infinity, or (given the head's ``(max |W|, max |b|)``) of a
    scale whose logits could overflow their dtype, naming the first such row. ``problems``: :func:`hidden_problems`'
    answer where it is known to hold one (the client checks on the device first, then asks here which)."""
    if problems is None:
        problems = hidden_problems(hidden, head_abs_max)
    if not hidden.shape[0] or not bool(problems.any()):
        return
    peak, infinite = hidden_peaks(hidden)
    if bool(infinite.any()):
        row = int(infinite.nonzero()[0, 0])
        raise TeacherResponseError(f"hidden[{row}] holds a NaN or an infinity: not a hidden state")
    over = scale_over(peak, hidden.shape[-1], *head_abs_max, hidden.dtype)
    row = int(over.nonzero()[0, 0])
    raise TeacherResponseError(f"hidden[{row}] has max |h| = {float(peak[row]):.3g}: the head's logits from it "
                               f"could overflow {dtype_name(hidden.dtype)}; not a hidden state of this teacher")


def scale_over(peak: torch.Tensor, hidden_size: int, weight_abs_max: float, bias_abs_max: float,
               dtype: torch.dtype) -> torch.Tensor:
    """(N,) bool: rows whose head outputs could overflow ``dtype``. ``peak`` (N,): each row's largest |h|. A logit
    is at most ``||h||_1 max|W| + max|b| <= H max|h| max|W| + max|b|``, so rows under ``finfo(dtype).max / 2`` of
    that give finite logits and finite differences of two. A real teacher's bound is ~10^4-10^6; a hostile
    server's 10^30 is refused here, where it would otherwise turn the loss into inf or NaN."""
    return peak * (hidden_size * weight_abs_max) + bias_abs_max > torch.finfo(dtype).max / 2


def encode_head(weight: torch.Tensor, bias: torch.Tensor | None) -> bytes:
    """The ``/v1/head`` body: ``HEAD_MAGIC``, uint32 header length, JSON header (``shape``, ``dtype``, ``bias``,
    ``sha256``: :func:`head_digest`), then the (V, H) weight and the (V,) bias raw in their dtype."""
    header = {"shape": list(weight.shape), "dtype": dtype_name(weight.dtype), "bias": bias is not None,
              "sha256": head_digest(weight, bias)}
    parts = [tensor_bytes(rows) for rows in weight.detach().split(8192)]
    return _framed(HEAD_MAGIC, header, *parts, *([tensor_bytes(bias)] if bias is not None else []))


def head_size(vocab: int, hidden: int, dtype: str, bias: bool) -> int:
    """The bytes of a ``/v1/head`` answer's arrays (its header is at most 64 KiB more)."""
    return (vocab * hidden + (vocab if bias else 0)) * DTYPES[dtype][1]


def decode_head(body: bytes | np.ndarray, shape: tuple[int, int], dtype: str,
                sha256: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`encode_head`'s body back to ``(weight, bias)``, refused unless it is whole, of ``shape`` and ``dtype``,
    and its bytes hash to ``sha256`` (what the server's ``/info`` said), every value finite."""
    header, start = _unframe(body, HEAD_MAGIC, "/v1/head")
    if header.get("shape") != list(shape) or header.get("dtype") != dtype:
        said = json.dumps({"shape": header.get("shape"), "dtype": header.get("dtype")}, default=str)[:120]
        raise TeacherResponseError(f"the /v1/head header says {said}; the server's /info said shape "
                                   f"{list(shape)}, dtype {dtype}")
    bias = header.get("bias")
    if not isinstance(bias, bool):
        raise TeacherResponseError(f"the /v1/head header's bias is {_shown(bias)} where true or false belongs")
    expected = start + head_size(*shape, dtype, bias)
    if len(body) != expected:
        raise TeacherResponseError(f"the /v1/head answer is cut off or padded: {len(body)} bytes, {expected} expected")
    count = shape[0] * shape[1]
    weight = from_bytes(body, dtype, count, start).reshape(shape)
    vector = from_bytes(body, dtype, shape[0], start + count * DTYPES[dtype][1]) if bias else None
    if head_digest(weight, vector) != sha256:
        raise TeacherResponseError("the /v1/head answer's bytes do not hash to the head_sha256 the server's /info "
                                   "reported: a corrupted transfer or another model")
    if not bool(torch.isfinite(weight).all()) or (vector is not None and not bool(torch.isfinite(vector).all())):
        raise TeacherResponseError("the /v1/head answer holds a NaN or an infinity: not a head to train against")
    return weight, vector


# ------------------------------------------------------------------------------------------------ sampled tokens

SAMPLE_MAGIC = b"DKS1"
"""The first bytes of a ``/v1/sample`` response: then a uint32 header length, the JSON header, the arrays."""


def encode_sample(prompts: Sequence[Sequence[int]], k: int, temperature: float, ids: np.ndarray,
                  log_probs: np.ndarray, counts: np.ndarray) -> bytes:
    """The ``/v1/sample`` body: ``SAMPLE_MAGIC``, uint32 header length, JSON header (``k``, ``temperature``,
    ``lengths``, ``tokens_sha256``), then ``ids`` (N, k) int32, ``log_probs`` (N, k) float32 (log p at the
    temperature) and ``counts`` (N, k) uint8: per position the distinct tokens of k draws and how often each came
    (``offline/capture.py:sample``)."""
    header = {"k": k, "temperature": temperature, "lengths": [len(p) for p in prompts],
              "tokens_sha256": tokens_digest(prompts)}
    return _framed(SAMPLE_MAGIC, header, np.ascontiguousarray(ids, dtype="<i4").tobytes(),
                   np.ascontiguousarray(log_probs, dtype="<f4").tobytes(),
                   np.ascontiguousarray(counts, dtype="u1").tobytes())


def decode_sample(body: bytes, prompts: Sequence[Sequence[int]], k: int, temperature: float,
                  vocab_size: int | None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`encode_sample`'s body back to per-prompt ``(ids, log_probs, counts)``, refused unless it is whole, for
    these prompts, this k and temperature, and every value one a draw can give: each position's counts sum to k, a
    used slot's id is in the vocabulary, not repeated, and its log-probability finite and <= 0."""
    if not body:
        raise TeacherResponseError("the answer is an empty body")
    header, start = _unframe(body, SAMPLE_MAGIC, "/v1/sample")
    if header.get("k") != k or isinstance(header.get("k"), bool) or header.get("temperature") != temperature:
        raise TeacherResponseError(f"the /v1/sample header's k and temperature are {_shown(header.get('k'))} and "
                                   f"{_shown(header.get('temperature'))}; this run asked for {k} at {temperature}")
    if header.get("lengths") != [len(p) for p in prompts] or header.get("tokens_sha256") != tokens_digest(prompts):
        raise TeacherResponseError("the /v1/sample header's tokens_sha256 or lengths differ from the prompts sent: "
                                   "the answer is for other tokens")
    n = sum(max(len(p) - 1, 0) for p in prompts)
    if len(body) != start + n * k * 9:
        raise TeacherResponseError(f"the /v1/sample answer is cut off or padded: {len(body)} bytes, "
                                   f"{start + n * k * 9} expected for {n} positions at k = {k}")
    ids = np.frombuffer(body, dtype="<i4", count=n * k, offset=start).reshape(n, k)
    values = np.frombuffer(body, dtype="<f4", count=n * k, offset=start + n * k * 4).reshape(n, k)
    counts = np.frombuffer(body, dtype="u1", count=n * k, offset=start + n * k * 8).reshape(n, k)
    used = counts > 0
    high = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
    wide = values.astype(np.float64)
    ordered = np.sort(np.where(used, ids.astype(np.int64), -1 - np.arange(k)), axis=-1)  # unused slots: distinct
    checks = ((np.repeat((counts.sum(-1, dtype=np.int64) != k)[:, None], k, axis=1), "counts that do not sum to k"),
              (used & ((ids < 0) | (ids >= high)), "an id outside the vocabulary"),
              (used & ~(np.isfinite(wide) & (wide <= LOG_PROB_SLACK)),
               "a log-probability that is not finite and <= 0 (a token drawn has some probability)"),
              (np.pad(ordered[:, 1:] == ordered[:, :-1], ((0, 0), (1, 0))), "an id given twice in one position"))
    for bad, what in checks:
        if bad.any():
            row, column = map(int, np.argwhere(bad)[0])
            raise TeacherResponseError(f"/v1/sample position {row}, slot {column}: {what}")
    out, begin = [], 0
    for prompt in prompts:
        stop = begin + max(len(prompt) - 1, 0)
        out.append((ids[begin:stop], values[begin:stop], counts[begin:stop]))
        begin = stop
    return out

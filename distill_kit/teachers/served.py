"""A served teacher: its top-k targets asked of an inference server over HTTP, the teacher out of the training run.

``TeacherSpec(model="http://host:port", options={...})`` (``kind: auto`` reads a URL as ``served``). For each
micro-batch it sends every row's real tokens (``input_ids`` where ``attention_mask`` is 1; packed rows, by
``position_ids``, one prompt per conversation) and gets back, per position, the teacher's top-k token ids and
log-probabilities, assembled as :class:`losses.sparse.SparseTeacherLogits` aligned with the rows: the captured
store's type, so the losses' sparse path (``losses/sparse.py``) runs unchanged. Position ``t`` holds the prediction
of token ``t + 1``, as a causal LM's ``logits[:, t]``; padding and each prompt's last position (its prediction
past the row, which no loss counts) hold zeros.

It speaks stock vLLM (``/v1/completions`` with ``prompt_logprobs``), SGLang (native ``/generate`` with input
logprobs) and the project's own server (``scripts/serve_teacher.py``: binary ``/v1/topk``, the exact tail);
``served_protocol.py`` has the schemas. Requests carry ``rows_per_request`` rows, up to ``max_in_flight`` at once,
and :meth:`ServedTeacher.prefetch` sends the next micro-batch's before the student's step on this one, so the
teacher's time hides behind the student's.

Options (``TeacherSpec.options``), with their defaults:

* ``k`` (20): ids per position. 20 is stock ``vllm serve``'s ``--max-logprobs``; a larger k needs that flag.
* ``api`` (``distill_kit``): ``vllm``, ``sglang`` or ``distill_kit``.
* ``tail`` (true): the tail bucket (k + 1 outcomes, exact at temperature 1): the server's tail where it gives one,
  else ``log(1 - sum of the top k)`` (``served_protocol.derived_tail``); false renormalises over the k.
* ``tokenizer`` (none): a local folder holding the tokenizer the server's model uses. Compared with the server's
  ``tokenizer_sha256`` where it reports one (the project's server), and handed to the run's tokenizer rule as this
  teacher's, so a teacher whose tokenizer differs from the students' is refused before any write.
* ``api_key_env`` (none): the environment variable holding the server's API key (``Authorization: Bearer``). A
  warning, once a process, when it would go over plain ``http://`` to another host than this one.
* ``timeout_s`` (120): one request's whole deadline (connecting, waiting, reading; 0: none): a server that trickles
  its answer is cut off there, not only one that stalls. ``wait_s`` (300): how long the start waits for the server
  to answer. ``retries_s`` (600): how long a run retries a server that stopped answering, then raises
  :class:`TeacherUnavailable` (the run checkpoints and exits; ``--resume`` when the server is back).
* ``max_response_bytes`` (256 MiB): the largest answer read; a larger one is refused as it arrives.
* ``rows_per_request`` (8), ``max_in_flight`` (4).
* ``payload`` (``top_k``): ``hidden`` asks the project's server for each position's final hidden state (after the
  final norm, in the teacher's dtype: H values a position, 2 H bytes in bf16) instead of top-k targets; the forward
  returns a :class:`~losses.fused.HeadOutput`, and the loss applies the teacher's head chunk by chunk exactly as it
  applies an in-process teacher's (``losses/chunked.py:head_chunk_loss``). So every whole-distribution use works:
  every divergence at any temperature, ``combine: mixture`` and ``route``, evaluation's KL. vLLM and SGLang serve
  top-k log-probabilities only (refused at the start). The head (V x H in the teacher's dtype, e.g. 1.09 GB in bf16
  for Qwen2-7B's 152,064 x 3,584) is held on the training device.
* ``head`` (none): the teacher's ``save_pretrained`` folder to read the head from (its head's tensors only); none:
  fetched from the server once (``GET /v1/head``). Either way its sha256 must equal the server's ``head_sha256``:
  another head is refused before anything is written.
* ``payload: sampled`` with ``temperature`` (1.0): ``k`` tokens drawn from the teacher at ``temperature`` per position
  (``/v1/sample``, 9 k bytes), read by forward KL at that temperature as an unbiased estimate (RS-KD), as a sampled
  store is (``offline/store.py``); the plan refuses other losses and temperatures.

Every answer is checked before anything trains on it (``served_protocol.parse``: JSON types, counts, shapes, ids
inside the vocabulary, log-probabilities finite-or--inf and <= 0, masses <= 1); one that fails raises
:class:`TeacherResponseError` naming the server and the field, and the run stops as on an unavailable server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import hashlib
import ipaddress
import json
import logging
import os
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill_kit.config import TeacherSpec
from distill_kit.engines.head import GatheredHead
from distill_kit.errors import ConfigError, TeacherFault
from distill_kit.teachers import served_protocol as protocol
from distill_kit.teachers.base import HEAD, SAMPLED, TOP_K, TOP_K_TAIL, Teacher, TeacherCard, TeacherSetup
from distill_kit.teachers.kinds import is_url
from distill_kit.teachers.served_protocol import PromptTargets, TeacherResponseError, TeacherTimeout, TeacherUnavailable
from distill_kit.teachers.served_wire import Answer, Wire
from distill_kit.teachers.tokenizers import vocabulary_sha256
from losses.fused import HeadOutput
from losses.sparse import SampledTeacherLogits, SparseTeacherLogits

LOG = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {"k": 20, "api": "distill_kit", "tail": True, "tokenizer": None, "api_key_env": None,
                            "timeout_s": 120.0, "wait_s": 300.0, "retries_s": 600.0, "rows_per_request": 8,
                            "max_in_flight": 4, "max_response_bytes": 256 << 20, "payload": "top_k", "head": None,
                            "temperature": 1.0}
PAYLOADS = ("top_k", "hidden", "sampled")
"""What a served teacher sends a position: its top-k log-probabilities (every server); its final hidden state, to
which the client applies the teacher's head at the loss (the whole distribution); or k tokens drawn from it at
``temperature`` (forward KL's unbiased estimate). The last two: the project's server only."""
# max_response_bytes: the defaults' 8 rows of 2,048 tokens at k = 20 are 2.7 MB from /v1/topk (8 bytes an id and
# value) and ~26 MB as vLLM's JSON (k + 1 entries of ~75 bytes a position); 256 MiB leaves ~10x that for longer rows
# or a larger k, and bounds the memory max_in_flight answers can take. Past it: lower rows_per_request.
TRANSPORT_OPTIONS = ("api_key_env", "timeout_s", "wait_s", "retries_s", "rows_per_request", "max_in_flight",
                     "max_response_bytes", "head")
"""The options that say how requests travel, not what comes back: a resumed run may change them (the others, and
the weights' sha256, are the teacher's identity)."""

__all__ = ["TRANSPORT_OPTIONS", "ServedCard", "ServedOutput", "ServedTeacher", "TeacherResponseError",
           "TeacherTimeout", "TeacherUnavailable", "is_url"]  # is_url: kinds.py's rule, named here too


@dataclass(frozen=True)
class Labels:
    """What the client's messages call the server's address and its options, so that each error names what the
    user wrote: a run config's keys (``teachers[NAME].model``, ``teachers[NAME].options.wait_s``) unless a script
    says otherwise with :func:`named_as` (capture: ``--teacher``, ``--teacher-options wait_s``)."""

    model: str
    options: str
    sep: str = "."
    stop: str = "the run stops after a checkpoint of the last whole step"
    """What a teacher fault mid-way does (a run: the loop's rewind and checkpoint; the capture script: its parts)."""
    resume: str = "resume with --resume"
    """How to continue once the server is fixed (a run: ``--resume``; the capture script: run it again)."""

    def option(self, name: str) -> str:
        return f"{self.options}{self.sep}{name}"


_NAMED_AS: contextvars.ContextVar[Labels | None] = contextvars.ContextVar("served_labels", default=None)


def labels(spec: TeacherSpec) -> Labels:
    """The labels in force: the script's (:func:`named_as`), else the run config's keys for ``spec``."""
    return _NAMED_AS.get() or Labels(f"teachers[{spec.name}].model", f"teachers[{spec.name}].options")


@contextlib.contextmanager
def named_as(given: Labels) -> Iterator[None]:
    """Within the block, the client's messages name ``given`` (a script's flags) instead of run-config keys."""
    token = _NAMED_AS.set(given)
    try:
        yield
    finally:
        _NAMED_AS.reset(token)


@dataclass(frozen=True)
class ServedCard(TeacherCard):
    """A served teacher's card: the plan's fields, and what the server said of itself."""

    api: str = "distill_kit"
    k: int = 20
    served_model: str | None = None
    """The name the server serves the model under (vLLM's ``model`` field)."""
    teacher_sha256: str | None = None
    """The server's weights' sha256 (the project's server), what checkpoints record as the teacher."""
    payload: str = "top_k"
    head_sha256: str | None = None
    """``payload: hidden``: the head's sha256 the server reported (and the local folder's matched)."""
    head_dtype: str | None = None
    """``payload: hidden``: the dtype of the hidden states and head (``served_protocol.DTYPES``)."""
    head_shape: tuple[int, int] | None = None
    """``payload: hidden``: the head's (V, H), as the server reports them."""
    head_bias: bool = False
    options: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass
class ServedOutput:
    """What a served teacher's forward returns: top-k targets in place of logits."""

    logits: SparseTeacherLogits


def options_of(spec: TeacherSpec) -> dict[str, Any]:
    """The spec's options over :data:`DEFAULTS`, each checked; one ``ConfigError`` naming every bad value."""
    opts = DEFAULTS | dict(spec.options)
    key, problems = labels(spec).options, []
    if opts["api"] not in protocol.APIS:
        problems.append(f"api {opts['api']!r}: choose one of {', '.join(protocol.APIS)}")
    for name in ("k", "rows_per_request", "max_in_flight", "max_response_bytes"):
        if not (isinstance(opts[name], int) and not isinstance(opts[name], bool) and opts[name] >= 1):
            problems.append(f"{name} must be an integer >= 1, got {opts[name]!r}")
    for name in ("timeout_s", "wait_s", "retries_s"):
        if not (isinstance(opts[name], int | float) and not isinstance(opts[name], bool) and opts[name] >= 0):
            problems.append(f"{name} must be a number of seconds >= 0, got {opts[name]!r}")
    if opts["payload"] not in PAYLOADS:
        problems.append(f"payload {opts['payload']!r}: choose one of {', '.join(PAYLOADS)}")
    temperature = opts["temperature"]
    if not (isinstance(temperature, int | float) and not isinstance(temperature, bool) and 0 < temperature < 1e6):
        problems.append(f"temperature must be a number > 0, got {temperature!r}")
    if opts["payload"] != "sampled" and temperature != 1.0:
        problems.append(f"temperature {temperature!r}: only payload: sampled draws at a temperature (top-k "
                        "log-probabilities come at 1 and the loss applies its own; payload: hidden is exact at any)")
    if opts["payload"] == "sampled" and isinstance(opts["k"], int) and opts["k"] > 255:
        problems.append(f"k = {opts['k']}: payload: sampled draws 1 to 255 tokens a position (counts are one byte)")
    if opts["head"] is not None and not isinstance(opts["head"], str | Path):
        problems.append(f"head must be the teacher's folder (a path), got {opts['head']!r}")
    if not isinstance(opts["tail"], bool):
        problems.append(f"tail must be true or false, got {opts['tail']!r}")
    if opts["api_key_env"] is not None and not os.environ.get(opts["api_key_env"]):
        problems.append(f"api_key_env {opts['api_key_env']!r}: that environment variable is not set; export the "
                        "server's API key in it")
    if problems:
        raise ConfigError(f"{key}: " + "; ".join(problems))
    return opts


class Transport:
    """The client's HTTP: an ``httpx.AsyncClient`` on an event loop of its own (a daemon thread). A request's
    deadline (``timeout_s``) cancels it wherever it waits (connecting, the headers, a body trickled a byte at a
    time), which httpx's per-read timeouts cannot; its body is read up to ``max_response_bytes`` and refused as soon
    as it passes them. :meth:`submit` returns a ``concurrent.futures.Future``; at most ``max_in_flight`` requests run
    at once, the rest queued with their deadline not yet started."""

    def __init__(self, url: str, opts: Mapping[str, Any], named: Labels):
        import httpx

        quiet = logging.getLogger("httpx")  # an INFO line per request (one or more a micro-batch) would bury the
        if quiet.level == logging.NOTSET:   # run's log; its warnings stay, and a level the user set is kept
            quiet.setLevel(logging.WARNING)
        self.url, self.opts, self.named = url, opts, named
        key = os.environ.get(opts["api_key_env"]) if opts["api_key_env"] else None
        if key:
            _warn_if_plain_http(url, named)
        headers = {"Accept-Encoding": "identity"} | ({"Authorization": f"Bearer {key}"} if key else {})
        limits = httpx.Limits(max_connections=opts["max_in_flight"] + 1,
                              max_keepalive_connections=opts["max_in_flight"])
        # httpx's own timeouts: only connecting (a host that drops packets: retried as unreachable); the deadline
        # covers the rest
        deadline = opts["timeout_s"] or None
        self.client = httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(
            None, connect=min(10.0, deadline or 10.0)))
        self.slots = asyncio.Semaphore(opts["max_in_flight"])
        self.received = 0
        """Bytes of answers read whole (the benchmarks' bytes on the wire)."""
        self.wire = Wire(url, {"Authorization": f"Bearer {key}"} if key else {}) if url.startswith("http://") else None
        """Large binary answers' fast path (``served_wire.py``): plain http:// only; https:// goes through httpx."""
        self.timings: collections.deque[dict[str, float]] = collections.deque(maxlen=4096)
        """Per ``/v1/hidden`` answer, the seconds of each phase, the server's (``server_*``, from its timing header)
        and this client's (``sent``, ``head``, ``body``, ``check``): what the benchmarks break a request into."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="served-teacher", daemon=True)
        self.thread.start()

    def submit(self, work: Coroutine[Any, Any, Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    async def fetch(self, method: str, path: str, body: Any = None, *, what: str = "",
                    cap: int | None = None) -> tuple[int, bytes]:
        """One request: its status and body. :class:`TeacherTimeout` past ``timeout_s``, :class:`TeacherResponseError`
        past ``max_response_bytes``; httpx's transport errors pass through (the caller retries them)."""
        deadline = self.opts["timeout_s"] or None
        async with self.slots:
            try:
                return await asyncio.wait_for(self._fetch(method, path, body, cap), deadline)
            except asyncio.TimeoutError:
                raise self.timed_out(path, deadline, what) from None

    async def fetch_into(self, path: str, body: Any, allocate: Callable[[int], torch.Tensor], *,
                         what: str = "", cap: int | None = None) -> Answer:
        """A POST of ``body`` (a GET where it is None) whose large answer is read straight into ``allocate(length)``
        (a uint8 tensor) where the URL is plain http:// (``served_wire.py``), else through :meth:`fetch`; the same
        deadline, cap (``max_response_bytes`` unless ``cap``) and errors."""
        if self.wire is None:
            status, content = await self.fetch("GET" if body is None else "POST", path, body, what=what, cap=cap)
            return Answer(status, len(content), data=content)
        deadline = self.opts["timeout_s"] or None
        sent = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        async with self.slots:
            try:
                answer = await asyncio.wait_for(self.wire.post(
                    path, sent, int(self.opts["max_response_bytes"]) if cap is None else cap, allocate,
                    self.too_large), deadline)
            except asyncio.TimeoutError:
                raise self.timed_out(path, deadline, what) from None
        self.received += answer.length
        return answer

    def timed_out(self, path: str, deadline: float | None, what: str) -> TeacherTimeout:
        return TeacherTimeout(
            f"{self.named.model}: the teacher server at {self.url} did not answer {path} within timeout_s="
            f"{deadline:g} s{what}. A loaded or slow server (or one that trickles its answer): raise "
            f"{self.named.option('timeout_s')}, lower {self.named.option('rows_per_request')}, or give it "
            f"more GPUs; {self.named.stop}: {self.named.resume}")

    async def _fetch(self, method: str, path: str, body: Any, cap: int | None = None) -> tuple[int, bytes]:
        """``cap``: this request's largest answer (the head's exact size); else ``max_response_bytes``."""
        cap = int(self.opts["max_response_bytes"]) if cap is None else cap
        async with self.client.stream(method, self.url + path, json=body) as reply:
            length = reply.headers.get("content-length", "")
            if length.isdigit() and int(length) > cap:
                raise self.too_large(f"Content-Length {int(length)}")
            chunks, size = [], 0
            async for chunk in reply.aiter_bytes():
                size += len(chunk)
                if size > cap:
                    raise self.too_large(f"{size} bytes read")
                chunks.append(chunk)
            self.received += size
            return reply.status_code, b"".join(chunks)

    def too_large(self, seen: str) -> TeacherResponseError:
        return TeacherResponseError(
            f"the answer is larger than {self.named.option('max_response_bytes')} = {self.opts['max_response_bytes']} "
            f"bytes ({seen}): a server gone wrong, or requests too large for the cap (lower "
            f"{self.named.option('rows_per_request')}, or raise {self.named.option('max_response_bytes')})")

    def close(self) -> None:
        """Cancel what is in flight, close the connections, stop the loop."""
        if self.loop.is_closed():
            return

        async def shut() -> None:
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            if self.wire is not None:
                self.wire.close()
            await self.client.aclose()

        with contextlib.suppress(Exception):
            self.submit(shut()).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


_WARNED_PLAIN_HTTP: set[str] = set()


def _warn_if_plain_http(url: str, named: Labels) -> None:
    """Once a process per URL: the API key is about to go in clear text to a host other than this machine."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        local = ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = host == "localhost"
    if parts.scheme == "http" and not local and url not in _WARNED_PLAIN_HTTP:
        _WARNED_PLAIN_HTTP.add(url)
        LOG.warning("%s: the API key goes to %s over plain http://, readable by anyone on the path: serve the "
                    "teacher behind https:// (a TLS proxy), or reach it through an SSH tunnel to 127.0.0.1",
                    named.model, url)


def server_info(url: str, opts: Mapping[str, Any], named: Labels) -> dict[str, Any]:
    """What the server at ``url`` says of its model (``served_protocol.INFO_ENDPOINTS``), waiting up to ``wait_s``
    for it to come up; then one ``ConfigError`` naming the URL and the fix, in ``named``'s words."""
    import httpx

    api, deadline, last = opts["api"], time.monotonic() + opts["wait_s"], "no answer"
    path = protocol.INFO_ENDPOINTS[api]
    with Transport(url, opts, named) as transport:
        while True:
            status, document = None, None
            try:
                status, content = transport.submit(transport.fetch("GET", path)).result()
                document = json.loads(content) if status == 200 else None
            except (httpx.TransportError, ValueError, TeacherFault) as err:  # a bad answer is a ValueError too
                last = f"{type(err).__name__}: {err}"
            if status == 401:
                raise ConfigError(f"{named.model}: the server at {url} refused the API key (HTTP 401); set "
                                  f"{named.option('api_key_env')} to the environment variable holding its --api-key")
            if document is not None:
                return _info(api, document, url, named)
            if status is not None and status != 200:
                last = f"HTTP {status} from {path}: {content[:200].decode('utf-8', 'replace')}"
                if status == 404:
                    break  # another API on that port: waiting will not help
            if time.monotonic() >= deadline:
                break
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    start = {"distill_kit": "python scripts/serve_teacher.py MODEL --port PORT",
             "vllm": "vllm serve MODEL --port PORT --max-logprobs K",
             "sglang": "python -m sglang.launch_server --model-path MODEL --port PORT"}[api]
    raise ConfigError(f"{named.model}: no {api} teacher server answered at {url} within wait_s="
                      f"{opts['wait_s']:g} s (last: {last}). Start it ({start}), check the host, port and "
                      f"{named.option('api')} ({api}), or raise {named.option('wait_s')} while it loads")


INFO_TYPES: dict[str, tuple[type, ...]] = {"model": (str,), "vocab_size": (int,), "tokenizer_sha256": (str,),
                                           "teacher_sha256": (str,), "max_k": (int,), "max_model_len": (int,),
                                           "config": (dict,), "payloads": (list,), "head_sha256": (str,),
                                           "hidden_size": (int,), "hidden_dtype": (str,), "head_bias": (bool,)}
"""What each field a server reports of itself must be (null allowed): a start trusts none it cannot read."""


def _info(api: str, document: Any, url: str, named: Labels) -> dict[str, Any]:
    """The facts a server reports of itself, each of the type :data:`INFO_TYPES` says, or one ``ConfigError``."""
    path = protocol.INFO_ENDPOINTS[api]
    if not isinstance(document, dict):
        raise ConfigError(f"{named.model}: {url}{path} answered {type(document).__name__}, not a JSON object: is "
                          f"that a {api} server ({named.option('api')})?")
    if api == "distill_kit":
        info = dict(document)
    elif api == "vllm":
        data = document.get("data")
        if not (isinstance(data, list) and data and isinstance(data[0], dict)):
            raise ConfigError(f"{named.model}: {url}/v1/models lists no model")
        entry = data[0]
        extra = entry.get("distill_kit")
        info = {"model": entry.get("id"), "max_model_len": entry.get("max_model_len"),
                **(extra if isinstance(extra, dict) else {})}
    else:
        info = {"model": document.get("model_path"), "max_model_len": document.get("max_model_len")}
    wrong = [f"{name} is {json.dumps(info[name], default=str)[:40]}" for name, types in INFO_TYPES.items()
             if info.get(name) is not None and (not isinstance(info[name], types)
                                                or (isinstance(info[name], bool) and types != (bool,))
                                                or (types == (int,) and info[name] < 1))]
    if info.get("hidden_dtype") is not None and info["hidden_dtype"] not in protocol.DTYPES:
        wrong.append(f"hidden_dtype is {json.dumps(info['hidden_dtype'])[:40]}")
    if wrong:
        raise ConfigError(f"{named.model}: {url}{path} reports {', '.join(wrong)}: not a teacher server's facts "
                          f"(a number >= 1, a string or an object where each belongs); check the URL and "
                          f"{named.option('api')}")
    return info


_HEADS: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
"""Heads read from a folder by ``describe`` (to check their sha256), taken by the teacher's ``__init__``: read once."""


def _payload_problems(opts: Mapping[str, Any], info: Mapping[str, Any], named: Labels) -> list[str]:
    """What ``payload: hidden`` cannot have of this server: another API (vLLM, SGLang serve top-k log-probabilities
    only), a model whose logits are not its head's output, a local head other than the server's (by sha256)."""
    payload = opts["payload"]
    if payload == "top_k":
        return []
    option = named.option("payload")
    if opts["api"] != "distill_kit":
        field = "prompt_logprobs" if opts["api"] == "vllm" else "input_top_logprobs"
        what = "hidden states" if payload == "hidden" else "sampled tokens"
        return [f"{option}: {payload}: a {opts['api']} server serves top-k log-probabilities ({field}), not {what}: "
                f"use {option}: top_k (k up to its --max-logprobs), or serve the teacher with "
                f"scripts/serve_teacher.py for payload: {payload}"]
    if payload == "sampled":
        return [] if "sampled" in (info.get("payloads") or []) else [
            f"{option}: sampled: the server gives no sampled tokens (its /info payloads: "
            f"{info.get('payloads') or ['top_k']}): a server that predates them; use payload: top_k"]
    if "hidden" not in (info.get("payloads") or []) or not info.get("head_sha256") or not info.get("hidden_size"):
        return [f"{option}: hidden: the server gives no hidden states (its /info payloads: "
                f"{info.get('payloads') or ['top_k']}): its model's logits are not exactly its head's output "
                "(engines/head.py EXACT_HEADS), or the server predates them; use payload: top_k"]
    folder = opts["head"]
    if folder is None:
        return []
    from distill_kit.teachers.served_head import load_head

    dtype = _TORCH_DTYPES[info["hidden_dtype"]]
    try:
        weight, bias = load_head(folder, dtype)
    except (ConfigError, OSError, ValueError) as err:
        return [f"{named.option('head')} {str(folder)!r}: {err}"]
    ours = protocol.head_digest(weight, bias)
    if ours != info["head_sha256"]:
        return [f"{named.option('head')} {str(folder)!r}: its head's sha256 ({ours[:12]}, in {info['hidden_dtype']}) "
                f"is not the server's ({info['head_sha256'][:12]}): the folder holds another model or revision than "
                f"the server serves; point {named.option('head')} at the served model's folder, or leave it out to "
                "take the head from the server"]
    _HEADS[(str(folder), ours)] = (weight, bias)
    return []


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ServedTeacher(Teacher):
    """A teacher behind an inference server (module docstring). ``forward`` returns :class:`ServedOutput`."""

    kind = "served"
    options = tuple(DEFAULTS)

    @classmethod
    def describe(cls, spec: TeacherSpec) -> ServedCard:
        """Asks the server (waiting up to ``wait_s``); refuses a tokenizer other than ``options.tokenizer``'s and a
        k above what the server gives, before anything is written."""
        opts, named = options_of(spec), labels(spec)
        url = str(spec.model).rstrip("/")
        info = server_info(url, opts, named)
        problems = []
        hidden, sampled = opts["payload"] == "hidden", opts["payload"] == "sampled"
        problems += _payload_problems(opts, info, named)
        if not hidden and info.get("max_k") is not None and opts["k"] > int(info["max_k"]):  # top_k, sampled
            problems.append(f"{named.option('k')} = {opts['k']}: the server gives at most {info['max_k']} "
                            "(serve_teacher.py --max-k, vllm serve --max-logprobs)")
        local = opts["tokenizer"]
        from distill_kit.engines.models import has_tokenizer

        if local is not None:
            if not has_tokenizer(local):
                problems.append(f"{named.option('tokenizer')} {local!r} holds no tokenizer (tokenizer.json or "
                                "tokenizer_config.json); give the folder of the server's model's tokenizer")
            elif info.get("tokenizer_sha256") and (ours := vocabulary_sha256(local)) != info["tokenizer_sha256"]:
                problems.append(f"the server's tokenizer (vocabulary sha256 {info['tokenizer_sha256'][:12]}) is not "
                                f"{named.option('tokenizer')}'s ({local!r}: {ours[:12]}): serve a model with this "
                                f"run's tokenizer, or point {named.option('tokenizer')} at the server model's")
        config = _config(info.get("config"))
        text = config.get_text_config() if config is not None else None
        vocab = info.get("vocab_size") or (getattr(text, "vocab_size", None) if text is not None else None)
        if vocab is None and local is not None and (Path(local) / "config.json").is_file():
            from distill_kit.engines.models import model_config  # vLLM, SGLang: the served model's folder says

            vocab = getattr(model_config(local).get_text_config(), "vocab_size", None)
        if not hidden and vocab is not None and opts["k"] > int(vocab):
            problems.append(f"{named.option('k')} = {opts['k']}: above the teacher's vocabulary ({vocab} tokens); give "
                            f"k <= {vocab} (or payload: hidden for the whole distribution)")
        if problems:
            raise ConfigError(f"{named.model}: " + "; ".join(problems))
        outputs = {HEAD} if hidden else {SAMPLED} if sampled else {TOP_K} | ({TOP_K_TAIL} if opts["tail"] else set())
        return ServedCard(
            kind=cls.kind, source=url, outputs=frozenset(outputs), can_generate=False, vocab_size=vocab,
            tokenizer=str(local) if local is not None else None, positions=info.get("max_model_len"),
            hidden_size=getattr(text, "hidden_size", None), num_layers=getattr(text, "num_hidden_layers", None),
            eos_token_id=getattr(text, "eos_token_id", None), model_type=getattr(config, "model_type", None),
            config=config, api=opts["api"], k=opts["k"], served_model=info.get("model"),
            tokenizer_sha256=info.get("tokenizer_sha256"), teacher_sha256=info.get("teacher_sha256"), options=opts,
            payload=opts["payload"], head_sha256=info.get("head_sha256") if hidden else None,
            head_dtype=info.get("hidden_dtype") if hidden else None,
            head_shape=(int(vocab), int(info["hidden_size"])) if hidden and vocab else None,
            head_bias=bool(info.get("head_bias")) if hidden else False,
            sample_temperature=float(opts["temperature"]) if sampled else None)

    def __init__(self, spec: TeacherSpec, card: TeacherCard, setup: TeacherSetup):
        super().__init__(spec, card, setup)
        self.opts = card.options if isinstance(card, ServedCard) and card.options else options_of(spec)
        self.named = labels(spec)  # taken here: the request threads do not see the caller's named_as
        self.url = str(spec.model).rstrip("/")
        self.api, self.k = self.opts["api"], int(self.opts["k"])
        self.served_model = card.served_model if isinstance(card, ServedCard) else None
        self.device = setup.device
        self.vocab_size = card.vocab_size  # the bound of the ids an answer may hold
        if self.vocab_size is None:
            LOG.warning("%s: the server at %s reports no vocabulary size: its answers' ids are checked only to be "
                        ">= 0; give %s the served model's folder (with its config.json) to check them against it",
                        self.named.model, self.url, self.named.option("tokenizer"))
        self.transport = Transport(self.url, self.opts, self.named)
        self.payload = self.opts["payload"]
        self.head: GatheredHead | None = None
        if self.payload == "hidden":
            self.head = self._head(card)
        self.pending: OrderedDict[str, tuple[list[tuple[int, np.ndarray]], list[Future]]] = OrderedDict()
        self.lock = threading.Lock()
        self.waited_s = 0.0
        """Seconds ``forward`` spent waiting on the server (what prefetch did not hide), for benchmarks."""
        self.side: torch.cuda.Stream | None = None
        """``payload: hidden`` on a GPU: the stream its answers are copied and checked on."""

    def _head(self, card: TeacherCard) -> GatheredHead:
        """The teacher's head on the training device: the folder's (read by ``describe``) or the server's, fetched
        once and checked against ``head_sha256``; and the bound its hidden states are checked against."""
        if not isinstance(card, ServedCard) or card.head_sha256 is None or card.head_dtype is None:
            raise ConfigError(f"{self.named.model}: payload: hidden needs the card describe() makes of the server")
        folder = self.opts["head"]
        if folder is not None:
            weight, bias = _HEADS.pop((str(folder), card.head_sha256), (None, None))
            if weight is None:
                from distill_kit.teachers.served_head import load_head

                weight, bias = load_head(folder, _TORCH_DTYPES[card.head_dtype])
                if protocol.head_digest(weight, bias) != card.head_sha256:
                    raise ConfigError(f"{self.named.option('head')} {str(folder)!r}: its head is not the server's "
                                      "(sha256)")
        else:
            shape = card.head_shape
            size = protocol.head_size(*shape, card.head_dtype, card.head_bias) + (1 << 20)  # + its header, at most
            answer = self.transport.submit(self.transport.fetch_into(
                "/v1/head", None, lambda n: torch.empty(n, dtype=torch.uint8), cap=size,
                what=" (the teacher's head)")).result()
            try:
                if answer.status != 200:
                    raise TeacherResponseError(f"HTTP {answer.status} to /v1/head: "
                                               f"{(answer.data or b'')[:300].decode('utf-8', 'replace')}")
                body = answer.data if answer.data is not None else answer.buffer.numpy()
                weight, bias = protocol.decode_head(body, shape, card.head_dtype, card.head_sha256)
            except TeacherResponseError as err:
                raise TeacherResponseError(f"{self.named.model}: the teacher server at {self.url} sent a head that "
                                           f"cannot be used: {err}") from None
        weight = weight.to(self.device)
        bias = None if bias is None else bias.to(self.device)
        self.head_bound = (float(weight.abs().max()), 0.0 if bias is None else float(bias.abs().max()))
        return GatheredHead(weight, bias)

    # ------------------------------------------------------------------------------------------- the step

    def prefetch(self, inputs: Mapping[str, Any]) -> None:
        """Send ``inputs``' requests now and return at once; the ``forward`` on the same inputs then takes their
        answers. Call it with the next micro-batch's teacher inputs before the student's step on this one."""
        key = _key(inputs)
        with self.lock:
            if key not in self.pending:
                self.pending[key] = self._send(inputs)
                while len(self.pending) > 4:  # prefetched and never consumed (a skipped batch): let them go
                    self.pending.popitem(last=False)

    def forward(self, inputs: Mapping[str, Any]) -> ServedOutput:
        if inputs.get("output_hidden_states") or inputs.get("output_attentions"):
            raise ConfigError(f"{self.named.model}: a served teacher returns top-k log-probabilities or its final "
                              "hidden states only; hidden-state and attention losses need an in-process teacher "
                              "(kind: engine)")
        key = _key(inputs)
        with self.lock:
            sent = self.pending.pop(key, None)
        segments, futures = sent if sent is not None else self._send(inputs)
        start = time.perf_counter()
        answers = [future.result() for future in futures]
        self.waited_s += time.perf_counter() - start
        if self.payload == "hidden":
            return HeadOutput(hidden=self._assemble_hidden(inputs, segments, answers), head=self.head)
        if self.payload == "sampled":
            return ServedOutput(self._assemble_sampled(inputs, segments, [t for part in answers for t in part]))
        return ServedOutput(self._assemble(inputs, segments, [t for part in answers for t in part]))

    def _send(self, inputs: Mapping[str, Any]) -> tuple[list[tuple[int, np.ndarray]], list[Future]]:
        segments = prompts_of(inputs)
        prompts = [tokens.tolist() for _, tokens, _ in segments]
        size = self.opts["rows_per_request"]
        futures = [self.transport.submit(self._request(prompts[i:i + size])) for i in range(0, len(prompts), size)]
        return segments, futures

    def _assemble(self, inputs: Mapping[str, Any], segments: Sequence[tuple[int, np.ndarray, np.ndarray]],
                  targets: Sequence[PromptTargets]) -> SparseTeacherLogits:
        """(B, T, k) targets: each segment's rows placed at its positions but its last; zeros elsewhere."""
        batch, length = inputs["input_ids"].shape
        ids = np.zeros((batch, length, self.k), dtype=np.int64)
        values = np.zeros((batch, length, self.k), dtype=np.float32)
        tail = np.zeros((batch, length), dtype=np.float32) if self.opts["tail"] else None
        for (row, _, positions), target in zip(segments, targets, strict=True):
            where = positions[:-1]
            ids[row, where], values[row, where] = target.ids, target.log_probs
            if tail is not None:
                tail[row, where] = target.log_tail if target.log_tail is not None else protocol.derived_tail(
                    target.log_probs)
        to = {"device": self.device}
        return SparseTeacherLogits(torch.from_numpy(values).to(**to), torch.from_numpy(ids).to(**to),
                                   None if tail is None else torch.from_numpy(tail).to(**to))

    def _assemble_hidden(self, inputs: Mapping[str, Any], segments: Sequence[tuple[int, np.ndarray, np.ndarray]],
                         answers: Sequence[tuple[torch.Tensor, Any]]) -> torch.Tensor:
        """(B, T, H) hidden states in the head's dtype on the training device: each answer's rows (already there,
        checked) placed at their segments' positions but the last, by one ``index_copy_`` an answer; zeros
        elsewhere (positions no loss counts)."""
        batch, length = inputs["input_ids"].shape
        weight = self.head.weight
        out = torch.zeros((batch * length, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        where = np.concatenate([row * length + positions[:-1] for row, _, positions in segments] or [np.zeros(0)])
        where = torch.from_numpy(where.astype(np.int64)).to(weight.device, non_blocking=True)
        start = 0
        for rows, done in answers:
            if done is not None:  # the copy and the check ran on the side stream: order this stream after them
                torch.cuda.current_stream(weight.device).wait_event(done)
                rows.record_stream(torch.cuda.current_stream(weight.device))
            out.index_copy_(0, where[start:start + rows.shape[0]], rows)
            start += rows.shape[0]
        return out.view(batch, length, -1)

    def _assemble_sampled(self, inputs: Mapping[str, Any], segments: Sequence[tuple[int, np.ndarray, np.ndarray]],
                          drawn: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> SampledTeacherLogits:
        """(B, T, k) draws at each segment's positions but its last; zeros (count 0) elsewhere."""
        batch, length = inputs["input_ids"].shape
        ids = np.zeros((batch, length, self.k), dtype=np.int64)
        values = np.zeros((batch, length, self.k), dtype=np.float32)
        counts = np.zeros((batch, length, self.k), dtype=np.uint8)
        for (row, _, positions), (got_ids, got_values, got_counts) in zip(segments, drawn, strict=True):
            where = positions[:-1]
            ids[row, where], values[row, where], counts[row, where] = got_ids, got_values, got_counts
        to = {"device": self.device}
        return SampledTeacherLogits(torch.from_numpy(values).to(**to), torch.from_numpy(ids).to(**to),
                                    torch.from_numpy(counts).to(**to), float(self.opts["temperature"]))

    # ----------------------------------------------------------------------------------------- one request

    async def _request(self, prompts: list[list[int]]) -> list[PromptTargets]:
        """One request, retried with backoff while the server is unreachable or restarting, for ``retries_s``; its
        answer checked whole (``protocol.parse``) before it is returned."""
        import httpx

        if self.payload == "hidden":
            body, path = {"prompts": prompts}, "/v1/hidden"
        elif self.payload == "sampled":
            body = {"prompts": prompts, "k": self.k, "temperature": float(self.opts["temperature"])}
            path = "/v1/sample"
        else:
            body = protocol.request_body(self.api, prompts, self.k, self.served_model)
            path = protocol.ENDPOINTS[self.api]
        what = f" ({len(prompts)} prompts, {sum(map(len, prompts))} tokens)"
        first_failure, delay = None, 0.5
        while True:
            try:
                if self.payload == "hidden":
                    answer = await self.transport.fetch_into(path, body, self._allocate, what=what)
                    status, content = answer.status, answer.data
                else:
                    status, content = await self.transport.fetch("POST", path, body, what=what)
                if status in (502, 503, 504):
                    raise httpx.TransportError(f"HTTP {status}")
                if status == 401:
                    raise ConfigError(f"{self.named.model}: the server at {self.url} refused the API key (HTTP "
                                      f"401); set {self.named.option('api_key_env')} to the variable holding its "
                                      "--api-key")
                if status != 200:
                    raise TeacherResponseError(f"HTTP {status} to {path}{what}: "
                                               f"{content[:300].decode('utf-8', 'replace')}")
                if self.payload == "hidden":
                    return await self._hidden(answer, prompts)
                if self.payload == "sampled":
                    return protocol.decode_sample(content, prompts, self.k, float(self.opts["temperature"]),
                                                  self.vocab_size)
                return protocol.parse(self.api, content, prompts, self.k, self.vocab_size)
            except TeacherResponseError as err:
                raise TeacherResponseError(
                    f"{self.named.model}: the teacher server at {self.url} ({self.api}) answered what cannot be "
                    f"trained on: {err}. Check that it serves this run's teacher and is healthy (an error page, a "
                    f"proxy, another service on that port or a broken build answer so) and that "
                    f"{self.named.option('api')} is its API; {self.named.stop}: fix the server, then "
                    f"{self.named.resume}") from None
            except (httpx.TransportError, httpx.DecodingError) as err:
                now = time.monotonic()
                first_failure = first_failure or now
                if now - first_failure >= self.opts["retries_s"]:
                    raise TeacherUnavailable(
                        f"{self.named.model}: the teacher server at {self.url} has not answered for "
                        f"{now - first_failure:.0f} s ({self.named.option('retries_s')}={self.opts['retries_s']:g}; "
                        f"last: {type(err).__name__}: {err}); {self.named.stop}: restart the server, then "
                        f"{self.named.resume}") from None
                LOG.warning("teacher server %s: %s; retrying in %.1f s", self.url, err, delay)
                await asyncio.sleep(min(delay, max(0.0, first_failure + self.opts["retries_s"] - now)))
                delay = min(delay * 2, 10.0)

    def _allocate(self, size: int) -> torch.Tensor:
        """Where a ``/v1/hidden`` answer is read to: pinned host memory for a GPU (its copy there is one DMA; torch's
        caching host allocator reuses the blocks), else plain memory."""
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    async def _hidden(self, answer: Answer, prompts: list[list[int]]) -> tuple[torch.Tensor, Any]:
        """A ``/v1/hidden`` answer checked whole (``served_protocol.hidden_layout``: framing, tokens, width, dtype,
        length), copied to the training device (one non-blocking copy from pinned memory, on a side stream), its
        values checked there (``served_protocol.hidden_problems``: finite, a scale the head turns into finite
        logits; one flag read back) before it is returned: ``(rows (N, H) on the device, the side stream's event or
        None)``."""
        began = time.perf_counter()
        weight = self.head.weight
        hidden_size, dtype = int(weight.shape[1]), protocol.dtype_name(weight.dtype)
        if answer.data is not None:
            body, length = answer.data, len(answer.data)
        else:
            body, length = answer.buffer.numpy(), answer.length
        start, n = protocol.hidden_layout(memoryview(body), length, prompts, hidden_size, dtype)
        size = n * hidden_size * weight.element_size()
        if answer.data is not None:
            source = torch.frombuffer(bytearray(answer.data[start:start + size]), dtype=torch.uint8)
        else:
            source = answer.buffer[start:start + size]
        if self.device.type != "cuda":
            rows = torch.empty((n, hidden_size), dtype=weight.dtype)
            rows.view(-1).view(torch.uint8).copy_(source)
            protocol.check_hidden(rows, self.head_bound)
            done = None
        else:
            if self.side is None:
                self.side = torch.cuda.Stream(self.device)
            flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            with torch.cuda.stream(self.side):
                rows = torch.empty((n, hidden_size), dtype=weight.dtype, device=self.device)
                rows.view(-1).view(torch.uint8).copy_(source, non_blocking=True)
                problems = protocol.hidden_problems(rows, self.head_bound)
                flag.copy_(problems.any(), non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.side)
            while not done.query():  # the event loop stays free for the other answers' reads meanwhile
                await asyncio.sleep(0.0005)
            if bool(flag):
                with torch.cuda.stream(self.side):
                    protocol.check_hidden(rows, self.head_bound, problems)
        fields = answer.headers or {}
        self.transport.timings.append(
            answer.timings | {f"server_{name}": seconds
                              for name, seconds in protocol.parse_timing(fields.get(protocol.TIMING_HEADER)).items()}
            | {"check": time.perf_counter() - began, "bytes": float(length)})
        return rows, done

    # ------------------------------------------------------------------------------------------ identity

    @property
    def identity(self) -> str:
        """The server's weights' sha256 where it reports one (then resuming against another server holding the same
        weights is allowed); else the API, URL and served model name."""
        card = self.card
        if isinstance(card, ServedCard) and card.teacher_sha256:
            return card.teacher_sha256
        return f"served:{self.api}:{self.url}:{getattr(card, 'served_model', None)}"

    def close(self) -> None:
        self.transport.close()


def prompts_of(inputs: Mapping[str, Any]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Each prompt a micro-batch asks the server to score: ``(row, tokens, positions)``, ``positions`` the columns
    its tokens sit at. A row's real tokens (``attention_mask`` 1, or all without one) are one prompt; a packed row
    (``position_ids``, no mask) holds one per conversation, where the positions restart at 0. A prompt of one token
    predicts nothing the losses count and is not sent."""
    ids = inputs["input_ids"].detach().cpu().numpy()
    mask = inputs.get("attention_mask")
    mask = np.ones_like(ids, dtype=bool) if mask is None else mask.detach().cpu().numpy().astype(bool)
    packed = inputs.get("position_ids") is not None and inputs.get("attention_mask") is None
    starts = inputs["position_ids"].detach().cpu().numpy() == 0 if packed else None
    out = []
    for row in range(ids.shape[0]):
        columns = np.flatnonzero(mask[row])
        pieces = np.split(columns, np.flatnonzero(starts[row][columns])[1:]) if packed else [columns]
        out += [(row, ids[row, piece], piece) for piece in pieces if len(piece) > 1]
    return out


def _config(values: Any) -> Any:
    """The server's model config as a ``PretrainedConfig`` (what a fresh student is built from), or None."""
    if not isinstance(values, dict) or "model_type" not in values:
        return None
    from transformers import AutoConfig

    values = dict(values)
    try:
        return AutoConfig.for_model(values.pop("model_type"), **values)
    except (ValueError, KeyError, TypeError):
        return None


def _key(inputs: Mapping[str, Any]) -> str:
    """Which micro-batch ``inputs`` are (prefetch's and forward's meeting point): a hash of their token tensors."""
    digest = hashlib.sha256()
    for name in ("input_ids", "attention_mask", "position_ids"):
        value = inputs.get(name)
        if value is not None:
            digest.update(name.encode())
            digest.update(value.detach().cpu().numpy().tobytes())
    return digest.hexdigest()

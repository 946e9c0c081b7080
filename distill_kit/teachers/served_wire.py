"""Large binary answers read straight off the socket into the caller's buffer (``payload: hidden``'s fast path).

Why not httpx for these: a micro-batch of a 7B teacher's hidden states is ~59 MB (8 x 1,023 positions x 3,584 bf16
values). httpx hands the body up in 64 KiB chunks through several layers of Python (~900 iterations, ~0.15-0.2 s of
CPU on this project's 2-core machine, holding the GIL the training thread needs to launch its kernels), then it is
joined into one ``bytes`` (a copy). Here the request and the response's head go through ``h11`` (the HTTP/1.1 state
machine httpx itself is built on), and a ``Content-Length`` body goes by ``loop.sock_recv_into`` into one buffer
the caller allocates (pinned host memory on a GPU, so the copy to the device is one DMA): a few dozen large reads,
~0.013 s of CPU for the same 59 MB (``benchmarks/bench_hidden_wire.py``). Anything else (an error status, a chunked
body, a body under :data:`SMALL`) is read through h11 as it comes.

Plain ``http://`` only (the client uses httpx for ``https://``); connections are kept alive and reused one answer at
a time. A socket that closes or errors mid-answer raises ``httpx.TransportError`` (the caller's retry handles it, as
it does httpx's own).
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SMALL = 1 << 20
"""A body under this many bytes (an error page, a refusal's JSON) is read through h11, not into a caller's buffer."""
READ = 1 << 16
"""Bytes a read asks for while the response's head is not whole yet."""


@dataclass
class Answer:
    """One response: its status, and its body as ``bytes`` (:attr:`data`) or in the caller's buffer
    (:attr:`buffer`, the first :attr:`length` bytes)."""

    status: int
    length: int
    data: bytes | None = None
    buffer: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    """The response's headers, names in lower case."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: ``sent`` (connect and send), ``head`` (until the status line and headers: the server's work and
    queue), ``body`` (reading the body)."""


class Wire:
    """Raw HTTP/1.1 POSTs of JSON to one ``http://host:port`` with keep-alive connections."""

    def __init__(self, url: str, headers: Mapping[str, str]):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"{url}: the fast path speaks plain http:// only")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.headers = [("Host", parts.netloc), ("Accept-Encoding", "identity"), *headers.items()]
        self.idle: list[socket.socket] = []

    async def _connect(self) -> socket.socket:
        if self.idle:
            return self.idle.pop()
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            sock.close()
            raise
        return sock

    async def post(self, path: str, body: bytes | None, cap: int, allocate: Callable[[int], Any],
                   too_large: Callable[[str], Exception]) -> Answer:
        """POST ``body`` (JSON) to ``path``, or GET it where ``body`` is None. A 200 answer of a ``Content-Length``
        >= :data:`SMALL` is read into ``allocate(length)`` (a uint8 CPU tensor of at least ``length`` bytes); past
        ``cap`` bytes, ``too_large``'s exception is raised before the body is read."""
        import h11
        import httpx

        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        sock = await self._connect()
        keep = False
        try:
            conn = h11.Connection(h11.CLIENT)
            if body is None:
                request = h11.Request(method="GET", target=path, headers=self.headers)
                await loop.sock_sendall(sock, conn.send(request) + conn.send(h11.EndOfMessage()))
            else:
                request = h11.Request(method="POST", target=path, headers=[
                    *self.headers, ("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
                await loop.sock_sendall(sock, conn.send(request) + conn.send(h11.Data(data=body))
                                        + conn.send(h11.EndOfMessage()))
            sent = time.perf_counter()

            async def event() -> Any:
                while True:
                    got = conn.next_event()
                    if got is not h11.NEED_DATA:
                        return got
                    conn.receive_data(await loop.sock_recv(sock, READ))

            head = await event()
            while isinstance(head, h11.InformationalResponse):
                head = await event()
            if not isinstance(head, h11.Response):
                raise httpx.RemoteProtocolError(f"the connection closed before an answer ({type(head).__name__})")
            answered = time.perf_counter()
            fields = {name.decode().lower(): value.decode("latin-1") for name, value in head.headers}
            length = fields.get("content-length", "")
            if length.isdigit() and int(length) > cap:
                raise too_large(f"Content-Length {int(length)}")
            answer = Answer(head.status_code, 0, headers=fields)
            if head.status_code == 200 and length.isdigit() and int(length) >= SMALL:
                answer.length = int(length)
                answer.buffer = allocate(answer.length)
                view = memoryview(answer.buffer.numpy()).cast("B")[:answer.length]
                got = 0
                while True:  # what h11 read past the head already
                    piece = conn.next_event()
                    if not isinstance(piece, h11.Data):
                        break
                    view[got:got + len(piece.data)] = piece.data
                    got += len(piece.data)
                while got < answer.length:
                    count = await loop.sock_recv_into(sock, view[got:])
                    if not count:
                        raise httpx.RemoteProtocolError(f"the connection closed {got} bytes into a "
                                                        f"{answer.length}-byte answer")
                    got += count
                keep = fields.get("connection", "").lower() != "close"
            else:
                chunks, size = [], 0
                while not isinstance(piece := await event(), h11.EndOfMessage):
                    if isinstance(piece, h11.ConnectionClosed):
                        raise httpx.RemoteProtocolError("the connection closed mid-answer")
                    size += len(piece.data)
                    if size > cap:
                        raise too_large(f"{size} bytes read")
                    chunks.append(piece.data)
                answer.data, answer.length = b"".join(chunks), size
                keep = conn.their_state is h11.DONE and conn.our_state is h11.DONE
            answer.timings = {"sent": sent - start, "head": answered - sent, "body": time.perf_counter() - answered}
            return answer
        except h11.RemoteProtocolError as err:
            raise httpx.RemoteProtocolError(f"not an HTTP/1.1 answer: {err}") from None
        except (ConnectionError, OSError) as err:
            raise httpx.TransportError(f"{type(err).__name__}: {err}") from None
        finally:
            if keep:
                self.idle.append(sock)
            else:
                sock.close()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()

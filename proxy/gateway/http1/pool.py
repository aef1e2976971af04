"""HTTP/1.1 to one unit: a pool of keep-alive connections, responses parsed by httptools.

A general client does much per request that a proxy does not need (cookies, redirects,
tracing hooks, a header multidict, a stream reader per body). Here a request is one
write of head and body, the response head arrives as a dict of lower-case names, and
the body comes out as the bytes that arrived, joined per read: SSE events are passed
on as they came, never split into lines. Reading pauses while a body waits unread
(the client behind it is slow), so memory stays bounded.

Errors, mapped once here::

    UpstreamError
      ConnectFailed   no response head: connect refused or reset, closed before answering
        Dropped       the request went out, then the connection ended with no answer
      Broken          the connection ended or sent garbage after the head
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 256 * 1024  # unread body bytes at which reading from the unit pauses
IDLE_KEEP_S = 50.0  # an idle connection older than this is closed, not reused (aiohttp
# servers close keep-alive connections after 75 s by default)


# The response header names units send, as the lower-case str a response is keyed by.
_NAMES = {
    name.encode(): name.lower()
    for name in ("Content-Type", "Content-Length", "Date", "Server", "Transfer-Encoding",
                 "Connection", "Cache-Control", "X-Request-Id", "X-Unitproxy-Unit",
                 "x-request-id", "x-unitproxy-unit", "content-type", "content-length", "date",
                 "server", "transfer-encoding", "connection", "cache-control", "Retry-After",
                 "retry-after", "x-unitproxy-usage", "X-Unitproxy-Usage")
}  # fmt: skip


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    """No response head came: the unit could not be reached or closed the connection."""


class Dropped(ConnectFailed):
    """The request went out on the connection, which then ended before any answer: the
    unit may have taken it (a unit killed while it ran a non-streamed request)."""


class Broken(UpstreamError):
    """The response broke after its head: connection lost or not valid HTTP."""


class UnitConnection(asyncio.Protocol):
    """One keep-alive connection; also the response it is carrying."""

    __slots__ = ("_buffered", "_chunks", "_complete", "_error", "_head", "_keep_alive",
                 "_loop", "_parser", "_paused", "_pool", "_sink", "_to_eof", "_waiter",
                 "_wake", "closed", "headers", "idle_since", "reused", "status",
                 "transport")  # fmt: skip

    def __init__(self, pool: Pool):
        self._pool = pool
        self._loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self._head: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._complete = False
        self._keep_alive = False
        self._to_eof = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._wake = False
        self._paused = False
        self.closed = False
        self.reused = False
        self.idle_since = 0.0

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"not a valid HTTP response: {exc}")
            self.close()
        except httptools.HttpParserUpgrade:  # 101 Switching Protocols: failed already
            self.close()
        if self._wake:
            self._wake = False
            if self._sink is not None and self._chunks:
                self._sink(self._take())
                if not self._complete:
                    return  # spliced: the task waits for the end only
            self._set_waiter()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.lost(self)
        if self._to_eof and exc is None and self._error is None:
            self._complete = True  # the close was the end of the body
            if self._sink is not None and self._chunks:
                self._sink(self._take())
        if not self._complete:
            self._fail(f"connection closed: {exc}" if exc else "connection closed")
        self._set_waiter()

    # -- httptools callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        self.headers = {}
        self._chunks = []

    def on_header(self, name: bytes, value: bytes) -> None:
        key = _NAMES.get(name)
        if key is None:
            key = name.decode("latin-1").lower()
        self.headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self.status < 200:
            # An interim response (100 Continue, 103 Early Hints) comes before the answer
            # and is dropped. A 101 switches protocols, which the gateway never asks for:
            # the answer is broken (not unreachable: the unit took the request).
            if self.status == 101:
                self._fail("it switched protocols (101), which the gateway never asks", True)
            return
        self._keep_alive = self._parser.should_keep_alive()  # known only until the end
        # No length and not chunked: the body ends when the unit closes the connection.
        self._to_eof = (
            "content-length" not in self.headers
            and "transfer-encoding" not in self.headers
            and self.status >= 200
            and self.status not in (204, 304)
        )
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        self._wake = True
        if self._buffered > HIGH_WATER:
            self.pause_reading()

    def on_message_complete(self) -> None:
        if self.status < 200:
            return  # an interim response ended: the answer comes next
        self._complete = True
        self._wake = True

    # -- the request -----------------------------------------------------------------

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.status = 0
        self._complete = False
        self._to_eof = False
        self._error = None
        self._head = self._loop.create_future()
        self.transport.write(data)

    async def read_some(self) -> bytes | None:
        """The body bytes that arrived since the last call, joined; None at its end."""
        while not self._chunks:
            if self._complete:
                return None
            await self._wait()
        return self._take()

    async def splice(self, sink: Callable[[bytes], None]) -> None:
        """Hand the body to ``sink`` as it arrives, inside the protocol callback (no task
        wakes per chunk); return when it ended. The receiver paces the unit through
        ``pause_reading``/``resume_reading``."""
        self._sink = sink  # first: taking what is buffered must not resume reading
        if self._chunks:
            sink(self._take())
        try:
            while not self._complete:
                await self._wait()
        finally:
            self._sink = None

    async def _wait(self) -> None:
        """Until the protocol has news: body bytes, the end, or an error (raised)."""
        if self._error is not None:
            raise self._error
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        chunks, self._chunks = self._chunks, []
        self._buffered = 0
        if self._paused and self._sink is None:
            self.resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @property
    def paused(self) -> bool:
        """Reading is paused: the receiver of the body is not taking more."""
        return self._paused

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    async def read(self) -> bytes:
        if self._complete:  # most bodies: whole in the read that brought the head
            return self._take() if self._chunks else b""
        parts = []
        while (data := await self.read_some()) is not None:
            parts.append(data)
        return b"".join(parts)

    def done(self) -> None:
        """The caller is finished with this response: keep the connection or close it."""
        if self._complete and self._keep_alive and not self.closed:
            self.resume_reading()  # a receiver may have paused it on the last read
            self._pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self._pool.lost(self)

    def _fail(self, why: str, answered: bool = False) -> None:
        """The response failed (``answered``: the unit took the request, though no head
        came that the gateway can pass on)."""
        if self._error is not None:
            return
        head_came = self._head is not None and self._head.done()
        if head_came or answered:
            self._error = Broken(why)
        elif self._head is not None:
            self._error = Dropped(why)
        else:
            self._error = ConnectFailed(why)
        if self._head is not None and not self._head.done():
            self._head.set_exception(self._error)
            self._head.exception()  # retrieved: no "never retrieved" warning if unawaited

    def _set_waiter(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Pool:
    """Keep-alive connections to one unit's HTTP address, at most ``limit`` open."""

    def __init__(
        self,
        url: str,
        limit: int,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout_s: float = 2.0,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.loop = asyncio.get_running_loop()
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = (
            (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        )
        self._host_header = parts.netloc.encode("idna")
        self._limit = limit
        self._connect_timeout_s = connect_timeout_s
        # Lists, not deques: a gateway holds a pool per unit, and an empty deque is
        # ten times an empty list (thousands of units); these stay short.
        self._idle: list[UnitConnection] = []
        self._open: set[UnitConnection] = set()
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False

    def head_bytes(
        self, method: bytes, path: str, headers: dict[str, str], length: int, own: bytes = b""
    ) -> bytes:
        first = (b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n"
                 % (method, path.encode(), self._host_header, length))  # fmt: skip
        # the fields as one text, encoded once (not a bytes object a field)
        fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
        return b"".join((first, fields.encode(), own, b"\r\n"))

    async def request(
        self,
        method: bytes,
        path: str,
        headers: dict[str, str],
        body: bytes = b"",
        own: bytes = b"",
    ) -> UnitConnection:
        """Send the request and wait for the response head; the caller reads the body
        and then calls ``done()`` (or ``close()``) on the connection it gets. ``own``:
        head lines written as they are (``name: value\\r\\n`` each, names not among
        ``headers``).

        A kept-alive connection the unit closed just as it was reused is replaced once by
        a new one: nothing of the request was answered on it."""
        data = self.head_bytes(method, path, headers, len(body), own) + body
        for _ in range(2):
            conn = await self._get()
            try:
                conn.send(data)
                head = conn._head
                assert head is not None
                if not head.done():
                    await head
                head.result()  # raises what the protocol failed with
                return conn
            except ConnectFailed:
                conn.close()
                if not conn.reused:
                    raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    async def _get(self) -> UnitConnection:
        while True:
            if self._closed:
                raise ConnectFailed("the gateway is closing")
            now = time.monotonic()
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed and now - conn.idle_since < IDLE_KEEP_S:
                    conn.reused = True
                    return conn
                conn.close()
            if len(self._open) < self._limit:
                return await self._connect()
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: pass the turn on
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    async def _connect(self) -> UnitConnection:
        conn = UnitConnection(self)
        self._open.add(conn)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await self.loop.create_connection(
                    lambda: conn,
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl else None,
                )
        except (OSError, TimeoutError) as exc:
            self.lost(conn)
            # No address in the message: it may reach a client (units go by their id).
            raise ConnectFailed(f"cannot connect: {_reason(exc)}") from exc
        except BaseException:
            conn.close()
            self.lost(conn)
            raise
        return conn

    def put(self, conn: UnitConnection) -> None:
        """A connection whose response was read to its end: keep it for the next."""
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        self._wake_one()

    def lost(self, conn: UnitConnection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            self._wake_one()
        if conn in self._idle:
            self._idle.remove(conn)

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._open):
            conn.close()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


def _reason(exc: BaseException) -> str:
    """Why a connect failed, without the address (an OSError's text names it)."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)  # asyncio's own text names the address
    return type(exc).__name__

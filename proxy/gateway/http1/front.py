"""The gateway's HTTP/1.1 listener: inference requests on a lean path, the rest to aiohttp.

Every connection starts here. A request head is parsed by httptools; a plain
``POST /v1/completions`` or ``/v1/chat/completions`` with a Content-Length body (the
requests a gateway lives on) is served on this connection without building request or
response objects: the body is handed to the forwarder, the unit's answer written back
in one write per read, SSE chunk-framed as it comes. Anything else (other routes and
methods, chunked or compressed bodies, ``Expect``, HTTP/1.0, no ``Host``, a head that
does not parse, a body over the limit, a header the error middleware refuses) hands the
connection, with every byte of that request, to aiohttp's request handler, which
serves it from then on: one set of rules for errors, auth and limits, written once.
An offer to switch protocols (``Upgrade: h2c`` or ``websocket``) is ignored on either
path: the gateway speaks HTTP/1.1 on this port and nothing else.

Requests are framed by Content-Length, so bytes of a next (pipelined) request are
never lost; they wait until the current response is written.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, Protocol, cast

import httptools

from proxy.errors import Unavailable, UnitProxyError
from proxy.gateway.request import HOP_BY_HOP, Context, http_context
from proxy.httputil import (
    FORM_TYPES,
    NO_UNIT,
    REQUEST_ID_HEADER,
    UNIT_HEADER,
    ClientClosed,
    bad_request_id,
)
from proxy.ingress import BODY_BUFFER_FULL, Guard, Limits, request_timeout_response
from proxy.timers import Timer

log = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024  # a longer head goes to aiohttp, which answers it with its limits
# Bytes of later requests buffered behind one being served before reading pauses (a
# head or two); all connections together hold about server.max_pipelined_bytes.
PIPELINE_KEEP = 64 * 1024
MAX_FIELD = 8190  # aiohttp's limits on a line and a header: past them it answers 400
MAX_HEADERS = 128
# Headers whose request aiohttp serves: a body to decode or to invite.
HANDOFF_HEADERS = frozenset({"transfer-encoding", "content-encoding", "expect"})


class Head:
    """A request the lean path serves. (A plain class, not a dataclass: mypyc compiles
    its ``__init__``, where a dataclass's stays interpreted.)"""

    __slots__ = ("ctx", "keep_alive", "length", "size")

    def __init__(
        self,
        ctx: Context,  # the request's context, built from its head
        length: int,  # of the body
        size: int,  # of the head, in bytes
        keep_alive: bool,
    ):
        self.ctx = ctx
        self.length = length
        self.size = size
        self.keep_alive = keep_alive


Serve = Callable[["Response", Head, bytes], Awaitable[None]]


class Producer(Protocol):
    """What a spliced stream reads from: paused while the client cannot take more."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class _Collect:
    """httptools callbacks: the URL and the headers, checked as they come (one pass;
    httptools calls ``on_header`` once per whole header)."""

    __slots__ = ("connection", "count", "headers", "refuse", "url")

    def __init__(self) -> None:
        self.url = b""
        # Every header but the hop-by-hop ones, by lower-case name (request.end_to_end).
        self.headers: dict[str, str] = {}
        self.connection = ""  # the Connection header: more hop-by-hop names
        self.count = 0
        self.refuse = False  # a header the lean path leaves to aiohttp

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.count += 1
        if len(name) + len(value) > MAX_FIELD:
            self.refuse = True
            return
        key = _NAMES.get(name)
        if key is None:
            key = name.decode("latin-1").lower()
        text = value.decode("utf-8", "surrogateescape")
        if key in HOP_BY_HOP:
            if key == "connection":
                self.connection = f"{self.connection},{text}" if self.connection else text
            elif key == "transfer-encoding":
                self.refuse = True
        elif key in self.headers or key in HANDOFF_HEADERS:
            self.refuse = True  # a repeated header: how to read it is aiohttp's to say
        else:
            self.headers[key] = text

    def end_to_end(self) -> dict[str, str]:
        """The headers, without those the Connection header names hop-by-hop."""
        headers = self.headers
        if self.connection:
            for token in self.connection.split(","):
                headers.pop(token.strip().lower(), None)
        return headers


# The lower-case names of headers clients send most, by their bytes as sent.
_NAMES = {
    spelling.encode(): name
    for name in ("host", "content-type", "content-length", "authorization", "accept",
                 "user-agent", "connection", "accept-encoding", REQUEST_ID_HEADER,
                 "x-unitproxy-timeout-ms", "x-unitproxy-priority", "traceparent")
    for spelling in (name, name.title())
}  # fmt: skip
_HTTP11 = b" HTTP/1.1"


def parse_head(raw: bytes, routes: dict[str, str], max_body: int) -> Head | None:
    """The request in ``raw`` (a whole head) if the lean path serves it, else None."""
    found = _Collect()
    parser = httptools.HttpRequestParser(found)
    try:
        parser.feed_data(raw)
    except httptools.HttpParserUpgrade:
        # An offer to switch protocols (Upgrade: h2c from curl --http2, websocket): the
        # gateway switches to none, and ignores it as RFC 9110 section 7.8 allows, serving
        # the request as HTTP/1.1 framed by its Content-Length. (httptools raises this
        # after the whole head; a CONNECT is no POST and goes to aiohttp below.)
        pass
    except httptools.HttpParserError:
        return None
    # The request line is valid (httptools said so): its version is its last word.
    if (
        found.refuse
        or parser.get_method() != b"POST"
        or not raw.startswith(_HTTP11, raw.find(b"\r\n") - len(_HTTP11))
    ):
        return None
    if len(found.url) > MAX_FIELD or found.count > MAX_HEADERS:
        return None
    path = found.url.split(b"?", 1)[0].decode("latin-1")
    route = routes.get(path)
    if route is None:
        return None
    headers = found.end_to_end()
    if "host" not in headers:
        return None  # HTTP/1.1 with no Host: aiohttp answers the 400 (RFC 9112 section 3.2)
    length = headers.get("content-length", "")
    if not (length.isascii() and length.isdigit()) or int(length) > max_body:
        return None
    content_type = headers.get("content-type")
    if content_type is not None and content_type.split(";", 1)[0].strip().lower() in FORM_TYPES:
        return None
    request_id = headers.get(REQUEST_ID_HEADER)
    if request_id is not None and bad_request_id(request_id) is not None:
        return None  # aiohttp answers it with the 400
    ctx = http_context(headers, route, path)
    return Head(ctx, int(length), len(raw), parser.should_keep_alive())


def _refusal_head(request_id: str) -> dict[str, str]:
    """The head of the gateway's own answer to a request no unit was tried for."""
    return {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id,
            UNIT_HEADER: NO_UNIT}  # fmt: skip


_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {reason}\r\n".encode()
    return line


def _head_bytes(
    status: int, headers: dict[str, str], framing: bytes, close: bool, more: str = ""
) -> bytes:
    parts = [_status_line(status)]
    if headers:  # one text, encoded once (not a bytes object a header)
        lines = [f"{name}: {value}" for name, value in headers.items()]
        lines.append(more)  # whole lines ("" ends the last header's)
        parts.append("\r\n".join(lines).encode())
    elif more:
        parts.append(more.encode())
    if close:
        parts.append(b"Connection: close\r\n")
    parts.append(framing)
    return b"".join(parts)


class Response:
    """The response to one lean-path request (a forward.Downstream)."""

    __slots__ = ("_close", "_conn", "_pending", "ended", "started", "status")

    def __init__(self, conn: ClientConnection, close: bool):
        self._conn = conn
        self._close = close
        self._pending = b""  # a streamed head, sent with the first chunk
        self.status = 0
        self.started = False
        self.ended = False

    def respond(self, status: int, headers: dict[str, str], body: bytes, lines: str = "") -> None:
        self.status = status
        self.ended = True
        framing = b"Content-Length: %d\r\n\r\n" % len(body)
        self._conn.send(_head_bytes(status, headers, framing, self._close, lines) + body)

    async def start(self, status: int, headers: dict[str, str], lines: str = "") -> None:
        self.status = status
        self._pending = _head_bytes(status, headers, b"Transfer-Encoding: chunked\r\n\r\n",
                                    self._close, lines)  # fmt: skip

    async def write(self, data: bytes) -> None:
        if not data:
            return
        chunk = b"%x\r\n%b\r\n" % (len(data), data)
        if not self.started:
            chunk = self._pending + chunk
            self.started = True
        await self._conn.send_and_drain(chunk)

    async def end(self) -> None:
        tail = b"0\r\n\r\n"
        if not self.started:
            tail = self._pending + tail
            self.started = True
        self.ended = True
        self._conn.producer = None
        await self._conn.send_and_drain(tail)

    def splice_writer(self, producer: Producer) -> Callable[[bytes], None]:
        """A plain function that writes a streamed chunk at once, called from the unit's
        protocol callback; while the client's buffer is full, ``producer`` is paused."""
        conn = self._conn
        conn.producer = producer
        if conn.write_paused:
            producer.pause_reading()  # the client's buffer is full already

        def write(data: bytes) -> None:
            if conn.closed or not data:
                return  # a client gone cancels the request's task; nothing to do here
            chunk = b"%x\r\n%b\r\n" % (len(data), data)
            if not self.started:
                chunk = self._pending + chunk
                self.started = True
            conn.transport.write(chunk)  # type: ignore[union-attr]

        return write


class Front:
    """The listener's shared parts; ``protocol()`` makes one ClientConnection per client."""

    def __init__(
        self,
        routes: dict[str, str],
        serve: Serve,
        fallback: Callable[[], asyncio.Protocol],
        max_body: int,
        limits: Limits,
        authorize: Callable[[Head], None] = lambda head: None,
    ):
        self.wheel = limits.wheel
        self.limits = limits
        self.routes = routes
        self.serve = serve
        self.fallback = fallback
        self.max_body = max_body
        self.authorize = authorize  # raises UnitProxyError, from the head alone
        self.connections: set[ClientConnection] = set()

    def protocol(self) -> ClientConnection:
        return ClientConnection(self)

    async def shutdown(self, timeout_s: float) -> None:
        """Close idle connections now; requests still running get ``timeout_s``."""
        for conn in list(self.connections):
            if conn.task is None:
                conn.close()
        running = [c.task for c in self.connections if c.task is not None]
        if running:
            await asyncio.wait(running, timeout=timeout_s)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            conn.close()


class ClientConnection(asyncio.Protocol):
    """One client connection on the lean path (until it is handed to aiohttp).

    Its read timer follows the phases of proxy/ingress.py: idle (keep-alive), head
    (from a head's first byte), body (from the head's end), none while a request is
    served; a write timer runs while the client's buffer is full.
    """

    def __init__(self, front: Front):
        self._front = front
        self._limits = front.limits
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._head: Head | None = None
        self.task: asyncio.Task[None] | None = None
        self._timer: Timer | None = None  # the read timer of the phase
        self._phase = "idle"
        self._idle_since = 0.0  # loop time the connection last went idle
        self._head_deadline = 0.0
        self._write_timer: Timer | None = None
        self._discard = 0  # body bytes still to drop after a refusal from the head
        self._held = 0  # bytes of the body coming in, held in the limits' body budget
        self._pipelined = 0  # bytes that came behind the request served, in the limits
        self._drained: asyncio.Future[None] | None = None
        self.write_paused = False
        self._read_paused = False
        self.producer: Producer | None = None  # a unit's stream spliced into this client
        self.closed = False
        self._counted = False
        self._client = ""  # its address, as the limits count it

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        client = self._limits.admit(transport)
        if client is None:
            self.closed = True
            return
        self._client = client
        self._counted = True
        self._front.connections.add(self)
        # A new connection must bring its first head within the head timeout, counted
        # from now: a socket that sends nothing holds a connection only that long.
        self._head_deadline = self._loop.time() + self._limits.head_timeout_s
        self._arm("new", self._limits.head_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self._discard:
            self._discard -= min(len(data), self._discard)
            if not self._discard:
                self.close()
            return
        self._buf += data
        if self.task is None:
            if self._head is not None and not self._hold(len(data)):
                return
            self._next()
        else:
            # Pipelined behind the request served: held until it is answered, within the
            # port's budget; reading pauses past a little (the kernel holds the rest).
            limits = self._limits
            self._pipelined += len(data)
            limits.pipelined += len(data)
            if self._pipelined > PIPELINE_KEEP or limits.pipelined > limits.pipeline_budget:
                self._pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._front.connections.discard(self)
        self._disarm()
        self._stop_write_timer()
        if self._counted:
            self._counted = False
            self._limits.release(self._client)
        self._free_body()  # gone while a body came
        self._free_pipelined()
        if self.task is not None:
            self.task.cancel()  # the client went away: the forwarder cancels upstream
        self._wake_writer()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._write_timer is None:
            self._write_timer = self._limits.after(self._limits.write_timeout_s, self._stalled)
        if self.producer is not None:
            self.producer.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._stop_write_timer()
        if self.producer is not None:
            self.producer.resume_reading()
        self._wake_writer()

    # -- timers ------------------------------------------------------------------------

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self._limits.after(max(seconds, 0.0), self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._front.wheel.cancel(self._timer)
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.closed:
            return
        if self._phase in ("idle", "serve"):
            # The keep-alive timer stays armed across requests (no cancel and re-arm per
            # request): when it fires it looks at when the connection last went idle.
            if self.task is not None:
                left = self._limits.keepalive_s  # serving: idle starts when it ends
            else:
                left = self._idle_since + self._limits.keepalive_s - self._loop.time()
            if left > 0:
                self._timer = self._limits.after(left, self._expired)
                return
        if self.task is not None:
            return
        if self._phase == "closing":
            pass  # answered already (a refusal from the head): just close
        elif self._phase == "new":
            self._limits.timed_out("head_timeout")  # not a byte came: nothing to answer
        elif self._phase == "idle":
            self._limits.timed_out("idle")
        else:
            self._limits.timed_out(f"{self._phase}_timeout")
            head = self._head  # the body's, in phase body; None: no whole head came
            request_id = None if head is None else head.ctx.request_id
            self.send(request_timeout_response(self._phase, self._limits.own_headers(request_id)))
        self.close()

    def _stalled(self) -> None:
        self._write_timer = None
        if self.transport is not None and not self.closed:
            self._limits.timed_out("write_timeout")
            self.transport.abort()  # close() would wait for the client to read

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._front.wheel.cancel(self._write_timer)
            self._write_timer = None

    # -- framing ---------------------------------------------------------------------

    def _next(self) -> None:
        """At a request boundary: serve the request in the buffer once it is whole."""
        buf = self._buf
        if not buf:
            return
        head = self._head
        if head is None:
            # The head and body timers are armed only when a request is not whole in
            # the bytes at hand (most come in one read): the idle timer covers it till then.
            if self._phase == "idle":
                self._head_deadline = self._loop.time() + self._limits.head_timeout_s
            end = buf.find(b"\r\n\r\n")
            bare = buf.find(b"\n\n")  # a head with bare LF line ends: aiohttp's to judge
            if (end < 0 and (bare >= 0 or len(buf) > MAX_HEAD)) or 0 <= bare < end:
                self._handoff()
                return
            if end < 0:
                if self._phase == "idle":
                    self._arm("head", self._limits.head_timeout_s)
                elif self._phase == "new":
                    self._phase = "head"  # its timer runs from the connect
                return
            head = parse_head(bytes(buf[: end + 4]), self._front.routes, self._front.max_body)
            if head is None:
                self._handoff()
                return
            if not self._authorized(head):
                return
            total = head.size + head.length
            if len(buf) < total:
                # The body is not whole: what came of it is held in the body budget, and
                # what comes, until it is (most requests come whole in one read).
                self._head = head
                if not self._hold(len(buf) - head.size):
                    return
                self._arm("body", self._limits.body_timeout_s)
                return
        else:
            total = head.size + head.length
            if len(buf) < total:
                return
        if self._phase != "idle":
            self._disarm()  # a head or body timer; the idle one stays (see _expired)
        self._free_body()
        self._phase = "serve"
        self._head = None
        if len(buf) == total:
            body = bytes(buf[head.size :])
            buf.clear()
        else:
            body = bytes(buf[head.size : total])
            del buf[:total]
            self._pipelined = len(buf)  # the next request's bytes, come already
            self._limits.pipelined += len(buf)
        limits = self._limits
        if limits.pipelined >= limits.pipeline_budget or self._pipelined > PIPELINE_KEEP:
            self._pause_reading()  # the port holds its share of later requests already
        self.task = self._loop.create_task(self._serve(head, body))

    def _authorized(self, head: Head) -> bool:
        """Check the head (the API key) before the body is read; refuse and close if not."""
        try:
            self._front.authorize(head)
        except UnitProxyError as exc:
            self._refuse(head, exc.http_status, exc.body())
            return False
        return True

    def _refuse(
        self, head: Head, status: int, error: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        """Answer from the head alone and close once the body is dropped."""
        headers = {**_refusal_head(head.ctx.request_id), **(headers or {})}
        Response(self, close=True).respond(status, headers, json.dumps(error).encode())
        # Drop the body as it comes (a close with unread bytes would reset the
        # connection before the client reads the answer), within the body timer.
        self._discard = head.size + head.length - len(self._buf)
        self._buf.clear()
        if self._discard <= 0:
            self._discard = 0
            self.close()
        else:
            self._arm("closing", self._limits.body_timeout_s)

    def _hold(self, size: int) -> bool:
        """Hold ``size`` more bytes of the body coming in (of ``self._head``); past the
        port's budget, answer 503 and close."""
        if self._limits.hold_body(size):
            self._held += size
            return True
        head = self._head
        assert head is not None
        self._free_body()
        self._head = None
        refusal = Unavailable(BODY_BUFFER_FULL, code="body_buffer_full")
        self._refuse(head, refusal.http_status, refusal.body(), {"Retry-After": "1"})
        return False

    def _free_body(self) -> None:
        if self._held:
            self._limits.free_body(self._held)
            self._held = 0

    def _free_pipelined(self) -> None:
        if self._pipelined:
            self._limits.pipelined -= self._pipelined
            self._pipelined = 0

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()

    async def _serve(self, head: Head, body: bytes) -> None:
        response = Response(self, close=not head.keep_alive)
        try:
            await self._front.serve(response, head, body)
        except (ClientClosed, asyncio.CancelledError):
            self.close()
        except Exception:
            ctx = head.ctx
            log.exception("request %s %s failed", ctx.path, ctx.request_id)
            if not response.started and not response.ended:
                error = json.dumps(UnitProxyError("internal error in the gateway").body())
                response.respond(500, _refusal_head(ctx.request_id), error.encode())
            else:
                self.close()
        finally:
            self.task = None
            self.producer = None
        if not response.ended or not head.keep_alive:
            self.close()  # a response cut short (the client must not read on), or asked for
        elif not self.closed:
            self._after()

    def _after(self) -> None:
        self._free_pipelined()  # the bytes buffered are the next request's now
        if self._read_paused and self.transport is not None:
            self._read_paused = False
            self.transport.resume_reading()
        self._phase = "idle"
        self._idle_since = self._loop.time()
        if self._timer is None:
            self._timer = self._limits.after(self._limits.keepalive_s, self._expired)
        if self._buf:
            self._next()

    def _handoff(self) -> None:
        """From here on aiohttp serves this connection, starting with the buffered bytes."""
        transport = self.transport
        assert transport is not None and self.task is None
        self._front.connections.discard(self)
        self._disarm()
        self._stop_write_timer()
        self._counted = False  # the guard counts it from here on
        self.closed = True  # this protocol's part is over
        guard = Guard(self._limits, self._front.fallback())
        transport.set_protocol(guard)
        guard.take_over(transport, self._client, self._head_deadline)
        data, self._buf = bytes(self._buf), bytearray()
        if self._read_paused:
            transport.resume_reading()
        if data:
            guard.data_received(data)

    # -- writing ---------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            raise ClientClosed()
        self.transport.write(data)

    async def send_and_drain(self, data: bytes) -> None:
        self.send(data)
        if self.write_paused:
            self._drained = self._loop.create_future()
            await self._drained
            if self.closed:
                raise ClientClosed()

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self._front.connections.discard(self)

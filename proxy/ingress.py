"""Limits on client connections, for every HTTP port (gateway and sidecar).

A client connection is always in one phase, and each phase has its own timer,
armed when the phase begins and dropped when it ends:

    new    from the connect to its first byte         head_timeout_s, then closed
    idle   between requests                           keepalive_timeout_s, then closed
    head   from the first byte of a head to its end  head_timeout_s, then 408 and closed
           (the first head: from the connect)
    body   from the end of the head to its last byte body_timeout_s, then 408 and closed
    serve  the request runs; no read timer

and, in any phase, a write timer that runs while the client's socket buffer is full
(the transport paused our writes) and stops when it drains: after write_timeout_s
the connection is aborted, which cancels the request's task, so the request ends and
its capacity slot is freed. At most max_connections are open; one more is answered
503 and closed at once. The bodies coming in (each from its head until it is whole)
hold at most max_body_buffer_bytes together: a request whose declared body would pass
it is answered 503 before its body is read, and the connection closes.

The gateway's lean path (proxy/gateway/http1/front.py) keeps these phases itself, since it
frames requests itself. A connection served by aiohttp runs under a ``Guard``: the
transport's protocol, in front of aiohttp's request handler; ``middleware`` tells the
guard when a request's head is parsed and reads its body under the body timer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
from http import HTTPStatus
from typing import cast

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.errors import (
    Overloaded,
    RequestTimeout,
    Unavailable,
    UnitProxyError,
    VersionNotSupported,
)
from proxy.httputil import (
    REQUEST_ID_HEADER,
    UNIT_HEADER,
    Handler,
    bad_request_id,
    new_request_id,
)
from proxy.metrics import IngressMetrics
from proxy.settings import ServerSettings
from proxy.timers import Timer, Wheel

log = logging.getLogger(__name__)


def error_response(error: UnitProxyError, *headers: str) -> bytes:
    """The whole HTTP/1.1 answer of ``error``, closing the connection; ``headers`` are
    more "Name: value" lines."""
    body = json.dumps(error.body()).encode()
    lines = [f"HTTP/1.1 {error.http_status} {HTTPStatus(error.http_status).phrase}",
             "Content-Type: application/json", *headers, "Connection: close",
             f"Content-Length: {len(body)}", "", ""]  # fmt: skip
    return "\r\n".join(lines).encode() + body


BODY_BUFFER_FULL = "request bodies under way fill the server's body buffer; retry"
BODY_BUFFER_REFUSAL = error_response(
    Unavailable(BODY_BUFFER_FULL, code="body_buffer_full"), "Retry-After: 1"
)
REFUSAL = error_response(
    Unavailable("too many client connections", code="max_connections"), "Retry-After: 1"
)
FD_REFUSAL = error_response(
    Unavailable("the server is out of file descriptors", code="fd_limit"), "Retry-After: 1"
)
CLIENT_REFUSAL = error_response(
    Overloaded("too many connections from this client address", code="max_client_connections"),
    "Retry-After: 1",
)
# File descriptors kept for the process's own use (listeners, Redis, probes, logs) beyond
# the open ones counted at start; a client connection takes up to two (its own, and one
# onward to a unit or an engine).
FD_HEADROOM = 64
# Connections the kernel queues before they are accepted (asyncio's default is 100, which
# a burst of clients overflows into SYN retries); capped by net.core.somaxconn.
LISTEN_BACKLOG = 1024


class Limits:
    """The limits of one HTTP port, its count of open connections, and its timers."""

    def __init__(
        self,
        server: ServerSettings,
        wheel: Wheel,
        metrics: IngressMetrics,
        role: str,
        unit: str | None = None,
    ):
        # The x-unitproxy-unit of the port's own answers to a request (a 408), which then
        # carry an x-request-id too; None: neither.
        self.unit = unit
        self.head_timeout_s = server.head_timeout_s
        self.body_timeout_s = server.body_timeout_s
        self.keepalive_s = server.keepalive_timeout_s
        self.write_timeout_s = server.write_timeout_s
        # The most connections the process's open-file limit leaves room for, and the
        # descriptor number past which a new connection is refused (the kernel gives the
        # lowest free one: a high one means the process is nearly out of them).
        self.fd_ceiling, self.max_connections = fit_to_fds(server.max_connections)
        self._fd_short = 0  # connections refused for descriptors; 0: none lately
        self.per_client = server.connections_per_client(role)  # 0: no cap
        self._clients: dict[str, int] = {}  # open connections by client address
        self._capped: set[str] = set()  # client addresses refused (and logged) at their cap
        self.body_budget = server.max_body_buffer_bytes
        self.body_held = 0  # bytes received of the bodies of the requests under way
        self.pipeline_budget = server.max_pipelined_bytes
        self.pipelined = 0  # bytes received behind requests being served
        self.wheel = wheel
        self.metrics = metrics
        metrics.body_buffer.set_function(lambda: self.body_held)  # read at scrape time
        metrics.pipelined.set_function(lambda: self.pipelined)
        self.open = 0
        self._refusing = 0  # connections refused since the cap was reached; 0: not at it
        self._loop = asyncio.get_running_loop()

    def own_headers(self, request_id: str | None) -> tuple[str, ...]:
        """The x-request-id and x-unitproxy-unit lines of the port's own answer to a
        request: the client's id if its head came with one that can be echoed, else a
        new one."""
        if self.unit is None:
            return ()
        if request_id is None or bad_request_id(request_id) is not None:
            request_id = new_request_id()
        return f"{REQUEST_ID_HEADER}: {request_id}", f"{UNIT_HEADER}: {self.unit}"

    def admit(self, transport: asyncio.BaseTransport) -> str | None:
        """Count a new connection in and return its client's address (for ``release``);
        at a cap, answer it (503 at max_connections, 429 at its client's cap), close it,
        and return None."""
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.fileno() >= self.fd_ceiling:
            # Near the open-file limit (RLIMIT_NOFILE): answered while a descriptor is
            # left, rather than reset when accept() finds none.
            if not self._fd_short:
                log.warning("file descriptor %d of %d in use: out of file descriptors "
                            "(RLIMIT_NOFILE), refusing new client connections",
                            sock.fileno(), self.fd_ceiling + FD_HEADROOM // 2)  # fmt: skip
            self._fd_short += 1
            self.metrics.closed.labels("fd_limit").inc()
            cast(asyncio.WriteTransport, transport).write(FD_REFUSAL)
            transport.close()
            return None
        if self._fd_short:
            log.warning("file descriptors free again; %d connections were refused",
                        self._fd_short)  # fmt: skip
            self._fd_short = 0
        if self.open >= self.max_connections:
            if not self._refusing:
                log.warning("%d client connections open (server.max_connections): refusing "
                            "new ones until some close", self.open)  # fmt: skip
            self._refusing += 1
            self.metrics.closed.labels("max_connections").inc()
            cast(asyncio.WriteTransport, transport).write(REFUSAL)
            transport.close()
            return None
        client = ""
        if self.per_client:
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            count = self._clients.get(client, 0)
            if count >= self.per_client:
                if client not in self._capped:
                    self._capped.add(client)
                    log.warning("%d connections open from %s "
                                "(server.max_connections_per_client): refusing more "
                                "from it (logged once while it has connections)",
                                count, client)  # fmt: skip
                self.metrics.closed.labels("max_client_connections").inc()
                cast(asyncio.WriteTransport, transport).write(CLIENT_REFUSAL)
                transport.close()
                return None
            self._clients[client] = count + 1
        self.open += 1
        self.metrics.connections.inc()
        return client

    def release(self, client: str) -> None:
        """A connection admitted for ``client`` (what ``admit`` returned) closed."""
        self.open -= 1
        self.metrics.connections.dec()
        if self.per_client:
            count = self._clients.pop(client, 1) - 1
            if count:
                self._clients[client] = count
            elif self._capped:
                self._capped.discard(client)  # logged again if it comes back to the cap
        if self._refusing and self.open < self.max_connections:
            log.warning("client connections below server.max_connections again; "
                        "%d were refused", self._refusing)  # fmt: skip
            self._refusing = 0

    def hold_body(self, size: int) -> bool:
        """Count in ``size`` bytes received of a body under way; False if the bodies held
        would pass max_body_buffer_bytes (the refusal is counted; the caller answers it).
        Bodies are counted by what arrived, never by what they declare: a client that
        announces a large body and sends it slowly holds only what it sent."""
        if self.body_held >= self.body_budget or self.body_held + size > self.body_budget:
            self.metrics.closed.labels("body_buffer").inc()
            return False
        self.body_held += size
        return True

    def free_body(self, size: int) -> None:
        self.body_held -= size

    def after(self, seconds: float, callback: object) -> Timer:
        return self.wheel.call_at(self._loop.time() + seconds, callback)  # type: ignore[arg-type]

    def timed_out(self, reason: str) -> None:
        self.metrics.closed.labels(reason).inc()


def raise_fd_limit() -> None:
    """At start: raise the soft limit on open files (RLIMIT_NOFILE) to the hard one, where
    the system lets it, so that server.max_connections fits (a connection is a file)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:  # macOS caps it below an infinite hard one
            log.info("cannot raise the open-file limit from %d to %d: %s", soft, want, exc)


def fit_to_fds(wanted: int) -> tuple[int, int]:
    """The descriptor number past which a new connection is refused, and the most of
    ``wanted`` client connections the open-file limit leaves room for (with a WARNING
    when that is fewer: the rest are answered 503, never reset)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 40, wanted
    in_use = _open_fds()
    room = (soft - in_use - FD_HEADROOM) // 2
    if wanted > room:
        fit = max(room, 1)
        log.warning("server.max_connections is %d, but this process may open %d files "
                    "(RLIMIT_NOFILE, hard limit %d; %d open now) and a client connection "
                    "takes up to 2: at most %d are served, more are answered 503; raise "
                    "the limit (ulimit -n, systemd LimitNOFILE=, docker --ulimit nofile=)",
                    wanted, soft, hard, in_use, fit)  # fmt: skip
        wanted = fit
    return soft - FD_HEADROOM // 2, wanted


def _open_fds() -> int:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


class Guard(asyncio.Protocol):
    """A client connection served by aiohttp, under the limits (see the module doc)."""

    def __init__(self, limits: Limits, handler: asyncio.Protocol):
        self._limits = limits
        self._handler = handler
        self._counted = False
        self._client = ""  # its address, as the limits count it
        self.transport: asyncio.Transport | None = None
        self._phase = "idle"  # idle, head, body, serve
        self._next_head_at = 0.0  # bytes of the next head came while a request was served
        self._read_timer: Timer | None = None
        self._write_timer: Timer | None = None
        self._held = 0  # bytes of the body coming in, held in the limits' body budget
        self._request_id: str | None = None  # of the request whose body is coming

    @property
    def limits(self) -> Limits:
        return self._limits

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        client = self._limits.admit(transport)
        if client is not None:
            self.take_over(transport, client, new=True)

    def take_over(
        self,
        transport: asyncio.BaseTransport,
        client: str,
        head_deadline: float | None = None,
        new: bool = False,
    ) -> None:
        """Serve ``transport``, counted in the limits already (for ``client``, the
        address ``Limits.admit`` gave); ``head_deadline``: the loop
        time by which the head under way must be whole (it began before a handoff);
        ``new``: a connection just accepted, which must bring its first head within the
        head timeout."""
        self._counted = True
        self._client = client
        self.transport = cast(asyncio.Transport, transport)
        self._handler.connection_made(transport)
        if new:
            self._phase = "new"
            self._set_read_timer(self._limits.head_timeout_s, self._head_expired)
        elif head_deadline is None:
            self._set_read_timer(self._limits.keepalive_s, self._idle_expired)
        else:
            self._phase = "head"
            left = head_deadline - asyncio.get_running_loop().time()
            self._set_read_timer(max(left, 0.0), self._head_expired)

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        if self._phase == "idle":
            self._phase = "head"
            self._set_read_timer(self._limits.head_timeout_s, self._head_expired)
        elif self._phase == "new":
            self._phase = "head"  # its timer runs from the connect
        elif self._phase == "serve" and not self._next_head_at:
            self._next_head_at = asyncio.get_running_loop().time()
        elif self._phase == "body" and not self._hold(len(data)):
            return
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received() if self._counted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._counted:
            return
        self._counted = False
        self._limits.release(self._client)
        self._free_body()
        self._set_read_timer(0, None)
        self._stop_write_timer()
        self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._write_timer is None and self._counted:
            self._write_timer = self._limits.after(self._limits.write_timeout_s, self._stalled)
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._stop_write_timer()
        self._handler.resume_writing()

    # -- phases, told by the middlewares -----------------------------------------------

    def head_done(self, has_body: bool, request_id: str | None = None) -> None:
        self._request_id = request_id
        if has_body:
            self._phase = "body"
            self._set_read_timer(self._limits.body_timeout_s, self._body_expired)
        else:
            self._phase = "serve"
            self._set_read_timer(0, None)

    def body_done(self) -> None:
        self._phase = "serve"
        self._free_body()
        self._set_read_timer(0, None)

    def refused(self) -> None:
        """Answered without reading the body (a bad API key): aiohttp reads and drops
        what comes; the connection closes when the body timer runs out."""
        self._free_body()
        self._phase = "closing"
        self._set_read_timer(self._limits.body_timeout_s, self._close_quietly)

    def request_done(self) -> None:
        if self._phase in ("body", "closing"):
            self.refused()
        elif self._next_head_at:
            self._phase = "head"
            left = self._next_head_at + self._limits.head_timeout_s
            self._set_read_timer(left - asyncio.get_running_loop().time(), self._head_expired)
        else:
            self._phase = "idle"
            self._set_read_timer(self._limits.keepalive_s, self._idle_expired)
        self._next_head_at = 0.0

    # -- the body budget ---------------------------------------------------------------

    def _hold(self, size: int) -> bool:
        """Hold ``size`` more bytes of the body coming in; past the port's budget, answer
        503 and close (aiohttp finds its body cut short)."""
        if self._limits.hold_body(size):
            self._held += size
            return True
        self._free_body()
        self._phase = "closing"
        self._set_read_timer(0, None)
        if self.transport is not None:
            self.transport.write(BODY_BUFFER_REFUSAL)
            self.transport.close()
        return False

    def _free_body(self) -> None:
        if self._held:
            self._limits.free_body(self._held)
            self._held = 0

    # -- timers ------------------------------------------------------------------------

    def _set_read_timer(self, seconds: float, callback: object | None) -> None:
        if self._read_timer is not None:
            self._limits.wheel.cancel(self._read_timer)
            self._read_timer = None
        if callback is not None:
            self._read_timer = self._limits.after(max(seconds, 0.0), callback)

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._limits.wheel.cancel(self._write_timer)
            self._write_timer = None

    def _idle_expired(self) -> None:
        self._read_timer = None
        if self._phase == "idle" and self.transport is not None:
            self._limits.timed_out("idle")
            self.transport.close()

    def _head_expired(self) -> None:
        self._read_timer = None
        if self._phase == "new" and self.transport is not None:
            self._limits.timed_out("head_timeout")  # not a byte came: nothing to answer
            self.transport.close()
        elif self._phase == "head" and self.transport is not None:
            self._limits.timed_out("head_timeout")
            own = self._limits.own_headers(None)
            self.transport.write(request_timeout_response("head", own))
            self.transport.close()

    def _body_expired(self) -> None:
        self._read_timer = None
        if self._phase == "body" and self.transport is not None:
            self._limits.timed_out("body_timeout")
            own = self._limits.own_headers(self._request_id)
            self.transport.write(request_timeout_response("body", own))
            self.transport.close()  # aiohttp would linger, reading the rest

    def _close_quietly(self) -> None:
        self._read_timer = None
        if self.transport is not None:
            self.transport.close()

    def _stalled(self) -> None:
        self._write_timer = None
        if self.transport is not None:
            self._limits.timed_out("write_timeout")
            self.transport.abort()  # close() would wait for the client to read


def request_timeout_response(phase: str, headers: tuple[str, ...] = ()) -> bytes:
    return error_response(RequestTimeout(f"the request {phase} took too long"), *headers)


def version_not_supported(request: web.Request) -> web.Response:
    """505 to a request line of HTTP/2.0 or 0.9 (the parser takes both), and close.
    Written here, since aiohttp's status line would echo the request's version; aiohttp
    then finds the connection closed, as if the client had left."""
    version = f"HTTP/{request.version.major}.{request.version.minor}"
    error = VersionNotSupported(f"{version} is not served here; send HTTP/1.1")
    transport = request.transport
    if transport is not None:
        transport.write(error_response(error))
        transport.close()
    return web.Response(status=error.http_status)


def guard_of(request: web.BaseRequest) -> Guard | None:
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, Guard) else None


def phase_middleware() -> Middleware:
    """Outermost: tells the connection's guard that a request's head is parsed (its
    timer stops) and when the request is done (the keep-alive timer starts)."""

    @web.middleware
    async def phases(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.version.major != 1:
            return version_not_supported(request)
        guard = guard_of(request)
        if guard is None:
            return await handler(request)
        guard.head_done(request.can_read_body, request.headers.get(REQUEST_ID_HEADER))
        try:
            return await handler(request)
        finally:
            guard.request_done()

    return phases


def body_middleware() -> Middleware:
    """After the API key check: read the whole body (the handler's ``request.read()``
    then returns it at once) under the guard's body timer, its bytes held in the port's
    body budget as they arrive (the guard counts them) until it is whole; a request
    that comes while the budget is full gets 503 from its head."""

    @web.middleware
    async def body(request: web.Request, handler: Handler) -> web.StreamResponse:
        guard = guard_of(request)
        if not request.can_read_body or guard is None:
            return await handler(request)
        if not guard.limits.hold_body(0):
            guard.refused()
            raise Unavailable(BODY_BUFFER_FULL, code="body_buffer_full")
        await request.read()
        guard.body_done()
        return await handler(request)

    return body

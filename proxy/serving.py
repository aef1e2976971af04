"""Running HTTP (aiohttp) and gRPC (grpc.aio) servers side by side in one event loop."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Protocol, Self

import grpc
from aiohttp import web

from proxy.broadcast import Broadcast
from proxy.httputil import quiet_bad_requests
from proxy.ingress import LISTEN_BACKLOG, Guard, Limits
from proxy.tls import ServerTLS

log = logging.getLogger(__name__)

GRPC_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
)


def os_error(exc: OSError) -> str:
    """'Address already in use', not uvloop's sentence around it."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


class ListenError(OSError):
    """A server port cannot be opened (in use, not allowed): said in one line at exit."""


async def start_http(
    stack: AsyncExitStack,
    app: web.Application,
    host: str,
    port: int,
    shutdown_timeout_s: float = 1.0,
    tls: ServerTLS | None = None,
    limits: Limits | None = None,
) -> int:
    """Serve ``app``; return the bound port. Cleanup is pushed onto ``stack``.

    At cleanup, requests still running get ``shutdown_timeout_s`` before they are
    cancelled (a graceful drain waits for them before that). With ``limits``, every
    connection runs under an ingress Guard (the app needs ingress.phase_middleware).
    """
    # handler_cancellation: a client that goes away cancels its handler, so the
    # engine request is aborted and the outstanding count drops.
    quiet_bad_requests()
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s
    )
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    ssl_context = None if tls is None else tls.ssl_context
    if limits is None:
        site = web.TCPSite(runner, host, port, reuse_address=True, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError as exc:
            raise ListenError(f"cannot listen on {host}:{port} (HTTP): {os_error(exc)}") from exc
        return int(runner.addresses[0][1])
    handler = runner.server
    assert handler is not None
    try:
        server = await asyncio.get_running_loop().create_server(
            lambda: Guard(limits, handler()),
            host,
            port,
            ssl=ssl_context,
            reuse_address=True,
            backlog=LISTEN_BACKLOG,
        )
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port} (HTTP): {os_error(exc)}") from exc
    stack.callback(server.close)  # runs before runner.cleanup, which ends the connections
    return int(server.sockets[0].getsockname()[1])


async def start_grpc(
    stack: AsyncExitStack,
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], None],
    grace_s: float = 1.0,
    tls: ServerTLS | None = None,
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    register(server)
    address = f"{_grpc_host(host)}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, tls.grpc_credentials)
    except RuntimeError as exc:  # grpcio says only "Failed to bind"
        bound = 0
        cause: BaseException | None = exc
    else:
        cause = None
    if bound == 0:
        raise ListenError(f"cannot listen on {address} (gRPC): in use or not allowed") from cause
    await server.start()
    stack.push_async_callback(server.stop, grace_s)
    return server, bound


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def advertised_host(host: str, advertise: str | None = None) -> str:
    """The address others should use to reach a server bound to ``host``."""
    if advertise:
        return f"[{advertise}]" if ":" in advertise and not advertise.startswith("[") else advertise
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


class Service(abc.ABC):
    """A server that builds itself in ``_start`` and owns what it opens in ``_stack``.

    ``async with`` starts it; leaving the block (or a failed start) closes everything
    it opened, in reverse order.
    """

    def __init__(self) -> None:
        self._stack = AsyncExitStack()

    @abc.abstractmethod
    async def _start(self) -> None: ...

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()


class Signals:
    """SIGINT and SIGTERM while the ``with`` block runs: the first asks to stop (``stop``
    is set, ``first`` says which signal), any later one to stop now (``hurry``)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.first: signal.Signals | None = None
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()

    def __enter__(self) -> Signals:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._received, sig)
        return self

    def __exit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.remove_signal_handler(sig)

    def _received(self, sig: signal.Signals) -> None:
        if self.first is None:
            self.first = sig
            self.stop.set()
        else:
            log.warning("received %s again: stopping now", sig.name)
            self.hurry.set()

    def name(self) -> str:
        """The first signal's name, for a log line."""
        return self.first.name if self.first is not None else "a signal"


async def wait_for_signal() -> signal.Signals:
    """Block until SIGINT or SIGTERM; return which."""
    with Signals() as signals:
        await signals.stop.wait()
    assert signals.first is not None
    return signals.first


class Drainable(Protocol):
    def start_drain(self) -> None: ...

    async def wait_drained(self) -> None:
        """Return once a drain has started and finished (or ran out of time)."""


class Drain:
    """A drain: once started, wait until nothing is in flight, at most ``timeout_s``."""

    def __init__(self, in_flight: Callable[[], int], changes: Broadcast, timeout_s: float):
        self._in_flight = in_flight
        self._changes = changes
        self._timeout_s = timeout_s
        self._started = asyncio.Event()
        self._deadline = 0.0

    @property
    def started(self) -> bool:
        return self._started.is_set()

    def start(self) -> bool:
        """Start the drain; False if it had started already."""
        if self._started.is_set():
            return False
        self._deadline = asyncio.get_running_loop().time() + self._timeout_s
        self._started.set()
        self._changes.notify()
        return True

    async def wait(self) -> None:
        await self._started.wait()
        loop = asyncio.get_running_loop()
        while (busy := self._in_flight()) > 0:
            seen = self._changes.version
            left = self._deadline - loop.time()
            if left <= 0:
                log.warning("drain timeout (%g s) passed with %d requests in flight",
                            self._timeout_s, busy)  # fmt: skip
                return
            await self._changes.wait(seen, left)


async def serve_until_drained(server: Drainable) -> int:
    """Serve until a drain finishes; return the exit status.

    The first SIGTERM (or SIGINT) starts a drain, as POST /admin/drain does; the
    server lets in-flight requests finish (up to its drain timeout). A second signal
    stops at once, with status 1.
    """
    with Signals() as signals:
        drained = asyncio.create_task(server.wait_drained())
        stop = asyncio.create_task(signals.stop.wait())
        tasks = [drained, stop]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if stop.done():
                log.info("received %s: draining (a second signal stops at once)", signals.name())
                server.start_drain()
                hurry = asyncio.create_task(signals.hurry.wait())
                tasks.append(hurry)
                await asyncio.wait({drained, hurry}, return_when=asyncio.FIRST_COMPLETED)
                if hurry.done():
                    stop_now = getattr(server, "stop_now", None)
                    if stop_now is not None:
                        stop_now()  # open responses end with an error, not a silent cut
                    return 1
        finally:
            await cancel_tasks([t for t in tasks if not t.done()])
    log.info("drained: stopping")
    return 0


CANCEL_AGAIN_S = 1.0  # a task still running this long after its cancel gets another


async def cancel_tasks(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait for them; one that lets a cancel go (a library that
    takes it for its own timeout, say) is cancelled again, so shutdown never hangs."""
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=CANCEL_AGAIN_S)
        for task in pending:
            log.warning("task %s still runs %g s after its cancel: cancelling it again",
                        task.get_name(), CANCEL_AGAIN_S)  # fmt: skip
            task.cancel()
    for task in tasks:  # their errors, as awaiting each would raise them
        with contextlib.suppress(asyncio.CancelledError):
            await task


def run_loop(main: Callable[[], Any]) -> Any:
    """Run ``main()`` (a coroutine function) on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())

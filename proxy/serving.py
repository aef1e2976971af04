"""Running HTTP (aiohttp) and gRPC (grpc.aio) servers side by side in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import grpc
from aiohttp import web

log = logging.getLogger(__name__)

GRPC_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
)


async def start_http(
    stack: AsyncExitStack,
    app: web.Application,
    host: str,
    port: int,
    shutdown_timeout_s: float = 1.0,
) -> int:
    """Serve ``app``; return the bound port. Cleanup is pushed onto ``stack``.

    At cleanup, requests still running get ``shutdown_timeout_s`` before they are
    cancelled (a graceful drain waits for them before that).
    """
    # handler_cancellation: a client that goes away cancels its handler, so the
    # engine request is aborted and the outstanding count drops.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s
    )
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return int(runner.addresses[0][1])


async def start_grpc(
    stack: AsyncExitStack,
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], None],
    grace_s: float = 1.0,
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    register(server)
    bound = server.add_insecure_port(f"{_grpc_host(host)}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    await server.start()
    stack.push_async_callback(server.stop, grace_s)
    return server, bound


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def advertised_host(host: str) -> str:
    """The address others should use to reach a server bound to ``host``."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


async def wait_for_signal() -> signal.Signals:
    """Block until SIGINT or SIGTERM; return which."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _resolve, received, sig)
    try:
        return await received
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _resolve(future: asyncio.Future[signal.Signals], sig: signal.Signals) -> None:
    if not future.done():
        future.set_result(sig)


async def cancel_tasks(tasks: Sequence[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


def run_loop(main: Callable[[], Any]) -> Any:
    """Run ``main()`` (a coroutine function) on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())

"""Probes: each makes exactly one call and raises ProbeFailed (or OSError) when unhealthy.

Timing, timeouts, jitter and thresholds belong to ``proxy.checks.Checker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proxy.checks import Probe, ProbeFailed

SERVING = health_pb2.HealthCheckResponse.SERVING


def tcp_probe(host: str, port: int) -> Probe:
    async def probe() -> None:
        _, writer = await asyncio.open_connection(host, port)
        writer.close()
        await writer.wait_closed()

    return probe


def http_probe(session: aiohttp.ClientSession, url: str) -> Probe:
    async def probe() -> None:
        try:
            async with session.get(url, allow_redirects=False) as resp:
                if not 200 <= resp.status < 300:
                    raise ProbeFailed(f"GET {url} answered {resp.status}")
        except aiohttp.ClientError as exc:
            raise ProbeFailed(f"GET {url}: {exc or type(exc).__name__}") from exc

    return probe


def grpc_health_probe(stub: health_pb2_grpc.HealthStub, service: str = "") -> Probe:
    async def probe() -> None:
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        except grpc.aio.AioRpcError as exc:
            raise ProbeFailed(
                f"health check: {exc.code().name} {exc.details() or ''}".strip()
            ) from exc
        if reply.status != SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            raise ProbeFailed(f"health check says {name}")

    return probe


def process_probe(pid: int) -> Probe:
    async def probe() -> None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError as exc:
            raise ProbeFailed(f"process {pid} is gone") from exc
        except PermissionError:
            return  # it exists; it belongs to someone else

    return probe


def command_probe(command: str) -> Probe:
    """Run ``command`` in a shell; exit status 0 is healthy. Killed when the check times out."""

    async def probe() -> None:
        proc = await asyncio.create_subprocess_shell(
            command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, err = await proc.communicate()
        except asyncio.CancelledError:
            _kill_group(proc.pid)
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise ProbeFailed(
                f"command exited with {proc.returncode}: {tail[0][:200]}".rstrip(": ")
            )

    return probe


def heartbeat_probe(path: Path, max_age_s: float, now: Callable[[], float] = time.time) -> Probe:
    """The file's modification time must be younger than ``max_age_s``."""

    async def probe() -> None:
        try:
            mtime = (await asyncio.to_thread(path.stat)).st_mtime
        except FileNotFoundError as exc:
            raise ProbeFailed(f"heartbeat file {path} does not exist") from exc
        age = now() - mtime
        if age > max_age_s:
            raise ProbeFailed(f"heartbeat file {path} is {age:.1f} s old (limit {max_age_s:g} s)")

    return probe


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)

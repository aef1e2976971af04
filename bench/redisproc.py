"""A redis-server of a bench's own, on a free loopback port, that the bench may stop
mid-run without touching any other Redis (``--save '' --appendonly no``: nothing on disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from bench.common import free_ports

START_TIMEOUT_S = 10.0


class RedisProcess:
    """One redis-server child; ``url`` to reach it, ``stop()`` to take it away."""

    def __init__(self, port: int, proc: asyncio.subprocess.Process):
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = proc

    async def stop(self) -> None:
        """SIGTERM (SIGKILL after 5 s); a second call does nothing."""
        if self.proc.returncode is not None:
            return
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()

    async def info(self, section: str) -> dict[str, Any]:
        """INFO ``section`` as key: value."""
        client = Redis.from_url(self.url, decode_responses=True)
        try:
            found = await client.info(section)
        finally:
            await client.aclose()
        return dict(found)


def why_not() -> str | None:
    """Why no redis-server can be started here (None: it can)."""
    return None if shutil.which("redis-server") else "redis-server is not on PATH"


@contextlib.asynccontextmanager
async def redis_server(log: Path) -> AsyncIterator[RedisProcess]:
    """A redis-server on a free port until the block ends."""
    (port,) = free_ports(1)
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", stdout=out, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    server = RedisProcess(port, proc)
    try:
        client = Redis.from_url(server.url)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    await client.ping()
                    break
                except (OSError, RedisConnectionError):
                    if proc.returncode is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start: see {log}") from None
                    await asyncio.sleep(0.05)
        finally:
            await client.aclose()
        yield server
    finally:
        await server.stop()

"""Shared fixtures: real servers on 127.0.0.1 with ephemeral ports, stopped after each test."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from proxy.gateway.server import Gateway
from proxy.resume import HintKey, ResumeHint
from proxy.settings import Settings, load
from proxy.sidecar.server import Sidecar
from tests.procs import RESUME_SECRET, BlackHole, Procs
from tests.redisenv import NO_REDIS, REDIS_URL

SidecarFactory = Callable[..., Awaitable[Sidecar]]


@dataclass(slots=True)
class Cell:
    """A sidecar and a gateway in front of it."""

    sidecar: Sidecar
    gateway: Gateway

    @property
    def url(self) -> str:
        return self.gateway.http_url


GatewayFactory = Callable[..., Awaitable[Gateway]]
BlackHoleFactory = Callable[[], Awaitable[BlackHole]]


def sidecar_settings(**sections: dict[str, Any]) -> Settings:
    """Settings for a test sidecar: loopback, free ports, fast health checks, fast sim."""
    base: dict[str, dict[str, Any]] = {
        "server": {
            "host": "127.0.0.1",
            "http_port": 0,
            "grpc_port": 0,
            "resume_secret": RESUME_SECRET,
        },
        "health": {"interval_s": 0.05, "timeout_s": 0.5},
        "engine": {
            "sim": {"decode_step_ms": 1.0, "decode_ms_per_seq": 0.0, "prefill_ms_per_token": 0.0}
        },
    }
    for name, values in sections.items():
        if name == "sim":
            base["engine"]["sim"].update(values)
        else:
            base.setdefault(name, {}).update(values)
    return load(base)


def signed_hint(delivered: str | list[int], created: int | None = None) -> str:
    """An ``x-unitproxy-resume`` value for ``delivered`` (text, or token ids), signed as
    the test fleet's gateways sign it."""
    if isinstance(delivered, str):
        hint = ResumeHint(created, delivered_chars=len(delivered))
    else:
        hint = ResumeHint(created, delivered_tokens=len(delivered))
    return HintKey(RESUME_SECRET).sign(hint, delivered)


async def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` every 10 ms; fail the test after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture
async def start_sidecar() -> AsyncIterator[SidecarFactory]:
    """Start sidecars in this test's loop; wait until SERVING; stop them afterwards."""
    running: list[Sidecar] = []

    async def start(serving: bool = True, **sections: dict[str, Any]) -> Sidecar:
        sidecar = Sidecar(sidecar_settings(**sections))
        await sidecar.__aenter__()
        running.append(sidecar)
        if serving:
            await wait_until(lambda: str(sidecar.health.state) == "SERVING", what="sidecar SERVING")
        return sidecar

    yield start
    for sidecar in reversed(running):
        await sidecar.__aexit__(None, None, None)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.fixture
async def procs(tmp_path: Path) -> AsyncIterator[Procs]:
    """Real unitproxy processes for this test; all stopped at its end."""
    started = Procs(tmp_path)
    try:
        yield started
    finally:
        await started.stop_all()


@pytest.fixture
async def start_gateway() -> AsyncIterator[GatewayFactory]:
    """Start gateways routing to the given sidecars; wait until each sees them all SERVING."""
    running: list[Gateway] = []

    async def start(sidecars: list[Sidecar], wait: bool = True, **gateway: Any) -> Gateway:
        units = [f"{s.core.unit_id}={s.http_url},{s.grpc_target}" for s in sidecars]
        settings = load(
            {
                "server": {
                    "host": "127.0.0.1",
                    "http_port": 0,
                    "grpc_port": 0,
                    "resume_secret": RESUME_SECRET,
                },
                "gateway": {"units": units, **gateway},
            }
        )
        gw = Gateway(settings)
        await gw.__aenter__()
        running.append(gw)
        if wait:
            await wait_until(
                lambda: len(gw.router.serving()) == len(sidecars), what="gateway sees units"
            )
        return gw

    yield start
    for gw in reversed(running):
        await gw.__aexit__(None, None, None)


# --- Redis: the server at REDIS_URL (tests/redisenv.py); skip, naming it, where none answers ---


@pytest.fixture
async def redis() -> AsyncIterator[Redis]:
    client = Redis.from_url(
        REDIS_URL, socket_timeout=2, socket_connect_timeout=2, decode_responses=True
    )
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        await client.aclose()
        pytest.skip(f"{NO_REDIS} ({REDIS_URL}: {exc})")
    yield client
    await client.aclose()


@pytest.fixture
async def cluster(redis: Redis) -> AsyncIterator[str]:
    """A cluster name of this test's own; its keys are deleted afterwards."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    keys = [k async for k in redis.scan_iter(match=f"unitproxy:{name}:*")]
    if keys:
        await redis.delete(*keys)


@pytest.fixture
async def black_hole() -> AsyncIterator[BlackHoleFactory]:
    """Started BlackHoles (TCP servers that accept and never write); every one closes,
    with each connection it accepted, when the test ends."""
    holes: list[BlackHole] = []

    async def start() -> BlackHole:
        hole = BlackHole()
        holes.append(hole)
        await hole.start()
        return hole

    yield start
    for hole in holes:
        await hole.close()

"""Load sharing through Redis (docs/api.md, Load report), against a real Redis server.

The tests use the Redis at ``UNITPROXY_TEST_REDIS_URL`` (default
redis://127.0.0.1:6379/0) and skip, saying how to get one, when none answers:
start one with ``redis-server --port 6379`` (Debian/Ubuntu: ``apt-get install
redis-server``). Each test works under its own random cluster name, so tests never
see each other's keys. The restart test starts and kills its own ``redis-server`` on
a free port, and skips when that binary is not on PATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from proxy import cli
from proxy.gateway.server import Gateway
from proxy.load import LoadReport, UnitState
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests.conftest import SidecarFactory, wait_until
from tests.procs import free_ports
from tests.redisenv import REDIS_URL, redis_section

pytestmark = pytest.mark.timeout(30)

SLOW_STREAM = {"prompt": "x", "max_tokens": 100_000, "stream": True}
SLOW_SIM = {"decode_step_ms": 20.0}  # long streams that cost little CPU

GatewayStarter = Callable[..., Awaitable[Gateway]]


class AheadClock:
    """The monotonic clock plus however far a test moved it on: time passes for the
    gateway's reports without the test sleeping through it."""

    def __init__(self) -> None:
        self.ahead_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead_s


# --- fixtures -------------------------------------------------------------------


@pytest.fixture
async def start_gateway_on_redis() -> AsyncIterator[GatewayStarter]:
    """Gateways with load_source redis and no configured unit; stopped afterwards."""
    async with AsyncExitStack() as stack:

        async def start(
            url: str, cluster: str, clock: Callable[[], float] = time.monotonic, **gateway: Any
        ) -> Gateway:
            settings = load(
                {
                    "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
                    "gateway": {
                        "load_source": "redis",
                        "discover_allow": ["http://127.0.0.1:*"],
                        **gateway,
                    },
                    "redis": redis_section(url, cluster),
                }
            )
            return await stack.enter_async_context(Gateway(settings, clock))

        yield start


async def start_unit(
    start_sidecar: SidecarFactory, unit_id: str, url: str, cluster: str, **sections: Any
) -> Sidecar:
    sidecar_values = {"unit_id": unit_id, "report_interval_s": 0.2, **sections.pop("sidecar", {})}
    return await start_sidecar(
        sidecar=sidecar_values, redis=redis_section(url, cluster), **sections
    )


async def next_report(
    pubsub: Any, predicate: Callable[[LoadReport], bool], timeout_s: float = 5.0
) -> LoadReport:
    """The next report on the channel that satisfies ``predicate``."""
    async with asyncio.timeout(timeout_s):
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
            if message is not None and message["type"] == "message":
                report = LoadReport.from_dict(json.loads(message["data"]))
                if predicate(report):
                    return report


async def open_stream(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    resp = await http.post(f"{url}/v1/completions", json=SLOW_STREAM)
    assert resp.status == 200, await resp.text()
    await resp.content.readline()
    return resp


# --- settings -------------------------------------------------------------------


def test_redis_flags_and_bad_url(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["gateway", "--redis-url", "redis://h:1/2", "--redis-cluster", "blue"])
    settings = load(cli.cli_values(args))
    assert (settings.redis.url, settings.redis.cluster) == ("redis://h:1/2", "blue")
    for command in ("sidecar", "follower"):  # every role takes it
        args = parser.parse_args([command, "--redis-url", "redis://h:1/2"])
        assert load(cli.cli_values(args)).redis.url == "redis://h:1/2"
    assert (
        cli.main(
            [
                "gateway",
                "--load-source",
                "redis",
                "--redis-url",
                "http://h:1",
                "--discover-allow",
                "http://h:*",
            ]
        )
        == 2
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "redis.url" in lines[0] and "redis://" in lines[0]


# --- sidecar --------------------------------------------------------------------


async def test_sidecar_publishes_key_set_and_channel_on_change(
    redis: Redis, cluster: str, start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    async with redis.pubsub() as pubsub:
        await pubsub.subscribe(f"unitproxy:{cluster}:load")
        # A long interval: a report within a fraction of it comes from the change.
        sidecar = await start_unit(
            start_sidecar, "a", REDIS_URL, cluster, sidecar={"report_interval_s": 1.0}
        )
        key = f"unitproxy:{cluster}:unit:a"
        serving = await next_report(pubsub, lambda r: r.state is UnitState.SERVING)
        assert (serving.http_url, serving.grpc_target) == (sidecar.http_url, sidecar.grpc_target)
        stored = LoadReport.from_dict(json.loads(await redis.get(key)))
        assert stored.unit_id == "a" and stored.capacity == sidecar.core.capacity
        assert 0 < await redis.pttl(key) <= 3000  # 3 report intervals
        assert await redis.smembers(f"unitproxy:{cluster}:units") == {"a"}

        started = time.monotonic()
        resp = await open_stream(http, sidecar.http_url)
        await next_report(pubsub, lambda r: r.outstanding == 1)
        resp.close()
        await next_report(pubsub, lambda r: r.outstanding == 0)
        sidecar.start_drain()
        draining = await next_report(pubsub, lambda r: r.state is UnitState.DRAINING)
        assert time.monotonic() - started < 0.9, "changes wait for the heartbeat"
        # No change now: the heartbeat still comes, at least once per interval.
        heartbeat = await next_report(pubsub, lambda r: r.seq > draining.seq, timeout_s=2.0)
        assert heartbeat.state is UnitState.DRAINING


async def test_sidecar_stopping_publishes_its_last_state(
    redis: Redis, cluster: str, start_sidecar: SidecarFactory
) -> None:
    sidecar = await start_unit(start_sidecar, "a", REDIS_URL, cluster)
    key = f"unitproxy:{cluster}:unit:a"
    await wait_until(lambda: sidecar.publisher is not None and sidecar.publisher.published > 1)
    await sidecar.__aexit__(None, None, None)
    final = LoadReport.from_dict(json.loads(await redis.get(key)))
    assert final.state is UnitState.DRAINING and final.outstanding == 0


# --- gateway --------------------------------------------------------------------


async def test_gateway_discovers_units_in_redis_and_routes(
    redis: Redis,
    cluster: str,
    start_sidecar: SidecarFactory,
    start_gateway_on_redis: GatewayStarter,
    http: aiohttp.ClientSession,
) -> None:
    a = await start_unit(start_sidecar, "a", REDIS_URL, cluster)
    b = await start_unit(start_sidecar, "b", REDIS_URL, cluster)
    gw = await start_gateway_on_redis(REDIS_URL, cluster)
    assert gw.settings.gateway.units == []
    await wait_until(lambda: len(gw.router.serving()) == 2, what="gateway discovers a and b")

    seen = set()
    async with openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0) as oa:
        for _ in range(20):
            raw = await oa.completions.with_raw_response.create(
                model="unitproxy-sim", prompt="abc", max_tokens=2
            )
            assert raw.parse().choices[0].finish_reason == "length"
            seen.add(raw.headers["x-unitproxy-unit"])
        assert seen == {"a", "b"}
        chat = await oa.chat.completions.create(
            model="unitproxy-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.choices[0].message.content

    async with http.get(f"{gw.http_url}/units") as resp:
        units = {u["id"]: u for u in (await resp.json())["units"]}
    assert units["a"]["http_url"] == a.http_url and units["b"]["grpc_target"] == b.grpc_target

    # A unit that stops says so on its way out: no request goes there from then on.
    await b.__aexit__(None, None, None)
    await wait_until(lambda: gw.router.units["b"].state is UnitState.DRAINING)
    async with openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0) as oa:
        for _ in range(5):
            raw = await oa.completions.with_raw_response.create(
                model="unitproxy-sim", prompt="abc", max_tokens=2
            )
            assert raw.headers["x-unitproxy-unit"] == "a"
    assert a.core.outstanding == 0


@pytest.mark.slow
async def test_two_gateways_keep_units_balanced(
    redis: Redis,
    cluster: str,
    start_sidecar: SidecarFactory,
    start_gateway_on_redis: GatewayStarter,
    http: aiohttp.ClientSession,
) -> None:
    a = await start_unit(start_sidecar, "a", REDIS_URL, cluster, sim=SLOW_SIM)
    b = await start_unit(start_sidecar, "b", REDIS_URL, cluster, sim=SLOW_SIM)
    gateways = [await start_gateway_on_redis(REDIS_URL, cluster) for _ in range(2)]
    for gw in gateways:
        await wait_until(lambda gw=gw: len(gw.router.serving()) == 2, what="both units")
    held = [await open_stream(http, a.http_url) for _ in range(6)]  # a starts ahead
    for gw in gateways:
        await wait_until(lambda gw=gw: gw.router.units["a"].estimate() == 6, what="a's load")
    try:
        for _ in range(9):  # both gateways at once, each round
            held += await asyncio.gather(*(open_stream(http, gw.http_url) for gw in gateways))
        outstanding = {"a": a.core.outstanding, "b": b.core.outstanding}
        assert sum(outstanding.values()) == 24
        assert abs(outstanding["a"] - outstanding["b"]) <= 2, outstanding
        # Each gateway's view agrees with what the units report.
        for gw in gateways:
            await wait_until(
                lambda gw=gw: gw.router.units["b"].estimate() == b.core.outstanding,
                what="the gateway's view of b",
            )
    finally:
        for resp in held:
            resp.close()
    await wait_until(lambda: a.core.outstanding == b.core.outstanding == 0, what="all closed")


# --- Redis down and back --------------------------------------------------------


class RedisServer:
    """A redis-server of the test's own, on a fixed port, that can be killed and restarted."""

    def __init__(self, port: int):
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        client = Redis.from_url(self.url, socket_connect_timeout=0.2)
        try:
            async with asyncio.timeout(10):
                while True:
                    with contextlib.suppress(RedisError, OSError):
                        if await client.ping():
                            return
                    await asyncio.sleep(0.02)
        finally:
            await client.aclose()

    async def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()


@pytest.fixture
async def own_redis() -> AsyncIterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip(
            "needs the redis-server binary on PATH to stop and restart a Redis of its own "
            "(Debian/Ubuntu: apt-get install redis-server)"
        )
    server = RedisServer(free_ports(1)[0])
    await server.start()
    try:
        yield server
    finally:
        await server.kill()


@pytest.mark.slow
async def test_redis_restart_sidecar_serves_gateway_routes_both_reconnect(
    own_redis: RedisServer,
    start_sidecar: SidecarFactory,
    start_gateway_on_redis: GatewayStarter,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "proxy.redis_reports")
    url, cluster = own_redis.url, "restart"
    a = await start_unit(start_sidecar, "a", url, cluster, sim=SLOW_SIM)
    clock = AheadClock()
    gw = await start_gateway_on_redis(url, cluster, clock, stale_after_s=0.6)
    await wait_until(lambda: len(gw.router.serving()) == 1, what="gateway discovers a")
    source = gw.redis_source
    assert source is not None and source.connects == 1

    await own_redis.kill()
    await wait_until(lambda: gw.router.aging_paused, what="gateway notices Redis is gone")
    clock.ahead_s += 1.5  # well past stale_after_s: the last report must still count

    def retried(who: str) -> bool:
        return sum(who in r.getMessage() and "still unreachable" in r.getMessage()
                   for r in caplog.records) >= 2  # fmt: skip

    await wait_until(lambda: retried("gateway load source") and retried("report publisher"),
                     what="both sides retry Redis")  # fmt: skip
    async with http.post(
        f"{a.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}
    ) as r:
        assert r.status == 200  # the sidecar serves
    async with http.post(
        f"{gw.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}
    ) as r:
        assert r.status == 200 and r.headers["x-unitproxy-unit"] == "a"  # the gateway routes
    before = gw.router.units["a"].report
    assert before is not None
    outages = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and "unreachable" in r.getMessage()
    ]
    assert len(outages) == 2, [r.getMessage() for r in outages]  # once each, not per attempt

    await own_redis.start()  # empty: no key survived
    await wait_until(lambda: source.connects == 2 and not gw.router.aging_paused,
                     what="gateway reconnects")  # fmt: skip
    # The sidecar republishes and a new change reaches the gateway through Redis.
    resp = await open_stream(http, a.http_url)
    try:
        await wait_until(
            lambda: (
                (r := gw.router.units["a"].report) is not None
                and r.seq > before.seq
                and r.outstanding == 1
            ),
            what="a new report through the restarted Redis",
        )
    finally:
        resp.close()
    client = Redis.from_url(url, decode_responses=True)
    try:
        assert await client.smembers(f"unitproxy:{cluster}:units") == {"a"}
        assert await client.pttl(f"unitproxy:{cluster}:unit:a") > 0
    finally:
        await client.aclose()
    backs = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(backs) == 2
    await wait_until(lambda: a.core.outstanding == 0, what="the stream closed")

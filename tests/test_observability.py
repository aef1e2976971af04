"""What operators see: a dead or unreachable unit at the gateway, honest series."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine.sim import SimEngine
from proxy.errors import EngineError
from proxy.gateway.server import Gateway
from proxy.settings import Settings, load
from proxy.sidecar.server import INFERENCE_SERVICE, Sidecar
from tests.conftest import GatewayFactory, SidecarFactory, sidecar_settings, wait_until
from tests.procs import free_ports

pytestmark = pytest.mark.timeout(30)


async def units(http: aiohttp.ClientSession, gw: Gateway) -> dict[str, dict[str, object]]:
    async with http.get(f"{gw.http_url}/units") as resp:
        return {u["id"]: u for u in (await resp.json())["units"]}


def sample(gw: Gateway, name: str, **labels: str) -> float | None:
    return gw.registry.get_sample_value(name, labels)


async def test_a_dead_unit_is_lost_with_its_reason_and_its_report_age_grows(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    gw = await start_gateway([a, b])
    assert sample(gw, "unitproxy_gateway_unit_state", unit="b", state="SERVING") == 1
    assert sample(gw, "unitproxy_unit_load", unit="b") == 0
    await b.__aexit__(None, None, None)

    async def b_is_refused() -> bool:
        return (await units(http, gw))["b"]["reason"] == "connection refused"

    async with asyncio.timeout(10):
        while not await b_is_refused():
            await asyncio.sleep(0.02)
    first = (await units(http, gw))["b"]
    await asyncio.sleep(0.6)  # the gauges refresh every 0.5 s
    later = (await units(http, gw))["b"]
    assert first["state"] == later["state"] == "LOST"
    assert isinstance(first["report_age_s"], float) and isinstance(later["report_age_s"], float)
    assert later["report_age_s"] > first["report_age_s"] > 0
    age = sample(gw, "unitproxy_load_report_age_seconds", unit="b")
    assert age is not None and age > 0.3
    assert sample(gw, "unitproxy_gateway_unit_state", unit="b", state="LOST") == 1
    assert sample(gw, "unitproxy_gateway_unit_state", unit="b", state="SERVING") == 0
    assert sample(gw, "unitproxy_unit_load", unit="b") is None  # not "idle"
    assert (await units(http, gw))["a"]["state"] == "SERVING"
    async with http.get(f"{gw.http_url}/ready") as resp:
        assert (await resp.json())["units"] == {"SERVING": 1, "LOST": 1}


async def test_a_unit_never_reached_is_unknown_and_logged_once(
    caplog: pytest.LogCaptureFixture, http: aiohttp.ClientSession
) -> None:
    http_port, grpc_port = free_ports(2)  # nothing listens there
    settings = load(
        {
            "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
            "gateway": {
                "units": [f"ghost=http://127.0.0.1:{http_port},127.0.0.1:{grpc_port}"],
                "stale_after_s": 0.5,  # the grace a unit gets to start listening
            },
        }
    )
    caplog.set_level(logging.INFO, logger="proxy.gateway.router")
    async with Gateway(settings) as gw:
        assert sample(gw, "unitproxy_gateway_unit_state", unit="ghost", state="UNKNOWN") == 1
        assert sample(gw, "unitproxy_load_report_age_seconds", unit="ghost") == -1
        await wait_until(lambda: gw.router.units["ghost"].lost is not None, what="a failure")

        def ghost_lines() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "ghost" in r.getMessage()]

        # the WARNING comes with the first reconnect that fails after the grace (backoff
        # with jitter: when, depends on the draws), then nothing more however many fail
        await wait_until(
            lambda: any(r.levelname == "WARNING" for r in ghost_lines()), 10, "the WARNING"
        )
        await asyncio.sleep(1.0)  # several reconnects more, with backoff
        ghost = (await units(http, gw))["ghost"]
    assert ghost["state"] == "UNKNOWN" and ghost["reason"] == "connection refused"
    assert ghost["capacity"] == 0 and ghost["report_age_s"] is None
    lines = ghost_lines()
    # INFO while it may still be starting, one WARNING once the grace passed: not a line
    # per reconnect.
    assert [r.levelname for r in lines] == ["INFO", "WARNING"], lines
    assert all("connection refused" in r.getMessage() for r in lines)


class SlowLoadingSim(SimEngine):
    """The simulator with a model load that lasts until the test lets it finish."""

    def __init__(self, settings: Settings, loaded: asyncio.Event, fail: bool = False) -> None:
        super().__init__(settings.engine.sim)
        self._loaded = loaded
        self._fail = fail

    async def start(self) -> None:
        await self._loaded.wait()
        if self._fail:
            raise EngineError("weights not found")
        await super().start()


async def test_the_sidecar_answers_probes_and_metrics_while_its_engine_loads(
    http: aiohttp.ClientSession,
) -> None:
    settings = sidecar_settings(sidecar={"unit_id": "slow"})
    loaded = asyncio.Event()
    sidecar = Sidecar(settings, engine=SlowLoadingSim(settings, loaded))
    entering = asyncio.create_task(sidecar.__aenter__())
    try:
        await wait_until(lambda: bool(sidecar.http_url), what="ports open")
        await asyncio.sleep(1.2)  # the load's time so far is shown each second
        async with http.get(f"{sidecar.http_url}/ready") as resp:
            assert resp.status == 503
            ready = await resp.json()
        assert ready["state"] == "STARTING"
        leader = ready["nodes"][0]
        assert leader["name"] == "leader" and leader["healthy"] is False
        assert leader["reason"] == "engine loading (1 s so far)", leader
        async with http.get(f"{sidecar.http_url}/metrics") as resp:
            assert resp.status == 200
            assert 'unitproxy_unit_state{state="STARTING"} 1.0' in await resp.text()
        async with http.get(f"{sidecar.http_url}/health") as resp:
            assert resp.status == 200
        body = {"prompt": "x", "max_tokens": 1}
        async with http.post(f"{sidecar.http_url}/v1/completions", json=body) as resp:
            assert resp.status == 503
        async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            answer = await check(health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE))
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not entering.done()
        loaded.set()
        await entering
        await wait_until(lambda: str(sidecar.health.state) == "SERVING", what="SERVING")
    finally:
        loaded.set()
        if not entering.done():
            with contextlib.suppress(Exception):
                await entering
        await sidecar.__aexit__(None, None, None)


async def test_an_engine_that_fails_to_load_fails_the_start_and_closes_the_ports() -> None:
    settings = sidecar_settings(sidecar={"unit_id": "broken"})
    loaded = asyncio.Event()
    sidecar = Sidecar(settings, engine=SlowLoadingSim(settings, loaded, fail=True))
    entering = asyncio.create_task(sidecar.__aenter__())
    await wait_until(lambda: bool(sidecar.http_url), what="ports open")
    port = int(sidecar.http_url.rsplit(":", 1)[1])
    loaded.set()
    with pytest.raises(EngineError, match="weights not found"):
        await entering
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_known_series_start_at_zero_and_each_role_exports_only_its_own(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    gw = await start_gateway([a])

    async def families(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                found.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return found

    unit, gateway = await families(a.http_url), await families(gw.http_url)
    for seen in (unit, gateway):
        requests = seen["unitproxy_requests_total"]
        assert requests[(("code", "503"), ("route", "chat"))] == 0
        assert requests[(("code", "UNAVAILABLE"), ("route", "grpc_generate"))] == 0
        assert seen["unitproxy_time_to_first_token_seconds_count"][(("route", "chat"),)] == 0
    transitions = unit["unitproxy_health_transitions_total"]
    assert transitions[(("node", "leader"), ("to", "unhealthy"))] == 0
    assert transitions[(("node", "leader"), ("to", "healthy"))] == 1  # it came up
    assert gateway["unitproxy_retries_total"][(("reason", "503"),)] == 0
    assert gateway["unitproxy_retries_total"][(("reason", "unavailable"),)] == 0
    assert gateway["unitproxy_routed_requests_total"][(("unit", "a"),)] == 0
    # Tokens are counted where they are made: the gateway would only export zeros.
    assert "unitproxy_generated_tokens_total" in unit
    assert "unitproxy_inter_token_latency_seconds_count" in unit
    assert "unitproxy_generated_tokens_total" not in gateway
    assert "unitproxy_inter_token_latency_seconds_count" not in gateway
    assert "unitproxy_gateway_unit_state" not in unit and "unitproxy_unit_state" not in gateway


async def test_a_known_route_with_the_wrong_method_is_405_with_allow(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    gw = await start_gateway([a])
    for base in (a.http_url, gw.http_url):
        # an API route: as vLLM's server (FastAPI) answers it
        for method, path, allow in (("GET", "/v1/chat/completions", "POST"),
                                    ("DELETE", "/v1/embeddings", "POST"),
                                    ("PUT", "/tokenize", "POST"),
                                    ("POST", "/v1/models", "GET"),
                                    ("HEAD", "/v1/models", "GET")):  # fmt: skip
            async with http.request(method, f"{base}{path}") as resp:
                assert resp.status == 405 and resp.headers["allow"] == allow
                assert resp.headers["content-type"] == "application/json"
                body = b"" if method == "HEAD" else b'{"detail":"Method Not Allowed"}'
                assert await resp.read() == body
                assert resp.headers["x-unitproxy-unit"] in ("a", "none")
        # a path of unitproxy's own keeps its error body
        async with http.get(f"{base}/admin/drain") as resp:
            assert resp.status == 405 and resp.headers["allow"] == "POST"
            assert (await resp.json())["error"]["code"] == "method_not_allowed"
        async with http.get(f"{base}/v1/nothing") as resp:
            assert resp.status == 404


async def test_the_sidecar_exports_its_engines_prefix_cache(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    system = "the assistant answers every question in plain words " * 30
    for question in ("why is the sky blue", "why is the sea blue"):
        body = {"model": "unitproxy-sim", "prompt": system + question, "max_tokens": 2}
        async with http.post(f"{a.http_url}/v1/completions", json=body) as resp:
            assert resp.status == 200
    async with http.get(f"{a.http_url}/metrics") as resp:
        text = await resp.text()
    found = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    queries = found["unitproxy_engine_prefix_cache_queries_total"]
    hits = found["unitproxy_engine_prefix_cache_hits_total"]
    assert 0 < hits < queries / 2  # the second prompt found most of itself cached
    assert found["unitproxy_engine_prefix_cache_hit_rate"] == hits / queries

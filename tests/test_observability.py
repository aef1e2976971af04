"""What operators see: a dead or unreachable unit at the gateway, honest series."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from proxy.gateway.server import Gateway
from proxy.settings import load
from tests.conftest import GatewayFactory, SidecarFactory, wait_until
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
            "gateway": {"units": [f"ghost=http://127.0.0.1:{http_port},127.0.0.1:{grpc_port}"]},
        }
    )
    caplog.set_level(logging.WARNING, logger="proxy.gateway.router")
    async with Gateway(settings) as gw:
        assert sample(gw, "unitproxy_gateway_unit_state", unit="ghost", state="UNKNOWN") == 1
        assert sample(gw, "unitproxy_load_report_age_seconds", unit="ghost") == -1
        await wait_until(lambda: gw.router.units["ghost"].lost is not None, what="a failure")
        await asyncio.sleep(1.0)  # several reconnects, with backoff
        ghost = (await units(http, gw))["ghost"]
    assert ghost["state"] == "UNKNOWN" and ghost["reason"] == "connection refused"
    assert ghost["capacity"] == 0 and ghost["report_age_s"] is None
    lines = [r.getMessage() for r in caplog.records if "ghost" in r.getMessage()]
    assert len(lines) == 1 and "connection refused" in lines[0], lines

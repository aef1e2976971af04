"""Drain and rolling restarts with real processes: nothing in flight is lost."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.procs import Proc, Procs, free_ports

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

SIM = (
    "--sim-decode-step-ms",
    "5",
    "--sim-decode-ms-per-seq",
    "0",
    "--sim-prefill-ms-per-token",
    "0",
)


async def stream(http: aiohttp.ClientSession, url: str, tokens: int) -> tuple[int, int, bool]:
    """One streaming completion: (status, token events, ended with [DONE])."""
    body = {"prompt": "x", "max_tokens": tokens, "stream": True}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, 0, False
        events = [line async for line in resp.content if line.startswith(b"data: ")]
    done = events[-1] == b"data: [DONE]\n"
    return 200, len(events) - 1 if done else len(events), done


async def ready(http: aiohttp.ClientSession, proc: Proc) -> tuple[int, dict[str, object]]:
    async with http.get(f"{proc.http_url}/ready") as resp:
        return resp.status, await resp.json()


async def started_streaming(
    http: aiohttp.ClientSession, url: str, tokens: int
) -> asyncio.Task[tuple[int, int, bool]]:
    task = asyncio.create_task(stream(http, url, tokens))
    await asyncio.sleep(0.3)  # it is surely admitted and streaming by now
    assert not task.done()
    return task


async def test_sidecar_drains_on_sigterm(procs: Procs) -> None:
    sidecar = await procs.sidecar(*free_ports(2), *SIM)
    async with aiohttp.ClientSession() as http:
        in_flight = await started_streaming(http, sidecar.http_url, 300)  # ~1.5 s of tokens
        sidecar.signal(signal.SIGTERM)
        await asyncio.sleep(0.1)
        status, body = await ready(http, sidecar)
        assert (status, body["state"]) == (503, "DRAINING")
        async with http.post(f"{sidecar.http_url}/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "draining"
        async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await in_flight == (200, 300, True), "the stream in flight finished whole"
    assert await sidecar.wait(10) == 0


@pytest.mark.parametrize("role", ["sidecar", "gateway"])
async def test_admin_drain_with_token_then_exit(
    procs: Procs, role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNITPROXY_SERVER__ADMIN_TOKEN", "s3cret-token")
    sc_http, sc_grpc, gw_http, gw_grpc = free_ports(4)
    sidecar = await procs.sidecar(sc_http, sc_grpc, *SIM)
    target = sidecar
    if role == "gateway":
        target = await procs.gateway(
            gw_http, gw_grpc, "--unit", f"u=http://127.0.0.1:{sc_http},127.0.0.1:{sc_grpc}"
        )
    url = f"{target.http_url}/admin/drain"
    async with aiohttp.ClientSession() as http:
        in_flight = await started_streaming(http, target.http_url, 200)
        async with http.post(url) as resp:
            assert resp.status == 401
        async with http.post(url, headers={"Authorization": "Bearer wrong"}) as resp:
            assert resp.status == 403
        assert (await ready(http, target))[0] == 200, "refused drains changed nothing"
        async with http.post(url, headers={"Authorization": "Bearer s3cret-token"}) as resp:
            assert resp.status == 202
            assert (await resp.json())["state"] == "DRAINING"
        async with http.post(f"{target.http_url}/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
        assert await in_flight == (200, 200, True)
    assert await target.wait(10) == 0
    assert "s3cret-token" not in target.output(), "no secret in logs"


async def test_rolling_restart_under_load_loses_no_request(procs: Procs) -> None:
    ports = free_ports(6)
    units = [(ports[0], ports[1]), (ports[2], ports[3])]
    sidecars = [
        await procs.sidecar(h, g, "--unit-id", f"u{i}", *SIM) for i, (h, g) in enumerate(units)
    ]
    unit_flags = [
        f
        for i, (h, g) in enumerate(units)
        for f in ("--unit", f"u{i}=http://127.0.0.1:{h},127.0.0.1:{g}")
    ]
    gateway = await procs.gateway(ports[4], ports[5], *unit_flags)
    results: Counter[str] = Counter()
    stop = asyncio.Event()

    async with aiohttp.ClientSession() as http:

        async def client() -> None:
            while not stop.is_set():
                status, events, done = await stream(http, gateway.http_url, 40)
                results[
                    "ok"
                    if (status, events, done) == (200, 40, True)
                    else f"bad {status} {events} {done}"
                ] += 1

        async def units_serving() -> int:
            async with http.get(f"{gateway.http_url}/units") as resp:
                return sum(u["state"] == "SERVING" for u in (await resp.json())["units"])

        clients = [asyncio.create_task(client()) for _ in range(6)]
        for i, (h, g) in enumerate(units):
            await asyncio.sleep(0.5)
            sidecars[i].signal(signal.SIGTERM)
            assert await sidecars[i].wait(30) == 0
            sidecars[i] = await procs.sidecar(h, g, "--unit-id", f"u{i}", *SIM)
            async with asyncio.timeout(20):
                while await units_serving() < 2:
                    await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 30)
        async with http.get(f"{gateway.http_url}/metrics") as resp:
            metrics = await resp.text()
    assert set(results) == {"ok"}, results
    assert results["ok"] > 20
    print(
        json.dumps(results),
        [line for line in metrics.splitlines() if line.startswith("unitproxy_retries_total")],
    )

"""A failed unit lets go of its requests: every wire ends them at once with unit_failed."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import aiohttp
import grpc
import pytest

from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.sidecar.server import Sidecar
from tests.conftest import SidecarFactory, wait_until
from tests.procs import Procs, free_ports

pytestmark = pytest.mark.timeout(30)

LONG = 100_000  # max_tokens of a request that is still running when the unit fails


async def open_stream(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """A streamed completion that has delivered its first token."""
    body = {"prompt": "the long story", "max_tokens": LONG, "stream": True}
    resp = await http.post(f"{url}/v1/completions", json=body)
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data: {")
    return resp


async def rest_of_stream(resp: aiohttp.ClientResponse) -> list[bytes]:
    async with resp:
        return [line.strip() async for line in resp.content if line.startswith(b"data: ")]


def assert_unit_failed_event(events: list[bytes]) -> None:
    assert events, "the stream ended without an event"
    assert events[-1] != b"data: [DONE]"
    assert b"data: [DONE]" not in events
    error = json.loads(events[-1][6:])["error"]
    assert error["code"] == "unit_failed", error
    assert error["type"] == "unit_failed"


async def first_grpc_chunk(
    stub: inference_pb2_grpc.InferenceStub,
) -> grpc.aio.UnaryStreamCall[Any, inference_pb2.GenerateChunk]:
    call = stub.Generate(
        inference_pb2.GenerateRequest(
            prompt="a grpc story", sampling=inference_pb2.SamplingParams(max_tokens=LONG)
        ),
        timeout=20,
    )
    first = await call.read()
    assert isinstance(first, inference_pb2.GenerateChunk) and first.token_ids
    return call


async def grpc_status(call: grpc.aio.UnaryStreamCall[Any, Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while await call.read() is not grpc.aio.EOF:
            pass
    return info.value.code()


async def test_stalled_unit_lets_go_of_every_request_on_every_wire(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    # The third request hangs the engine; the watchdog makes the unit NOT_SERVING.
    sidecar = await start_sidecar(
        sim={"hang_after_requests": 3}, health={"stall_timeout_s": 0.3, "unhealthy_threshold": 1}
    )
    url = sidecar.http_url
    streamed = await open_stream(http, url)
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        call = await first_grpc_chunk(inference_pb2_grpc.InferenceStub(channel))
        whole = asyncio.create_task(
            http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 5})
        )
        await wait_until(lambda: sidecar.core.outstanding == 3, what="3 requests admitted")
        hung_at = time.monotonic()
        events, code = await asyncio.gather(rest_of_stream(streamed), grpc_status(call))
        ended_after = time.monotonic() - hung_at
        assert code == grpc.StatusCode.UNAVAILABLE
    assert_unit_failed_event(events)
    async with await whole as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "unit_failed"
    assert str(sidecar.health.state) == "NOT_SERVING"
    # The stall timeout (0.3 s) plus a probe or two (slack for a loaded machine): not a hang.
    assert ended_after < 5.0
    assert sidecar.core.outstanding == 0
    assert sidecar.engine.stats().running == 0, "aborted in the engine"


async def test_follower_killed_ends_streams_at_once(
    start_sidecar: SidecarFactory, procs: Procs, http: aiohttp.ClientSession
) -> None:
    follower = await procs.follower("--node-name", "f1")
    sidecar = await start_sidecar(
        sidecar={"followers": [f"f1={follower.grpc_target}"], "probe": "grpc-watch"}
    )
    streamed = await open_stream(http, sidecar.http_url)
    follower.signal(signal.SIGKILL)
    started = time.monotonic()
    async with asyncio.timeout(10):
        events = await rest_of_stream(streamed)
    assert time.monotonic() - started < 5.0  # at once (a broken watch), with slack for load
    assert_unit_failed_event(events)
    assert "f1" in json.loads(events[-1][6:])["error"]["message"]
    assert sidecar.core.outstanding == 0


async def test_engine_dead_under_a_request_is_a_unit_failure(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sim={"crash_after_requests": 2})
    streamed = await open_stream(http, sidecar.http_url)
    async with http.post(f"{sidecar.http_url}/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 503  # the request that crashed the engine: before its first byte
        assert (await resp.json())["error"]["code"] == "unit_failed"
    assert_unit_failed_event(await rest_of_stream(streamed))
    assert sidecar.core.outstanding == 0


async def test_drain_lets_requests_finish(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar()
    body = {"prompt": "x", "max_tokens": 300, "stream": True}
    async with http.post(f"{sidecar.http_url}/v1/completions", json=body) as resp:
        await resp.content.readline()
        sidecar.start_drain()
        events = [line.strip() async for line in resp.content if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]", "a drain is no unit failure"
    assert sidecar.core.outstanding == 0


async def test_stopping_sidecar_ends_open_streams_with_unit_failed(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar: Sidecar = await start_sidecar()
    streamed = await open_stream(http, sidecar.http_url)
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        call = await first_grpc_chunk(inference_pb2_grpc.InferenceStub(channel))
        stopping = asyncio.create_task(sidecar.__aexit__(None, None, None))
        events, code = await asyncio.gather(rest_of_stream(streamed), grpc_status(call))
        await stopping
    assert_unit_failed_event(events)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert sidecar.core.outstanding == 0


@pytest.mark.slow
async def test_second_sigterm_ends_streams_with_unit_failed(procs: Procs) -> None:
    sidecar = await procs.sidecar(*free_ports(2), "--sim-decode-step-ms", "2")
    async with aiohttp.ClientSession() as http:
        streamed = await open_stream(http, sidecar.http_url)
        async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
            call = await first_grpc_chunk(inference_pb2_grpc.InferenceStub(channel))
            sidecar.signal(signal.SIGTERM)
            async with aiohttp.ClientSession() as probe:
                await wait_until_draining(probe, sidecar.http_url)
            sidecar.signal(signal.SIGTERM)
            events, code = await asyncio.gather(rest_of_stream(streamed), grpc_status(call))
        assert await sidecar.wait(10) == 1
    assert_unit_failed_event(events)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "stopping" in json.loads(events[-1][6:])["error"]["message"]


async def wait_until_draining(http: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(5):
        while True:
            async with http.get(f"{url}/ready") as resp:
                if (await resp.json())["state"] == "DRAINING":
                    return
            await asyncio.sleep(0.02)

"""A unit that fails under a request: the gateway continues it on another unit.

Real sidecars and gateways on loopback; the units fail the ways units fail (engine
stopped, process killed, process stopped). What the client reads must be one whole
response: no error event, the same id throughout, one [DONE].
"""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import aiohttp
import grpc
import pytest

from proxy.gateway.router import Outcome
from proxy.gateway.server import Gateway
from proxy.load import UnitState
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests.conftest import GatewayFactory, SidecarFactory, wait_until
from tests.procs import Procs, free_ports

SLOW_SIM = {"decode_step_ms": 5.0}  # about 200 tokens/s: a stream that lasts


def sample(gw: Gateway, name: str, **labels: str) -> float:
    return gw.registry.get_sample_value(name, labels) or 0.0


async def read_events(resp: aiohttp.ClientResponse, n: int) -> list[bytes]:
    """The first ``n`` SSE data lines of ``resp``."""
    events: list[bytes] = []
    while len(events) < n:
        line = await resp.content.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: "):
            events.append(line[6:].strip())
    return events


async def rest_of(resp: aiohttp.ClientResponse) -> list[bytes]:
    async with asyncio.timeout(20):
        return [line[6:].strip() async for line in resp.content if line.startswith(b"data: ")]


def chat_text(events: list[bytes]) -> str:
    parts = []
    for event in events:
        if event == b"[DONE]":
            continue
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


async def unfailed(
    http: aiohttp.ClientSession, sidecar: Sidecar | str, path: str, body: dict[str, Any]
) -> dict[str, Any]:
    """The same request, not streamed, from a unit that does not fail: the reference."""
    url = sidecar if isinstance(sidecar, str) else sidecar.http_url
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    async with http.post(f"{url}{path}", json=plain) as resp:
        assert resp.status == 200
        answer: dict[str, Any] = await resp.json()
        return answer


def sidecar_of(resp: aiohttp.ClientResponse, *sidecars: Sidecar) -> Sidecar:
    unit = resp.headers["x-unitproxy-unit"]
    return next(s for s in sidecars if s.core.unit_id == unit)


async def two_units(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, **gateway: Any
) -> tuple[Sidecar, Sidecar, Gateway]:
    a = await start_sidecar(sidecar={"unit_id": "a"}, sim=SLOW_SIM)
    b = await start_sidecar(sidecar={"unit_id": "b"}, sim=SLOW_SIM)
    return a, b, await start_gateway([a, b], **gateway)


CHAT = {
    "messages": [{"role": "user", "content": "tell me a story"}],
    "max_tokens": 200,
    "stream": True,
    "stream_options": {"include_usage": True},
}


async def test_a_stream_goes_on_when_its_unit_stops(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a, b, gw = await two_units(start_sidecar, start_gateway)
    resp = await http.post(f"{gw.http_url}/v1/chat/completions", json=CHAT)
    assert resp.status == 200
    first = await read_events(resp, 20)
    failing = sidecar_of(resp, a, b)
    await failing.engine.stop()  # the engine dies under the request
    events = first + await rest_of(resp)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}, "one response, one id"
    assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 200
    survivor = b if failing is a else a
    reference = await unfailed(http, survivor, "/v1/chat/completions", CHAT)
    assert chat_text(events) == reference["choices"][0]["message"]["content"]
    assert usage == reference["usage"]
    assert sample(gw, "unitproxy_migrations_total", reason="unit_failed") == 1
    assert sample(gw, "unitproxy_migration_pause_seconds_count") == 1
    assert sample(gw, "unitproxy_requests_total", route="chat", code="200") == 1
    await wait_until(lambda: a.core.outstanding == b.core.outstanding == 0, what="all released")


def eject(gw: Gateway, unit_id: str) -> None:
    """Passive health ejects the unit: one failure with eject_after 1."""
    unit = gw.router.units[unit_id]
    unit.inflight += 1  # the failed request's own count, as the core would hold it
    gw.router.release(unit, Outcome.FAILED)
    assert gw.router.stopped(unit) == "ejected"


async def test_a_stream_leaves_its_unit_once_ejected_and_a_draining_one_keeps_it(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    # The unit still streams: only the router's verdict moves the request, within a
    # tick, not at the 60 s idle timeout (rest_of gives up after 20 s).
    a, b, gw = await two_units(start_sidecar, start_gateway, eject_after=1)
    resp = await http.post(f"{gw.http_url}/v1/chat/completions", json=CHAT)
    first = await read_events(resp, 20)
    left = sidecar_of(resp, a, b)
    eject(gw, left.core.unit_id)
    events = first + await rest_of(resp)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}, "one response, one id"
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert sample(gw, "unitproxy_migrations_total", reason="unit_lost") == 1
    assert gw.router.units[left.core.unit_id].failures == 0, "leaving is not a failure"
    # A draining unit finishes what it holds: nothing moves.
    survivor = b if left is a else a
    resp = await http.post(f"{gw.http_url}/v1/chat/completions", json=CHAT)
    first = await read_events(resp, 5)
    assert resp.headers["x-unitproxy-unit"] == survivor.core.unit_id
    survivor.start_drain()
    unit = gw.router.units[survivor.core.unit_id]
    await wait_until(lambda: unit.state is UnitState.DRAINING, what="the gateway sees DRAINING")
    events = first + await rest_of(resp)
    assert events[-1] == b"[DONE]"
    assert sample(gw, "unitproxy_migrations_total", reason="unit_lost") == 1
    await wait_until(lambda: a.core.outstanding == b.core.outstanding == 0, what="all released")


@pytest.mark.parametrize("wire", ["http", "grpc"])
async def test_a_grpc_stream_leaves_its_unit_once_ejected(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, wire: str
) -> None:
    a, b, gw = await two_units(start_sidecar, start_gateway, eject_after=1, grpc_unit_wire=wire)
    request = inference_pb2.GenerateRequest(
        prompt="tell me a story", sampling=inference_pb2.SamplingParams(max_tokens=200)
    )
    chunks: list[inference_pb2.GenerateChunk] = []
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=20)
        async for chunk in call:
            chunks.append(chunk)
            if len(chunks) == 5:
                eject(gw, chunk.unit_id)
    assert sum(len(c.token_ids) for c in chunks) == 200
    assert chunks[-1].usage.completion_tokens == 200
    assert len({c.unit_id for c in chunks}) == 2, "continued on the other unit"
    assert sample(gw, "unitproxy_migrations_total", reason="unit_lost") == 1
    await wait_until(lambda: a.core.outstanding == b.core.outstanding == 0, what="all released")


async def test_a_completion_goes_on_token_for_token(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a, b, gw = await two_units(start_sidecar, start_gateway)
    body = {"prompt": "Once upon a time", "max_tokens": 150, "stream": True}
    resp = await http.post(f"{gw.http_url}/v1/completions", json=body)
    first = await read_events(resp, 30)
    failing = sidecar_of(resp, a, b)
    await failing.engine.stop()
    events = first + await rest_of(resp)
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    reference = await unfailed(http, b if failing is a else a, "/v1/completions", body)
    assert text == reference["choices"][0]["text"]


async def test_a_non_streamed_request_is_answered_by_another_unit(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a, b, gw = await two_units(start_sidecar, start_gateway)
    body = {"prompt": "x", "max_tokens": 100}
    task = asyncio.create_task(http.post(f"{gw.http_url}/v1/completions", json=body))
    await wait_until(lambda: a.core.outstanding + b.core.outstanding == 1, what="admitted")
    failing = a if a.core.outstanding else b
    await asyncio.sleep(0.05)
    await failing.engine.stop()
    resp = await task
    assert resp.status == 200
    answer = await resp.json()
    assert answer["usage"]["completion_tokens"] == 100
    assert resp.headers["x-unitproxy-unit"] != failing.core.unit_id
    assert sample(gw, "unitproxy_migrations_total", reason="unit_failed") == 1


async def test_no_unit_left_ends_the_stream_with_an_error_event(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, sim=SLOW_SIM)
    gw = await start_gateway([a])
    resp = await http.post(f"{gw.http_url}/v1/chat/completions", json=CHAT)
    await read_events(resp, 3)
    await a.engine.stop()
    events = await rest_of(resp)
    error = json.loads(events[-1])["error"]
    assert error["code"] == "unit_failed"
    assert b"127.0.0.1" not in events[-1], "errors name units by id, not address"
    assert sample(gw, "unitproxy_requests_total", route="chat", code="503") == 1
    assert sample(gw, "unitproxy_requests_total", route="chat", code="200") == 0
    assert sample(gw, "unitproxy_migrations_total", reason="unit_failed") == 0, "none happened"


async def test_a_gateway_without_the_resume_secret_moves_no_started_stream(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    # Its units would refuse its hints (it cannot sign them): the stream ends with the
    # unit's error, as with no unit left, instead of a refused resume.
    a = await start_sidecar(sidecar={"unit_id": "a"}, sim=SLOW_SIM)
    b = await start_sidecar(sidecar={"unit_id": "b"}, sim=SLOW_SIM)
    units = [f"{s.core.unit_id}={s.http_url},{s.grpc_target}" for s in (a, b)]
    settings = load({"server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
                     "gateway": {"units": units}})  # fmt: skip
    async with Gateway(settings) as gw:
        await wait_until(lambda: len(gw.router.serving()) == 2, what="both units SERVING")
        resp = await http.post(f"{gw.http_url}/v1/chat/completions", json=CHAT)
        await read_events(resp, 3)
        await sidecar_of(resp, a, b).engine.stop()
        events = await rest_of(resp)
        assert json.loads(events[-1])["error"]["code"] == "unit_failed"
        assert sample(gw, "unitproxy_migrations_total", reason="unit_failed") == 0
        assert sample(gw, "unitproxy_requests_total", route="chat", code="503") == 1
        resp.release()


async def test_a_client_may_opt_out_of_migration(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a, b, gw = await two_units(start_sidecar, start_gateway)
    resp = await http.post(
        f"{gw.http_url}/v1/chat/completions", json=CHAT, headers={"x-unitproxy-migrate": "0"}
    )
    await read_events(resp, 3)
    await sidecar_of(resp, a, b).engine.stop()
    events = await rest_of(resp)
    assert json.loads(events[-1])["error"]["code"] == "unit_failed"
    assert sample(gw, "unitproxy_migrations_total", reason="unit_failed") == 0


async def test_grpc_stream_goes_on_when_its_unit_stops(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    a, b, gw = await two_units(start_sidecar, start_gateway)
    request = inference_pb2.GenerateRequest(
        request_id="g1",
        chat=inference_pb2.ChatMessages(
            messages=[inference_pb2.ChatMessage(role="user", content="tell me a story")]
        ),
        sampling=inference_pb2.SamplingParams(max_tokens=200),
    )
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(request, timeout=20)
        chunks = []
        failing = a
        async for chunk in call:
            chunks.append(chunk)
            if len(chunks) == 10:
                failing = a if a.core.outstanding else b
                await failing.engine.stop()
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 200
    assert sum(len(c.token_ids) for c in chunks) == 200
    async with grpc.aio.insecure_channel((b if failing is a else a).grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        reference = [c async for c in stub.Generate(request, timeout=20)]
    assert "".join(c.text for c in chunks) == "".join(c.text for c in reference)
    assert [t for c in chunks for t in c.token_ids] == [t for c in reference for t in c.token_ids]
    assert chunks[-1].usage == reference[-1].usage
    assert {c.request_id for c in chunks} == {"g1"}
    assert sample(gw, "unitproxy_migrations_total", reason="unit_failed") == 1
    assert sample(gw, "unitproxy_requests_total", route="grpc_generate", code="OK") == 1


async def test_grpc_call_cancelled_by_its_client_counts_cancelled(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    a, b, gw = await two_units(start_sidecar, start_gateway)
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(inference_pb2.GenerateRequest(prompt="x"), timeout=20)
        await call.read()
        call.cancel()
    await wait_until(
        lambda: (
            sample(gw, "unitproxy_requests_total", route="grpc_generate", code="CANCELLED") == 1
        ),
        what="CANCELLED counted",
    )
    assert sample(gw, "unitproxy_requests_total", route="grpc_generate", code="OK") == 0
    await wait_until(lambda: a.core.outstanding == b.core.outstanding == 0, what="all released")


# --- real processes ----------------------------------------------------------------------


async def cell(
    procs: Procs, units: int, *gateway_args: str, sidecar_args: tuple[str, ...] = ()
) -> tuple[list[Any], Any]:
    ports = free_ports(2 * units + 2)
    sidecars = [
        await procs.sidecar(
            ports[2 * i], ports[2 * i + 1], "--unit-id", f"u{i}", "--sim-decode-step-ms", "5",
            *sidecar_args,
        )
        for i in range(units)
    ]  # fmt: skip
    unit_flags = [
        arg
        for i, s in enumerate(sidecars)
        for arg in ("--unit", f"u{i}={s.http_url},{s.grpc_target}")
    ]
    gateway = await procs.gateway(ports[-2], ports[-1], *unit_flags, *gateway_args)
    return sidecars, gateway


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_a_killed_or_silent_unit_is_invisible_to_the_client(
    procs: Procs, http: aiohttp.ClientSession, how: str
) -> None:
    sidecars, gateway = await cell(procs, 2, "--stream-idle-timeout", "0.5")
    resp = await http.post(f"{gateway.http_url}/v1/chat/completions", json=CHAT)
    first = await read_events(resp, 10)
    victim = sidecars[int(resp.headers["x-unitproxy-unit"][1:])]
    victim.signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    events = first + await rest_of(resp)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    async with http.get(f"{gateway.http_url}/metrics") as metrics:
        text = await metrics.text()
    reason = "broken" if how == "kill" else "idle"
    assert f'unitproxy_migrations_total{{reason="{reason}"}} 1.0' in text


@pytest.mark.slow
async def test_a_non_streamed_request_on_a_killed_unit_is_migrated_not_retried(
    procs: Procs, http: aiohttp.ClientSession
) -> None:
    # The unit had taken the request (it answers a non-streamed one only when done) and
    # died under it: a migration, though nothing of the answer had gone out.
    sidecars, gateway = await cell(procs, 2)
    body = {"prompt": "tell me a story", "max_tokens": 400}
    task = asyncio.create_task(http.post(f"{gateway.http_url}/v1/completions", json=body))

    async def running() -> Any:
        while True:
            for sidecar in sidecars:
                async with http.get(f"{sidecar.http_url}/load") as resp:
                    if (await resp.json())["outstanding"]:
                        return sidecar
            await asyncio.sleep(0.02)

    victim = await asyncio.wait_for(running(), 10)
    victim.signal(signal.SIGKILL)
    resp = await task
    assert resp.status == 200
    assert (await resp.json())["usage"]["completion_tokens"] == 400
    async with http.get(f"{gateway.http_url}/metrics") as metrics:
        text = await metrics.text()
    assert 'unitproxy_migrations_total{reason="broken"} 1.0' in text
    assert 'unitproxy_retries_total{reason="connect"} 0.0' in text


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_a_killed_or_silent_unit_is_invisible_to_a_grpc_client(
    procs: Procs, http: aiohttp.ClientSession, how: str
) -> None:
    # The gateway's leg to the unit is HTTP (gRPC-Web framing): a connection lost and a
    # unit gone silent read as they do for SSE.
    sidecars, gateway = await cell(procs, 2, "--stream-idle-timeout", "0.5")
    request = inference_pb2.GenerateRequest(
        prompt="tell me a story", sampling=inference_pb2.SamplingParams(max_tokens=200)
    )
    chunks: list[inference_pb2.GenerateChunk] = []
    async with grpc.aio.insecure_channel(gateway.grpc_target) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=20)
        async for chunk in call:
            chunks.append(chunk)
            if len(chunks) == 5:
                victim = sidecars[int(chunk.unit_id[1:])]
                victim.signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    assert sum(len(c.token_ids) for c in chunks) == 200
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 200
    assert len({c.unit_id for c in chunks}) == 2, "continued on the other unit"
    async with http.get(f"{gateway.http_url}/metrics") as metrics:
        text = await metrics.text()
    reason = "broken" if how == "kill" else "idle"
    assert f'unitproxy_migrations_total{{reason="{reason}"}} 1.0' in text


# Reports every 0.2 s, LOST after 1 s without one; streams idle out only after the
# default 60 s. A stopped unit's streams must move once it shows LOST, not at 60 s.
QUICK_LOSS = ("--stale-after", "1")
QUICK_REPORTS = ("--report-interval", "0.2")


async def metrics_of(http: aiohttp.ClientSession, gateway: Any) -> str:
    async with http.get(f"{gateway.http_url}/metrics") as resp:
        return await resp.text()


@pytest.mark.slow
async def test_streams_on_a_stopped_unit_move_as_soon_as_it_is_lost(
    procs: Procs, http: aiohttp.ClientSession
) -> None:
    sidecars, gateway = await cell(procs, 2, *QUICK_LOSS, sidecar_args=QUICK_REPORTS)
    body = {**CHAT, "max_tokens": 1000}  # about 5 s of tokens
    resp = await http.post(f"{gateway.http_url}/v1/chat/completions", json=body)
    first = await read_events(resp, 10)
    victim = sidecars[int(resp.headers["x-unitproxy-unit"][1:])]
    victim.signal(signal.SIGSTOP)
    try:
        events = first + await rest_of(resp)  # 20 s at most: well before the idle timeout
    finally:
        victim.signal(signal.SIGCONT)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 1000
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    text = await metrics_of(http, gateway)
    assert 'unitproxy_migrations_total{reason="unit_lost"} 1.0' in text
    assert 'unitproxy_migrations_total{reason="idle"} 0.0' in text


@pytest.mark.slow
async def test_grpc_streams_on_a_stopped_unit_move_as_soon_as_it_is_lost(
    procs: Procs, http: aiohttp.ClientSession
) -> None:
    sidecars, gateway = await cell(procs, 2, *QUICK_LOSS, sidecar_args=QUICK_REPORTS)
    request = inference_pb2.GenerateRequest(
        prompt="tell me a story", sampling=inference_pb2.SamplingParams(max_tokens=1000)
    )
    chunks: list[inference_pb2.GenerateChunk] = []
    stopped: list[Any] = []
    try:
        async with grpc.aio.insecure_channel(gateway.grpc_target) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=20)
            async for chunk in call:
                chunks.append(chunk)
                if len(chunks) == 5:
                    stopped.append(sidecars[int(chunk.unit_id[1:])])
                    stopped[0].signal(signal.SIGSTOP)
    finally:
        for victim in stopped:
            victim.signal(signal.SIGCONT)
    assert sum(len(c.token_ids) for c in chunks) == 1000
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 1000
    assert len({c.unit_id for c in chunks}) == 2, "continued on the other unit"
    assert 'unitproxy_migrations_total{reason="unit_lost"} 1.0' in await metrics_of(http, gateway)


@pytest.mark.slow
async def test_a_second_sigterm_ends_open_streams_with_an_error_event(
    procs: Procs, http: aiohttp.ClientSession
) -> None:
    _, gateway = await cell(procs, 1)
    slow = {**CHAT, "max_tokens": 100_000}
    resp = await http.post(f"{gateway.http_url}/v1/chat/completions", json=slow)
    await read_events(resp, 3)
    gateway.signal(signal.SIGTERM)  # drain: the stream may finish...
    await asyncio.sleep(0.2)
    gateway.signal(signal.SIGTERM)  # ...but not now: stop
    events = await rest_of(resp)
    assert json.loads(events[-1])["error"]["code"] == "shutting_down"
    assert await gateway.wait(10) == 1


async def follower_cell(procs: Procs) -> tuple[list[Any], list[Any], Any]:
    """Two units, each a follower agent and a sidecar probing it quickly, and a gateway."""
    followers = [await procs.follower("--node-name", "f1") for _ in range(2)]
    ports = free_ports(6)
    quick = ("--health-interval", "0.2", "--health-timeout", "0.2", "--sim-decode-step-ms", "5")
    sidecars = [
        await procs.sidecar(ports[2 * i], ports[2 * i + 1], "--unit-id", f"u{i}",
                            "--follower", f"f1={f.grpc_target}", *quick)
        for i, f in enumerate(followers)
    ]  # fmt: skip
    flags = [a for i, s in enumerate(sidecars)
             for a in ("--unit", f"u{i}={s.http_url},{s.grpc_target}")]  # fmt: skip
    gateway = await procs.gateway(ports[4], ports[5], *flags)
    return followers, sidecars, gateway


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_a_failed_follower_is_invisible_to_the_client(
    procs: Procs, http: aiohttp.ClientSession, how: str
) -> None:
    """(a) a follower killed, (b) a follower hung: its unit lets go of the stream, the
    gateway continues it elsewhere, and the client reads the unfailed text."""
    followers, sidecars, gateway = await follower_cell(procs)
    body = {**CHAT, "max_tokens": 400}
    resp = await http.post(f"{gateway.http_url}/v1/chat/completions", json=body)
    first = await read_events(resp, 10)
    index = int(resp.headers["x-unitproxy-unit"][1:])
    followers[index].signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    events = first + await rest_of(resp)
    assert events[-1] == b"[DONE]"
    reference = await unfailed(http, sidecars[1 - index].http_url, "/v1/chat/completions", body)
    assert chat_text(events) == reference["choices"][0]["message"]["content"]
    assert json.loads(events[-2])["usage"] == reference["usage"]
    async with http.get(f"{gateway.http_url}/metrics") as metrics:
        text = await metrics.text()
    assert 'unitproxy_migrations_total{reason="unit_failed"} 1.0' in text


async def test_grpc_unavailable_from_a_draining_unit_is_a_refusal_not_a_failure(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    # Reports reach the gateway 2 s late: it goes on believing a SERVING meanwhile.
    a, _, gw = await two_units(start_sidecar, start_gateway, eject_after=1, report_delay_s=2.0)
    a.start_drain()
    request = inference_pb2.GenerateRequest(prompt="x", sampling={"max_tokens": 3})
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for _ in range(6):
            chunks = [c async for c in stub.Generate(request, timeout=10)]
            assert chunks[-1].finish_reason == "length"
    unit = gw.router.units["a"]
    assert sample(gw, "unitproxy_retries_total", reason="unavailable") >= 1
    assert unit.failures == 0 and unit.ejected_until == 0, "a drain is no failure"

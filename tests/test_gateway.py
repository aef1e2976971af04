"""The gateway against real sidecars on loopback: routing, retries, queueing, ejection."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
from collections import Counter

import aiohttp
import grpc
import openai
import pytest

from proxy.gateway.server import Gateway
from proxy.load import UnitState
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import BlackHoleFactory, GatewayFactory, SidecarFactory, wait_until
from tests.procs import Procs, free_ports

pytestmark = pytest.mark.timeout(30)

SLOW_STREAM = {"prompt": "x", "max_tokens": 100_000, "stream": True}


def counter_value(gw: Gateway, name: str, **labels: str) -> float:
    value = gw.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def units_of(
    http: aiohttp.ClientSession, gw: Gateway, n: int, body: dict[str, object]
) -> Counter[str]:
    async def one() -> str:
        async with http.post(f"{gw.http_url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            return resp.headers["x-unitproxy-unit"]

    return Counter(await asyncio.gather(*(one() for _ in range(n))))


async def hold_streams(
    http: aiohttp.ClientSession, url: str, n: int
) -> list[aiohttp.ClientResponse]:
    held = []
    for _ in range(n):
        resp = await http.post(f"{url}/v1/completions", json=SLOW_STREAM)
        assert resp.status == 200
        await resp.content.readline()
        held.append(resp)
    return held


async def test_openai_client_and_grpc_through_the_gateway(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    gw = await start_gateway([a, b])
    async with openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0) as oa:
        stream = await oa.chat.completions.create(
            model="unitproxy-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        text = await oa.completions.create(model="unitproxy-sim", prompt="abc", max_tokens=3)
        assert text.choices[0].finish_reason == "length"
        raw = await oa.completions.with_raw_response.create(
            model="unitproxy-sim", prompt="abc", max_tokens=2
        )
        assert raw.headers["x-unitproxy-unit"] in ("a", "b")
        assert raw.headers["x-request-id"]
        chat = await oa.chat.completions.create(
            model="unitproxy-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.choices[0].message.content
        models = await oa.models.list()
        assert models.data[0].id == "unitproxy-sim"

    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=5)
        )
        chunks_g = [c async for c in stub.Generate(request, timeout=5)]
        assert sum(len(c.token_ids) for c in chunks_g) == 5
        assert chunks_g[-1].finish_reason == "length"
        assert chunks_g[0].unit_id in ("a", "b")
    assert a.core.outstanding == b.core.outstanding == 0


@pytest.mark.parametrize("policy", ["lor", "p2c"])
async def test_load_aware_policies_avoid_the_busy_unit(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    http: aiohttp.ClientSession,
    policy: str,
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a", "capacity": 16})
    b = await start_sidecar(sidecar={"unit_id": "b", "capacity": 16})
    gw = await start_gateway([a, b], policy=policy)
    held = await hold_streams(http, a.http_url, 8)  # sent to unit a directly
    await wait_until(lambda: gw.router.units["a"].estimate() == 8, what="gateway sees a's load")
    got = await units_of(http, gw, 6, {"prompt": "x", "max_tokens": 2})
    assert got == Counter({"b": 6})
    for resp in held:
        resp.close()


async def test_round_robin_splits_regardless_of_load(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a", "capacity": 16})
    b = await start_sidecar(sidecar={"unit_id": "b", "capacity": 16})
    gw = await start_gateway([a, b], policy="round_robin")
    held = await hold_streams(http, a.http_url, 8)
    await wait_until(lambda: gw.router.units["a"].estimate() == 8, what="gateway sees a's load")
    got = Counter()
    for _ in range(6):
        got += await units_of(http, gw, 1, {"prompt": "x", "max_tokens": 2})
    assert got == Counter({"a": 3, "b": 3})
    for resp in held:
        resp.close()


async def test_not_serving_unit_gets_no_new_requests(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    procs: Procs,
    http: aiohttp.ClientSession,
) -> None:
    follower = await procs.follower("--node-name", "a-f1")
    a = await start_sidecar(sidecar={"unit_id": "a", "followers": [f"a-f1={follower.grpc_target}"]})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    gw = await start_gateway([a, b])
    follower.signal(signal.SIGKILL)
    await wait_until(
        lambda: gw.router.units["a"].state is UnitState.NOT_SERVING, what="report arrives"
    )
    got = await units_of(http, gw, 10, {"prompt": "x", "max_tokens": 1})
    assert got == Counter({"b": 10})
    assert counter_value(gw, "unitproxy_retries_total", reason="503") == 0, "never even tried a"


async def test_429_and_refused_connections_are_retried_elsewhere(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a", "capacity": 1})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    # Polling once a minute: the gateway keeps believing a is idle and SERVING.
    gw = await start_gateway([a, b], policy="round_robin", load_source="poll",
                             poll_interval_s=60, stale_after_s=120)  # fmt: skip
    held = await hold_streams(http, a.http_url, 1)  # a is now full
    got = await units_of(http, gw, 1, {"prompt": "x", "max_tokens": 1})
    assert got == Counter({"b": 1})
    assert counter_value(gw, "unitproxy_retries_total", reason="429") == 1
    held[0].close()

    await a.__aexit__(None, None, None)  # a's ports now refuse connections
    for _ in range(3):
        assert await units_of(http, gw, 1, {"prompt": "x", "max_tokens": 1}) == Counter({"b": 1})
    assert counter_value(gw, "unitproxy_retries_total", reason="connect") >= 1
    assert gw.router.units["a"].ejected_until > 0, "failing fast got a ejected"


async def test_a_retry_with_no_unit_left_is_not_counted(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    # The only unit is full but the gateway believes it idle (polled once a minute): it
    # refuses with 429 and no other unit takes the request, so nothing was retried.
    a = await start_sidecar(sidecar={"unit_id": "a", "capacity": 1})
    gw = await start_gateway([a], load_source="poll", poll_interval_s=60, stale_after_s=120)
    held = await hold_streams(http, a.http_url, 1)
    async with http.post(f"{gw.http_url}/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 429
        assert resp.headers["x-unitproxy-unit"] == "a"
    assert counter_value(gw, "unitproxy_routed_requests_total", unit="a") == 1
    assert counter_value(gw, "unitproxy_retries_total", reason="429") == 0
    held[0].close()


async def test_the_gateways_own_answers_carry_unit_and_request_id(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    # A unit slower than --response-timeout: the gateway answers 504 on its own.
    a = await start_sidecar(sidecar={"unit_id": "a"}, sim={"decode_step_ms": 20.0})
    gw = await start_gateway([a], response_timeout_s=0.2)
    body = {"prompt": "x", "max_tokens": 50}
    headers = {"x-request-id": "late-1"}
    async with http.post(f"{gw.http_url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 504
        assert resp.headers["x-unitproxy-unit"] == "a", "the unit that was too slow"
        assert resp.headers["x-request-id"] == "late-1"
    # No unit is SERVING: none was tried.
    await a.__aexit__(None, None, None)
    await wait_until(lambda: not gw.router.serving(), what="a gone")
    async with http.post(f"{gw.http_url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 503
        assert resp.headers["x-unitproxy-unit"] == "none"
        assert resp.headers["x-request-id"] == "late-1"


async def test_503_from_a_unit_is_retried_and_grpc_too(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, sim={"crash_after_requests": 1},
                            health={"unhealthy_threshold": 1})  # fmt: skip
    b = await start_sidecar(sidecar={"unit_id": "b"})
    gw = await start_gateway([a, b], policy="round_robin", load_source="poll",
                             poll_interval_s=60, stale_after_s=120)  # fmt: skip
    async with http.post(f"{a.http_url}/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 503  # this one crashed a's engine
    await wait_until(lambda: a.health.state is UnitState.NOT_SERVING, what="a NOT_SERVING")
    assert await units_of(http, gw, 1, {"prompt": "x", "max_tokens": 1}) == Counter({"b": 1})
    assert counter_value(gw, "unitproxy_retries_total", reason="503") == 1

    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=2)
        )
        for _ in range(2):  # round robin's turn lands on a first each time (a, b, a, b)
            chunks = [c async for c in stub.Generate(request, timeout=5)]
            assert chunks[-1].unit_id == "b"
    assert counter_value(gw, "unitproxy_retries_total", reason="unavailable") == 2


async def test_no_retry_after_the_first_byte(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, sim={"error_after_tokens": 2})
    gw = await start_gateway([a])
    async with http.post(f"{gw.http_url}/v1/completions",
                         json={"prompt": "x", "max_tokens": 10, "stream": True}) as resp:  # fmt: skip
        assert resp.status == 200
        events = [line async for line in resp.content if line.startswith(b"data: ")]
    assert len(events) == 3
    assert json.loads(events[-1][6:])["error"]["type"] == "engine_error"
    assert counter_value(gw, "unitproxy_routed_requests_total", unit="a") == 1
    assert (
        sum(
            counter_value(gw, "unitproxy_retries_total", reason=r)
            for r in ("429", "503", "connect")
        )
        == 0
    )


async def test_unit_dying_mid_stream_gives_an_sse_error_event(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    gw = await start_gateway([a])
    resp = await http.post(f"{gw.http_url}/v1/completions", json=SLOW_STREAM)
    assert resp.status == 200
    await resp.content.readline()
    await a.__aexit__(None, None, None)  # the unit stops mid-stream: its engine first
    async with asyncio.timeout(10):
        events = [line async for line in resp.content if line.startswith(b"data: ")]
    error = json.loads(events[-1][6:])["error"]  # no other unit to continue on
    assert (error["type"], error["code"]) == ("unavailable_error", "unit_failed")
    resp.close()


@pytest.mark.slow
async def test_unit_killed_mid_stream_gives_an_sse_error_event(
    procs: Procs, http: aiohttp.ClientSession
) -> None:
    sc_http, sc_grpc, gw_http, gw_grpc = free_ports(4)
    sidecar = await procs.sidecar(sc_http, sc_grpc, "--unit-id", "a")
    gateway = await procs.gateway(
        gw_http, gw_grpc, "--unit", f"a={sidecar.http_url},{sidecar.grpc_target}"
    )
    resp = await http.post(f"{gateway.http_url}/v1/completions", json=SLOW_STREAM)
    await resp.content.readline()
    sidecar.signal(signal.SIGKILL)  # no goodbye: the connection is cut
    async with asyncio.timeout(10):
        events = [line async for line in resp.content if line.startswith(b"data: ")]
    assert json.loads(events[-1][6:])["error"]["type"] == "unavailable_error"
    resp.close()


async def test_client_disconnect_leaves_nothing_outstanding(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    gw = await start_gateway([a, b])
    held = await hold_streams(http, gw.http_url, 4)
    assert a.core.outstanding + b.core.outstanding == 4
    for resp in held:
        resp.close()
    await wait_until(lambda: a.core.outstanding == b.core.outstanding == 0, what="units at 0")
    await wait_until(
        lambda: a.engine.stats().running == b.engine.stats().running == 0, what="aborted"
    )
    assert all(u.inflight == 0 for u in gw.router.units.values())

    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(inference_pb2.GenerateRequest(prompt="x"), timeout=10)
        await call.read()
        call.cancel()
    await wait_until(lambda: a.core.outstanding == b.core.outstanding == 0, what="gRPC cancel")


async def test_no_serving_unit_is_503_at_once(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    gw = await start_gateway([a])
    await a.__aexit__(None, None, None)
    await wait_until(lambda: not gw.router.serving(), what="gateway loses a")
    async with http.post(f"{gw.http_url}/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "no_unit_available"
    async with http.get(f"{gw.http_url}/ready") as resp:
        assert resp.status == 503
    assert counter_value(gw, "unitproxy_no_unit_available_total") == 1


async def test_full_units_queue_then_overflow_with_429(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a", "capacity": 1})
    gw = await start_gateway([a], queue_size=1, queue_timeout_s=5)
    held = await hold_streams(http, gw.http_url, 1)
    queued = asyncio.create_task(units_of(http, gw, 1, {"prompt": "x", "max_tokens": 1}))
    await wait_until(lambda: gw.router.waiting == 1, what="one request waits")
    async with http.post(f"{gw.http_url}/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 429
        assert (await resp.json())["error"]["code"] == "queue_full"
    held[0].close()
    assert await asyncio.wait_for(queued, 5) == Counter({"a": 1}), "the waiter got the freed slot"


async def test_queue_timeout_is_429(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a", "capacity": 1})
    gw = await start_gateway([a], queue_size=4, queue_timeout_s=0.2)
    held = await hold_streams(http, gw.http_url, 1)
    async with http.post(f"{gw.http_url}/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 429
        assert (await resp.json())["error"]["code"] == "queue_timeout"
    held[0].close()


async def test_unit_failing_fast_is_ejected(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, sim={"error_after_tokens": 0})
    b = await start_sidecar(sidecar={"unit_id": "b"}, sim={"decode_step_ms": 20.0})
    gw = await start_gateway([a, b], eject_after=3, eject_s=30)

    async def status() -> int:
        body = {"prompt": "x", "max_tokens": 1}
        async with http.post(f"{gw.http_url}/v1/completions", json=body) as resp:
            return resp.status

    # a answers 500 at once and would look idle forever; after 3 failures it is out.
    # (Which unit a request meets first depends on ties and report timing: count.)
    failures = 0
    for _ in range(60):
        failures += await status() == 500
        if failures == 3:
            break
    assert failures == 3
    assert [await status() for _ in range(8)] == [200] * 8
    async with http.get(f"{gw.http_url}/units") as resp:
        units = {u["id"]: u for u in (await resp.json())["units"]}
    assert units["a"]["ejected_for_s"] > 0


async def test_gateway_endpoints(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    gw = await start_gateway([a])
    await units_of(http, gw, 2, {"prompt": "x", "max_tokens": 1})
    async with http.get(f"{gw.http_url}/ready") as resp:
        assert resp.status == 200
        assert (await resp.json())["units"] == {"SERVING": 1}
    async with http.get(f"{gw.http_url}/units") as resp:
        unit = (await resp.json())["units"][0]
    assert unit["id"] == "a" and unit["state"] == "SERVING" and unit["routed"] == 2
    assert unit["capacity"] == 32 and unit["report_age_s"] < 5  # the sim's slots
    async with http.get(f"{gw.http_url}/metrics") as resp:
        text = await resp.text()
    for name in ("unitproxy_routed_requests_total", "unitproxy_retries_total", "unitproxy_no_unit_available_total",
                 "unitproxy_unit_load", "unitproxy_load_report_age_seconds", "unitproxy_requests_total"):  # fmt: skip
        assert name in text
    async with http.post(f"{gw.http_url}/v1/nothing", json={}) as resp:
        assert resp.status == 404


async def test_errors_mid_stream_count_toward_ejection(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, sim={"error_after_tokens": 2})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    gw = await start_gateway([a, b], policy="round_robin", eject_after=2, eject_s=30)
    body = {"prompt": "x", "max_tokens": 5, "stream": True}
    for _ in range(4):  # round robin: a, b, a, b
        async with http.post(f"{gw.http_url}/v1/completions", json=body) as resp:
            await resp.read()
    assert gw.router.units["a"].ejected_until > 0, "two streams that ended in errors"
    assert gw.router.units["b"].ejected_until == 0


async def test_a_unit_that_never_answers_gets_504_and_is_ejected(
    start_sidecar: SidecarFactory,
    http: aiohttp.ClientSession,
    black_hole: BlackHoleFactory,
) -> None:
    from proxy.settings import load

    port = (await black_hole()).port  # takes requests and says nothing
    reports = await start_sidecar(sidecar={"unit_id": "a"})  # its gRPC says SERVING
    settings = load({
        "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
        # Reports over gRPC: the HTTP port (and so /load/watch) is the wedged one.
        "gateway": {"units": [f"a=http://127.0.0.1:{port},{reports.grpc_target}"],
                    "load_source": "watch",
                    "response_timeout_s": 0.3, "eject_after": 2, "eject_s": 30,
                    "max_ejection_percent": 100},  # its only unit
    })  # fmt: skip
    async with Gateway(settings) as gw:
        await wait_until(lambda: bool(gw.router.serving()), what="a reports SERVING")
        for _ in range(2):
            async with http.post(f"{gw.http_url}/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 504
                assert "no response within 0.3 s" in (await resp.json())["error"]["message"]
        assert gw.router.units["a"].ejected_until > 0
        assert gw.router.units["a"].inflight == 0


async def test_clients_that_give_up_on_a_silent_unit_count_as_its_failures(
    start_sidecar: SidecarFactory,
    http: aiohttp.ClientSession,
    black_hole: BlackHoleFactory,
) -> None:
    # The unit takes requests and never answers while it reports SERVING; the response
    # timeout (300 s) never passes. A client that left after gave_up_failure_s with no
    # byte is a failure of the unit (HTTP and gRPC alike); one that left sooner is not.
    from proxy.settings import load

    port = (await black_hole()).port  # takes requests and says nothing
    reports = await start_sidecar(sidecar={"unit_id": "a"})  # its gRPC says SERVING
    settings = load({
        "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
        "gateway": {"units": [f"a=http://127.0.0.1:{port},{reports.grpc_target}"],
                    "load_source": "watch", "gave_up_failure_s": 0.5,
                    "eject_after": 2, "eject_s": 30, "max_ejection_percent": 100},
    })  # fmt: skip
    async with Gateway(settings) as gw:
        await wait_until(lambda: bool(gw.router.serving()), what="a reports SERVING")
        unit = gw.router.units["a"]

        async def give_up_after(seconds: float) -> None:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(seconds):
                    await http.post(f"{gw.http_url}/v1/completions", json={"prompt": "x"})
            await wait_until(lambda: unit.inflight == 0, what="the gateway let the unit go")

        for _ in range(3):
            await give_up_after(0.05)  # impatient clients say nothing about the unit
        assert unit.failures == 0 and unit.ejected_until == 0
        await give_up_after(1.5)
        assert unit.failures == 1
        async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(prompt="x"), timeout=1.5
            )
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await call.read()
            assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_until(lambda: unit.ejected_until > 0, what="a ejected")
        async with http.get(f"{gw.http_url}/units") as resp:
            shown = (await resp.json())["units"][0]
        assert shown["ejected_for_s"] > 0 and shown["ejections"] == 1


async def test_a_request_waiting_on_a_unit_that_is_ejected_goes_on_elsewhere(
    start_sidecar: SidecarFactory,
    http: aiohttp.ClientSession,
    black_hole: BlackHoleFactory,
) -> None:
    # a takes requests and says nothing (its reports come from a real sidecar's gRPC);
    # a request waiting there for a head moves to b once a is ejected, not after the
    # 300 s response timeout.
    from proxy.gateway.router import Outcome
    from proxy.settings import load

    port = (await black_hole()).port  # takes requests and says nothing
    reports = await start_sidecar(sidecar={"unit_id": "a"})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    settings = load({
        "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
        "gateway": {"units": [f"a=http://127.0.0.1:{port},{reports.grpc_target}",
                              f"b={b.http_url},{b.grpc_target}"],
                    "load_source": "watch", "eject_after": 1},
    })  # fmt: skip
    async with Gateway(settings) as gw:
        await wait_until(lambda: len(gw.router.serving()) == 2, what="both SERVING")
        a = gw.router.units["a"]
        body = {"prompt": "x", "max_tokens": 3}
        waiting = None
        for _ in range(50):  # until one lands on a (lor draws between idle units)
            task = asyncio.create_task(http.post(f"{gw.http_url}/v1/completions", json=body))
            while not task.done() and a.inflight == 0:
                await asyncio.sleep(0.01)
            if a.inflight:
                waiting = task
                break
            (await task).release()
        assert waiting is not None, "no request went to a"
        a.inflight += 1
        gw.router.release(a, Outcome.FAILED)  # a is ejected
        async with asyncio.timeout(10):
            resp = await waiting
        assert resp.status == 200 and resp.headers["x-unitproxy-unit"] == "b"
        resp.release()
        assert counter_value(gw, "unitproxy_migrations_total", reason="unit_lost") == 1


async def test_load_over_http_watch_routes_and_drops_a_stopped_unit_at_once(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a", "capacity": 16})
    b = await start_sidecar(sidecar={"unit_id": "b", "capacity": 16})
    gw = await start_gateway([a, b], load_source="watch-http")
    held = await hold_streams(http, a.http_url, 8)  # sent to unit a directly
    await wait_until(lambda: gw.router.units["a"].estimate() == 8, what="a's load over HTTP")
    assert await units_of(http, gw, 6, {"prompt": "x", "max_tokens": 2}) == Counter({"b": 6})
    for resp in held:
        resp.close()
    await wait_until(lambda: gw.router.units["a"].estimate() == 0, what="a idle again")
    await a.__aexit__(None, None, None)  # the report stream breaks: a is dropped at once
    await wait_until(lambda: gw.router.units["a"].report is None, what="a forgotten")
    assert await units_of(http, gw, 4, {"prompt": "x", "max_tokens": 1}) == Counter({"b": 4})


async def test_watch_reads_a_fleet_above_watch_grpc_max_units_over_http(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a", "capacity": 16})
    b = await start_sidecar(sidecar={"unit_id": "b", "capacity": 16})
    small = await start_gateway([a, b])
    assert not small.watches_over_http  # 2 units: a gRPC stream each
    await wait_until(lambda: len(small._channels) == 2, what="a gRPC channel per unit")
    gw = await start_gateway([a, b], load_source="watch", watch_grpc_max_units=1)
    assert gw.watches_over_http
    held = await hold_streams(http, a.http_url, 8)  # sent to unit a directly
    await wait_until(lambda: gw.router.units["a"].estimate() == 8, what="a's load over HTTP")
    assert await units_of(http, gw, 6, {"prompt": "x", "max_tokens": 2}) == Counter({"b": 6})
    for resp in held:
        resp.close()
    assert not gw._channels, "no gRPC channel was opened for reports"


async def test_a_watch_stream_that_goes_quiet_is_closed_and_opened_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A unit whose /load/watch sends one report and then nothing, not even heartbeats,
    # while its connection stays open: after stale_after_s the gateway closes it, stops
    # routing there ("timed out"), and opens the stream again, each time.
    from proxy.load import LoadReport
    from proxy.settings import load

    opened: list[float] = []
    writers: list[asyncio.StreamWriter] = []
    report = LoadReport("a", UnitState.SERVING, outstanding=0, capacity=4).to_json()

    async def quiet_unit(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        opened.append(asyncio.get_running_loop().time())
        event = f"data: {report}\n\n".encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n" % (len(event), event))  # fmt: skip
        await reader.read()  # until the gateway closes it

    server = await asyncio.start_server(quiet_unit, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = load({
        "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
        "gateway": {"units": [f"a=http://127.0.0.1:{port},127.0.0.1:1"],
                    "load_source": "watch-http", "stale_after_s": 0.4},
    })  # fmt: skip
    try:
        async with Gateway(settings):
            await wait_until(lambda: len(opened) >= 3, timeout_s=8, what="three streams")
            lost = [r for r in caplog.records if "no report for 0.4 s" in r.getMessage()]
            assert len(lost) >= 2 and "(timed out: " in lost[0].getMessage()
            gaps = [b - a for a, b in itertools.pairwise(opened)]
            # quiet for 0.4-0.45 s, then a backoff of at most 0.1 s (the stream had a
            # report) and the connect
            assert all(0.4 <= gap < 1.0 for gap in gaps), gaps
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()

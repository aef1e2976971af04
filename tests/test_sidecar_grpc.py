"""The sidecar's gRPC services over real channels on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proxy.load import LoadReport, UnitState
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc, load_pb2, load_pb2_grpc
from tests.conftest import SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
async def channels() -> AsyncIterator[list[grpc.aio.Channel]]:
    opened: list[grpc.aio.Channel] = []
    yield opened
    for channel in opened:
        await channel.close()


def connect(opened: list[grpc.aio.Channel], target: str) -> grpc.aio.Channel:
    channel = grpc.aio.insecure_channel(target)
    opened.append(channel)
    return channel


def prompt(
    text: str = "hello", max_tokens: int = 5, **sampling: object
) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        request_id="g-1",
        prompt=text,
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


async def test_generate_streams_chunks_with_usage_last(
    start_sidecar: SidecarFactory, channels: list[grpc.aio.Channel]
) -> None:
    sidecar = await start_sidecar(sidecar={"unit_id": "unit-g"})
    stub = inference_pb2_grpc.InferenceStub(connect(channels, sidecar.grpc_target))
    chunks = [c async for c in stub.Generate(prompt(max_tokens=6), timeout=5)]
    # One message per token delta while the client keeps up; deltas that wait on a
    # write merge (test_coalesce.py), so count the tokens the messages carry.
    assert sum(len(c.token_ids) for c in chunks) == 6
    assert all(c.request_id == "g-1" and c.unit_id == "unit-g" for c in chunks)
    assert all(c.token_ids for c in chunks)
    assert [c.finish_reason for c in chunks] == [""] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 6
    assert not chunks[0].HasField("usage")

    chat = inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(
            messages=[inference_pb2.ChatMessage(role="user", content="hi there")]
        ),
        sampling=inference_pb2.SamplingParams(max_tokens=3),
    )
    chat_chunks = [c async for c in stub.Generate(chat, timeout=5)]
    assert sum(len(c.token_ids) for c in chat_chunks) == 3
    assert chat_chunks[0].request_id, "an id is generated"

    ids = inference_pb2.GenerateRequest(
        prompt_token_ids=inference_pb2.PromptTokenIds(ids=[1, 2, 3])
    )
    id_chunks = [c async for c in stub.Generate(ids, timeout=5)]
    assert id_chunks[-1].usage.prompt_tokens == 3
    assert sidecar.core.outstanding == 0


@pytest.mark.parametrize(
    ("request_", "names"),
    [
        (inference_pb2.GenerateRequest(), "input"),
        (prompt(max_tokens=0), "max_tokens"),
        (prompt(temperature=5.0), "temperature"),
        (prompt(""), "prompt"),
        (inference_pb2.GenerateRequest(prompt="x", model="other-model"), "model"),
    ],
)
async def test_bad_generate_requests_are_invalid_argument(
    start_sidecar: SidecarFactory,
    channels: list[grpc.aio.Channel],
    request_: inference_pb2.GenerateRequest,
    names: str,
) -> None:
    sidecar = await start_sidecar()
    stub = inference_pb2_grpc.InferenceStub(connect(channels, sidecar.grpc_target))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(request_, timeout=5):
            pass
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert names in (info.value.details() or "")
    assert sidecar.core.outstanding == 0


async def test_full_unit_is_resource_exhausted(
    start_sidecar: SidecarFactory, channels: list[grpc.aio.Channel]
) -> None:
    sidecar = await start_sidecar(sidecar={"capacity": 1})
    stub = inference_pb2_grpc.InferenceStub(connect(channels, sidecar.grpc_target))
    held = stub.Generate(prompt(max_tokens=100_000), timeout=10)
    await held.read()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(prompt(), timeout=5):
            pass
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    held.cancel()
    await wait_until(lambda: sidecar.core.outstanding == 0, what="cancelled stream released")
    await wait_until(lambda: sidecar.engine.stats().running == 0, what="engine request aborted")


async def test_deadline_is_deadline_exceeded_and_released(
    start_sidecar: SidecarFactory, channels: list[grpc.aio.Channel]
) -> None:
    sidecar = await start_sidecar(sim={"decode_step_ms": 20.0})
    stub = inference_pb2_grpc.InferenceStub(connect(channels, sidecar.grpc_target))
    received = 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(prompt(max_tokens=1000), timeout=0.3):
            received += 1
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < received < 1000
    await wait_until(lambda: sidecar.core.outstanding == 0, what="outstanding back to 0")
    await wait_until(lambda: sidecar.engine.stats().running == 0, what="engine request aborted")


async def test_engine_error_mid_stream_is_internal(
    start_sidecar: SidecarFactory, channels: list[grpc.aio.Channel]
) -> None:
    sidecar = await start_sidecar(sim={"error_after_tokens": 2})
    stub = inference_pb2_grpc.InferenceStub(connect(channels, sidecar.grpc_target))
    received = 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(prompt(max_tokens=10), timeout=5):
            received += 1
    assert received == 2
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "simulated engine error" in (info.value.details() or "")
    assert sidecar.core.outstanding == 0


async def test_health_check_and_watch_follow_the_unit_state(
    start_sidecar: SidecarFactory, channels: list[grpc.aio.Channel]
) -> None:
    sidecar = await start_sidecar(
        sim={"crash_after_requests": 1}, health={"unhealthy_threshold": 1}
    )
    health = health_pb2_grpc.HealthStub(connect(channels, sidecar.grpc_target))
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", "unitproxy.v1.Inference"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == serving
    watch = health.Watch(
        health_pb2.HealthCheckRequest(service="unitproxy.v1.Inference"), timeout=10
    )
    assert (await watch.read()).status == serving

    stub = inference_pb2_grpc.InferenceStub(connect(channels, sidecar.grpc_target))
    with pytest.raises(grpc.aio.AioRpcError):  # this request crashes the simulated engine
        async for _ in stub.Generate(prompt(), timeout=5):
            pass
    update = await asyncio.wait_for(watch.read(), 5)
    assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
    reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == serving, "the process itself is still up"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(prompt(), timeout=5):
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    watch.cancel()


async def test_watch_load_reports_every_change(
    start_sidecar: SidecarFactory, channels: list[grpc.aio.Channel]
) -> None:
    sidecar = await start_sidecar(sidecar={"unit_id": "unit-w", "report_interval_s": 30.0})
    channel = connect(channels, sidecar.grpc_target)
    load = load_pb2_grpc.LoadReportingStub(channel)
    first = LoadReport.from_pb(await load.GetLoad(load_pb2.GetLoadRequest(), timeout=5))
    assert first.unit_id == "unit-w" and first.state is UnitState.SERVING
    assert first.capacity == 32 and first.nodes[0].healthy  # the sim's slots

    watch = load.WatchLoad(load_pb2.WatchLoadRequest(), timeout=15)
    initial = LoadReport.from_pb(await asyncio.wait_for(watch.read(), 5))
    assert initial.outstanding == 0

    stub = inference_pb2_grpc.InferenceStub(channel)
    held = stub.Generate(prompt(max_tokens=100_000), timeout=10)
    await held.read()
    admitted = LoadReport.from_pb(await asyncio.wait_for(watch.read(), 5))
    assert admitted.outstanding == 1 and admitted.seq > initial.seq
    held.cancel()
    released = LoadReport.from_pb(await asyncio.wait_for(watch.read(), 5))
    assert released.outstanding == 0 and released.seq > admitted.seq
    watch.cancel()


async def test_watch_load_heartbeat(
    start_sidecar: SidecarFactory, channels: list[grpc.aio.Channel]
) -> None:
    sidecar = await start_sidecar(sidecar={"report_interval_s": 0.1})
    load = load_pb2_grpc.LoadReportingStub(connect(channels, sidecar.grpc_target))
    watch = load.WatchLoad(load_pb2.WatchLoadRequest(), timeout=10)
    seqs = [(await asyncio.wait_for(watch.read(), 2)).seq for _ in range(4)]
    assert seqs == sorted(set(seqs)), "heartbeats keep coming, each a new report"
    watch.cancel()

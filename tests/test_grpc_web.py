"""Generate over a unit's HTTP port (gRPC-Web framing): the frames, the sidecar's route,
and the gateway's unit leg with its fallback to gRPC."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from proxy import grpcweb
from proxy.gateway.grpc_proxy import stream_interval_ms
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import GatewayFactory, SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(30)

KEY = "test-key-123"


def chunk(text: str) -> bytes:
    return inference_pb2.GenerateChunk(text=text, token_ids=[len(text)]).SerializeToString()


def test_frames_come_out_whole_however_the_body_is_split() -> None:
    messages = [chunk("a"), chunk(""), chunk("xyz" * 100)]
    end = grpcweb.trailers(grpc.StatusCode.UNAVAILABLE, "unit u: gone, 100% sure", "unit_failed")
    body = b"".join(grpcweb.frame(m) for m in messages) + end
    for cut in range(len(body) + 1):
        for step in (1, 7, len(body)):
            frames = grpcweb.Frames()
            got = frames.feed(body[:cut])
            for at in range(cut, len(body), step):
                got += frames.feed(body[at : at + step])
            assert got == messages, (cut, step)
            assert frames.status is not None
            assert frames.status.code is grpc.StatusCode.UNAVAILABLE
            assert frames.status.message == "unit u: gone, 100% sure"
            assert frames.status.error_code == "unit_failed"


def test_an_ok_status_and_garbage() -> None:
    frames = grpcweb.Frames()
    assert frames.feed(grpcweb.frame(chunk("a")) + grpcweb.OK_TRAILERS) == [chunk("a")]
    assert frames.status is not None and frames.status.code is grpc.StatusCode.OK
    assert frames.status.error_code is None
    with pytest.raises(grpcweb.FrameError):
        grpcweb.Frames().feed(b"\x07\x00\x00\x00\x01x")  # no such flag
    with pytest.raises(grpcweb.FrameError):
        grpcweb.Frames().feed(grpcweb.OK_TRAILERS + b"\x00")  # bytes after the end
    with pytest.raises(grpcweb.FrameError):
        grpcweb.one_message(grpcweb.frame(b"ab") + b"c")
    assert grpcweb.one_message(grpcweb.frame(b"ab")) == b"ab"


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [(None, 0.0), ("", 0.0), ("5", 0.005), ("2.5", 0.0025), ("-1", 0.0), ("nan", 0.0),
     ("x", 0.0), ("1e9", 1.0)],
)  # fmt: skip
def test_interval_header(raw: str | None, seconds: float) -> None:
    assert grpcweb.interval_s(raw) == seconds


@pytest.mark.parametrize(
    ("floor_ms", "rate", "streams", "ms"),
    [(5, 3000, 1, 5), (5, 3000, 15, 5), (5, 3000, 30, 10), (5, 3000, 64, 64 / 3),
     (5, 3000, 150, 50), (5, 3000, 5000, 50), (80, 3000, 5000, 80), (0, 1000, 2, 2),
     (5, 0, 5000, 5)],
)  # fmt: skip
def test_a_stream_interval_is_its_share_of_the_message_rate(
    floor_ms: float, rate: float, streams: int, ms: float
) -> None:
    assert stream_interval_ms(floor_ms, rate, streams) == pytest.approx(ms)


async def call(
    http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[list[inference_pb2.GenerateChunk], grpcweb.Status]:
    """One Generate over the HTTP port: its chunks and its status."""
    head = {"Content-Type": grpcweb.CONTENT_TYPE, **(headers or {})}
    async with http.post(f"{url}{grpcweb.PATH}", data=body, headers=head) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == grpcweb.CONTENT_TYPE
        frames = grpcweb.Frames()
        messages = frames.feed(await resp.read())
    assert frames.status is not None, "every call ends with its status"
    return [inference_pb2.GenerateChunk.FromString(m) for m in messages], frames.status


def request(max_tokens: int = 8, **fields: Any) -> bytes:
    msg = inference_pb2.GenerateRequest(
        prompt="hello", sampling=inference_pb2.SamplingParams(max_tokens=max_tokens), **fields
    )
    return grpcweb.frame(msg.SerializeToString())


async def test_the_sidecar_streams_chunks_and_ends_with_ok(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sidecar={"unit_id": "u"})
    chunks, status = await call(http, sidecar.http_url, request(12, request_id="r1"))
    assert status.code is grpc.StatusCode.OK
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
    assert {c.request_id for c in chunks} == {"r1"} and {c.unit_id for c in chunks} == {"u"}
    # The same request over gRPC: the same text (the simulator is deterministic).
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        msg = inference_pb2.GenerateRequest.FromString(grpcweb.one_message(request(12)))
        reference = [c async for c in stub.Generate(msg, timeout=10)]
    assert "".join(c.text for c in chunks) == "".join(c.text for c in reference)
    await wait_until(lambda: sidecar.core.outstanding == 0, what="lease released")


async def test_an_interval_merges_what_comes_meanwhile(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sim={"decode_step_ms": 1.0})
    headers = {grpcweb.INTERVAL_HEADER: "1000"}
    chunks, status = await call(http, sidecar.http_url, request(30), headers)
    assert status.code is grpc.StatusCode.OK
    assert sum(len(c.token_ids) for c in chunks) == 30
    # The first message at once; the rest came within the second and went out as one
    # when the stream ended (the end does not wait out the interval).
    assert len(chunks) == 2, [len(c.token_ids) for c in chunks]


async def test_errors_are_statuses_with_their_code(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(server={"api_keys": [KEY]}, sidecar={"capacity": 1})
    auth = {"Authorization": f"Bearer {KEY}"}
    chunks, status = await call(http, sidecar.http_url, request())
    assert not chunks and status.code is grpc.StatusCode.UNAUTHENTICATED
    assert status.error_code == "missing_api_key"
    chunks, status = await call(http, sidecar.http_url, b"\x00\x00\x00\x00\x09garbage!!", auth)
    assert not chunks and status.code is grpc.StatusCode.INVALID_ARGUMENT
    chunks, status = await call(http, sidecar.http_url, request(model="no-such-model"), auth)
    assert not chunks and status.code is grpc.StatusCode.NOT_FOUND
    # At capacity: RESOURCE_EXHAUSTED, which a gateway retries elsewhere.
    long = asyncio.create_task(call(http, sidecar.http_url, request(100_000), auth))
    await wait_until(lambda: sidecar.core.outstanding == 1, what="one request running")
    chunks, status = await call(http, sidecar.http_url, request(), auth)
    assert not chunks and status.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status.error_code == "unit_at_capacity"
    long.cancel()
    await asyncio.gather(long, return_exceptions=True)
    await wait_until(lambda: sidecar.core.outstanding == 0, what="a gone client releases")


async def test_the_gateway_calls_units_over_http_and_falls_back_to_grpc(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    # Unit "old" answers 404 on its HTTP port (a sidecar from before the route); its
    # gRPC port and load reports are a real sidecar's.
    new = await start_sidecar(sidecar={"unit_id": "new"})
    old = await start_sidecar(sidecar={"unit_id": "old"})
    posts: list[str] = []

    async def not_here(req: web.Request) -> web.Response:
        posts.append(req.path)
        return web.Response(status=404, text="404: Not Found")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", not_here)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        old.http_url = f"http://127.0.0.1:{port}"
        gw = await start_gateway([new, old], policy="round_robin")
        async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            msg = inference_pb2.GenerateRequest.FromString(grpcweb.one_message(request(5)))
            units = set()
            for _ in range(6):
                chunks = [c async for c in stub.Generate(msg, timeout=10)]
                assert sum(len(c.token_ids) for c in chunks) == 5
                assert chunks[-1].finish_reason == "length"
                units |= {c.unit_id for c in chunks}
    finally:
        await runner.cleanup()
    assert units == {"new", "old"}
    assert posts == [grpcweb.PATH], "tried over HTTP once, then over gRPC"
    assert gw.router.units["old"].failures == 0, "a unit without the route is no failure"


async def test_streams_come_in_fewer_messages_while_many_share_the_gateway(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    # 100 messages a second: a lone stream 10 ms apart, one of five 50 ms apart.
    sidecar = await start_sidecar(sim={"decode_step_ms": 2.0})
    gw = await start_gateway([sidecar], grpc_interval_ms=0, grpc_messages_per_s=100)

    async def generate(stub: inference_pb2_grpc.InferenceStub, tokens: int) -> list[int]:
        msg = inference_pb2.GenerateRequest.FromString(grpcweb.one_message(request(tokens)))
        return [len(c.token_ids) async for c in stub.Generate(msg, timeout=20)]

    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        alone = await generate(stub, 100)
        others = [asyncio.create_task(generate(stub, 5000)) for _ in range(4)]
        try:
            await wait_until(lambda: sidecar.core.outstanding == 4, what="four streams running")
            shared = await generate(stub, 100)
        finally:
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
    assert sum(alone) == sum(shared) == 100
    # However slow the machine, the same tokens over the same time: 5x the spacing.
    assert 2 * len(shared) < len(alone), (alone, shared)
    await wait_until(lambda: sidecar.core.outstanding == 0, what="leases released")

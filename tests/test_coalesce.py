"""Coalescing of stream writes: the helper alone, the two merges, and both gRPC legs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
import grpc
import pytest

from engine.base import TokenDelta
from proxy.coalesce import Coalescer
from proxy.gateway.grpc_proxy import merge_chunks
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.sidecar.grpc_api import merge_deltas
from tests.conftest import GatewayFactory, SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(20)


class GatedWriter:
    """A write that takes as long as the test says: each one waits for ``release``."""

    def __init__(self) -> None:
        self.written: list[list[int]] = []
        self.started = 0
        self._gate = asyncio.Event()
        self.fail_with: Exception | None = None

    async def write(self, item: list[int]) -> None:
        self.started += 1
        await self._gate.wait()
        self._gate.clear()
        if self.fail_with is not None:
            raise self.fail_with
        self.written.append(item)

    def release(self) -> None:
        self._gate.set()


def concat(items: Sequence[list[int]]) -> list[int]:
    return [x for item in items for x in item]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_first_item_goes_at_once_and_what_waits_goes_merged() -> None:
    w = GatedWriter()
    out = Coalescer(w.write, concat)
    await out.put([1])
    await settle()
    assert w.started == 1, "the first item is written without waiting for more"
    await out.put([2])
    await out.put([3, 4])
    await settle()
    assert w.started == 1, "nothing else is written while a write is in flight"
    w.release()
    await settle()
    assert w.written == [[1]] and w.started == 2
    w.release()
    closing = asyncio.create_task(out.close())
    await settle()
    assert closing.done()
    await closing
    assert w.written == [[1], [2, 3, 4]]
    assert out.writes == 2


async def test_a_lone_item_is_written_as_given() -> None:
    seen: list[object] = []

    async def write(item: object) -> None:
        seen.append(item)

    def merge(items: Sequence[object]) -> object:
        raise AssertionError("nothing to merge")

    out = Coalescer(write, merge)
    item = object()
    await out.put(item)
    await out.close()
    assert seen == [item] and seen[0] is item


async def test_put_waits_while_limit_items_wait() -> None:
    w = GatedWriter()
    out = Coalescer(w.write, concat, limit=2)
    await out.put([1])
    await settle()  # [1] is in flight
    await out.put([2])
    third = asyncio.create_task(out.put([3]))
    await settle()
    assert not third.done(), "two items wait: the producer waits for the writer"
    w.release()  # [1] written; [2, 3] taken for the next write
    await asyncio.wait_for(third, 1)
    w.release()
    await out.close()
    assert w.written == [[1], [2, 3]]


async def test_a_failed_write_reaches_put_and_close() -> None:
    w = GatedWriter()
    w.fail_with = ConnectionResetError("client gone")
    out = Coalescer(w.write, concat)
    await out.put([1])
    w.release()
    await settle()
    with pytest.raises(ConnectionResetError):
        await out.put([2])
    with pytest.raises(ConnectionResetError):
        await out.close()
    out.cancel()  # after a failure: nothing left to cancel, no unretrieved error


async def test_cancel_drops_what_waits() -> None:
    w = GatedWriter()
    out = Coalescer(w.write, concat)
    await out.put([1])
    await out.put([2])
    await settle()
    out.cancel()
    await settle()
    w.release()
    await settle()
    assert w.written == []
    with pytest.raises(asyncio.CancelledError):
        await out.put([3])


async def test_interval_holds_later_items_and_close_does_not_wait_it_out() -> None:
    written: list[list[int]] = []

    async def write(item: list[int]) -> None:
        written.append(item)

    out = Coalescer(write, concat, interval_s=60.0)
    await out.put([1])
    await settle()
    assert written == [[1]], "the first item goes at once"
    await out.put([2])
    await out.put([3])
    await asyncio.sleep(0.05)
    assert written == [[1]], "later items wait out the interval"
    async with asyncio.timeout(5):
        await out.close()  # not 60 s: what waits goes out now
    assert written == [[1], [2, 3]]


async def test_an_item_after_a_quiet_interval_goes_at_once() -> None:
    written: list[list[int]] = []

    async def write(item: list[int]) -> None:
        written.append(item)

    out = Coalescer(write, concat, interval_s=0.01)
    await out.put([1])
    await asyncio.sleep(0.1)  # the interval has passed: the writer waits for items
    await out.put([2])
    await settle()
    assert written == [[1], [2]]
    out.cancel()


class Reading:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")


async def test_offer_pauses_the_reader_past_the_limit_and_resumes_it() -> None:
    w = GatedWriter()
    out = Coalescer(w.write, concat, limit=2)
    reader = Reading()
    out.offer([1], reader)
    await settle()  # [1] is in flight
    out.offer([2], reader)
    assert reader.calls == []
    out.offer([3], reader)
    assert reader.calls == ["pause"], "two items wait: reading stops"
    out.offer([4], reader)
    assert reader.calls == ["pause"], "paused once"
    w.release()  # [1] written; the writer takes [2, 3, 4]
    await settle()
    assert reader.calls == ["pause", "resume"]
    w.release()
    await out.close()
    assert w.written == [[1], [2, 3, 4]]
    out.offer([5], reader)  # after the end: dropped, not an error
    assert out.stopped


def test_merge_deltas_keeps_order_and_takes_the_last_counts() -> None:
    merged = merge_deltas(
        [
            TokenDelta("a", (1,), 7, 1),
            TokenDelta("", (2,), 7, 2),  # a stop-string hold-back: a token, no text yet
            TokenDelta("bc", (3, 4), 7, 4, "length"),
        ]
    )
    assert merged == TokenDelta("abc", (1, 2, 3, 4), 7, 4, "length")


def test_merge_chunks_joins_text_and_ids_and_keeps_the_last_usage() -> None:
    def chunk(text: str, ids: list[int], finish: str = "") -> bytes:
        c = inference_pb2.GenerateChunk(request_id="r", unit_id="u", text=text, token_ids=ids)
        if finish:
            c.finish_reason = finish
            c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens = 2, 3, 5
        return c.SerializeToString()

    merged = inference_pb2.GenerateChunk.FromString(
        merge_chunks([chunk("x", [5]), chunk("yy", [6]), chunk("z", [7], "stop")])
    )
    assert merged.text == "xyyz" and list(merged.token_ids) == [5, 6, 7]
    assert merged.request_id == "r" and merged.unit_id == "u"
    assert merged.finish_reason == "stop" and merged.usage.total_tokens == 5
    early = inference_pb2.GenerateChunk.FromString(merge_chunks([chunk("x", [5]), chunk("y", [6])]))
    assert early.finish_reason == "" and not early.HasField("usage")


@pytest.mark.parametrize("through", ["sidecar", "gateway"])
async def test_a_fast_engine_outruns_grpc_writes_and_nothing_is_lost(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    http: aiohttp.ClientSession,
    through: str,
) -> None:
    # 0 ms per step: the engine makes tokens faster than grpc.aio writes messages.
    sidecar = await start_sidecar(sim={"decode_step_ms": 0.0})
    target = sidecar.grpc_target
    if through == "gateway":
        target = (await start_gateway([sidecar])).grpc_target
    tokens = 400
    async with grpc.aio.insecure_channel(target) as channel:
        request = inference_pb2.GenerateRequest(
            prompt="same prompt", sampling=inference_pb2.SamplingParams(max_tokens=tokens, seed=3)
        )
        chunks = [
            c async for c in inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=10)
        ]
    # The same request, not streamed, over HTTP: the simulator is deterministic per seed.
    body = {"prompt": "same prompt", "max_tokens": tokens, "seed": 3}
    async with http.post(f"{sidecar.http_url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        whole = await resp.json()
    assert "".join(c.text for c in chunks) == whole["choices"][0]["text"]
    assert sum(len(c.token_ids) for c in chunks) == tokens
    assert len(chunks) < tokens, "messages that waited on a write went out merged"
    assert [c.finish_reason for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == tokens
    assert all(c.unit_id == sidecar.core.unit_id for c in chunks)
    await wait_until(lambda: sidecar.core.outstanding == 0, what="the lease released")

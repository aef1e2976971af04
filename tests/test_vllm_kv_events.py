"""Prefix affinity from what vLLM holds: the embedded engine's KV cache events reach
the sidecar's load report as the text chunks every gateway names, and a second
gateway replica, which never routed a prompt, sends a request sharing its long prefix
to the unit whose vLLM holds it.

Two sidecars with vLLM embedded (the tiny Llama of tests/vllm_model.py, started
together, 60-120 s on 2 CPU cores) serve the module's tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from engine.vllm import (
    KVEventNames,
    VllmEngine,
    block_key,
    kv_events_endpoint,
    kv_replay_endpoint,
    token_blocks,
)
from proxy.gateway.policies.prefix import PrefixAffinity
from proxy.gateway.request import prompt_text
from proxy.gateway.server import Gateway
from proxy.load import UnitState
from proxy.prefix_chunks import chunk_hashes
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests.conftest import sidecar_settings, wait_until
from tests.test_engine_vllm import (
    HAVE_VLLM,
    MODEL_NAME,
    needs_vllm,
    tiny_model,  # noqa: F401 (a fixture)
    vllm_engine_settings,
    vllm_env,  # noqa: F401 (a fixture)
)

CHUNK = 64  # characters per reported block, sidecars and gateways alike
START_TIMEOUT_S = 240  # two engines starting on a small box
SENTENCES = [
    "Once upon a time there was a proxy that routed requests to healthy units.",
    "A unit is one model replica spread over a leader and its followers.",
    "Load balancing picks the least outstanding requests among serving units.",
    "Tokens stream back to the client one delta at a time.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you, and you?",
]

with_vllm = [*needs_vllm[:2], pytest.mark.timeout(START_TIMEOUT_S), *needs_vllm[3:]]


def vllm_test(test: Any) -> Any:
    for mark in reversed(with_vllm):
        test = mark(test)
    return test


def shared_prefix(seed: int) -> str:
    """About 600 characters (150-odd tokens of the tiny tokenizer), different per seed
    from its first sentence on."""
    order = [(seed + i * (seed + 1)) % len(SENTENCES) for i in range(9)]
    return f"Tenant {seed}. " + " ".join(SENTENCES[k] for k in order)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sidecars(tiny_model: Path, vllm_env: None) -> AsyncIterator[list[Sidecar]]:  # noqa: F811
    engine = vllm_engine_settings(tiny_model)
    engine["engine_args"] = {**engine["engine_args"], "block_size": 32}
    async with contextlib.AsyncExitStack() as stack:
        units = [
            Sidecar(
                sidecar_settings(
                    engine=engine,
                    sidecar={
                        "unit_id": f"kv{i}",
                        "prefix_chunk_chars": CHUNK,
                        "report_interval_s": 0.2,
                    },
                    health={"stall_timeout_s": 10.0},
                )
            )
            for i in range(2)
        ]
        await asyncio.gather(*(stack.enter_async_context(u) for u in units))
        async with asyncio.timeout(START_TIMEOUT_S):
            while any(u.health.state is not UnitState.SERVING for u in units):
                await asyncio.sleep(0.05)
        yield units


def gateway_settings(units: list[Sidecar]) -> Any:
    return load(
        {
            "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
            "gateway": {
                "policy": "prefix",
                "prefix_chunk_chars": CHUNK,
                "units": [f"{u.core.unit_id}={u.http_url},{u.grpc_target}" for u in units],
            },
        }
    )


def held(unit: Sidecar) -> frozenset[int]:
    assert unit.core.held is not None, "the unit reports no prefix blocks"
    return frozenset(unit.core.held.full().added)


@vllm_test
async def test_vllms_kv_events_reach_the_load_report_as_the_gateways_chunks(
    sidecars: list[Sidecar],
) -> None:
    unit = sidecars[0]
    engine = unit.engine
    assert isinstance(engine, VllmEngine) and unit.core.held is not None
    before = held(unit)
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("completions", {"prompt": shared_prefix(100) + " Why?"}),
        ("chat/completions", {"messages": [
            {"role": "system", "content": shared_prefix(101)},
            {"role": "user", "content": "And then?"},
        ]}),
    ]  # fmt: skip
    async with aiohttp.ClientSession() as http:
        for route, body in bodies:
            body = {**body, "model": MODEL_NAME, "max_tokens": 2}
            async with http.post(f"{unit.http_url}/v1/{route}", json=body) as resp:
                assert resp.status == 200, await resp.text()
    for _, body in bodies:
        chunks = chunk_hashes(prompt_text(body), CHUNK, 512)
        # Held: the prompt's chunks whose text vLLM's stored blocks cover, in order
        # (the last block of the prompt may be partial, and so never stored).
        await wait_until(
            lambda chunks=chunks: set(chunks[: len(chunks) - 2]) <= held(unit),  # type: ignore[misc]
            10,
            "vLLM's stored blocks named as the prompt's chunks",
        )
        assert chunks[0] not in before, "held since these requests"
    report = unit.core.report()
    assert report.prefix_blocks is not None and report.prefix_blocks.chunk_chars == CHUNK
    assert set(report.prefix_blocks.added) == held(unit)


@vllm_test
async def test_a_second_gateway_replica_sends_a_shared_prefix_to_the_unit_that_holds_it(
    sidecars: list[Sidecar],
) -> None:
    settings = gateway_settings(sidecars)
    async with Gateway(settings) as a, Gateway(settings) as b:
        for gw in (a, b):
            await wait_until(
                lambda gw=gw: (
                    all(  # type: ignore[misc]
                        u.report is not None for u in gw.router.units.values()
                    )
                    and len(gw.router.units) == 2
                ),
                10,
                "both units' first reports",
            )
        policy = b.router.policy
        assert isinstance(policy, PrefixAffinity)
        served: dict[int, str] = {}
        async with aiohttp.ClientSession() as http:
            for i in range(4):
                body = {
                    "model": MODEL_NAME,
                    "prompt": shared_prefix(i) + " First.",
                    "max_tokens": 2,
                }
                async with http.post(f"{a.http_url}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    served[i] = resp.headers["x-unitproxy-unit"]
            # Replica B routed none of them, and holds what each engine reported.
            for i, unit in served.items():
                want = set(chunk_hashes(shared_prefix(i), CHUNK, 512)[:4])
                await wait_until(
                    lambda unit=unit, want=want: want <= set(policy.engine.held(unit)),  # type: ignore[misc]
                    10,
                    f"replica B's view of {unit}",
                )
            assert len(set(served.values())) == 2, "both units hold some prefix"
            # and B has heard that A's requests ended: a report taken while one of them
            # waited for prefill says its unit has a queue, and B weighs that (rightly)
            # against prefilling the prefix again at the idle unit
            await wait_until(
                lambda: all(b.router.view.estimate(u) == 0 for u in b.router.units.values()),
                10,
                "replica B's reports of both units idle",
            )
            for i in range(4):
                body = {
                    "model": MODEL_NAME,
                    "prompt": shared_prefix(i) + " Second, other words.",
                    "max_tokens": 2,
                }
                async with http.post(f"{b.http_url}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-unitproxy-unit"] == served[i], f"prefix {i} via B"


# -- vLLM's events, without an engine ---------------------------------------------------


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here")
def test_vllms_block_hashes_are_renamed_by_their_tokens_as_a_prompt_is_cut() -> None:
    from vllm.distributed import kv_events as vllm_events

    from engine.kv_events import BlockRemoved, BlockStored

    def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> Any:
        return vllm_events.BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )

    names = KVEventNames()
    ids, ends = [5, 6, 7, 8, 9], [1, 2, 3, 4, 5]
    spans = token_blocks(ids, ends, 2)  # two full blocks; the fifth token is left over
    k1 = block_key(None, [5, 6])
    k2 = block_key(k1, [7, 8])
    assert spans == [(k1, 2), (k2, 4)]
    out = names.translate([stored([b"a"], None, [5, 6]), stored([b"b"], b"a", [7, 8])])
    assert out == [BlockStored((k1,), None, 2), BlockStored((k2,), k1, 2)]
    assert names.block_size == 2  # as the engine core's events say it
    # A block after one never named here cannot be named either.
    assert names.translate([stored([b"z"], b"unknown", [1, 2])]) == []
    # An offloading tier's copy is not what a prefill finds.
    cpu = vllm_events.BlockRemoved(block_hashes=[b"a"], medium="CPU")
    assert names.translate([cpu]) == []
    gone = vllm_events.BlockRemoved(block_hashes=[b"b", b"z"], medium="GPU")
    assert names.translate([gone]) == [BlockRemoved((k2,))]
    assert len(names) == 1


def test_the_replay_endpoint_is_beside_this_process_own_or_the_one_configured() -> None:
    assert kv_replay_endpoint({"model": "m"}, "ipc:///tmp/e") == "ipc:///tmp/e-replay"
    configured = {"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:5558"}
    assert kv_replay_endpoint({"kv_events_config": configured}, "x") == "tcp://127.0.0.1:5558"
    none = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"}
    assert kv_replay_endpoint({"kv_events_config": none}, "tcp://127.0.0.1:5557") is None


@vllm_test
@pytest.mark.parametrize("buffered", [100, 1])
async def test_batches_a_reader_missed_are_replayed_from_vllms_buffer(
    tiny_model: Path,  # noqa: F811 (a fixture)
    tmp_path: Path,
    buffered: int,
) -> None:
    """vLLM's own publisher (its PUB and replay ROUTER sockets) sends batches 0 and 1
    before the sidecar's reader subscribes: the reader, seeing batch 2 first, asks the
    replay socket for 0 and 1 and names the whole chain; where vLLM's buffer no longer
    has them (one batch kept), the reader's listener is emptied and told only what it
    can name."""
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed import kv_events as vllm_events

    from engine.kv_events import AllBlocksCleared, BlockStored

    endpoint = f"ipc://{tmp_path}/kv"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": endpoint + "-replay", "buffer_steps": buffered}  # fmt: skip
    settings = vllm_engine_settings(tiny_model)
    settings["engine_args"] = {**settings["engine_args"], "kv_events_config": config}
    engine = VllmEngine(load({"engine": settings}).engine)
    heard: list[Any] = []
    assert engine.subscribe_kv_events(heard.extend)

    def batch(i: int) -> Any:
        parent = None if i == 0 else bytes([i - 1])
        stored = vllm_events.BlockStored(
            block_hashes=[bytes([i])], parent_block_hash=parent, token_ids=[2 * i, 2 * i + 1],
            block_size=2, lora_id=None, medium="GPU", lora_name=None,
        )  # fmt: skip
        return vllm_events.KVEventBatch(ts=0.0, events=[stored])

    publisher = vllm_events.ZmqEventPublisher(
        0, endpoint=endpoint, replay_endpoint=endpoint + "-replay", buffer_steps=buffered
    )
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    reader: asyncio.Task[None] | None = None
    try:
        publisher.publish(batch(0))
        publisher.publish(batch(1))
        await asyncio.sleep(0.3)  # published, to nobody
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoint)
        decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
        reader = asyncio.create_task(engine._read_kv_events(socket, decoder.decode, context))
        sent = 2
        while not heard and sent < 40:  # until the subscription has joined
            publisher.publish(batch(sent))
            sent += 1
            await asyncio.sleep(0.1)
        await wait_until(lambda: len(heard) >= (sent if buffered > 1 else 1), timeout_s=10)
    finally:
        if reader is not None:
            reader.cancel()
        socket.close(linger=0)
        context.destroy(linger=0)
        publisher.shutdown()
    keys: list[int] = []
    for i in range(sent):
        keys.append(block_key(keys[-1] if keys else None, [2 * i, 2 * i + 1]))
    if buffered > 1:  # every batch, in order, the chain named from its first block
        assert heard == [
            BlockStored((k,), keys[i - 1] if i else None, 2) for i, k in enumerate(keys)
        ]
    else:  # gone: what was held is dropped; the chain's later blocks cannot be named
        assert heard[0] == AllBlocksCleared()
        assert not any(isinstance(e, BlockStored) for e in heard)


def test_the_kv_events_endpoint_is_this_process_own_or_the_one_configured() -> None:
    own = kv_events_endpoint({"model": "m"})
    assert own is not None and own.startswith("ipc://")
    assert kv_events_endpoint({"model": "m", "data_parallel_size": 2}) is None
    assert kv_events_endpoint({"model": "m", "enable_prefix_caching": False}) is None
    configured = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"}
    assert kv_events_endpoint({"kv_events_config": configured}) == "tcp://127.0.0.1:5557"
    off = {"enable_kv_cache_events": False}
    assert kv_events_endpoint({"kv_events_config": off}) is None
    elsewhere = {"enable_kv_cache_events": True, "endpoint": "tcp://10.0.0.1:5557"}
    assert kv_events_endpoint({"kv_events_config": elsewhere}) is None

"""Engine kind openai against real servers on loopback.

The upstream is a unitproxy sidecar on the sim engine (a real OpenAI-compatible
server) or, for /metrics and /health, a small aiohttp server serving Prometheus text
in vLLM's format with failure knobs: vLLM's own server is an edge we do not own, and
its run against ``vllm serve`` lives in test_engine_vllm.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from engine import EngineUnavailable, create_engine
from engine.base import ChatMessage, Engine, EngineRequest, SamplingParams, TokenDelta
from engine.openai_upstream import OpenAIUpstreamEngine, parse_metrics, sse_events
from proxy.errors import EngineDeadError, EngineError, InvalidRequest, NotFound
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests.conftest import SidecarFactory, wait_until
from tests.procs import free_ports

pytestmark = pytest.mark.timeout(30)

EngineFactory = Callable[..., Awaitable[OpenAIUpstreamEngine]]

# What vLLM 0.32's /metrics shows for these gauges (one engine), with neighbours.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="tiny"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {waiting}
# HELP vllm:{kv_name} KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:{kv_name} gauge
vllm:{kv_name}{{engine="0",model_name="tiny"}} {kv}
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="tiny"}} 1234.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="tiny"}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="tiny"}} 7.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="tiny"}} 7.0
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="tiny"}} 0.42
"""


@dataclass
class FakeVllmMetrics:
    """Knobs of the fake upstream's /metrics and /health."""

    running: float = 3.0
    waiting: float = 2.0
    kv: float = 0.25
    kv_name: str = "kv_cache_usage_perc"
    status: int = 200
    hang: bool = False
    health_status: int = 200

    def text(self) -> str:
        return VLLM_METRICS.format(
            running=self.running, waiting=self.waiting, kv=self.kv, kv_name=self.kv_name
        )


@pytest.fixture
async def fake_upstream() -> AsyncIterator[tuple[str, FakeVllmMetrics]]:
    knobs = FakeVllmMetrics()
    unhang = asyncio.Event()  # set at teardown, so the server can stop

    async def metrics(request: web.Request) -> web.Response:
        if knobs.hang:
            await unhang.wait()
        if knobs.status != 200:
            return web.Response(status=knobs.status, text="broken")
        return web.Response(text=knobs.text(), content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=knobs.health_status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", knobs
    finally:
        unhang.set()
        await runner.cleanup()


@pytest.fixture
async def start_engine() -> AsyncIterator[EngineFactory]:
    started: list[Engine] = []

    async def start(url: str, **engine: Any) -> OpenAIUpstreamEngine:
        settings = load({"engine": {"kind": "openai", "upstream_url": url, **engine}})
        created = create_engine(settings.engine)
        assert isinstance(created, OpenAIUpstreamEngine)
        await created.start()
        started.append(created)
        return created

    yield start
    for e in started:
        await e.stop()


async def collect(engine: Engine, request: EngineRequest) -> list[TokenDelta]:
    async with aclosing(engine.generate(request)) as deltas:
        return [d async for d in deltas]


def completion(prompt: str = "once upon a time", max_tokens: int = 6, **kw: Any) -> EngineRequest:
    return EngineRequest("r-1", prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, **kw))


# -- against a real OpenAI-compatible server (a unitproxy sidecar on the sim engine) ----


async def test_streams_completions_token_ids_and_chat_with_usage(
    start_sidecar: SidecarFactory, start_engine: EngineFactory, http: aiohttp.ClientSession
) -> None:
    upstream = await start_sidecar()
    engine = await start_engine(upstream.http_url)
    assert engine.model_name == "unitproxy-sim", "learned from the upstream's /v1/models"

    deltas = await collect(engine, completion(max_tokens=6))
    assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"]
    assert [d.completion_tokens for d in deltas] == [1, 2, 3, 4, 5, 6]
    assert deltas[-1].prompt_tokens == 4, "usage of the final chunk"
    body = {"prompt": "once upon a time", "max_tokens": 6}
    async with http.post(f"{upstream.http_url}/v1/completions", json=body) as resp:
        whole = await resp.json()
    assert "".join(d.text for d in deltas) == whole["choices"][0]["text"]

    ids = await collect(engine, EngineRequest("r-2", prompt_token_ids=(5, 6, 7)))
    assert ids[-1].prompt_tokens == 3 and ids[-1].finish_reason == "length"

    chat = EngineRequest(
        "r-3", messages=(ChatMessage("user", "hello there"),), sampling=SamplingParams(max_tokens=4)
    )
    chat_deltas = await collect(engine, chat)
    assert len(chat_deltas) == 4 and all(d.text for d in chat_deltas), "no empty role chunk"
    assert chat_deltas[-1].completion_tokens == 4
    await engine.check_health()
    assert upstream.core.outstanding == 0


async def test_continues_a_final_message_and_counts_tokens(
    start_sidecar: SidecarFactory, start_engine: EngineFactory
) -> None:
    upstream = await start_sidecar()
    engine = await start_engine(upstream.http_url)
    messages = (ChatMessage("user", "hello there"),)
    whole = await collect(
        engine, EngineRequest("c", messages=messages, sampling=SamplingParams(max_tokens=9))
    )
    partial = ChatMessage("assistant", "".join(d.text for d in whole[:4]))
    continued = EngineRequest(
        "c",
        messages=(*messages, partial),
        sampling=SamplingParams(max_tokens=5),
        add_generation_prompt=False,
        continue_final_message=True,
    )
    rest = await collect(engine, continued)
    assert [d.text for d in rest] == [d.text for d in whole[4:]], "the upstream continued it"
    # No /tokenize upstream (a sidecar has none): the estimate, which is the sim's own count.
    assert await engine.count_tokens(partial.content) == 4
    nothing_left = await collect(engine, completion(max_tokens=0))
    assert nothing_left == [TokenDelta("", (), 4, 0, "length")]
    assert upstream.core.outstanding == 0


async def test_closing_the_iterator_aborts_the_upstream_request(
    start_sidecar: SidecarFactory, start_engine: EngineFactory
) -> None:
    upstream = await start_sidecar(sim={"decode_step_ms": 20.0})
    engine = await start_engine(upstream.http_url)
    deltas = engine.generate(completion(max_tokens=10_000))
    await anext(deltas)
    await anext(deltas)
    assert upstream.core.outstanding == 1
    await deltas.aclose()
    await wait_until(lambda: upstream.core.outstanding == 0, what="upstream request aborted")
    assert upstream.engine.stats().running == 0


async def test_cancelling_the_consumer_aborts_the_upstream_request(
    start_sidecar: SidecarFactory, start_engine: EngineFactory
) -> None:
    upstream = await start_sidecar(sim={"decode_step_ms": 20.0})
    engine = await start_engine(upstream.http_url)

    async def consume() -> None:
        await collect(engine, completion(max_tokens=10_000))

    task = asyncio.create_task(consume())
    await wait_until(lambda: upstream.engine.stats().running == 1, what="upstream running")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: upstream.core.outstanding == 0, what="upstream request aborted")


async def test_upstream_errors_map_onto_our_error_tree(
    start_sidecar: SidecarFactory, start_engine: EngineFactory
) -> None:
    upstream = await start_sidecar(sim={"error_after_tokens": 2})
    engine = await start_engine(upstream.http_url)
    with pytest.raises(EngineError, match="simulated engine error"):
        await collect(engine, completion(max_tokens=5))
    with pytest.raises(InvalidRequest, match="temperature"):
        await collect(engine, completion(temperature=7.0))

    wrong_model = await start_engine(upstream.http_url, model="no-such-model")
    with pytest.raises(NotFound, match="no-such-model"):
        await collect(wrong_model, completion())
    assert upstream.core.outstanding == 0


async def test_unreachable_upstream_is_dead_and_unknown_load(
    start_engine: EngineFactory,
) -> None:
    (port,) = free_ports(1)
    engine = await start_engine(f"http://127.0.0.1:{port}", model="m")
    with pytest.raises(EngineDeadError, match="unreachable"):
        await collect(engine, completion())
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    assert engine.stats().kv_cache_usage == -1.0
    with pytest.raises(EngineError, match="give --model"):
        await start_engine(f"http://127.0.0.1:{port}")


def test_settings_need_an_upstream_url() -> None:
    with pytest.raises(EngineUnavailable, match="--upstream-url"):
        create_engine(load({"engine": {"kind": "openai"}}).engine)


async def test_sidecar_in_front_of_a_sidecar_serves_the_openai_client(
    start_sidecar: SidecarFactory,
) -> None:
    upstream = await start_sidecar(sidecar={"unit_id": "upstream"})
    front: Sidecar = await start_sidecar(
        sidecar={"unit_id": "front"},
        engine={"kind": "openai", "upstream_url": f"{upstream.http_url}/v1"},
    )
    async with openai.AsyncOpenAI(
        base_url=f"{front.http_url}/v1", api_key="unused", max_retries=0
    ) as client:
        stream = await client.chat.completions.create(
            model="unitproxy-sim",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 5
    assert front.core.report().kv_cache_usage == -1.0, "a sidecar serves no vllm: gauges"
    assert front.core.outstanding == 0 and upstream.core.outstanding == 0


# -- load from /metrics and health from /health, on a fake upstream with knobs -----------


async def test_load_comes_from_vllm_gauges_and_goes_unknown_on_failure(
    fake_upstream: tuple[str, FakeVllmMetrics], start_engine: EngineFactory
) -> None:
    url, knobs = fake_upstream
    engine = await start_engine(url, model="tiny", upstream_metrics_interval_s=0.02)
    await wait_until(lambda: engine.stats().running == 3, what="running from /metrics")
    assert (engine.stats().waiting, engine.stats().kv_cache_usage) == (2, 0.25)

    knobs.running, knobs.kv_name, knobs.kv = 1.0, "gpu_cache_usage_perc", 0.5
    await wait_until(lambda: engine.stats().kv_cache_usage == 0.5, what="the older gauge name")
    assert engine.stats().running == 1

    knobs.status = 500
    await wait_until(lambda: engine.stats().kv_cache_usage == -1.0, what="unknown on 500")
    assert engine.stats().running == 0
    knobs.status = 200
    await wait_until(lambda: engine.stats().kv_cache_usage == 0.5, what="back after 500")


async def test_a_hung_metrics_endpoint_times_out_to_unknown(
    fake_upstream: tuple[str, FakeVllmMetrics], start_engine: EngineFactory
) -> None:
    url, knobs = fake_upstream
    engine = await start_engine(
        url, model="tiny", upstream_metrics_interval_s=0.02, upstream_timeout_s=0.2
    )
    await wait_until(lambda: engine.stats().running == 3, what="running from /metrics")
    knobs.hang = True
    await wait_until(lambda: engine.stats().kv_cache_usage == -1.0, what="unknown after hang")


async def test_health_follows_the_upstream_health_endpoint(
    fake_upstream: tuple[str, FakeVllmMetrics], start_engine: EngineFactory
) -> None:
    url, knobs = fake_upstream
    engine = await start_engine(url, model="tiny")
    await engine.check_health()
    knobs.health_status = 503
    with pytest.raises(EngineError, match="503"):
        await engine.check_health()


def test_parse_metrics_sums_engines_and_averages_kv_usage() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4\n'
    )
    stats = parse_metrics(text)
    assert (stats.running, stats.waiting) == (5, 4)
    assert stats.kv_cache_usage == pytest.approx(0.3)
    assert parse_metrics("# nothing here\n").kv_cache_usage == -1.0
    assert parse_metrics("# nothing here\n").prefix_cache_hit_rate == -1.0


def test_parse_metrics_reads_vllms_prefix_cache_counters() -> None:
    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0\n'
    )
    stats = parse_metrics(text)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (1000, 250)
    assert stats.prefix_cache_hit_rate == 0.25


async def test_sse_events_survive_any_split_crlf_and_comments() -> None:
    raw = b': keep-alive\r\n\r\ndata: {"a": 1}\r\n\r\nevent: x\ndata: [DONE]\n\n'

    async def pieces(size: int) -> AsyncIterator[bytes]:
        for i in range(0, len(raw), size):
            yield raw[i : i + size]

    for size in (1, 3, 7, len(raw)):
        assert [e async for e in sse_events(pieces(size))] == ['{"a": 1}', "[DONE]"]

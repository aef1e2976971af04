"""Engine vllm serves vLLM's whole OpenAI API: the same answers as vLLM's own server.

Differential: the tiny Llama served by ``python -m vllm.entrypoints.openai.api_server``
and by a sidecar with the engine embedded, behind a gateway; the same requests with
the real `openai` SDK at temperature 0 to both; the answers compared (the weights are
random: the arguments of a tool call are whatever the model makes of the schema, so
the two answers are compared rather than judged). Needs a vLLM build (marked
``vllm``); one ``vllm serve``, one sidecar and one gateway serve the module.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from proxy.gateway.server import Gateway
from proxy.load import UnitState
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests import test_engine_openai_vllm, test_engine_vllm
from tests.conftest import sidecar_settings, signed_hint, wait_until
from tests.test_engine_vllm import (
    MODEL_NAME,
    VLLM_TEST_TIMEOUT_S,
    needs_vllm,
    vllm_engine_settings,
)

tiny_model = test_engine_vllm.tiny_model  # the fixtures, shared
vllm_env = test_engine_vllm.vllm_env
# vLLM 0.32 asks for a tool parser (which it loads only with auto tool choice on) for
# tool_choice "required" and named too; any parser will do for those (the output is
# constrained to the tools' schema), as long as both servers use the same one.
TOOL_PARSER = "pythonic"
# A random model fills a JSON grammar's optional whitespace forever: none allowed.
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}

# The first test pays for two engines' start (vLLM's server and the sidecar's).
LAYER_MARKS = [m for m in needs_vllm if m.name != "timeout"]
LAYER_MARKS.append(pytest.mark.timeout(3 * VLLM_TEST_TIMEOUT_S))


def with_vllm(test: Any) -> Any:
    for mark in reversed(LAYER_MARKS):
        test = mark(test)
    return test


TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            # One boolean: random weights end a constrained answer quickly only when
            # the schema leaves nothing open (a string argument can run to max_tokens).
            "parameters": {
                "type": "object",
                "properties": {"metric": {"type": "boolean"}},
                "required": ["metric"],
                "additionalProperties": False,
            },
        },
    }
]
SCHEMA: Any = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_serve(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """vLLM's own server on the tiny model, with the tool parser; its base URL."""
    extra = ["--enable-auto-tool-choice", "--tool-call-parser", TOOL_PARSER]
    extra += ["--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS)]
    async with test_engine_openai_vllm.started_vllm_serve(
        tiny_model, tmp_path_factory, *extra
    ) as url:
        yield url


def layer_engine_settings(model: Path) -> dict[str, Any]:
    settings = vllm_engine_settings(model)
    settings["engine_args"] = {
        **settings["engine_args"],
        "structured_outputs_config": STRUCTURED_OUTPUTS,
    }
    return {**settings, "tool_call_parser": TOOL_PARSER, "enable_auto_tool_choice": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sidecar(tiny_model: Path, vllm_env: None) -> AsyncIterator[Sidecar]:
    settings = sidecar_settings(
        engine=layer_engine_settings(tiny_model),
        sidecar={"unit_id": "unit-layer"},
        health={"stall_timeout_s": 30.0},
    )
    async with Sidecar(settings) as running:
        async with asyncio.timeout(VLLM_TEST_TIMEOUT_S):
            while running.health.state is not UnitState.SERVING:
                await asyncio.sleep(0.05)
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(sidecar: Sidecar) -> AsyncIterator[Gateway]:
    settings = load(
        {
            "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
            "gateway": {"units": [f"unit-layer={sidecar.http_url},{sidecar.grpc_target}"]},
        }
    )
    async with Gateway(settings) as gw:
        await wait_until(lambda: len(gw.router.serving()) == 1, 10, "gateway sees the unit")
        yield gw


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def both(vllm_serve: str, gateway: Gateway, call: Any) -> tuple[Any, Any]:
    """The same call to vLLM's own server and through the gateway to the sidecar."""
    async with _client(vllm_serve) as theirs, _client(gateway.http_url) as ours:
        return await call(theirs), await call(ours)


@with_vllm
async def test_tool_choice_required_gives_the_same_tool_call(
    vllm_serve: str, gateway: Gateway, sidecar: Sidecar
) -> None:
    async def call(oa: openai.AsyncOpenAI) -> Any:
        return await oa.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,  # else a random model calls the tool again and again
            temperature=0,
            max_tokens=100,
        )

    theirs, ours = await both(vllm_serve, gateway, call)
    for answer in (theirs, ours):
        calls = answer.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather"
    assert [c.function.arguments for c in ours.choices[0].message.tool_calls] == [
        c.function.arguments for c in theirs.choices[0].message.tool_calls
    ]
    assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason
    assert ours.usage == theirs.usage
    assert sidecar.core.outstanding == 0


@with_vllm
async def test_named_tool_choice_streamed(vllm_serve: str, gateway: Gateway) -> None:
    async def call(oa: openai.AsyncOpenAI) -> Any:
        stream = await oa.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
        )
        name, args, usage = "", "", None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                for tc in choice.delta.tool_calls or []:
                    name += (tc.function and tc.function.name) or ""
                    args += (tc.function and tc.function.arguments) or ""
        return name, args, usage

    theirs, ours = await both(vllm_serve, gateway, call)
    assert ours == theirs and ours[0] == "get_weather"


@with_vllm
async def test_json_schema_gives_the_same_answer(vllm_serve: str, gateway: Gateway) -> None:
    async def call(oa: openai.AsyncOpenAI) -> Any:
        return await oa.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            response_format=SCHEMA,
            temperature=0,
            max_tokens=32,
        )

    theirs, ours = await both(vllm_serve, gateway, call)
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason
    assert ours.usage == theirs.usage
    if theirs.choices[0].finish_reason == "stop":
        assert json.loads(ours.choices[0].message.content or "") in ({"ok": True}, {"ok": False})


@with_vllm
async def test_logprobs_with_two_choices(vllm_serve: str, gateway: Gateway) -> None:
    async def call(oa: openai.AsyncOpenAI) -> Any:
        return await oa.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            temperature=1.0,  # vLLM refuses n > 1 with greedy sampling
            seed=7,
            max_tokens=6,
            n=2,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )

    theirs, ours = await both(vllm_serve, gateway, call)
    assert len(ours.choices) == 2
    for choice in ours.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        assert len(choice.logprobs.content) == 6
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert [c.message.content for c in ours.choices] == [c.message.content for c in theirs.choices]
    assert ours.usage == theirs.usage


@with_vllm
async def test_completions_echo_logprobs_batch_and_continuous_usage(
    vllm_serve: str, gateway: Gateway
) -> None:
    async def call(oa: openai.AsyncOpenAI) -> Any:
        batch = await oa.completions.create(
            model=MODEL_NAME,
            prompt=["Once upon a time", "The quick brown fox"],
            temperature=0,
            max_tokens=4,
            echo=True,
            logprobs=1,
        )
        stream = await oa.completions.create(
            model=MODEL_NAME,
            prompt="Hello",
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body={"ignore_eos": True},
        )
        # Without continuous_usage_stats a chunk that carries text has no usage.
        counts = [c.usage and c.usage.completion_tokens async for c in stream if c.choices]
        return [(c.text, c.logprobs and c.logprobs.tokens) for c in batch.choices], counts

    theirs, ours = await both(vllm_serve, gateway, call)
    assert ours[0] == theirs[0], "echoed text and logprob tokens of the batch"
    texts = ours[0]
    assert texts[0][0].startswith("Once upon a time") and texts[1][0].startswith("The quick")
    # Usage in every chunk that carries text. How many such chunks there are is timing:
    # vLLM merges tokens into one chunk when its output handler falls behind the engine
    # (a busy box), on both servers alike, so only the counts' order and end are fixed.
    for counts in (ours[1], theirs[1]):
        assert counts and None not in counts, counts
        assert counts == sorted(set(counts)) and counts[-1] == 8, counts


@with_vllm
async def test_tokenize_detokenize_and_models_retrieve(vllm_serve: str, sidecar: Sidecar) -> None:
    results = []
    async with aiohttp.ClientSession() as http:
        for url in (vllm_serve, sidecar.http_url):
            body = {"model": MODEL_NAME, "prompt": "Hello there"}
            async with http.post(f"{url}/tokenize", json=body) as resp:
                assert resp.status == 200
                tokens = await resp.json()
            body = {"model": MODEL_NAME, "tokens": tokens["tokens"]}
            async with http.post(f"{url}/detokenize", json=body) as resp:
                assert resp.status == 200
                text = await resp.json()
            results.append((tokens, text))
    assert results[0] == results[1]
    assert results[1][1]["prompt"] == "Hello there"
    async with _client(sidecar.http_url) as oa:
        card = await oa.models.retrieve(MODEL_NAME)
        assert card.id == MODEL_NAME
    assert sidecar.core.outstanding == 0


async def _sse(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> list[dict[str, Any]]:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@with_vllm
async def test_a_resumed_stream_continues_the_unfailed_one(sidecar: Sidecar) -> None:
    """The gateway's resume (x-unitproxy-resume) at temperature 0: the rest of the
    unfailed stream, same id and created, no role chunk, usage as for one request."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "return_token_ids": True,
    }
    headers = {"x-request-id": "resume-1"}
    async with aiohttp.ClientSession() as http:
        whole = await _sse(http, sidecar.http_url, body, headers)
        pieces = [c for c in whole if c["choices"] and c["choices"][0]["delta"].get("content")]
        texts = [c["choices"][0]["delta"]["content"] for c in pieces]
        ids = [c["choices"][0].get("token_ids") or [] for c in pieces]
        # A cut where the delivered text tokenizes back to the tokens generated (vLLM
        # continues from the text: a cut inside a merge would change what it sees).
        cut = None
        for k in range(len(texts) - 2, 1, -1):
            tok = {"model": MODEL_NAME, "prompt": "".join(texts[:k]), "add_special_tokens": False}
            async with http.post(f"{sidecar.http_url}/tokenize", json=tok) as resp:
                if (await resp.json())["tokens"] == [t for i in ids[:k] for t in i]:
                    cut = k
                    break
        assert cut is not None, f"no clean cut in {texts}"
        delivered = "".join(texts[:cut])
        resumed_body = {
            **body,
            "messages": [*MESSAGES, {"role": "assistant", "content": delivered}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        hint = signed_hint(delivered, whole[0]["created"])
        rest = await _sse(
            http, sidecar.http_url, resumed_body, {**headers, "x-unitproxy-resume": hint}
        )
    assert all("role" not in (c["choices"] or [{"delta": {}}])[0]["delta"] for c in rest)
    rest_texts = [c["choices"][0]["delta"].get("content") for c in rest if c["choices"]]
    assert "".join(t or "" for t in rest_texts) == "".join(texts[cut:])
    assert {c["created"] for c in rest} == {whole[0]["created"]}
    assert {c["id"] for c in rest} == {whole[0]["id"]} == {"chatcmpl-resume-1"}
    assert rest[-1]["usage"] == whole[-1]["usage"]
    assert sidecar.core.outstanding == 0


@with_vllm
async def test_a_resume_with_nothing_left_is_the_finish_alone(sidecar: Sidecar) -> None:
    """Every token was delivered before the cut: the resumed answer is the finish
    (length) and the usage of the unfailed stream."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    headers = {"x-request-id": "resume-2"}
    async with aiohttp.ClientSession() as http:
        whole = await _sse(http, sidecar.http_url, body, headers)
        delivered = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in whole if c["choices"]
        )
        resumed_body = {
            **body,
            "messages": [*MESSAGES, {"role": "assistant", "content": delivered}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        hint = signed_hint(delivered, whole[0]["created"])
        rest = await _sse(
            http, sidecar.http_url, resumed_body, {**headers, "x-unitproxy-resume": hint}
        )
    assert rest[0]["choices"][0]["finish_reason"] == "length"
    assert rest[0]["choices"][0]["delta"] == {"content": ""}
    assert {c["id"] for c in rest} == {"chatcmpl-resume-2"}
    assert {c["created"] for c in rest} == {whole[0]["created"]}
    assert rest[-1]["usage"] == whole[-1]["usage"]
    assert sidecar.core.outstanding == 0

"""Engine openai's HTTP routes: the client's body reaches the upstream unchanged.

The upstream is a recording OpenAI server on loopback (an edge we do not own): it
keeps every body it was sent and answers with tool calls, JSON content or a stream,
so the tests see both what went up and what came back, with the real `openai` SDK,
to the sidecar directly and through the gateway.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from proxy.sidecar.server import Sidecar
from tests.conftest import GatewayFactory, SidecarFactory, signed_hint

pytestmark = pytest.mark.timeout(30)

MODEL = "upstream-model"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
# An agent loop's second turn: the assistant's tool call and the tool's answer.
AGENT_MESSAGES: list[Any] = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@dataclass
class Recorder:
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    forms: list[tuple[str, bytes]] = field(default_factory=list)  # (content type, bytes)

    @property
    def last(self) -> dict[str, Any]:
        return self.bodies[-1]


def _chat_answer(body: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": '{"city": "Paris"}'}
    finish = "stop"
    if body.get("tool_choice") == "required":
        message = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
        finish = "tool_calls"
    return {
        "id": "chatcmpl-up",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
    }


def _completion_answer(body: dict[str, Any]) -> dict[str, Any]:
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    choices = [
        {"index": i, "text": f" answer {i}", "logprobs": None, "finish_reason": "length"}
        for i in range(len(prompts))
    ]
    return {
        "id": "cmpl-up",
        "object": "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": choices,
        "usage": {"prompt_tokens": 4, "completion_tokens": 2 * len(prompts), "total_tokens": 9},
    }


TRANSCRIPT = "the upstream heard this"
WAV = b"RIFF" + bytes(range(256)) + b"\r\n--not-a-boundary\r\n"

STREAM_EVENTS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, **TOOL_CALL}]},
                "finish_reason": None,
            }
        ]
    },
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
]


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = Recorder()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rec.bodies.append(body)
        if not body.get("stream"):
            return web.json_response(_chat_answer(body))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in STREAM_EVENTS:
            chunk = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1}
            chunk |= {"model": MODEL, **event}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        rec.bodies.append(body)
        return web.json_response(_completion_answer(body))

    async def audio(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        rec.forms.append((request.headers["Content-Type"], raw))
        if b'name="stream"\r\n\r\ntrue' in raw:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for word in TRANSCRIPT.split(" "):
                delta = {"type": "transcript.text.delta", "delta": word + " "}
                await response.write(f"data: {json.dumps(delta)}\n\n".encode())
            done = {"type": "transcript.text.done", "text": TRANSCRIPT}
            await response.write(f"data: {json.dumps(done)}\n\n".encode())
            return response
        if b'name="response_format"\r\n\r\ntext' in raw:
            return web.Response(text=TRANSCRIPT, content_type="text/plain")
        return web.json_response({"text": TRANSCRIPT})

    async def models(request: web.Request) -> web.Response:
        card = {"id": MODEL, "object": "model", "created": 1, "owned_by": "vllm",
                "root": "/models/upstream", "parent": None, "max_model_len": 4096,
                "permission": [{"id": "modelperm-1", "object": "model_permission"}]}  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/audio/transcriptions", audio)
    app.router.add_post("/v1/audio/translations", audio)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    rec.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield rec
    finally:
        await runner.cleanup()


async def _sidecar(start_sidecar: SidecarFactory, recorder: Recorder) -> Sidecar:
    return await start_sidecar(engine={"kind": "openai", "upstream_url": recorder.url})


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture(params=["sidecar", "gateway"])
async def base_url(
    request: pytest.FixtureRequest,
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    recorder: Recorder,
) -> str:
    sidecar = await _sidecar(start_sidecar, recorder)
    if request.param == "sidecar":
        return sidecar.http_url
    gateway = await start_gateway([sidecar])
    return gateway.http_url


async def test_tools_and_agent_messages_reach_the_upstream_unchanged(
    base_url: str, recorder: Recorder
) -> None:
    async with _client(base_url) as client:
        answer = await client.chat.completions.create(
            model=MODEL,
            messages=AGENT_MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
        )
    sent = recorder.last
    assert sent["messages"] == AGENT_MESSAGES, "tool_calls and tool_call_id kept"
    assert sent["tools"] == TOOLS and sent["tool_choice"] == "required"
    assert sent["parallel_tool_calls"] is False
    assert "temperature" not in sent and "top_p" not in sent, "no sampling defaults of ours"
    calls = answer.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_weather"
    assert answer.choices[0].finish_reason == "tool_calls"
    assert answer.usage is not None and answer.usage.completion_tokens == 5


async def test_response_format_reaches_the_upstream(base_url: str, recorder: Recorder) -> None:
    async with _client(base_url) as client:
        answer = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "city?"}],
            response_format=SCHEMA,  # type: ignore[arg-type]
            temperature=0,
        )
    assert recorder.last["response_format"] == SCHEMA
    assert recorder.last["temperature"] == 0
    assert json.loads(answer.choices[0].message.content or "") == {"city": "Paris"}


async def test_streamed_tool_calls_come_back_as_the_upstream_sent_them(
    base_url: str, recorder: Recorder
) -> None:
    async with _client(base_url) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "weather?"}],
            tools=TOOLS,
            tool_choice="required",
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
    assert recorder.last["stream"] is True and "stream_options" not in recorder.last
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls if c.function] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_batched_prompts_are_served(base_url: str, recorder: Recorder) -> None:
    async with _client(base_url) as client:
        answer = await client.completions.create(
            model=MODEL, prompt=["one", "two", "three"], max_tokens=2
        )
    assert recorder.last["prompt"] == ["one", "two", "three"]
    assert [c.text for c in answer.choices] == [" answer 0", " answer 1", " answer 2"]


async def test_audio_forms_reach_the_upstream_as_sent(base_url: str, recorder: Recorder) -> None:
    """The audio routes: the form goes up byte for byte with its content type, and the
    upstream's answer comes back as it sent it (JSON, text/plain, a stream)."""
    form = aiohttp.FormData()
    form.add_field("model", MODEL)
    form.add_field("language", "en")
    form.add_field("file", WAV, filename="a.wav", content_type="audio/wav")
    writer = form()
    sent = await writer.as_bytes()
    async with aiohttp.ClientSession() as http:
        for route in ("transcriptions", "translations"):
            headers = {"Content-Type": writer.content_type}
            async with http.post(f"{base_url}/v1/audio/{route}", data=sent,
                                 headers=headers) as resp:  # fmt: skip
                assert resp.status == 200, await resp.text()
                assert resp.headers["Content-Type"] == "application/json; charset=utf-8"
                assert await resp.json() == {"text": TRANSCRIPT}
            assert recorder.forms[-1] == (writer.content_type, sent), route
    async with _client(base_url) as client:
        whole = await client.audio.transcriptions.create(model=MODEL, file=("a.wav", WAV))
        assert whole.text == TRANSCRIPT
        text = await client.audio.transcriptions.create(
            model=MODEL, file=("a.wav", WAV), response_format="text"
        )
        assert text == TRANSCRIPT  # the upstream's text/plain, as it sent it
        stream = await client.audio.transcriptions.create(
            model=MODEL, file=("a.wav", WAV), stream=True
        )
        deltas = [e.delta async for e in stream if e.type == "transcript.text.delta"]
        assert "".join(deltas).strip() == TRANSCRIPT
    assert len(recorder.forms) == 5 and not recorder.bodies, "every form went up as a form"
    assert all(WAV in raw for _, raw in recorder.forms)


async def test_model_is_added_only_when_left_out(
    start_sidecar: SidecarFactory, recorder: Recorder, http: aiohttp.ClientSession
) -> None:
    sidecar = await _sidecar(start_sidecar, recorder)
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "n": 2}
    async with http.post(f"{sidecar.http_url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["x-unitproxy-unit"] == sidecar.core.unit_id
    assert recorder.last == {**body, "model": MODEL}
    async with _client(sidecar.http_url) as client:
        card = await client.models.retrieve(MODEL)
        assert card.id == MODEL
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("no-such-model")
    assert sidecar.core.outstanding == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_a_resume_with_nothing_left_ends_at_once_with_length(
    start_sidecar: SidecarFactory, recorder: Recorder, stream: bool
) -> None:
    # The gateway resumes a stream whose delivered output already reaches max_tokens
    # (the cut fell after the last token, before its finish): the answer is the finish
    # alone, made without engine work, usage counted as for one request.
    sidecar = await _sidecar(start_sidecar, recorder)
    messages = [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "one two three four"},  # 18 chars
    ]
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    hint = signed_hint("one two three four", created=77)
    url = f"{sidecar.http_url}/v1/chat/completions"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
        http.post(url, json=body, headers={"x-unitproxy-resume": hint}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    assert recorder.bodies == [], "no engine work"
    if stream:
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert chunks[0]["choices"] == [
            {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": "length"}
        ]
        assert {c["created"] for c in chunks} == {77}
        usage = chunks[-1]["usage"]
    else:
        answer = json.loads(raw)
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["choices"][0]["message"]["content"] == ""
        usage = answer["usage"]
    # No /tokenize upstream: counted at 4 characters a token (18 -> 4 delivered).
    assert usage["completion_tokens"] == 4
    assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]


async def test_the_gateway_shows_the_units_model_cards_with_vllms_fields(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, recorder: Recorder
) -> None:
    sidecar = await _sidecar(start_sidecar, recorder)
    gateway = await start_gateway([sidecar])
    async with _client(gateway.http_url) as client:
        [card] = (await client.models.list()).data
        again = await client.models.retrieve(MODEL)
    shown = card.model_dump(exclude_unset=True)
    assert shown["root"] == "/models/upstream" and shown["max_model_len"] == 4096
    assert shown["owned_by"] == "vllm" and shown["created"] == 1
    assert shown["permission"] == [{"id": "modelperm-1", "object": "model_permission"}]
    assert shown["unitproxy"] == {"units": [sidecar.core.unit_id], "simulator": False}
    assert again.model_dump(exclude_unset=True) == shown


async def test_a_resume_hint_from_a_client_is_refused_on_the_engines_own_layer(
    start_sidecar: SidecarFactory, recorder: Recorder
) -> None:
    # The same resume as above, but the hint is the client's own (no gateway signed
    # it): refused before any work, so no usage moves from prompt to completion.
    sidecar = await _sidecar(start_sidecar, recorder)
    messages = [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "one two three four"},
    ]
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4}
    url = f"{sidecar.http_url}/v1/chat/completions"
    for hint in (
        json.dumps({"created": 77, "delivered_chars": 18}),
        signed_hint("one two three fou?", created=77),  # signed for other output
    ):
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.post(url, json=body, headers={"x-unitproxy-resume": hint}) as resp,
        ):
            assert resp.status == 403
            assert (await resp.json())["error"]["code"] == "resume_forbidden"
    assert recorder.bodies == [], "no engine work"
    assert sidecar.core.outstanding == 0

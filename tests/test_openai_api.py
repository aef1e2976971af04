"""The OpenAI wire format: parse() validates request bodies, StreamEncoder writes SSE chunks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.base import ChatMessage, TokenDelta
from proxy.errors import InvalidRequest, NotFound, PayloadTooLarge, UnitProxyError
from proxy.openai_api import DONE, ParsedRequest, Route, StreamEncoder, parse

pytestmark = pytest.mark.timeout(10)

MODEL = "unitproxy-sim"
MAX_PROMPT_CHARS = 100
USER = {"role": "user", "content": "hello"}


def _parse(route: Route, body: Any, *, request_id: str = "req-1") -> ParsedRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse(
        route, raw, request_id=request_id, served_model=MODEL, max_prompt_chars=MAX_PROMPT_CHARS
    )


# --- valid requests --------------------------------------------------------------


def test_completion_string_prompt() -> None:
    p = _parse(
        "completions",
        {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "stop": "\n",
            "seed": 3,
        },
    )
    assert p.route == "completions" and p.model == MODEL
    assert not p.stream and not p.include_usage
    req = p.engine_request
    assert req.request_id == "req-1"
    assert req.prompt == "Once upon a time"
    assert req.prompt_token_ids is None and req.messages is None
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.stop, s.seed) == (5, 0.5, 0.9, ("\n",), 3)


def test_completion_defaults() -> None:
    s = _parse("completions", {"prompt": "x"}).engine_request.sampling
    assert s.max_tokens is None  # the engine's default
    assert (s.temperature, s.top_p, s.top_k, s.min_tokens, s.stop) == (1.0, 1.0, -1, 0, ())


def test_completion_token_ids() -> None:
    req = _parse("completions", {"prompt": [1, 2, 3]}).engine_request
    assert req.prompt is None
    assert req.prompt_token_ids == (1, 2, 3)


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [(["hello"], "hello", None), ([[4, 5]], None, (4, 5))],
    ids=["string", "token-ids"],
)
def test_completion_batch_of_one(
    prompt: Any, text: str | None, ids: tuple[int, ...] | None
) -> None:
    req = _parse("completions", {"prompt": prompt}).engine_request
    assert req.prompt == text
    assert req.prompt_token_ids == ids


def test_chat_string_content() -> None:
    p = _parse(
        "chat",
        {
            "model": MODEL,
            "messages": [{"role": "system", "content": "be brief"}, USER],
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert p.route == "chat" and p.stream and p.include_usage
    req = p.engine_request
    assert req.prompt is None and req.prompt_token_ids is None
    assert req.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "hello"))
    assert req.sampling.max_tokens == 7  # max_completion_tokens wins


def test_chat_text_parts() -> None:
    content = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    req = _parse("chat", {"messages": [{"role": "user", "content": content}]}).engine_request
    assert req.messages == (ChatMessage("user", "hello world"),)


def test_vllm_extras_are_honoured() -> None:
    s = _parse(
        "completions",
        {"prompt": "x", "top_k": 20, "min_tokens": 2, "max_tokens": 4, "ignore_eos": True},
    ).engine_request.sampling
    assert (s.top_k, s.min_tokens, s.ignore_eos) == (20, 2, True)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_unknown_fields_are_ignored(route: Route) -> None:
    body: dict[str, Any] = {
        "logit_bias": {"50256": -100},
        "suffix": "!",
        "no_such_field": [1, {"x": None}],
        "max_tokens": 3,
    }
    body |= {"prompt": "x"} if route == "completions" else {"messages": [USER]}
    assert _parse(route, body).engine_request.sampling.max_tokens == 3


def test_empty_model_means_the_served_one() -> None:
    assert _parse("completions", {"prompt": "x", "model": ""}).model == MODEL


def test_prompt_at_the_limit_is_accepted() -> None:
    prompt = "x" * MAX_PROMPT_CHARS
    assert _parse("completions", {"prompt": prompt}).engine_request.prompt == prompt


# --- invalid requests ------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body", "needle"),
    [
        ("completions", b"{not json", "JSON"),
        ("chat", b'{"messages": [', "JSON"),
        ("completions", b"", "JSON"),
        ("completions", b"[1, 2]", "object"),
        ("chat", b'"hello"', "object"),
        ("chat", b"null", "object"),
    ],
    ids=["malformed", "truncated", "empty", "array", "string", "null"],
)
def test_body_not_a_json_object(route: Route, body: bytes, needle: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        _parse(route, body)
    assert needle in exc.value.message
    assert exc.value.param is None
    assert exc.value.http_status == 400


Case = tuple[Route, dict[str, Any], str]

FIELD_ERRORS: dict[str, Case] = {
    "missing-prompt": ("completions", {"max_tokens": 3}, "prompt"),
    "missing-messages": ("chat", {"model": MODEL}, "messages"),
    "max_tokens-string": ("completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    "max_tokens-float": ("completions", {"prompt": "x", "max_tokens": 5.5}, "max_tokens"),
    "max_tokens-bool": ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    "temperature-string": ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    "stream-string": ("chat", {"messages": [USER], "stream": "yes"}, "stream"),
    "stream_options-string": (
        "completions",
        {"prompt": "x", "stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
    ),
    "messages-not-list": ("chat", {"messages": "hello"}, "messages"),
    "messages-empty": ("chat", {"messages": []}, "messages"),
    "max_tokens-0": ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    "max_tokens--1": ("chat", {"messages": [USER], "max_tokens": -1}, "max_tokens"),
    "temperature-3": ("completions", {"prompt": "x", "temperature": 3}, "temperature"),
    "top_p-0": ("chat", {"messages": [USER], "top_p": 0}, "top_p"),
    "n-2": ("completions", {"prompt": "x", "n": 2}, "n"),
    "prompt-empty": ("completions", {"prompt": ""}, "prompt"),
    "prompt-number": ("completions", {"prompt": 5}, "prompt"),
    "batched-strings": ("completions", {"prompt": ["a", "b"]}, "prompt"),
    "batched-token-ids": ("completions", {"prompt": [[1], [2]]}, "prompt"),
    "stop-not-strings": ("completions", {"prompt": "x", "stop": [1]}, "stop"),
    "min_tokens-over-max-completion": (
        "completions",
        {"prompt": "x", "min_tokens": 5, "max_tokens": 2},
        "min_tokens",
    ),
    "min_tokens-over-max-chat": (
        "chat",
        {"messages": [USER], "min_tokens": 5, "max_completion_tokens": 2},
        "min_tokens",
    ),
    "image-part": (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        },
        "messages",
    ),
}


@pytest.mark.parametrize(("route", "body", "field"), FIELD_ERRORS.values(), ids=FIELD_ERRORS.keys())
def test_bad_field_is_named(route: Route, body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        _parse(route, body)
    assert type(exc.value) is InvalidRequest
    assert field in exc.value.message
    assert exc.value.param == field
    assert exc.value.body()["error"]["param"] == field


def test_unknown_role_is_named() -> None:
    with pytest.raises(InvalidRequest) as exc:
        _parse("chat", {"messages": [USER, {"role": "wizard", "content": "x"}]})
    assert "role" in exc.value.message and "user" in exc.value.message  # says what is allowed
    assert exc.value.param is not None
    assert exc.value.param.startswith("messages") and exc.value.param.endswith("role")


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_unknown_model_is_not_found(route: Route) -> None:
    body: dict[str, Any] = {"model": "gpt-4"}
    body |= {"prompt": "x"} if route == "completions" else {"messages": [USER]}
    with pytest.raises(NotFound) as exc:
        _parse(route, body)
    assert "gpt-4" in exc.value.message and "model" in exc.value.message
    assert exc.value.param == "model"
    assert exc.value.http_status == 404


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("completions", {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
        ("completions", {"prompt": [1] * (MAX_PROMPT_CHARS + 1)}, "prompt"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x" * 60}] * 2},
            "messages",
        ),
    ],
    ids=["string", "token-ids", "chat-total"],
)
def test_prompt_over_the_limit(route: Route, body: dict[str, Any], field: str) -> None:
    with pytest.raises(PayloadTooLarge) as exc:
        _parse(route, body)
    assert field in exc.value.message
    assert str(MAX_PROMPT_CHARS) in exc.value.message
    assert exc.value.param == field
    assert exc.value.http_status == 413


def test_every_parse_error_is_a_unitproxy_error() -> None:
    # The front ends map UnitProxyError and nothing else: no pydantic error leaks out.
    for route, body, _ in FIELD_ERRORS.values():
        with pytest.raises(UnitProxyError):
            _parse(route, body)


# --- streaming -------------------------------------------------------------------

TRICKY = 'he said "hi"\n\tthen \\ left: caf\u00e9 \u4f60\u597d \U0001f600 \u2028'


def _events(data: bytes) -> list[Any]:
    """Each SSE event of data, JSON-decoded; [DONE] stays the string "[DONE]"."""
    assert data.endswith(b"\n\n"), data
    out: list[Any] = []
    for event in data[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), event
        payload = event.removeprefix(b"data: ")
        assert b"\n" not in payload and b"\r" not in payload  # one line per event
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def _stream(route: Route, include_usage: bool, request_id: str = "req-1") -> StreamEncoder:
    body: dict[str, Any] = {"stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    body |= {"prompt": "x"} if route == "completions" else {"messages": [USER]}
    return StreamEncoder(_parse(route, body, request_id=request_id), created=1_700_000_000)


def _check_head(chunk: dict[str, Any], route: Route, include_usage: bool) -> None:
    prefix, obj = (
        ("cmpl-", "text_completion")
        if route == "completions"
        else ("chatcmpl-", "chat.completion.chunk")
    )
    assert chunk["id"] == f"{prefix}req-1"
    assert chunk["object"] == obj
    assert chunk["created"] == 1_700_000_000
    assert chunk["model"] == MODEL
    assert isinstance(chunk["choices"], list)
    if include_usage:
        assert "usage" in chunk
    else:
        assert "usage" not in chunk


def _delta_text(chunk: dict[str, Any], route: Route) -> str:
    choice = chunk["choices"][0]
    return str(choice["text"] if route == "completions" else choice["delta"]["content"])


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stream_chunks(route: Route, include_usage: bool) -> None:
    enc = _stream(route, include_usage)

    start = enc.start()
    if route == "completions":
        assert start == b""
    else:
        (first,) = _events(start)
        _check_head(first, route, include_usage)
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert first["choices"][0]["finish_reason"] is None

    (mid,) = _events(enc.chunk(TokenDelta(TRICKY, (1, 2), 3, 2)))
    _check_head(mid, route, include_usage)
    assert mid["choices"][0]["index"] == 0
    assert mid["choices"][0]["finish_reason"] is None
    assert _delta_text(mid, route) == TRICKY
    if include_usage:
        assert mid["usage"] is None

    last_delta = TokenDelta("end", (3,), 3, 3, "length")
    (last,) = _events(enc.chunk(last_delta))
    _check_head(last, route, include_usage)
    assert last["choices"][0]["finish_reason"] == "length"
    assert _delta_text(last, route) == "end"

    end = _events(enc.end(last_delta))
    assert end[-1] == "[DONE]"
    assert enc.end(last_delta).endswith(DONE)
    if include_usage:
        (usage, _) = end
        _check_head(usage, route, include_usage)
        assert usage["choices"] == []
        assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    else:
        assert end == ["[DONE]"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stream_end_without_a_last_delta(route: Route) -> None:
    # A stream that ended before any token (error, abort) still ends with [DONE].
    assert _stream(route, include_usage=True).end(None) == DONE


@pytest.mark.parametrize(
    "text", ["", '"', "\\", "\n\n", "data: [DONE]\n\n", "\x00\x1f", "\ud7ff\ue000", TRICKY]
)
def test_stream_text_round_trips(text: str) -> None:
    for route in ("completions", "chat"):
        (chunk,) = _events(_stream(route, include_usage=False).chunk(TokenDelta(text, (), 1, 1)))
        assert _delta_text(chunk, route) == text


# The request id comes from the client's x-request-id header: a quote or backslash in
# it must not break the chunks' JSON.
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stream_request_id_is_escaped(route: Route) -> None:
    enc = _stream(route, include_usage=False, request_id='a"b\\c')
    (chunk,) = _events(enc.chunk(TokenDelta("x", (), 1, 1)))
    assert chunk["id"].endswith('a"b\\c')

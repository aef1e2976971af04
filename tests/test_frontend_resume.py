"""The resume hint on an engine's own OpenAI layer: parsing, limits, the rewritten answer."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

import pytest

from proxy.errors import InvalidRequest
from proxy.sidecar.frontend_resume import (
    ResumedAnswer,
    ResumeHint,
    delivered_text,
    parse_hint,
    reduce_limits,
)


@pytest.mark.parametrize(
    "raw",
    ["nope", "[]", '{"delivered_chars": -1}', '{"created": "1"}', '{"delivered_chars": true}'],
)
def test_a_bad_hint_is_a_400_naming_the_header(raw: str) -> None:
    with pytest.raises(InvalidRequest) as bad:
        parse_hint(raw)
    assert bad.value.param == "x-unitproxy-resume"


def test_the_delivered_text_and_the_limits() -> None:
    assert parse_hint('{"created":5,"delivered_chars":3}') == ResumeHint(5, 3)
    body = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "abcdef"}]
    }
    assert delivered_text("chat", body, 3) == "def"
    with pytest.raises(InvalidRequest, match="longer than the text"):
        delivered_text("chat", body, 7)
    with pytest.raises(InvalidRequest, match="assistant"):
        delivered_text("chat", {"messages": [{"role": "user", "content": "x"}]}, 0)
    assert delivered_text("completions", {"prompt": "once upon"}, 4) == "upon"
    reduced = reduce_limits({"max_tokens": 10, "max_completion_tokens": 8, "min_tokens": 2}, 3)
    assert reduced == {"max_tokens": 7, "max_completion_tokens": 5, "min_tokens": 0}
    assert reduce_limits({"max_tokens": 3}, 3) is None
    assert reduce_limits({}, 3) == {}


async def _pieces(*events: dict[str, object]) -> AsyncGenerator[bytes, None]:
    for e in events:
        yield b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


async def test_a_resumed_stream_reads_as_the_rest_of_the_first() -> None:
    role = {
        "id": "x",
        "created": 99,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
    }
    token = {"id": "x", "created": 99, "choices": [{"index": 0, "delta": {"content": "b"}}]}
    usage = {
        "id": "x",
        "created": 99,
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
    }
    answer = ResumedAnswer("chat", ResumeHint(created=5, delivered_chars=1), delivered=3)
    out = b"".join([p async for p in answer.chunks(_pieces(role, token, usage))])
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"] == token["choices"], "no role chunk"
    assert {c["created"] for c in chunks} == {5}
    assert chunks[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}

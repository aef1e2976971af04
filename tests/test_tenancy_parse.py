"""The tenants' admission reads a request body once (proxy/gateway/tenancy.py): its
parser is json.loads, decision for decision, and the Want of the router is built from
what admission parsed (request.body_want) as it would be from the body."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from engine import tokens
from proxy.errors import InvalidRequest
from proxy.gateway.request import body_want, json_want
from proxy.gateway.tenancy import PromptCounts, TenantGate, Usage, parse_json
from proxy.metrics import TenantMetrics
from proxy.ratelimit import Limiter
from proxy.tenants import TenantSource

pytestmark = pytest.mark.timeout(20)

INT64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # beyond: see the test below
VALUES = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def _same(data: bytes) -> None:
    """parse_json(data) is json.loads(data): the same value, or the same kind of error."""
    try:
        expected: Any = json.loads(data)
    except (ValueError, RecursionError) as exc:
        with pytest.raises(type(exc)):
            parse_json(data)
        return
    assert repr(parse_json(data)) == repr(expected)  # NaN too


@given(VALUES, st.sampled_from(["", " ", "\n\t "]), st.sampled_from(["", " ", "\r\n", "x"]))
@settings(max_examples=200, deadline=None)
def test_parse_json_decides_as_json_loads(value: Any, before: str, after: str) -> None:
    text = before + json.dumps(value, ensure_ascii=False) + after
    for encoding in ("utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32"):
        _same(text.encode(encoding))


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b'{"a": 1}{', b"\xff\xfe", b'{"a": "\xff"}', b"[" * 100_000 + b"]" * 100_000,
     b'"\x00"', b"1 2", b"NaN", b'{"model": "m"}'],
)  # fmt: skip
def test_parse_json_on_odd_bodies(data: bytes) -> None:
    _same(data)


@pytest.mark.parametrize("n", [-(2**63) - 1, 2**64, 10**30, -(10**30)])
def test_an_integer_beyond_64_bits_reads_as_the_nearest_float(n: int) -> None:
    """The one value orjson reads otherwise than json.loads (proxy/jsonio.py): the body
    still goes to the unit as it came."""
    assert json.loads(f'{{"max_tokens": {n}}}') == {"max_tokens": n}
    read = parse_json(f'{{"max_tokens": {n}}}'.encode())
    assert type(read["max_tokens"]) is float and read["max_tokens"] == float(n)


def test_a_usage_is_read_from_the_end_of_an_answer() -> None:
    usage = Usage()
    usage.read_body(b'{"choices": [{"text": "\\"usage\\":"}], "usage": {"prompt_tokens": 3, '
                    b'"completion_tokens": 4, "total_tokens": 7}}')  # fmt: skip
    assert (usage.prompt, usage.completion, usage.reported) == (3, 4, True)
    broken = Usage()
    broken.read_body(b'{"usage": {"prompt_tokens": 3,')
    assert not broken.reported


USAGE_VALUES = (
    st.integers(min_value=-5, max_value=10**12) | st.none() | st.booleans()
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=3)
    | st.dictionaries(st.sampled_from(["cached_tokens", "}"]), st.integers(0, 9), max_size=2)
)  # fmt: skip


@given(
    st.dictionaries(
        st.sampled_from(["prompt_tokens", "completion_tokens", "total_tokens",
                         "prompt_tokens_details", "x"]),
        USAGE_VALUES,
    ),
    st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]),
    st.sampled_from(["", ', "id": "x"', ', "more": {"prompt_tokens": 1, "completion_tokens": 1}']),
)  # fmt: skip
@settings(max_examples=300, deadline=None)
def test_a_usage_read_from_an_answer_is_what_its_json_says(
    usage: dict[str, Any], separators: tuple[str, str], after: str
) -> None:
    """Read without parsing the answer where the counts are plain digits, parsed where
    they are not: either way the counts the usage object holds, and none where it holds
    none."""
    body = ('{"choices": [], "usage": ' + json.dumps(usage, separators=separators) + after
            + "}").encode()  # fmt: skip
    read, expected = Usage(), Usage()
    read.read_body(body)
    expected.read_usage(json.loads(body)["usage"])
    assert (read.prompt, read.completion, read.reported) == (
        expected.prompt, expected.completion, expected.reported)  # fmt: skip


def test_the_want_is_built_from_what_admission_parsed(tmp_path: Path) -> None:
    async def main() -> None:
        tenants = tmp_path / "tenants.toml"
        tenants.write_text('[[tenant]]\nname = "a"\nkeys = ["sk-a"]\ntokens_per_minute = 1000\n')
        source = TenantSource(tenants)
        await source.load()
        gate = TenantGate(source, Limiter(None), TenantMetrics(CollectorRegistry()), 16)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 5}).encode()  # fmt: skip
        admission = await gate.admit_http(body, "Bearer sk-a", None)
        assert admission.cost == admission.estimated + 5
        parsed = admission.take_request()
        assert parsed == json.loads(body)
        assert admission.take_request() is None, "taken once: not kept for the request's life"
        blocks = lambda text: [len(text)]  # noqa: E731
        assert body_want(parsed, blocks) == json_want(body, blocks)
        assert body_want(parsed, None) == json_want(body, None)
        with pytest.raises(InvalidRequest):
            await gate.admit_http(b"[1]", "Bearer sk-a", None)
        admission.finish("200")

    asyncio.run(main())


EVENT = b'data: {"choices": [{"text": " usage: \\": usage \\""}]}\n\n'
COMMENT = b': usage {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("events", "left"),
    [
        (EVENT * 3 + COMMENT + DONE, EVENT * 3 + DONE),  # as a unit ends its stream
        (EVENT + COMMENT, EVENT),  # [DONE] comes in the next read
        (COMMENT + DONE, DONE),
        (COMMENT, b""),
        (EVENT + COMMENT.replace(b"}", b', "prompt_tokens_details": {"cached_tokens": 1}}')
         + DONE, EVENT + DONE),  # a usage object the counts are not first in: parsed
    ],
)  # fmt: skip
def test_the_usage_comment_is_read_and_taken_out_of_a_stream(events: bytes, left: bytes) -> None:
    usage = Usage()
    assert usage.take_comment(events) == left
    assert (usage.prompt, usage.completion, usage.reported) == (5, 2, True)


@pytest.mark.parametrize(
    "events",
    [EVENT * 2, EVENT + DONE, COMMENT + EVENT + DONE, EVENT + COMMENT + EVENT * 2,
     b": usage not json\n\n" + DONE],
)  # fmt: skip
def test_events_without_a_usage_comment_at_their_end_go_on_as_they_are(events: bytes) -> None:
    """Only a stream's last event, or the one before [DONE], is the unit's comment: one
    anywhere else is the client's to get (and nothing is counted from it)."""
    usage = Usage()
    taken = usage.take_comment(events)
    assert not usage.reported
    if events.startswith(b": usage not json"):
        assert taken == DONE  # a comment of the unit's, unreadable: out, counting nothing
    else:
        assert taken == events


@given(st.lists(st.text(max_size=40), max_size=60))
@settings(max_examples=100, deadline=None)
def test_prompts_counted_with_texts_kept_count_as_the_simulator(texts: list[str]) -> None:
    """The count kept for a text is the simulator's; at most ``max_chars`` characters and
    ``max_texts`` texts are kept, and a text larger than all is counted, not kept."""
    counts = PromptCounts(max_chars=100, max_texts=8)
    for text in [*texts, *texts, "word " * 30]:
        assert counts(text) == tokens.count(text)
        assert len(counts) <= 8
        assert counts._chars <= 100
    assert "word " * 30 not in counts._counts
    assert counts._chars == sum(map(len, counts._counts))
    counts("a system prompt")
    assert counts._counts["a system prompt"] == tokens.count("a system prompt")  # kept


@pytest.mark.parametrize(
    ("value", "counts"),
    [("3 8", (3, 8, True)), ("0 0", (0, 0, True)), ("3", (0, 0, False)), ("3 x", (0, 0, False)),
     ("-1 2", (0, 0, False)), ("3  8", (0, 0, False)), ("\u0663 8", (0, 0, False)),
     (" 8", (0, 0, False)), ("3 ", (0, 0, False)), ("+3 8", (0, 0, False)),
     ("3 8 9", (0, 0, False)), ("1" * 19 + " 2", (0, 0, False))],
)  # fmt: skip
def test_a_usage_header_is_two_counts_or_nothing(value: str, counts: tuple[int, int, bool]) -> None:
    usage = Usage()
    assert usage.read_header(value) == counts[2]
    assert (usage.prompt, usage.completion, usage.reported) == counts


@given(st.integers(0, 10**18 - 1), st.integers(0, 10**18 - 1))
def test_a_usage_header_reads_back_the_counts_written(prompt: int, completion: int) -> None:
    usage = Usage()
    assert usage.read_header(f"{prompt} {completion}")
    assert (usage.prompt, usage.completion) == (prompt, completion)

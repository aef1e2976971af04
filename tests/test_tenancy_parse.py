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

from proxy.errors import InvalidRequest
from proxy.gateway.request import body_want, json_want
from proxy.gateway.tenancy import TenantGate, Usage, parse_json
from proxy.metrics import TenantMetrics
from proxy.ratelimit import Limiter
from proxy.tenants import TenantSource

pytestmark = pytest.mark.timeout(20)

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
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


def test_a_usage_is_read_from_the_end_of_an_answer() -> None:
    usage = Usage()
    usage.read_body(b'{"choices": [{"text": "\\"usage\\":"}], "usage": {"prompt_tokens": 3, '
                    b'"completion_tokens": 4, "total_tokens": 7}}')  # fmt: skip
    assert (usage.prompt, usage.completion, usage.reported) == (3, 4, True)
    broken = Usage()
    broken.read_body(b'{"usage": {"prompt_tokens": 3,')
    assert not broken.reported


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
        assert admission.cost == admission.prompt + 5
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

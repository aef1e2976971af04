"""Hostile input against real servers on loopback, property-based (hypothesis).

Whatever a client sends — any JSON value, any bytes, the known fields with values of
any type, odd headers, bodies and prompts at and over the limits, gRPC messages with
any field values, bytes that are not a protobuf at all — it gets a 2xx (only when the
request is valid) or a 4xx with the OpenAI error body whose message names the problem
(gRPC: INVALID_ARGUMENT or NOT_FOUND); never a 500, a crash or a hang. After every
example the server is still ready and its outstanding count is back to 0.

Each test starts its servers once; pytest-asyncio runs every hypothesis example in
the test's loop against them. Valid requests may ask for billions of tokens, so
bodies go with a short deadline header: a valid request ends in 200 or in a 504 that
says the deadline passed; gRPC calls read the first chunk and cancel.

What the layers below unitproxy do, pinned down here:
- aiohttp's HTTP parser answers a header line over 8190 bytes, too many headers, a
  control character in a header value or a content-encoding it cannot decode (br
  without Brotli) with its own plain-text 400 before the application sees the
  request; a content-encoding it has never heard of, it ignores.
- grpcio decodes the request before the servicer runs: bytes that are not a
  GenerateRequest (corrupt wire format, a string field that is not UTF-8) get
  UNKNOWN "Unexpected <class 'google.protobuf.message.DecodeError'>: Error parsing
  message ..." from grpcio itself; the server stays SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import math
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.sidecar.server import Sidecar
from tests.conftest import Cell, GatewayFactory, SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(60)

MODEL = "unitproxy-sim"
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_BODY = 8192
MAX_PROMPT = 2000
LIMITS = {"max_body_bytes": MAX_BODY, "max_prompt_chars": MAX_PROMPT}
DEADLINE_HEADER = "x-unitproxy-timeout-ms"
# Long enough for a valid small request, short enough that max_tokens=2**40 ends soon.
DEADLINE = {DEADLINE_HEADER: "100"}
CALL_TIMEOUT_S = 5.0
MAX_UINT32 = 2**32 - 1  # token counts: the gRPC wire's uint32, on HTTP too
INFERENCE = "unitproxy.v1.Inference"
HEALTHY = health_pb2.HealthCheckResponse.SERVING
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
BASE_BODIES: dict[str, dict[str, Any]] = {
    "completions": {"prompt": "hello", "max_tokens": 3},
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
}


def fuzz(examples: int) -> settings:
    # The servers are started once per test (function-scoped fixtures) and shared by
    # its examples on purpose. No example database: the tree is shared.
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


# --- servers ----------------------------------------------------------------------


@pytest.fixture
async def sidecar(start_sidecar: SidecarFactory) -> Sidecar:
    return await start_sidecar(server=LIMITS)


@pytest.fixture
async def cell(start_sidecar: SidecarFactory, start_gateway: GatewayFactory) -> Cell:
    unit = await start_sidecar(server=LIMITS)
    return Cell(unit, await start_gateway([unit]))


@pytest.fixture
async def channel(sidecar: Sidecar) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as opened:
        yield opened


async def assert_sidecar_well(sidecar: Sidecar, http: aiohttp.ClientSession) -> None:
    await wait_until(lambda: sidecar.core.outstanding == 0, 3.0, "outstanding back to 0")
    async with http.get(f"{sidecar.http_url}/ready") as resp:
        assert resp.status == 200, await resp.text()


async def assert_cell_well(cell: Cell, http: aiohttp.ClientSession) -> None:
    await assert_sidecar_well(cell.sidecar, http)
    units = cell.gateway.router.candidates()
    assert units, "the unit is still a candidate: not ejected, not full"
    await wait_until(lambda: all(u.inflight == 0 for u in units), 3.0, "gateway in-flight 0")
    async with http.get(f"{cell.url}/ready") as resp:
        assert resp.status == 200, await resp.text()


# --- answers ----------------------------------------------------------------------


@dataclass(slots=True)
class Answer:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def __str__(self) -> str:
        return f"{self.status} {self.body[:300]!r}"


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: Mapping[str, str] = DEADLINE,
) -> Answer:
    async with asyncio.timeout(CALL_TIMEOUT_S), http.post(url, data=body, headers=headers) as resp:
        return Answer(resp.status, resp.headers, await resp.read())


async def raw_http(url: str, request: bytes) -> Answer:
    """Send ``request`` byte for byte (headers no client would let through); read to EOF."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        with contextlib.suppress(ConnectionError):  # refused before it read everything
            await writer.drain()
        async with asyncio.timeout(CALL_TIMEOUT_S):
            data = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip(" \t").lower()] = value.strip(" \t")  # not str.strip(): \x85
    return Answer(int(status_line.split()[1]), headers, body)


def raw_post(path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    head = [
        b"POST " + path.encode() + b" HTTP/1.1",
        b"Host: 127.0.0.1",
        b"Connection: close",
        b"Content-Length: " + str(len(body)).encode(),
    ]
    head += [name + b": " + value for name, value in headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def error_of(answer: Answer) -> dict[str, Any]:
    """The OpenAI error body: message (non-empty), type, code, param."""
    content_type = next((v for k, v in answer.headers.items() if k.lower() == "content-type"), "")
    assert content_type.startswith("application/json"), str(answer)
    error: dict[str, Any] = json.loads(answer.body)["error"]
    assert isinstance(error["message"], str) and error["message"].strip(), str(answer)
    assert isinstance(error["type"], str) and error["type"], str(answer)
    assert isinstance(error["code"], str) and error["code"], str(answer)
    assert "param" in error and (error["param"] is None or isinstance(error["param"], str))
    return error


def check_success(answer: Answer) -> None:
    """A 200: one JSON completion, or an SSE stream ending in [DONE] or a deadline error."""
    if answer.body.startswith(b"data: "):
        events = [e for e in answer.body.split(b"\n\n") if e]
        assert all(e.startswith(b"data: ") for e in events), str(answer)
        if events[-1] != b"data: [DONE]":
            assert json.loads(events[-1][6:])["error"]["type"] == "timeout_error", str(answer)
        return
    completion = json.loads(answer.body)
    assert completion["object"] in ("text_completion", "chat.completion"), str(answer)
    assert completion["choices"][0]["finish_reason"] in ("length", "stop"), str(answer)


def note_outcome(outcome: str) -> None:
    """Count outcomes per test: pytest --hypothesis-show-statistics shows the mix."""
    if currently_in_test_context():
        event(outcome)


def check_answer(answer: Answer, *, valid: bool | None = None) -> dict[str, Any] | None:
    """200 only for a valid request; 504 only because the deadline passed on a valid one;
    else a 4xx with the error body, which is returned."""
    note_outcome(f"HTTP {answer.status}")
    if answer.status == 200:
        assert valid is not False, f"an invalid request was accepted: {answer}"
        check_success(answer)
        return None
    assert 400 <= answer.status < 500 or answer.status == 504, str(answer)
    error = error_of(answer)
    if answer.status == 504:
        assert valid is not False, f"an invalid request got past validation: {answer}"
        assert error["type"] == "timeout_error", str(answer)
        return None
    assert valid is not True, f"a valid request was refused: {answer}"
    return error


def assert_names(error: dict[str, Any], fields: set[str]) -> None:
    """The error's param is one of ``fields`` (or inside one), and the message says so."""
    param = error["param"]
    assert param is not None, f"no param in {error}"
    assert param.split(".")[0] in fields, f"param {param!r} is none of {fields}: {error}"
    assert param in error["message"], error


# --- strategies -------------------------------------------------------------------

CHARS = st.one_of(
    st.characters(),
    st.sampled_from('\x00\n"\\\u2028\ufeff\U0010ffff\U0001f600é'),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),  # lone surrogates
)
TEXT = st.text(CHARS, max_size=24)
NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, -1, 1, 2, 2**31, 2**32, 2**63, 2**64, -(2**63), 10**400]),
    st.floats(),  # NaN and ±Infinity included: json.dumps writes them as bare words
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, 1.0]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def small_ints() -> st.SearchStrategy[int]:
    return st.integers(-3, 40)


PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([MODEL, "", "gpt-4o", "UNITPROXY-SIM"]),
    "max_tokens": small_ints(),
    "max_completion_tokens": small_ints(),
    "min_tokens": small_ints(),
    "top_k": small_ints(),
    "seed": small_ints(),
    "n": small_ints(),
    "best_of": small_ints(),
    "logprobs": st.one_of(small_ints(), st.booleans()),
    "temperature": st.floats(-3, 3),
    "top_p": st.floats(-1, 2),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=20)),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "echo": st.booleans(),
    "user": TEXT,
    "stream_options": st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), SCALARS)}),
    "prompt": st.one_of(
        TEXT,
        st.lists(st.integers(-2, 2**32 + 2), max_size=5),
        st.lists(TEXT, max_size=3),
        st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=2),
    ),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.one_of(st.sampled_from([*CHAT_ROLES, "robot", ""]), SCALARS),
                "content": st.one_of(
                    TEXT,
                    SCALARS,
                    st.lists(
                        st.fixed_dictionaries(
                            {
                                "type": st.sampled_from(["text", "image_url", ""]),
                                "text": st.one_of(TEXT, SCALARS),
                            }
                        ),
                        max_size=3,
                    ),
                ),
            }
        ),
        max_size=3,
    ),
}
FIELDS = sorted(PLAUSIBLE)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _between(lo: float, hi: float, *, open_lo: bool = False) -> Callable[[Any], bool]:
    def ok(value: Any) -> bool:
        if value is None:
            return True
        if not _number(value) or (isinstance(value, float) and not math.isfinite(value)):
            return False  # (an int may be too large for a float: no isfinite on it)
        return bool((lo < value if open_lo else lo <= value) and value <= hi)

    return ok


# Checks that are easy to state: a value that fails one must be refused, naming it.
VALID: dict[str, Callable[[Any], bool]] = {
    "max_tokens": lambda v: v is None or (_int(v) and 1 <= v <= MAX_UINT32),
    "min_tokens": lambda v: _int(v) and 0 <= v <= MAX_UINT32,
    "top_k": lambda v: v is None or (_int(v) and -1 <= v < 2**31),
    "seed": lambda v: v is None or (_int(v) and -(2**63) <= v < 2**63),
    "n": lambda v: _int(v) and v == 1,
    "temperature": _between(0, 2),
    "top_p": _between(0, 1, open_lo=True),
    "presence_penalty": _between(-2, 2),
    "frequency_penalty": _between(-2, 2),
    "repetition_penalty": _between(0, 2, open_lo=True),
    "stream": lambda v: isinstance(v, bool),
    "ignore_eos": lambda v: isinstance(v, bool),
    "user": lambda v: v is None or isinstance(v, str),
}
ROUTE_ONLY: dict[str, dict[str, Callable[[Any], bool]]] = {
    "completions": {
        "echo": lambda v: v is False,
        "logprobs": lambda v: v is None,
        "best_of": lambda v: v is None or (_int(v) and v == 1),
    },
    "chat": {
        "logprobs": lambda v: v is False,
        "max_completion_tokens": lambda v: v is None or (_int(v) and 1 <= v <= MAX_UINT32),
    },
}
OTHER_ROUTE_FIELDS = {
    "completions": {"messages", "max_completion_tokens"},
    "chat": {"prompt", "echo", "best_of"},
}


def has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return any(has_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(has_surrogate(k) or has_surrogate(v) for k, v in value.items())
    return False


def surely_invalid(route: str, fields: dict[str, Any]) -> set[str]:
    """The fields whose values are wrong by a simple rule."""
    checks = {**VALID, **ROUTE_ONLY[route]}
    return {name for name, value in fields.items() if name in checks and not checks[name](value)}


def encode(value: Any, ascii_only: bool) -> bytes:
    # ensure_ascii=False writes a lone surrogate as itself: those bytes are not UTF-8.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def field_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A valid body of a route with one to three known fields given odd values."""
    route = draw(st.sampled_from(sorted(ROUTES)))
    names = draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True))
    changed = {name: draw(st.one_of(PLAUSIBLE[name], JSON_VALUES)) for name in names}
    return route, {**BASE_BODIES[route], **changed}, changed


# --- HTTP bodies ------------------------------------------------------------------


@fuzz(150)
@given(route=st.sampled_from(sorted(ROUTES)), value=JSON_VALUES, ascii_only=st.booleans())
async def test_any_json_value_as_body(
    sidecar: Sidecar, http: aiohttp.ClientSession, route: str, value: Any, ascii_only: bool
) -> None:
    answer = await post(http, sidecar.http_url + ROUTES[route], encode(value, ascii_only))
    valid = None if isinstance(value, dict) else False  # an object might even be valid
    error = check_answer(answer, valid=valid)
    if error is not None and not isinstance(value, dict):
        assert "JSON" in error["message"], error
    await assert_sidecar_well(sidecar, http)


@fuzz(100)
@given(route=st.sampled_from(sorted(ROUTES)), body=st.binary(max_size=600))
async def test_any_bytes_as_body(
    sidecar: Sidecar, http: aiohttp.ClientSession, route: str, body: bytes
) -> None:
    check_answer(await post(http, sidecar.http_url + ROUTES[route], body))
    await assert_sidecar_well(sidecar, http)


@fuzz(300)
@given(case=field_bodies(), ascii_only=st.booleans())
async def test_known_fields_with_any_values(
    sidecar: Sidecar,
    http: aiohttp.ClientSession,
    case: tuple[str, dict[str, Any], dict[str, Any]],
    ascii_only: bool,
) -> None:
    route, body, changed = case
    answer = await post(http, sidecar.http_url + ROUTES[route], encode(body, ascii_only))
    wrong = surely_invalid(route, changed)
    error = check_answer(answer, valid=False if wrong else None)
    if error is not None and not has_surrogate(changed):
        # The base body is valid: what is refused is one of the changed fields.
        assert_names(error, set(changed) - OTHER_ROUTE_FIELDS[route])
        if wrong == set(changed):
            assert error["param"].split(".")[0] in wrong, error
    await assert_sidecar_well(sidecar, http)


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


DEEP = 10_000
HOSTILE_BODIES = {
    "deep arrays": nested(DEEP),
    "deep objects": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "deep prompt": b'{"prompt":' + nested(DEEP) + b"}",
    "deep content": b'{"messages":[{"role":"user","content":' + nested(DEEP, b"[{", b"}]") + b"}]}",
    "deep but under the parser's limit": b'{"prompt":' + nested(150) + b"}",
    "NaN max_tokens": b'{"prompt":"x","max_tokens": NaN}',
    "Infinity temperature": b'{"prompt":"x","temperature": Infinity}',
    "-Infinity top_p": b'{"prompt":"x","top_p": -Infinity}',
    "NaN presence_penalty": b'{"messages":[{"role":"user","content":"x"}],"presence_penalty":NaN}',
    "1e400 max_tokens": b'{"prompt":"x","max_tokens": 1e400}',
    "lone surrogate": b'{"prompt":"\\ud800"}',
    "raw surrogate bytes": b'{"prompt":"\xed\xa0\x80"}',
    "latin-1 bytes": b'{"prompt":"caf\xe9"}',
    "BOM": b'\xef\xbb\xbf{"prompt":"x"}',
    "trailing garbage": b'{"prompt":"x"} {"prompt":"y"}',
    "empty": b"",
    "NUL": b"\x00",
    "4000 digits seed": b'{"prompt":"x","seed":' + b"9" * 4000 + b"}",
    "2**64 max_tokens": b'{"prompt":"x","max_tokens":18446744073709551616}',
    "many keys": b"{" + b",".join(b'"k%d":%d' % (i, i) for i in range(1000)) + b',"prompt":"x"}',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_BODIES))
async def test_hostile_bodies_get_4xx(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession, name: str
) -> None:
    sidecar = await start_sidecar(server={"max_body_bytes": 1 << 20})  # room for deep bodies
    route = "chat" if b"messages" in HOSTILE_BODIES[name] else "completions"
    answer = await post(http, sidecar.http_url + ROUTES[route], HOSTILE_BODIES[name], {})
    if name == "many keys":  # unknown fields are ignored
        assert answer.status == 200, str(answer)
    else:
        error = check_answer(answer, valid=False)
        assert error is not None and answer.status == 400, str(answer)
        field = name.split()[-1]
        if field in VALID:
            assert error["param"] == field, error
    await assert_sidecar_well(sidecar, http)


def chat_part(part: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": [part]}]}).encode()


# What a gateway reads of the body to choose a unit (policy prefix: the prompt's text).
PROMPT_BODIES = {
    "text part a number": chat_part({"type": "text", "text": 5}),
    "text part a list": chat_part({"type": "text", "text": ["a", "b"]}),
    "text part an object": chat_part({"type": "text", "text": {"a": 1}}),
    "text part null": chat_part({"type": "text", "text": None}),
    "role an object": b'{"messages":[{"role":{"a":1},"content":"hi"}]}',
    "deep content": HOSTILE_BODIES["deep content"],
    "deep prompt": HOSTILE_BODIES["deep prompt"],
    "deep arrays": HOSTILE_BODIES["deep arrays"],
}


@pytest.mark.parametrize("policy", ["prefix", "lor"])
async def test_a_body_a_policy_reads_gets_the_units_own_4xx(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    http: aiohttp.ClientSession,
    policy: str,
) -> None:
    # Policy prefix reads the prompt before choosing: what it cannot read goes on to the
    # unit, which refuses it as it refuses it under lor, never a gateway 500.
    unit = await start_sidecar(server={"max_body_bytes": 1 << 20})
    cell = Cell(unit, await start_gateway([unit], policy=policy))
    for name, body in PROMPT_BODIES.items():
        path = ROUTES["chat" if b"messages" in body else "completions"]
        direct = await post(http, unit.http_url + path, body, {})
        through = await post(http, cell.url + path, body, {})
        assert direct.status == 400, (name, str(direct))
        assert (through.status, through.body) == (direct.status, direct.body), name
    await assert_cell_well(cell, http)


@fuzz(40)
@given(case=st.one_of(field_bodies(), st.tuples(st.sampled_from(sorted(ROUTES)), JSON_VALUES)))
async def test_through_the_gateway_4xx_pass_through(
    cell: Cell, http: aiohttp.ClientSession, case: tuple[Any, ...]
) -> None:
    route, body = case[0], case[1]
    answer = await post(http, cell.url + ROUTES[route], encode(body, True))
    wrong = surely_invalid(route, case[2]) if len(case) == 3 else set()
    check_answer(answer, valid=False if wrong or not isinstance(body, dict) else None)
    await assert_cell_well(cell, http)


# --- limits -----------------------------------------------------------------------


@fuzz(60)
@given(
    route=st.sampled_from(["completions", "chat", "token ids"]),
    size=st.integers(MAX_PROMPT - 3, MAX_PROMPT + 3),
    char=st.sampled_from(["a", "é", "€", "\U0001f600", "\x00", '"']),
    parts=st.integers(1, 4),
    ascii_only=st.booleans(),
)
async def test_prompt_and_body_limits(
    sidecar: Sidecar,
    http: aiohttp.ClientSession,
    route: str,
    size: int,
    char: str,
    parts: int,
    ascii_only: bool,
) -> None:
    text = char * size
    fields: dict[str, Any]
    if route == "chat":
        step = -(-size // parts)
        chunks = [text[i : i + step] for i in range(0, size, step)]
        fields = {"messages": [{"role": "user", "content": c} for c in chunks]}
    elif route == "token ids":
        fields = {"prompt": [7] * size}
    else:
        fields = {"prompt": text}
    body = encode({**fields, "max_tokens": 1}, ascii_only)
    path = ROUTES["chat" if route == "chat" else "completions"]
    answer = await post(http, sidecar.http_url + path, body, headers={})
    if len(body) > MAX_BODY:
        assert answer.status == 413, str(answer)
        assert f"{MAX_BODY} bytes" in error_of(answer)["message"]
    elif size > MAX_PROMPT:
        assert answer.status == 413, str(answer)
        error = error_of(answer)
        assert error["param"] == ("messages" if route == "chat" else "prompt"), error
        assert f"{size} " in error["message"] and str(MAX_PROMPT) in error["message"], error
    else:
        assert answer.status == 200, str(answer)
    await assert_sidecar_well(sidecar, http)


async def test_body_limit_exact_and_streamed_and_compressed(
    sidecar: Sidecar, http: aiohttp.ClientSession
) -> None:
    url = sidecar.http_url + ROUTES["completions"]
    valid = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    padded = valid + b" " * (MAX_BODY - len(valid))
    assert (await post(http, url, padded, {})).status == 200, "exactly at the limit"
    over = await post(http, url, padded + b" ", {})
    assert over.status == 413 and str(MAX_BODY) in error_of(over)["message"]

    async def chunks() -> AsyncIterator[bytes]:  # chunked: no content-length to refuse early
        for _ in range(64):
            yield b" " * 1024

    async with http.post(url, data=chunks()) as resp:
        assert resp.status == 413
    bomb = gzip.compress(b" " * (4 << 20))  # 4 MiB of spaces, under the limit compressed
    assert len(bomb) < MAX_BODY
    answer = await post(http, url, bomb, {"Content-Encoding": "gzip"})
    assert answer.status == 413, str(answer)
    # aiohttp then logs "Unhandled exception" while it lingers over the rest of the
    # broken body, and closes the connection: the client has its 400 by then.
    broken = {"Content-Encoding": "gzip", "Connection": "close"}
    answer = await post(http, url, b"not gzip at all", broken)
    assert answer.status == 400, str(answer)
    assert "body" in error_of(answer)["message"]
    answer = await post(http, url, gzip.compress(valid), {"Content-Encoding": "gzip"})
    assert answer.status == 200, str(answer)
    # A coding aiohttp cannot decode here (br without Brotli): its parser says 400;
    # one it has never heard of, it ignores: the body is taken as it is.
    for coding, status in (("br", 400), ("x-unheard-of", 200)):
        answer = await post(http, url, valid, {"Content-Encoding": coding, "Connection": "close"})
        assert answer.status == status, str(answer)
    await assert_sidecar_well(sidecar, http)


# --- headers ----------------------------------------------------------------------

# Bytes a header value may carry on the wire (RFC 9110: VCHAR, SP, HTAB, obs-text).
HEADER_BYTES = st.sampled_from([9, *range(0x20, 0x7F), *range(0x80, 0x100)])
HEADER_VALUES = st.one_of(
    st.lists(HEADER_BYTES, max_size=64).map(bytes),
    # Any text but control characters, which aiohttp's parser refuses (tested apart).
    st.text(
        st.characters(codec="utf-8", min_codepoint=0x20, exclude_categories=["Cc"]), max_size=32
    ).map(str.encode),
)


def expected_request_id(raw: bytes) -> str | None:
    """What the server should echo: the id as text, or None where it must refuse it."""
    try:
        return raw.decode("utf-8").strip(" \t")
    except UnicodeDecodeError:
        return None


async def request_id_example(url: str, route: str, request_id: bytes) -> None:
    body = json.dumps(BASE_BODIES[route]).encode()
    answer = await raw_http(url, raw_post(ROUTES[route], body, [(b"x-request-id", request_id)]))
    note_outcome(f"HTTP {answer.status}")
    expected = expected_request_id(request_id)
    if expected is None:
        assert answer.status == 400, str(answer)
        assert "x-request-id" in error_of(answer)["message"]
        assert "x-request-id" not in answer.headers, "what cannot be echoed is not echoed"
    else:
        assert answer.status == 200, str(answer)
        echoed = answer.headers["x-request-id"].encode("latin-1").decode("utf-8")
        assert echoed == expected or (not expected and len(echoed) >= 16)
        assert json.loads(answer.body)["id"].endswith(echoed)


@fuzz(120)
@given(route=st.sampled_from(sorted(ROUTES)), request_id=HEADER_VALUES)
async def test_any_request_id(
    sidecar: Sidecar, http: aiohttp.ClientSession, route: str, request_id: bytes
) -> None:
    await request_id_example(sidecar.http_url, route, request_id)
    await assert_sidecar_well(sidecar, http)


@fuzz(30)
@given(route=st.sampled_from(sorted(ROUTES)), request_id=HEADER_VALUES)
async def test_any_request_id_through_the_gateway(
    cell: Cell, http: aiohttp.ClientSession, route: str, request_id: bytes
) -> None:
    await request_id_example(cell.url, route, request_id)
    await assert_cell_well(cell, http)


ODD_NUMBERS = b"nan NaN -nan inf -inf Infinity 1e400 -0 0 1e-300 0x10 1_000 1e308 5e-324".split()
ODD_NUMBERS += [b"", b" 50 ", "\u0661\u0662".encode()]  # the last: Arabic-Indic 12
DEADLINE_VALUES = st.one_of(
    HEADER_VALUES,
    st.floats().map(repr).map(str.encode),
    st.integers(-(2**70), 2**70).map(str).map(str.encode),
    st.sampled_from(ODD_NUMBERS),
)


def deadline_valid(raw: bytes) -> bool:
    """Whether the header is a finite number of milliseconds above 0, as Python reads it."""
    try:
        ms = float(raw.decode("utf-8", "surrogateescape"))
    except ValueError:
        return False
    return math.isfinite(ms) and ms > 0


async def deadline_example(url: str, route: str, raw: bytes) -> None:
    body = json.dumps(BASE_BODIES[route]).encode()
    answer = await raw_http(url, raw_post(ROUTES[route], body, [(DEADLINE_HEADER.encode(), raw)]))
    error = check_answer(answer, valid=deadline_valid(raw.strip(b" \t")))
    if error is not None:
        assert DEADLINE_HEADER in error["message"], error


@fuzz(120)
@given(route=st.sampled_from(sorted(ROUTES)), raw=DEADLINE_VALUES)
async def test_any_deadline_header(
    sidecar: Sidecar, http: aiohttp.ClientSession, route: str, raw: bytes
) -> None:
    await deadline_example(sidecar.http_url, route, raw)
    await assert_sidecar_well(sidecar, http)


@fuzz(40)
@given(route=st.sampled_from(sorted(ROUTES)), raw=DEADLINE_VALUES)
async def test_any_deadline_header_through_the_gateway(
    cell: Cell, http: aiohttp.ClientSession, route: str, raw: bytes
) -> None:
    await deadline_example(cell.url, route, raw)
    await assert_cell_well(cell, http)


async def test_infinite_and_tiny_deadlines_through_the_gateway(
    cell: Cell, http: aiohttp.ClientSession
) -> None:
    # Once a 500 that leaked the unit's in-flight count (int(inf) in the forwarder),
    # and a budget under 1 ms passed on as "0", which the unit refused with a 400.
    for raw in (b"inf", b"1e400", b"-inf"):
        await deadline_example(cell.url, "completions", raw)
    for _ in range(5):
        for raw in (b"0.001", b"1", b"1.5", b"2"):
            await deadline_example(cell.url, "completions", raw)
    await assert_cell_well(cell, http)


CONTENT_TYPES = {
    # name: (content-type, body, expected status)
    "text/plain with JSON": (b"text/plain", None, 200),
    "none": (None, None, 200),
    "json with an odd charset": (b"application/json; charset=latin-1", None, 200),
    "octet-stream with JSON": (b"application/octet-stream", None, 200),
    "form with JSON": (b"application/x-www-form-urlencoded", None, 400),
    "multipart with JSON": (b"multipart/form-data; boundary=x", None, 400),
    "form with a form": (b"application/x-www-form-urlencoded", b"prompt=x&max_tokens=2", 400),
}


@pytest.mark.parametrize("name", sorted(CONTENT_TYPES))
@pytest.mark.parametrize("via", ["sidecar", "gateway"])
async def test_content_type_lies(
    cell: Cell, http: aiohttp.ClientSession, name: str, via: str
) -> None:
    content_type, body, status = CONTENT_TYPES[name]
    body = body or json.dumps(BASE_BODIES["completions"]).encode()
    headers = [] if content_type is None else [(b"Content-Type", content_type)]
    url = cell.sidecar.http_url if via == "sidecar" else cell.url
    answer = await raw_http(url, raw_post(ROUTES["completions"], body, headers))
    assert answer.status == status, str(answer)
    if status != 200:
        assert "send application/json" in error_of(answer)["message"]
    await assert_cell_well(cell, http)


OVERSIZE_HEADERS = {
    "one huge x-request-id": [(b"x-request-id", b"r" * 9000)],
    "one huge unknown header": [(b"x-junk", b"j" * 70_000)],
    "many headers": [(b"x-junk-%d" % i, b"v" * 100) for i in range(500)],
    "control character": [(b"x-request-id", b"a\x00b")],
}


@pytest.mark.parametrize("name", sorted(OVERSIZE_HEADERS))
@pytest.mark.parametrize("via", ["sidecar", "gateway"])
async def test_oversize_and_broken_headers_get_4xx(
    cell: Cell, http: aiohttp.ClientSession, name: str, via: str
) -> None:
    # aiohttp's parser refuses these before the application: a plain-text 400.
    url = cell.sidecar.http_url if via == "sidecar" else cell.url
    body = json.dumps(BASE_BODIES["completions"]).encode()
    answer = await raw_http(url, raw_post(ROUTES["completions"], body, OVERSIZE_HEADERS[name]))
    # "Got more than 8190 bytes when reading", "Too many headers received",
    # "Invalid header value char".
    assert answer.status == 400 and answer.body, str(answer)
    await assert_cell_well(cell, http)


# --- gRPC -------------------------------------------------------------------------

PROTO_TEXT = st.text(max_size=24)  # protobuf strings are UTF-8: no lone surrogates
FLOAT32 = st.one_of(
    st.floats(width=32), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 2.0, 1.0])
)
UINT32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**32 - 1]))
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": UINT32,
    "temperature": FLOAT32,
    "top_p": FLOAT32,
    "top_k": INT32,
    "stop": st.lists(PROTO_TEXT, max_size=20),
    "seed": INT64,
    "min_tokens": UINT32,
    "ignore_eos": st.booleans(),
    "presence_penalty": FLOAT32,
    "frequency_penalty": FLOAT32,
    "repetition_penalty": FLOAT32,
}
SAMPLING = st.fixed_dictionaries({}, optional=SAMPLING_FIELDS)
# In range, so that a fair share of requests is valid and goes as far as the engine.
SANE_SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.one_of(st.integers(1, 16), st.just(2**32 - 1)),
        "temperature": st.floats(0, 2, width=32),
        "top_p": st.floats(0.5, 1, width=32),
        "top_k": st.integers(-1, 50),
        "stop": st.lists(PROTO_TEXT, max_size=16),
        "seed": INT64,
        "min_tokens": st.integers(0, 1),
        "ignore_eos": st.booleans(),
        "presence_penalty": st.floats(-2, 2, width=32),
        "frequency_penalty": st.floats(-2, 2, width=32),
        "repetition_penalty": st.floats(0.5, 2, width=32),
    },
)
CHAT = st.lists(
    st.builds(
        inference_pb2.ChatMessage,
        role=st.one_of(st.sampled_from(CHAT_ROLES), PROTO_TEXT),
        content=PROTO_TEXT,
    ),
    max_size=3,
).map(lambda messages: inference_pb2.ChatMessages(messages=messages))


@st.composite
def generate_requests(draw: st.DrawFn) -> inference_pb2.GenerateRequest:
    msg = inference_pb2.GenerateRequest(
        request_id=draw(PROTO_TEXT),
        model=draw(st.sampled_from(["", MODEL, "", MODEL, "gpt-4o"]) | PROTO_TEXT),
        sampling=inference_pb2.SamplingParams(**draw(st.one_of(SANE_SAMPLING, SAMPLING))),
        metadata=draw(st.dictionaries(PROTO_TEXT, PROTO_TEXT, max_size=4)),
    )
    kinds = ["prompt", "prompt", "chat", "ids", "none", "empty chat", "empty ids"]
    kind = draw(st.sampled_from(kinds))
    if kind == "prompt":
        msg.prompt = draw(PROTO_TEXT)
    elif kind == "chat":
        msg.chat.CopyFrom(draw(CHAT))
    elif kind == "ids":
        msg.prompt_token_ids.ids.extend(draw(st.lists(UINT32, max_size=8)))
    elif kind == "empty chat":
        msg.chat.SetInParent()
    elif kind == "empty ids":
        msg.prompt_token_ids.SetInParent()
    return msg


def grpc_invalid(msg: inference_pb2.GenerateRequest) -> bool:
    """Wrong by a simple rule, read back from the message (floats are float32 there)."""
    s = msg.sampling
    fields = {name: getattr(s, name) for name in VALID.keys() & SAMPLING_FIELDS if s.HasField(name)}
    if surely_invalid("completions", fields):
        return True
    if s.HasField("min_tokens") and s.HasField("max_tokens") and s.min_tokens > s.max_tokens:
        return True
    kind = msg.WhichOneof("input")
    if kind == "prompt":
        return not msg.prompt
    if kind == "chat":
        return not msg.chat.messages or any(m.role not in CHAT_ROLES for m in msg.chat.messages)
    if kind == "prompt_token_ids":
        return not msg.prompt_token_ids.ids
    return True


GRPC_NAMES = {"input", "prompt", "messages", "model", *SAMPLING_FIELDS}
GRPC_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


async def first_chunk_or_error(
    call: grpc.aio.UnaryStreamCall[Any, Any],
) -> grpc.aio.AioRpcError | None:
    """Read one message and cancel the rest (max_tokens may be 2**32 - 1)."""
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            async for _ in call:
                break
        note_outcome("gRPC OK")
        return None
    except grpc.aio.AioRpcError as exc:
        note_outcome(f"gRPC {exc.code().name}")
        return exc
    finally:
        call.cancel()


async def assert_grpc_well(sidecar: Sidecar, channel: grpc.aio.Channel) -> None:
    await wait_until(lambda: sidecar.core.outstanding == 0, 3.0, "outstanding back to 0")
    health = health_pb2_grpc.HealthStub(channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=INFERENCE), timeout=2)
    assert reply.status == HEALTHY


METADATA = st.lists(
    st.tuples(
        st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=12).filter(
            lambda k: not k.startswith("grpc") and k not in ("te", "authorization")
        ),
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
    ),
    max_size=4,
)


@fuzz(200)
@given(msg=generate_requests(), metadata=METADATA)
async def test_grpc_generate_with_any_field_values(
    sidecar: Sidecar,
    channel: grpc.aio.Channel,
    msg: inference_pb2.GenerateRequest,
    metadata: list[tuple[str, str]],
) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    error = await first_chunk_or_error(
        stub.Generate(msg, timeout=CALL_TIMEOUT_S, metadata=metadata)
    )
    # Validation comes before the model check: an invalid request with an unknown
    # model may get either answer.
    unknown_model, invalid = msg.model not in ("", MODEL), grpc_invalid(msg)
    if unknown_model or invalid:
        assert error is not None and error.code() in GRPC_REFUSALS, error
    if unknown_model and not invalid:
        assert error is not None and error.code() == grpc.StatusCode.NOT_FOUND, error
    if invalid and not unknown_model:
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    if error is not None:
        assert error.code() in GRPC_REFUSALS, error
        details = error.details() or ""
        assert any(details.startswith(name) for name in GRPC_NAMES), details
    await assert_grpc_well(sidecar, channel)


def valid_wire() -> bytes:
    msg = inference_pb2.GenerateRequest(
        prompt="hello", sampling=inference_pb2.SamplingParams(max_tokens=2)
    )
    wire: bytes = msg.SerializeToString()
    return wire


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    data = bytearray(valid_wire())
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))])


@fuzz(150)
@given(data=st.one_of(st.binary(max_size=200), mangled()))
async def test_grpc_any_bytes_as_request(
    sidecar: Sidecar, channel: grpc.aio.Channel, data: bytes
) -> None:
    # No serializer on either side: the bytes go out as they are.
    generate = channel.unary_stream("/unitproxy.v1.Inference/Generate")
    error = await first_chunk_or_error(generate(data, timeout=CALL_TIMEOUT_S))
    if error is not None:
        if error.code() == grpc.StatusCode.UNKNOWN:  # grpcio could not decode the bytes
            assert "Error parsing message" in (error.details() or ""), error
        else:
            assert error.code() in GRPC_REFUSALS, error
            assert error.details(), error
    await assert_grpc_well(sidecar, channel)

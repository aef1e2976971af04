"""The gateway's HTTP/1.1 listener, spoken to byte for byte on loopback.

Inference POSTs with a Content-Length body are served on the lean path (proxy/gateway/
http1/front.py); anything else hands the connection to aiohttp. A raw client shows what a
client sees: keep-alive, pipelining, the handoff in the middle of a connection, framing
that must go to aiohttp, ``Connection: close``, and a client that leaves mid-stream.
Behind the gateway: the pool of keep-alive connections to a unit (http1/pool.py), shown
reusing its connections and recovering when a unit closes them; a fake unit (GET /load
for ``--load-source poll``) breaks keep-alive in each way a server may, or streams as fast
as it is read. Two tests drive ``upstream.Pool`` on its own, at races a client cannot
time from outside.

A response from aiohttp carries its ``Server`` header; one from the lean path has none:
that is how these tests know which path answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.gateway.http1.pool import Pool
from proxy.gateway.server import Gateway
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests.conftest import Cell, SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(30)

HOST = "127.0.0.1"
CALL_S = 5.0  # the longest any one answer may take here
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
SLOW_STREAM = {"prompt": "x", "max_tokens": 100_000, "stream": True}


# --- a raw HTTP/1.1 client ------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def __str__(self) -> str:
        return f"{self.status} {self.headers} {self.body[:300]!r}"

    @property
    def by_aiohttp(self) -> bool:
        return "aiohttp" in self.headers.get("server", "")

    def json(self) -> Any:
        assert self.headers.get("content-type", "").startswith("application/json"), str(self)
        return json.loads(self.body)


class Raw:
    """One client connection: requests written as given, responses parsed here."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def reply(self) -> Reply:
        async with asyncio.timeout(CALL_S):
            head = await self.reader.readuntil(b"\r\n\r\n")
            status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
            version, status, *_ = status_line.split(" ")
            assert version in ("HTTP/1.1", "HTTP/1.0"), status_line  # aiohttp's 400s: 1.0
            headers: dict[str, str] = {}
            for line in lines:
                name, _, value = line.partition(":")
                assert name.lower() not in headers, f"{name} twice in {head!r}"
                headers[name.lower()] = value.strip()
            if int(status) < 200:
                return Reply(int(status), headers, b"")
            if headers.get("transfer-encoding", "").lower() == "chunked":
                assert "content-length" not in headers, head
                body = await self._chunked()
            elif "content-length" in headers:
                body = await self.reader.readexactly(int(headers["content-length"]))
            else:
                body = await self.reader.read()
        return Reply(int(status), headers, body)

    async def _chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await self.reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers
                return b"".join(parts)
            parts.append(await self.reader.readexactly(size))
            assert await self.reader.readexactly(2) == b"\r\n", "chunk not ended by CRLF"

    async def closed_by_server(self) -> bool:
        """True once the server closed the connection without sending anything more."""
        async with asyncio.timeout(CALL_S):
            return await self.reader.read() == b""

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


RawFactory = Callable[[str], Awaitable[Raw]]


@pytest.fixture
async def raw() -> AsyncIterator[RawFactory]:
    opened: list[Raw] = []

    async def connect(url: str) -> Raw:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        conn = Raw(*await asyncio.open_connection(host, int(port)))
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        await conn.close()


def request(
    path: str = COMPLETIONS,
    body: dict[str, Any] | bytes | None = None,
    *headers: str,
    request_id: str | None = None,
) -> bytes:
    """A POST with a Content-Length body; ``headers`` are extra "Name: value" lines."""
    if body is None:
        body = {"prompt": "x", "max_tokens": 2}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {HOST}", "Content-Type: application/json",
             f"Content-Length: {len(data)}", *headers]  # fmt: skip
    if request_id is not None:
        lines.append(f"x-request-id: {request_id}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()


def completion_body(path: str, tokens: int, stream: bool) -> dict[str, Any]:
    if path == CHAT:
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                "stream": stream}  # fmt: skip
    return {"prompt": "x", "max_tokens": tokens, "stream": stream}


def check_completion(reply: Reply, tokens: int, request_id: str | None = None) -> None:
    """A 200 with one JSON completion of ``tokens`` tokens (for that request id)."""
    assert reply.status == 200, str(reply)
    completion = reply.json()
    assert completion["usage"]["completion_tokens"] == tokens, str(reply)
    assert completion["choices"][0]["finish_reason"] == "length", str(reply)
    if request_id is not None:
        assert reply.headers["x-request-id"] == request_id, str(reply)
        assert completion["id"].endswith(request_id), str(reply)


def check_stream(reply: Reply, tokens: int, request_id: str | None = None) -> None:
    """A 200 SSE stream of ``tokens`` tokens, ended by [DONE] (for that request id)."""
    assert reply.status == 200, str(reply)
    assert reply.headers["content-type"].startswith("text/event-stream"), str(reply)
    assert reply.body.endswith(b"\n\n"), str(reply)
    events = reply.body[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events), str(reply)
    assert events[-1] == b"data: [DONE]", str(reply)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    texts = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
             for c in chunks]  # fmt: skip
    assert sum(1 for t in texts if t) == tokens, str(reply)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", str(reply)
    if request_id is not None:
        assert reply.headers["x-request-id"] == request_id, str(reply)
        assert all(c["id"].endswith(request_id) for c in chunks), str(reply)


def check_error(reply: Reply, status: int) -> dict[str, Any]:
    """The OpenAI error body with ``status``."""
    assert reply.status == status, str(reply)
    error: dict[str, Any] = reply.json()["error"]
    assert error["message"] and error["type"] and error["code"], str(reply)
    return error


# --- servers -----------------------------------------------------------------------------

GatewayStarter = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def start_gateway_with() -> AsyncIterator[GatewayStarter]:
    """Like conftest's start_gateway, with settings of the server section too."""
    running: list[Gateway] = []

    async def start(
        units: list[str], server: dict[str, Any] | None = None, **gateway: Any
    ) -> Gateway:
        settings = load(
            {
                "server": {"host": HOST, "http_port": 0, "grpc_port": 0, **(server or {})},
                "gateway": {"units": units, **gateway},
            }
        )
        gw = Gateway(settings)
        await gw.__aenter__()
        running.append(gw)
        await wait_until(lambda: len(gw.router.serving()) == len(units), what="units SERVING")
        return gw

    yield start
    for gw in reversed(running):
        await gw.__aexit__(None, None, None)


def unit_spec(sidecar: Sidecar) -> str:
    return f"{sidecar.core.unit_id}={sidecar.http_url},{sidecar.grpc_target}"


ENDLESS_CAP = 128 << 20  # what a fake unit's endless stream sends at most
MAX_BODY = 2048  # the gateway's --max-body-bytes here


@pytest.fixture
async def cell(start_sidecar: SidecarFactory, start_gateway_with: GatewayStarter) -> Cell:
    unit = await start_sidecar(sidecar={"unit_id": "a"})
    gateway = await start_gateway_with([unit_spec(unit)], server={"max_body_bytes": MAX_BODY})
    return Cell(unit, gateway)


def metric(gw: Gateway, name: str, **labels: str) -> float:
    value = gw.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def assert_settled(cell: Cell) -> None:
    """Nothing outstanding on the unit, nothing in flight in the gateway."""
    await wait_until(lambda: cell.sidecar.core.outstanding == 0, 3.0, "unit outstanding 0")
    await wait_until(lambda: cell.gateway.gate.in_flight == 0, 3.0, "gateway in flight 0")
    assert all(u.inflight == 0 for u in cell.gateway.router.units.values())
    assert metric(cell.gateway, "unitproxy_outstanding_requests") == 0


# --- keep-alive and pipelining on the lean path ------------------------------------------


async def test_keep_alive_many_requests_on_one_connection(cell: Cell, raw: RawFactory) -> None:
    conn = await raw(cell.url)
    n = 0
    for round_ in range(2):
        for path in (COMPLETIONS, CHAT):
            for stream in (False, True):
                n += 1
                tokens, rid = 2 + n % 3, f"ka-{round_}-{n}"
                conn.send(request(path, completion_body(path, tokens, stream), request_id=rid))
                reply = await conn.reply()
                (check_stream if stream else check_completion)(reply, tokens, rid)
                assert not reply.by_aiohttp, f"request {n} left the lean path: {reply}"
                assert "connection" not in reply.headers, str(reply)
                assert reply.headers["x-unitproxy-unit"] == "a"
    # A request that arrives in pieces (head, then the body in two parts) is whole first.
    data = request(body={"prompt": "x", "max_tokens": 3}, request_id="pieces")
    split = data.index(b"\r\n\r\n") + 4
    for part in (data[:10], data[10:split], data[split : split + 5], data[split + 5 :]):
        conn.send(part)
        await asyncio.sleep(0.02)
    reply = await conn.reply()
    check_completion(reply, 3, "pieces")
    assert not reply.by_aiohttp
    assert metric(cell.gateway, "unitproxy_requests_total", route="completions", code="200") == 5
    assert metric(cell.gateway, "unitproxy_requests_total", route="chat", code="200") == 4
    await assert_settled(cell)


async def test_pipelined_requests_are_answered_in_order(cell: Cell, raw: RawFactory) -> None:
    conn = await raw(cell.url)
    # A long stream first: the two behind it wait in the buffer until it has ended.
    conn.send(
        request(COMPLETIONS, completion_body(COMPLETIONS, 30, True), request_id="p1")
        + request(CHAT, completion_body(CHAT, 2, False), request_id="p2")
        + request(COMPLETIONS, completion_body(COMPLETIONS, 3, False), request_id="p3")
    )
    check_stream(await conn.reply(), 30, "p1")
    check_completion(await conn.reply(), 2, "p2")
    check_completion(await conn.reply(), 3, "p3")
    # One whole request and half of the next in one write, the rest later.
    second = request(body=completion_body(COMPLETIONS, 4, True), request_id="p5")
    conn.send(request(request_id="p4") + second[:40])
    check_completion(await conn.reply(), 2, "p4")
    conn.send(second[40:])
    reply = await conn.reply()
    check_stream(reply, 4, "p5")
    assert not reply.by_aiohttp
    await assert_settled(cell)


async def pipeline_behind_a_stream(url: str) -> tuple[socket.socket, int]:
    """A connection whose stream is being served, then as many bytes pipelined behind it
    as the gateway takes before the client's writes block (for half a second)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sock.setblocking(False)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    await loop.sock_connect(sock, (host, int(port)))
    await loop.sock_sendall(sock, request(COMPLETIONS, SLOW_STREAM))
    async with asyncio.timeout(CALL_S):
        assert (await loop.sock_recv(sock, 65536)).startswith(b"HTTP/1.1 200")
    chunk = b"x" * (256 * 1024)
    sent = 0
    with contextlib.suppress(TimeoutError):
        while sent < (16 << 20):
            await asyncio.wait_for(loop.sock_sendall(sock, chunk), 0.5)
            sent += len(chunk)
    return sock, sent


async def test_bytes_pipelined_behind_a_request_are_held_briefly(
    start_sidecar: SidecarFactory, start_gateway_with: GatewayStarter
) -> None:
    # A client pipelines megabytes behind a long stream: the gateway holds a little of
    # it and stops reading (the kernel's buffers hold the rest), on each connection and,
    # past server.max_pipelined_bytes, on the port: a second connection that comes
    # once the port's share is held gets nothing more read behind its request.
    unit = await start_sidecar(sidecar={"unit_id": "a"})
    gw = await start_gateway_with([unit_spec(unit)], server={"max_pipelined_bytes": 1000})
    first, sent = await pipeline_behind_a_stream(gw.http_url)
    try:
        assert sent < (3 << 20), f"the client pipelined {sent >> 10} KiB unblocked"
        held = metric(gw, "unitproxy_pipelined_bytes")
        assert 0 < held <= 512 * 1024, held
        second, _ = await pipeline_behind_a_stream(gw.http_url)
        second.close()
        assert metric(gw, "unitproxy_pipelined_bytes") == held, "the port's budget is spent"
    finally:
        first.close()
    await wait_until(lambda: metric(gw, "unitproxy_pipelined_bytes") == 0, 3.0, "all freed")
    await wait_until(lambda: gw.gate.in_flight == 0, 3.0, "gateway in flight 0")


# --- the handoff to aiohttp in the middle of a connection --------------------------------


async def test_handoff_after_lean_requests_on_one_connection(cell: Cell, raw: RawFactory) -> None:
    conn = await raw(cell.url)
    conn.send(request(request_id="lean"))
    reply = await conn.reply()
    check_completion(reply, 2, "lean")
    assert not reply.by_aiohttp

    conn.send(get("/health"))
    health = await conn.reply()
    assert health.status == 200 and health.json() == {"status": "ok"}, str(health)
    assert health.by_aiohttp
    conn.send(get("/ready"))
    ready = await conn.reply()
    assert ready.status == 200 and ready.json()["state"] == "SERVING", str(ready)
    conn.send(get("/metrics"))
    page = await conn.reply()
    assert page.status == 200 and b"unitproxy_requests_total" in page.body, str(page)

    # From here on aiohttp serves this connection: inference still works on it.
    conn.send(request(request_id="after"))
    reply = await conn.reply()
    check_completion(reply, 2, "after")
    assert reply.by_aiohttp, "the handed-off connection stays with aiohttp"
    conn.send(request(body=completion_body(CHAT, 3, True), path=CHAT, request_id="after-sse"))
    check_stream(await conn.reply(), 3, "after-sse")

    # A lean request and a GET pipelined in one write: the handoff happens at the
    # request boundary, with the GET's bytes still in the lean path's buffer.
    other = await raw(cell.url)
    other.send(request(request_id="first") + get("/health") + request(request_id="third"))
    first = await other.reply()
    check_completion(first, 2, "first")
    assert not first.by_aiohttp
    health = await other.reply()
    assert health.status == 200 and health.json() == {"status": "ok"}, str(health)
    check_completion(await other.reply(), 2, "third")
    both_paths = metric(cell.gateway, "unitproxy_requests_total", route="completions", code="200")
    assert both_paths == 4, "the lean path and aiohttp count requests alike"
    await assert_settled(cell)


# --- requests that must take the aiohttp path ------------------------------------------


def head_only(path: str, *headers: str, version: str = "1.1") -> bytes:
    lines = [f"POST {path} HTTP/{version}", f"Host: {HOST}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_headers(body: bytes) -> tuple[str, str]:
    return "Content-Type: application/json", f"Content-Length: {len(body)}"


async def test_chunked_request_body(cell: Cell, raw: RawFactory) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 3}).encode()
    conn = await raw(cell.url)
    conn.send(
        head_only(COMPLETIONS, "Content-Type: application/json", "Transfer-Encoding: chunked")
        + b"%x\r\n%b\r\n" % (10, body[:10])
        + b"%x\r\n%b\r\n" % (len(body) - 10, body[10:])
        + b"0\r\n\r\n"
    )
    reply = await conn.reply()
    check_completion(reply, 3)
    assert reply.by_aiohttp
    conn.send(request())  # the connection stays usable
    check_completion(await conn.reply(), 2)
    await assert_settled(cell)


async def test_gzip_request_body(cell: Cell, raw: RawFactory) -> None:
    # aiohttp decodes the body; the unit gets plain JSON (as test_hostile_input expects
    # of the sidecar itself).
    conn = await raw(cell.url)
    valid = gzip.compress(json.dumps({"prompt": "x", "max_tokens": 3}).encode())
    conn.send(request(COMPLETIONS, valid, "Content-Encoding: gzip", request_id="gz"))
    reply = await conn.reply()
    check_completion(reply, 3, "gz")
    assert reply.by_aiohttp
    conn.send(
        request(COMPLETIONS, b"not gzip at all", "Content-Encoding: gzip", "Connection: close")
    )
    error = check_error(await conn.reply(), 400)
    assert "body" in error["message"], error
    await assert_settled(cell)


async def test_expect_100_continue(cell: Cell, raw: RawFactory) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    conn = await raw(cell.url)
    conn.send(head_only(COMPLETIONS, *json_headers(body), "Expect: 100-continue"))
    interim = await conn.reply()  # the client waits for it before sending its body
    assert interim.status == 100, str(interim)
    conn.send(body)
    check_completion(await conn.reply(), 2)
    await assert_settled(cell)


async def test_http_1_0_request(cell: Cell, raw: RawFactory) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    conn = await raw(cell.url)
    conn.send(head_only(COMPLETIONS, *json_headers(body), version="1.0") + body)
    async with asyncio.timeout(CALL_S):
        data = await conn.reader.read()  # HTTP/1.0: the server closes after its answer
    head, _, content = data.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")), data
    assert json.loads(content)["usage"]["completion_tokens"] == 2, data
    await assert_settled(cell)


async def test_body_over_the_limit(cell: Cell, raw: RawFactory) -> None:
    valid = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    at_limit = valid + b" " * (MAX_BODY - len(valid))
    conn = await raw(cell.url)
    conn.send(request(COMPLETIONS, at_limit))
    reply = await conn.reply()
    check_completion(reply, 2)
    assert not reply.by_aiohttp, "a body exactly at the limit stays on the lean path"
    conn.send(request(COMPLETIONS, at_limit + b" ", "Connection: close"))
    error = check_error(await conn.reply(), 413)
    assert str(MAX_BODY) in error["message"], error
    await assert_settled(cell)


async def test_form_content_type(cell: Cell, raw: RawFactory) -> None:
    conn = await raw(cell.url)
    conn.send(
        request(COMPLETIONS, b"prompt=x&max_tokens=2").replace(
            b"Content-Type: application/json", b"Content-Type: application/x-www-form-urlencoded"
        )
    )
    error = check_error(await conn.reply(), 400)
    assert "send application/json" in error["message"], error
    conn.send(request())
    check_completion(await conn.reply(), 2)
    await assert_settled(cell)


async def test_an_unknown_path_is_answered_as_vllms_server_answers_it(
    cell: Cell, raw: RawFactory
) -> None:
    """vLLM's server (FastAPI) answers a path it has no route for with 404
    ``{"detail":"Not Found"}``: so does the gateway, with its own headers, whichever way
    the request comes (a POST the lean path would take but for its path, a GET, a
    chunked body); an unknown path under its own (/admin, /units) keeps its error body."""
    conn = await raw(cell.url)
    body = json.dumps({"prompt": "x"}).encode()
    sent = [
        request("/v1/nothing", request_id="lean-shaped"),
        get("/v1/nothing"),
        get("/v2/chat/completions"),
        head_only("/tokenizer", "Transfer-Encoding: chunked", "Content-Type: application/json")
        + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body),
    ]
    for data in sent:
        conn.send(data)
        reply = await conn.reply()
        assert (reply.status, reply.body) == (404, b'{"detail":"Not Found"}'), str(reply)
        assert reply.headers["content-type"] == "application/json", str(reply)
        assert reply.headers["x-unitproxy-unit"] == "none" and reply.headers["x-request-id"]
    conn.send(request("/v1/nothing", request_id="lean-shaped"))
    assert (await conn.reply()).headers["x-request-id"] == "lean-shaped"
    for path in ("/admin/nothing", "/units/u1"):
        conn.send(get(path))
        error = check_error(await conn.reply(), 404)
        assert path in error["message"], error
    conn.send(request())
    check_completion(await conn.reply(), 2)
    await assert_settled(cell)


async def test_request_ids_the_lean_path_does_not_take(cell: Cell, raw: RawFactory) -> None:
    conn = await raw(cell.url)
    conn.send(request(request_id="r" * 1000))
    error = check_error(await conn.reply(), 400)
    assert "x-request-id" in error["message"], error
    # Twice: which one counts is aiohttp's to say, but the request is served.
    conn = await raw(cell.url)
    conn.send(request(COMPLETIONS, None, "x-request-id: one", request_id="two"))
    reply = await conn.reply()
    check_completion(reply, 2)
    assert reply.headers["x-request-id"] in ("one", "two"), str(reply)
    await assert_settled(cell)


FRAMED = b'{"prompt": "x", "max_tokens": 1}'
LENGTH = b"Content-Length: %d" % len(FRAMED)
FRAMING = {  # what stands in the request for its Content-Length line
    "Content-Length twice, same value": LENGTH + b"\r\n" + LENGTH,
    "Content-Length twice, other value": LENGTH + b"\r\nContent-Length: 7",
    "Content-Length and Transfer-Encoding": LENGTH + b"\r\nTransfer-Encoding: chunked",
    "Content-Length with a plus": b"Content-Length: +%d" % len(FRAMED),
    "Content-Length not ASCII digits": "Content-Length: \u00b3\u00b2".encode(),
    "Content-Length negative": b"Content-Length: -%d" % len(FRAMED),
}


@pytest.mark.parametrize("name", sorted(FRAMING))
async def test_broken_framing_gets_4xx(cell: Cell, raw: RawFactory, name: str) -> None:
    data = request(COMPLETIONS, FRAMED).replace(LENGTH, FRAMING[name])
    conn = await raw(cell.url)
    conn.send(data)
    reply = await conn.reply()
    assert 400 <= reply.status < 500, str(reply)
    await assert_settled(cell)
    # The gateway serves the next client as before.
    other = await raw(cell.url)
    other.send(request())
    check_completion(await other.reply(), 2)


async def test_head_with_bare_lf_line_ends_is_answered(cell: Cell, raw: RawFactory) -> None:
    data = request(COMPLETIONS, None, "Connection: close").replace(b"\r\n", b"\n")
    sidecar = await raw(cell.sidecar.http_url)
    sidecar.send(data)
    assert (await sidecar.reply()).status == 400, "aiohttp refuses it at once"
    conn = await raw(cell.url)
    conn.send(data)
    async with asyncio.timeout(1):
        reply = await conn.reply()
    assert reply.status == 400, str(reply)


# --- offers to switch protocols, versions and hosts ----------------------------------------

H2C = (
    "Connection: Upgrade, HTTP2-Settings",
    "Upgrade: h2c",
    "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
)
WEBSOCKET = ("Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")  # fmt: skip
UPGRADES = {  # (what curl --http2 or a websocket client sends, on the lean path or not)
    "h2c, inference": (H2C, True),
    "websocket, inference": (WEBSOCKET, True),
    "h2c, GET /health": (H2C, False),
    "websocket, GET /v1/models": (WEBSOCKET, False),
}


@pytest.mark.parametrize("name", list(UPGRADES))
async def test_an_offer_to_upgrade_is_ignored_and_served_as_http_1_1(
    cell: Cell, raw: RawFactory, name: str
) -> None:
    # The gateway switches to no other protocol: it answers as HTTP/1.1 (RFC 9110
    # section 7.8 lets a server ignore Upgrade), never a close with no answer.
    offer, inference = UPGRADES[name]
    conn = await raw(cell.url)
    for _ in range(2):  # and the connection goes on as HTTP/1.1
        if inference:
            conn.send(request(COMPLETIONS, None, *offer))
            reply = await conn.reply()
            check_completion(reply, 2)
            assert not reply.by_aiohttp, "the lean path serves it, the offer ignored"
        else:
            path = "/health" if "health" in name else "/v1/models"
            conn.send(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n".encode()
                      + "".join(f"{h}\r\n" for h in offer).encode() + b"\r\n")  # fmt: skip
            reply = await conn.reply()
            assert reply.status == 200, str(reply)
        assert reply.status != 101
    await assert_settled(cell)


async def test_a_request_without_host_gets_400(cell: Cell, raw: RawFactory) -> None:
    # HTTP/1.1 asks for a Host header (RFC 9112 section 3.2): the sidecar and the gateway
    # on either path answer 400.
    for url in (cell.sidecar.http_url, cell.url):
        conn = await raw(url)
        conn.send(request().replace(f"Host: {HOST}\r\n".encode(), b""))
        reply = await conn.reply()
        assert reply.status == 400, str(reply)
    assert metric(cell.gateway, "unitproxy_requests_total", route="completions", code="200") == 0
    await assert_settled(cell)


@pytest.mark.parametrize("version", ["2.0", "0.9"])
async def test_a_request_line_of_another_http_version_gets_505(
    cell: Cell, raw: RawFactory, version: str
) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    for url in (cell.url, cell.sidecar.http_url):
        conn = await raw(url)
        conn.send(head_only(COMPLETIONS, *json_headers(body), version=version) + body)
        reply = await conn.reply()  # which asserts an HTTP/1.x status line
        error = check_error(reply, 505)
        assert error["code"] == "http_version_not_supported", error
        assert await conn.closed_by_server()
    await assert_settled(cell)


# --- Connection: close -----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_connection_close_on_the_lean_path(cell: Cell, raw: RawFactory, stream: bool) -> None:
    conn = await raw(cell.url)
    # A second request pipelined behind it is never answered: the client asked to close.
    conn.send(
        request(COMPLETIONS, completion_body(COMPLETIONS, 3, stream), "Connection: close")
        + request()
    )
    reply = await conn.reply()
    (check_stream if stream else check_completion)(reply, 3)
    assert not reply.by_aiohttp
    assert reply.headers.get("connection", "").lower() == "close", str(reply)
    assert await conn.closed_by_server(), "the server closes the connection after the answer"
    await assert_settled(cell)
    assert metric(cell.gateway, "unitproxy_requests_total", route="completions", code="200") == 1


# --- the pool of connections to a unit -------------------------------------------------


def tcp_peers(port: int) -> set[int]:
    """The other ports of every TCP socket on 127.0.0.1 with ``port`` at one end, in any
    state but LISTEN (closed ones linger in TIME_WAIT): one per connection ever made."""
    peers = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if state == "0A":
            continue
        local_port, remote_port = (int(end.split(":")[1], 16) for end in (local, remote))
        if local_port == port:
            peers.add(remote_port)
        elif remote_port == port:
            peers.add(local_port)
    return peers


async def test_connections_to_the_unit_are_reused(cell: Cell, raw: RawFactory) -> None:
    port = int(cell.sidecar.http_url.rsplit(":", 1)[1])
    before = tcp_peers(port)  # sockets of earlier tests on this port, in TIME_WAIT
    for i in range(20):
        conn = await raw(cell.url)  # a new client connection each time: the pool is apart
        stream = i % 2 == 1
        conn.send(request(COMPLETIONS, completion_body(COMPLETIONS, 2, stream)))
        (check_stream if stream else check_completion)(await conn.reply(), 2)
        await conn.close()
    peers = tcp_peers(port) - before
    assert 1 <= len(peers) <= 2, f"20 requests took {len(peers)} connections to the unit"
    await assert_settled(cell)


class FakeUnit:
    """The HTTP side of a unit (GET /load, POST /v1/completions), with knobs.

    ``mode``, how it treats keep-alive: ``keep`` as a unit should; ``close_on_reuse``
    keeps a connection open after its answer but closes it, unanswered, when a second
    request comes on it; ``connection_close`` says so in its answer and closes;
    ``silent_close`` closes after its answer without saying so; ``close_delimited``
    sends neither Content-Length nor chunks: its answer ends where the connection does
    (RFC 9112 section 6.3), as an HTTP/1.0 server's would. ``interim`` keeps alive
    and sends a 100 and a 103 before each answer; ``switch`` answers 101 Switching
    Protocols, which it was never asked for, then bytes of another protocol.
    A request with ``"endless": true`` gets an SSE stream that goes on as long as the
    gateway reads it (``streamed`` counts its bytes); ``"pad": N`` a JSON answer of
    about N bytes.
    """

    def __init__(self, mode: str):
        self.mode = mode
        self.answered = 0
        self.refused = 0  # requests that came on a used connection and were not answered
        self.connections = 0  # that carried an answered completion
        self.streamed = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> FakeUnit:
        self._server = await asyncio.start_server(self._serve, HOST, 0)
        self.url = f"http://{HOST}:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        served = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                target = head.split(b" ", 2)[1]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = json.loads(await reader.readexactly(length) or b"{}")
                if target.partition(b"?")[0] == b"/load":  # the gateway names itself
                    writer.write(self._load())
                    return
                if served and self.mode == "close_on_reuse":
                    self.refused += 1
                    return
                self.connections += served == 0
                served += 1
                self.answered += 1
                if body.get("endless"):
                    await self._endless(writer)
                    return
                if self.mode == "interim":  # the answer comes in a later read
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n"
                                 b"Link: </style.css>; rel=preload\r\n\r\n")  # fmt: skip
                    await writer.drain()
                    await asyncio.sleep(0.02)
                writer.write(self._completion(body))
                await writer.drain()
                if self.mode not in ("keep", "close_on_reuse", "interim"):
                    return
        except ConnectionError:
            return
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _endless(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        event = b'data: {"id":"e","choices":[{"index":0,"text":"%b"}]}\n\n' % (b"x" * 65536)
        chunk = b"%x\r\n%b\r\n" % (len(event), event)
        while self.streamed < ENDLESS_CAP:
            writer.write(chunk)
            await writer.drain()
            self.streamed += len(chunk)
        await asyncio.sleep(3600)  # the gateway read all it could take: hold the stream

    def _load(self) -> bytes:
        report = json.dumps({"unit_id": "fake", "state": "SERVING", "outstanding": 0,
                             "capacity": 8}).encode()  # fmt: skip
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(report), report))  # fmt: skip

    def _completion(self, request: dict[str, Any]) -> bytes:
        if self.mode == "switch":
            return (b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                    b"Upgrade: h2c\r\n\r\n\x00\x00\x12\x04\x00\x00\x00\x00\x00")  # fmt: skip
        close = b"Connection: close\r\n" if self.mode == "connection_close" else b""
        if self.mode == "close_delimited":
            return self._close_delimited(request)
        if request.get("pad"):
            text = "x" * request["pad"]
            done = json.dumps({"id": "c", "object": "text_completion",
                               "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})  # fmt: skip
            return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%b" % (len(done), done.encode()))  # fmt: skip
        if request.get("stream"):
            events = [b'data: {"id":"s","choices":[{"index":0,"text":" t%d"}]}\n\n' % i
                      for i in range(3)] + [b"data: [DONE]\n\n"]  # fmt: skip
            chunks = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
            return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n%b"
                    b"Transfer-Encoding: chunked\r\n\r\n%b" % (close, chunks))  # fmt: skip
        done = json.dumps({"id": "c", "object": "text_completion",
                           "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})  # fmt: skip
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%b"
                b"Content-Length: %d\r\n\r\n%b" % (close, len(done), done.encode()))  # fmt: skip

    def _close_delimited(self, request: dict[str, Any]) -> bytes:
        if request.get("stream"):
            events = [b'data: {"id":"s","choices":[{"index":0,"text":" t%d"}]}\n\n' % i
                      for i in range(3)] + [b"data: [DONE]\n\n"]  # fmt: skip
            return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Connection: close\r\n\r\n" + b"".join(events))  # fmt: skip
        done = json.dumps({"id": "c", "object": "text_completion",
                           "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})  # fmt: skip
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"\r\n%b" % done.encode())  # fmt: skip


@pytest.mark.parametrize(
    "mode",
    [
        "close_on_reuse",
        "connection_close",
        "silent_close",
        "close_delimited",
        "interim",
    ],
)
async def test_unit_that_closes_its_connections(
    start_gateway_with: GatewayStarter, raw: RawFactory, mode: str
) -> None:
    async with FakeUnit(mode) as unit:
        # Poll its /load: the fake has no gRPC side; the gRPC target is never dialled.
        gw = await start_gateway_with(
            [f"fake={unit.url},{HOST}:9"], load_source="poll", poll_interval_s=0.05
        )
        conn = await raw(gw.http_url)
        for i in range(20):
            stream = i % 2 == 1
            conn.send(request(COMPLETIONS, {"prompt": "x", "max_tokens": 3, "stream": stream}))
            reply = await conn.reply()
            assert reply.status == 200, f"request {i}: {reply}"
            if stream:
                assert reply.body.count(b"data: ") == 4 and reply.body.endswith(b"[DONE]\n\n")
            else:
                assert reply.json()["choices"][0]["text"] == "ok", str(reply)
        assert unit.answered == 20
        if mode == "close_on_reuse":
            # Every reuse met a closed connection and went once more on a new one.
            assert unit.refused == 19, "the gateway reused connections the unit then closed"
        # (interim: one connection kept, the 1xx before each answer dropped)
        assert unit.connections == (1 if mode == "interim" else 20)
        assert metric(gw, "unitproxy_gateway_retries_total", reason="connect") == 0
        assert gw.router.units["fake"].ejected_until == 0
        await conn.close()
        await wait_until(lambda: gw.gate.in_flight == 0, 3.0, "gateway in flight 0")


async def test_a_unit_that_switches_protocols_fails_the_request_clearly(
    start_gateway_with: GatewayStarter, raw: RawFactory
) -> None:
    # A 101 the gateway never asked for (it sends no Upgrade): the unit's answer is
    # broken, and the client gets the gateway's error, not the 101.
    async with FakeUnit("switch") as unit:
        gw = await start_gateway_with(
            [f"fake={unit.url},{HOST}:9"], load_source="poll", poll_interval_s=0.05
        )
        conn = await raw(gw.http_url)
        conn.send(request(COMPLETIONS, {"prompt": "x", "max_tokens": 3}))
        error = check_error(await conn.reply(), 503)
        assert error["code"] == "unit_failed", error
        assert unit.answered >= 1
        await wait_until(lambda: gw.gate.in_flight == 0, 3.0, "gateway in flight 0")


# --- a client that leaves ---------------------------------------------------------------


async def test_client_leaves_mid_stream_on_the_lean_path(cell: Cell, raw: RawFactory) -> None:
    conns = []
    for _ in range(3):
        conn = await raw(cell.url)
        conn.send(request(COMPLETIONS, SLOW_STREAM))
        async with asyncio.timeout(CALL_S):
            head = await conn.reader.readuntil(b"\r\n\r\n")
            assert b"Transfer-Encoding: chunked" in head, head
            await conn.reader.readuntil(b"\n\n")  # the first event
        conns.append(conn)
    # And one that leaves before any byte came back.
    early = await raw(cell.url)
    early.send(request(COMPLETIONS, {**SLOW_STREAM, "stream": False}))
    await wait_until(lambda: cell.sidecar.core.outstanding == 4, 3.0, "4 requests at the unit")
    assert cell.gateway.gate.in_flight == 4
    assert metric(cell.gateway, "unitproxy_outstanding_requests") == 4
    for conn in [*conns, early]:
        await conn.close()
    await assert_settled(cell)
    await wait_until(lambda: cell.sidecar.engine.stats().running == 0, 3.0, "engine aborted")
    assert metric(cell.gateway, "unitproxy_requests_total", route="completions", code="499") == 4
    # The gateway still serves.
    conn = await raw(cell.url)
    conn.send(request())
    check_completion(await conn.reply(), 2)


async def unread_socket(url: str, data: bytes) -> socket.socket:
    """Send ``data`` on a connection with a tiny receive buffer, then never read a byte
    (a raw socket: an asyncio transport would keep reading for us)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    await loop.sock_connect(sock, (host, int(port)))
    await loop.sock_sendall(sock, data)
    return sock


async def streamed_until_steady(unit: FakeUnit) -> int:
    """What an endless stream sent once it stopped growing for 0.5 s (the gateway stopped
    reading), or as soon as it passed ``BUFFERED_LIMIT``."""
    await wait_until(lambda: unit.streamed > 0, 5.0, "the stream started")
    last, steady_since = -1, 0.0
    async with asyncio.timeout(10):
        while unit.streamed < BUFFERED_LIMIT:
            now = asyncio.get_running_loop().time()
            if unit.streamed != last:
                last, steady_since = unit.streamed, now
            elif now - steady_since >= 0.5:
                break
            await asyncio.sleep(0.05)
    return unit.streamed


BUFFERED_LIMIT = 48 << 20  # a paced stream stops within a few MiB (socket buffers)


async def test_stream_to_a_client_that_stops_reading_is_paced(
    start_gateway_with: GatewayStarter,
) -> None:
    # test_faults.test_clients_that_stop_reading checks the gateway's RSS for this with a
    # real unit; here the unit sends as fast as the gateway reads.
    async with FakeUnit("keep") as unit:
        gw = await start_gateway_with(
            [f"fake={unit.url},{HOST}:9"], load_source="poll", poll_interval_s=0.05
        )
        endless = request(COMPLETIONS, {"prompt": "x", "endless": True, "stream": True})
        sock = await unread_socket(gw.http_url, endless)
        try:
            streamed = await streamed_until_steady(unit)
        finally:
            sock.close()
    assert streamed < BUFFERED_LIMIT, f"the gateway took {streamed >> 20} MiB from the unit"


async def test_stream_pipelined_behind_an_unread_answer_is_paced(
    start_gateway_with: GatewayStarter,
) -> None:
    async with FakeUnit("keep") as unit:
        gw = await start_gateway_with(
            [f"fake={unit.url},{HOST}:9"], load_source="poll", poll_interval_s=0.05
        )
        big = request(COMPLETIONS, {"prompt": "x", "pad": 8 << 20})  # over what sockets hold
        endless = request(COMPLETIONS, {"prompt": "x", "endless": True, "stream": True})
        sock = await unread_socket(gw.http_url, big + endless)
        try:
            streamed = await streamed_until_steady(unit)
        finally:
            sock.close()
    assert streamed < BUFFERED_LIMIT, f"the gateway took {streamed >> 20} MiB from the unit"


# --- the pool on its own -----------------------------------------------------------------


async def test_a_connection_paused_by_its_receiver_is_not_reused_paused() -> None:
    async with FakeUnit("keep") as unit:
        pool = Pool(unit.url, limit=1)
        try:
            stream = json.dumps({"prompt": "x", "stream": True}).encode()
            conn = await pool.request(b"POST", COMPLETIONS, {}, stream)
            got = []

            def sink(data: bytes) -> None:
                # What front.ClientConnection.pause_writing does when this write fills the
                # client's buffer; the whole answer came in this one read.
                got.append(data)
                conn.pause_reading()

            async with asyncio.timeout(CALL_S):
                await conn.splice(sink)
            assert b"".join(got).endswith(b"data: [DONE]\n\n")
            # front.Response.end() drops the producer before it drains: nobody resumes it.
            conn.done()
            async with asyncio.timeout(1):
                again = await pool.request(b"POST", COMPLETIONS, {}, b'{"prompt": "x"}')
                assert again.status == 200
                assert json.loads(await again.read())["choices"][0]["text"] == "ok"
            again.done()
            assert unit.connections == 1, "the same connection, reused"
        finally:
            await pool.close()


async def test_a_waiter_cancelled_as_it_is_woken_passes_the_connection_on() -> None:
    async with FakeUnit("keep") as unit:
        pool = Pool(unit.url, limit=1)
        body = b'{"prompt": "x"}'
        try:
            first = await pool.request(b"POST", COMPLETIONS, {}, body)
            await first.read()
            second = asyncio.create_task(pool.request(b"POST", COMPLETIONS, {}, body))
            third = asyncio.create_task(pool.request(b"POST", COMPLETIONS, {}, body))
            for _ in range(5):
                await asyncio.sleep(0)  # both wait for the one connection
            assert not second.done() and not third.done()
            first.done()  # wakes `second`...
            second.cancel()  # ...whose client leaves before it runs
            async with asyncio.timeout(1):
                conn = await third
                assert conn.status == 200
                await conn.read()
            conn.done()
            with contextlib.suppress(asyncio.CancelledError):
                await second
        finally:
            await pool.close()

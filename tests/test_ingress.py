"""Ingress limits against slow, idle and greedy clients, on the gateway and the sidecar.

Each test plays one hostile or careless client on a raw socket and checks what it
sees: a 408 and a close within the phase's timeout (head, body), a silent close after
the keep-alive idle time, a 503 past ``server.max_connections``, a 401 from the head
before any body byte is read, and a stream whose client stopped reading that is cut
after ``server.write_timeout_s``, freeing the unit's capacity slot.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest

from proxy.follower.agent import FollowerAgent
from proxy.gateway.server import Gateway
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests.conftest import SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(30)

HOST = "127.0.0.1"
TIMEOUT_S = 0.4  # every limit here; a close must come before LATE_S
LATE_S = 3.0
LIMITS = {
    "head_timeout_s": TIMEOUT_S,
    "body_timeout_s": TIMEOUT_S,
    "keepalive_timeout_s": TIMEOUT_S,
    "write_timeout_s": TIMEOUT_S,
}
KEY = "sk-ingress-test"
BODY = json.dumps({"prompt": "x", "max_tokens": 2}).encode()


def post(path: str, length: int, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {HOST}", "Content-Type: application/json",
             f"Content-Length: {length}", *headers]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.fixture
async def servers(start_sidecar: SidecarFactory) -> AsyncIterator[dict[str, Any]]:
    """A sidecar and a gateway in front of it, both under LIMITS, API keys on both."""
    # A fast engine, so that an unread stream fills the sockets' buffers in a second.
    sidecar = await start_sidecar(
        server={**LIMITS, "api_keys": [KEY]}, sim={"decode_step_ms": 0.02}
    )
    unit = f"a={sidecar.http_url},{sidecar.grpc_target}"
    settings = load(
        {
            "server": {"host": HOST, "http_port": 0, "grpc_port": 0, **LIMITS,
                       "api_keys": [KEY]},
            "gateway": {"units": [unit], "unit_api_key": KEY},
        }
    )  # fmt: skip
    async with Gateway(settings) as gateway:
        await wait_until(lambda: len(gateway.router.serving()) == 1, what="unit SERVING")
        yield {"gateway": gateway, "sidecar": sidecar}


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def closed_with(reader: asyncio.StreamReader, started: float) -> tuple[bytes, float]:
    """Everything the server sent until it closed, and when it closed (s after start)."""
    async with asyncio.timeout(LATE_S + 2):
        data = await reader.read()
    return data, time.monotonic() - started


def status(data: bytes) -> int:
    assert data.startswith(b"HTTP/1."), data[:200]
    return int(data.split(b" ", 2)[1])


def last_status(data: bytes) -> int:
    """The status of the last response in ``data`` (after a 100 Continue, say)."""
    return status(data[data.rindex(b"HTTP/1.") :])


def closed_total(server: Gateway | Sidecar | FollowerAgent, reason: str) -> float:
    value = server.registry.get_sample_value(
        "unitproxy_client_connections_closed_total", {"reason": reason}
    )
    return value or 0.0


ROLES = ["gateway", "sidecar"]
# What each slow client sends, then nothing: what it must get back, and the reason.
SLOW = {
    "one byte of a head": (b"P", 408, "head_timeout"),
    "a head without its end": (post("/v1/completions", 2)[:-2], 408, "head_timeout"),
    "a body one byte short": (
        post("/v1/completions", len(BODY), f"Authorization: Bearer {KEY}") + BODY[:-1],
        408,
        "body_timeout",
    ),
    "a partial chunked body": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'5\r\n{"pro',
        408,
        "body_timeout",
    ),
    "Expect: 100-continue and no body": (
        post("/v1/completions", 40, "Expect: 100-continue", f"Authorization: Bearer {KEY}"),
        408,
        "body_timeout",
    ),
    "nothing at all": (b"", 0, "head_timeout"),
}


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("slow", list(SLOW), ids=list(SLOW))
async def test_a_slow_client_is_closed_within_its_timeout(
    servers: dict[str, Any], role: str, slow: str
) -> None:
    server = servers[role]
    data, want, reason = SLOW[slow]
    before = closed_total(server, reason)
    reader, writer = await connect(server.http_url)
    started = time.monotonic()
    writer.write(data)
    got, after_s = await closed_with(reader, started)
    writer.close()
    assert TIMEOUT_S * 0.9 <= after_s < LATE_S, f"closed after {after_s:.2f} s"
    if want:
        assert last_status(got) == want, got
        assert json.loads(got.split(b"\r\n\r\n")[-1])["error"]["code"] == "request_timeout"
    else:
        assert got == b""
    assert closed_total(server, reason) == before + 1


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("path", ["/v1/completions", "/health"])
async def test_the_head_timer_is_rearmed_after_each_request(
    servers: dict[str, Any], role: str, path: str
) -> None:
    # /v1/completions stays on the gateway's lean path; /health goes to aiohttp.
    server = servers[role]
    reader, writer = await connect(server.http_url)
    for _ in range(3):  # a keep-alive client at its own pace: never cut
        if path == "/health":
            writer.write(f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        else:
            writer.write(post(path, len(BODY), f"Authorization: Bearer {KEY}") + BODY)
        async with asyncio.timeout(LATE_S):
            head = await reader.readuntil(b"\r\n\r\n")
            assert status(head) == 200, head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        await asyncio.sleep(TIMEOUT_S / 2)
    writer.write(b"G")  # then a head that never ends
    started = time.monotonic()
    got, after_s = await closed_with(reader, started)
    writer.close()
    assert status(got) == 408
    assert after_s < LATE_S


@pytest.mark.parametrize("role", ["gateway", "sidecar", "follower"])
async def test_a_new_connection_that_sends_nothing_gets_the_head_timeout(
    start_sidecar: SidecarFactory, role: str
) -> None:
    # Not the keep-alive time: a socket that never sends a byte holds a connection
    # (of server.max_connections) for head_timeout_s, counted from the connect.
    limits = {**LIMITS, "keepalive_timeout_s": 60.0}
    async with serving(start_sidecar, role, limits) as server:
        before = closed_total(server, "head_timeout")
        reader, writer = await connect(server.http_url)
        got, after_s = await closed_with(reader, time.monotonic())
        writer.close()
        assert got == b"", got  # no request: nothing to answer
        assert TIMEOUT_S * 0.9 <= after_s < LATE_S, f"closed after {after_s:.2f} s"
        assert closed_total(server, "head_timeout") == before + 1
        # A head begun late on a new connection has what is left of that time.
        reader, writer = await connect(server.http_url)
        await asyncio.sleep(TIMEOUT_S / 2)
        started = time.monotonic()
        writer.write(b"GET /hea")
        got, after_s = await closed_with(reader, started)
        writer.close()
        assert status(got) == 408 and after_s < TIMEOUT_S * 0.75, f"{after_s:.2f} s {got!r}"


@asynccontextmanager
async def serving(
    start_sidecar: SidecarFactory, role: str, limits: dict[str, Any]
) -> AsyncIterator[Gateway | Sidecar | FollowerAgent]:
    """A server of ``role`` under the server settings ``limits``."""
    base = {"host": HOST, "http_port": 0, "grpc_port": 0, **limits}
    if role == "follower":
        async with FollowerAgent(load({"server": base})) as follower:
            yield follower
        return
    sidecar = await start_sidecar(server=limits)
    if role == "sidecar":
        yield sidecar
        return
    unit = f"a={sidecar.http_url},{sidecar.grpc_target}"
    async with Gateway(load({"server": base, "gateway": {"units": [unit]}})) as gateway:
        await wait_until(lambda: len(gateway.router.serving()) == 1, what="unit SERVING")
        yield gateway


@pytest.mark.parametrize("role", ROLES)
async def test_the_idle_time_counts_from_the_last_response(
    servers: dict[str, Any], role: str
) -> None:
    server = servers[role]
    before = closed_total(server, "idle")
    reader, writer = await connect(server.http_url)
    for _ in range(4):  # in use past one keep-alive limit, never idle that long
        writer.write(post("/v1/completions", len(BODY), f"Authorization: Bearer {KEY}") + BODY)
        async with asyncio.timeout(LATE_S):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        answered = time.monotonic()
        await asyncio.sleep(TIMEOUT_S / 3)
    got, after_s = await closed_with(reader, answered)
    writer.close()
    assert got == b""
    assert TIMEOUT_S * 0.9 <= after_s < LATE_S, f"closed {after_s:.2f} s after the last answer"
    assert closed_total(server, "idle") == before + 1


@pytest.mark.parametrize("role", ROLES)
async def test_connections_over_the_cap_are_refused_clearly(
    start_sidecar: SidecarFactory, role: str
) -> None:
    sidecar = await start_sidecar(server={"max_connections": 2})
    if role == "sidecar":
        await check_cap(sidecar)
        return
    unit = f"a={sidecar.http_url},{sidecar.grpc_target}"
    settings = load(
        {
            "server": {"host": HOST, "http_port": 0, "grpc_port": 0, "max_connections": 2},
            "gateway": {"units": [unit]},
        }
    )
    async with Gateway(settings) as gateway:
        await check_cap(gateway)


async def check_cap(server: Gateway | Sidecar) -> None:
    held = [await connect(server.http_url) for _ in range(2)]
    await wait_until(lambda: gauge(server) == 2, what="2 connections counted")
    reader, writer = await connect(server.http_url)
    got, _ = await closed_with(reader, time.monotonic())
    writer.close()
    assert status(got) == 503
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "max_connections"
    assert closed_total(server, "max_connections") == 1
    held.pop()[1].close()
    await wait_until(lambda: gauge(server) == 1, what="1 connection counted")
    reader, writer = await connect(server.http_url)
    writer.write(f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    async with asyncio.timeout(LATE_S):
        assert status(await reader.readuntil(b"\r\n\r\n")) == 200
    writer.close()
    for _, w in held:
        w.close()


def test_the_cap_per_client_address_is_on_for_gateways_only_by_default() -> None:
    # A sidecar's clients are gateways, each with up to gateway.connections_per_unit
    # connections to it, from one address.
    server = load({}).server
    assert server.connections_per_client("gateway") == 1024
    assert server.connections_per_client("sidecar") == 0
    assert server.connections_per_client("follower") == 0
    given = load({"server": {"max_connections_per_client": 7}}).server
    assert given.connections_per_client("sidecar") == 7


@pytest.mark.parametrize("role", ROLES)
async def test_one_client_address_is_capped_and_others_are_served(
    start_sidecar: SidecarFactory, role: str
) -> None:
    # server.max_connections_per_client: one address that holds its share of the
    # connections is refused 429; another address (127.0.0.2 on loopback) is served.
    async with serving(start_sidecar, role, {"max_connections_per_client": 2}) as server:
        held = [await connect(server.http_url) for _ in range(2)]
        await wait_until(lambda: gauge(server) == 2, what="2 connections counted")
        reader, writer = await connect(server.http_url)
        got, _ = await closed_with(reader, time.monotonic())
        writer.close()
        assert status(got) == 429, got
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == (
            "max_client_connections"
        )
        assert closed_total(server, "max_client_connections") == 1
        port = int(server.http_url.rsplit(":", 1)[1])
        for _ in range(2):  # beyond one address's cap, from another
            reader, writer = await asyncio.open_connection(HOST, port, local_addr=("127.0.0.2", 0))
            writer.write(f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
            async with asyncio.timeout(LATE_S):
                assert status(await reader.readuntil(b"\r\n\r\n")) == 200
            held.append((reader, writer))
        held.pop(0)[1].close()  # one of the first address's closes: it may open one more
        await wait_until(lambda: gauge(server) == 3, what="3 connections counted")
        reader, writer = await connect(server.http_url)
        writer.write(f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        async with asyncio.timeout(LATE_S):
            assert status(await reader.readuntil(b"\r\n\r\n")) == 200
        writer.close()
        for _, w in held:
            w.close()
        await wait_until(lambda: gauge(server) == 0, what="all closed")


@contextmanager
def open_file_limit(extra: int) -> Iterator[int]:
    """This process's soft RLIMIT_NOFILE set to the files open now plus ``extra``, for
    the block; yields the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + extra
    assert limit < soft, "the test needs a lower limit than the one it runs under"
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def gateway_in_front(sidecar: Sidecar, **server: Any) -> Gateway:
    unit = f"a={sidecar.http_url},{sidecar.grpc_target}"
    base = {"host": HOST, "http_port": 0, "grpc_port": 0, **server}
    gateway = Gateway(load({"server": base, "gateway": {"units": [unit]}}))
    await gateway.__aenter__()
    return gateway


async def test_max_connections_past_the_open_file_limit_are_answered_503(
    start_sidecar: SidecarFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # 4096 connections do not fit in a few hundred files: the gateway says so at start,
    # serves what fits, and answers the rest 503 (no reset when accept finds no file).
    sidecar = await start_sidecar()
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    with open_file_limit(300):
        gateway = await gateway_in_front(sidecar, max_connections=4096)
        try:
            warned = [r for r in caplog.records if "RLIMIT_NOFILE" in r.getMessage()]
            assert len(warned) == 1 and warned[0].levelname == "WARNING", caplog.text
            fit = int(warned[0].getMessage().split("at most ")[1].split()[0])
            assert 0 < fit < 150, warned[0].getMessage()
            held = [await connect(gateway.http_url) for _ in range(fit)]
            await wait_until(lambda: gauge(gateway) == fit, what=f"{fit} connections counted")
            reader, writer = await connect(gateway.http_url)
            got, _ = await closed_with(reader, time.monotonic())
            writer.close()
            assert status(got) == 503, got
            assert closed_total(gateway, "max_connections") == 1
        finally:
            for _, w in held:
                w.close()
            await gateway.__aexit__(None, None, None)


async def test_a_connection_near_the_open_file_limit_is_answered_503(
    start_sidecar: SidecarFactory,
) -> None:
    # Files taken by something else (here: this test) leave the gateway almost none: a
    # new client gets 503 fd_limit while a descriptor is left, not a reset.
    sidecar = await start_sidecar()
    fillers: list[int] = []
    with open_file_limit(300) as limit:
        gateway = await gateway_in_front(sidecar, max_connections=8)
        try:
            while True:
                fd = os.open(os.devnull, os.O_RDONLY)
                fillers.append(fd)
                if fd >= limit - 30:  # the client's socket and the server's come next
                    break
            reader, writer = await connect(gateway.http_url)
            got, _ = await closed_with(reader, time.monotonic())
            writer.close()
            assert status(got) == 503, got
            assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "fd_limit"
            assert closed_total(gateway, "fd_limit") == 1
            for fd in fillers:
                os.close(fd)
            fillers = []
            reader, writer = await connect(gateway.http_url)  # served again
            writer.write(f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
            async with asyncio.timeout(LATE_S):
                assert status(await reader.readuntil(b"\r\n\r\n")) == 200
            writer.close()
        finally:
            for fd in fillers:
                os.close(fd)
            await gateway.__aexit__(None, None, None)


@pytest.mark.slow
def test_the_soft_open_file_limit_is_raised_to_the_hard_one_at_start() -> None:
    # In a child process: the limit is the process's own.
    code = (
        "import resource\n"
        "from proxy.ingress import raise_fd_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "raise_fd_limit()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard, hard)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert out.stdout.split()[0] == "True", out


def gauge(server: Gateway | Sidecar | FollowerAgent) -> float:
    return server.registry.get_sample_value("unitproxy_client_connections") or 0.0


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("expect", [False, True])
async def test_the_api_key_is_checked_from_the_head(
    servers: dict[str, Any], role: str, expect: bool
) -> None:
    # A head that announces 3 MiB and sends none of it: 401 at once, not after a body.
    server = servers[role]
    reader, writer = await connect(server.http_url)
    extra = ("Expect: 100-continue",) if expect else ()
    writer.write(post("/v1/completions", 3 << 20, *extra))
    async with asyncio.timeout(TIMEOUT_S * 0.75):
        head = await reader.readuntil(b"\r\n\r\n")
    assert status(head) == 401, head
    # Then the connection closes within the body timer, with nothing more said.
    rest, _ = await closed_with(reader, time.monotonic())
    writer.close()
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    assert len(rest) == length, rest


async def unread_stream(url: str, data: bytes) -> socket.socket:
    """Send ``data`` on a socket with a tiny receive buffer, then never read it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    await loop.sock_connect(sock, (host, int(port)))
    await loop.sock_sendall(sock, data)
    return sock


@pytest.mark.parametrize(
    ("role", "path"), [("gateway", "lean"), ("gateway", "aiohttp"), ("sidecar", "aiohttp")]
)
async def test_a_stream_left_unread_ends_and_frees_its_slot(
    servers: dict[str, Any], role: str, path: str
) -> None:
    server, sidecar = servers[role], servers["sidecar"]
    body = json.dumps({"prompt": "x", "max_tokens": 1_000_000, "stream": True}).encode()
    # Chunked framing sends the gateway's request down its aiohttp path.
    framing = (
        post("/v1/completions", len(body), f"Authorization: Bearer {KEY}") + body
        if path == "lean"
        else post("/v1/completions", 0, f"Authorization: Bearer {KEY}").replace(
            b"Content-Length: 0", b"Transfer-Encoding: chunked"
        )
        + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    )
    before = closed_total(server, "write_timeout")
    sock = await unread_stream(server.http_url, framing)
    try:
        await wait_until(lambda: sidecar.core.outstanding == 1, 5.0, "the stream admitted")
        # The client holds its socket and reads nothing: the slot comes back anyway.
        await wait_until(lambda: sidecar.core.outstanding == 0, 15.0, "the unit's slot freed")
        assert closed_total(server, "write_timeout") == before + 1
    finally:
        sock.close()
    if role == "gateway":
        await wait_until(lambda: server.gate.in_flight == 0, 3.0, "gateway in flight 0")


async def test_the_followers_http_port_closes_slow_heads_too() -> None:
    settings = load({"server": {"host": HOST, "http_port": 0, "grpc_port": 0, **LIMITS}})
    async with FollowerAgent(settings) as follower:
        reader, writer = await connect(follower.http_url)
        writer.write(b"GET /hea")
        got, after_s = await closed_with(reader, time.monotonic())
        writer.close()
        assert status(got) == 408 and after_s < LATE_S
        assert closed_total(follower, "head_timeout") == 1


BUDGET = {"max_body_bytes": 1000, "max_body_buffer_bytes": 1000, "body_timeout_s": 10.0}
PADDED = BODY + b" " * (600 - len(BODY))  # a valid body of 600 bytes


async def budget_server(start_sidecar: SidecarFactory, role: str) -> Gateway | Sidecar:
    sidecar = await start_sidecar(server=BUDGET)
    if role == "sidecar":
        return sidecar
    unit = f"a={sidecar.http_url},{sidecar.grpc_target}"
    settings = load(
        {
            "server": {"host": HOST, "http_port": 0, "grpc_port": 0, **BUDGET},
            "gateway": {"units": [unit]},
        }
    )
    gateway = Gateway(settings)
    await gateway.__aenter__()
    await wait_until(lambda: len(gateway.router.serving()) == 1, what="unit SERVING")
    return gateway


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    async with asyncio.timeout(LATE_S):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return status(head), await reader.readexactly(length)


def opening(framing: str, length: int) -> bytes:
    """A request head announcing a body of ``length`` bytes (chunked: of no length)."""
    if framing == "length":
        return post("/v1/completions", length)
    return post("/v1/completions", 0).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")


def part(framing: str, data: bytes, last: bool = False) -> bytes:
    if framing == "length":
        return data
    return b"%x\r\n%b\r\n" % (len(data), data) + (b"0\r\n\r\n" if last else b"")


async def start_body(
    server: Gateway | Sidecar, framing: str, length: int, data: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client that sends a head, then (once the server reads its body) ``data``."""
    reader, writer = await connect(server.http_url)
    writer.write(opening(framing, length))
    await asyncio.sleep(0.1)  # the head read on its own: the body bytes come after it
    writer.write(part(framing, data))
    return reader, writer


@pytest.mark.parametrize(
    ("role", "framing"),
    [("gateway", "length"), ("gateway", "chunked"), ("sidecar", "length")],
)
async def test_bodies_under_way_are_held_by_the_bytes_that_came(
    start_sidecar: SidecarFactory, role: str, framing: str
) -> None:
    # Bodies are held in max_body_buffer_bytes (1000 here) by the bytes that arrived,
    # never by what they announce: clients that announce large bodies and send a few
    # bytes hold a few bytes, and other requests go through.
    server = await budget_server(start_sidecar, role)
    body = PADDED + b" " * (900 - len(PADDED))
    try:
        slow = [await start_body(server, framing, 900, body[:10]) for _ in range(3)]
        await wait_until(lambda: server_limits_held(server) >= 30, what="the bytes held")
        assert server_limits_held(server) < 100
        reader, writer = await connect(server.http_url)
        writer.write(post("/v1/completions", len(PADDED)) + PADDED)
        code, error = await answer(reader)
        assert code == 200, error
        writer.close()
        for _, w in slow:
            w.close()
        await wait_until(lambda: server_limits_held(server) == 0, what="their bytes freed")

        # The budget holds against bytes that did come: one body of 800 bytes under way,
        # another's 300 more would pass it: that one gets 503 and its connection closes.
        before = closed_total(server, "body_buffer")
        big_reader, big = await start_body(server, framing, 900, body[:800])
        await wait_until(lambda: server_limits_held(server) >= 800, what="800 bytes held")
        reader, writer = await start_body(server, framing, 900, body[:300])
        code, error = await answer(reader)
        assert code == 503, error
        assert json.loads(error)["error"]["code"] == "body_buffer_full"
        writer.write(part(framing, body[300:], last=True))  # dropped, then closed
        assert (await closed_with(reader, time.monotonic()))[0] == b""
        writer.close()
        assert closed_total(server, "body_buffer") == before + 1
        big.write(part(framing, body[800:], last=True))
        code, error = await answer(big_reader)
        assert code == 200, error
        big.close()
        await wait_until(lambda: server_limits_held(server) == 0, what="the budget freed")
    finally:
        if isinstance(server, Gateway):
            await server.__aexit__(None, None, None)


def server_limits_held(server: Gateway | Sidecar) -> float:
    return server.registry.get_sample_value("unitproxy_body_buffer_bytes") or 0.0

"""/admin routes: the admin token, loopback only without one, nothing a browser can send.

Non-loopback clients are this machine's own non-loopback address (the servers bind
0.0.0.0 here), so the test stays on this host.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import aiohttp
import pytest

from proxy.gateway.server import Gateway
from proxy.httputil import is_loopback
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests.conftest import sidecar_settings

pytestmark = pytest.mark.timeout(30)

TOKEN = "admin-9d2e41"
Server = Gateway | Sidecar
Start = Callable[[dict[str, Any]], AbstractAsyncContextManager[Server]]


def local_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # sends nothing: picks the source address
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if is_loopback(address) else address


LOCAL = local_address()


@pytest.fixture(params=["sidecar", "gateway"])
def start(request: pytest.FixtureRequest) -> Start:
    """Start a sidecar, or a gateway (with a sidecar behind it), bound to 0.0.0.0."""

    @asynccontextmanager
    async def run(server: dict[str, Any]) -> AsyncIterator[Server]:
        server = {"host": "0.0.0.0", **server}
        async with Sidecar(sidecar_settings(server=server)) as sidecar:
            if request.param == "sidecar":
                yield sidecar
                return
            settings = load(
                {
                    "server": {"http_port": 0, "grpc_port": 0, **server},
                    "gateway": {"units": [f"a={sidecar.http_url},{sidecar.grpc_target}"]},
                }
            )
            async with Gateway(settings) as gateway:
                yield gateway

    return run


def drain_url(server: Server, host: str = "127.0.0.1") -> str:
    port = server.http_url.rsplit(":", 1)[1]
    return f"http://{host}:{port}/admin/drain"


async def post(url: str, **kwargs: Any) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.post(url, **kwargs) as resp:
        body = await resp.json() if resp.status != 202 else {}
        return resp.status, body.get("error", {}).get("code", "")


async def test_without_a_token_only_loopback_clients(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    if LOCAL is None:
        pytest.skip("this machine has no non-loopback address")
    caplog.set_level(logging.INFO)
    async with start({}) as server:
        assert "admin routes: loopback clients only" in caplog.text
        assert await post(drain_url(server, LOCAL)) == (403, "not_loopback")
        assert not server.drain.started
        assert (await post(drain_url(server)))[0] == 202
        assert server.drain.started


async def test_with_a_token_any_client_that_has_it(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with start({"admin_token": TOKEN}) as server:
        assert "admin routes: need server.admin_token" in caplog.text
        url = drain_url(server, LOCAL or "127.0.0.1")
        assert await post(url) == (401, "missing_token")
        assert await post(url, headers={"Authorization": "Bearer nope"}) == (403, "invalid_token")
        assert not server.drain.started
        assert (await post(url, headers={"Authorization": f"Bearer {TOKEN}"}))[0] == 202
        assert server.drain.started
    assert TOKEN not in caplog.text


BROWSER = {
    "a form": {"data": {"x": "1"}},
    "a text/plain form": {"data": b"x=1", "headers": {"Content-Type": "text/plain"}},
    "a multipart form": {"data": aiohttp.FormData({"x": "1"}, default_to_multipart=True)},
    "a fetch() with its Origin": {"headers": {"Origin": "https://evil.example"}},
}


@pytest.mark.parametrize("token", [None, TOKEN])
async def test_nothing_a_web_page_can_send(start: Start, token: str | None) -> None:
    # A page cannot add Authorization to a cross-site request (that needs a preflight,
    # which is not answered): with a token, a form gets 401; without, 403.
    server_settings = {} if token is None else {"admin_token": token}
    async with start(server_settings) as server:
        for what, kwargs in BROWSER.items():
            got = await post(drain_url(server), **kwargs)
            browser = token is None or "Origin" in kwargs.get("headers", {})
            assert got == ((403, "browser_request") if browser else (401, "missing_token")), what
        auth = {} if token is None else {"Authorization": f"Bearer {token}"}
        origin = {**auth, "Origin": "http://127.0.0.1"}
        assert await post(drain_url(server), headers=origin) == (403, "browser_request")
        async with (
            aiohttp.ClientSession() as session,
            session.get(drain_url(server), headers=auth) as resp,
        ):
            assert resp.status in (400, 405)  # refused, and no drain
        assert not server.drain.started
        if token is not None:  # what urllib and curl -d '' send, with the token: fine
            form = {"data": b"", "headers": {**auth}}
            assert (await post(drain_url(server), **form))[0] == 202


@pytest.mark.parametrize(
    ("remote", "loopback"),
    [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("::ffff:127.0.0.1", True),
     ("fe80::1%eth0", False), ("192.0.2.7", False), ("::ffff:192.0.2.7", False), (None, False),
     ("", False)],
)  # fmt: skip
def test_loopback_addresses(remote: str | None, loopback: bool) -> None:
    assert is_loopback(remote) is loopback

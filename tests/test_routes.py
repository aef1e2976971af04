"""Every route the engine serves, through the sidecar and the gateway, as vLLM answers it.

Real sidecars (engine sim) and gateways on loopback; the clients are real ones: aiohttp
decoding by the declared charset as ``requests`` does, and the openai SDK.
"""

from __future__ import annotations

import aiohttp
import pytest

from tests.conftest import GatewayFactory, SidecarFactory

pytestmark = pytest.mark.timeout(30)

NON_ASCII = "café naïve"


def latin1_by_default(response: aiohttp.ClientResponse, body: bytes) -> str:
    """What ``requests`` assumes of a text/* body that declares no charset (RFC 2616)."""
    return "iso-8859-1"


async def test_streams_declare_utf8_so_clients_decode_them_intact(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    # The model name is in every chunk: a stream that carries non-ASCII text.
    sidecar = await start_sidecar(engine={"served_model_name": NON_ASCII})
    gw = await start_gateway([sidecar])
    body = {"model": NON_ASCII, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": True}  # fmt: skip
    async with aiohttp.ClientSession(fallback_charset_resolver=latin1_by_default) as http:
        for url in (sidecar.http_url, gw.http_url):
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
                text = await resp.text()
            assert f'"model":"{NON_ASCII}"' in text, (url, text[:200])
            assert text.endswith("data: [DONE]\n\n")

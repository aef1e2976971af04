"""A gRPC client that opens a Generate stream and never reads it.

Its unit slot must come back within ``server.write_timeout_s`` of the client's window
filling, through the gateway (either unit wire) and on the sidecar's own gRPC port, and
what the servers hold for it must stop growing: the unit's stream is cancelled, and the
client gets what was sent, then DEADLINE_EXCEEDED (code write_timeout), if it reads.

The client is a plain grpc.aio channel with BDP probing off, so that its transport
takes 64 KB per stream before HTTP/2 flow control holds the writer. A default channel
takes up to its BDP-sized window first (about 4 MB on loopback): the same path, later.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from proxy.errors import GRPC_CODE_KEY
from proxy.gateway.server import Gateway
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.settings import load
from tests.conftest import SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(40)

HOST = "127.0.0.1"
WRITE_TIMEOUT_S = 0.4
MAX_TOKENS = 10_000_000
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0)]


@pytest.fixture
async def servers(start_sidecar: SidecarFactory) -> AsyncIterator[dict[str, Any]]:
    # A fast engine: an unread stream fills the client's window in well under a second.
    sidecar = await start_sidecar(
        server={"write_timeout_s": WRITE_TIMEOUT_S}, sim={"decode_step_ms": 0.02}
    )
    unit = f"a={sidecar.http_url},{sidecar.grpc_target}"
    gateways = {}
    for wire in ("http", "grpc"):
        settings = load({
            "server": {"host": HOST, "http_port": 0, "grpc_port": 0,
                       "write_timeout_s": WRITE_TIMEOUT_S},
            "gateway": {"units": [unit], "grpc_unit_wire": wire},
        })  # fmt: skip
        gateways[wire] = gw = Gateway(settings)
        await gw.__aenter__()
    try:
        for gw in gateways.values():
            await wait_until(lambda gw=gw: len(gw.router.serving()) == 1, what="unit SERVING")
        yield {"sidecar": sidecar, **gateways}
    finally:
        for gw in gateways.values():
            await gw.__aexit__(None, None, None)


def generated(servers: dict[str, Any]) -> float:
    value = servers["sidecar"].registry.get_sample_value("unitproxy_generated_tokens_total")
    return float(value or 0.0)


@pytest.mark.parametrize("via", ["http", "grpc", "sidecar"])
async def test_a_grpc_stream_left_unread_is_cancelled_and_frees_its_slot(
    servers: dict[str, Any], via: str
) -> None:
    sidecar = servers["sidecar"]
    server = servers[via]
    request = inference_pb2.GenerateRequest(
        prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=MAX_TOKENS)
    )
    async with grpc.aio.insecure_channel(server.grpc_target, options=SMALL_WINDOW) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(request)
        await wait_until(lambda: sidecar.core.outstanding == 1, 5.0, "the stream admitted")
        # The client holds its call open and reads nothing: the slot comes back anyway.
        await wait_until(lambda: sidecar.core.outstanding == 0, 15.0, "the unit's slot freed")
        if via != "sidecar":
            await wait_until(lambda: server.gate.in_flight == 0, 3.0, "gateway in flight 0")
        # The unit stopped generating once the writes waited: what it made, and what
        # the gateway kept for the stream, is a small part of what was asked for.
        made = generated(servers)
        assert made < MAX_TOKENS / 10
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for chunk in call:
                received += len(chunk.token_ids)
        # It reads at last: what was sent, then the reason it was given up on.
        assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert dict(ended.value.trailing_metadata() or ())[GRPC_CODE_KEY] == "write_timeout"
        assert received <= made
        assert generated(servers) == made  # nothing more once the call was cancelled

"""A request's context at the gateway (proxy/gateway/request.py), from both wires.

The unit gets the client's end-to-end headers as they came, on the lean path and on
aiohttp's, and a gRPC call's metadata by the same rule on both unit wires (less what
gRPC reserves), and none of the hop-by-hop ones nor a client's own ``x-unitproxy-*``; the
gateway's own answers from the head alone (401, 413, 408) and its gRPC errors name
the request (``x-request-id``) and the unit (``x-unitproxy-unit``, ``none`` where
none was tried), as its 504 does.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web

from proxy import grpcweb
from proxy.gateway.server import Gateway
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.settings import load
from tests.conftest import SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(30)

HOST = "127.0.0.1"
CALL_S = 5.0
KEY = "sk-context"
NEW_ID = re.compile(r"[0-9a-f]{32}")


class RecordingUnit:
    """A unit at the edge that keeps each request's headers (aiohttp's names, as sent)
    and answers a completion; ``GET /load`` for ``load_source poll``."""

    def __init__(self) -> None:
        self.heads: list[dict[str, str]] = []
        self.raw_heads: list[list[tuple[str, str]]] = []  # each field as sent, repeats too
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> RecordingUnit:
        app = web.Application()
        app.router.add_get("/load", self._load)
        app.router.add_post("/v1/completions", self._completion)
        self.routes(app)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, 0)
        await site.start()
        self.url = f"http://{HOST}:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    def routes(self, app: web.Application) -> None:
        """More routes, a subclass's."""

    async def _load(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"unit_id": "rec", "state": "SERVING", "outstanding": 0, "capacity": 8}
        )

    async def _completion(self, request: web.Request) -> web.Response:
        await request.read()
        self.heads.append({k.lower(): v for k, v in request.headers.items()})
        self.raw_heads.append([(k.decode().lower(), v.decode()) for k, v in request.raw_headers])
        return web.json_response({"id": "c", "object": "text_completion",
                                  "choices": [{"index": 0, "text": "ok",
                                               "finish_reason": "stop"}]})  # fmt: skip


class RecordingGrpcUnit(RecordingUnit):
    """A unit that keeps each Generate call's metadata (``calls``) and answers one
    chunk, on both of a gateway's unit wires: gRPC (its ``grpc_target``) and gRPC-Web
    on its HTTP port."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, str | bytes]] = []
        self.grpc_target = ""
        self._server: grpc.aio.Server | None = None

    async def __aenter__(self) -> RecordingGrpcUnit:
        await super().__aenter__()
        method = grpc.unary_stream_rpc_method_handler(self._generate)
        handler = grpc.method_handlers_generic_handler("unitproxy.v1.Inference",
                                                       {"Generate": method})  # fmt: skip
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((handler,))
        port = self._server.add_insecure_port(f"{HOST}:0")
        await self._server.start()
        self.grpc_target = f"{HOST}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        await self._server.stop(None)
        await super().__aexit__(*exc)

    def routes(self, app: web.Application) -> None:
        app.router.add_post(grpcweb.PATH, self._generate_web)

    async def _generate(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        self.calls.append(dict(context.invocation_metadata() or ()))
        yield CHUNK

    async def _generate_web(self, request: web.Request) -> web.Response:
        await request.read()
        self.calls.append({k.lower(): v for k, v in request.headers.items()})
        body = grpcweb.frame(CHUNK) + grpcweb.OK_TRAILERS
        return web.Response(body=body, headers={"Content-Type": grpcweb.CONTENT_TYPE})


CHUNK = inference_pb2.GenerateChunk(text="ok", finish_reason="stop").SerializeToString()
Start = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def start_gw() -> AsyncIterator[Start]:
    running: list[Gateway] = []

    async def start(
        units: list[str],
        server: dict[str, Any] | None = None,
        tracing: dict[str, Any] | None = None,
        **gw: Any,
    ) -> Gateway:
        settings = load({"server": {"host": HOST, "http_port": 0, "grpc_port": 0, **(server or {})},
                         "gateway": {"units": units, **gw}, "tracing": tracing or {}})  # fmt: skip
        gateway = Gateway(settings)
        await gateway.__aenter__()
        running.append(gateway)
        await wait_until(lambda: len(gateway.router.serving()) == len(units), what="units up")
        return gateway

    yield start
    for gateway in reversed(running):
        await gateway.__aexit__(None, None, None)


async def exchange(url: str, data: bytes, then: bytes = b"", pause_s: float = 0.0) -> bytes:
    """Write ``data`` (and ``then`` after ``pause_s``); everything the server sends until
    it closes, or until its first whole answer when it keeps the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        if pause_s:
            await asyncio.sleep(pause_s)
        if then:
            writer.write(then)
        async with asyncio.timeout(CALL_S):
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            body = await reader.readexactly(int(length.group(1))) if length else await reader.read()
        return head + body
    finally:
        writer.close()


def head_of(answer: bytes) -> tuple[int, dict[str, str]]:
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(head[0].split(" ")[1]), headers


def post(body: bytes, *headers: str, length: int | None = None, chunked: bool = False) -> bytes:
    framing = ["Transfer-Encoding: chunked"] if chunked else [
        f"Content-Length: {len(body) if length is None else length}"]  # fmt: skip
    lines = ["POST /v1/completions HTTP/1.1", f"Host: {HOST}", "Content-Type: application/json",
             *framing, *headers]  # fmt: skip
    if chunked:
        body = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


BODY = json.dumps({"prompt": "x", "max_tokens": 2}).encode()


@pytest.mark.parametrize("path", ["lean", "aiohttp"])
async def test_the_unit_gets_the_clients_end_to_end_headers(start_gw: Start, path: str) -> None:
    async with RecordingUnit() as unit:
        gw = await start_gw([f"rec={unit.url},{HOST}:9"], load_source="poll", poll_interval_s=0.05)
        sent = post(
            BODY,
            "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "X-Custom-Thing: kept",
            "Connection: keep-alive, x-hop",
            "X-Hop: per connection",
            "Keep-Alive: timeout=5",
            "x-unitproxy-priority: batch",  # the gateway's own header: never the client's
            "x-unitproxy-resume: forged",
            "x-request-id: ctx-1",
            chunked=path == "aiohttp",  # a chunked body goes to aiohttp
        )
        status, headers = head_of(await exchange(gw.http_url, sent))
        assert status == 200, headers
        assert ("server" in headers) == (path == "aiohttp"), "the path meant served it"
        got = unit.heads[-1]
        assert got["traceparent"] == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        assert got["x-custom-thing"] == "kept"
        assert got["x-request-id"] == "ctx-1"
        assert got["content-type"] == "application/json"
        for hop in ("x-hop", "keep-alive", "x-unitproxy-priority", "x-unitproxy-resume"):
            assert hop not in got, f"{hop} reached the unit: {got}"
        assert got.get("connection", "keep-alive").lower() == "keep-alive", got


@pytest.mark.parametrize("path", ["lean", "aiohttp"])
async def test_a_tenants_class_and_usage_ask_reach_the_unit_once_each(
    start_gw: Start, path: str, tmp_path: Path
) -> None:
    # The gateway writes its own lines of the head apart from the client's fields: the
    # class the request settled on (the client's lowering, not its header itself) and
    # the ask for the unit's usage, each exactly once.
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "t"\nkeys = ["sk-t"]\nrequests_per_minute = 100\n')
    async with RecordingUnit() as unit:
        gw = await start_gw([f"rec={unit.url},{HOST}:9"], load_source="poll",
                            poll_interval_s=0.05, tenants_file=str(tenants))  # fmt: skip
        for lowered in ("batch", None):
            extra = [f"x-unitproxy-priority: {lowered}"] if lowered else []
            sent = post(BODY, "Authorization: Bearer sk-t", "x-unitproxy-usage: 0", *extra,
                        chunked=path == "aiohttp")  # fmt: skip
            status, headers = head_of(await exchange(gw.http_url, sent))
            assert status == 200, headers
            got = unit.raw_heads[-1]
            own = [(n, v) for n, v in got if n in ("x-unitproxy-priority", "x-unitproxy-usage")]
            assert sorted(own) == [("x-unitproxy-priority", lowered or "standard"),
                                   ("x-unitproxy-usage", "1")], got  # fmt: skip
            assert ("authorization", "Bearer sk-t") in got, got


TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.mark.parametrize("wire", ["http", "grpc"])
async def test_the_unit_gets_a_grpc_calls_metadata_on_both_wires(
    start_gw: Start, wire: str
) -> None:
    async with RecordingGrpcUnit() as unit:
        gw = await start_gw([f"rec={unit.url},{unit.grpc_target}"], load_source="poll",
                            poll_interval_s=0.05, grpc_unit_wire=wire)  # fmt: skip
        metadata = (
            ("x-custom-thing", "kept"),
            ("x-request-id", "g-ctx"),
            ("authorization", "Bearer client"),
            ("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01"),
            # unitproxy's own: the gateway's to set, never the client's
            ("x-unitproxy-priority", "interactive"),
            ("x-unitproxy-priority-sig", "forged"),
            ("x-unitproxy-resume", "forged"),
            # what gRPC reserves or its transport sets: it must not break the call
            ("grpc-custom", "reserved"),
            ("host", "elsewhere.example"),
            ("user-agent", "client-agent"),
            ("x-blob-bin", b"\x00\xff"),
        )
        request = inference_pb2.GenerateRequest(prompt="x")
        async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            chunks = [c async for c in stub.Generate(request, metadata=metadata, timeout=CALL_S)]
        assert [c.text for c in chunks] == ["ok"], chunks
        assert len(unit.calls) == 1, unit.calls
        got = unit.calls[0]
        if wire == "http":
            assert got["content-type"] == grpcweb.CONTENT_TYPE, got
            assert got["host"] != "elsewhere.example", got
        else:
            assert "host" not in got, got
        assert got["x-custom-thing"] == "kept", got
        assert got["x-request-id"] == "g-ctx", got
        assert got["authorization"] == "Bearer client", got
        assert got["traceparent"] == f"00-{TRACE_ID}-{CLIENT_SPAN}-01", got
        for name in ("x-unitproxy-priority", "x-unitproxy-priority-sig", "x-unitproxy-resume",
                     "grpc-custom", "x-blob-bin"):  # fmt: skip
            assert name not in got, f"{name} reached the unit: {got}"
        assert "client-agent" not in str(got.get("user-agent", "")), got


@pytest.mark.parametrize("path", ["lean", "aiohttp"])
async def test_a_tracing_gateway_sends_its_trace_context_in_place_of_the_clients(
    start_gw: Start, path: str
) -> None:
    # Sampling 0: no span is recorded (nothing is exported), but the gateway still
    # names its own trace to the unit.
    tracing = {"otlp_endpoint": f"http://{HOST}:9", "sample_ratio": 0.0}
    async with RecordingUnit() as unit:
        gw = await start_gw([f"rec={unit.url},{HOST}:9"], tracing=tracing, load_source="poll",
                            poll_interval_s=0.05)  # fmt: skip
        chunked = path == "aiohttp"  # a chunked body goes to aiohttp

        async def sent(*trace: str) -> dict[str, str]:
            answer = await exchange(gw.http_url, post(BODY, *trace, chunked=chunked))
            status, headers = head_of(answer)
            assert status == 200, headers
            assert ("server" in headers) == chunked, "the path meant served it"
            return unit.heads[-1]

        # A client's context whose traceparent is malformed: a new trace, and the
        # client's tracestate (which belonged to it) goes nowhere.
        got = await sent(f"traceparent: 00-{TRACE_ID.upper()}-{CLIENT_SPAN}-00",
                         "tracestate: vendor=x")  # fmt: skip
        version, trace_id, span_id, flags = got["traceparent"].split("-")
        assert (version, flags) == ("00", "00") and trace_id != TRACE_ID, got
        assert "tracestate" not in got, got
        # A valid one (not sampled): the same trace, the gateway's span as the parent,
        # the tracestate with it.
        got = await sent(f"traceparent: 00-{TRACE_ID}-{CLIENT_SPAN}-00", "tracestate: vendor=x")
        version, trace_id, span_id, flags = got["traceparent"].split("-")
        assert (version, trace_id, flags) == ("00", TRACE_ID, "00"), got
        assert span_id != CLIENT_SPAN, got
        assert got["tracestate"] == "vendor=x", got


def no_unit(headers: dict[str, str], request_id: str | None) -> None:
    """The gateway's own answer to a request it tried no unit for."""
    assert headers["x-unitproxy-unit"] == "none", headers
    if request_id is None:
        assert NEW_ID.fullmatch(headers["x-request-id"]), headers
    else:
        assert headers["x-request-id"] == request_id, headers


async def test_refusals_from_the_head_name_the_request_and_no_unit(
    start_sidecar: SidecarFactory, start_gw: Start
) -> None:
    sidecar = await start_sidecar(sidecar={"unit_id": "a"})
    server = {"api_keys": [KEY], "max_body_bytes": 1000, "head_timeout_s": 0.3,
              "body_timeout_s": 0.3}  # fmt: skip
    gw = await start_gw([f"a={sidecar.http_url},{sidecar.grpc_target}"], server=server)
    url, auth = gw.http_url, f"Authorization: Bearer {KEY}"
    cases = [  # (what, bytes, then, pause, status, the client's request id)
        ("401 lean", post(BODY, "x-request-id: r-401"), b"", 0.0, 401, "r-401"),
        ("401 lean, no id", post(BODY), b"", 0.0, 401, None),
        ("401 aiohttp", post(BODY, "x-request-id: r-401a", chunked=True), b"", 0.0, 401, "r-401a"),
        ("401 expect", post(b"", "Expect: 100-continue", "x-request-id: r-e", length=len(BODY)),
         b"", 0.0, 401, "r-e"),
        ("413", post(b"x" * 1001, auth, "x-request-id: r-413"), b"", 0.0, 413, "r-413"),
        ("408 body", post(BODY[:5], auth, "x-request-id: r-408", length=len(BODY)), b"", 0.0,
         408, "r-408"),
        ("408 body aiohttp", post(BODY, auth, "x-request-id: r-408a", chunked=True)[:-12], b"",
         0.0, 408, "r-408a"),
        ("408 head", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"", 0.0, 408, None),
    ]  # fmt: skip
    for what, data, then, pause, expected, request_id in cases:
        status, headers = head_of(await exchange(url, data, then, pause))
        assert status == expected, f"{what}: {status} {headers}"
        no_unit(headers, request_id)


async def test_the_gateways_grpc_errors_name_the_request_and_the_unit(
    start_sidecar: SidecarFactory, start_gw: Start
) -> None:
    sidecar = await start_sidecar(sidecar={"unit_id": "a"})
    gw = await start_gw([f"a={sidecar.http_url},{sidecar.grpc_target}"], server={"api_keys": [KEY]})
    request = inference_pb2.GenerateRequest(
        prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=4)
    )
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # refused before any unit
            await stub.Generate(request, metadata=(("x-request-id", "g-1"),)).read()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        trailing = dict(refused.value.trailing_metadata() or ())
        assert (trailing["x-request-id"], trailing["x-unitproxy-unit"]) == ("g-1", "none")

        auth = ("authorization", f"Bearer {KEY}")
        wrong = inference_pb2.GenerateRequest(
            model="no-such-model", prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=4)
        )
        with pytest.raises(grpc.aio.AioRpcError) as failed:  # the unit's answer: it is named
            await stub.Generate(wrong, metadata=(auth,)).read()
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND, failed.value
        trailing = dict(failed.value.trailing_metadata() or ())
        assert trailing["x-unitproxy-unit"] == "a", trailing
        assert NEW_ID.fullmatch(trailing["x-request-id"]), trailing

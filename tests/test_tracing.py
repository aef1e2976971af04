"""Traces: W3C traceparent parsing, sampling, and spans from a gateway and a sidecar
exported over OTLP HTTP/protobuf to a real receiver on loopback, which decodes them
with opentelemetry-proto and checks the trace ids and parent links end to end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import CollectorRegistry

from engine.vllm import OTLP_PROTOCOL_ENV, otlp_protocol
from proxy.gateway.server import Gateway
from proxy.gateway.traces import finish_reasons
from proxy.metrics import TracingMetrics
from proxy.otlp import Exporter
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.settings import TracingSettings, load
from proxy.sidecar.server import Sidecar
from proxy.tracing import (
    CLIENT,
    SERVER,
    Tracer,
    engine_settings,
    format_traceparent,
    parse_traceparent,
)
from tests.conftest import RESUME_SECRET, SidecarFactory, wait_until

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
SAMPLED = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"
MODEL = "unitproxy-sim"


# --- the parser ---------------------------------------------------------------------


def test_a_valid_traceparent_names_its_trace_parent_and_flag() -> None:
    parent = parse_traceparent(SAMPLED)
    assert parent is not None
    assert (parent.trace_id, parent.span_id, parent.sampled) == (TRACE_ID, PARENT_ID, True)
    unsampled = parse_traceparent(SAMPLED[:-2] + "00")
    assert unsampled is not None and not unsampled.sampled
    # A later version may add fields after a dash; only the flag's low bit counts.
    later = parse_traceparent(f"cc-{TRACE_ID:032x}-{PARENT_ID:016x}-03-whatever")
    assert later is not None and later.sampled
    assert parse_traceparent(SAMPLED.encode()) is not None  # gRPC metadata may be bytes
    assert format_traceparent(TRACE_ID, PARENT_ID, True) == SAMPLED


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        SAMPLED.upper(),  # upper-case hex
        "ff" + SAMPLED[2:],  # version ff
        f"00-{0:032x}-{PARENT_ID:016x}-01",  # zero trace id
        f"00-{TRACE_ID:032x}-{0:016x}-01",  # zero parent id
        SAMPLED + "-extra",  # version 00 has exactly four fields
        SAMPLED[:-1],  # short
        SAMPLED.replace("-", "_"),
        f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-0g",
        f"0-{TRACE_ID:032x}-{PARENT_ID:016x}-01x",
        f"cc-{TRACE_ID:032x}-{PARENT_ID:016x}-01x",  # a later version, no dash after
    ],
)
def test_a_malformed_traceparent_is_none(value: str | None) -> None:
    assert parse_traceparent(value) is None


def test_sampling_is_parent_based() -> None:
    ended: list[Any] = []
    never = Tracer(0.0, ended.append, random.Random(1))
    honoured = never.begin(SAMPLED, "k=v", "r")
    assert honoured.sampled and honoured.trace_id == TRACE_ID and honoured.state == "k=v"
    assert honoured.root.parent_id == PARENT_ID
    assert not never.begin(None, None, "r").sampled
    always = Tracer(1.0, ended.append, random.Random(1))
    declined = always.begin(SAMPLED[:-2] + "00", None, "r")
    assert not declined.sampled
    # Not recorded, yet named downstream (flag 00) so the next process does the same.
    assert declined.traceparent(declined.start("x")) == (
        f"00-{TRACE_ID:032x}-{declined.root_id:016x}-00"
    )
    bad = always.begin("00-nonsense", "k=v", "r")
    assert bad.sampled and bad.trace_id != TRACE_ID and bad.root.parent_id == 0
    assert bad.state is None  # a tracestate goes with its traceparent
    half = Tracer(0.5, ended.append, random.Random(7))
    picked = sum(half.begin(None, None, "r").sampled for _ in range(2000))
    assert 850 < picked < 1150
    assert ended == []  # nothing ended yet: nothing went to the sink


def test_vllm_gets_the_sidecars_collector() -> None:
    settings = load({"engine": {"kind": "vllm", "model": "m"}})
    tracing = TracingSettings(otlp_endpoint="http://collector:4318/")
    engine = engine_settings(settings.engine, tracing)
    assert engine.engine_args["otlp_traces_endpoint"] == "http://collector:4318/v1/traces"
    own = load({"engine": {"kind": "vllm", "model": "m",
                           "engine_args": {"otlp_traces_endpoint": "grpc://x:4317"}}})  # fmt: skip
    assert engine_settings(own.engine, tracing).engine_args["otlp_traces_endpoint"] == (
        "grpc://x:4317"
    )
    assert engine_settings(settings.engine, TracingSettings()) is settings.engine


def test_vllm_sends_to_an_http_path_over_http(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OTLP_PROTOCOL_ENV, raising=False)
    otlp_protocol({"otlp_traces_endpoint": "grpc-collector:4317"})
    assert OTLP_PROTOCOL_ENV not in os.environ  # vLLM's default, gRPC, stays
    monkeypatch.setenv(OTLP_PROTOCOL_ENV, "grpc")
    otlp_protocol({"otlp_traces_endpoint": "http://c:4318/v1/traces"})
    assert os.environ[OTLP_PROTOCOL_ENV] == "grpc"  # the operator's choice stands
    monkeypatch.delenv(OTLP_PROTOCOL_ENV)
    otlp_protocol({"otlp_traces_endpoint": "http://c:4318/v1/traces"})
    assert os.environ[OTLP_PROTOCOL_ENV] == "http/protobuf"


# --- a receiver -----------------------------------------------------------------------


@dataclass
class Got:
    name: str
    service: str
    trace_id: int
    span_id: int
    parent_id: int
    kind: int
    attributes: dict[str, Any]
    error: bool


@dataclass
class Receiver:
    url: str = ""
    spans: list[Got] = field(default_factory=list)
    posts: int = 0
    status: int = 200  # what it answers

    def named(self, name: str) -> list[Got]:
        return [s for s in self.spans if s.name == name]

    def one(self, name: str, service: str | None = None) -> Got:
        found = [s for s in self.named(name) if service is None or s.service == service]
        assert len(found) == 1, (name, [(s.name, s.service) for s in self.spans])
        return found[0]


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which)


async def _receive(request: web.Request) -> web.Response:
    receiver = request.app[RECEIVER]
    assert request.content_type == "application/x-protobuf"
    receiver.posts += 1
    message = ExportTraceServiceRequest.FromString(await request.read())
    for rs in message.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                receiver.spans.append(
                    Got(
                        s.name, resource["service.name"], int.from_bytes(s.trace_id, "big"),
                        int.from_bytes(s.span_id, "big"), int.from_bytes(s.parent_span_id, "big"),
                        s.kind, {a.key: _value(a.value) for a in s.attributes},
                        s.status.code == s.status.STATUS_CODE_ERROR,
                    )
                )  # fmt: skip
    return web.Response(status=receiver.status, content_type="application/x-protobuf")


RECEIVER = web.AppKey("receiver", Receiver)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    got = Receiver()
    app = web.Application()
    app[RECEIVER] = got
    app.router.add_post("/v1/traces", _receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    got.url = f"http://127.0.0.1:{port}"
    yield got
    await runner.cleanup()


def _tracing(receiver: Receiver, ratio: float = 1.0) -> dict[str, Any]:
    return {"otlp_endpoint": receiver.url, "sample_ratio": ratio, "export_interval_s": 0.05}


async def _gateway(
    stack: contextlib.AsyncExitStack,
    sidecars: list[Sidecar],
    tracing: dict[str, Any] | None,
    **gateway: Any,
) -> Gateway:
    units = [f"{s.core.unit_id}={s.http_url},{s.grpc_target}" for s in sidecars]
    settings: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0,
                   "resume_secret": RESUME_SECRET},
        "gateway": {"units": units, **gateway},
    }  # fmt: skip
    if tracing:
        settings["tracing"] = tracing
    gw = await stack.enter_async_context(Gateway(load(settings)))
    await wait_until(lambda: len(gw.router.serving()) == len(sidecars), what="gateway sees units")
    return gw


async def _cell(
    stack: contextlib.AsyncExitStack,
    start_sidecar: SidecarFactory,
    sidecar_tracing: dict[str, Any] | None,
    gateway_tracing: dict[str, Any] | None,
    **gateway: Any,
) -> tuple[Sidecar, Gateway]:
    sections = {"tracing": sidecar_tracing} if sidecar_tracing else {}
    sidecar = await start_sidecar(sidecar={"unit_id": "u0"}, **sections)
    return sidecar, await _gateway(stack, [sidecar], gateway_tracing, **gateway)


async def _chat(gw: Gateway, headers: dict[str, str]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gw.http_url}/v1/chat/completions", json=body, headers=headers) as response,
    ):
        assert response.status == 200, await response.text()
        await response.read()


SIDECAR_HTTP = "POST /v1/chat/completions"


def _gateway_root(receiver: Receiver, name: str = SIDECAR_HTTP) -> Got:
    return receiver.one(name, "unitproxy-gateway")


def _check_chain(receiver: Receiver, root_name: str, sidecar_name: str) -> Got:
    """The spans of one request hang together: gateway root, its route and attempt,
    the sidecar's server span under the attempt, admission and engine under that."""
    root = _gateway_root(receiver, root_name)
    route = receiver.one("route")
    attempt = receiver.one("attempt")
    side = receiver.one(sidecar_name, "unitproxy-sidecar")
    admission = receiver.one("admission")
    engine = receiver.one("engine")
    spans = (root, route, attempt, side, admission, engine)
    assert len({s.trace_id for s in spans}) == 1
    assert root.kind == SERVER and attempt.kind == CLIENT and side.kind == SERVER
    assert route.parent_id == attempt.parent_id == root.span_id
    assert side.parent_id == attempt.span_id  # the gateway's traceparent named its attempt
    assert admission.parent_id == engine.parent_id == side.span_id
    assert route.attributes["unitproxy.policy"] == "lor"
    assert route.attributes["unitproxy.candidates"] == 1
    assert route.attributes["unitproxy.unit"] == attempt.attributes["unitproxy.unit"] == "u0"
    assert attempt.attributes["unitproxy.outcome"] == "done"
    assert root.attributes["gen_ai.request.model"] == MODEL
    assert engine.attributes["gen_ai.request.model"] == MODEL
    assert engine.attributes["gen_ai.usage.output_tokens"] == 3
    assert engine.attributes["gen_ai.usage.input_tokens"] > 0
    assert side.attributes["gen_ai.usage.output_tokens"] == 3
    # The gateway's own span has what the unit reported: its tokens, why it ended.
    assert root.attributes["gen_ai.usage.output_tokens"] == 3
    assert (
        root.attributes["gen_ai.usage.input_tokens"]
        == (engine.attributes["gen_ai.usage.input_tokens"])
    )
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert not any(s.error for s in spans)
    return root


# --- end to end -----------------------------------------------------------------------


async def test_a_clients_trace_runs_through_gateway_and_sidecar(
    receiver: Receiver, start_sidecar: SidecarFactory
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        _, gw = await _cell(stack, start_sidecar, _tracing(receiver), _tracing(receiver))
        await _chat(gw, {"traceparent": SAMPLED, "tracestate": "vendor=x"})
        await wait_until(lambda: len(receiver.spans) >= 6, what="six spans")
    root = _check_chain(receiver, SIDECAR_HTTP, SIDECAR_HTTP)
    assert root.trace_id == TRACE_ID and root.parent_id == PARENT_ID
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.operation.name"] == "chat"


async def test_a_streamed_requests_span_has_its_usage_and_the_client_no_comment(
    receiver: Receiver, start_sidecar: SidecarFactory
) -> None:
    """A sampled stream asks its unit for the usage comment (no tenants here to ask for
    it) and takes it out; an unsampled one is passed on as it came, with no usage."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}  # fmt: skip
    unsampled = SAMPLED[:-2] + "00"
    async with contextlib.AsyncExitStack() as stack:
        _, gw = await _cell(stack, start_sidecar, _tracing(receiver), _tracing(receiver))
        streams = []
        async with aiohttp.ClientSession() as session:
            for parent in (SAMPLED, unsampled):
                async with session.post(f"{gw.http_url}/v1/chat/completions", json=body,
                                        headers={"traceparent": parent}) as response:  # fmt: skip
                    assert response.status == 200
                    streams.append(await response.read())
        await wait_until(lambda: len(receiver.spans) >= 6, what="six spans")
    for stream in streams:
        assert b": usage" not in stream and stream.endswith(b"data: [DONE]\n\n")
        assert stream.count(b'"finish_reason":"length"') == 1
    root = _check_chain(receiver, SIDECAR_HTTP, SIDECAR_HTTP)
    assert root.attributes["gen_ai.usage.output_tokens"] == 3
    assert root.attributes["gen_ai.usage.input_tokens"] > 0
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert [s.trace_id for s in receiver.spans] == [TRACE_ID] * len(receiver.spans)


async def test_a_bad_traceparent_starts_a_new_trace(
    receiver: Receiver, start_sidecar: SidecarFactory
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        _, gw = await _cell(stack, start_sidecar, _tracing(receiver), _tracing(receiver))
        await _chat(gw, {"traceparent": f"00-{TRACE_ID:032X}-{PARENT_ID:016x}-01"})
        await wait_until(lambda: len(receiver.spans) >= 6, what="six spans")
    root = _check_chain(receiver, SIDECAR_HTTP, SIDECAR_HTTP)
    assert root.trace_id != TRACE_ID and root.parent_id == 0


@pytest.mark.parametrize("unit_wire", ["http", "grpc"])
async def test_a_trace_runs_through_the_grpc_wire(
    receiver: Receiver, start_sidecar: SidecarFactory, unit_wire: str
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        _, gw = await _cell(stack, start_sidecar, _tracing(receiver), _tracing(receiver),
                            grpc_unit_wire=unit_wire)  # fmt: skip
        async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.GenerateRequest(
                model=MODEL, prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=3)
            )
            call = stub.Generate(request, timeout=5, metadata=(("traceparent", SAMPLED),))
            chunks = [c async for c in call]
            assert sum(len(c.token_ids) for c in chunks) == 3
        await wait_until(lambda: len(receiver.spans) >= 6, what="six spans")
    method = "unitproxy.v1.Inference/Generate"
    root = _check_chain(receiver, method, method)
    assert root.trace_id == TRACE_ID and root.parent_id == PARENT_ID
    assert root.attributes["rpc.grpc.status_code"] == "OK"


async def test_sampling_zero_exports_nothing(
    receiver: Receiver, start_sidecar: SidecarFactory
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        sidecar, gw = await _cell(
            stack, start_sidecar, _tracing(receiver, 0.0), _tracing(receiver, 0.0)
        )
        await _chat(gw, {})
        await _chat(gw, {"traceparent": SAMPLED[:-2] + "00"})  # a parent that declined
        await stack.aclose()  # the gateway flushes what it holds as it stops
        await sidecar.__aexit__(None, None, None)
    assert receiver.spans == [] and receiver.posts == 0


async def test_a_gateway_that_does_not_trace_passes_the_clients_traceparent_on(
    receiver: Receiver, start_sidecar: SidecarFactory
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        _, gw = await _cell(stack, start_sidecar, _tracing(receiver), None)
        await _chat(gw, {"traceparent": SAMPLED})
        await wait_until(lambda: len(receiver.spans) >= 3, what="the sidecar's spans")
        async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.GenerateRequest(
                model=MODEL, prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=2)
            )
            grpc_parent = f"00-{TRACE_ID:032x}-{PARENT_ID + 1:016x}-01"
            call = stub.Generate(request, timeout=5, metadata=(("traceparent", grpc_parent),))
            assert [c async for c in call]
        await wait_until(lambda: len(receiver.spans) >= 6, what="the sidecar's gRPC spans")
    side = receiver.one(SIDECAR_HTTP, "unitproxy-sidecar")
    assert (side.trace_id, side.parent_id) == (TRACE_ID, PARENT_ID)
    side_grpc = receiver.one("unitproxy.v1.Inference/Generate", "unitproxy-sidecar")
    assert (side_grpc.trace_id, side_grpc.parent_id) == (TRACE_ID, PARENT_ID + 1)
    assert not [s for s in receiver.spans if s.service == "unitproxy-gateway"]


async def test_a_migration_and_a_wait_in_the_queue_are_spans(
    receiver: Receiver, start_sidecar: SidecarFactory
) -> None:
    tracing = {"tracing": _tracing(receiver)}
    slow = {"decode_step_ms": 5.0}
    a = await start_sidecar(sidecar={"unit_id": "a", "capacity": 1}, sim=slow, **tracing)
    b = await start_sidecar(sidecar={"unit_id": "b", "capacity": 1}, sim=slow, **tracing)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 60}
    async with contextlib.AsyncExitStack() as stack:
        gw = await _gateway(stack, [a, b], _tracing(receiver))
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(session.post(f"{gw.http_url}/v1/completions", json=body,
                                                     headers={"traceparent": SAMPLED}))  # fmt: skip
            await wait_until(lambda: a.core.outstanding + b.core.outstanding == 1, what="taken")
            failing = a if a.core.outstanding else b
            # Both units full: a third request waits in the gateway's queue.
            second = asyncio.create_task(session.post(f"{gw.http_url}/v1/completions", json=body))
            third = asyncio.create_task(session.post(f"{gw.http_url}/v1/completions", json=body))
            await wait_until(lambda: gw.router.waiting == 1, what="a request waiting")
            await asyncio.sleep(0.05)
            await failing.engine.stop()  # the first request goes on on the other unit
            for task in (first, second, third):
                response = await task
                await response.read()
            assert (await first).status == 200
        await wait_until(
            lambda: any(s.trace_id == TRACE_ID for s in receiver.named("migration")),
            what="the traced request's migration",
        )
        await wait_until(lambda: len(receiver.named("queue")) >= 1, what="a queue wait")
    traced = [s for s in receiver.spans if s.trace_id == TRACE_ID]
    attempts = sorted((s for s in traced if s.name == "attempt"),
                      key=lambda s: s.attributes["unitproxy.attempt"])  # fmt: skip
    assert [s.attributes["unitproxy.outcome"] for s in attempts] == ["migrate", "done"]
    assert attempts[0].error and attempts[0].attributes["unitproxy.unit"] == failing.core.unit_id
    moved = next(s for s in traced if s.name == "migration")
    assert moved.attributes["unitproxy.migration.reason"] == "unit_failed"
    assert moved.attributes["unitproxy.unit"] == attempts[1].attributes["unitproxy.unit"]
    waited = receiver.named("queue")[0]
    route = next(s for s in receiver.spans if s.span_id == waited.parent_id)
    assert route.name == "route"


async def test_the_latency_policy_shows_its_prediction(
    receiver: Receiver, start_sidecar: SidecarFactory
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        _, gw = await _cell(stack, start_sidecar, None, _tracing(receiver), policy="latency")
        for _ in range(12):  # past the answers the policy needs to learn the unit
            await _chat(gw, {})
        await wait_until(lambda: len(receiver.named("route")) == 12, what="twelve routes")
    predicted = [s.attributes.get("unitproxy.predicted_ttft_s") for s in receiver.named("route")]
    assert predicted[0] is None  # not learnt yet: no prediction
    assert isinstance(predicted[-1], float) and predicted[-1] >= 0.0
    assert {s.attributes["unitproxy.policy"] for s in receiver.named("route")} == {"latency"}


# --- the exporter -----------------------------------------------------------------------


async def test_a_full_queue_drops_and_counts_and_a_refusing_collector_is_counted(
    receiver: Receiver,
) -> None:
    registry = CollectorRegistry()
    settings = TracingSettings(otlp_endpoint=receiver.url, max_queued_spans=3,
                               export_interval_s=60.0)  # fmt: skip
    receiver.status = 503
    async with Exporter(settings, TracingMetrics(registry), "test") as exporter:
        tracer = Tracer(1.0, exporter.add)
        trace = tracer.begin(None, None, "r")
        for i in range(5):
            trace.start(f"s{i}").end()
    # Closing sent the three it held; the collector refused them.
    assert receiver.posts == 1 and len(receiver.spans) == 3

    def dropped(reason: str) -> float | None:
        return registry.get_sample_value("unitproxy_trace_spans_dropped_total", {"reason": reason})

    assert dropped("queue_full") == 2
    assert dropped("export_failed") == 3
    assert registry.get_sample_value("unitproxy_trace_spans_exported_total") == 0


async def test_spans_wait_no_longer_than_the_interval(receiver: Receiver) -> None:
    registry = CollectorRegistry()
    settings = TracingSettings(otlp_endpoint=receiver.url, export_interval_s=0.05)
    async with Exporter(settings, TracingMetrics(registry), "test") as exporter:
        trace = Tracer(1.0, exporter.add).begin(None, None, "r")
        trace.root.end()
        await wait_until(lambda: len(receiver.spans) == 1, what="the span, before closing")
        assert registry.get_sample_value("unitproxy_trace_spans_exported_total") == 1


def test_finish_reasons_are_read_without_parsing() -> None:
    found: list[str] = []
    body = b'{"choices":[{"index":0,"finish_reason": "stop"},{"index":1,"finish_reason":"length"}]}'
    finish_reasons(body, found)
    events = b'data: {"choices":[{"finish_reason":null}]}\n\ndata: {"choices":[{"finish_reason":"tool_calls"}]}\n\n'
    finish_reasons(events, found)
    finish_reasons(b'{"finish_reason":', found)  # cut short: nothing
    assert found == ["stop", "length", "tool_calls"]

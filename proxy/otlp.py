"""The span exporter: OTLP over HTTP/protobuf, posted to ``{otlp_endpoint}/v1/traces``.

Ended spans wait in a bounded queue (``tracing.max_queued_spans``; past it a span is
dropped and counted, never waited for); one background task sends them in batches of
``tracing.batch_spans``, at once when a batch is full, else every
``tracing.export_interval_s``. A collector that refuses or does not answer costs the
batch (counted as dropped), never the requests. Closing sends what is left, within
``tracing.export_timeout_s``.

Encoded with the ``opentelemetry-proto`` messages (ExportTraceServiceRequest): the
OpenTelemetry SDK is not used.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections import deque
from collections.abc import Callable
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Self

import aiohttp
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status
from prometheus_client import CollectorRegistry

from proxy.metrics import TracingMetrics
from proxy.settings import TracingSettings
from proxy.tracing import Span, Tracer, Value

log = logging.getLogger(__name__)

PATH = "/v1/traces"
CONTENT_TYPE = "application/x-protobuf"
SCOPE = "unitproxy"
ENCODE_SLICE = 32  # spans encoded between two turns of the loop


def _version() -> str:
    try:
        return importlib.metadata.version("unitproxy")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = _version()


def set_value(out: AnyValue, value: Value) -> None:
    if isinstance(value, str):
        out.string_value = value
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.double_value = value
    else:
        out.array_value.values.extend(AnyValue(string_value=v) for v in value)


def encode_span(span: Span, out: OtlpSpan) -> None:
    """``span`` into ``out``, filled in place (a message built and copied costs twice)."""
    trace = span.trace
    assert trace is not None
    out.trace_id = trace.trace_id.to_bytes(16, "big")
    out.span_id = span.span_id.to_bytes(8, "big")
    if span.parent_id:
        out.parent_span_id = span.parent_id.to_bytes(8, "big")
    out.name = span.name
    out.kind = span.kind  # type: ignore[assignment]
    out.start_time_unix_nano = span.start_ns
    out.end_time_unix_nano = span.end_ns
    attributes = out.attributes
    for key, value in span.attributes.items():
        kv = attributes.add()
        kv.key = key
        set_value(kv.value, value)
    if trace.state:
        out.trace_state = trace.state
    if span.error is not None:
        out.status.code = Status.STATUS_CODE_ERROR
        out.status.message = span.error


async def encode(spans: list[Span], service: str) -> bytes:
    """One ExportTraceServiceRequest of ``spans``, from ``service``. The loop runs
    between every ENCODE_SLICE spans: a full batch takes milliseconds, which requests
    must not wait behind."""
    request, add = _request(service)
    for i, span in enumerate(spans, 1):
        encode_span(span, add())
        if not i % ENCODE_SLICE:
            await asyncio.sleep(0)
    data: bytes = request.SerializeToString()
    return data


def _request(service: str) -> tuple[ExportTraceServiceRequest, Callable[[], OtlpSpan]]:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(
        [
            KeyValue(key="service.name", value=AnyValue(string_value=service)),
            KeyValue(key="service.version", value=AnyValue(string_value=VERSION)),
        ]
    )
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = SCOPE
    scope_spans.scope.version = VERSION
    return request, scope_spans.spans.add


class Exporter:
    """``async with Exporter(settings, metrics, service) as exporter``: ``add`` is the
    tracer's sink; the batches go out from a task of its own."""

    def __init__(self, settings: TracingSettings, metrics: TracingMetrics, service: str):
        assert settings.otlp_endpoint is not None
        self.url = settings.otlp_endpoint + PATH
        self._settings = settings
        self._service = settings.service_name or service
        self._queue: deque[Span] = deque()
        self._full = asyncio.Event()  # a batch is ready, or closing
        self._dropped = metrics.dropped.labels("queue_full")
        self._failed = metrics.dropped.labels("export_failed")
        self._exported = metrics.exported
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._warned = False

    def add(self, span: Span) -> None:
        queue = self._queue
        if len(queue) >= self._settings.max_queued_spans:
            self._dropped.inc()
            return
        queue.append(span)
        if len(queue) >= self._settings.batch_spans:
            self._full.set()

    async def __aenter__(self) -> Self:
        timeout = aiohttp.ClientTimeout(total=self._settings.export_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._task = asyncio.create_task(self._run(), name="trace export")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closing = True
        self._full.set()
        try:
            if self._task is not None:
                # What is queued goes out, each batch within the export timeout.
                await asyncio.wait_for(self._task, self._settings.export_timeout_s * 2)
        except TimeoutError:
            log.warning("traces: %d spans not sent at shutdown", len(self._queue))
        finally:
            if self._session is not None:
                await self._session.close()

    async def _run(self) -> None:
        while True:
            try:
                if not self._closing and len(self._queue) < self._settings.batch_spans:
                    try:
                        async with asyncio.timeout(self._settings.export_interval_s):
                            await self._full.wait()
                    except TimeoutError:
                        pass
                self._full.clear()
                while self._queue:
                    await self._send(self._batch())
                    if not self._closing and len(self._queue) < self._settings.batch_spans:
                        break
                if self._closing and not self._queue:
                    return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("traces: export loop failed; going on")

    def _batch(self) -> list[Span]:
        queue, n = self._queue, min(len(self._queue), self._settings.batch_spans)
        return [queue.popleft() for _ in range(n)]

    async def _send(self, spans: list[Span]) -> None:
        body = await encode(spans, self._service)
        assert self._session is not None
        try:
            async with self._session.post(
                self.url, data=body, headers={"Content-Type": CONTENT_TYPE}
            ) as response:
                await response.read()
                ok = 200 <= response.status < 300
                why: Any = f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, why = False, exc
        if ok:
            self._exported.inc(len(spans))
            self._warned = False
            return
        self._failed.inc(len(spans))
        if not self._warned:  # once per outage, not once per batch
            self._warned = True
            log.warning("traces: the collector at %s did not take %d spans: %s",
                        self.url, len(spans), why)  # fmt: skip


async def open_tracer(
    stack: AsyncExitStack, settings: TracingSettings, registry: CollectorRegistry, service: str
) -> Tracer | None:
    """The tracer of a process, its exporter entered on ``stack``; None with tracing off."""
    if settings.otlp_endpoint is None:
        return None
    exporter = Exporter(settings, TracingMetrics(registry), service)
    await stack.enter_async_context(exporter)
    return Tracer(settings.sample_ratio, exporter.add)

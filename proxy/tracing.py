"""Traces: W3C Trace Context in and out, and a small span recorder.

A request's trace comes in as its ``traceparent`` header (gRPC: metadata), or starts
here. ``Tracer.begin`` parses it (a malformed one is ignored: a new trace starts) and
decides whether the request is sampled: parent-based, so a sampled parent is honoured
and an unsampled one is not recorded; a request without a parent is sampled at
``tracing.sample_ratio``. ``tracestate`` rides along unchanged.

Spans are plain objects handed, when they end, to a sink (``proxy.otlp.Exporter``,
which batches them to an OTLP collector). An unsampled request records nothing: its
spans are ``NO_SPAN``, whose methods return at once, and it still forwards a
``traceparent`` (flag 00) so the processes after it make the same choice. With tracing
off there is no tracer at all: the callers' one branch is ``tracer is None``, and a
client's own headers are passed on unchanged.

    Tracer.begin -> Trace (trace id, sampled, tracestate) + its server Span
    Trace.start  -> a child Span;  Span.end -> the sink
    Trace.headers(span) -> the traceparent/tracestate to send with a call made under span
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.settings import EngineSettings
    from proxy.settings import TracingSettings

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
MAX_TRACESTATE = 512  # longer ones are dropped (W3C: a vendor may truncate; we keep none)

# OTLP's Span.SpanKind values.
INTERNAL = 1
SERVER = 2
CLIENT = 3

_HEX = frozenset("0123456789abcdef")

Value = str | int | float | bool | list[str]


class Parent:
    """A valid incoming ``traceparent``: the caller's trace, span and sampled flag."""

    __slots__ = ("sampled", "span_id", "trace_id")

    def __init__(self, trace_id: int, span_id: int, sampled: bool):
        self.trace_id = trace_id
        self.span_id = span_id
        self.sampled = sampled


def parse_traceparent(value: str | bytes | None) -> Parent | None:
    """The parent a ``traceparent`` value names, None when it is absent or malformed
    (W3C Trace Context level 1: version-traceid-parentid-flags, lower-case hex; version
    ff, an all-zero trace or parent id, and a version 00 value of any other length are
    invalid; a later version may append fields after a dash)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    value = value.strip(" \t")
    if len(value) < 55 or value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    version, flags = value[:2], value[53:55]
    trace_hex, span_hex = value[3:35], value[36:52]
    if not _hex(version) or version == "ff" or not _hex(flags):
        return None
    if len(value) > 55 and (version == "00" or value[55] != "-"):
        return None
    if not (_hex(trace_hex) and _hex(span_hex)):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return Parent(trace_id, span_id, bool(int(flags, 16) & 1))


def _hex(text: str) -> bool:
    return _HEX.issuperset(text)


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


class Span:
    """One timed operation of a trace. Times are Unix nanoseconds."""

    __slots__ = (
        "attributes", "end_ns", "error", "kind", "name", "parent_id", "span_id", "start_ns",
        "trace",
    )  # fmt: skip

    def __init__(
        self,
        trace: Trace | None,
        name: str,
        kind: int,
        span_id: int,
        parent_id: int,
        start_ns: int,
    ):
        self.trace = trace  # None: NO_SPAN, which records nothing
        self.name = name
        self.kind = kind
        self.span_id = span_id
        self.parent_id = parent_id  # 0: a root
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes: dict[str, Value] = {}
        self.error: str | None = None  # set: the span's status is ERROR with this message

    @property
    def recording(self) -> bool:
        return self.trace is not None

    def set(self, key: str, value: Value | None) -> None:
        if self.trace is not None and value is not None:
            self.attributes[key] = value

    def fail(self, message: str) -> None:
        """The operation failed: status ERROR."""
        if self.trace is not None:
            self.error = message

    def end(self, end_ns: int = 0) -> None:
        """Done: to the sink, once."""
        trace = self.trace
        if trace is None or self.end_ns:
            return
        self.end_ns = end_ns or trace.tracer.clock_ns()
        trace.tracer.sink(self)


NO_SPAN = Span(None, "", INTERNAL, 0, 0, 0)


class Trace:
    """One request's part of a trace in this process."""

    __slots__ = ("root", "sampled", "state", "trace_id", "tracer")

    def __init__(self, tracer: Tracer, trace_id: int, sampled: bool, state: str | None):
        self.tracer = tracer
        self.trace_id = trace_id
        self.sampled = sampled
        self.state = state  # the incoming tracestate, passed on as it came
        self.root = NO_SPAN

    def start(
        self, name: str, parent: Span | None = None, kind: int = INTERNAL, start_ns: int = 0
    ) -> Span:
        """A span begun now (or at ``start_ns``), child of ``parent`` (default: the root)."""
        if not self.sampled:
            return NO_SPAN
        tracer = self.tracer
        up = self.root if parent is None else parent
        return Span(self, name, kind, tracer.new_span_id(), up.span_id,
                    start_ns or tracer.clock_ns())  # fmt: skip

    def traceparent(self, span: Span) -> str:
        """The ``traceparent`` of a call made under ``span`` (unsampled: under the root
        id, flag 00)."""
        span_id = span.span_id if span.trace is not None else self.root_id
        return format_traceparent(self.trace_id, span_id, self.sampled)

    @property
    def root_id(self) -> int:
        return self.root.span_id if self.root.trace is not None else self._unsampled_id

    @property
    def _unsampled_id(self) -> int:
        # An unsampled trace's calls name a fixed parent: any nonzero id will do, as
        # nothing downstream records it; the trace id's low bits keep it stable.
        return (self.trace_id & 0xFFFFFFFFFFFFFFFF) or 1

    def headers(self, span: Span) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) for a call made under ``span``."""
        found = {TRACEPARENT: self.traceparent(span)}
        if self.state:
            found[TRACESTATE] = self.state
        return found


class Tracer:
    """Starts traces and hands ended spans to ``sink``; ``ratio`` of the requests with
    no parent are sampled (a parent's own flag decides for the others)."""

    def __init__(
        self,
        ratio: float,
        sink: Callable[[Span], None],
        rng: random.Random | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
    ):
        self.ratio = ratio
        self.sink = sink
        self._rng = rng or random.Random()
        self.clock_ns = clock_ns

    def new_span_id(self) -> int:
        return self._rng.getrandbits(64) or 1

    def begin(
        self,
        traceparent: str | bytes | None,
        tracestate: str | bytes | None,
        name: str,
        kind: int = SERVER,
    ) -> Trace:
        """The trace of a request that came in with these headers, its root span (kind
        ``kind``, named ``name``) started now; a bad ``traceparent`` starts a new trace
        (and its ``tracestate`` is dropped with it)."""
        return self.start(parse_traceparent(traceparent), trace_state(tracestate), name, kind)

    def start(
        self, parent: Parent | None, state: str | None, name: str, kind: int = SERVER
    ) -> Trace:
        """``begin`` with the headers already read (``parse_traceparent``,
        ``trace_state``): a new trace where ``parent`` is None."""
        if parent is None:
            trace_id = self._rng.getrandbits(128) or 1
            sampled = self.ratio >= 1.0 or self._rng.random() < self.ratio
            state = None
            parent_id = 0
        else:
            trace_id, sampled, parent_id = parent.trace_id, parent.sampled, parent.span_id
        trace = Trace(self, trace_id, sampled, state)
        if sampled:
            trace.root = Span(trace, name, kind, self.new_span_id(), parent_id, self.clock_ns())
        return trace


def trace_state(value: str | bytes | None) -> str | None:
    """A ``tracestate`` value to pass on, None when it is absent or unfit (too long,
    not printable)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    value = value.strip(" \t")
    if not value or len(value) > MAX_TRACESTATE or not value.isprintable():
        return None
    return value


def finish(span: Span, status: str, error: str | None = None) -> None:
    """End a request's server span: it answered ``status`` (an HTTP status, or a gRPC
    code's name); ERROR for a 5xx or a gRPC failure, or with ``error``."""
    if span.trace is None:
        return
    if status.isdigit():
        span.set("http.response.status_code", int(status))
        failed = int(status) >= 500
    else:
        span.set("rpc.grpc.status_code", status)
        failed = status not in ("OK", "CANCELLED")
    if error is not None or failed:
        span.fail(error or status)
    span.end()


def from_metadata(metadata: object) -> tuple[str | None, str | None]:
    """``traceparent`` and ``tracestate`` of gRPC invocation metadata (pairs)."""
    parent = state = None
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == TRACEPARENT:
            parent = value if isinstance(value, str) else value.decode("latin-1")
        elif key == TRACESTATE:
            state = value if isinstance(value, str) else value.decode("latin-1")
    return parent, state


def engine_settings(engine: EngineSettings, tracing: TracingSettings) -> EngineSettings:
    """The engine settings of a sidecar that traces: vLLM gets the same collector as
    its ``otlp_traces_endpoint`` (unless engine_args name one), so that its own spans
    join each request's trace."""
    endpoint = tracing.otlp_endpoint
    if endpoint is None or engine.kind != "vllm" or "otlp_traces_endpoint" in engine.engine_args:
        return engine
    args = {**engine.engine_args, "otlp_traces_endpoint": endpoint + "/v1/traces"}
    return engine.model_copy(update={"engine_args": args})

"""A request's spans at the gateway (``proxy.tracing``), around the core's loop.

    POST /v1/...  SERVER, from the client's traceparent (or a new trace); once
                  answered, the tokens it used (gen_ai.usage.input_tokens and
                  output_tokens, as its unit reported them) and why it ended
                  (gen_ai.response.finish_reasons)
      route       the routing decision: policy, candidates, chosen unit, the
                  predicted TTFT (policy latency); the wait in the queue, if any:
        queue     the time the request waited for a unit
      attempt     CLIENT, one per unit tried: unit, outcome; the unit's traceparent
                  names this span, so the sidecar's spans hang here
      migration   between a unit that failed under the request and the next one
                  that takes it (reason, the new unit)

The core calls ``acquire`` and ``attempt`` in place of the router's and the job's when
a request has a trace, and nothing otherwise. An unsampled trace makes no spans but
still names itself in the traceparent it sends (flag 00).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any, TypeAlias

from proxy.errors import UnitProxyError
from proxy.tracing import CLIENT, NO_SPAN, Span, Trace, finish

# The core's types (Router, Unit, Want, Tried, Job) are Any here: the core imports
# this module, and nothing in proxy/ imports in a circle.
Router: TypeAlias = Any
Unit: TypeAlias = Any
Want: TypeAlias = Any
Tried: TypeAlias = Any
Attempting: TypeAlias = Any


# gen_ai.operation.name of each route (OpenTelemetry GenAI semantic conventions).
OPERATIONS = {
    "chat": "chat",
    "completions": "text_completion",
    "responses": "chat",
    "embeddings": "embeddings",
    "grpc_generate": "text_completion",
}


class RequestTrace:
    """One request's trace at the gateway."""

    __slots__ = ("_attempt", "_attempts", "_failed_at", "_last", "root", "trace")

    def __init__(self, trace: Trace):
        self.trace = trace
        self.root = trace.root
        self._attempt = NO_SPAN  # the attempt in flight (its id goes to the unit)
        self._attempts = 0
        self._last: Tried | None = None  # how the attempt before ended
        self._failed_at = 0  # when it ended (ns)

    @property
    def sampled(self) -> bool:
        return self.trace.sampled

    def headers(self) -> dict[str, str]:
        """What a unit gets: a traceparent naming the attempt in flight."""
        return self.trace.headers(self._attempt)

    def describe(self, route: str, model: str | None, request_id: str) -> None:
        root = self.root
        root.set("gen_ai.operation.name", OPERATIONS.get(route, route))
        root.set("gen_ai.request.model", model)
        root.set("unitproxy.route", route)
        root.set("unitproxy.request_id", request_id or None)

    async def acquire(self, router: Router, exclude: Collection[str], want: Want) -> Unit:
        """``router.acquire``, inside a route span."""
        trace = self.trace
        if not trace.sampled:
            return await router.acquire(exclude, want)
        span = trace.start("route")
        span.set("unitproxy.policy", router.settings.policy)
        span.set("unitproxy.candidates", len(router.candidates(exclude, want.model)))
        queued = router.queued
        try:
            unit = await router.acquire(exclude, want)
        except UnitProxyError as exc:
            span.fail(exc.message)
            span.set("error.type", exc.code or exc.error_type)
            raise
        finally:
            if router.queued != queued:  # it waited in the queue (nothing else moves it)
                trace.start("queue", span, start_ns=span.start_ns).end()
            span.end()
        span.set("unitproxy.unit", unit.id)
        predicted = router.policy.predicted_ttft(unit, want, router.ahead(unit))
        if predicted >= 0.0:
            span.set("unitproxy.predicted_ttft_s", predicted)
        return unit

    async def attempt(self, job: Attempting, unit: Unit) -> Tried:
        """``job.attempt(unit)``, inside an attempt span (and after a failure under the
        request, a migration span up to now)."""
        trace = self.trace
        if not trace.sampled:
            return await job.attempt(unit)
        last = self._last
        if last is not None and last.next.value == "migrate":
            moved = trace.start("migration", start_ns=self._failed_at)
            moved.set("unitproxy.migration.reason", last.reason)
            moved.set("unitproxy.unit", unit.id)
            moved.end()
        self._attempts += 1
        span = self._attempt = trace.start("attempt", kind=CLIENT)
        span.set("unitproxy.unit", unit.id)
        span.set("unitproxy.attempt", self._attempts)
        try:
            result = await job.attempt(unit)
        except BaseException as exc:
            span.fail(type(exc).__name__)
            span.end()
            raise
        self._attempt_ended(span, result)
        return result

    def _attempt_ended(self, span: Span, result: Tried) -> None:
        span.set("unitproxy.outcome", result.next.value)
        span.set("unitproxy.unit_health", result.health.value)
        if result.reason:
            span.set("unitproxy.reason", result.reason)
        if result.error is not None:
            span.fail(result.error.message)
        span.end()
        self._last = result
        self._failed_at = span.end_ns

    def used(self, prompt: int, completion: int, reasons: list[str]) -> None:
        """What the request used, as its (last) unit reported it (-1: it reported
        nothing), and why each of its choices ended."""
        root = self.root
        if prompt >= 0 and completion >= 0:
            root.set("gen_ai.usage.input_tokens", prompt)
            root.set("gen_ai.usage.output_tokens", completion)
        if reasons:
            root.set("gen_ai.response.finish_reasons", reasons)

    def finish(self, status: str, error: str | None = None) -> None:
        """The request ended with ``status`` (HTTP status or gRPC code)."""
        finish(self.root, status, error)


def span_name(method: bytes, path: str, stored: str | None) -> str:
    """An HTTP request's server span name: its method and route (a stored response's
    id and the query are no part of it)."""
    where = path.split("?", 1)[0]
    if stored is not None:
        where = where.replace(stored, "{response_id}")
    return f"{method.decode()} {where}"


FINISH_REASON = b'"finish_reason":'


def finish_reasons(data: bytes, into: list[str]) -> None:
    """The finish reasons that ``data`` (a JSON answer, or whole SSE events) names, in
    order, added to ``into``: read without parsing the JSON (a null one is no reason;
    a sampled request's only)."""
    at = data.find(FINISH_REASON)
    while at >= 0:
        start = at + len(FINISH_REASON)
        while start < len(data) and data[start] in b" \t\r\n":
            start += 1
        if data[start : start + 1] == b'"':
            end = data.find(b'"', start + 1)
            if end > start:
                into.append(data[start + 1 : end].decode("utf-8", "replace"))
        at = data.find(FINISH_REASON, start)


def body_model(body: bytes) -> str | None:
    """The ``model`` of an OpenAI JSON body (for a sampled request's span, when the
    router did not read it)."""
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError, RecursionError):
        return None
    return model if isinstance(model, str) else None

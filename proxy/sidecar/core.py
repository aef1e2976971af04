"""What the sidecar does for one request, whatever wire it came on.

``admit`` decides at once (429 full, 503 not serving) and hands out a ``Lease``;
``run`` drives the engine, passes each delta to the caller's ``emit``, observes the
latency metrics and releases the lease on every path: finished, engine error,
deadline, client gone (the caller's task cancelled), unit failed.

A unit that fails lets go of its requests: ``let_go`` ends every request in flight
with ``UnitFailed`` at once (each one's deadline scope is made to expire now, which
aborts it in the engine), so no client waits on a hung collective and a gateway can
resume them elsewhere. ``watch_failures`` does that whenever the unit is NOT_SERVING;
a drain lets requests finish instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import TypeVar

from engine.base import ENGINE_SLOTS, PRIORITY_RANK, Engine, EngineRequest, TokenDelta
from engine.kv_events import KVEvent
from proxy.broadcast import Broadcast
from proxy.errors import (
    DeadlineExceeded,
    EngineDeadError,
    EngineError,
    Overloaded,
    Unavailable,
    UnitFailed,
)
from proxy.load import (
    MAX_METRIC_NAME,
    MAX_NAMED_METRICS,
    OUTSTANDING_BATCH,
    OUTSTANDING_STANDARD,
    PRIORITY_HEADROOM,
    LoadReport,
    UnitState,
    joined_metrics,
    named_metrics,
)
from proxy.metrics import ServingMetrics
from proxy.resume import HintKey
from proxy.sidecar.blocks import HeldChunks
from proxy.sidecar.health import UnitHealth
from proxy.tracing import NO_SPAN, Span, Trace, Tracer

log = logging.getLogger(__name__)
_T = TypeVar("_T")
# How often a request awaiting a whole answer looks at the engine's step count.
_PROGRESS_POLL_S = 1.0
# A unit's capacity when none is configured and its engine does not say its slots.
DEFAULT_CAPACITY = 64
STANDARD = PRIORITY_RANK["standard"]


def engine_priority(
    asked: str | bytes | None,
    sig: str | bytes | None = None,
    request_id: str | bytes | None = None,
    key: HintKey | None = None,
) -> int:
    """The engine priority (``EngineRequest.priority``) of a request whose
    ``x-unitproxy-priority`` names its class: a gateway with tenants sends its tenant's
    class there. The header is trusted downwards: ``batch`` is batch, ``standard`` and
    anything else standard. ``interactive`` is granted only with a gateway's credential:
    ``x-unitproxy-priority-sig``, an HMAC under ``server.resume_secret`` (``key``) over
    the request's ``x-request-id`` and the class; without it (or without the secret) a
    claim of interactive is standard, so a client that reaches a unit directly cannot
    take a slot from other work."""
    if asked == "batch" or asked == b"batch":
        return PRIORITY_RANK["batch"]
    if (asked == "interactive" or asked == b"interactive") and key is not None and sig:
        sig = sig.decode(errors="replace") if isinstance(sig, bytes) else sig
        if isinstance(request_id, bytes):
            request_id = request_id.decode(errors="replace")
        if key.valid_priority(request_id or "", "interactive", sig):
            return PRIORITY_RANK["interactive"]
    return PRIORITY_RANK["standard"]


def with_priority(request: EngineRequest, priority: int) -> EngineRequest:
    if priority == request.priority:
        return request
    return dataclasses.replace(request, priority=priority)


class Lease:
    """One admitted request; ``release`` takes it off the outstanding count once."""

    __slots__ = ("_core", "admitted_at", "failure", "gateway", "priority", "released", "trace")

    def __init__(
        self,
        core: SidecarCore,
        admitted_at: float,
        priority: int = STANDARD,
        gateway: str | None = None,
    ):
        self._core = core
        self.admitted_at = admitted_at
        self.priority = priority  # its engine priority (PRIORITY_RANK)
        self.gateway = gateway  # the gateway that sent it, as it names itself
        self.released = False
        self.failure: UnitFailed | None = None  # set by let_go: why the unit dropped it
        self.trace: Trace | None = None  # its spans, with tracing on

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._core._release(self.priority, self.gateway)


class SidecarCore:
    def __init__(
        self,
        *,
        unit_id: str,
        engine: Engine,
        health: UnitHealth,
        metrics: ServingMetrics,
        changes: Broadcast,
        capacity: int | None,  # None: the engine's slots (DEFAULT_CAPACITY if unknown)
        retry_after_s: int = 1,
        clock: Callable[[], float] = time.monotonic,
        resume_key: HintKey | None = None,
        prefix_chunk_chars: int = 512,
        prefix_report_blocks: int = 4096,
        priority_headroom: int | None = None,  # None: a quarter of the capacity
    ):
        self.unit_id = unit_id
        # What resume hints and interactive classes must be signed with; None: no hint
        # taken, no request granted interactive.
        self.resume_key = resume_key
        self.engine = engine
        self.health = health
        self._capacity = capacity
        self._headroom = priority_headroom
        self.outstanding = 0
        self._by_priority = [0 for _ in PRIORITY_RANK]  # outstanding by engine priority
        # outstanding by the gateway that sent them (only those with some: at most
        # ``outstanding`` names), for the reports to each watching gateway
        self._by_gateway: dict[str, int] = {}
        self.http_url = ""
        self.grpc_target = ""
        self.last_progress_at = clock()
        # Requests whose last token waits on a slow client: the engine owes them nothing.
        self._on_client = 0
        self._metrics = metrics
        self.tracer: Tracer | None = None  # with tracing.otlp_endpoint (the server sets it)
        self._changes = changes
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._seq = 0
        self._named: dict[str, float] = {}  # named metrics the sidecar itself sets
        # Requests inside run(), each with the scope that bounds it (its deadline).
        self._running: dict[Lease, asyncio.Timeout] = {}
        # The prefix blocks the engine holds, when it tells (its KV cache events), and
        # prefix_report_blocks is not 0.
        self.held: HeldChunks | None = None
        if prefix_report_blocks > 0:
            held = HeldChunks(prefix_chunk_chars, prefix_report_blocks)
            if engine.subscribe_kv_events(self._kv_events):
                self.held = held

    def _kv_events(self, events: list[KVEvent]) -> None:
        if self.held is not None:
            before = self.held.seq
            self.held.events(events)
            if self.held.seq != before:
                self._changes.notify()

    @property
    def capacity(self) -> int:
        """Most requests admitted at once: as configured, else the engine's slots (so
        what its engine cannot run at once waits in the gateways, where it can be put
        in order), else DEFAULT_CAPACITY."""
        if self._capacity is not None:
            return self._capacity
        return self.engine.slots() or DEFAULT_CAPACITY

    @property
    def headroom(self) -> int:
        """How many requests over capacity a unit takes for a class above the lowest it
        runs (``admit``): sidecar.priority_headroom, else a quarter of the capacity (at
        least 1); 0 where the engine does not schedule by priority (nothing would take a
        lower class's slot: the request would wait in the engine's FIFO)."""
        if not self.engine.takes_priority():
            return 0
        if self._headroom is not None:
            return self._headroom
        return max(1, self.capacity // 4)

    def priority_of(
        self, asked: str | bytes | None, sig: str | bytes | None, request_id: str | bytes | None
    ) -> int:
        """The engine priority of a request's ``x-unitproxy-priority`` (``engine_priority``
        under this unit's ``resume_key``)."""
        return engine_priority(asked, sig, request_id, self.resume_key)

    def begin_trace(
        self, parent: str | bytes | None, state: str | bytes | None, name: str
    ) -> Trace | None:
        """A request's trace (its server span started), with tracing on."""
        tracer = self.tracer
        if tracer is None:
            return None
        trace = tracer.begin(parent, state, name)
        trace.root.set("unitproxy.unit", self.unit_id)
        return trace

    def admit(
        self, priority: int = STANDARD, trace: Trace | None = None, gateway: str | None = None
    ) -> Lease:
        """A lease for one request of engine priority ``priority`` (PRIORITY_RANK), or
        Overloaded (429) / Unavailable (503) now; ``trace``: its spans (an admission
        span, with tracing on); ``gateway``: the name the gateway that sent it gave
        (``gateway_name``), counted apart in the reports to that gateway.

        Up to capacity any class; over it, up to ``headroom`` more, a request whose
        class and those above it hold fewer than capacity: the engine gives it the slot
        of a running request of a lower class (which pauses, and resumes when a slot
        frees), rather than keeping it behind work it outranks."""
        if trace is None or not trace.sampled:
            lease = self._admit(priority, gateway)
        else:
            span = trace.start("admission")
            span.set("unitproxy.outstanding", self.outstanding)
            span.set("unitproxy.capacity", self.capacity)
            try:
                lease = self._admit(priority, gateway)
            except (Overloaded, Unavailable) as exc:
                span.set("error.type", exc.code)
                span.fail(exc.message)
                raise
            finally:
                span.end()
        lease.trace = trace
        return lease

    def _admit(self, priority: int, gateway: str | None) -> Lease:
        state = self.health.state
        if state is not UnitState.SERVING:
            raise Unavailable(f"unit {self.unit_id} is {state}", code=state.lower())
        capacity = self.capacity
        if self.outstanding >= capacity and not (
            self.outstanding < capacity + self.headroom
            and sum(self._by_priority[: priority + 1]) < capacity
        ):
            raise Overloaded(
                f"unit {self.unit_id} is at capacity ({capacity} outstanding requests)",
                retry_after_s=self._retry_after_s,
                code="unit_at_capacity",
            )
        if self.outstanding == self._on_client:
            self.last_progress_at = self._clock()  # the watchdog's clock starts with work
        self.outstanding += 1
        self._by_priority[priority] += 1
        if gateway is not None:
            by_gateway = self._by_gateway
            by_gateway[gateway] = by_gateway.get(gateway, 0) + 1
        self._metrics.outstanding.set(self.outstanding)
        self._changes.notify()
        return Lease(self, self._clock(), priority, gateway)

    def _release(self, priority: int, gateway: str | None = None) -> None:
        self.outstanding -= 1
        self._by_priority[priority] -= 1
        if gateway is not None:
            by_gateway = self._by_gateway
            left = by_gateway[gateway] - 1
            if left:
                by_gateway[gateway] = left
            else:
                del by_gateway[gateway]
        self._metrics.outstanding.set(self.outstanding)
        self._changes.notify()

    async def run(
        self,
        lease: Lease,
        request: EngineRequest,
        route: str,
        emit: Callable[[TokenDelta], Awaitable[None]],
        deadline: float | None = None,
        delivered_tokens: int = 0,
    ) -> TokenDelta:
        """Generate ``request``, passing each delta to ``emit``; return the last delta.

        ``deadline`` is on the event loop's clock. ``delivered_tokens``: output of a
        resumed request that another unit delivered, counted in the usage as completion
        tokens rather than prompt tokens. Always releases ``lease``.
        """
        span = NO_SPAN
        trace = lease.trace
        if trace is not None:  # the engine's own spans (vLLM's) hang under this one
            span = self._engine_span(trace, request, route)
            request = dataclasses.replace(request, trace_headers=trace.headers(span))
        try:
            await self.expect_blocks(request)
            async with self.tracked(lease, deadline):
                last = await self._generate(lease, request, route, emit, delivered_tokens)
            if trace is not None and span.recording:
                _usage(span, last)
                _usage(trace.root, last)
            return last
        except Exception as exc:
            span.fail(getattr(exc, "message", None) or type(exc).__name__)
            raise
        finally:
            span.end()
            self.finish(lease, route)

    def _engine_span(self, trace: Trace, request: EngineRequest, route: str) -> Span:
        span = trace.start("engine")
        if span.recording:
            model = request.model or self.engine.model_name
            for target in (span, trace.root):
                target.set("gen_ai.operation.name", OPERATIONS.get(route, route))
                target.set("gen_ai.request.model", model)
            span.set("gen_ai.request.max_tokens", request.sampling.max_tokens)
        return span

    async def expect_blocks(self, request: EngineRequest) -> None:
        """Before the engine gets ``request``: note which of its prompt's chunks each
        engine block covers, so that the KV cache events that follow name them."""
        if self.held is None:
            return
        try:
            text, spans = await self.engine.find_prompt_blocks(request)
        except Exception as exc:  # the prompt is not the engine's to name: nothing held
            log.debug("unit %s: prompt blocks not found: %s", self.unit_id, exc)
            return
        self.held.expect(request, text, spans)

    @asynccontextmanager
    async def tracked(self, lease: Lease, deadline: float | None) -> AsyncIterator[None]:
        """The request's deadline scope, which ``let_go`` can also end.

        A TimeoutError inside becomes the lease's failure (``UnitFailed``, the unit let
        go) or ``DeadlineExceeded``; a dead engine becomes ``UnitFailed``. Every way a
        request runs (``run``, ``relay``, an engine's own layer) runs inside one.
        """
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                self._running[lease] = scope
                try:
                    yield
                finally:
                    del self._running[lease]
        except TimeoutError as exc:
            if lease.failure is not None:
                raise lease.failure from exc
            if scope.expired():
                raise DeadlineExceeded("the request's deadline passed") from exc
            raise
        except EngineDeadError as exc:
            raise UnitFailed(f"unit {self.unit_id}: the engine died: {exc.message}") from exc

    async def _generate(
        self,
        lease: Lease,
        request: EngineRequest,
        route: str,
        emit: Callable[[TokenDelta], Awaitable[None]],
        delivered_tokens: int,
    ) -> TokenDelta:
        metrics = self._metrics
        last: TokenDelta | None = None
        previous = lease.admitted_at
        async with aclosing(self.engine.generate(request)) as deltas:
            async for delta in deltas:
                now = self._clock()
                self.last_progress_at = now
                if last is None:
                    metrics.ttft.labels(route).observe(now - previous)
                else:
                    metrics.inter_token.observe(now - previous)
                previous = now
                metrics.generated_tokens.inc(len(delta.token_ids))
                if delivered_tokens:
                    delta = _resumed(delta, delivered_tokens)
                await self._emit(emit, delta)
                last = delta
        if last is None:
            raise EngineError("the engine ended the request without output")
        return last

    @property
    def running(self) -> int:
        """Requests inside ``run``: admitted and not yet ended."""
        return len(self._running)

    def let_go(self, reason: str) -> int:
        """End every request in flight with ``UnitFailed(reason)``; return how many.

        Each is cancelled where it waits (on the engine or on its client); its
        ``run`` aborts it in the engine, raises ``UnitFailed`` and releases its lease.
        """
        loop = asyncio.get_running_loop()
        n = 0
        for lease, scope in self._running.items():
            if lease.failure is None and not scope.expired():
                lease.failure = UnitFailed(f"unit {self.unit_id} failed: {reason}")
                scope.reschedule(loop.time())
                n += 1
        return n

    async def watch_failures(self) -> None:
        """Let go of every request in flight whenever the unit is NOT_SERVING."""
        changes = self.health.state_changes
        while True:
            seen = changes.version
            if self.health.state is UnitState.NOT_SERVING and self._running:
                failed = ", ".join(self.health.failed_nodes()) or "-"
                n = self.let_go(f"NOT_SERVING (failed: {failed})")
                if n:
                    log.warning(
                        "unit %s is NOT_SERVING (failed: %s): let go of %d requests in flight",
                        self.unit_id, failed, n,
                    )  # fmt: skip
            await changes.wait(seen)

    async def _emit(self, emit: Callable[[_T], Awaitable[None]], delta: _T) -> None:
        # A client that stops reading blocks here (backpressure): that is no engine stall,
        # and must not make the watchdog take the unit out of service.
        self._on_client += 1
        try:
            await emit(delta)
        finally:
            self._on_client -= 1
        if self.outstanding - self._on_client == 1:
            self.last_progress_at = self._clock()  # back to the engine, the only one waiting

    async def relay(
        self,
        lease: Lease,
        chunks: AsyncGenerator[bytes, None],
        route: str,
        emit: Callable[[bytes], Awaitable[None]],
        deadline: float | None = None,
    ) -> None:
        """Pass an engine's own response bytes to ``emit``, as ``run`` does deltas.

        For engines that serve the OpenAI routes themselves (engine/frontend.py): each
        piece counts as progress and as a token for the latency metrics; the engine
        counts the tokens themselves. Closing ``chunks`` aborts the request in the
        engine. Always releases ``lease``.
        """
        metrics = self._metrics
        previous, first = lease.admitted_at, True
        try:
            async with self.tracked(lease, deadline), aclosing(chunks):
                async for chunk in chunks:
                    now = self._clock()
                    self.last_progress_at = now
                    if first:
                        metrics.ttft.labels(route).observe(now - previous)
                        first = False
                    else:
                        metrics.inter_token.observe(now - previous)
                    previous = now
                    await self._emit(emit, chunk)
        finally:
            self.finish(lease, route)

    def finish(self, lease: Lease, route: str) -> None:
        """Release ``lease`` and observe its duration, once."""
        if not lease.released:
            lease.release()
            self._metrics.request_duration.labels(route).observe(self._clock() - lease.admitted_at)

    async def wait_whole(self, answer: Awaitable[_T], steps: Callable[[], int | None]) -> _T:
        """Await a whole (non-streamed) answer, feeding the progress watchdog meanwhile.

        ``steps`` is the engine's step count: each change counts as progress. An engine
        that cannot tell (None) is trusted while it works: the request is left out of
        the watchdog, as one waiting on its client is.
        """
        first = steps()
        if first is None:
            self._on_client += 1
            try:
                return await answer
            finally:
                self._on_client -= 1
        task = asyncio.ensure_future(answer)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_PROGRESS_POLL_S)
                if done:
                    return task.result()
                now = steps()
                if now != first:
                    first, self.last_progress_at = now, self._clock()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})

    def count_tokens(self, generated: int) -> None:
        """Tokens an engine's own layer generated (``relay`` cannot see them)."""
        self._metrics.generated_tokens.inc(generated)

    def stalled_for(self) -> float:
        """Seconds the engine has had work and produced no token; 0 when idle."""
        if self.outstanding <= self._on_client:
            return 0.0  # idle, or every request waits on its client
        return self._clock() - self.last_progress_at

    def set_metric(self, name: str, value: float) -> None:
        """Report ``value`` under ``name`` in every load report from now on (the
        engine's ``EngineStats.named_metrics`` join them; the sidecar's win a tie);
        watchers hear of it at once. Raises ValueError past the bounds (``proxy.load``:
        MAX_NAMED_METRICS names of at most MAX_METRIC_NAME characters, finite values)."""
        if named_metrics({name: value}) != {name: value} or (
            name not in self._named and len(self._named) >= MAX_NAMED_METRICS
        ):
            raise ValueError(
                f"named metric {name[:80]!r}={value!r}: a name of 1 to {MAX_METRIC_NAME} "
                f"characters, a finite number, at most {MAX_NAMED_METRICS} names"
            )
        self._named[name] = float(value)
        self._changes.notify()

    def report(
        self, blocks_since: tuple[int, int] | None = None, watcher: str | None = None
    ) -> LoadReport:
        """The unit's report now. ``blocks_since``: the (epoch, seq) of the prefix blocks
        the reader holds, for the changes since; None: the whole set. ``watcher``: the
        name of the gateway it goes to, whose outstanding requests it counts apart."""
        self._seq += 1
        stats = self.engine.stats()
        named = joined_metrics(stats.named_metrics, self._named)
        slots = self.engine.slots()
        if slots is not None and ENGINE_SLOTS not in named and len(named) < MAX_NAMED_METRICS:
            named[ENGINE_SLOTS] = float(slots)
        headroom = self.headroom
        if headroom and len(named) <= MAX_NAMED_METRICS - 3:
            # what a gateway needs to send a higher class over capacity, as admit lets
            # it (Unit.over_capacity_for)
            named[PRIORITY_HEADROOM] = float(headroom)
            named[OUTSTANDING_BATCH] = float(self._by_priority[PRIORITY_RANK["batch"]])
            if self.resume_key is not None:
                # interactive may take standard's slots; without the secret this unit
                # grants no interactive, so a gateway counts only batch below it
                named[OUTSTANDING_STANDARD] = float(self._by_priority[STANDARD])
        held = self.held
        blocks = None
        if held is not None:
            blocks = held.full() if blocks_since is None else held.delta(*blocks_since)
        return LoadReport(
            unit_id=self.unit_id,
            state=self.health.state,
            outstanding=self.outstanding,
            capacity=self.capacity,
            running=stats.running,
            waiting=stats.waiting,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            prefix_cache_resets=stats.prefix_cache_resets,
            models=self.engine.served_models(),
            nodes=self.health.nodes(),
            seq=self._seq,
            timestamp_ms=int(time.time() * 1000),
            http_url=self.http_url,
            grpc_target=self.grpc_target,
            named_metrics=named,
            prefix_blocks=blocks,
            watcher_outstanding=-1 if watcher is None else self._by_gateway.get(watcher, 0),
        )


def _resumed(delta: TokenDelta, delivered: int) -> TokenDelta:
    # The delivered output is in this request's prompt; the client counts it as output.
    return TokenDelta(
        delta.text,
        delta.token_ids,
        delta.prompt_tokens - delivered,
        delta.completion_tokens + delivered,
        delta.finish_reason,
    )


# gen_ai.operation.name of a route (OpenTelemetry GenAI semantic conventions).
OPERATIONS = {"chat": "chat", "completions": "text_completion", "grpc_generate": "text_completion"}


def _usage(span: Span, last: TokenDelta) -> None:
    span.set("gen_ai.usage.input_tokens", last.prompt_tokens)
    span.set("gen_ai.usage.output_tokens", last.completion_tokens)
    if last.finish_reason is not None:
        span.set("gen_ai.response.finish_reasons", [last.finish_reason])

"""Inference.Generate through the gateway: the gRPC wire of ``core.GatewayCore``.

The gateway registers a generic handler for the method with no (de)serializers and
calls units on their HTTP port in the gRPC-Web framing (``proxy.grpcweb``: a socket
read per batch of messages instead of a grpc.aio read per message), or over gRPC where
a unit does not serve that (or ``gateway.grpc_unit_wire`` is grpc), so each chunk is
forwarded as the bytes the unit sent; messages that arrive while a write to the client
is in flight are decoded only to be merged into the next one (``proxy.coalesce``).
Every message that went toward the client is kept (``resume.GrpcTranscript``) in case
its unit fails.

A client that takes no message for ``server.write_timeout_s`` (a write to it waits that
long on HTTP/2 flow control: its window is full, gRPC's equivalent of a full socket
buffer) is given up on as one that went away: its unit's stream is cancelled, which
frees the unit's slot, and its status (DEADLINE_EXCEEDED, code write_timeout) waits
behind the messages it has yet to read. What the gateway holds for such a client stays bounded: the
writer's queue pauses the unit stream at ``coalesce.DEFAULT_LIMIT`` messages, and the
unit's own stream is flow controlled in turn.

An attempt ends as on HTTP: RESOURCE_EXHAUSTED, or UNAVAILABLE before the first
message (the unit's refusal or no connection), is a RETRY; UNAVAILABLE after it, or a
unit silent for ``stream_idle_timeout_s``, is a MIGRATE (the request goes on elsewhere
with the output so far appended to its input); any other status ends the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from proxy import grpcweb
from proxy.auth import ApiKeys
from proxy.coalesce import Coalescer
from proxy.errors import (
    GRPC_CODE_KEY,
    DeadlineExceeded,
    RequestTimeout,
    Unavailable,
    UnitProxyError,
    write_timeout,
)
from proxy.gate import Gate
from proxy.gateway.core import (
    DONE_OK,
    ERROR_CLASSES,
    NOT_TAKING_WORK,
    UNIT_FAILED,
    GatewayCore,
    Next,
    Tried,
    UnitTimeout,
    deadline_passed,
    error_code,
    per_token,
    send_deadline,
    shutting_down,
    unit_error,
)
from proxy.gateway.http1.pool import Broken, ConnectFailed, Dropped, Pool, UnitConnection
from proxy.gateway.request import Context, grpc_context, unit_fields
from proxy.gateway.resume import GrpcTranscript, resume_generate
from proxy.gateway.router import Outcome
from proxy.gateway.tenancy import Admission, TenantGate, Usage
from proxy.gateway.traces import RequestTrace
from proxy.gateway.units import Unit
from proxy.httputil import NO_UNIT, REQUEST_ID_HEADER, RESUME_HEADER, UNIT_HEADER
from proxy.metrics import GatewayMetrics
from proxy.pb.unitproxy.v1.inference_pb2 import GenerateChunk, GenerateRequest
from proxy.ratelimit import RateLimited
from proxy.resume import HintKey
from proxy.settings import GatewaySettings
from proxy.timers import Deadline, Timer, Wheel
from proxy.tracing import Tracer

log = logging.getLogger(__name__)

SERVICE = "unitproxy.v1.Inference"
METHOD = f"/{SERVICE}/Generate"
ROUTE = "grpc_generate"
FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
ERROR_OF_CODE = {cls.grpc_code: cls for cls in reversed(ERROR_CLASSES)}

UnaryStream = Callable[..., Any]  # grpc.aio.UnaryStreamMultiCallable, bytes in and out
POST = b"POST"
MAX_SHARED_INTERVAL_MS = 50.0  # a share of the message rate never spaces a stream wider


def stream_interval_ms(floor_ms: float, messages_per_s: float, streams: int) -> float:
    """The spacing of a stream's messages when ``streams`` are in flight (itself
    included): its share of ``messages_per_s``, at least ``floor_ms`` and at most
    ``MAX_SHARED_INTERVAL_MS`` (``floor_ms`` itself may be above that)."""
    if messages_per_s <= 0:
        return floor_ms
    share_ms = min(streams * 1000 / messages_per_s, MAX_SHARED_INTERVAL_MS)
    return max(floor_ms, share_ms)


def merge_chunks(messages: Sequence[bytes]) -> bytes:
    """Consecutive serialized GenerateChunks of one stream as one."""
    chunks = [GenerateChunk.FromString(m) for m in messages]
    merged = GenerateChunk()
    for chunk in chunks:
        merged.MergeFrom(chunk)  # token_ids append; finish_reason, usage: the last set
    merged.text = "".join(c.text for c in chunks)
    data: bytes = merged.SerializeToString()
    return data


class GenerateProxy:
    def __init__(
        self,
        core: GatewayCore,
        settings: GatewaySettings,
        call_for: Callable[[Unit], UnaryStream],
        metrics: GatewayMetrics,
        gate: Gate,
        wheel: Wheel,
        api_keys: ApiKeys | None = None,
        unit_key: str | None = None,
        pool_for: Callable[[Unit], Pool | None] | None = None,
        tenancy: TenantGate | None = None,
        write_timeout_s: float = 60.0,
        resume_key: HintKey | None = None,
        tracer: Tracer | None = None,
    ):
        self.core = core
        self.tracer = tracer
        self.settings = settings
        self.write_timeout_s = write_timeout_s
        self.resume_key = resume_key  # None: no migration after the first byte
        self.call_for = call_for
        self.wheel = wheel
        self.metrics = metrics.serving
        self.gateway_metrics = metrics
        self._gate = gate
        self._api_keys = api_keys or ApiKeys()
        self.unit_auth = None if unit_key is None else f"Bearer {unit_key}"
        # Units are called on their HTTP port (proxy.grpcweb) where there is a pool,
        # except those found not to serve it (an older sidecar): gRPC for them.
        self.pool_for = pool_for if settings.grpc_unit_wire == "http" else None
        self.grpc_only: set[str] = set()
        self.streams = 0  # Generate calls in flight, which share grpc_messages_per_s
        self.tenancy = tenancy

    def interval(self) -> str:
        """The ``grpcweb.INTERVAL_HEADER`` of a stream that starts now."""
        settings = self.settings
        ms = stream_interval_ms(
            settings.grpc_interval_ms, settings.grpc_messages_per_s, self.streams
        )
        return f"{ms:.4g}"

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.unary_stream_rpc_method_handler(
            self.generate, request_deserializer=None, response_serializer=None
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Generate": method})

    async def generate(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        started = time.monotonic()
        ctx = grpc_context(context.invocation_metadata(), ROUTE, METHOD, context.time_remaining())
        code = "OK"
        try:
            if self.tenancy is not None:
                ctx.admission = await admit(self.tenancy, request, ctx, context)
            else:
                self._api_keys.check(ctx.authorization)
            self._gate.enter()
        except UnitProxyError as exc:
            self.metrics.requests.labels(ROUTE, exc.grpc_code.name).inc()
            if ctx.admission is not None:
                ctx.admission.finish(exc.grpc_code.name)
            await context.abort(
                exc.grpc_code, exc.message, refusal_metadata(exc, ctx.request_id, ctx.admission)
            )
        admission = ctx.admission
        tracer = self.tracer
        if tracer is not None:
            name = METHOD.lstrip("/")
            ctx.trace = RequestTrace(tracer.start(ctx.traceparent, ctx.tracestate, name))
        trace = ctx.trace
        job = GrpcJob(self, ctx, request, context, started)
        self.streams += 1
        error: UnitProxyError | None = None
        try:
            try:
                want = self.core.grpc_want(ctx, request)
                if trace is not None and trace.sampled:
                    trace.describe(ROUTE, want.model or request_model(request), ctx.request_id)
                await self.core.run(job, want, trace)
                await job.finish()
            except UnitProxyError as exc:
                error = exc
                await job.flush()  # what the units sent before the error, then the status
        except asyncio.CancelledError:
            if not job.stalled:
                code = "CANCELLED"
                raise
            error = job.stall_error()
        finally:
            if error is not None:
                code = error.grpc_code.name
            self.streams -= 1
            job.close()
            self._gate.exit()
            self.metrics.requests.labels(ROUTE, code).inc()
            self.metrics.request_duration.labels(ROUTE).observe(time.monotonic() - started)
            if admission is not None:
                job.measure(admission)
                admission.finish(code)  # settles its tokens, whatever ended it
            if trace is not None:
                if trace.sampled:
                    job.used(trace)
                trace.finish(code, None if error is None else error.message)
        if error is not None:
            # After a stall the status waits behind the messages the client has yet to
            # read: it gets them, then the status, if it ever reads again.
            own = ((REQUEST_ID_HEADER, ctx.request_id), (UNIT_HEADER, job.unit_id))
            limits = () if admission is None else tuple(admission.header_pairs())
            await context.abort(
                error.grpc_code, error.message, ((GRPC_CODE_KEY, error.code), *own, *limits)
            )


class GrpcJob:
    """One Generate call, across the units it is tried on."""

    def __init__(
        self,
        proxy: GenerateProxy,
        ctx: Context,
        request: bytes,
        context: grpc.aio.ServicerContext,
        started: float,
    ):
        self._proxy = proxy
        self._admission = ctx.admission
        self._context = context
        self._started = started
        self._request = request
        self._next: tuple[bytes, str | None] | None = (request, None)
        self._migrate = ctx.migrate
        self._ctx = ctx
        self.trace: RequestTrace | None = ctx.trace
        self._deadline = ctx.deadline(started, proxy.settings.request_timeout_s)
        self.unit_id = NO_UNIT  # the unit tried last
        self._loop = asyncio.get_running_loop()
        self._out = Coalescer(context.write, merge_chunks)
        self._transcript = GrpcTranscript()
        self._sent = False  # a message went toward the client
        self._call: Any = None
        self._conn: UnitConnection | None = None
        self._bad: str | None = None  # what was wrong with a unit's frames
        self._failed_at: float | None = None
        self._last = 0.0
        self._putting = False
        self._received = False  # a message of this attempt's unit came
        self._asked_at = 0.0  # when this attempt was sent (loop time)
        self._first_s = -1.0  # from then to its first message (s; -1: none yet)
        # Policy latency: the attempt's messages are counted (time per token).
        self._learns = proxy.core.learns
        self._messages = 0
        self._last_message = 0.0  # when the last came (loop time)
        self._lost: str | None = None  # why the gateway stopped routing to its unit
        self._scope: Deadline | None = None  # the HTTP attempt's deadline, while it runs
        self._watch: Timer | None = None
        self._idle = False
        self._stopping = False
        self.stalled = False  # the client took no message for write_timeout_s
        self._task = asyncio.current_task(self._loop)  # the loop given: no lookup of it
        self._writes: Timer | None = proxy.wheel.call_at(
            self._loop.time() + proxy.write_timeout_s, self._check_writes
        )

    # -- core.Job ------------------------------------------------------------------------

    @property
    def migratable(self) -> bool:
        return self._migrate and not self._stopping and self._next is not None

    def unanswered_s(self) -> float:
        return 0.0 if self._received else self._loop.time() - self._asked_at

    def first_token_s(self) -> float:
        return self._first_s

    def per_token_s(self) -> float:
        last = self._last_message - self._asked_at
        return per_token(self._first_s, last, self._messages)

    def abandon(self, why: str) -> bool:
        if self._lost is not None or self._stopping:
            return False
        call, conn, scope = self._call, self._conn, self._scope
        if call is None and conn is None and scope is None:
            return False
        self._lost = why
        if call is not None:
            call.cancel()
        elif conn is not None:
            conn.close()
        elif scope is not None:
            scope.reschedule(self._loop.time())  # no head yet: stop waiting for it
        return True

    def interrupt(self) -> None:
        self._stopping = True
        if self._call is not None:
            self._call.cancel()
        if self._conn is not None:
            self._conn.close()

    async def give_up(self, last: Tried) -> None:
        error = last.error or Unavailable("no unit could serve the request")
        if self._sent:
            log.warning("request: %s", error.message)
        raise error

    async def finish(self) -> None:
        await self._out.close()

    async def flush(self) -> None:
        # A client that is gone gets no more messages: the status is all that is left.
        with contextlib.suppress(grpc.aio.AioRpcError, RuntimeError):
            await self._out.close()

    def close(self) -> None:
        self._out.cancel()
        self._unwatch()
        if self._writes is not None:
            self._proxy.wheel.cancel(self._writes)
            self._writes = None

    def measure(self, usage: Usage) -> None:
        """What the call used, as far as the client got it (tenants' accounting)."""
        transcript = self._transcript
        reported = transcript.last_usage()
        if reported is not None:
            usage.read_usage({"prompt_tokens": reported[0], "completion_tokens": reported[1]})
        else:
            completion = transcript.output_tokens()
            if completion:
                usage.completion = completion

    def used(self, trace: RequestTrace) -> None:
        """What the call used, as its unit's last chunk reported it, and why it ended
        (a sampled call's span)."""
        reported, reason = self._transcript.ending()
        prompt, completion = (-1, -1) if reported is None else reported
        trace.used(prompt, completion, [reason] if reason else [])

    async def attempt(self, unit: Unit) -> Tried:
        assert self._next is not None
        self._reset_lost()
        self.unit_id = unit.id
        request, hint = self._next
        admission = self._admission
        if admission is not None:
            admission.attempt(unit.id)
        pool_for = self._proxy.pool_for
        if pool_for is not None and unit.id not in self._proxy.grpc_only:
            pool = pool_for(unit)
            if pool is not None:
                tried = await self._attempt_http(unit, pool, request, hint)
                if tried is not None:
                    return tried
        return await self._attempt_grpc(unit, request, hint)

    def _fields(self) -> dict[str, str]:
        """What an attempt sends the unit: the client's metadata by HTTP's rule, less
        what gRPC reserves, and the gateway's own (``request.unit_fields``)."""
        proxy = self._proxy
        return unit_fields(self._ctx, proxy.unit_auth, proxy.resume_key, proxy.core.name, grpc=True)

    async def _attempt_grpc(self, unit: Unit, request: bytes, hint: str | None) -> Tried:
        fields = self._fields()
        if hint is not None:
            fields[RESUME_HEADER] = hint
        metadata = tuple(fields.items())
        timeout = None
        if self._deadline is not None:
            timeout = self._deadline - time.monotonic()
            if timeout <= 0.001:
                return Tried(Next.DONE, Outcome.CANCELLED, error=deadline_passed())
        call = self._call = self._proxy.call_for(unit)(request, timeout=timeout, metadata=metadata)
        received = self._received = False
        self._asked_at = self._loop.time()
        self._first_s = -1.0
        self._messages = 0
        self._idle = False
        self._watch_idle(self._proxy.settings.response_timeout_s)
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                if not received:
                    received = self._received = True
                    self._unwatch()
                    self._watch_idle(self._proxy.settings.stream_idle_timeout_s)
                await self._deliver(message)
            return DONE_OK
        except grpc.aio.AioRpcError as exc:
            return self._ended(unit, exc.code(), _error_of(exc, unit), _trailer_code(exc), received)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the client went away
            return self._silent(unit, received)  # our own watchdog cancelled the call
        finally:
            self._unwatch()
            self._call = None
            call.cancel()

    async def _attempt_http(
        self, unit: Unit, pool: Pool, request: bytes, hint: str | None
    ) -> Tried | None:
        """The call over the unit's HTTP port; None: the unit does not serve it there."""
        settings = self._proxy.settings
        headers = self._fields()
        headers["content-type"] = grpcweb.CONTENT_TYPE
        headers[grpcweb.INTERVAL_HEADER] = self._proxy.interval()
        if hint is not None:
            headers[RESUME_HEADER] = hint
        now = self._asked_at = self._loop.time()
        self._first_s = -1.0
        self._messages = 0
        try:
            left = send_deadline(headers, self._deadline)
        except DeadlineExceeded as late:
            return Tried(Next.DONE, Outcome.CANCELLED, error=late)
        end = None if left is None else now + left
        head_by = now + settings.response_timeout_s
        frames = grpcweb.Frames()
        self._received = False
        self._idle, self._bad = False, None
        conn: UnitConnection | None = None
        try:
            async with Deadline(
                self._proxy.wheel, head_by if end is None else min(head_by, end)
            ) as scope:
                self._scope = scope
                try:
                    conn = await pool.request(POST, grpcweb.PATH, headers, grpcweb.frame(request))
                except ConnectFailed as failed:
                    return self._unreachable(unit, failed)
                scope.reschedule(end)
                if conn.status != 200 or not conn.headers.get("content-type", "").startswith(
                    grpcweb.CONTENT_TYPE
                ):
                    return await self._http_answer(unit, conn)
                self._conn = conn
                self._watch_idle(settings.stream_idle_timeout_s)
                await conn.splice(self._sink(conn, frames))
        except TimeoutError:
            if self._stopping:
                return Tried(Next.DONE, Outcome.OK, error=shutting_down())
            if self._lost is not None:
                return self._failed(unit, "unit_lost", "")
            if conn is None and (end is None or head_by < end):
                return self._silent(unit, False)
            return Tried(Next.DONE, Outcome.CANCELLED, error=deadline_passed())
        except Broken as exc:
            return await self._broken(unit, str(exc))
        finally:
            self._unwatch()
            self._conn = self._scope = None
            if conn is not None:
                conn.done()  # kept for reuse only when its response was read to the end
        status = frames.status
        if status is None:
            return await self._broken(unit, "the stream ended without a status")
        if status.code is grpc.StatusCode.OK:
            return DONE_OK
        error = _status_error(status, unit)
        return self._ended(unit, status.code, error, status.error_code, self._received)

    async def _http_answer(self, unit: Unit, conn: UnitConnection) -> Tried | None:
        """A plain HTTP answer (an error before the call began)."""
        data = await conn.read()
        if conn.status == 404 and not error_code(data):
            # No such route: a unit that predates it. Over gRPC from now on.
            log.info("unit %s: no gRPC-Web route; calling it over gRPC", unit.id)
            self._proxy.grpc_only.add(unit.id)
            return None
        error = unit_error(conn.status, data, unit)
        return self._ended(unit, error.grpc_code, error, error_code(data), False)

    def _unreachable(self, unit: Unit, exc: ConnectFailed) -> Tried:
        if self._stopping:
            return Tried(Next.DONE, Outcome.OK, error=shutting_down())
        if isinstance(exc, Dropped):  # it had the call: a failure under it, not a refusal
            return self._failed(unit, "broken", f"unit {unit.id} dropped the call: {exc}")
        log.info("unit %s: %s", unit.id, exc)
        error = Unavailable(f"unit {unit.id} could not be reached")
        return Tried(Next.RETRY, Outcome.FAILED, "connect", error)

    async def _broken(self, unit: Unit, why: str) -> Tried:
        if self._out.stopped:
            await self._out.close()  # the client is gone: its error ends the call
        if self._stopping:
            return Tried(Next.DONE, Outcome.OK, error=shutting_down())
        if self._lost is not None:
            return self._failed(unit, "unit_lost", "")
        if self._idle:
            return self._silent(unit, self._received)
        why = self._bad or why
        return self._failed(unit, "broken", f"unit {unit.id} broke the stream: {why}")

    def _sink(self, conn: UnitConnection, frames: grpcweb.Frames) -> Callable[[bytes], None]:
        """What takes the unit's body in the connection's callback: each message to the
        client's writer, which merges those that wait on a write."""
        offer = self._out.offer

        def sink(data: bytes) -> None:
            try:
                messages = frames.feed(data)
            except grpcweb.FrameError as exc:
                self._bad = str(exc)
                conn.close()
                return
            for message in messages:
                self._delivered(message)
                offer(message, conn)
            if messages:
                self._last = self._loop.time()

        return sink

    def _delivered(self, message: bytes) -> None:
        if self._first_s < 0.0:
            self._first_s = self._loop.time() - self._asked_at
        if self._learns:
            self._messages += 1
            self._last_message = self._loop.time()
        if not self._sent:
            self._sent = True
            self._proxy.metrics.ttft.labels(ROUTE).observe(time.monotonic() - self._started)
            self._first_byte()
        if not self._received:
            self._received = True
        if self._failed_at is not None:
            pause = time.monotonic() - self._failed_at
            self._proxy.gateway_metrics.migration_pause.observe(pause)
            self._failed_at = None
        self._transcript.add(message)

    async def _deliver(self, message: bytes) -> None:
        if self._first_s < 0.0:
            self._first_s = self._loop.time() - self._asked_at
        if self._learns:
            self._messages += 1
            self._last_message = self._loop.time()
        if not self._sent:
            self._sent = True
            self._proxy.metrics.ttft.labels(ROUTE).observe(time.monotonic() - self._started)
            self._first_byte()
        if self._failed_at is not None:
            pause = time.monotonic() - self._failed_at
            self._proxy.gateway_metrics.migration_pause.observe(pause)
            self._failed_at = None
        self._transcript.add(message)
        self._putting = True
        try:
            await self._out.put(message)
        finally:
            self._putting = False
            self._last = self._loop.time()

    # -- how an attempt ended ------------------------------------------------------------

    def _ended(
        self,
        unit: Unit,
        code: grpc.StatusCode,
        error: UnitProxyError,
        why: str | None,
        received: bool,
    ) -> Tried:
        """The unit's status ``code`` (``why``: its error code) ended the attempt."""
        if self._stopping:
            return Tried(Next.DONE, Outcome.OK, error=shutting_down())
        if self._lost is not None:  # the gateway cancelled the call: abandon()
            return self._failed(unit, "unit_lost", "")
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return Tried(Next.DONE, Outcome.CANCELLED, error=deadline_passed())
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and not received:
            return Tried(Next.RETRY, Outcome.REFUSED, "resource_exhausted", error)
        if code is grpc.StatusCode.UNAVAILABLE:
            if why in UNIT_FAILED or received:
                return self._failed(unit, "unit_failed", error.message)
            health = Outcome.REFUSED if why in NOT_TAKING_WORK else Outcome.FAILED
            return Tried(Next.RETRY, health, "unavailable", error)
        return Tried(Next.DONE, Outcome.FAILED if code in FAILURES else Outcome.OK, error=error)

    def _silent(self, unit: Unit, received: bool) -> Tried:
        if self._stopping:
            return Tried(Next.DONE, Outcome.OK, error=shutting_down())
        if self._lost is not None:  # the gateway cancelled the call: abandon()
            return self._failed(unit, "unit_lost", "")
        if not received:
            limit = self._proxy.settings.response_timeout_s
            message = f"unit {unit.id} sent no response within {limit:g} s"
            log.warning("%s", message)
            return Tried(Next.DONE, Outcome.FAILED, error=UnitTimeout(message))
        idle = self._proxy.settings.stream_idle_timeout_s
        return self._failed(unit, "idle", f"unit {unit.id} sent nothing for {idle:g} s")

    def _failed(self, unit: Unit, reason: str, message: str) -> Tried:
        health = Outcome.FAILED
        if self._lost is not None:  # the router's verdict, not something this one saw
            reason, health = "unit_lost", Outcome.CANCELLED
            message = f"unit {unit.id} is {self._lost}: the request goes on elsewhere"
        log.warning("%s", message)
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        self._next = self._continuation()
        return Tried(Next.MIGRATE, health, reason, Unavailable(message, code="unit_failed"))

    def _reset_lost(self) -> None:
        # A method: see forward.HttpJob._reset_events (mypyc and narrowing across awaits).
        self._lost = None

    def _continuation(self) -> tuple[bytes, str | None] | None:
        if not self._sent:
            return self._request, None
        key = self._proxy.resume_key
        if key is None:
            return None
        self._transcript.text()
        if self._transcript.finished:
            return None
        return resume_generate(self._request, self._transcript, key)

    # -- silence ---------------------------------------------------------------------------

    def _watch_idle(self, limit_s: float) -> None:
        self._last = self._loop.time()
        self._watch = self._proxy.wheel.call_at(self._last + limit_s, lambda: self._check(limit_s))

    def _check(self, limit_s: float) -> None:
        self._watch = None
        call, conn = self._call, self._conn
        if call is None and conn is None:
            return
        now = self._loop.time()
        if self._putting or (conn is not None and conn.paused):
            self._last = now  # the client is not reading: the unit is not silent
        due = self._last + limit_s
        if due > now:
            self._watch = self._proxy.wheel.call_at(due, lambda: self._check(limit_s))
            return
        self._idle = True
        if call is not None:
            call.cancel()
        if conn is not None:
            conn.close()

    def _check_writes(self) -> None:
        """A client whose write has waited ``write_timeout_s`` is not reading: its task
        is cancelled, as grpc.aio does when a client leaves, and ``generate`` ends the
        call with ``stall_error``."""
        self._writes = None
        limit = self._proxy.write_timeout_s
        since, now = self._out.writing_since, self._loop.time()
        if since and now - since >= limit and self._task is not None:
            self.stalled = True
            self._task.cancel()
            return
        due = (since or now) + limit
        self._writes = self._proxy.wheel.call_at(due, self._check_writes)

    def stall_error(self) -> RequestTimeout:
        """The error of a stalled client, with its task's cancellation taken back."""
        if self._task is not None:
            self._task.uncancel()
        limit = self._proxy.write_timeout_s
        log.info("a gRPC client took no message for %g s (server.write_timeout_s)", limit)
        return write_timeout(limit)

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._proxy.wheel.cancel(self._watch)
            self._watch = None

    def _first_byte(self) -> None:
        admission = self._admission
        if admission is not None:
            admission.first_byte = time.monotonic()


async def admit(
    tenancy: TenantGate, request: bytes, ctx: Context, context: grpc.aio.ServicerContext
) -> Admission:
    """The tenant's admission of a call; a limited tenant's x-ratelimit-* go out as
    trailing metadata, with the call's status (as ORCA's per-call load reports do):
    initial metadata would be a batch of its own ahead of the first message, which
    grpc.aio sends with empty metadata (about 60,000 instructions and a write a call)."""
    got = tenancy.try_admit_grpc(request, ctx.authorization, ctx.priority)
    admission = got if isinstance(got, Admission) else await got.admitted()  # Redis says
    pairs = admission.header_pairs()
    if pairs:
        context.set_trailing_metadata(tuple(pairs))
    return admission


def refusal_metadata(
    exc: UnitProxyError, request_id: str, admission: Admission | None = None
) -> tuple[tuple[str, str], ...]:
    """Trailing metadata of a call refused before a unit was chosen: the request id and
    no unit, and a rate limit's headers and retry-after (or the x-ratelimit-* of the
    tenant it was admitted for)."""
    own = ((REQUEST_ID_HEADER, request_id), (UNIT_HEADER, NO_UNIT))
    if isinstance(exc, RateLimited):
        return ((GRPC_CODE_KEY, exc.code), ("retry-after", str(exc.retry_after_s)),
                *exc.headers.items(), *own)  # fmt: skip
    if admission is not None:
        return (*own, *admission.header_pairs())
    return own


def _trailer_code(exc: grpc.aio.AioRpcError) -> str | None:
    for key, value in exc.trailing_metadata() or ():
        if key == GRPC_CODE_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def _error_of(exc: grpc.aio.AioRpcError, unit: Unit) -> UnitProxyError:
    """The unit's status as an error of ours. Its details reach the client only when the
    unit's sidecar wrote them (they carry its code); grpc-core's own (a connection
    refused or reset) name addresses, so the unit is named by its id instead."""
    cls = ERROR_OF_CODE.get(exc.code(), UnitProxyError)
    code = _trailer_code(exc)
    if code is None:
        return cls(f"unit {unit.id} failed: {exc.code().name}")
    return cls(exc.details() or exc.code().name, code=code)


def _status_error(status: grpcweb.Status, unit: Unit) -> UnitProxyError:
    """The status a unit's trailers gave, as ``_error_of`` reads a gRPC status."""
    cls = ERROR_OF_CODE.get(status.code, UnitProxyError)
    if status.error_code is None:
        return cls(f"unit {unit.id} failed: {status.code.name}")
    return cls(status.message or status.code.name, code=status.error_code)


def request_model(request: bytes) -> str | None:
    """The model of a serialized GenerateRequest (for a sampled request's span)."""
    try:
        return GenerateRequest.FromString(request).model or None
    except Exception:  # protobuf's DecodeError; the unit answers INVALID_ARGUMENT
        return None

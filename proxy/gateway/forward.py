"""One HTTP inference request through the gateway: the HTTP wire of ``core.GatewayCore``.

An attempt sends the request (or its continuation) to a unit and says how it ended:

- not taken (429, a 503 whose code says the unit is not taking work, no connection):
  RETRY;
- the unit answered: a whole body goes to the client as it came; SSE events are passed
  through as they come, never re-encoded, and kept (``resume.SseTranscript``) in case
  the unit fails: DONE;
- the unit failed under the request (connection lost once the request went out, its
  ``unit_failed`` error event or 503, no byte for ``stream_idle_timeout_s``), or the
  gateway stopped routing to it (``abandon``): MIGRATE. The next attempt sends the
  request with what the client already got appended, and that unit's events follow on
  in the same response;
- anything else ends the client's response: an error before the response started is a
  plain error response, after it one SSE error event (never a silent cut).

Only whole events are written to the client, so a stream can be continued at any point.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from proxy import openai_api
from proxy.errors import DeadlineExceeded, Unavailable
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
from proxy.gateway.http1.front import Producer
from proxy.gateway.http1.pool import Broken, ConnectFailed, Dropped, Pool, UnitConnection
from proxy.gateway.request import Context, Want, own_lines, unit_fields
from proxy.gateway.resume import SseTranscript, resume_body, resume_hint
from proxy.gateway.router import Outcome
from proxy.gateway.tenancy import COMMENT_TAIL, Usage
from proxy.gateway.traces import body_model, finish_reasons
from proxy.gateway.units import Unit
from proxy.httputil import (
    NO_UNIT,
    REQUEST_ID_HEADER,
    RESUME_HEADER,
    UNIT_HEADER,
    error_parts,
)
from proxy.metrics import GatewayMetrics, LoopBuckets
from proxy.resume import HintKey
from proxy.settings import GatewaySettings
from proxy.timers import Deadline, Timer, Wheel

log = logging.getLogger(__name__)

PASSED_HEADERS = (("content-type", "Content-Type"), ("retry-after", "Retry-After"))
# The routes whose streams a unit that fails can continue (their SSE carries the text);
# a stream of another route (the Responses API's events, with their ids and sequence
# numbers) ends with an error event instead. Before the first byte every route retries.
RESUMABLE = frozenset({"completions", "chat"})
ERROR_EVENT = b'data: {"error"'
MAX_PARTIAL_EVENT = 1024 * 1024  # an "event" longer than this is passed on unsplit
DONE_EVENT = b"data: [DONE]\n\n"

# The status an error event stands for, by its type (the requests metric counts it).
STATUS_OF_TYPE = {cls.error_type: cls.http_status for cls in ERROR_CLASSES}


class Downstream(Protocol):
    """Where the client's response goes: the gateway's own HTTP/1.1 path or aiohttp."""

    status: int

    @property
    def started(self) -> bool:
        """Some of a streamed response went out: it can only be continued, not replaced."""

    def respond(self, status: int, headers: dict[str, str], body: bytes, lines: str = "") -> None:
        """The whole response at once. ``lines``: more of its head, as written
        (``name: value\\r\\n`` each: a limited tenant's x-ratelimit-*)."""

    async def start(self, status: int, headers: dict[str, str], lines: str = "") -> None:
        """A streamed response: its head goes out with the first ``write``."""

    async def write(self, data: bytes) -> None:
        """Raises ClientGone when the client closed the connection."""

    async def end(self) -> None: ...

    def splice_writer(self, producer: Producer) -> Callable[[bytes], None] | None:
        """A synchronous writer for chunks as they arrive, or None where writes must be
        awaited."""


class Forwarder:
    """What every HTTP job shares: the core, the unit pools, metrics and timers."""

    def __init__(
        self,
        core: GatewayCore,
        settings: GatewaySettings,
        pools: dict[str, Pool],
        metrics: GatewayMetrics,
        gate: Gate,
        wheel: Wheel,
        unit_key: str | None = None,
        routes: tuple[str, ...] = ("completions", "chat"),  # the route labels it serves
        resume_key: HintKey | None = None,
    ):
        self.core = core
        self.settings = settings
        self.resume_key = resume_key  # None: no migration after the first byte
        self.pools = pools
        self.wheel = wheel
        self.gateway_metrics = metrics
        self._gate = gate
        self._unit_auth = None if unit_key is None else f"Bearer {unit_key}"
        self.ttft: dict[str, LoopBuckets] = {
            route: metrics.serving.ttft.labels(route) for route in routes
        }
        self._duration: dict[str, LoopBuckets] = {
            route: metrics.serving.request_duration.labels(route) for route in routes
        }

    async def handle(
        self, down: Downstream, ctx: Context, body: bytes, want: Want | None = None
    ) -> int:
        """Answer the request of ``ctx`` and ``body`` through ``down``; return the status
        the request counts as. ``want``: what routes it, when its body is not JSON (a
        form's model field).

        Raises UnitProxyError when no unit could be tried and nothing was sent."""
        started = time.monotonic()
        if want is None:
            want = self.core.json_want(ctx, body)
        if ctx.stored is not None:
            want = ctx.want = self.core.pin(want, ctx.stored, None)
        elif ctx.route == "responses":
            previous = previous_response_id(body)
            if previous is not None:
                want = ctx.want = self.core.pin(want, previous, "previous_response_id")
        job = HttpJob(self, down, ctx, body, started)
        trace = ctx.trace
        if trace is not None and trace.sampled:
            trace.describe(ctx.route, want.model or body_model(body), ctx.request_id)
        self._gate.enter()
        try:
            await self.core.run(job, want, trace)
            return job.status or down.status
        finally:
            self._gate.exit()
            self._duration[ctx.route].observe(time.monotonic() - started)
            if ctx.admission is not None:
                job.measure(ctx.admission)
            usage = job.usage
            if job.reasons is not None and trace is not None and usage is not None:  # sampled
                reported = usage.reported
                trace.used(usage.prompt if reported else -1,
                           usage.completion if reported else -1, job.reasons)  # fmt: skip

    def unit_headers(self, ctx: Context) -> dict[str, str]:
        """The fields of an attempt's head: ``request.unit_fields`` (the client's
        end-to-end headers and the gateway's own, less the class: ``own_lines``), and a
        JSON content type where the client named none."""
        headers = unit_fields(ctx, self._unit_auth, self.resume_key, self.core.name,
                              class_field=False)  # fmt: skip
        if "content-type" not in headers:
            headers["content-type"] = "application/json"
        return headers


class HttpJob:
    """One client request over HTTP, across the units it is tried on."""

    def __init__(self, fw: Forwarder, down: Downstream, ctx: Context, body: bytes, started: float):
        self._fw = fw
        self._down = down
        self._ctx = ctx
        self._body = body
        self._started = started
        self._deadline = ctx.deadline(started, fw.settings.request_timeout_s)
        self._loop = fw.wheel.loop  # not get_running_loop(): a getpid() system call each
        self.status = 0  # set when the requests metric must not count down.status
        self._next: tuple[bytes, str | None] | None = (body, None)  # body, resume hint
        self._transcript: SseTranscript | None = None
        self._conn: UnitConnection | None = None
        self._tail = b""  # the start of an event whose end has not come yet
        self._unit_error: bytes | None = None  # an error event the unit ended with
        self._failed_at: float | None = None  # a unit failed; the next one's byte not yet out
        self._last_byte = 0.0
        self._watch: Timer | None = None
        self._idle = False
        self._stopping = False
        self._asked_at = 0.0  # when the current attempt was sent (loop time)
        self._first_s = -1.0  # from then to its first token (s; -1: none yet)
        # Policy latency: the attempt's stream events are counted (time per token).
        self._learns = fw.core.learns
        self._events = 0
        self._answered = False  # its unit's response head came
        self._lost: str | None = None  # why the gateway stopped routing to its unit
        self._scope: Deadline | None = None  # the attempt's deadline, while it runs
        self._unit_id = NO_UNIT  # the unit tried last
        # What the request used (the tenant's, or a sampled request's for its span; None:
        # neither, nothing read), and why its choices ended (a sampled request's only).
        sampled = ctx.trace is not None and ctx.trace.sampled
        admission = ctx.admission
        self.usage: Usage | None = (
            admission if admission is not None else Usage() if sampled else None
        )
        self.reasons: list[str] | None = [] if sampled else None

    # -- core.Job ------------------------------------------------------------------------

    @property
    def migratable(self) -> bool:
        return self._ctx.migrate and not self._stopping and self._next is not None

    def unanswered_s(self) -> float:
        return 0.0 if self._answered else self._loop.time() - self._asked_at

    def first_token_s(self) -> float:
        return self._first_s

    def per_token_s(self) -> float:
        return per_token(self._first_s, self._last_byte - self._asked_at, self._events)

    def abandon(self, why: str) -> bool:
        if self._lost is not None or self._stopping:
            return False
        conn, scope = self._conn, self._scope
        if conn is None and scope is None:
            return False
        self._lost = why
        if conn is not None:
            conn.close()  # the answer breaks off: _failed migrates it
        elif scope is not None:
            scope.reschedule(self._loop.time())  # no head yet: stop waiting for it
        return True

    def interrupt(self) -> None:
        self._stopping = True
        if self._conn is not None:
            self._conn.close()

    async def give_up(self, last: Tried) -> None:
        down = self._down
        if not down.started:
            if isinstance(last.reply, tuple):
                down.respond(*last.reply)  # the last unit's own answer, as it came
                return
            # The gateway's own answer (a deadline, a unit that sent nothing in time):
            # it names the unit tried last, as a unit's answer names that unit.
            error = last.error or Unavailable("no unit could serve the request")
            down.respond(*error_parts(error, self._ctx.request_id, self._unit_id))
            return
        error = last.error or Unavailable("no unit could serve the request")
        log.warning("request %s: %s", self._ctx.request_id, error.message)
        await self._end_with(openai_api.sse_error(error.body()), error.http_status)

    def measure(self, usage: Usage) -> None:
        """What the request used, as far as the client got it (tenants' accounting)."""
        transcript = self._transcript
        if transcript is not None and not usage.reported:  # no usage comment came
            text = transcript.text()
            usage.read_usage(transcript.usage)
            usage.count_output(text)

    async def attempt(self, unit: Unit) -> Tried:
        assert self._next is not None
        self._unit_id = unit.id
        body, hint = self._next
        usage = self.usage
        if usage is not None:
            usage.attempt(unit.id)
        headers = self._fw.unit_headers(self._ctx)
        # with tenants the class, and the usage asked for (the tenant's accounting, a
        # sampled request's span)
        lines = own_lines(self._ctx, usage is not None)
        if hint is not None:
            headers[RESUME_HEADER] = hint
        now = self._begin()
        try:
            left = send_deadline(headers, self._deadline)
        except DeadlineExceeded as late:
            return Tried(Next.DONE, Outcome.CANCELLED, error=late)
        end = None if left is None else now + left
        limit = self._fw.settings.response_timeout_s
        head_by = now + limit
        conn: UnitConnection | None = None
        try:
            async with Deadline(
                self._fw.wheel, head_by if end is None else min(head_by, end)
            ) as scope:
                self._scope = scope
                try:
                    conn = await self._fw.pools[unit.id].request(
                        self._ctx.method, self._ctx.path, headers, body, lines
                    )
                except ConnectFailed as failed:
                    return self._unreachable(unit, failed)
                self._conn = conn
                self._answered = True
                scope.reschedule(end)
                return await self._answer(unit, conn)
        except TimeoutError:
            if self._lost is not None:
                return self._failed(unit, "unit_lost", "")
            if conn is None and (end is None or head_by < end):
                message = f"unit {unit.id} sent no response within {limit:g} s"
                log.warning("%s", message)
                return Tried(Next.DONE, Outcome.FAILED, error=UnitTimeout(message))
            return Tried(Next.DONE, Outcome.CANCELLED, error=deadline_passed())
        except Broken as exc:  # a whole body was being read
            return self._failed(unit, "broken", f"unit {unit.id} broke its answer: {exc}")
        finally:
            self._conn = self._scope = None
            if conn is not None:
                conn.done()  # kept for reuse only when its response was read to the end

    def _begin(self) -> float:
        """A new attempt starts now (returned, in loop time)."""
        self._asked_at = now = self._loop.time()
        self._first_s = -1.0
        self._events = 0
        self._answered = False
        self._lost = None
        return now

    # -- one unit's answer -----------------------------------------------------------------

    async def _answer(self, unit: Unit, conn: UnitConnection) -> Tried:
        status = conn.status
        if status in (429, 503):
            return self._refused(unit, conn, status, await conn.read())
        if status == 200 and conn.headers.get("content-type", "").startswith("text/event-stream"):
            return await self._stream(unit, conn)
        data = await conn.read()
        health = Outcome.FAILED if status >= 500 else Outcome.OK
        if self._down.started:  # a continuation the unit would not take
            return Tried(Next.DONE, health, error=unit_error(status, data, unit))
        usage = self.usage
        if usage is not None:
            told = conn.headers.get(openai_api.USAGE_HEADER)
            if told is None or not usage.read_header(told):
                usage.read_body(data)  # a unit that sends no header: from its answer
            usage.first_byte = time.monotonic()
        if self.reasons is not None:
            finish_reasons(data, self.reasons)
        self._first_s = self._loop.time() - self._asked_at
        self._down.respond(status, self._headers(conn, unit), data, self._limit_lines())
        return Tried(Next.DONE, health)

    def _refused(self, unit: Unit, conn: UnitConnection, status: int, data: bytes) -> Tried:
        code = error_code(data)
        reply = (status, self._headers(conn, unit), data, self._limit_lines())
        error = unit_error(status, data, unit)
        if status == 429 or code in NOT_TAKING_WORK:
            return Tried(Next.RETRY, Outcome.REFUSED, str(status), error, reply)
        if code in UNIT_FAILED:
            return self._failed(unit, "unit_failed", error.message, reply)
        return Tried(Next.RETRY, Outcome.FAILED, str(status), error, reply)

    def _unreachable(self, unit: Unit, exc: ConnectFailed) -> Tried:
        if self._stopping:
            return Tried(Next.DONE, Outcome.OK, error=shutting_down())
        if isinstance(exc, Dropped):  # it had the request: a failure under it, not a refusal
            return self._failed(unit, "broken", f"unit {unit.id} dropped the request: {exc}")
        log.info("unit %s: %s", unit.id, exc)
        error = Unavailable(f"unit {unit.id} could not be reached")
        reply = (503, {"Content-Type": "application/json"}, json.dumps(error.body()).encode())
        return Tried(Next.RETRY, Outcome.FAILED, "connect", error, reply)

    def _failed(self, unit: Unit, reason: str, message: str, reply: Any = None) -> Tried:
        """The unit failed under the request, or the gateway left it (``abandon``):
        continue it elsewhere, if it can be."""
        if self._stopping:
            return Tried(Next.DONE, Outcome.OK, error=shutting_down())
        health = Outcome.FAILED
        if self._lost is not None:  # the router's verdict, not something this one saw
            reason, health = "unit_lost", Outcome.CANCELLED
            message = f"unit {unit.id} is {self._lost}: the request goes on elsewhere"
        log.warning("request %s: %s", self._ctx.request_id, message)
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        self._next = self._continuation()
        error = Unavailable(message, code="unit_failed")
        return Tried(Next.MIGRATE, health, reason, error, reply)

    def _continuation(self) -> tuple[bytes, str | None] | None:
        if not self._down.started:
            return self._body, None  # nothing went out: the request as it came
        if self._ctx.route not in RESUMABLE:
            return None
        transcript, key = self._transcript, self._fw.resume_key
        if transcript is None or key is None:
            return None
        text = transcript.text()
        if not transcript.resumable or transcript.finished:
            return None
        body = resume_body(self._ctx.route, self._body, text)
        if body is None:
            return None
        return body, resume_hint(key, transcript.created, text)

    def _headers(self, conn: UnitConnection, unit: Unit) -> dict[str, str]:
        headers = {name: conn.headers[key] for key, name in PASSED_HEADERS if key in conn.headers}
        headers[UNIT_HEADER] = conn.headers.get(UNIT_HEADER, unit.id)
        headers[REQUEST_ID_HEADER] = self._ctx.request_id
        return headers

    def _limit_lines(self) -> str:
        """A limited tenant's x-ratelimit-* as head lines ("" for none): one text, not
        six headers to add and write one by one."""
        admission = self._ctx.admission
        return "" if admission is None else admission.header_block()

    # -- streams ---------------------------------------------------------------------------

    async def _stream(self, unit: Unit, conn: UnitConnection) -> Tried:
        down = self._down
        if not down.started:
            headers = self._headers(conn, unit)
            headers["Cache-Control"] = "no-cache"
            await down.start(conn.status, headers, self._limit_lines())
            self._transcript = SseTranscript()
        self._reset_events()
        self._watch_idle(conn)
        try:
            write = down.splice_writer(conn)
            if write is not None:
                await conn.splice(self._sink(write))
            else:
                while (data := await conn.read_some()) is not None:
                    await down.write(self._accept(data))
        except Broken as exc:
            return await self._broken(unit, exc)
        finally:
            self._unwatch()
        if self._unit_error is not None:
            return await self._unit_errored(unit)
        await down.write(self._tail)
        await down.end()
        return DONE_OK

    def _reset_events(self) -> None:
        # A method, not inline: a None assigned in _stream would narrow the attribute's
        # type there, and compiled (mypyc) code checks that narrowing after each await.
        self._tail, self._unit_error, self._idle = b"", None, False

    def _sink(self, write: Callable[[bytes], None]) -> Callable[[bytes], None]:
        accept = self._accept

        def sink(data: bytes) -> None:
            events = accept(data)
            if events:
                write(events)

        return sink

    def _accept(self, data: bytes) -> bytes:
        """What of ``data`` goes to the client now: whole events, up to an error event."""
        if self._unit_error is not None:
            return b""
        if self._tail:
            data, self._tail = self._tail + data, b""
        cut = data.rfind(b"\n\n") + 2
        if cut < len(data):
            if cut == 1 and len(data) <= MAX_PARTIAL_EVENT:
                self._tail = data
                return b""
            if cut > 1:
                data, self._tail = data[:cut], data[cut:]
        at = data.find(ERROR_EVENT)
        if at >= 0:
            data, self._unit_error = data[:at], data[at:]
        usage = self.usage
        # the unit's usage comment, out of the client's stream (it comes once, at the end)
        if usage is not None and openai_api.USAGE_COMMENT in data[-COMMENT_TAIL:]:
            data = usage.take_comment(data)
        if self.reasons is not None:
            finish_reasons(data, self.reasons)
        if data:
            self._delivered(data)
        return data

    def _delivered(self, events: bytes) -> None:
        transcript = self._transcript
        assert transcript is not None
        if not self._down.started:
            self._fw.ttft[self._ctx.route].observe(time.monotonic() - self._started)
            usage = self.usage
            if usage is not None:
                usage.first_byte = time.monotonic()
        if self._failed_at is not None:
            self._fw.gateway_metrics.migration_pause.observe(time.monotonic() - self._failed_at)
            self._failed_at = None
        transcript.add(events)
        self._last_byte = self._loop.time()
        if self._first_s < 0.0:
            self._first_s = self._last_byte - self._asked_at
        if self._learns:
            self._events += events.count(b"data:")

    async def _broken(self, unit: Unit, exc: Broken) -> Tried:
        transcript = self._transcript
        if transcript is not None and self._down.started and not self._stopping:
            transcript.text()
            if transcript.finished:  # every token went out; the end of the stream did not
                await self._end_with(b"" if transcript.done else DONE_EVENT, 0)
                return Tried(Next.DONE, Outcome.FAILED)
        if self._idle:
            idle = self._fw.settings.stream_idle_timeout_s
            return self._failed(unit, "idle", f"unit {unit.id} sent nothing for {idle:g} s")
        return self._failed(unit, "broken", f"unit {unit.id} broke the stream: {exc}")

    async def _unit_errored(self, unit: Unit) -> Tried:
        event = self._unit_error or b""
        error = _event_error(event)
        code = error.get("code")
        if code in UNIT_FAILED:
            return self._failed(unit, "unit_failed", f"unit {unit.id}: {error.get('message')}")
        status = STATUS_OF_TYPE.get(str(error.get("type")), 500)
        await self._end_with(event, status)
        return Tried(Next.DONE, Outcome.OK if status == 504 else Outcome.FAILED)

    async def _end_with(self, event: bytes, status: int) -> None:
        """End the client's stream with ``event`` (after any event the unit left open)."""
        self.status = status
        await self._down.write(event)
        await self._down.end()

    # -- silence ---------------------------------------------------------------------------

    def _watch_idle(self, conn: UnitConnection) -> None:
        self._last_byte = self._loop.time()
        self._watch = self._fw.wheel.call_at(
            self._last_byte + self._fw.settings.stream_idle_timeout_s, self._check_idle
        )

    def _check_idle(self) -> None:
        self._watch = None
        conn = self._conn
        if conn is None or conn.closed:
            return
        now = self._loop.time()
        if conn.paused:
            self._last_byte = now  # the client is not reading: the unit is not silent
        due = self._last_byte + self._fw.settings.stream_idle_timeout_s
        if due > now:
            self._watch = self._fw.wheel.call_at(due, self._check_idle)
            return
        self._idle = True
        conn.close()

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._fw.wheel.cancel(self._watch)
            self._watch = None


def previous_response_id(body: bytes) -> str | None:
    """The ``previous_response_id`` of a Responses API body, None when it has none."""
    try:
        value = json.loads(body).get("previous_response_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def _event_error(event: bytes) -> dict[str, Any]:
    payload = event.split(b"\n\n", 1)[0].removeprefix(b"data:").strip()
    try:
        error = json.loads(payload)["error"]
    except (ValueError, KeyError, TypeError):
        return {}
    return error if isinstance(error, dict) else {}

"""Forwarding one HTTP inference request to a unit, with retries before the first byte.

An attempt ends in one of three ways: the unit refused before doing work (429, 503,
connection failure: try another unit at once, within the retry budget), the unit
answered (its response goes to the client; SSE bytes are passed through as they come,
never re-encoded), or the stream broke after the first byte (the client gets one SSE
error event, never a silent cut; no retry).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from proxy import openai_api
from proxy.errors import DeadlineExceeded, Unavailable, UnitProxyError
from proxy.gateway.front import Producer
from proxy.gateway.router import NoUnit, Outcome, Router
from proxy.gateway.units import Unit
from proxy.gateway.upstream import Broken, ConnectFailed, Connection, Pool
from proxy.httputil import DEADLINE_HEADER, REQUEST_ID_HEADER, UNIT_HEADER, timeout_header
from proxy.metrics import GatewayMetrics, ServingMetrics
from proxy.serving import Gate
from proxy.timers import Deadline, Wheel

log = logging.getLogger(__name__)

PASSED_HEADERS = (("content-type", "Content-Type"), ("retry-after", "Retry-After"))
MIN_LEFT_S = 0.001  # less time than this left: the deadline has passed for all purposes
POST = b"POST"


class UnitTimeout(DeadlineExceeded):
    """The unit took longer than the gateway allows to start answering."""


# A 503 whose code says the unit is not taking work (its state) is a refusal, like 429;
# any other 503 is the unit failing and counts toward its ejection.
NOT_TAKING_WORK = frozenset({"starting", "not_serving", "draining"})


def _refusal(status: int, body: bytes) -> bool:
    if status == 429:
        return True
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return False
    return code in NOT_TAKING_WORK


class Downstream(Protocol):
    """Where the client's response goes: the gateway's own HTTP/1.1 path or aiohttp."""

    @property
    def started(self) -> bool:
        """Some of a streamed response went out: no other unit can be tried."""

    def respond(self, status: int, headers: dict[str, str], body: bytes) -> None:
        """The whole response at once."""

    async def start(self, status: int, headers: dict[str, str]) -> None:
        """A streamed response: its head goes out with the first ``write``."""

    async def write(self, data: bytes) -> None:
        """Raises ClientGone when the client closed the connection."""

    async def end(self) -> None: ...

    def splice_writer(self, producer: Producer) -> Callable[[bytes], None] | None:
        """A synchronous writer for chunks as they arrive, or None where writes must be
        awaited."""


@dataclass(slots=True)
class Inbound:
    """What the gateway takes from the client's request."""

    path: str
    route: str
    body: bytes
    request_id: str
    content_type: str | None = None
    authorization: str | None = None
    timeout_s: float | None = None  # from DEADLINE_HEADER, already checked


@dataclass(slots=True)
class Refused:
    """A unit said no before any work: the attempt may go to another unit."""

    reason: str  # "429", "503", "connect"
    status: int
    body: bytes
    headers: dict[str, str]


class Forwarder:
    def __init__(
        self,
        router: Router,
        pools: dict[str, Pool],
        metrics: ServingMetrics,
        gateway_metrics: GatewayMetrics,
        gate: Gate,
        wheel: Wheel,
        unit_key: str | None = None,
    ):
        self._gate = gate
        self._wheel = wheel
        self._unit_auth = None if unit_key is None else f"Bearer {unit_key}"
        self._router = router
        self._pools = pools
        self._metrics = metrics
        self._gw = gateway_metrics
        self._settings = router.settings
        self._routed: dict[str, Any] = {}  # metric children by unit: labels() per request costs
        self._ttft = {route: metrics.ttft.labels(route) for route in ("completions", "chat")}
        self._duration = {
            route: metrics.request_duration.labels(route) for route in ("completions", "chat")
        }

    async def handle(self, down: Downstream, req: Inbound) -> None:
        """Answer ``req`` through ``down``; raises UnitProxyError before any response."""
        started = time.monotonic()
        deadline = self._deadline(req, started)
        tried: set[str] = set()
        refused: Refused | None = None
        self._gate.enter()
        try:
            for attempt in range(self._settings.retries + 1):
                if attempt:
                    assert refused is not None
                    self._gw.retries.labels(refused.reason).inc()
                try:
                    unit = await self._router.acquire(tried)
                except NoUnit:
                    if refused is not None:
                        break  # no other unit to try: the client gets the last refusal
                    self._gw.no_unit_available.inc()
                    raise
                tried.add(unit.id)
                routed = self._routed.get(unit.id)
                if routed is None:
                    routed = self._routed[unit.id] = self._gw.routed.labels(unit.id)
                routed.inc()
                refused = await self._attempt(unit, down, req, deadline, started)
                if refused is None:
                    return
            assert refused is not None
            down.respond(refused.status, refused.headers, refused.body)
        finally:
            self._gate.exit()
            self._duration[req.route].observe(time.monotonic() - started)

    def _deadline(self, req: Inbound, now: float) -> float | None:
        if req.timeout_s is not None:
            return now + req.timeout_s
        timeout = self._settings.request_timeout_s
        return None if timeout is None else now + timeout

    def _headers(self, req: Inbound) -> dict[str, str]:
        headers = {"Content-Type": req.content_type or "application/json",
                   REQUEST_ID_HEADER: req.request_id}  # fmt: skip
        authorization = self._unit_auth or req.authorization
        if authorization:
            headers["Authorization"] = authorization
        return headers

    async def _attempt(
        self, unit: Unit, down: Downstream, req: Inbound, deadline: float | None, started: float
    ) -> Refused | None:
        """One try on ``unit``: None when the client got the unit's answer."""
        headers = self._headers(req)
        left = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < MIN_LEFT_S:
                self._router.release(unit, Outcome.OK)
                raise DeadlineExceeded("the request's deadline passed")
            headers[DEADLINE_HEADER] = timeout_header(left)
        outcome = Outcome.FAILED
        conn: Connection | None = None
        last = [b""]  # what the client got last: an error event must start on its own line
        # One timer: the unit's response_timeout_s (or the deadline, if sooner) until the
        # response head, then the request's deadline.
        limit = self._settings.response_timeout_s
        now = asyncio.get_running_loop().time()
        end = None if left is None else now + left
        head_by = now + limit
        try:
            async with Deadline(
                self._wheel, head_by if end is None else min(head_by, end)
            ) as scope:
                conn = await self._pools[unit.id].request(POST, req.path, headers, req.body)
                scope.reschedule(end)
                status = conn.status
                if status in (429, 503):
                    data = await conn.read()
                    outcome = Outcome.REFUSED if _refusal(status, data) else Outcome.FAILED
                    return Refused(str(status), status, data,
                                   _passed_headers(conn, unit.id, req.request_id))  # fmt: skip
                outcome = Outcome.FAILED if status >= 500 else Outcome.OK
                if conn.headers.get("content-type", "").startswith("text/event-stream"):
                    ok = await self._pipe(conn, down, unit, req, started, last)
                    outcome = Outcome.OK if ok else Outcome.FAILED
                    return None
                data = await conn.read()
                self._ttft[req.route].observe(time.monotonic() - started)
                down.respond(status, _passed_headers(conn, unit.id, req.request_id), data)
                return None
        except TimeoutError as exc:
            if conn is None and (end is None or head_by < end):
                message = f"unit {unit.id} sent no response within {limit:g} s"
                log.warning("%s", message)
                raise UnitTimeout(message) from None  # the unit's failure (outcome FAILED)
            outcome = Outcome.OK  # the request's own deadline, not the unit's fault
            error = DeadlineExceeded("the request's deadline passed")
            if not down.started:
                raise error from exc
            log.warning("request %s: %s", req.request_id, error.message)
            await _end_with_error(down, error, last[0])
            return None
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED  # the client went away: no failure of the unit
            raise
        except (ConnectFailed, Broken) as exc:
            if down.started:
                raise
            log.info("unit %s: %s", unit.id, exc)
            return Refused(
                "connect", 503, _unavailable(unit, exc), {"Content-Type": "application/json"}
            )
        finally:
            if conn is not None:
                conn.done()  # kept for reuse only when its response was read to the end
            self._router.release(unit, outcome)

    def _spliced(
        self,
        write: Callable[[bytes], None],
        down: Downstream,
        req: Inbound,
        started: float,
        last: list[bytes],
    ) -> Callable[[bytes], None]:
        ttft = self._ttft[req.route]

        def sink(data: bytes) -> None:
            if not down.started:
                ttft.observe(time.monotonic() - started)
            write(data)
            last[0] = data

        return sink

    async def _pipe(
        self,
        conn: Connection,
        down: Downstream,
        unit: Unit,
        req: Inbound,
        started: float,
        last: list[bytes],
    ) -> bool:
        """Pass the SSE bytes through; on a broken upstream end with an SSE error event.

        Returns whether the unit did its part (False: it broke or ended with an error)."""
        headers = _passed_headers(conn, unit.id, req.request_id)
        headers["Cache-Control"] = "no-cache"
        await down.start(conn.status, headers)
        write = down.splice_writer(conn)
        try:
            if write is not None:
                await conn.splice(self._spliced(write, down, req, started, last))
                await down.end()
                return not _ended_by_unit_error(last[0])
            first = True
            while (data := await conn.read_some()) is not None:
                if first:
                    self._ttft[req.route].observe(time.monotonic() - started)
                    first = False
                await down.write(data)
                last[0] = data
        except Broken as exc:
            if not down.started:
                raise  # nothing reached the client yet: the attempt may go elsewhere
            error = Unavailable(f"unit {unit.id} broke the stream: {exc}")
            log.warning("request %s: %s", req.request_id, error.message)
            await _end_with_error(down, error, last[0])
            return False
        await down.end()
        return not _ended_by_unit_error(last[0])


async def _end_with_error(down: Downstream, error: UnitProxyError, last: bytes) -> None:
    separator = b"" if not last or last.endswith(b"\n\n") else b"\n\n"
    await down.write(separator + openai_api.sse_error(error.body()))
    await down.end()


def _ended_by_unit_error(last: bytes) -> bool:
    """Did the unit end the stream with an error event of its own (not the deadline)?"""
    at = last.rfind(b'data: {"error"')
    return at >= 0 and b"timeout_error" not in last[at:]


def _passed_headers(conn: Connection, unit_id: str, request_id: str) -> dict[str, str]:
    headers = {name: conn.headers[key] for key, name in PASSED_HEADERS if key in conn.headers}
    headers[UNIT_HEADER] = conn.headers.get(UNIT_HEADER, unit_id)
    headers[REQUEST_ID_HEADER] = request_id
    return headers


def _unavailable(unit: Unit, exc: BaseException) -> bytes:
    err = Unavailable(f"unit {unit.id} could not be reached: {exc or type(exc).__name__}")
    return json.dumps(err.body()).encode()

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
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from proxy import openai_api
from proxy.errors import DeadlineExceeded, Unavailable, UnitProxyError
from proxy.gateway.router import NoUnit, Outcome, Router
from proxy.gateway.units import Unit
from proxy.httputil import (
    DEADLINE_HEADER,
    REQUEST_ID_HEADER,
    UNIT_HEADER,
    ClientGone,
    timeout_header,
    timeout_s,
)
from proxy.metrics import GatewayMetrics, ServingMetrics
from proxy.serving import Gate

log = logging.getLogger(__name__)

PASSED_HEADERS = ("Content-Type", "Retry-After")
MIN_LEFT_S = 0.001  # less time than this left: the deadline has passed for all purposes


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
        sessions: dict[str, aiohttp.ClientSession],
        metrics: ServingMetrics,
        gateway_metrics: GatewayMetrics,
        gate: Gate,
        unit_key: str | None = None,
    ):
        self._gate = gate
        self._unit_auth = None if unit_key is None else f"Bearer {unit_key}"
        self._router = router
        self._sessions = sessions
        self._metrics = metrics
        self._gw = gateway_metrics
        self._settings = router.settings

    async def handle(self, request: web.Request, route: str, request_id: str) -> web.StreamResponse:
        started = time.monotonic()
        body = await request.read()
        deadline = self._deadline(request)
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
                self._gw.routed.labels(unit.id).inc()
                result = await self._attempt(
                    unit, request, route, body, request_id, deadline, started
                )
                if not isinstance(result, Refused):
                    return result
                refused = result
            assert refused is not None
            return web.Response(status=refused.status, body=refused.body, headers=refused.headers)
        finally:
            self._gate.exit()
            self._metrics.request_duration.labels(route).observe(time.monotonic() - started)

    def _deadline(self, request: web.Request) -> float | None:
        now = time.monotonic()
        budget = timeout_s(request.headers.get(DEADLINE_HEADER))
        if budget is not None:
            return now + budget
        timeout = self._settings.request_timeout_s
        return None if timeout is None else now + timeout

    async def _attempt(
        self,
        unit: Unit,
        request: web.Request,
        route: str,
        body: bytes,
        request_id: str,
        deadline: float | None,
        started: float,
    ) -> web.StreamResponse | Refused:
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json"),
                   REQUEST_ID_HEADER: request_id}  # fmt: skip
        authorization = self._unit_auth or request.headers.get("Authorization")
        if authorization:
            headers["Authorization"] = authorization
        timeout = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < MIN_LEFT_S:
                self._router.release(unit, Outcome.OK)
                raise DeadlineExceeded("the request's deadline passed")
            headers[DEADLINE_HEADER] = timeout_header(left)
            timeout = aiohttp.ClientTimeout(total=left)
        outcome = Outcome.FAILED
        try:
            upstream = await self._response(unit, request.path, body, headers, timeout, deadline)
            async with upstream:
                if upstream.status in (429, 503):
                    data = await upstream.read()
                    outcome = Outcome.REFUSED if _refusal(upstream.status, data) else Outcome.FAILED
                    return Refused(str(upstream.status), upstream.status, data,
                                   _passed_headers(upstream, unit.id, request_id))  # fmt: skip
                outcome = Outcome.FAILED if upstream.status >= 500 else Outcome.OK
                if upstream.content_type == "text/event-stream":
                    response, ok = await self._pipe(
                        request, upstream, unit, request_id, route, started
                    )
                    outcome = Outcome.OK if ok else Outcome.FAILED
                    return response
                data = await upstream.read()
                self._metrics.ttft.labels(route).observe(time.monotonic() - started)
                return web.Response(status=upstream.status, body=data,
                                    headers=_passed_headers(upstream, unit.id, request_id))  # fmt: skip
        except UnitTimeout as exc:
            log.warning("%s", exc.message)
            raise
        except TimeoutError as exc:
            outcome = Outcome.OK  # the request's own deadline, not the unit's fault
            raise DeadlineExceeded("the request's deadline passed") from exc
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED  # the client went away: no failure of the unit
            raise
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            log.info("unit %s: %s", unit.id, exc or type(exc).__name__)
            return Refused(
                "connect", 503, _unavailable(unit, exc), {"Content-Type": "application/json"}
            )
        finally:
            self._router.release(unit, outcome)

    async def _response(
        self,
        unit: Unit,
        path: str,
        body: bytes,
        headers: dict[str, str],
        client_timeout: aiohttp.ClientTimeout | None,
        deadline: float | None,
    ) -> aiohttp.ClientResponse:
        """The unit's response headers (with its first token, when streaming).

        A unit that sends none within ``response_timeout_s`` has failed: 504, and it
        counts toward its ejection. The request's own deadline is no fault of the unit.
        """
        limit = self._settings.response_timeout_s
        post = self._sessions[unit.id].post(f"{unit.http_url}{path}", data=body, headers=headers,
                                            timeout=client_timeout)  # fmt: skip
        try:
            return await asyncio.wait_for(post, limit)
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline - MIN_LEFT_S:
                raise
            raise UnitTimeout(f"unit {unit.id} sent no response within {limit:g} s") from None

    async def _pipe(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        unit: Unit,
        request_id: str,
        route: str,
        started: float,
    ) -> tuple[web.StreamResponse, bool]:
        """Pass the SSE bytes through; on a broken upstream end with an SSE error event.

        Returns the response and whether the unit did its part (False: it broke)."""
        response = web.StreamResponse(
            status=upstream.status, headers=_passed_headers(upstream, unit.id, request_id)
        )
        response.headers["Cache-Control"] = "no-cache"
        tail = b"\n\n"
        last = b""
        try:
            first = True
            async for data in upstream.content.iter_any():
                if first:
                    await response.prepare(request)
                    self._metrics.ttft.labels(route).observe(time.monotonic() - started)
                    first = False
                await response.write(data)
                tail, last = data[-2:], data
            if first:
                await response.prepare(request)
            await response.write_eof()
            return response, not _ended_by_unit_error(last)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            if not response.prepared:
                raise  # nothing reached the client yet: the attempt may go elsewhere
            if isinstance(exc, aiohttp.ClientConnectionResetError) and _client_gone(request):
                raise ClientGone(response) from exc
            error: UnitProxyError = (
                DeadlineExceeded("the request's deadline passed")
                if isinstance(exc, TimeoutError)
                else Unavailable(f"unit {unit.id} broke the stream: {exc or type(exc).__name__}")
            )
            log.warning("request %s: %s", request_id, error.message)
            separator = b"" if tail == b"\n\n" else b"\n\n"
            await response.write(separator + openai_api.sse_error(error.body()))
            await response.write_eof()
            return response, isinstance(exc, TimeoutError)


def _ended_by_unit_error(last: bytes) -> bool:
    """Did the unit end the stream with an error event of its own (not the deadline)?"""
    at = last.rfind(b'data: {"error"')
    return at >= 0 and b"timeout_error" not in last[at:]


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _passed_headers(
    upstream: aiohttp.ClientResponse, unit_id: str, request_id: str
) -> dict[str, str]:
    headers = {name: upstream.headers[name] for name in PASSED_HEADERS if name in upstream.headers}
    headers[UNIT_HEADER] = upstream.headers.get(UNIT_HEADER, unit_id)
    headers[REQUEST_ID_HEADER] = request_id
    return headers


def _unavailable(unit: Unit, exc: BaseException) -> bytes:
    err = Unavailable(f"unit {unit.id} could not be reached: {exc or type(exc).__name__}")
    return json.dumps(err.body()).encode()

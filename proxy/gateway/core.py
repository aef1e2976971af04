"""The gateway's request loop, whatever wire the request came on.

    acquire a unit -> one attempt (the wire's) -> release with its health outcome
      -> DONE     the client has its answer (or gets the attempt's error)
      -> RETRY    the unit did not take the request (429, 503 not taking work, no
                  connection to it): the request as it came to another unit at once,
                  up to ``gateway.retries``
      -> MIGRATE  the unit took the request and failed under it (connection lost after
                  the request went out, its unit_failed error, silent for
                  ``stream_idle_timeout_s``), streamed or not, started or not, or the
                  router stopped routing to it (``move_off_stopped_units``: ejected,
                  NOT_SERVING, LOST): another unit continues it after what the client
                  already got (all of it, when nothing went out yet), up to
                  ``gateway.migrations``

A retry or migration is counted (``unitproxy_retries_total``,
``unitproxy_migrations_total``) when another unit takes the request, never when none is
left to take it.

The wires (``forward.HttpJob``, ``grpc_proxy.GrpcJob``) make attempts and say which of
the three each was; this module owns the loop, the budgets and their metrics. With
nothing left to try, the job gives up: the client gets the last refusal, or, if its
response started, the error as the end of its stream.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Iterator
from enum import Enum
from typing import Any, Protocol

from proxy.errors import DeadlineExceeded, NotFound, Unavailable, UnitProxyError
from proxy.gateway.request import (
    NO_WANT,
    Context,
    Want,
    body_want,
    for_tenant,
    grpc_want,
    json_want,
    message_want,
    pinned,
)
from proxy.gateway.router import NoUnit, Outcome, Router
from proxy.gateway.traces import RequestTrace
from proxy.gateway.units import Unit
from proxy.httputil import DEADLINE_HEADER, timeout_header
from proxy.metrics import MIGRATION_REASONS, RETRY_REASONS, GatewayMetrics, LoopCount, LoopCounter
from proxy.response_ids import unit_of
from proxy.settings import GatewaySettings

log = logging.getLogger(__name__)


# A unit's error code that says it is not taking work (its state): a refusal, like 429.
NOT_TAKING_WORK = frozenset({"starting", "not_serving", "draining"})
# One that says the unit failed under the request: a reason to migrate.
UNIT_FAILED = frozenset({"unit_failed", "engine_dead"})


MIN_TOKENS = 4  # events of a stream before its time per token is taken


def per_token(first_s: float, last_s: float, tokens: int) -> float:
    """Seconds per token after the first, of a stream whose first of ``tokens`` events
    came ``first_s`` and its last ``last_s`` after it was sent; -1 with fewer than
    MIN_TOKENS (or none)."""
    if first_s < 0.0 or tokens < MIN_TOKENS or last_s <= first_s:
        return -1.0
    return (last_s - first_s) / (tokens - 1)


class UnitTimeout(DeadlineExceeded):
    """The unit took longer than the gateway allows to start answering."""


def deadline_passed() -> DeadlineExceeded:
    return DeadlineExceeded("the request's deadline passed")


MIN_LEFT_S = 0.001  # less time than this left: the deadline has passed for all purposes


def send_deadline(headers: dict[str, str], deadline: float | None) -> float | None:
    """Tell the unit, in ``headers``, the seconds left before ``deadline`` (on
    time.monotonic) and return them; None without a deadline. Raises DeadlineExceeded
    when less than MIN_LEFT_S is left: nothing is worth sending then."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left < MIN_LEFT_S:
        raise deadline_passed()
    headers[DEADLINE_HEADER] = timeout_header(left)
    return left


def shutting_down() -> Unavailable:
    return Unavailable("the gateway is shutting down", code="shutting_down")


def _error_classes(base: type[UnitProxyError] = UnitProxyError) -> list[type[UnitProxyError]]:
    found = [base]
    for sub in base.__subclasses__():
        found += _error_classes(sub)
    return found


ERROR_CLASSES = _error_classes()  # the error tree, parents first


def error_code(body: bytes) -> str | None:
    """``error.code`` of a unit's OpenAI error body, None when it has none."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def unit_error(status: int, body: bytes, unit: Unit) -> UnitProxyError:
    """A unit's plain HTTP error answer (its OpenAI error body) as an error of ours,
    of the class that answers with that status."""
    try:
        error = json.loads(body)["error"]
        message, code = str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError):
        message, code = f"unit {unit.id} answered {status}", None
    code = code if isinstance(code, str) else None
    for cls in ERROR_CLASSES[1:]:
        if cls.http_status == status:
            return cls(message, code=code)
    return UnitProxyError(message, code=code)


class Pinned:
    """The units a request pinned to one unit may not take: every other one, and that
    one too once tried (``tried`` is the request's own set, which grows as it goes)."""

    __slots__ = ("tried", "unit")

    def __init__(self, unit: str, tried: set[str]):
        self.unit = unit
        self.tried = tried

    def __contains__(self, unit_id: object) -> bool:
        return unit_id != self.unit or unit_id in self.tried

    def __iter__(self) -> Iterator[str]:
        return iter(self.tried)  # the complement has no list; only membership is asked

    def __len__(self) -> int:
        return len(self.tried)


class Next(Enum):
    DONE = "done"
    RETRY = "retry"
    MIGRATE = "migrate"


class Tried:
    """How one attempt ended. (A plain class, not a dataclass: mypyc compiles its
    ``__init__``, where a dataclass's stays interpreted; one is made per attempt.)"""

    __slots__ = ("error", "health", "next", "reason", "reply")

    def __init__(
        self,
        next: Next,
        health: Outcome,  # what the unit's passive health learns
        reason: str = "",  # the retries_total / migrations_total label
        error: UnitProxyError | None = None,  # what the client gets if nothing else is tried
        reply: Any = None,  # the unit's own answer to pass on instead, where the wire has one
    ):
        self.next = next
        self.health = health
        self.reason = reason
        self.error = error
        self.reply = reply

    def __repr__(self) -> str:
        return f"Tried({self.next}, {self.health}, {self.reason!r}, {self.error!r})"


DONE_OK = Tried(Next.DONE, Outcome.OK)


class Job(Protocol):
    """One client request, as its wire carries it."""

    async def attempt(self, unit: Unit) -> Tried:
        """Send the request, or its continuation after what the client has, to ``unit``."""

    async def give_up(self, last: Tried) -> None:
        """Nothing else to try: end the client's response with ``last``'s answer."""

    @property
    def migratable(self) -> bool:
        """Whether the request can still be continued on another unit."""

    def unanswered_s(self) -> float:
        """How long the unit of the current attempt has had the request without sending
        a byte of its answer (0 once it sent one)."""

    def first_token_s(self) -> float:
        """Seconds from the current attempt's start to the first token of the unit's
        answer (the first stream event or message, or the whole answer); -1 if none
        came."""

    def per_token_s(self) -> float:
        """Seconds per output token of the current attempt's stream after its first
        (counted only with a policy that ``learns``); -1 if too few came to tell."""

    def interrupt(self) -> None:
        """The gateway stops now: end the response with an error as soon as possible."""

    def abandon(self, why: str) -> bool:
        """The gateway stopped routing to the unit of the current attempt (``why``):
        leave it now and go on elsewhere (migration reason ``unit_lost``) instead of
        waiting for its answer's head or the stream's idle timeout. False: nothing to
        leave, or left already."""


class GatewayCore:
    def __init__(
        self,
        router: Router,
        metrics: GatewayMetrics,
        settings: GatewaySettings,
    ):
        self._router = router
        self.name = router.name  # on every attempt: the units count its requests apart
        # Whether the policy learns from answers: the wires then count stream events.
        self.learns = router.learns
        self._metrics = metrics
        self._settings = settings
        self._active: set[Job] = set()
        self._on_unit: dict[str, set[Job]] = {}  # the jobs with an attempt on each unit
        self._routed: dict[str, LoopCount] = {}  # metric series by unit, found once
        self._retries = {r: metrics.retries.labels(r) for r in RETRY_REASONS}
        self._migrations = {r: metrics.migrations.labels(r) for r in MIGRATION_REASONS}

    @property
    def active(self) -> int:
        return len(self._active)

    def json_want(self, ctx: Context, body: bytes) -> Want:
        """What choosing a unit needs of an HTTP request (its body's model and prompt,
        when a policy reads prompts or units do not all serve the same models; with
        tenants, its tenant and priority class), kept as ``ctx.want``; raises NotFound
        for a model that no unit serves."""
        parsed = None if ctx.admission is None else ctx.admission.take_request()
        if parsed is None:
            ctx.want = self._want(json_want, body, ctx)
        else:  # the tenant's admission parsed the body already
            ctx.want = self._want(body_want, parsed, ctx)
        return ctx.want

    def form_want(self, ctx: Context, model: str | None) -> Want:
        """The same for a multipart form (the audio routes): its model field alone."""
        ctx.want = self._want(lambda _raw, _blocks: Want(model or None), b"", ctx)
        return ctx.want

    def grpc_want(self, ctx: Context, request: bytes) -> Want:
        """The same for a serialized GenerateRequest."""
        parsed = None if ctx.admission is None else ctx.admission.take_request()
        if parsed is None:
            ctx.want = self._want(grpc_want, request, ctx)
        else:  # the tenant's admission parsed the request already
            ctx.want = self._want(message_want, parsed, ctx)
        return ctx.want

    def pin(self, want: Want, response_id: str, param: str | None) -> Want:
        """``want``, sent to the unit that stores the response ``response_id`` (its id
        names that unit: proxy/response_ids.py). An id that names no unit this gateway
        knows is 404 (``param`` names the field it came in); one that names no unit at
        all (not made by a sidecar) is routed as any request is."""
        unit = unit_of(response_id)
        if unit is None:
            if param is None:  # a path: no unit to ask
                raise NotFound(f"Response with id '{response_id}' not found.", code="not_found")
            return want
        units = self._router.units
        known = unit if unit in units else None
        if known is None:  # configured under another name: the id its reports carry
            for u in units.values():
                if u.report is not None and u.report.unit_id == unit:
                    known = u.id
                    break
        if known is None:
            raise NotFound(
                f"Response with id '{response_id}' not found: it was stored on unit "
                f"{unit}, which this gateway does not know",
                param=param,
                code="not_found",
            )
        return pinned(want, known)

    def _want(self, parse: Any, raw: Any, ctx: Context) -> Want:
        router = self._router
        want = NO_WANT
        if router.reads_requests:
            policy = router.policy
            want = parse(raw, policy.prompt_blocks if policy.reads_prompt else None)
            router.check_model(want.model)
        admission = ctx.admission
        if admission is not None:
            want = for_tenant(want, admission.tenant.name, admission.priority, admission.cost)
        return want

    async def run(self, job: Job, want: Want = NO_WANT, trace: RequestTrace | None = None) -> None:
        """Serve ``job`` until its client has an answer; raises UnitProxyError when no unit
        could be tried and nothing reached the client. ``trace``: the request's spans."""
        self._active.add(job)
        try:
            await self._run(job, want, trace)
        finally:
            self._active.discard(job)

    async def _run(self, job: Job, want: Want, trace: RequestTrace | None) -> None:
        s = self._settings
        tried: set[str] = set()
        exclude: Collection[str] = tried if want.unit is None else Pinned(want.unit, tried)
        retries = migrations = 0
        last: Tried | None = None
        router = self._router
        learns = router.learns  # policy latency: each answer's TTFT goes to it
        while True:
            try:
                if trace is None:
                    unit = await router.acquire(exclude, want)
                else:
                    unit = await trace.acquire(router, exclude, want)
            except NoUnit as none_left:
                if last is None:
                    self._metrics.no_unit_available.inc()
                    if want.unit is not None:
                        raise NoUnit(
                            f"unit {want.unit}, which stores the response, is not serving",
                            code="no_unit_available",
                        ) from None
                    raise
                if last.next is Next.MIGRATE:
                    last.error = none_left if last.error is None else last.error
                await job.give_up(last)
                return
            except UnitProxyError as refused:  # the queue is full or timed out
                if last is None:
                    raise
                await job.give_up(Tried(Next.DONE, Outcome.OK, error=refused))
                return
            tried.add(unit.id)
            if last is not None:  # a retry or migration happens once a unit takes it
                self._counted(last, unit)
            self._count(self._routed, self._metrics.routed, unit.id)
            sent = router.sent(unit, want, job) if learns else None
            health = Outcome.CANCELLED  # unless the attempt says otherwise: the client left
            on_unit = self._on_unit.get(unit.id)
            if on_unit is None:
                on_unit = self._on_unit[unit.id] = set()
            on_unit.add(job)
            try:
                if trace is None:
                    result = await job.attempt(unit)
                else:
                    result = await trace.attempt(job, unit)
                health = result.health
            finally:
                on_unit.discard(job)
                if not on_unit:
                    self._on_unit.pop(unit.id, None)
                if health is Outcome.CANCELLED:
                    health = self._gave_up(unit, job)
                self._router.release(unit, health)
                if sent is not None:  # out of the unit's unstarted work, its TTFT learnt
                    ok = health is Outcome.OK
                    router.answered(unit, want, sent, ok, job.per_token_s() if ok else -1.0)
            if result.next is Next.DONE:
                if result.error is not None:
                    await job.give_up(result)  # the attempt ended the request with an error
                return
            last = result
            if result.next is Next.RETRY:
                if retries >= s.retries:
                    await job.give_up(result)
                    return
                retries += 1
                continue
            if migrations >= s.migrations or not job.migratable:
                await job.give_up(result)
                return
            migrations += 1

    def _counted(self, last: Tried, unit: Unit) -> None:
        """``unit`` takes the request after ``last``: count the retry or migration."""
        if last.next is Next.RETRY:
            self._count(self._retries, self._metrics.retries, last.reason)
            return
        self._count(self._migrations, self._metrics.migrations, last.reason)
        log.info("a unit failed under a request (%s): continuing it on unit %s",
                 last.reason, unit.id)  # fmt: skip

    def _gave_up(self, unit: Unit, job: Job) -> Outcome:
        """The client left or its deadline passed: a failure of the unit if it had waited
        gave_up_failure_s with no byte from it (so a unit that takes requests and never
        answers is ejected, whatever the response timeout), else nothing learnt."""
        waited = job.unanswered_s()
        if waited < self._settings.gave_up_failure_s:
            return Outcome.CANCELLED
        log.info("unit %s sent nothing in %.1f s and the client gave up: a failure of the "
                 "unit", unit.id, waited)  # fmt: skip
        return Outcome.FAILED

    def move_off_stopped_units(self) -> int:
        """Every request whose answer is coming from a unit the router stopped routing
        to (ejected, NOT_SERVING, LOST) leaves it and goes on elsewhere now, not at the
        stream's idle timeout: a SIGSTOPped unit's streams pause for as long as its
        reports take to go stale, plus the migration. Returns the requests moved."""
        moved = 0
        router = self._router
        for unit_id, jobs in list(self._on_unit.items()):
            unit = router.units.get(unit_id)
            why = None if unit is None else router.stopped(unit)
            if why is None:
                continue
            for job in list(jobs):
                if job.migratable and job.abandon(why):
                    moved += 1
        return moved

    def interrupt_all(self) -> None:
        """The gateway stops at once: every open response ends with an error."""
        for job in list(self._active):
            job.interrupt()

    @staticmethod
    def _count(cache: dict[str, LoopCount], counter: LoopCounter, label: str) -> None:
        child = cache.get(label)
        if child is None:
            child = cache[label] = counter.labels(label)
        child.inc()

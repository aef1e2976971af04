"""The gateway's routing state: units, their load, passive health, and the wait queue.

``acquire`` picks a unit for one attempt (or waits in the fair queue, ``fairqueue``,
while every SERVING unit it may take is full) and counts the request as started there; ``release`` counts it
finished and records the outcome for passive health. Reports from the load source
arrive through ``apply_report``.

Which unit a choice takes is the policy's (``proxy.gateway.policies``): the router
builds the one its settings name, hands it each choice with the candidates' view, and
tells it of every unit added, report applied and load moved. It names no policy.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import replace
from enum import Enum

from prometheus_client import CollectorRegistry

from proxy.errors import NotFound, Overloaded, Unavailable
from proxy.gateway.fairqueue import FairQueue, Waiter
from proxy.gateway.latency import Sent, Timed
from proxy.gateway.policies.base import Candidates, Policy, Shared, create
from proxy.gateway.request import NO_WANT, Want
from proxy.gateway.units import AS_REPORTED, CORRECTED, LoadView, Unit, reason
from proxy.load import LoadReport, PrefixBlocks, UnitState
from proxy.metrics import GatewayMetrics, UnitView
from proxy.settings import GatewaySettings, UnitTarget
from proxy.tenants import PRIORITIES, RANK

log = logging.getLogger(__name__)


class Outcome(Enum):
    OK = "ok"  # the unit answered (any status that is not its own failure)
    REFUSED = "refused"  # 429 or 503: the unit said no before doing work
    FAILED = "failed"  # connection error or 5xx: counts toward ejection
    # The client went away or its deadline passed: says nothing about the unit, unless
    # it waited gateway.gave_up_failure_s for a first byte (the core makes that FAILED).
    CANCELLED = "cancelled"


class NoUnit(Unavailable):
    """No SERVING unit is left to try (apart from those excluded)."""


INTERACTIVE, STANDARD, BATCH = RANK["interactive"], RANK["standard"], RANK["batch"]


class Router:
    def __init__(
        self,
        settings: GatewaySettings,
        targets: Iterable[UnitTarget] = (),
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[Unit], None] | None = None,
        metrics: GatewayMetrics | None = None,
    ):
        self.settings = settings
        # This gateway's name to its units, random per router: on its requests and in its
        # watch of their reports, which then count its requests apart (Unit.estimate).
        self.name = secrets.token_hex(8)
        # What the router observes it records here itself (None: a registry of its own).
        self.metrics = metrics or GatewayMetrics(CollectorRegistry())
        self.units: dict[str, Unit] = {}
        # How every choice reads a unit's load (gauges and /units read it too).
        self.view = CORRECTED if settings.correct_load else AS_REPORTED
        self._rng = rng or random.Random()
        self._clock = clock
        self._started = clock()  # a unit not reporting yet is wrong only after a grace
        # The wait queue, in fair order; each class bounded as the settings say.
        sizes = {str(c): n for c, n in settings.queue_class_size.items()}
        waits = {str(c): s for c, s in settings.queue_class_timeout_s.items()}
        self.queue = FairQueue(
            [sizes.get(p, settings.queue_size) for p in PRIORITIES],
            [waits.get(p, settings.queue_timeout_s) for p in PRIORITIES],
            settings.queue_size,
            clock=clock,
        )
        self._on_change = on_change
        # Whether the units grant this gateway's interactive requests their class (it
        # signs them with server.resume_secret; the server sets it): without, a unit
        # admits interactive as standard, and so does the allowance over capacity.
        self.signs_interactive = True
        self._aging_paused_at: float | None = None
        # How many units list each model, and how many list none (serve any): the
        # gateway reads a request's model only when the units differ.
        self._models: Counter[str] = Counter()
        self._model_sets: Counter[tuple[str, ...]] = Counter()
        self._held_back: set[str] = set()  # units the ejection cap kept in (logged once)
        self.queued = 0  # requests that waited in the queue, ever (a trace tells a wait by it)
        self._serving_reports = 0  # units whose last report says SERVING (fresh or not)
        self._all: list[Unit] = []
        # The policy the settings name (proxy.gateway.policies): it chooses, and keeps
        # what it needs to choose fast (a heap, an index) from the events below.
        shared = Shared(settings, self._rng, clock, self.view, self._all, self.units)
        self.policy: Policy = create(settings.policy, shared)
        self._candidates = Candidates(shared)  # set afresh for each choice
        for target in targets:
            self.add(target)
        # Whether the policy learns from each answer (policy latency): the core asks.
        self.learns = self.policy.learns
        self.metrics.watch_units(self.unit_views, lambda: self.waiting)
        self.metrics.watch_saturation(self.saturation)
        self.policy.count_to(self.metrics)

    def add(self, target: UnitTarget) -> Unit:
        unit = self.units.get(target.id)
        if unit is None:
            unit = self.units[target.id] = Unit(target.id, target.http_url, target.grpc_target)
            self._all.append(unit)
            self.policy.added(unit)
            self.metrics.add_unit(unit.id)
        return unit

    def unit_views(self) -> Iterator[UnitView]:
        """Every unit's state, report age and load as this gateway sees them now, for
        the per-unit series at scrape time. A LOST or UNKNOWN unit has no load (a dead
        unit must not read as idle), and its report age keeps growing."""
        age_at, stale_after_s, estimate = (
            self.age_at(self._clock()),
            self.settings.stale_after_s,
            self.view.estimate,
        )
        for unit in list(self.units.values()):
            state, _ = unit.view(age_at, stale_after_s)
            lost = state in ("LOST", "UNKNOWN")
            yield unit.id, state, unit.report_age(age_at), None if lost else estimate(unit)

    # --- choosing ---------------------------------------------------------------

    def candidates(self, exclude: Collection[str] = (), model: str | None = None) -> list[Unit]:
        now, s = self._clock(), self.settings
        age_at = self._age_at(now)
        return [
            u
            for u in self.units.values()
            if u.id not in exclude
            and self.view.available(u, now, s.stale_after_s, age_at)
            and u.serves(model)
        ]

    def serving(self, exclude: Collection[str] = (), model: str | None = None) -> list[Unit]:
        now = self._clock()
        age_at = self._age_at(now)
        return [
            u
            for u in self.units.values()
            if u.id not in exclude
            and u.serving(now, self.settings.stale_after_s, age_at)
            and u.serves(model)
        ]

    # --- what a request needs -----------------------------------------------------

    @property
    def reads_requests(self) -> bool:
        """Whether choosing needs the request's model or prompt: a policy that reads
        prompts, or units that do not all serve the same models."""
        return self.policy.reads_prompt or len(self._model_sets) > 1

    def check_model(self, model: str | None) -> None:
        """Raises NotFound (model_not_found) when no unit's report lists ``model``."""
        if model is None or self._models[model] or self._model_sets[()]:
            return
        raise NotFound(f"the model '{model}' does not exist", param="model", code="model_not_found")

    @property
    def any_reported_serving(self) -> bool:
        """Whether some unit's last report says SERVING, however old: kept as a count
        as reports arrive, not a pass over every unit."""
        return self._serving_reports > 0

    def _count_serving(self, report: LoadReport | None, n: int) -> None:
        if report is not None and report.state is UnitState.SERVING:
            self._serving_reports += n

    def _count_models(self, report: LoadReport | None, n: int) -> None:
        if report is None:
            return
        self._model_sets[report.models] += n
        if self._model_sets[report.models] <= 0:
            del self._model_sets[report.models]
        for model in report.models:
            self._models[model] += n
            if self._models[model] <= 0:
                del self._models[model]

    def _age_at(self, now: float) -> float:
        paused_at = self._aging_paused_at
        return now if paused_at is None else min(now, paused_at)

    def age_at(self, now: float) -> float:
        """When a report's age is taken at ``now``: now, or the time the load source went
        down (``pause_aging``). Whatever shows a unit's state reads it by this, as the
        router routes by it."""
        return self._age_at(now)

    def pick(self, exclude: Collection[str] = (), want: Want = NO_WANT) -> Unit | None:
        now = self._clock()
        candidates = self._candidates
        candidates.exclude = exclude
        candidates.now = now
        candidates.age_at = self._age_at(now)
        # Units of different models: the policy passes over those serving this one.
        model = want.model
        candidates.model = None if model is None or len(self._model_sets) < 2 else model
        unit = self.policy.choose(want, candidates)
        if unit is None and want.rank < BATCH and want.tenant:
            unit = self._over_capacity(exclude, want)
        if unit is not None:
            unit.inflight += 1
            unit.started_since_report += 1
            unit.routed += 1
            self.policy.moved(unit)
        return unit

    def _rank_at_unit(self, rank: int) -> int:
        """The class a unit grants a request of class ``rank`` from this gateway."""
        return max(rank, STANDARD) if not self.signs_interactive else rank

    def over_capacity(
        self, rank: int, exclude: Collection[str] = (), model: str | None = None
    ) -> list[Unit]:
        """The SERVING units full to capacity that still take a request of class
        ``rank`` (above batch) over it: their engine gives it the slot of a request of a
        lower class (``Unit.over_capacity_for``, sidecar.priority_headroom)."""
        rank = self._rank_at_unit(rank)
        if rank >= BATCH:
            return []
        now, s, estimate = self._clock(), self.settings, self.view.estimate
        age_at = self._age_at(now)
        return [
            u
            for u in self.units.values()
            if u.id not in exclude
            and u.serving(now, s.stale_after_s, age_at)
            and u.serves(model)
            and u.over_capacity_for(rank, estimate(u))
        ]

    def _over_capacity(self, exclude: Collection[str], want: Want) -> Unit | None:
        """A unit for ``want`` over capacity (``over_capacity``): the least loaded."""
        units = self.over_capacity(want.rank, exclude, want.model)
        return least_loaded(units, self._rng, self.view) if units else None

    async def acquire(self, exclude: Collection[str] = (), want: Want = NO_WANT) -> Unit:
        """A unit for one attempt; waits while every SERVING unit it may take is full.

        Raises NoUnit when no SERVING unit (serving the request's model) is left to try,
        Overloaded past the queue's bounds (or shed for an interactive request).
        """
        if not self.queue.total or self._may_pass(exclude, want):
            unit = self.pick(exclude, want)
            if unit is not None:
                if want.cost and not exclude:  # a retry or migration was charged already
                    self.queue.charge(want.tenant, want.cost)
                return unit
        if not self.serving(exclude, want.model):
            raise NoUnit(_none_serving(want.model), code="no_unit_available")
        return await self._wait(exclude, want)

    def _may_pass(self, exclude: Collection[str], want: Want) -> bool:
        """False if a waiter of its class or above could take a unit it could take too
        (a unit is free while waiters wait when they may not take it: a retry excludes
        the units it tried, a model another serves)."""
        free = self.candidates(exclude, want.model)
        if not free:
            return False  # nothing to take: it waits
        for waiter in self.queue.ahead(want.rank):
            for unit in free:
                if _may_take(waiter, unit):
                    return False
        return True

    def charge(self, tenant: str, tokens: int) -> None:
        """Count ``tokens`` more (negative: fewer) as served to ``tenant``: a request's
        use, settled when it ends, against the estimate charged when a unit took it."""
        self.queue.charge(tenant, tokens)

    async def _wait(self, exclude: Collection[str], want: Want) -> Unit:
        loop = asyncio.get_running_loop()
        queue = self.queue
        waiter = Waiter(want.tenant, want.rank, want.cost, loop.create_future(), exclude,
                        want.model)  # fmt: skip
        shed = queue.push(waiter)  # raises QueueFull
        self.queued += 1
        if shed is not None and shed.future is not None and not shed.future.done():
            shed.future.set_result(None)  # it raises its 429 shed
        self.wake()
        wait_s = queue.max_wait_s[want.rank]
        try:
            async with asyncio.timeout(wait_s):
                while True:
                    future = waiter.future
                    assert future is not None
                    await future
                    if waiter.shed:
                        raise Overloaded(
                            "every unit is full and this batch request gave its place in "
                            "the wait queue to an interactive one",
                            code="shed",
                        )
                    unit = self.pick(exclude, want)
                    if unit is not None:
                        if want.cost and not exclude:
                            queue.charge(want.tenant, want.cost)
                        return unit
                    if not self.serving(exclude, want.model):
                        raise NoUnit(_none_serving(want.model), code="no_unit_available")
                    waiter = waiter.again(loop.create_future())
                    queue.requeue(waiter)  # keep its place in line
        except TimeoutError:
            raise Overloaded(
                f"every unit stayed full for {wait_s:g} s", code="queue_timeout"
            ) from None
        finally:
            # Still in line unless a unit (or NoUnit) was handed to it: a client that
            # left or timed out has a cancelled future, and must not count in ``waiting``.
            queue.remove(waiter)
            self.wake()  # the next in line may find room too

    def wake(self) -> None:
        """Hand a unit that can take a request to the first waiter in fair order that may
        take it (a retried request excludes the units it tried; those behind it need not
        wait)."""
        queue = self.queue
        if not queue.total:
            return
        free = self.candidates()
        # Full units that take a class above batch over capacity, found once per class.
        over: dict[int, list[Unit]] = {}
        if not free:
            # Only a waiting class above batch may go, and only where some unit lets it
            # over: else nothing to do (not a pass over every waiter at each report).
            for rank in (INTERACTIVE, STANDARD):
                if queue.tenants_waiting(rank):
                    over[rank] = self.over_capacity(rank)
            if not any(over.values()):
                return

        def may_go(w: Waiter) -> bool:
            if not _ready(w):
                return False
            if any(_may_take(w, u) for u in free):
                return True
            if w.rank >= BATCH or not w.tenant:
                return False
            units = over.get(w.rank)
            if units is None:  # a waiter that may not take the free units
                units = over[w.rank] = self.over_capacity(w.rank)
            return any(_may_take(w, u) for u in units)

        waiter = queue.first(may_go)
        if waiter is not None and waiter.future is not None:
            queue.remove(waiter)
            waiter.future.set_result(None)

    def release_stranded(self) -> None:
        """Wake the waiters that no SERVING unit is left for (the last one stopped, went
        stale or lost its reports): they raise NoUnit at once, a 503 rather than a
        queue_timeout after waiting for a unit that cannot come."""
        queue = self.queue
        if not queue.total:
            return
        serving = self.serving()
        for waiter in list(queue):
            if _ready(waiter) and not any(_may_take(waiter, u) for u in serving):
                queue.remove(waiter)
                if waiter.future is not None:
                    waiter.future.set_result(None)

    @property
    def waiting(self) -> int:
        return self.queue.total

    # --- outcomes and reports -----------------------------------------------------

    def release(self, unit: Unit, outcome: Outcome) -> None:
        unit.inflight -= 1
        unit.finished_since_report += 1
        if outcome is Outcome.FAILED:
            unit.failures += 1
            if unit.failures >= self.settings.eject_after or unit.probation:
                self._eject(unit)
        elif outcome is Outcome.OK:
            unit.failures = 0
            if unit.ejections:
                self._healed(unit)
            if self._held_back:
                self._held_back.discard(unit.id)
        self.policy.moved(unit)  # after the outcome: an answer ends probation (capacity 1)
        self.wake()  # no _changed: a release changes no state (gauges refresh on a timer)

    def ahead(self, unit: Unit) -> int:
        """The requests ``unit`` holds besides one just started there (``pick``)."""
        return max(0, self.view.estimate(unit) - 1)

    def sent(self, unit: Unit, want: Want, attempt: Timed) -> Sent | None:
        """An attempt is sent to ``unit`` (just acquired there): for a policy that
        ``learns``, what it noted (its predicted TTFT: ``Sent.predicted_s``)."""
        return self.policy.sent(unit, want, attempt)

    def answered(
        self, unit: Unit, want: Want, sent: Sent, ok: bool, per_token_s: float = -1.0
    ) -> None:
        """The attempt ``sent`` on ``unit`` ended (``ok``: the unit answered), its
        tokens after the first ``per_token_s`` apart (-1: not known): for a policy
        that ``learns``."""
        self.policy.answered(unit, want, sent, ok, per_token_s)

    def saturation(self) -> float:
        """The fleet's load against what it can hold within the latency objective:
        (estimated outstanding on the SERVING units + requests waiting in the gateway)
        / the sum of the policy's ``limit`` over those units (each unit's capacity, or
        fewer where policy latency learnt that more would miss gateway.slo_ttft_s).
        0 idle, 1 full, above 1 past it; with no unit SERVING, 1 if a request waits,
        else 0."""
        now, stale_after_s = self._clock(), self.settings.stale_after_s
        age_at = self._age_at(now)
        load, limit = float(self.waiting), 0.0
        estimate, policy_limit = self.view.estimate, self.policy.limit
        for unit in self.units.values():
            if unit.serving(now, stale_after_s, age_at):
                load += estimate(unit)
                limit += policy_limit(unit)
        if limit <= 0.0:
            return 1.0 if load > 0 else 0.0
        return load / limit

    def _eject(self, unit: Unit) -> None:
        """Eject for eject_s times the ejections in a row, up to max_eject_s (Envoy's
        outlier detection): a unit that fails again once back stays out longer. Back, it
        is on probation (capacity 1) until a request there is answered, and its first
        failure ejects it again (a half-open circuit breaker). A failure of a request
        sent before the ejection extends it without adding one."""
        now, s = self._clock(), self.settings
        if now >= unit.ejected_until:
            if not self._may_eject(unit, now):
                unit.failures = 0
                return
            unit.ejections += 1
            log.warning("unit %s ejected for %g s after %d consecutive failures (ejection "
                        "%d in a row)", unit.id, self._eject_time(unit), unit.failures,
                        unit.ejections)  # fmt: skip
        self._held_back.discard(unit.id)
        unit.ejected_until = now + self._eject_time(unit)
        unit.decay_at = unit.ejected_until + s.eject_s
        unit.failures = 0
        unit.probation = True  # once back: one request at a time until one is answered

    def _eject_time(self, unit: Unit) -> float:
        s = self.settings
        return min(s.eject_s * unit.ejections, max(s.max_eject_s, s.eject_s))

    def _healed(self, unit: Unit) -> None:
        """The unit answered: every eject_s since its last ejection ended (the first one
        excepted) takes one ejection off the count, so that a unit that failed long ago
        is ejected for eject_s again. A unit that never answers never heals this way."""
        unit.probation = False
        now = self._clock()
        if now >= unit.decay_at:
            healed = int((now - unit.decay_at) // self.settings.eject_s) + 1
            unit.ejections = max(0, unit.ejections - healed)
            unit.decay_at = now + self.settings.eject_s

    def _may_eject(self, unit: Unit, now: float) -> bool:
        """Within gateway.max_ejection_percent of the units SERVING by their reports
        (ejected or not): ejecting every unit would turn every request into a 503."""
        s, age_at = self.settings, self._age_at(now)
        serving = [
            u for u in self.units.values()
            if u.state is UnitState.SERVING and age_at - u.report_at < s.stale_after_s
        ]  # fmt: skip
        if unit not in serving:
            return True  # it takes no request either way
        ejected = sum(1 for u in serving if now < u.ejected_until)
        if ejected + 1 <= len(serving) * s.max_ejection_percent // 100:
            return True
        if unit.id not in self._held_back:
            self._held_back.add(unit.id)
            log.warning("unit %s failed %d times in a row but is not ejected: %d of %d SERVING "
                        "units are ejected already (gateway.max_ejection_percent %d)",
                        unit.id, unit.failures, ejected, len(serving),
                        s.max_ejection_percent)  # fmt: skip
        return False

    def apply_report(
        self, unit_id: str, report: LoadReport, blocks: PrefixBlocks | None = None
    ) -> None:
        """A unit's report. Its prefix blocks go to the policy and are not kept: apart
        in ``blocks`` (``LoadReport.read_pb``, ``read_dict``), or in the report."""
        unit = self.units.get(unit_id)
        if unit is None:
            return
        if (
            unit.report is not None
            and report.seq < unit.report.seq
            and report.timestamp_ms <= unit.report.timestamp_ms
        ):
            return  # an older report that arrived late
        before = unit.state
        if unit.lost is not None:
            log.info("unit %s: load reports again (was %s)", unit_id, unit.lost)
            unit.lost = None
        if report.prefix_blocks is not None:  # kept, they would hold a thousand numbers a unit
            blocks = report.prefix_blocks
            report = replace(report, prefix_blocks=None)
        self.policy.reported(unit, report, blocks)
        self._count_models(unit.report, -1)
        self._count_models(report, +1)
        self._count_serving(unit.report, -1)
        self._count_serving(report, +1)
        unit.apply(report, self._clock())
        self.policy.moved(unit)
        if report.state != before:
            log.info("unit %s: %s -> %s", unit_id, before or "unknown", report.state)
            if before is UnitState.SERVING:
                self.release_stranded()
        self.wake()
        self._changed(unit)

    def pause_aging(self) -> None:
        """The load source itself is down (Redis unreachable), not the units.

        A report's age counts only the time its source was up: until ``resume_aging``
        a unit whose report was fresh keeps being routed on it plus this gateway's own
        counts, and one already stale stays stale. Passive health still ejects a unit
        that fails.
        """
        if self._aging_paused_at is None:
            self._aging_paused_at = self._clock()

    def resume_aging(self) -> None:
        """The load source is back (and has re-read what it could): reports age again,
        from where they stopped. One the source no longer has goes stale in
        ``stale_after_s`` unless its unit reports by then."""
        paused_at, self._aging_paused_at = self._aging_paused_at, None
        if paused_at is None:
            return
        down_s = self._clock() - paused_at
        for unit in self.units.values():
            if unit.report is not None and unit.report_at <= paused_at:
                unit.report_at += down_s

    def stopped(self, unit: Unit) -> str | None:
        """Why the router routes nothing to ``unit`` whatever its load (None: it may):
        ejected, NOT_SERVING, or LOST (no report, or one older than stale_after_s by
        ``age_at``). A DRAINING unit is not stopped: it finishes what it holds."""
        now = self._clock()
        if now < unit.ejected_until:
            return "ejected"
        report = unit.report
        if report is None:
            return f"LOST ({unit.lost})" if unit.lost else "LOST"
        if report.state is UnitState.NOT_SERVING:
            return "NOT_SERVING"
        if self._age_at(now) - unit.report_at >= self.settings.stale_after_s:
            return "LOST (no load report)"
        return None

    @property
    def aging_paused(self) -> bool:
        return self._aging_paused_at is not None

    def forget_report(self, unit_id: str, why: str) -> None:
        """The load source lost the unit: route nothing there until it reports again.

        The unit shows as LOST (UNKNOWN if it never reported) with ``why``; its report
        age keeps growing. Logged once per change of reason, not once per retry.
        """
        unit = self.units.get(unit_id)
        if unit is None:
            return
        self.unreachable(unit, why)
        if unit.report is not None:
            self._count_models(unit.report, -1)
            self._count_serving(unit.report, -1)
            unit.report = None
            self.release_stranded()
            self._changed(unit)

    def unreachable(self, unit: Unit, why: str) -> None:
        """The load source could not reach the unit (its last report, if any, ages out).

        Logged once per change of reason: a WARNING once the unit is wrong (it reported
        before, or has not for ``stale_after_s`` since this gateway started), INFO while
        it may still be starting (``unitproxy up`` starts the gateway first)."""
        short = reason(why)
        wrong = (
            not math.isinf(unit.report_at)
            or self._clock() - self._started >= self.settings.stale_after_s
        )
        if unit.lost != short or (wrong and not unit.lost_warned):
            detail = why if short == why else f"{short}: {why}"
            level = logging.WARNING if wrong else logging.INFO
            log.log(level, "unit %s: no load report (%s); not routing there", unit.id, detail)
            unit.lost = short
            unit.lost_warned = wrong

    def _changed(self, unit: Unit) -> None:
        if self._on_change is not None:
            self._on_change(unit)


def least_loaded(units: list[Unit], rng: random.Random, view: LoadView) -> Unit:
    """The least estimated outstanding / capacity of ``units`` (not empty); ties at
    random."""
    loads = [view.load(u) for u in units]
    lowest = min(loads)
    tied = [u for u, load in zip(units, loads, strict=True) if load == lowest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _may_take(waiter: Waiter, unit: Unit) -> bool:
    return unit.id not in waiter.exclude and unit.serves(waiter.model)


def _ready(waiter: Waiter) -> bool:
    """Still waiting for a unit: not handed one, nor gone (a cancelled future)."""
    future = waiter.future
    return future is not None and not future.done()


def _none_serving(model: str | None) -> str:
    return "no unit is SERVING" if model is None else f"no unit serving '{model}' is SERVING"

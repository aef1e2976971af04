"""The gateway's routing state: units, their load, passive health, and the wait queue.

``acquire`` picks a unit for one attempt (or waits in a bounded FIFO queue while every
SERVING unit is full) and counts the request as started there; ``release`` counts it
finished and records the outcome for passive health. Reports from the load source
arrive through ``apply_report``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Iterator
from enum import Enum

from prometheus_client import CollectorRegistry

from proxy.errors import NotFound, Overloaded, Unavailable
from proxy.gateway.index import LeastLoaded, sample_available
from proxy.gateway.policies import POLICIES, prefix_affinity
from proxy.gateway.prefix import EngineFeedback, PrefixIndex, Want
from proxy.gateway.units import AS_REPORTED, CORRECTED, LoadView, Unit, reason
from proxy.load import LoadReport, UnitState
from proxy.metrics import GatewayMetrics, UnitView
from proxy.settings import GatewaySettings, UnitTarget

log = logging.getLogger(__name__)

SAMPLED = {"p2c": 2, "random": 1}  # policies that look at this many units drawn at random


class Outcome(Enum):
    OK = "ok"  # the unit answered (any status that is not its own failure)
    REFUSED = "refused"  # 429 or 503: the unit said no before doing work
    FAILED = "failed"  # connection error or 5xx: counts toward ejection
    CANCELLED = "cancelled"  # the client went away: says nothing about the unit


class NoUnit(Unavailable):
    """No SERVING unit is left to try (apart from those excluded)."""


NO_WANT = Want()


class _Waiter:
    """A request in the wait queue, and the units it must not be given."""

    __slots__ = ("exclude", "future", "model", "seq")

    def __init__(
        self,
        future: asyncio.Future[None],
        exclude: Collection[str],
        seq: int,
        model: str | None = None,
    ):
        self.future = future
        self.exclude = exclude
        self.seq = seq  # its place in line
        self.model = model

    def may_take(self, unit: Unit) -> bool:
        return unit.id not in self.exclude and unit.serves(self.model)


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
        # What the router observes it records here itself (None: a registry of its own).
        self.metrics = metrics or GatewayMetrics(CollectorRegistry())
        self.units: dict[str, Unit] = {}
        self._select = POLICIES[settings.policy]
        # How every choice reads a unit's load (gauges and /units read it too).
        self.view = CORRECTED if settings.correct_load else AS_REPORTED
        self._rng = rng or random.Random()
        self._clock = clock
        self._started = clock()  # a unit not reporting yet is wrong only after a grace
        self._turn = 0
        self._waiters: deque[_Waiter] = deque()
        self._arrivals = itertools.count()
        self._on_change = on_change
        self._aging_paused_at: float | None = None
        self.prefix: PrefixIndex | None = None
        self.feedback: EngineFeedback | None = None
        self._mean = 0.0  # policy prefix: the fleet's mean load at this choice
        if settings.policy == "prefix":
            self.prefix = PrefixIndex(
                settings.prefix_chunk_chars, settings.prefix_max_blocks, settings.prefix_ttl_s
            )
            if settings.prefix_engine_feedback:
                self.feedback = EngineFeedback(self.prefix)
        # How many units list each model, and how many list none (serve any): the
        # gateway reads a request's model only when the units differ.
        self._models: Counter[str] = Counter()
        self._model_sets: Counter[tuple[str, ...]] = Counter()
        self._held_back: set[str] = set()  # units the ejection cap kept in (logged once)
        self._serving_reports = 0  # units whose last report says SERVING (fresh or not)
        # Large fleets: lor keeps its units in a heap; p2c and random draw from all units
        # (proxy.gateway.index); round_robin walks on from where it stopped. None passes
        # over every unit per request.
        self._index = (
            # prefix: the least loaded bounds it, and the fleet's mean load bounds that
            LeastLoaded(self._rng, self.view, sums=settings.policy == "prefix")
            if settings.policy in ("lor", "prefix")
            else None
        )
        self._sample_k = SAMPLED.get(settings.policy, 0)
        self._all: list[Unit] = []
        self._cursor = 0  # round_robin: where the next turn starts in _all
        for target in targets:
            self.add(target)
        self.metrics.watch_units(self.unit_views, lambda: self.waiting)
        if self.feedback is not None:
            self.metrics.count_prefix_corrections(self.feedback.counts)

    def add(self, target: UnitTarget) -> Unit:
        unit = self.units.get(target.id)
        if unit is None:
            unit = self.units[target.id] = Unit(target.id, target.http_url, target.grpc_target)
            self._all.append(unit)
            self.metrics.add_unit(unit.id)
        return unit

    def unit_views(self) -> Iterator[UnitView]:
        """Every unit's state, report age and load as this gateway sees them now, for
        the per-unit series at scrape time. A LOST or UNKNOWN unit has no load (a dead
        unit must not read as idle), and its report age keeps growing."""
        now, stale_after_s, estimate = (
            self._clock(),
            self.settings.stale_after_s,
            self.view.estimate,
        )
        for unit in list(self.units.values()):
            state, _ = unit.view(now, stale_after_s)
            lost = state in ("LOST", "UNKNOWN")
            yield unit.id, state, unit.report_age(now), None if lost else estimate(unit)

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
        """Whether choosing needs the request's model or prompt: policy prefix, or units
        that do not all serve the same models."""
        return self.prefix is not None or len(self._model_sets) > 1

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

    def pick(self, exclude: Collection[str] = (), want: Want = NO_WANT) -> Unit | None:
        unit = self._choose(exclude, want)
        if unit is not None and self.prefix is not None and want.blocks:
            unit = self._by_prefix(unit, exclude, want)
        if unit is not None:
            self._turn += 1
            unit.inflight += 1
            unit.started_since_report += 1
            unit.routed += 1
            self._moved(unit)
        return unit

    def _choose(self, exclude: Collection[str], want: Want) -> Unit | None:
        s, view = self.settings, self.view
        if want.model is not None and len(self._model_sets) > 1:
            # Units of different models: a pass over those serving this one (the index
            # and the samples are over every unit).
            candidates = self.candidates(exclude, want.model)
            if self.prefix is not None:
                self._mean = _mean_load(candidates, view)
            return self._select(candidates, self._rng, self._turn, view)
        if self._index is not None and self.prefix is not None:
            self._mean = self._index.mean_load()
        if self._index is not None:
            now = self._clock()
            return self._index.least(now, s.stale_after_s, self._age_at(now), exclude)
        if self._sample_k:
            now = self._clock()
            age_at = self._age_at(now)

            def can_take(u: Unit) -> bool:
                return u.id not in exclude and view.available(u, now, s.stale_after_s, age_at)

            drawn = sample_available(self._all, self._sample_k, can_take, self._rng)
            if drawn is not None:
                return self._select(drawn, self._rng, self._turn, view)
        if s.policy == "round_robin":
            return self._next_in_turn(exclude)
        return self._select(self.candidates(exclude), self._rng, self._turn, view)

    def _next_in_turn(self, exclude: Collection[str]) -> Unit | None:
        """round_robin: the next unit after the last one chosen that can take a request."""
        now, s, units = self._clock(), self.settings, self._all
        age_at = self._age_at(now)
        for k in range(len(units)):
            unit = units[(self._cursor + k) % len(units)]
            if unit.id not in exclude and self.view.available(unit, now, s.stale_after_s, age_at):
                self._cursor = (self._cursor + k + 1) % len(units)
                return unit
        return None

    def _moved(self, unit: Unit) -> None:
        """The unit's estimated load changed."""
        if self._index is not None:
            self._index.update(unit)

    def _by_prefix(self, least: Unit, exclude: Collection[str], want: Want) -> Unit:
        """Policy prefix, given the least loaded candidate: looks only at the units that
        hold a prefix of the prompt, not at the whole fleet."""
        assert self.prefix is not None
        now, s = self._clock(), self.settings
        age_at, units = self._age_at(now), self.units

        def can_take(unit_id: str) -> bool:
            unit = units.get(unit_id)
            return (
                unit is not None
                and unit_id not in exclude
                and self.view.available(unit, now, s.stale_after_s, age_at)
                and unit.serves(want.model)
            )

        holders = (
            [units[i] for i in ids if can_take(i)]
            for _, ids in self.prefix.matches(want.blocks, now)
        )
        unit = prefix_affinity(
            least, holders, self.view, self._mean, s.prefix_balance, s.prefix_slack
        )
        if self.feedback is not None:
            self.feedback.sent(unit.id, want.blocks, want.chars)
        self.prefix.record(unit.id, want.blocks, now)
        return unit

    async def acquire(self, exclude: Collection[str] = (), want: Want = NO_WANT) -> Unit:
        """A unit for one attempt; waits while every SERVING unit it may take is full.

        Raises NoUnit when no SERVING unit (serving the request's model) is left to try,
        Overloaded past the queue's bounds.
        """
        if not self._waiters or not self._may_pass(exclude, want.model):
            unit = self.pick(exclude, want)
            if unit is not None:
                return unit
        if not self.serving(exclude, want.model):
            raise NoUnit(_none_serving(want.model), code="no_unit_available")
        if len(self._waiters) >= self.settings.queue_size:
            raise Overloaded(
                f"every unit is full and {len(self._waiters)} requests already wait",
                code="queue_full",
            )
        return await self._wait(exclude, want)

    def _may_pass(self, exclude: Collection[str], model: str | None) -> bool:
        """False if a waiter ahead could take a unit this request could take too."""
        free = self.candidates(exclude, model)
        return not any(waiter.may_take(u) for waiter in self._waiters for u in free)

    async def _wait(self, exclude: Collection[str], want: Want) -> Unit:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), exclude, next(self._arrivals), want.model)
        self._waiters.append(waiter)
        self.wake()
        try:
            async with asyncio.timeout(self.settings.queue_timeout_s):
                while True:
                    await waiter.future
                    unit = self.pick(exclude, want)
                    if unit is not None:
                        return unit
                    if not self.serving(exclude, want.model):
                        raise NoUnit(_none_serving(want.model), code="no_unit_available")
                    waiter = _Waiter(loop.create_future(), exclude, waiter.seq, want.model)
                    self._insert(waiter)  # keep its place in line
        except TimeoutError:
            raise Overloaded(
                f"every unit stayed full for {self.settings.queue_timeout_s:g} s",
                code="queue_timeout",
            ) from None
        finally:
            if not waiter.future.done():
                self._waiters.remove(waiter)
            self.wake()  # the next in line may find room too

    def _insert(self, waiter: _Waiter) -> None:
        at = next((i for i, w in enumerate(self._waiters) if w.seq > waiter.seq), None)
        if at is None:
            self._waiters.append(waiter)
        else:
            self._waiters.insert(at, waiter)

    def wake(self) -> None:
        """Hand a unit that can take a request to the first waiter that may take it (a
        retried request excludes the units it tried; those behind it need not wait)."""
        while self._waiters and self._waiters[0].future.done():
            self._waiters.popleft()
        if not self._waiters:
            return
        free = self.candidates()
        if not free:
            return
        for waiter in self._waiters:
            if not waiter.future.done() and any(waiter.may_take(u) for u in free):
                self._waiters.remove(waiter)
                waiter.future.set_result(None)
                return

    def release_stranded(self) -> None:
        """Wake the waiters that no SERVING unit is left for (the last one stopped, went
        stale or lost its reports): they raise NoUnit at once, a 503 rather than a
        queue_timeout after waiting for a unit that cannot come."""
        if not self._waiters:
            return
        serving = self.serving()
        for waiter in list(self._waiters):
            if not waiter.future.done() and not any(waiter.may_take(u) for u in serving):
                self._waiters.remove(waiter)
                waiter.future.set_result(None)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    # --- outcomes and reports -----------------------------------------------------

    def release(self, unit: Unit, outcome: Outcome) -> None:
        unit.inflight -= 1
        unit.finished_since_report += 1
        self._moved(unit)
        if outcome is Outcome.FAILED:
            unit.failures += 1
            if unit.failures >= self.settings.eject_after:
                self._eject(unit)
        elif outcome is Outcome.OK:
            unit.failures = 0
            if self._held_back:
                self._held_back.discard(unit.id)
        self.wake()  # no _changed: a release changes no state (gauges refresh on a timer)

    def _eject(self, unit: Unit) -> None:
        now = self._clock()
        if now >= unit.ejected_until:
            if not self._may_eject(unit, now):
                unit.failures = 0
                return
            log.warning("unit %s ejected for %g s after %d consecutive failures",
                        unit.id, self.settings.eject_s, unit.failures)  # fmt: skip
        self._held_back.discard(unit.id)
        unit.ejected_until = now + self.settings.eject_s
        unit.failures = 0

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

    def apply_report(self, unit_id: str, report: LoadReport) -> None:
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
        if self.prefix is not None and _cache_lost(unit.report, report):
            self.prefix.forget(unit_id)
            if self.feedback is not None:
                self.feedback.forget(unit_id)
        if self.feedback is not None:
            self.feedback.report(
                unit_id,
                report.prefix_cache_queries,
                report.prefix_cache_hits,
                report.prefix_cache_resets,
                self._clock(),
            )
        self._count_models(unit.report, -1)
        self._count_models(report, +1)
        self._count_serving(unit.report, -1)
        self._count_serving(report, +1)
        unit.apply(report, self._clock())
        self._moved(unit)
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


def _mean_load(units: Iterable[Unit], view: LoadView) -> float:
    """The units' estimated outstanding, plus one request, over their capacity."""
    outstanding, capacity = 1, 0
    for unit in units:
        outstanding += view.estimate(unit)
        capacity += unit.capacity
    return outstanding / capacity if capacity else float("inf")


def _none_serving(model: str | None) -> str:
    return "no unit is SERVING" if model is None else f"no unit serving '{model}' is SERVING"


def _cache_lost(before: LoadReport | None, after: LoadReport) -> bool:
    """The unit's KV cache is likely gone: its sidecar restarted (seq went back) or it
    left SERVING for NOT_SERVING (a failed node; the engine may be restarted)."""
    if before is None:
        return False
    restarted = after.seq < before.seq and after.timestamp_ms > before.timestamp_ms
    failed = before.state is UnitState.SERVING and after.state is UnitState.NOT_SERVING
    return restarted or failed

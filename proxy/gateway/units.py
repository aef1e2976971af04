"""What a gateway knows about one unit, how its load is read, and the one definition
of "can take a request" (``LoadView.available``)."""

from __future__ import annotations

import math
from collections.abc import Callable

from proxy.load import (
    OUTSTANDING_BATCH,
    OUTSTANDING_STANDARD,
    PRIORITY_HEADROOM,
    LoadReport,
    UnitState,
)

# The states /units and unitproxy_gateway_unit_state give a unit: the state of its last
# fresh report, LOST once its reports stopped (stream broken, unreachable, or stale),
# UNKNOWN before it ever reported.
VIEW_STATES = (*(s.value for s in UnitState), "LOST", "UNKNOWN")

# Why a unit cannot be reached, from the text of the error: the short names operators
# look for first (the full text is logged).
_REASONS = (
    ("refused", "connection refused"),
    ("tls", "TLS handshake failed"),
    ("ssl", "TLS handshake failed"),
    ("certificate", "TLS handshake failed"),
    ("resolv", "name not resolved"),
    ("name not found", "name not resolved"),
    ("name or service not known", "name not resolved"),
    ("deadline", "timed out"),
    ("timed out", "timed out"),
    ("timeout", "timed out"),
    ("no report for", "timed out"),
    ("reset", "connection reset"),
    ("http/2", "not a unitproxy gRPC port"),
)


class Unit:
    """One unit as this gateway knows it. (A plain class, not a dataclass: compiled by
    mypyc, its fields are read straight from the object on every request.)"""

    __slots__ = (
        "decay_at",
        "ejected_until",
        "ejections",
        "failures",
        "finished_since_report",
        "grpc_target",
        "http_url",
        "id",
        "inflight",
        "lost",
        "lost_warned",
        "probation",
        "report",
        "report_at",
        "routed",
        "started_since_report",
    )  # fmt: skip

    def __init__(self, id: str, http_url: str, grpc_target: str):
        self.id = id
        self.http_url = http_url
        self.grpc_target = grpc_target
        self.report: LoadReport | None = None
        self.report_at = float("-inf")  # monotonic time the report arrived
        self.inflight = 0  # this gateway's requests on the unit right now
        self.started_since_report = 0
        self.finished_since_report = 0
        self.failures = 0  # consecutive connection errors and 5xx
        self.ejected_until = 0.0
        self.ejections = 0  # ejections in a row: the next one lasts eject_s times one more
        self.decay_at = 0.0  # an answer after this takes one off ``ejections``
        self.probation = False  # back from an ejection, not answered yet: one at a time
        self.routed = 0
        self.lost: str | None = None  # why the load source cannot reach the unit (None: it can)
        self.lost_warned = False  # that reason was logged as a WARNING

    def __repr__(self) -> str:
        return f"Unit({self.id!r}, {self.http_url!r}, {self.grpc_target!r})"

    @property
    def state(self) -> UnitState | None:
        return None if self.report is None else self.report.state

    @property
    def capacity(self) -> int:
        """Its report's, but 1 on probation: a unit back from an ejection takes one
        request at a time until one is answered (a black hole swallows one, not all)."""
        report = self.report
        if report is None:
            return 0
        return 1 if self.probation else report.capacity

    def over_capacity_for(self, rank: int, estimate: int) -> bool:
        """Whether the unit, holding ``estimate`` requests, takes one of class ``rank``
        (0 interactive, 1 standard) over its capacity, as its sidecar admits it: within
        the priority_headroom it reports, while the requests of that class and above
        (those outstanding less the lower classes' by its last report) number fewer than
        its capacity, so that its engine gives it a lower class's slot (every request
        that ended there since the report counted as one of those). A unit without
        server.resume_secret reports no outstanding_standard: it grants interactive as
        standard, and only batch is below it."""
        report = self.report
        if report is None or self.probation or rank > 1:
            return False
        named = report.named_metrics
        capacity = report.capacity
        if estimate >= capacity + named.get(PRIORITY_HEADROOM, 0.0):
            return False
        lower = named.get(OUTSTANDING_BATCH, 0.0)
        if rank == 0:
            lower += named.get(OUTSTANDING_STANDARD, 0.0)
        # Those lower-class requests as of the report: any request that ended since may
        # have been one of them (by their count alone this gateway would send a request
        # over capacity that the unit, its lower classes gone, refuses with a 429).
        lower -= self.finished_since_report
        return estimate - lower < capacity

    def metric(self, name: str, default: float = -1.0) -> float:
        """The named metric ``name`` of the unit's last report; ``default`` without."""
        report = self.report
        if report is None:
            return default
        return report.named_metrics.get(name, default)

    def view(self, age_at: float, stale_after_s: float) -> tuple[str, str | None]:
        """The unit's state as this gateway sees it, and why it is LOST or UNKNOWN.

        ``age_at``: the time its report's age is taken at, the router's ``age_at(now)``
        (earlier than now while the load source is down), so that a unit shows LOST
        exactly when the router stops routing to it."""
        if self.report is None:
            state = "UNKNOWN" if math.isinf(self.report_at) else "LOST"
            return state, self.lost or ("no load report yet" if state == "UNKNOWN" else None)
        age = age_at - self.report_at
        if age >= stale_after_s:
            return "LOST", self.lost or f"no load report for {age:.0f} s"
        return self.report.state.value, None

    def report_age(self, age_at: float) -> float:
        """Seconds since the last report arrived, growing while none comes (not while the
        load source is down: ``age_at`` as for ``view``); -1: none yet."""
        return -1.0 if math.isinf(self.report_at) else age_at - self.report_at

    def estimate(self) -> int:
        """Outstanding requests now. Where the report counts this gateway's requests
        apart (its watch named the gateway): the others' by the report, and this
        gateway's own in flight, which it always knows, whatever the report's flight
        (one sent before a request of its ended, arriving after, does not count it).
        Otherwise the last report, corrected by what this gateway started and finished
        there since, and never below its own in-flight count (so a stale report cannot
        make every request herd onto this unit)."""
        report = self.report
        if report is None:
            return self.inflight
        own = report.watcher_outstanding
        if own >= 0:
            return max(report.outstanding - own, 0) + self.inflight
        return max(
            report.outstanding + self.started_since_report - self.finished_since_report,
            self.inflight,
        )

    def serving(self, now: float, stale_after_s: float, age_at: float | None = None) -> bool:
        """SERVING by a fresh report and not ejected: it could take work if it had room.

        The report's age is taken at ``age_at`` (default ``now``); the router passes an
        earlier time while its load source is down, so that reports stop aging then.
        """
        return (
            self.report is not None
            and self.report.state is UnitState.SERVING
            and (now if age_at is None else age_at) - self.report_at < stale_after_s
            and now >= self.ejected_until
        )

    def serves(self, model: str | None) -> bool:
        """Serves ``model`` by its last report (a report that lists none: any model)."""
        report = self.report
        return model is None or report is None or not report.models or model in report.models

    def apply(self, report: LoadReport, now: float) -> None:
        self.report = report
        self.report_at = now
        self.started_since_report = 0
        self.finished_since_report = 0


def as_reported(unit: Unit) -> int:
    """Outstanding requests by the last report alone, not corrected by this gateway's
    own counts (``gateway.correct_load`` false: a baseline in benchmarks)."""
    return unit.report.outstanding if unit.report else 0


class LoadView:
    """How the gateway reads a unit's load. The router holds one, picked once from
    ``gateway.correct_load``, and every policy and the index read load through it."""

    __slots__ = ("estimate",)

    def __init__(self, estimate: Callable[[Unit], int]):
        self.estimate = estimate  # outstanding requests now

    def load(self, unit: Unit) -> float:
        """Estimated outstanding over capacity (infinite with no capacity)."""
        return self.estimate(unit) / unit.capacity if unit.capacity else float("inf")

    def available(
        self, unit: Unit, now: float, stale_after_s: float, age_at: float | None = None
    ) -> bool:
        """Can take a request now: serving, and below capacity by this estimate."""
        return unit.serving(now, stale_after_s, age_at) and self.estimate(unit) < unit.capacity


CORRECTED = LoadView(Unit.estimate)  # the default
AS_REPORTED = LoadView(as_reported)


def reason(error: str) -> str:
    """A short name for why a unit is unreachable (refused, timed out, TLS...)."""
    low = error.lower()
    for needle, name in _REASONS:
        if needle in low:
            return name
    return error.splitlines()[0][:120] if error else "unknown error"

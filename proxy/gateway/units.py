"""What a gateway knows about one unit, and the one definition of "can take a request"."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.load import LoadReport, UnitState


@dataclass(slots=True)
class Unit:
    id: str
    http_url: str
    grpc_target: str
    report: LoadReport | None = None
    report_at: float = float("-inf")  # monotonic time the report arrived
    inflight: int = 0  # this gateway's requests on the unit right now
    started_since_report: int = 0
    finished_since_report: int = 0
    failures: int = 0  # consecutive connection errors and 5xx
    ejected_until: float = 0.0
    routed: int = 0

    @property
    def state(self) -> UnitState | None:
        return None if self.report is None else self.report.state

    @property
    def capacity(self) -> int:
        return self.report.capacity if self.report else 0

    def estimate(self, correct: bool = True) -> int:
        """Outstanding requests now: the last report, corrected by what this gateway
        started and finished there since, and never below this gateway's own in-flight
        count (so a stale report cannot make every request herd onto this unit)."""
        reported = self.report.outstanding if self.report else 0
        if not correct:
            return reported
        return max(reported + self.started_since_report - self.finished_since_report, self.inflight)

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

    def available(
        self, now: float, stale_after_s: float, correct: bool = True, age_at: float | None = None
    ) -> bool:
        """Can take a request now: serving, and below capacity by our estimate."""
        return self.serving(now, stale_after_s, age_at) and self.estimate(correct) < self.capacity

    def load(self, correct: bool = True) -> float:
        return self.estimate(correct) / self.capacity if self.capacity else float("inf")

    def apply(self, report: LoadReport, now: float) -> None:
        self.report = report
        self.report_at = now
        self.started_since_report = 0
        self.finished_since_report = 0

"""How often a gateway asks each unit for load reports: the fleet's reports cost about
the same at any fleet size.

Each report costs the gateway CPU whatever it carries: in bench/scale at 1,000 units
on a busy 2-core machine, about 230 µs a WatchLoad message (grpcio's per-message
read), 90 µs a server-sent event, 400 µs a poll. A loaded unit changes load all the time and
would report every coalescing interval (5 ms), a heartbeat every second when idle: at
1,000 units that is up to 200,000 reports a second. So the gateway keeps a budget of
reports per second for its whole fleet (``report_budget_per_s``) and asks each of N
units for a report at most every N / budget seconds (WatchLoadRequest's
``min_interval_ms`` and ``heartbeat_ms``; poll: the poll interval). A change of unit
state still goes out at once. In between, the gateway's estimate of a unit's load is
its last report plus what the gateway itself started and finished there since, which
is exact for its own traffic; only other gateways' traffic waits for the next report.
A longer heartbeat needs a longer staleness bound: ``stale_after_s`` becomes at least
3 heartbeats.

However small the fleet, a unit reports load changes at most every
``report_min_interval_s`` (50 ms): at 1 to 12 units the budget alone would let every
unit report each 5 ms, and then the reports, not the requests, are what a gateway
(and its units) spend on at low concurrency (bench/overhead: about 40 % of the
gateway's CPU per non-streamed request at concurrency 1). A unit is never asked for
more than it sends by itself (5 ms coalescing, 1 s heartbeat).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.settings import GatewaySettings, SidecarSettings

UNIT_COALESCE_S = SidecarSettings.model_fields["report_coalesce_s"].default
UNIT_HEARTBEAT_S = SidecarSettings.model_fields["report_interval_s"].default
STALE_HEARTBEATS = 3  # a report older than this many heartbeats is stale


@dataclass(frozen=True, slots=True)
class ReportRates:
    min_interval_s: float = 0.0  # between reports of load changes; 0: the unit's own
    heartbeat_s: float = 0.0  # between reports at most; 0: the unit's own

    @property
    def min_interval_ms(self) -> int:
        return round(self.min_interval_s * 1000)

    @property
    def heartbeat_ms(self) -> int:
        return round(self.heartbeat_s * 1000)


def report_rates(settings: GatewaySettings, units: int) -> ReportRates:
    """What to ask each of ``units`` units for."""
    budget = settings.report_budget_per_s
    if units <= 0:
        return ReportRates()
    each_s = units / budget if budget > 0 else 0.0
    changes_s = max(each_s, settings.report_min_interval_s)
    return ReportRates(
        min_interval_s=changes_s if changes_s > UNIT_COALESCE_S else 0.0,
        heartbeat_s=each_s if each_s > UNIT_HEARTBEAT_S else 0.0,
    )


def scaled(settings: GatewaySettings, units: int | None = None) -> GatewaySettings:
    """The gateway's settings with the poll interval and staleness bound its report
    budget needs for ``units`` units (default: those configured)."""
    rates = report_rates(settings, len(settings.units) if units is None else units)
    each_s = max(rates.min_interval_s, rates.heartbeat_s)
    if each_s == 0:
        return settings
    return settings.model_copy(
        update={
            "poll_interval_s": max(settings.poll_interval_s, each_s),
            "stale_after_s": max(settings.stale_after_s, STALE_HEARTBEATS * rates.heartbeat_s),
        }
    )

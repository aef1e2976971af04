"""How many units meet the objectives: fleets simulated by doubling, then bisection.

Fleets of 1, 2, 4, ... units play the same traffic until one meets every objective;
then the count between the last that missed and the first that met is bisected. A
fleet that is clearly short stops early (once more requests missed the objective
than the percentile allows, it cannot meet it), so the short fleets cost little.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.settings import SimSettings
from proxy.plan.fleet import FleetSim, Outcome
from proxy.plan.workload import Request

PERCENTILE = 99.0  # of the objectives: --slo-ttft-p99, --slo-tpot-p99


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest rank: the smallest value with at least ``pct`` % of them at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]


@dataclass(frozen=True)
class Objectives:
    ttft_p99_s: float
    tpot_p99_s: float | None = None


@dataclass(frozen=True)
class Trial:
    """One fleet size, simulated: a row of the table."""

    units: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    goodput_per_s: float  # requests/s that met every objective
    meets: bool
    stopped: bool  # stopped early, already short of the objective
    prefix_hit_rate: float | None
    wall_s: float

    @classmethod
    def of(cls, outcome: Outcome, objectives: Objectives, wall_s: float) -> Trial:
        ttft99 = percentile(outcome.ttft_s, PERCENTILE)
        tpot99 = percentile(outcome.tpot_s, PERCENTILE)
        meets = (
            not outcome.stopped
            and len(outcome.ttft_s) == outcome.requests
            and ttft99 is not None
            and ttft99 <= objectives.ttft_p99_s
            and (objectives.tpot_p99_s is None or tpot99 is None or tpot99 <= objectives.tpot_p99_s)
        )
        span = outcome.duration_s or 1.0
        return cls(
            units=outcome.units,
            ttft_p50_s=percentile(outcome.ttft_s, 50.0),
            ttft_p99_s=ttft99,
            tpot_p50_s=percentile(outcome.tpot_s, 50.0),
            tpot_p99_s=tpot99,
            goodput_per_s=outcome.good / span,
            meets=meets,
            stopped=outcome.stopped,
            prefix_hit_rate=outcome.prefix_hit_rate,
            wall_s=wall_s,
        )


@dataclass(frozen=True)
class Plan:
    units: int | None  # the fewest that meet the objectives; None: none up to max_units
    trials: list[Trial]  # in the order tried
    requests: int
    duration_s: float
    offered_per_s: float
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "units": self.units,
            "requests": self.requests,
            "duration_s": self.duration_s,
            "offered_per_s": self.offered_per_s,
            "wall_s": round(self.wall_s, 3),
            "trials": [t.__dict__ for t in sorted(self.trials, key=lambda t: t.units)],
        }


def simulate(
    settings: SimSettings,
    units: int,
    capacity: int,
    traffic: Sequence[Request],
    objectives: Objectives,
    duration_s: float,
    seed: int = 0,
    stop_early: bool = True,
) -> Trial:
    began = time.perf_counter()
    sim = FleetSim(
        settings,
        units,
        capacity,
        slo_ttft_s=objectives.ttft_p99_s,
        slo_tpot_s=objectives.tpot_p99_s,
        percentile=PERCENTILE,
        seed=seed,
        stop_early=stop_early,
    )
    outcome = sim.run(traffic, duration_s)
    return Trial.of(outcome, objectives, time.perf_counter() - began)


def plan(
    settings: SimSettings,
    capacity: int,
    traffic: Sequence[Request],
    objectives: Objectives,
    duration_s: float,
    *,
    max_units: int,
    seed: int = 0,
    progress: Callable[[Trial], None] | None = None,
) -> Plan:
    """The fewest units that meet ``objectives`` for ``traffic``: doubling, then bisection."""
    began = time.perf_counter()
    trials: dict[int, Trial] = {}

    def meets(units: int) -> bool:
        if units not in trials:
            trial = simulate(settings, units, capacity, traffic, objectives, duration_s, seed)
            trials[units] = trial
            if progress is not None:
                progress(trial)
        return trials[units].meets

    short, enough = 0, 1
    while not meets(enough):
        short = enough
        if enough >= max_units:
            return _plan(None, trials, traffic, duration_s, began)
        enough = min(2 * enough, max_units)
    while enough - short > 1:
        middle = (short + enough) // 2
        if meets(middle):
            enough = middle
        else:
            short = middle
    return _plan(enough, trials, traffic, duration_s, began)


def _plan(
    units: int | None,
    trials: dict[int, Trial],
    traffic: Sequence[Request],
    duration_s: float,
    began: float,
) -> Plan:
    return Plan(
        units=units,
        trials=list(trials.values()),
        requests=len(traffic),
        duration_s=duration_s,
        offered_per_s=len(traffic) / duration_s if duration_s else 0.0,
        wall_s=time.perf_counter() - began,
    )


# -- the table ------------------------------------------------------------------------


def _ms(value: float | None, stopped: bool) -> str:
    if value is None:
        return "-"
    return f"{'>' if stopped else ''}{value * 1000:.0f}"


def table(result: Plan, objectives: Objectives) -> str:
    tpot_slo = objectives.tpot_p99_s
    lines = [
        f"objectives: TTFT p99 <= {objectives.ttft_p99_s * 1000:.0f} ms"
        + (f", TPOT p99 <= {tpot_slo * 1000:.0f} ms" if tpot_slo is not None else ""),
        f"traffic: {result.requests} requests over {result.duration_s:.0f} s "
        f"({result.offered_per_s:.2f}/s), simulated in {result.wall_s:.1f} s",
        "",
        f"{'units':>5}  {'TTFT p50':>9}  {'TTFT p99':>9}  {'TPOT p50':>9}  {'TPOT p99':>9}"
        f"  {'goodput/s':>9}  meets",
    ]
    for t in sorted(result.trials, key=lambda t: t.units):
        lines.append(
            f"{t.units:>5}  {_ms(t.ttft_p50_s, t.stopped):>9}  {_ms(t.ttft_p99_s, t.stopped):>9}"
            f"  {_ms(t.tpot_p50_s, t.stopped):>9}  {_ms(t.tpot_p99_s, t.stopped):>9}"
            f"  {t.goodput_per_s:>9.2f}  {'yes' if t.meets else 'no'}"
        )
    lines.append("(times in ms; >: the run stopped early, already past the objective)")
    if result.units is None:
        lines.append(f"no fleet of up to {max(t.units for t in result.trials)} units meets them")
    else:
        lines.append(f"units: {result.units}")
    return "\n".join(lines)

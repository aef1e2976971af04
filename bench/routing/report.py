"""From outcomes to numbers: per-run metrics, the table, the goal line, the PNG.

Over the measured window ``[warmup, duration]`` of one run:

    offered      requests due in the window / window
    throughput   successes that ENDED in the window / window (what the fleet kept up with)
    TTFT p50/99  requests DUE in the window that got a first token; one still without
                 a first token when the drain bound passed counts as infinite; failed
                 requests are left out (they are in "errors")
    goodput@SLO  requests DUE in the window that succeeded with TTFT <= SLO / window
    output tok/s output tokens of the successes that ENDED in the window / window (the
                 simulator generates exactly max_tokens)

Over a ramp (every load of a run, ``ramp``): each policy's output tok/s at the knee (the
most it sustained at any load: past the knee the curve flattens or falls), its TTFT p90
over every request of the ramp (the requests due in each run's window, pooled) and its
success rate (requests answered whole over requests sent, every run).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import percentile
from bench.routing.client import OpenLoopRun, Outcome

SLOS_S = {"1s": 1.0, "300ms": 0.3}
GOAL = ("lor", "round_robin", 85, 1.5)  # lor goodput@1s >= 1.5x round_robin's at 85 % load
PEER_GOAL = ("lor", 85)  # lor goodput@1s >= every peer policy's at 85 % load (and at each load)


def _ms(seconds: float | None) -> float | None:
    if seconds is None:
        return None
    return math.inf if math.isinf(seconds) else round(seconds * 1000, 1)


@dataclass
class RunMetrics:
    policy: str
    load_pct: int
    target_rate: float  # the Poisson rate asked for, requests/s
    window_s: float
    sent: int  # all requests of the run, warm-up included
    offered: float
    throughput: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    goodput: dict[str, float]  # by SLO name, requests/s
    errors: dict[str, int]  # whole run, by kind
    unfinished: int
    per_unit: dict[str, int]  # requests answered by each unit, whole run
    send_lag_p99_ms: float | None
    cpu: dict[str, float] = field(default_factory=dict)  # % of one core over the run
    timing_s: dict[str, float] = field(default_factory=dict)  # where the run's time went
    outstanding_after: dict[str, int] = field(default_factory=dict)
    gateway_exit: int | None = None
    gateway_problems: list[str] = field(default_factory=list)
    prefix_hit_rate: float | None = None  # the fleet's prefix cache: cached / prompt tokens
    ideal_hit_rate: float | None = None  # one unbounded cache: workload.ideal_hit_rate
    # The most loaded unit's outstanding / capacity over the fleet's mean, time-weighted
    # over every change of outstanding while the fleet is busy (bench.routing.imbalance):
    # 1.0 is a perfectly even fleet
    peak_over_mean_p99: float | None = None
    peak_over_mean_p50: float | None = None
    ideal_over_mean_p99: float | None = None  # the same totals spread as evenly as can be
    arrivals_over_mean_p99: float | None = None  # at the instants a request reached a unit
    load_changes: int = 0  # busy intervals (changes of outstanding) the figures are over
    load_busy_s: float = 0.0  # their total duration
    # policy latency: median |predicted - actual| / actual TTFT (the gateway's histogram)
    prediction_error_p50: float | None = None
    output_tok_s: float = 0.0
    ttft_p90_ms: float | None = None
    # every TTFT of the window, s (inf: none by the drain bound), for a ramp's pooled
    # percentiles; not in the JSON
    ttfts_s: list[float] = field(default_factory=list, repr=False)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["ttfts_s"]
        for key in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"):
            if data[key] is not None and math.isinf(data[key]):
                data[key] = "inf"  # JSON has no infinity
        data["error_count"] = self.error_count
        return data


def run_metrics(
    policy: str,
    load_pct: int,
    target_rate: float,
    run: OpenLoopRun,
    warmup_s: float,
    duration_s: float,
) -> RunMetrics:
    window = duration_s - warmup_s
    due = [o for o in run.outcomes if warmup_s <= o.arrival_s < duration_s]
    ended = [o.done_s for o in run.outcomes if o.ok and o.done_s is not None]
    ttfts = [_ttft_or_inf(o) for o in due if o.error is None]
    output = sum(
        o.max_tokens
        for o in run.outcomes
        if o.ok and o.done_s is not None and warmup_s <= o.done_s <= duration_s
    )
    return RunMetrics(
        policy=policy,
        load_pct=load_pct,
        target_rate=target_rate,
        window_s=window,
        sent=len(run.outcomes),
        offered=len(due) / window,
        throughput=sum(warmup_s <= done <= duration_s for done in ended) / window,
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        goodput={name: _good(due, slo) / window for name, slo in SLOS_S.items()},
        errors=dict(Counter(o.error for o in run.outcomes if o.error is not None)),
        unfinished=run.unfinished,
        per_unit=dict(sorted(Counter(o.unit for o in run.outcomes if o.unit).items())),
        send_lag_p99_ms=_ms(percentile(run.send_lag_s, 99)),
        output_tok_s=output / window,
        ttft_p90_ms=_ms(percentile(ttfts, 90)),
        ttfts_s=ttfts,
    )


def _ttft_or_inf(o: Outcome) -> float:
    return math.inf if o.ttft_s is None else o.ttft_s


def _good(due: Sequence[Outcome], slo_s: float) -> int:
    return sum(o.ok and o.ttft_s is not None and o.ttft_s <= slo_s for o in due)


# -- the table ------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:,.{digits}f}"


COLUMNS: tuple[tuple[str, Callable[[RunMetrics], str]], ...] = (
    ("load %", lambda m: str(m.load_pct)),
    ("policy", lambda m: m.policy),
    ("offered r/s", lambda m: _fmt(m.offered)),
    ("thruput r/s", lambda m: _fmt(m.throughput)),
    ("TTFT p50 ms", lambda m: _fmt(m.ttft_p50_ms, 0)),
    ("TTFT p99 ms", lambda m: _fmt(m.ttft_p99_ms, 0)),
    ("good@1s r/s", lambda m: _fmt(m.goodput["1s"])),
    ("good@300ms r/s", lambda m: _fmt(m.goodput["300ms"])),
    (
        "cache hit %",
        lambda m: _fmt(None if m.prefix_hit_rate is None else 100 * m.prefix_hit_rate, 0),
    ),
    (
        "ideal hit %",
        lambda m: _fmt(None if m.ideal_hit_rate is None else 100 * m.ideal_hit_rate, 0),
    ),
    ("max/mean p50", lambda m: _fmt(m.peak_over_mean_p50, 2)),
    ("max/mean p99", lambda m: _fmt(m.peak_over_mean_p99, 2)),
    ("at arrivals p99", lambda m: _fmt(m.arrivals_over_mean_p99, 2)),
    ("ideal p99", lambda m: _fmt(m.ideal_over_mean_p99, 2)),
    ("changes", lambda m: str(m.load_changes)),
    ("errors", lambda m: str(m.error_count)),
    ("unfinished", lambda m: str(m.unfinished)),
    ("gw CPU %", lambda m: _fmt(m.cpu.get("gateway"), 0)),
    ("all CPU %", lambda m: _fmt(m.cpu.get("ours"), 0)),
    ("host busy %", lambda m: _fmt(m.cpu.get("host_busy"), 0)),
)


def table(rows: Sequence[RunMetrics]) -> str:
    ordered = sorted(rows, key=lambda m: m.load_pct)
    cells = [[name for name, _ in COLUMNS]]
    cells += [[cell(m) for _, cell in COLUMNS] for m in ordered]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if i != 1 else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    header = line(cells[0])
    out = [header, "-" * len(header)]
    for previous, m, values in zip([None, *ordered], ordered, cells[1:], strict=False):
        if previous is not None and previous.load_pct != m.load_pct:
            out.append("")
        out.append(line(values))
    return "\n".join(out)


def routing_table(rows: Sequence[RunMetrics], load_pct: int, shares: dict[str, float]) -> str:
    """Share of requests per unit at one load, beside each unit's share of fleet capacity."""
    at_load = [m for m in rows if m.load_pct == load_pct]
    units = list(shares)
    name_w = max([len("capacity share"), *(len(m.policy) for m in at_load)])
    lines = ["".ljust(name_w) + "".join(u.rjust(7) for u in units)]
    lines.append("capacity share".ljust(name_w) + "".join(f"{shares[u]:6.1%} " for u in units))
    for m in at_load:
        total = sum(m.per_unit.values()) or 1
        cells = "".join(f"{m.per_unit.get(u, 0) / total:6.1%} " for u in units)
        lines.append(m.policy.ljust(name_w) + cells)
    return "\n".join(lines)


def goal(
    rows: Sequence[RunMetrics],
    spec: tuple[str, str, int, float] = GOAL,
    reference: str = "lor",
) -> dict[str, Any]:
    """``good``'s goodput@1s over ``base``'s at one load (% of the saturation through
    ``reference``)."""
    good, base, load_pct, want = spec
    by = {(m.policy, m.load_pct): m for m in rows}
    mine, theirs = by.get((good, load_pct)), by.get((base, load_pct))
    if mine is None or theirs is None:
        return {
            "checked": False,
            "line": f"goal: not checked ({good} and {base} at {load_pct} % load were not both run)",
        }
    a, b = mine.goodput["1s"], theirs.goodput["1s"]
    ratio = math.inf if b == 0 else a / b
    met = ratio >= want
    line = (
        f"goal: {good} goodput@1s {a:.1f} r/s vs {base} {b:.1f} r/s at {load_pct} % load"
        f"{'' if reference == 'lor' else f' (of the saturation through {reference})'}: "
        f"{ratio:.2f}x (want >= {want}x): {'MET' if met else 'NOT MET'}"
    )
    return {
        "checked": True,
        "met": met,
        "ratio": None if math.isinf(ratio) else ratio,
        "line": line,
    }


def peer_goal(
    rows: Sequence[RunMetrics], peer_policies: Sequence[str], spec: tuple[str, int] = PEER_GOAL
) -> dict[str, Any]:
    """One policy's goodput@1s (lor's by default) against every peer policy run at the
    same load: the headline at 85 % load, and each load run."""
    mine, headline_load = spec
    by = {(m.policy, m.load_pct): m for m in rows}
    per_load: dict[int, dict[str, dict[str, Any]]] = {}
    for load_pct in sorted({m.load_pct for m in rows}):
        ours = by.get((mine, load_pct))
        theirs = [by[p, load_pct] for p in peer_policies if (p, load_pct) in by]
        if ours is None or not theirs:
            continue
        a = ours.goodput["1s"]
        per_load[load_pct] = {
            m.policy: {"mine": a, "peer": m.goodput["1s"], "met": a >= m.goodput["1s"]}
            for m in theirs
        }
    lines = [_peer_goal_line(mine, load, peers) for load, peers in per_load.items()]
    headline = per_load.get(headline_load)
    if headline is None:
        lines.insert(
            0,
            f"goal (peers): not checked ({mine} and a peer policy at {headline_load} % load "
            "were not both run)",
        )
    return {
        "checked": headline is not None,
        "met": None if headline is None else all(v["met"] for v in headline.values()),
        "met_every_load": bool(per_load)
        and all(v["met"] for peers in per_load.values() for v in peers.values()),
        "per_load": per_load,
        "lines": lines,
    }


def _peer_goal_line(mine: str, load_pct: int, peers: dict[str, dict[str, Any]]) -> str:
    met = all(v["met"] for v in peers.values())
    a = next(iter(peers.values()))["mine"]
    against = ", ".join(
        f"{p} {v['peer']:.1f}{'' if v['met'] else ' (higher)'}" for p, v in peers.items()
    )
    return (
        f"goal (peers): {mine} goodput@1s {a:.1f} r/s at {load_pct} % load >= every peer "
        f"policy's ({against}): {'MET' if met else 'NOT MET'}"
    )


# -- a ramp of loads ----------------------------------------------------------------


# On the b2b ramp: prefix (by the engines' blocks) >= 1.25x prefix-guess's output tok/s
# at the knee, >= every peer policy's, a lower TTFT p90 over the ramp, 100 % success.
RAMP_GOAL = ("prefix", "prefix-guess", 1.25)


def ramp(rows: Sequence[RunMetrics]) -> dict[str, dict[str, Any]]:
    """Per policy, over every load it ran: output tok/s at the knee (and that load),
    TTFT p90 of every request pooled, success over every request sent."""
    out: dict[str, dict[str, Any]] = {}
    for policy in dict.fromkeys(m.policy for m in rows):
        mine = sorted((m for m in rows if m.policy == policy), key=lambda m: m.load_pct)
        knee = max(mine, key=lambda m: m.output_tok_s)
        sent = sum(m.sent for m in mine)
        failed = sum(m.error_count + m.unfinished for m in mine)
        out[policy] = {
            "loads": [m.load_pct for m in mine],
            "output_tok_s": {m.load_pct: round(m.output_tok_s, 1) for m in mine},
            "knee_tok_s": round(knee.output_tok_s, 1),
            "knee_load_pct": knee.load_pct,
            "ttft_p90_ms": _ms(percentile([t for m in mine for t in m.ttfts_s], 90)),
            "success": (sent - failed) / sent if sent else None,
        }
    return out


def ramp_table(summary: dict[str, dict[str, Any]]) -> str:
    loads = sorted({load for v in summary.values() for load in v["loads"]})
    name_w = max(len("policy"), *(len(p) for p in summary))
    head = "policy".ljust(name_w) + "".join(f"{f'tok/s@{x}%':>12}" for x in loads)
    head += f"{'knee tok/s':>12}{'TTFT p90 ms':>13}{'success %':>11}"
    lines = [head, "-" * len(head)]
    for policy, v in summary.items():
        cells = "".join(f"{_fmt(v['output_tok_s'].get(x), 0):>12}" for x in loads)
        success = None if v["success"] is None else 100 * v["success"]
        lines.append(
            policy.ljust(name_w) + cells + f"{_fmt(v['knee_tok_s'], 0):>12}"
            f"{_fmt(v['ttft_p90_ms'], 0):>13}{_fmt(success, 2):>11}"
        )
    return "\n".join(lines)


def _or_inf(ms: float | None) -> float:
    return math.inf if ms is None else ms


def ramp_goal(
    summary: dict[str, dict[str, Any]],
    peer_policies: Sequence[str],
    spec: tuple[str, str, float] = RAMP_GOAL,
) -> dict[str, Any]:
    mine, guess, want = spec
    ours = summary.get(mine)
    if ours is None:
        return {"checked": False, "lines": [f"goal (ramp): not checked ({mine} was not run)"]}
    lines: list[str] = []
    met: dict[str, bool] = {}
    base = summary.get(guess)
    if base is not None:
        ratio = math.inf if base["knee_tok_s"] == 0 else ours["knee_tok_s"] / base["knee_tok_s"]
        met["vs_guess"] = ratio >= want
        lines.append(
            f"goal (ramp): {mine} output {ours['knee_tok_s']:.0f} tok/s at the knee vs {guess} "
            f"{base['knee_tok_s']:.0f}: {ratio:.2f}x (want >= {want}x): "
            f"{'MET' if met['vs_guess'] else 'NOT MET'}"
        )
    theirs = {p: summary[p] for p in peer_policies if p in summary}
    if theirs:
        met["vs_peers_tok_s"] = all(ours["knee_tok_s"] >= v["knee_tok_s"] for v in theirs.values())
        against = ", ".join(f"{p} {v['knee_tok_s']:.0f}" for p, v in theirs.items())
        lines.append(
            f"goal (ramp): {mine} {ours['knee_tok_s']:.0f} tok/s at the knee >= every peer "
            f"policy's ({against}): {'MET' if met['vs_peers_tok_s'] else 'NOT MET'}"
        )
        p90 = _or_inf(ours["ttft_p90_ms"])
        met["vs_peers_ttft"] = all(p90 < _or_inf(v["ttft_p90_ms"]) for v in theirs.values())
        against = ", ".join(f"{p} {_fmt(v['ttft_p90_ms'], 0)}" for p, v in theirs.items())
        lines.append(
            f"goal (ramp): {mine} TTFT p90 over the ramp {_fmt(ours['ttft_p90_ms'], 0)} ms < "
            f"every peer policy's ({against}): {'MET' if met['vs_peers_ttft'] else 'NOT MET'}"
        )
    success = ours["success"]
    met["success"] = success == 1.0
    lines.append(
        f"goal (ramp): {mine} success {_fmt(None if success is None else 100 * success, 2)} % "
        f"(want 100 %): {'MET' if met['success'] else 'NOT MET'}"
    )
    return {"checked": True, "met": all(met.values()), "by": met, "lines": lines}


def replica_ramp_goals(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``ramp_goal`` of prefix-Ngw against prefix-guess-Ngw, for each N both were run at."""
    mine, guess, want = RAMP_GOAL
    return [
        ramp_goal(summary, [], (f"{mine}-{n}gw", f"{guess}-{n}gw", want))
        for n in (2, 3)
        if f"{mine}-{n}gw" in summary and f"{guess}-{n}gw" in summary
    ]


# -- the picture ----------------------------------------------------------------------


MARKERS = "osD^vP*X"


def plot(rows: Sequence[RunMetrics], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (good_ax, ttft_ax) = plt.subplots(1, 2, figsize=(13, 5.2))
    policies = list(dict.fromkeys(m.policy for m in rows))
    for i, policy in enumerate(policies):
        mine = sorted((m for m in rows if m.policy == policy), key=lambda m: m.load_pct)
        loads = [m.load_pct for m in mine]
        style = {
            "marker": MARKERS[i % len(MARKERS)],
            "label": policy,
            "linestyle": _linestyle(policy),
        }
        good_ax.plot(loads, [m.goodput["1s"] for m in mine], **style)
        ttft_ax.plot(loads, [_finite_s(m.ttft_p99_ms) for m in mine], **style)
    # Every policy at one load got the same arrivals: one offered rate per load.
    offered = {m.load_pct: m.offered for m in rows}
    loads = sorted(offered)
    good_ax.plot(
        loads, [offered[p] for p in loads], color="grey", linestyle=":", label="offered (ideal)"
    )
    good_ax.set(
        xlabel="load, % of measured saturation",
        ylabel="requests/s",
        title="goodput: completed with TTFT <= 1 s (higher is better)",
    )
    good_ax.set_ylim(bottom=0)
    ttft_ax.set(
        xlabel="load, % of measured saturation",
        ylabel="s (log scale)",
        title="TTFT p99 (lower is better; dotted: 0.3 s and 1 s)",
        yscale="log",
    )
    seconds = FuncFormatter(lambda v, _: f"{v:g}")
    ttft_ax.yaxis.set_major_formatter(seconds)
    ttft_ax.yaxis.set_minor_formatter(seconds)
    ttft_ax.tick_params(axis="y", which="minor", labelsize=7)
    for slo in SLOS_S.values():
        ttft_ax.axhline(slo, color="grey", linestyle=":", linewidth=1)
    for ax in (good_ax, ttft_ax):
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xticks(loads)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _linestyle(policy: str) -> str:
    if ":" in policy:  # a peer router's policy
        return "-."
    return "--" if "delayed" in policy else "-"


def _finite_s(ms: float | None) -> float:
    # A p99 that never came (inf) is drawn at the top of a sensible scale.
    if ms is None or math.isinf(ms):
        return math.nan
    return ms / 1000

"""``unitproxy plan``: settings in, the table (or one JSON object) and a plot out."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import TextIO

from proxy.plan.measure import MeasureError, Shape, measure
from proxy.plan.planner import Objectives, Plan, Trial, plan, table
from proxy.plan.workload import Request, TraceError, Traffic, parse_lengths, read_trace
from proxy.settings import PlanSettings, Settings


def traffic_of(p: PlanSettings) -> tuple[list[Request], float]:
    """The requests to play and the span they cover, in s."""
    if p.trace_file is not None:
        requests = read_trace(p.trace_file)
        return requests, max(requests[-1].at_s, 1e-9)
    assert p.rate_per_s is not None  # check_role: one of the two
    traffic = Traffic(
        p.rate_per_s,
        p.duration_s,
        parse_lengths(p.prompt_tokens),
        parse_lengths(p.output_tokens),
        p.prefix_share,
        p.prefix_groups,
    )
    return traffic.requests(p.seed), p.duration_s


def run_plan(settings: Settings, out: TextIO | None = None) -> int:
    p, out = settings.plan, out or sys.stdout
    assert p.slo_ttft_p99_s is not None  # check_role
    objectives = Objectives(p.slo_ttft_p99_s, p.slo_tpot_p99_s)
    try:
        requests, span = traffic_of(p)
    except TraceError as exc:
        print(f"unitproxy: invalid configuration: plan.trace_file: {exc}", file=sys.stderr)
        return 2

    def progress(trial: Trial) -> None:
        if not p.json_output:
            verdict = "meets" if trial.meets else "misses"
            print(f"  {trial.units} units: {verdict} ({trial.wall_s:.1f} s)", file=sys.stderr)

    sim, shape = settings.engine.sim, None
    if p.measure_url is not None:
        if not p.json_output:
            print(f"  measuring the unit at {p.measure_url} ...", file=sys.stderr)
        try:
            shape = asyncio.run(measure(p.measure_url, p.measure_api_key))
        except MeasureError as exc:
            print(f"unitproxy: plan.measure_url: {exc}", file=sys.stderr)
            return 1
        sim = sim.model_copy(update=shape.knobs())
        if not p.json_output:
            print(f"  measured: {describe(shape)}", file=sys.stderr)
    capacity = settings.sidecar.capacity
    if capacity is None and shape is not None and shape.capacity > 0:
        capacity = shape.capacity  # the measured unit's own admission limit
    if capacity is None:  # a simulator unit's own default: its engine's slots
        capacity = sim.max_num_seqs
    result = plan(
        sim,
        capacity,
        requests,
        objectives,
        span,
        max_units=p.max_units,
        seed=p.seed,
        progress=progress,
    )
    plotted = None if p.plot_file is None else draw(result, objectives, p.plot_file)
    if p.json_output:
        data = result.to_json()
        data["objectives"] = objectives.__dict__
        if shape is not None:
            data["measured"] = shape.to_json()
        if p.plot_file is not None:
            data["plot"] = str(p.plot_file) if plotted is None else None
            data["plot_skipped"] = plotted
        print(json.dumps(data), file=out)
    else:
        print(table(result, objectives), file=out)
        if p.plot_file is not None:
            print(plotted or f"plot: {p.plot_file}", file=out)
    return 0 if result.units is not None else 1


def describe(shape: Shape) -> str:
    """The measured shape as the --sim-* flags that would give it."""
    return (
        f"--sim-max-num-seqs {shape.max_num_seqs} "
        f"--sim-prefill-ms-per-token {shape.prefill_ms_per_token:g} "
        f"--sim-decode-step-ms {shape.decode_step_ms:g} "
        f"--sim-decode-ms-per-seq {shape.decode_ms_per_seq:g} "
        f"(capacity {shape.capacity}; {shape.wall_s:g} s)"
    )


def draw(result: Plan, objectives: Objectives, path: Path) -> str | None:
    """TTFT and TPOT p50/p99 against units, objectives dashed; why not, when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    trials = sorted((t for t in result.trials if not t.stopped), key=lambda t: t.units)
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    units = [t.units for t in trials]
    for axis, name, p50, p99, slo in (
        (ttft, "TTFT", [t.ttft_p50_s for t in trials], [t.ttft_p99_s for t in trials],
         objectives.ttft_p99_s),
        (tpot, "TPOT", [t.tpot_p50_s for t in trials], [t.tpot_p99_s for t in trials],
         objectives.tpot_p99_s),
    ):  # fmt: skip
        axis.plot(units, [_ms(v) for v in p50], "o-", label="p50")
        axis.plot(units, [_ms(v) for v in p99], "s-", label="p99")
        if slo is not None:
            axis.axhline(slo * 1000, linestyle="--", color="grey", label="objective (p99)")
        if result.units is not None:
            axis.axvline(result.units, linestyle=":", color="green", label="planned units")
        axis.set_xlabel("units")
        axis.set_ylabel(f"{name}, ms")
        axis.set_title(name)
        axis.legend()
    fig.suptitle(
        f"unitproxy plan: {result.requests} requests over {result.duration_s:.0f} s "
        f"-> {result.units} units (fleets that stopped early, short, left out)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _ms(value: float | None) -> float:
    return float("nan") if value is None else value * 1000

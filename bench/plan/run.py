"""The capacity planner against reality: its unit count against real sim fleets.

For each workload, ``unitproxy plan``'s planner (``proxy.plan``) answers how many units
of a sim shape meet a TTFT p99 objective for a seeded traffic; then that very traffic
is played, open loop, through real fleets on 127.0.0.1 (``python -m proxy sidecar
--engine sim`` units of the same shape behind a ``lor`` gateway, as bench/routing
starts them) of the planned count and one unit fewer, and more or fewer until the
smallest real fleet that meets the objective is found (within --max-units). Reported:
the planned count, the smallest real one, and the predicted against measured TTFT
p50/p99 for each fleet run; also the time the planner takes for an hour of the traffic.

    .venv/bin/python -m bench.plan.run            # three workloads, 40 s of traffic a fleet
    .venv/bin/python -m bench.plan.run --quick    # one workload, 15 s a fleet

Writes a table to stdout and JSON to bench/results/plan.json (--quick: plan.quick.json);
the children's logs go to bench/results/plan-logs/.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the bench package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp

from bench.common import Interrupted, run_loop, until_signal
from bench.routing import client, fleet
from bench.routing.run import command_line, machine_info
from bench.routing.workload import MODEL, VOCABULARY, Arrival, RequestSpec
from engine.settings import SimSettings
from proxy.plan.planner import Objectives, Trial, percentile, plan, simulate
from proxy.plan.workload import Request, Traffic, parse_lengths
from proxy.procutil import ChildFailed

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "bench" / "results" / "plan.json"
DRAIN_S = 60.0


@dataclass(frozen=True)
class Case:
    """A workload, a unit shape and the objective."""

    name: str
    rate_per_s: float
    prompt: str
    output: str
    slo_ttft_p99_s: float
    slots: int = 4
    decode_step_ms: float = 40.0
    decode_ms_per_seq: float = 1.0
    prefill_ms_per_token: float = 0.2
    prefix_share: float = 0.0
    prefix_groups: int = 1

    def settings(self) -> SimSettings:
        return SimSettings(
            max_num_seqs=self.slots,
            decode_step_ms=self.decode_step_ms,
            decode_ms_per_seq=self.decode_ms_per_seq,
            prefill_ms_per_token=self.prefill_ms_per_token,
        )

    def traffic(self, duration_s: float, seed: int) -> list[Request]:
        return Traffic(
            self.rate_per_s,
            duration_s,
            parse_lengths(self.prompt),
            parse_lengths(self.output),
            self.prefix_share,
            self.prefix_groups,
        ).requests(seed)

    def spec(self, i: int) -> fleet.UnitSpec:
        return fleet.UnitSpec(
            id=f"u{i}",
            slots=self.slots,
            capacity=64,  # set, not the engine's slots: the planner is given the same
            slowdown=1.0,
            decode_step_ms=self.decode_step_ms,
            decode_ms_per_seq=self.decode_ms_per_seq,
            prefill_ms_per_token=self.prefill_ms_per_token,
            seed=i,
        )


# Sized so that a few units carry them on two busy cores: steps of 40+ ms.
CASES = {
    "short": Case("short", 11.0, "uniform:50:150", "uniform:10:30", 1.0),
    "long-prompts": Case("long-prompts", 6.0, "lognormal:1200:0.5:3000", "16", 1.0),
    "shared-prefix": Case(
        "shared-prefix", 9.0, "1500", "uniform:10:20", 1.0, prefix_share=0.9, prefix_groups=3
    ),
}


def bodies(requests: Sequence[Request], seed: int) -> list[Arrival]:
    """Each request as /v1/completions text of exactly its prompt tokens (one simulated
    token a word), the group's prefix the same words for every request of the group."""
    rng = random.Random(seed)
    prefixes: dict[int, list[str]] = {}
    arrivals = []
    for index, r in enumerate(requests):
        shared: list[str] = []
        if r.group >= 0:
            group = prefixes.setdefault(r.group, rng.choices(VOCABULARY, k=4096))
            shared = group[: r.prefix_tokens]
        prompt = "".join(shared + rng.choices(VOCABULARY, k=r.prompt_tokens - len(shared)))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": r.output_tokens,
                "stream": True, "ignore_eos": True}  # fmt: skip
        data = json.dumps(body, separators=(",", ":")).encode()
        arrivals.append(Arrival(index, r.at_s, RequestSpec(r.prompt_tokens, r.output_tokens), data))
    return arrivals


@dataclass
class Measured:
    units: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    errors: int
    meets: bool
    predicted: Trial


async def real_run(
    case: Case, units: int, arrivals: list[Arrival], predicted: Trial, log_dir: Path
) -> Measured:
    specs = [case.spec(i) for i in range(units)]
    timeout = aiohttp.ClientTimeout(total=None)
    conn = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(timeout=timeout, connector=conn) as session,
        fleet.running_fleet(specs, session, log_dir) as f,
        fleet.running_gateway(f, ["--policy", "lor"], session, log_dir / f"gw-{units}.log") as gw,
    ):
        run = await client.open_loop(session, f"{gw.http_url}/v1/completions", arrivals, DRAIN_S)
    ok = [o for o in run.outcomes if o.ok and o.ttft_s is not None]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    tpots = [
        (o.done_s - o.sent_s - o.ttft_s) / (o.max_tokens - 1)
        for o in ok
        if o.done_s is not None and o.sent_s is not None and o.ttft_s is not None
        and o.max_tokens > 1
    ]  # fmt: skip
    errors = len(run.outcomes) - len(ok)
    p99 = percentile(ttfts, 99.0)
    meets = errors == 0 and p99 is not None and p99 <= case.slo_ttft_p99_s
    return Measured(units, percentile(ttfts, 50.0), p99, percentile(tpots, 99.0), errors, meets,
                    predicted)  # fmt: skip


@dataclass
class CaseResult:
    case: Case
    planned: int | None
    plan_wall_s: float
    hour_plan_units: int | None
    hour_plan_wall_s: float
    runs: list[Measured]

    @property
    def smallest_real(self) -> int | None:
        met = [m.units for m in self.runs if m.meets]
        missed = [m.units for m in self.runs if not m.meets]
        if not met:
            return None
        best = min(met)
        # known only where the fleet one smaller was run and missed (or it is 1)
        return best if best == 1 or best - 1 in missed else None


async def one_case(case: Case, s: argparse.Namespace, log_dir: Path) -> CaseResult:
    objectives = Objectives(case.slo_ttft_p99_s)
    settings = case.settings()
    requests = case.traffic(s.duration, s.seed)
    result = plan(settings, 64, requests, objectives, s.duration, max_units=s.max_units)
    began = time.perf_counter()
    hour = plan(settings, 64, case.traffic(3600.0, s.seed), objectives, 3600.0,
                max_units=s.max_units)  # fmt: skip
    hour_wall = time.perf_counter() - began
    print(f"{case.name}: planner says {result.units} units ({result.wall_s:.1f} s); "
          f"for an hour {hour.units} ({hour_wall:.1f} s)", flush=True)  # fmt: skip
    out = CaseResult(case, result.units, result.wall_s, hour.units, hour_wall, [])
    if result.units is None:
        return out
    arrivals = bodies(requests, s.seed)
    tried: dict[int, Measured] = {}

    async def run(units: int) -> Measured:
        predicted = simulate(settings, units, 64, requests, objectives, s.duration,
                             stop_early=False)  # fmt: skip
        m = await real_run(case, units, arrivals, predicted, log_dir / case.name)
        tried[units] = m
        print(f"  {units} units for real: TTFT p50 {_ms(m.ttft_p50_s)} p99 {_ms(m.ttft_p99_s)} "
              f"ms (predicted {_ms(predicted.ttft_p50_s)} / {_ms(predicted.ttft_p99_s)}), "
              f"errors {m.errors}, {'meets' if m.meets else 'misses'}", flush=True)  # fmt: skip
        return m

    units = result.units
    if (await run(units)).meets:
        while units > 1 and (await run(units - 1)).meets:  # real needs fewer
            units -= 1
    else:
        while units < s.max_units and not (await run(units + 1)).meets:  # real needs more
            units += 1
    out.runs = [tried[u] for u in sorted(tried)]
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def report(results: list[CaseResult], s: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    return {
        "benchmark": "plan",
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "wall_s": round(wall_s, 1),
        "settings": {"duration_s": s.duration, "seed": s.seed, "quick": s.quick},
        "machine": machine_info(),
        "cases": [
            {
                "case": r.case.__dict__,
                "planned_units": r.planned,
                "smallest_real_units": r.smallest_real,
                "plan_wall_s": round(r.plan_wall_s, 2),
                "hour_planned_units": r.hour_plan_units,
                "hour_plan_wall_s": round(r.hour_plan_wall_s, 2),
                "runs": [
                    {
                        **{k: v for k, v in m.__dict__.items() if k != "predicted"},
                        "predicted": m.predicted.__dict__,
                    }
                    for m in r.runs
                ],
            }
            for r in results
        ],
    }


def print_table(results: list[CaseResult]) -> None:
    print()
    print(f"{'workload':<14} {'planned':>7} {'real':>5}  {'units run':<10} "
          f"{'TTFT p50 pred/real':>19} {'TTFT p99 pred/real':>19}  plan of 1 h")  # fmt: skip
    for r in results:
        for i, m in enumerate(r.runs or [None]):
            head = (f"{r.case.name:<14} {r.planned!s:>7} {r.smallest_real!s:>5}" if i == 0
                    else " " * 28)  # fmt: skip
            if m is None:
                print(f"{head}  (not run)")
                continue
            p = m.predicted
            hour = f"{r.hour_plan_units} units in {r.hour_plan_wall_s:.1f} s" if i == 0 else ""
            print(f"{head}  {m.units:<10} {_ms(p.ttft_p50_s):>9}/{_ms(m.ttft_p50_s):<9} "
                  f"{_ms(p.ttft_p99_s):>9}/{_ms(m.ttft_p99_s):<9}  {hour}")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="The capacity planner against real sim fleets.")
    add = parser.add_argument
    add("--workloads", help=f"comma-separated, of {', '.join(CASES)}. Default all "
        "(--quick: short).")  # fmt: skip
    add("--duration", type=float, help="traffic per fleet, in s. Default 40 (--quick: 15).")
    add("--max-units", type=int, default=8, help="largest real fleet. Default 8.")
    add("--seed", type=int, default=1, help="seed of the traffic. Default 1.")
    add("--quick", action="store_true", help="smoke run: one workload, 15 s a fleet")
    add("--out", type=Path, help=f"JSON results. Default {DEFAULT_OUT.relative_to(REPO)}.")
    return parser


async def bench(s: argparse.Namespace, results: list[CaseResult]) -> None:
    log_dir = (s.out.parent / "plan-logs") if s.out else REPO / "bench" / "results" / "plan-logs"
    for name in s.workloads:
        results.append(await one_case(CASES[name], s, log_dir))


def main(argv: Sequence[str] | None = None) -> int:
    s = build_parser().parse_args(argv)
    s.workloads = (s.workloads or ("short" if s.quick else ",".join(CASES))).split(",")
    unknown = set(s.workloads) - set(CASES)
    if unknown:
        build_parser().error(f"unknown workload {', '.join(sorted(unknown))}")
    s.duration = s.duration or (15.0 if s.quick else 40.0)
    out = s.out or (DEFAULT_OUT.with_suffix(".quick.json") if s.quick else DEFAULT_OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    results: list[CaseResult] = []
    failed = None
    try:
        run_loop(until_signal(bench(s, results)))
    except (Interrupted, ChildFailed) as exc:
        failed = str(exc)
        print(f"plan benchmark stopped: {exc}; every process it started was stopped",
              file=sys.stderr)  # fmt: skip
    data = report(results, s, time.perf_counter() - began)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print_table(results)
    print(f"\nJSON: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

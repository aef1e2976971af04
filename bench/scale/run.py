"""The gateway against hundreds to thousands of units: cost by fleet size and load source.

For each fleet size and load source: a fleet emulator (``bench/scale/fleet.py``, its
own process: units speaking WatchLoad, ``/load``, ``/load/watch`` or publishing to
Redis, with load that moves) and a real ``python -m proxy gateway`` pointed at every
unit, then:

1. reports only: the gateway's CPU (utime + stime from /proc) over a window while the
   fleet's load moves and nothing is routed: CPU per second (% of one core) and per
   report (the emulator counts what it sent); resident memory, and per unit against
   the smallest fleet of the run; how stale the gateway's view gets (p99 of every
   unit's report age in ``GET /units``, sampled a few times);
2. requests (the first load source only, unless ``--request-sources``): streamed
   ``/v1/completions`` at concurrency 64 through the gateway, then the same straight
   to the units: added TTFT p50 and the gateway's CPU per request (less what reports
   cost it meanwhile). The units pace their chunks (``--chunk-ms``, 20 ms) so that
   concurrency 64 does not fill the two cores: the added TTFT is the gateway's latency,
   not the queue of a saturated machine.

Besides, in this process: the router's selection cost per request (``Router.pick`` +
``release`` while reports arrive) for each ``--policies`` name at each fleet size; a
policy this build lacks is reported as missing.

With ``--chunks-per-request N`` the units also report the prefix blocks their engines
hold (the sidecar's change stream: see bench/scale/fleet.py), N chunks stored per
request, and the gateway runs policy prefix, which keeps every unit's set: the cells
then say the reports' bytes per unit per second and the block changes per second, and
the CPU is the reports' with their blocks (compare a run without).

The machine's load average is recorded next to every window: the figures are CPU
time of the gateway process, not wall-clock rates, so other work on the machine moves
them less, but it still shares caches and cores.

    .venv/bin/python -m bench.scale.run                 # 8, 100, 1000, 5000 units
    .venv/bin/python -m bench.scale.run --quick         # 100 and 500 units, short windows
    .venv/bin/python -m bench.scale.run --sizes 1000 --sources watch,redis --policies lor,p2c

Load source ``watch-grpc`` is ``watch`` held over gRPC whatever the fleet's size (above
``gateway.watch_grpc_max_units`` units ``watch`` holds its streams over HTTP).

Writes a table to stdout, JSON to bench/results/scale.json (``scale.quick.json`` with
--quick), a PNG beside it, and the children's logs to bench/results/scale-logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp

from bench.common import (
    REPO,
    Interrupted,
    code_version,
    cpu_model,
    free_ports,
    run_loop,
    tree_cpu_s,
    until_signal,
)
from bench.scale import measure, report
from bench.scale.fleet import SOURCES
from proxy.procutil import python_m, running

DEFAULT_OUT = REPO / "bench" / "results" / "scale.json"
QUICK_OUT = DEFAULT_OUT.with_suffix(".quick.json")
REDIS_URL = "redis://127.0.0.1:6379/0"
# Besides the fleet's: watch-grpc, load_source watch held over gRPC at any fleet size
# (gateway.watch_grpc_max_units out of the way), to compare with what watch does there.
BENCH_SOURCES = (*SOURCES, "watch-grpc")


@dataclass
class Plan:
    sizes: list[int]
    sources: list[str]
    request_sources: list[str]
    policies: list[str]
    window_s: float
    request_s: float
    concurrency: int
    request_rounds: int
    selection_s: float
    chunk_ms: float
    chunks_per_request: int
    held_blocks: int
    out: Path
    extra_gateway: list[str]

    @property
    def log_dir(self) -> Path:
        return self.out.parent / "scale-logs"


def gateway_config(
    path: Path, units: list[dict[str, str]], source: str, cluster: str, blocks: bool = False
) -> None:
    # A fleet this size is over the gateway's default max_units (256), on purpose.
    lines = ["[gateway]", f"max_units = {len(units) + 8}"]
    if blocks:  # the policy that keeps the units' prefix blocks
        lines += ['policy = "prefix"']
    if source == "watch-grpc":
        lines += ['load_source = "watch"', f"watch_grpc_max_units = {len(units)}"]
    else:
        lines += [f'load_source = "{source}"']
    if source == "redis":  # the units register themselves: let those of this host in
        lines += ['discover_allow = ["http://127.0.0.1:*"]', "units = ["]
    else:
        lines += ["units = ["] + [f'  "{u["id"]}={u["http"]},{u["grpc"]}",' for u in units]
    lines += ["]", "", "[redis]", f'cluster = "{cluster}"', ""]
    # As `unitproxy up` sets a cell up: the gateway may move streams (the emulated units
    # fail none, but a gateway without the secret says at start that it could not).
    lines += ["[server]", f'resume_secret = "{secrets.token_hex(32)}"', ""]
    path.write_text("\n".join(lines))


def fleet_source(source: str) -> str:
    return "watch" if source == "watch-grpc" else source


async def one_cell(plan: Plan, size: int, source: str) -> dict[str, Any]:
    """One fleet and one gateway: reports only, then (for some sources) requests.

    Started by the shared launcher, not ``unitproxy up``: the units are the emulator's,
    not sidecars, and the gateway reads them from a config file written here."""
    tag = f"{size}-{source}"
    ready = plan.log_dir / f"fleet-{tag}.json"
    ready.unlink(missing_ok=True)
    cluster = f"scale-{os.getpid()}-{tag}"
    fleet_argv = [sys.executable, "-m", "bench.scale.fleet", "--units", str(size),
                  "--source", fleet_source(source), "--ready-file", str(ready), "--cluster", cluster,
                  "--redis-url", REDIS_URL, "--chunk-ms", str(plan.chunk_ms),
                  "--chunks-per-request", str(plan.chunks_per_request),
                  "--held-blocks", str(plan.held_blocks)]  # fmt: skip
    cell: dict[str, Any] = {"units": size, "source": source}
    async with running(
        f"fleet {tag}", fleet_argv, plan.log_dir / f"fleet-{tag}.log", cwd=REPO
    ) as fleet:
        started = time.monotonic()
        while not ready.exists():
            fleet.check_alive()
            if time.monotonic() - started > 120 + size / 20:
                raise TimeoutError(f"the fleet of {size} did not start")
            await asyncio.sleep(0.2)
        spec = json.loads(ready.read_text())
        config = plan.log_dir / f"gateway-{tag}.toml"
        gateway_config(config, spec["units"], source, cluster, plan.chunks_per_request > 0)
        http_port, grpc_port = free_ports(2)
        gateway_argv = [*python_m("gateway"), "--config", str(config),
                        "--host", "127.0.0.1", "--http-port", str(http_port),
                        "--grpc-port", str(grpc_port), "--log-level", "warning",
                        *(["--redis-url", REDIS_URL] if source == "redis" else []),
                        *plan.extra_gateway]  # fmt: skip
        log = plan.log_dir / f"gateway-{tag}.log"
        async with running(f"gateway {tag}", gateway_argv, log, cwd=REPO) as gateway:
            url = f"http://127.0.0.1:{http_port}"
            async with aiohttp.ClientSession() as session:
                cell["ready_s"] = round(
                    await measure.wait_serving(session, url, size, 60 + size / 25), 2
                )
                await asyncio.sleep(1.0)  # every stream open and reporting
                cell.update(await reports_window(plan, session, spec["control"], gateway.pid))
                cell["bytes_per_unit_s"] = round(cell.pop("report_bytes_per_s") / size, 1)
                if plan.chunks_per_request > 0:
                    cell["chunks_per_request"] = plan.chunks_per_request
                    cell["held_blocks"] = plan.held_blocks
                ages: list[float] = []
                for _ in range(3):
                    ages += await measure.report_ages(session, url)
                    await asyncio.sleep(0.3)
                cell["report_age_p50_s"] = round(measure.quantile(ages, 0.5), 3)
                cell["report_age_p99_s"] = round(measure.quantile(ages, 0.99), 3)
                if source in plan.request_sources:
                    cell.update(await requests_window(plan, session, gateway.pid, url, spec, cell))
            gateway.check_alive()
        cell["gateway_problems"] = gateway.log_problems()[:5]
    return cell


async def fleet_stats(session: aiohttp.ClientSession, control: str) -> dict[str, float]:
    async with session.get(f"{control}/stats") as resp:
        data: dict[str, float] = await resp.json()
        return data


async def reports_window(
    plan: Plan, session: aiohttp.ClientSession, control: str, pid: int
) -> dict[str, Any]:
    def stats() -> Any:
        return fleet_stats(session, control)

    before, cpu0, load0, t0 = await stats(), tree_cpu_s(pid), measure.loadavg(), time.monotonic()
    fleet0 = tree_cpu_s(int(before["pid"]))
    await asyncio.sleep(plan.window_s)
    after, cpu1, t1 = await stats(), tree_cpu_s(pid), time.monotonic()
    fleet_cpu = tree_cpu_s(int(after["pid"])) - fleet0
    reports = after["reports"] - before["reports"]
    cpu = cpu1 - cpu0
    return {
        "window_s": round(t1 - t0, 2),
        "reports_per_s": round(reports / (t1 - t0), 1),
        "changes_per_s": round((after["changes"] - before["changes"]) / (t1 - t0), 1),
        "report_bytes_per_s": (after["report_bytes"] - before["report_bytes"]) / (t1 - t0),
        "report_cpu_pct": round(100 * cpu / (t1 - t0), 2),
        "fleet_cpu_pct": round(100 * fleet_cpu / (t1 - t0), 1),  # the emulator's own
        "us_per_report": round(cpu / reports * 1e6, 2) if reports else None,
        "rss_mb": round(measure.rss_bytes(pid) / 2**20, 1),
        "loadavg": [load0, measure.loadavg()],
    }


async def requests_window(
    plan: Plan,
    session: aiohttp.ClientSession,
    pid: int,
    url: str,
    spec: dict[str, Any],
    cell: dict[str, Any],
) -> dict[str, Any]:
    # Through the gateway and straight to a few units (what a client beside them would
    # see), in rounds that take turns, each first in every other round: what the host
    # is doing meanwhile weighs on both alike.
    # TTFT: from a request's send to the first bytes of its body at the client.
    direct_urls = [u["http"] for u in spec["units"][:8]]
    through, direct = measure.Requests(), measure.Requests()
    added_by_round: list[float] = []  # each round's difference of p50s, legs side by side
    cpu = elapsed = background = 0.0
    round_s = plan.request_s / plan.request_rounds
    for k in range(plan.request_rounds):
        p50s: dict[str, float] = {}
        for leg in ("through", "direct") if k % 2 == 0 else ("direct", "through"):
            if leg == "direct":
                done = await measure.drive(direct_urls, plan.concurrency, round_s, seed=k)
                direct.add(done)
                p50s[leg] = measure.quantile(done.ttft_ms, 0.5)
                continue
            before, cpu0, t0 = (
                await fleet_stats(session, spec["control"]),
                tree_cpu_s(pid),
                time.monotonic(),
            )
            done = await measure.drive([url], plan.concurrency, round_s, seed=k)
            through.add(done)
            p50s[leg] = measure.quantile(done.ttft_ms, 0.5)
            cpu += tree_cpu_s(pid) - cpu0
            elapsed += time.monotonic() - t0
            after = await fleet_stats(session, spec["control"])
            # Reports kept coming meanwhile: take off what they cost in the reports-only window.
            background += (
                (after["reports"] - before["reports"]) * (cell["us_per_report"] or 0) / 1e6
            )
        added_by_round.append(round(p50s["through"] - p50s["direct"], 3))
    per_request = (cpu - background) / through.count * 1e6 if through.count else None
    return {
        "through": through.summary(),
        "direct": direct.summary(),
        "added_ttft_p50_ms": round(
            measure.quantile(through.ttft_ms, 0.5) - measure.quantile(direct.ttft_ms, 0.5), 3
        ),
        "added_ttft_p50_ms_by_round": added_by_round,
        "added_ttft_p50_ms_round_median": round(measure.median(added_by_round), 3),
        "cpu_us_per_request": round(per_request, 1) if per_request is not None else None,
        "gateway_cpu_pct_requests": round(100 * cpu / elapsed, 1),
        "loadavg_requests": measure.loadavg(),
    }


async def run(plan: Plan) -> dict[str, Any]:
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "code": code_version(),
        "plan": {k: v for k, v in plan.__dict__.items() if k not in ("out",)},
        "selection": [],
        "cells": [],
    }
    for size in plan.sizes:
        for policy in plan.policies:
            load = measure.loadavg()
            us = measure.selection_us(policy, size, plan.selection_s)
            row = {
                "units": size,
                "policy": policy,
                "us_per_request": None if us is None else round(us, 2),
                "loadavg": load,
            }
            result["selection"].append(row)
            print(f"selection {policy:>12} {size:>5} units: "
                  f"{'missing' if us is None else f'{us:.2f} µs'}  (load {load})", flush=True)  # fmt: skip
    for size in plan.sizes:
        for source in plan.sources:
            try:
                cell = await one_cell(plan, size, source)
            except (TimeoutError, OSError, aiohttp.ClientError) as exc:
                cell = {"units": size, "source": source, "error": f"{type(exc).__name__}: {exc}"}
            result["cells"].append(cell)
            print(report.cell_line(cell), flush=True)
    result["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    return result


def parse_args(argv: list[str] | None = None) -> tuple[Plan, bool]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="100 and 500 units, short windows")
    p.add_argument("--sizes", help="fleet sizes, comma-separated (default 8,100,1000,5000)")
    p.add_argument(
        "--sources",
        help=f"load sources (default {','.join(SOURCES)}; also watch-grpc; none: selection only)",
    )
    p.add_argument("--request-sources", default="watch",
                   help="sources whose cells also measure requests (default watch)")  # fmt: skip
    p.add_argument("--policies", default="lor,p2c,round_robin,prefix",
                   help="selection policies to time; any name (a missing one is reported)")  # fmt: skip
    p.add_argument("--window", type=float, help="seconds of reports only (default 10; quick 3)")
    p.add_argument("--request-window", type=float, help="seconds of requests (default 8; quick 3)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--request-rounds", type=int,
                   help="rounds of requests, through the gateway and direct in turn, over "
                        "the request window (default 4; quick 2)")  # fmt: skip
    p.add_argument("--chunk-ms", type=float, default=20.0,
                   help="the units' pause between two chunks of a stream (default 20): "
                        "paced so that concurrency 64 does not fill the cores, as in "
                        "bench/overhead's stream-5ms; 0: as fast as they go")  # fmt: skip
    p.add_argument("--chunks-per-request", type=int, default=0,
                   help="prefix blocks: chunks each request stores on its unit, reported as "
                        "sidecars report them, with policy prefix in the gateway (default 0: "
                        "no blocks)")  # fmt: skip
    p.add_argument("--held-blocks", type=int, default=512,
                   help="prefix blocks each unit holds, with --chunks-per-request (default 512)")  # fmt: skip
    p.add_argument("--out", type=Path)
    p.add_argument("--gateway-arg", action="append", default=[],
                   help="extra argument for every gateway (repeatable), e.g. --gateway-arg=--policy=p2c")  # fmt: skip
    a = p.parse_args(argv)
    quick = a.quick
    sizes = [int(s) for s in (a.sizes or ("100,500" if quick else "8,100,1000,5000")).split(",")]
    sources = [] if a.sources == "none" else (a.sources or ",".join(SOURCES)).split(",")
    unknown = [s for s in sources if s not in BENCH_SOURCES]
    if unknown:
        p.error(f"unknown load sources {unknown}; choose from {BENCH_SOURCES}")
    plan = Plan(
        sizes=sizes,
        sources=sources,
        request_sources=a.request_sources.split(","),
        policies=a.policies.split(","),
        window_s=a.window or (3.0 if quick else 10.0),
        request_s=a.request_window or (3.0 if quick else 8.0),
        concurrency=a.concurrency,
        request_rounds=max(1, a.request_rounds or (2 if quick else 4)),
        selection_s=0.3 if quick else 1.0,
        chunk_ms=a.chunk_ms,
        chunks_per_request=a.chunks_per_request,
        held_blocks=a.held_blocks,
        out=a.out or (QUICK_OUT if quick else DEFAULT_OUT),
        extra_gateway=a.gateway_arg,
    )
    return plan, quick


def main(argv: list[str] | None = None) -> int:
    plan, _ = parse_args(argv)
    try:
        result = run_loop(until_signal(run(plan)))
    except Interrupted as exc:
        print(f"interrupted ({exc})", file=sys.stderr)
        return 130
    plan.out.parent.mkdir(parents=True, exist_ok=True)
    plan.out.write_text(json.dumps(result, indent=2))
    print(report.table(result))
    png = report.plot(result, plan.out.with_suffix(".png"))
    print(f"JSON: {plan.out}" + (f"; PNG: {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

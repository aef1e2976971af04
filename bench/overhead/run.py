"""Router overhead: the same load direct to a sidecar, through unitproxy and through peers.

Each target has its own sidecar on the sim engine, all identical (every simulated cost
0 except the per-token step, 256 slots): the load goes to one directly and to each
router with its sidecar as its only worker. All targets are up at once and
interleaved: every repeat runs each (scenario, concurrency) cell once per target, in an
order that rotates, so the ratios hold on a noisy 2-core machine. Scenarios with a
different per-token step get their own sidecars and routers, started in turn. (Not one
shared sidecar: unitproxy's gateway holds a WatchLoad stream to its unit, and a shared
sidecar would push load reports to it while the other targets run.)

    scenario     load                                              backend
    stream-0ms   SSE POST /v1/completions, 64 tokens               0 ms/token
    stream-5ms   the same                                          5 ms/token
    completions  POST /v1/completions, max_tokens 16, not streamed 0 ms/token
    grpc         gRPC Inference/Generate, 64 tokens (direct and    0 ms/token
                 unitproxy only: the peers have no gRPC front)
    embeddings   POST /v1/embeddings, one short input (a pooling  0 ms/token
                 request: prefill, no output), not streamed

Targets: direct, unitproxy (the gateway, policy lor), vllm-router and sglang-router
(round_robin: with one worker their cheapest policy), and sglang-router+nodelay (the
same with TCP_NODELAY forced on its accepted sockets); unitproxy+tenants is the gateway
with tenants (--tenants-file, --tenants-redis; unitproxy+tenants@REF: a commit's;
unitproxy+compiled+tenants: the compiled tree's), and with one in the run every target's
load carries the same API key. The peers are PyPI
packages in their own virtual environments under bench/.venvs, put there by

    bash bench/overhead/setup_peers.sh

and left out, with the reason printed, where they are missing or do not start. Every
router and the sidecar log at warning level, so no target pays for per-request logs.

Per row: requests/s and chunks/s (token deltas; gRPC: the tokens its messages carry,
several to a message when the reader was behind), the ratio to direct (with its range
over the repeats), TTFT p50/p99 at the client and what the target adds over direct,
router CPU (utime+stime from /proc of the router and every process below it) per
1,000 chunks and per request, the sidecar's and the client's CPU, and how long the
router (per request) and the sidecar (share of the window) were ready to run with no
core free (the kernel's run delay, /proc/PID/task/TID/schedstat): on a machine with
fewer cores than busy processes, that is time a request waits on top of the work. The
client is this process (uvloop, one aiohttp session or one gRPC channel per run).
"Saturation" is the highest concurrency run.

    .venv/bin/python bench/overhead/run.py             # full: about 21 minutes on 2 cores
    .venv/bin/python bench/overhead/run.py --quick     # smoke run: about 2 minutes
    .venv/bin/python bench/overhead/run.py --targets direct,unitproxy --scenarios grpc
    .venv/bin/python bench/overhead/run.py --targets unitproxy,unitproxy@main --quick
    .venv/bin/python bench/overhead/run.py --targets unitproxy,unitproxy+tenants  # tenants A/B
    .venv/bin/python bench/overhead/run.py --targets unitproxy,unitproxy+trace0.01,unitproxy+trace1
    .venv/bin/python bench/overhead/run.py --targets unitproxy+tenants,unitproxy+tenants@main
    .venv/bin/python bench/overhead/run.py --targets unitproxy+compiled,unitproxy+compiled+tenants

Writes the table to stdout, JSON to bench/results/overhead.json, a PNG beside it and
the children's logs to bench/results/overhead-logs/ (--quick: overhead.quick.*).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a file: make the bench.overhead package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from bench.common import (
    MODEL,
    Interrupted,
    code_version,
    interrupt,
    machine_busy_s,
    processes_cpu_s,
    run_loop,
    run_queue_wait_s,
    tree,
    until_signal,
)
from bench.loadgen import outstanding_when_idle
from bench.overhead import goals, output, report
from bench.overhead.load import SCENARIOS, Scenario, measure, open_client
from bench.overhead.targets import (
    ALL_TARGETS,
    COMPILED_TENANTS,
    TENANTS,
    TENANTS_API_KEY,
    TENANTS_TOML,
    Backend,
    Target,
    TargetStatus,
    is_tenants,
    known_target,
    protocols,
    start_backend,
    start_target,
)
from bench.redisproc import redis_server, why_not
from proxy.procutil import ChildFailed

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "bench" / "results" / "overhead.json"
QUICK_OUT = DEFAULT_OUT.with_suffix(".quick.json")  # a smoke run keeps the full results
MIN_SLOTS = 256  # sidecar capacity and sim batch slots: never the bottleneck
IDLE_TIMEOUT_S = 5.0  # after a run, the sidecar must show 0 outstanding within this
API_KEY = TENANTS_API_KEY
T = TypeVar("T")


@dataclass(frozen=True)
class BenchSettings:
    duration_s: float
    warmup_s: float
    repeats: int
    concurrency: tuple[int, ...]
    scenarios: tuple[str, ...]
    targets: tuple[str, ...]
    max_requests: int
    quick: bool
    out: Path
    gateway_args: tuple[str, ...] = ()
    tenants_file: str | None = None  # unitproxy+tenants: None, the bench's own file
    tenants_redis: str | None = None  # None: a redis-server of the bench's own; "none"
    tenants_args: tuple[str, ...] = ()  # what unitproxy+tenants gets: set by run_all

    @property
    def log_dir(self) -> Path:
        return self.out.with_name(self.out.stem + "-logs")

    def cells(self) -> int:
        per_scenario = {
            s: sum(1 for t in self.targets if SCENARIOS[s].protocol in protocols(t))
            for s in self.scenarios
        }
        return self.repeats * len(self.concurrency) * sum(per_scenario.values())


# -- one run --------------------------------------------------------------------------


async def run_one(
    scenario: Scenario,
    concurrency: int,
    target: Target,
    repeat: int,
    settings: BenchSettings,
) -> dict[str, Any]:
    backend = target.backend
    address = target.address(scenario.protocol)
    assert address is not None

    def read_cpu() -> dict[str, float]:
        router = tree(target.router.pid) if target.router else []
        sidecar = tree(backend.child.pid)
        cpu = {
            "router": processes_cpu_s(router),
            "sidecar": processes_cpu_s(sidecar),
            "client": time.process_time(),
            "machine": machine_busy_s(),
        }
        # Time each process was ready to run but had no core: what the rate lost to the
        # way the processes shared the cores, beside what they spent on them.
        waits = {
            "router_wait": run_queue_wait_s(router),
            "sidecar_wait": run_queue_wait_s(sidecar),
            "client_wait": run_queue_wait_s([os.getpid()]),  # not its children
        }
        cpu.update({role: s for role, s in waits.items() if s is not None})
        return cpu

    api_key = API_KEY if any(map(is_tenants, settings.targets)) else None
    async with open_client(scenario, address, MODEL, concurrency, api_key) as request:
        window = await measure(
            request,
            concurrency,
            settings.warmup_s,
            settings.duration_s,
            settings.max_requests,
            read_cpu,
        )
    return {
        "scenario": scenario.name,
        "concurrency": concurrency,
        "target": target.name,
        "repeat": repeat,
        **asdict(window),
        "outstanding_after": await outstanding_when_idle(backend.http_url, IDLE_TIMEOUT_S),
    }


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _summary(run: dict[str, Any]) -> str:
    rate = run["requests"] / run["window_s"] if run["window_s"] else 0.0
    chunks = run["chunks"] / run["window_s"] if run["window_s"] else 0.0
    errors = sum(run["errors"].values())
    text = f"{rate:,.0f} req/s, {chunks:,.0f} chunks/s"
    return text + (f", {errors} ERRORS" if errors else "")


# -- one backend and its routers ------------------------------------------------------


async def run_phase(
    step_ms: float, scenarios: Sequence[Scenario], settings: BenchSettings, done: list[int]
) -> tuple[list[dict[str, Any]], list[TargetStatus], dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    statuses: list[TargetStatus] = []
    slots = max(MIN_SLOTS, 2 * max(settings.concurrency))
    total = settings.cells()
    code = code_version()  # what the sidecars and the gateway of this phase load
    async with AsyncExitStack() as stack:
        targets: list[Target] = []
        backends: dict[str, Backend] = {}
        for name in settings.targets:
            backend = await start_backend(stack, step_ms, slots, settings.log_dir, name)
            backends[name] = backend
            target, status = await start_target(
                stack, name, backend, settings.log_dir, settings.gateway_args,
                settings.tenants_args,
            )  # fmt: skip
            statuses.append(status)
            if target is None:
                _progress(f"!!! {name} ({step_ms:g} ms/token backend) is left out: {status.reason}")
            else:
                targets.append(target)
        cell = 0
        for repeat in range(settings.repeats):
            for scenario in scenarios:
                for concurrency in settings.concurrency:
                    cell += 1
                    able = [t for t in targets if scenario.protocol in protocols(t.name)]
                    shift = (repeat + cell) % max(1, len(able))
                    for target in able[shift:] + able[:shift]:
                        target.backend.child.check_alive()
                        if not _alive(target, statuses):
                            continue
                        done[0] += 1
                        label = f"[{done[0]}/{total}] r{repeat + 1} {scenario.name} c={concurrency} {target.name}"
                        try:
                            run = await run_one(scenario, concurrency, target, repeat, settings)
                        except ChildFailed as exc:
                            _mark_failed(target, statuses, str(exc))
                            continue
                        runs.append(run)
                        _progress(f"{label}: {_summary(run)}")
        live = {t.name: t for t in targets}
    # Everything is stopped now: exit codes and logs are final.
    backend_info = {
        "decode_step_ms": step_ms,
        "argv": shlex.join(backends[settings.targets[0]].child.argv),
        "code": code,
        "sidecars": {name: _sidecar_info(b) for name, b in backends.items()},
    }
    for status in statuses:
        target = live.get(status.name)
        if target is not None and target.router is not None:
            status.exit_code = target.router.exit_code
            status.log_problems = target.router.log_problems()
    return runs, statuses, backend_info


def _sidecar_info(backend: Backend) -> dict[str, Any]:
    text = backend.child.log_path.read_text(errors="replace")
    return {
        "argv": shlex.join(backend.child.argv),
        "log": str(backend.child.log_path),
        "exit_code": backend.child.exit_code,
        # sglang-router probes a worker's HTTP port with an HTTP/2 preface (gRPC detection).
        "http2_preface_errors": text.count("PRI/Upgrade"),
        "log_problems": backend.child.log_problems(),
    }


def _alive(target: Target, statuses: list[TargetStatus]) -> bool:
    if target.router is None or target.router.process.returncode is None:
        return all(s.available for s in statuses if s.name == target.name)
    _mark_failed(target, statuses, f"exited with {target.router.process.returncode}")
    return False


def _mark_failed(target: Target, statuses: list[TargetStatus], reason: str) -> None:
    for status in statuses:
        if status.name == target.name and status.available:
            status.available = False
            status.reason = f"failed during the run: {reason}"
            _progress(f"!!! {target.name}: {status.reason}")


async def run_all(settings: BenchSettings) -> dict[str, Any]:
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    if not any(map(is_tenants, settings.targets)):
        return await _run_phases(settings)
    path = settings.tenants_file
    if path is None:
        path = str(settings.log_dir / "tenants.toml")
        await asyncio.to_thread(Path(path).write_text, TENANTS_TOML)
    args = ["--tenants-file", path]
    if settings.tenants_redis == "none":
        return await _run_phases(replace(settings, tenants_args=tuple(args)))
    if settings.tenants_redis is not None:
        args += ["--redis-url", settings.tenants_redis]
        return await _run_phases(replace(settings, tenants_args=tuple(args)))
    why = why_not()
    if why is not None:
        raise ChildFailed(f"{TENANTS} needs a Redis: {why} (or --tenants-redis URL|none)")
    async with redis_server(settings.log_dir / "redis.log") as redis:
        args += ["--redis-url", redis.url]
        return await _run_phases(replace(settings, tenants_args=tuple(args)))


async def _run_phases(settings: BenchSettings) -> dict[str, Any]:
    steps = sorted({SCENARIOS[name].decode_step_ms for name in settings.scenarios})
    runs, phases, done = [], [], [0]
    for step in steps:
        scenarios = [
            SCENARIOS[n] for n in settings.scenarios if SCENARIOS[n].decode_step_ms == step
        ]
        _progress(f"backends at {step:g} ms/token: {', '.join(s.name for s in scenarios)}")
        phase_runs, statuses, backend = await run_phase(step, scenarios, settings, done)
        runs += phase_runs
        phases.append({"backend": backend, "targets": [asdict(s) for s in statuses]})
    return {"runs": runs, "phases": phases}


# -- settings -------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str) -> list[int]:
    values = [int(part) for part in _names(text)]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrency must be at least 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Router overhead: direct vs unitproxy vs vllm-router vs sglang-router.",
        epilog="Peers: bash bench/overhead/setup_peers.sh installs them into bench/.venvs.",
    )
    add = parser.add_argument
    add("--duration", type=float, help="measured window per run, in s. Default 3 (--quick: 1).")
    add("--warmup", type=float, help="uncounted warm-up per run, in s. Default 0.5.")
    add("--repeats", type=int, help="rounds over every cell and target. Default 5 (--quick: 1).")
    add(
        "--concurrency",
        type=_ints,
        action="extend",
        metavar="N[,N...]",
        help="closed-loop workers. Default 1,16,64 (--quick: 1,16).",
    )
    add(
        "--scenarios",
        type=_names,
        action="extend",
        metavar="NAME[,NAME...]",
        help=f"of {', '.join(SCENARIOS)}. Default all.",
    )
    add(
        "--targets",
        type=_names,
        action="extend",
        metavar="NAME[,NAME...]",
        help=f"of {', '.join(ALL_TARGETS)}, unitproxy@REF (the gateway at a git commit,"
        " for an A/B), unitproxy+traceR (this tree's gateway tracing R of its requests, e.g."
        " unitproxy+trace0.01), unitproxy+compiled (this tree built by"
        f" scripts/compiled_tree.sh) or {TENANTS} (this tree with tenants, their limits"
        f" counted in Redis; {TENANTS}@REF: a commit's; {COMPILED_TENANTS}: the compiled"
        " tree's). Default all but these five;"
        " direct is always run (the baseline).",
    )
    add(
        "--max-requests",
        type=int,
        default=2_000_000,
        help="most requests started per run (a safety bound). Default 2,000,000.",
    )
    add(
        "--out",
        type=Path,
        help=f"JSON results; the PNG and logs go beside it. Default "
        f"{DEFAULT_OUT.relative_to(REPO)} (--quick: {QUICK_OUT.name}).",
    )
    add(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the unitproxy gateway (repeatable), e.g. --gateway-arg=--load-source=poll.",
    )
    add(
        "--tenants-file",
        metavar="PATH",
        help=f"the tenants file {TENANTS} gets (its load sends the key {API_KEY}, which it "
        "must hold). Default: one the bench writes, four tenants, the load's with every "
        "limit set and never reached.",
    )
    add(
        "--tenants-redis",
        metavar="URL",
        help=f"the Redis {TENANTS} counts limits in, or 'none' (this gateway counts alone). "
        "Default: a redis-server of the bench's own on a free port.",
    )
    add(
        "--from-json",
        type=Path,
        metavar="JSON",
        help="run nothing: print the report and draw the PNG again from a JSON this bench wrote.",
    )
    add(
        "--quick",
        action="store_true",
        help="smoke run: 1 s windows, concurrency 1 and 16, one repeat (about 2 minutes).",
    )
    return parser


def parse_settings(argv: Sequence[str] | None) -> BenchSettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    scenarios = tuple(dict.fromkeys(args.scenarios or SCENARIOS))
    targets = tuple(dict.fromkeys(["direct", *(args.targets or ALL_TARGETS)]))
    for kind, names, known, is_known in (
        ("scenario", scenarios, SCENARIOS, SCENARIOS.__contains__),
        (
            "target",
            targets,
            (
                *ALL_TARGETS,
                "unitproxy@REF",
                "unitproxy+traceR",
                "unitproxy+compiled",
                TENANTS,
                COMPILED_TENANTS,
            ),
            known_target,
        ),
    ):
        unknown = [n for n in names if not is_known(n)]
        if unknown:
            parser.error(f"unknown {kind} {', '.join(unknown)}; choose from {', '.join(known)}")
    if (args.duration is not None and args.duration <= 0) or (args.warmup or 0) < 0:
        parser.error("--duration must be above 0 and --warmup at least 0")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    # --quick changes only the defaults; flags given explicitly still win.
    duration, warmup, repeats, conc = (
        (1.0, 0.5, 1, (1, 16)) if args.quick else (3.0, 0.5, 5, (1, 16, 64))
    )
    return BenchSettings(
        duration_s=duration if args.duration is None else args.duration,
        warmup_s=warmup if args.warmup is None else args.warmup,
        repeats=repeats if args.repeats is None else args.repeats,
        concurrency=tuple(dict.fromkeys(args.concurrency or conc)),
        scenarios=scenarios,
        targets=targets,
        max_requests=args.max_requests,
        quick=args.quick,
        out=args.out or (QUICK_OUT if args.quick else DEFAULT_OUT),
        gateway_args=tuple(args.gateway_arg),
        tenants_file=args.tenants_file,
        tenants_redis=args.tenants_redis,
    )


# -- the report ---------------------------------------------------------------------


def build_report(
    settings: BenchSettings, result: dict[str, Any], load_before: float, started: float
) -> dict[str, Any]:
    rows = report.aggregate(result["runs"])
    order = {name: i for i, name in enumerate(settings.targets)}
    rows.sort(
        key=lambda r: (
            settings.scenarios.index(r["scenario"]),
            r["concurrency"],
            order[r["target"]],
        )
    )
    verdicts = goals.verdicts(rows, settings.concurrency)
    return {
        "benchmark": "overhead",
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "elapsed_s": round(time.monotonic() - started, 1),
        "command": shlex.join([sys.executable, *sys.argv]),
        "settings": {**asdict(settings), "out": str(settings.out)},
        "scenarios": {n: asdict(SCENARIOS[n]) for n in settings.scenarios},
        "machine": {
            **output.machine_info(),
            "loadavg_1min_before": load_before,
            "loadavg_1min_after": os.getloadavg()[0],
        },
        "phases": result["phases"],
        "rows": rows,
        "verdicts": [v.to_json() for v in verdicts],
        "errors_total": sum(r["error_count"] for r in rows),
        "runs": [{k: v for k, v in run.items() if k != "ttfts"} for run in result["runs"]],
        "png": str(settings.out.with_suffix(".png")),
        "out": str(settings.out),
    }


# -- main -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json is not None:
        return output.redraw(args.from_json)
    settings = parse_settings(argv)
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    per_run = settings.warmup_s + settings.duration_s + 0.3
    _progress(
        f"{settings.cells()} runs of ~{per_run:.1f} s: about {settings.cells() * per_run / 60:.0f} "
        f"minutes plus start-ups; logs in {settings.log_dir}"
    )
    signal.signal(signal.SIGTERM, interrupt)  # outside the loop; until_signal inside it
    try:
        result = run_loop(until_signal(run_all(settings)))
    except (KeyboardInterrupt, Interrupted) as exc:
        print(
            f"interrupted ({str(exc) or 'SIGINT'}); everything started was stopped", file=sys.stderr
        )
        return 130
    except ChildFailed as exc:
        print(f"!!! {exc}", file=sys.stderr)
        return 1
    rep = build_report(settings, result, load_before, started)
    settings.out.write_text(json.dumps(rep, indent=1) + "\n")
    output.draw(rep)
    output.print_report(rep)
    return 1 if rep["errors_total"] else 0


if __name__ == "__main__":
    sys.exit(main())

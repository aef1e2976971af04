"""Requests/s and streamed chunks/s of ONE sidecar on a zero-delay simulated engine.

Starts ``python -m proxy sidecar --engine sim`` on 127.0.0.1 with every simulated cost
at 0 ms, so what is measured is the sidecar itself: parsing, admission, the engine
loop, encoding and the wire. This process drives it with a closed loop of C workers
(bench/loadgen.py: asyncio + aiohttp / grpc.aio, on uvloop when installed) in three
scenarios:

    completions  POST /v1/completions, max_tokens=16               -> requests/s
    stream       POST /v1/completions, stream, max_tokens=64       -> requests/s, chunks/s
    grpc         unitproxy.v1.Inference/Generate, max_tokens=64    -> streams/s, messages/s
                 (tokens that waited on a write are merged into one message)

Each run (scenario x concurrency) warms up, then measures a fixed window. Only
requests that finish successfully inside the window count (with all their chunks);
errors count over the whole run. TTFT is client-side: send to first SSE event or gRPC
message (for non-streaming requests, to the whole response). Sidecar CPU is the
child's utime+stime from /proc/<pid>/stat across the window. Every response is
checked (status, chunk count, finish reason, [DONE]); a run with errors says so.

Client and sidecar share this machine's cores: the client CPU column shows how much
the load generator itself took.

    .venv/bin/python bench/sidecar_throughput.py            # about a minute on 2 cores
    .venv/bin/python bench/sidecar_throughput.py --quick    # smoke run
    .venv/bin/python bench/sidecar_throughput.py --scenarios grpc --concurrency 1,64 \\
        --sidecar-arg=--log-level=warning
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the bench package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import grpc

from bench import loadgen
from bench.common import (
    Interrupted,
    cpu_model,
    free_ports,
    loop_name,
    run_loop,
    until_signal,
)
from bench.loadgen import RequestFn
from proxy.procutil import Child, ChildFailed, python_m, running

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "sidecar_throughput.json"
QUICK_OUT = DEFAULT_OUT.with_suffix(".quick.json")  # a smoke run keeps the full results
HOST = "127.0.0.1"
PROMPT = "Benchmark the sidecar with this short prompt"
READY_TIMEOUT_S = 30.0  # the sidecar must report SERVING within this
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this
IDLE_TIMEOUT_S = 2.0  # after a run, the sidecar must show 0 outstanding within this
MAX_LOG_LINES = 100  # sidecar warnings kept in the JSON
PRINTED_LOG_LINES = 10  # and printed
BUSY_LOADAVG = 0.5  # a 1-min load average above this before the run gets a warning


# -- the scenarios and one run -------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    protocol: str  # "http" or "grpc"
    stream: bool
    max_tokens: int

    def open_client(
        self, sidecar: Child, concurrency: int
    ) -> AbstractAsyncContextManager[RequestFn]:
        if self.protocol == "grpc":
            return loadgen.grpc_client(sidecar.grpc_target, PROMPT, self.max_tokens)
        # No "model": the sidecar's served model.
        body = {"prompt": PROMPT, "max_tokens": self.max_tokens, "stream": self.stream}
        return loadgen.http_client(sidecar.http_url, body, concurrency)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("completions", "POST /v1/completions max_tokens=16", "http", False, 16),
        Scenario("stream", "POST /v1/completions stream max_tokens=64", "http", True, 64),
        Scenario("grpc", "gRPC Inference/Generate max_tokens=64", "grpc", True, 64),
    )
}  # fmt: skip


@dataclass(frozen=True)
class RunResult:
    scenario: str
    concurrency: int
    window_s: float
    requests: int
    chunks: int
    ttft_ms: dict[str, float | None]
    sidecar_cpu_s: float
    client_cpu_s: float
    errors: dict[str, int]
    outstanding_after: int | None  # the sidecar's count once idle; anything but 0 leaked

    @property
    def error_count(self) -> int:
        return sum(self.errors.values()) + (self.outstanding_after != 0)

    def rate(self, count: float) -> float:
        return count / self.window_s if self.window_s > 0 else 0.0

    def per(self, cpu_s: float, count: int, scale: int = 1) -> float | None:
        return cpu_s * 1000 * scale / count if count else None

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "requests_per_s": self.rate(self.requests),
            "chunks_per_s": self.rate(self.chunks),
            "sidecar_cpu_pct": 100 * self.rate(self.sidecar_cpu_s),
            "client_cpu_pct": 100 * self.rate(self.client_cpu_s),
            "sidecar_cpu_ms_per_request": self.per(self.sidecar_cpu_s, self.requests),
            "sidecar_cpu_ms_per_1k_chunks": self.per(self.sidecar_cpu_s, self.chunks, 1000),
            "error_count": self.error_count,
        }


async def measure(
    scenario: Scenario, concurrency: int, sidecar: Child, settings: BenchSettings
) -> RunResult:
    def read_cpu() -> dict[str, float]:
        return {"sidecar": sidecar.cpu_s(), "client": time.process_time()}

    async with scenario.open_client(sidecar, concurrency) as request:
        window = await loadgen.measure(request, concurrency, settings.warmup_s,
                                       settings.duration_s, settings.max_requests, read_cpu)  # fmt: skip
    return RunResult(
        scenario=scenario.name,
        concurrency=concurrency,
        window_s=window.window_s,
        requests=window.requests,
        chunks=window.messages,  # SSE events; gRPC messages, merged deltas as one
        ttft_ms={f"p{p}": _ms(loadgen.percentile(window.ttfts, p)) for p in (50, 99)},
        sidecar_cpu_s=window.cpu_s["sidecar"],
        client_cpu_s=window.cpu_s["client"],
        errors=window.errors,
        outstanding_after=await loadgen.outstanding_when_idle(sidecar.http_url, IDLE_TIMEOUT_S),
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


async def run_all(sidecar: Child, settings: BenchSettings) -> list[RunResult]:
    results = []
    for name in settings.scenarios:
        for concurrency in settings.concurrency:
            sidecar.check_alive()
            print(f"  {name} c={concurrency} ...", file=sys.stderr, flush=True)
            results.append(await measure(SCENARIOS[name], concurrency, sidecar, settings))
    sidecar.check_alive()
    return results


# -- the sidecar, a child process -----------------------------------------------------
# The shared launcher, not ``unitproxy up``: one sidecar alone, with no gateway to share
# the cores with.


def sidecar_args(http_port: int, grpc_port: int, slots: int, extra: Sequence[str]) -> list[str]:
    return [
        "sidecar",
        "--host", HOST, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--engine", "sim",
        "--sim-decode-step-ms", "0", "--sim-prefill-ms-per-token", "0",
        "--sim-decode-ms-per-seq", "0",
        "--capacity", str(slots), "--sim-max-num-seqs", str(slots),
        *extra,
    ]  # fmt: skip


@asynccontextmanager
async def running_sidecar(slots: int, extra: Sequence[str], log_path: Path) -> AsyncIterator[Child]:
    """Start the sidecar, wait until it is ready, and always stop it."""
    http_port, grpc_port = free_ports(2)
    argv = python_m(*sidecar_args(http_port, grpc_port, slots, extra))
    async with running(
        "sidecar", argv, log_path, cwd=REPO, stop_timeout_s=STOP_TIMEOUT_S
    ) as sidecar:
        sidecar.http_url, sidecar.grpc_target = f"http://{HOST}:{http_port}", f"{HOST}:{grpc_port}"
        await sidecar.until_ready(READY_TIMEOUT_S)
        yield sidecar


async def bench(settings: BenchSettings, log_path: Path) -> tuple[Child, list[RunResult]]:
    slots = max(settings.concurrency)
    async with running_sidecar(slots, settings.sidecar_args, log_path) as sidecar:
        results = await run_all(sidecar, settings)
    return sidecar, results  # stopped: its exit code is known


# -- settings, machine, report --------------------------------------------------------


@dataclass(frozen=True)
class BenchSettings:
    duration_s: float
    warmup_s: float
    concurrency: tuple[int, ...]
    scenarios: tuple[str, ...]
    max_requests: int
    out: Path
    sidecar_args: tuple[str, ...]


def _names(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def _ints(text: str) -> list[int]:
    values = [int(part) for part in _names(text)]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrency must be at least 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Requests/s and chunks/s of one sidecar on a zero-delay sim engine.",
        epilog="Pass sidecar flags with '=', e.g. --sidecar-arg=--log-level=warning.",
    )
    add = parser.add_argument
    add("--duration", type=float, help="measured window per run, in s. Default 5 (--quick: 1).")
    add("--warmup", type=float, help="uncounted warm-up per run, in s. Default 1 (--quick: 0.5).")
    add(
        "--concurrency",
        type=_ints,
        action="extend",
        metavar="N[,N...]",
        help="closed-loop workers; several allowed. Default 1,16,64 (--quick: 1,16).",
    )
    add(
        "--scenarios",
        type=_names,
        action="extend",
        metavar="NAME[,NAME...]",
        help=f"of {', '.join(SCENARIOS)}. Default all.",
    )
    add(
        "--max-requests",
        type=int,
        default=1_000_000,
        help="most requests started per run (a safety bound). Default 1,000,000.",
    )
    add(
        "--out",
        type=Path,
        help=f"JSON results. Default {DEFAULT_OUT.relative_to(REPO)} (--quick: {QUICK_OUT.name}).",
    )
    add(
        "--sidecar-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the sidecar command line (repeatable; later flags win).",
    )
    add("--quick", action="store_true", help="smoke run: 1 s windows, concurrency 1 and 16.")
    return parser


def parse_settings(argv: Sequence[str] | None) -> BenchSettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    scenarios = tuple(dict.fromkeys(args.scenarios or SCENARIOS))
    unknown = [name for name in scenarios if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    if (args.duration is not None and args.duration <= 0) or (args.warmup or 0) < 0:
        parser.error("--duration must be above 0 and --warmup at least 0")
    # --quick changes only the defaults; flags given explicitly still win.
    duration, warmup, concurrency = (1.0, 0.5, (1, 16)) if args.quick else (5.0, 1.0, (1, 16, 64))
    return BenchSettings(
        duration_s=duration if args.duration is None else args.duration,
        warmup_s=warmup if args.warmup is None else args.warmup,
        concurrency=tuple(dict.fromkeys(args.concurrency or concurrency)),
        scenarios=scenarios,
        max_requests=args.max_requests,
        out=args.out or (QUICK_OUT if args.quick else DEFAULT_OUT),
        sidecar_args=tuple(args.sidecar_arg),
    )


def machine_info() -> dict[str, Any]:
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cgroup_cpu_max": _read("/sys/fs/cgroup/cpu.max"),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "client_loop": loop_name(),
        "aiohttp": aiohttp.__version__,
        "grpcio": grpc.__version__,
    }


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


Row = dict[str, Any]  # one RunResult.to_json()
COLUMNS: tuple[tuple[str, Callable[[Row], str]], ...] = (
    ("scenario", lambda r: r["scenario"]),
    ("conc", lambda r: str(r["concurrency"])),
    ("req/s", lambda r: _fmt(r["requests_per_s"])),
    ("chunks/s", lambda r: _fmt(r["chunks_per_s"] or None)),
    ("TTFT p50 ms", lambda r: _fmt(r["ttft_ms"]["p50"], 2)),
    ("TTFT p99 ms", lambda r: _fmt(r["ttft_ms"]["p99"], 2)),
    ("sidecar CPU %", lambda r: _fmt(r["sidecar_cpu_pct"])),
    ("CPU ms/req", lambda r: _fmt(r["sidecar_cpu_ms_per_request"], 3)),
    ("CPU ms/1k chunks", lambda r: _fmt(r["sidecar_cpu_ms_per_1k_chunks"], 1)),
    ("client CPU %", lambda r: _fmt(r["client_cpu_pct"])),
    ("errors", lambda r: str(r["error_count"])),
)


def table(rows: Sequence[Row]) -> str:
    cells = [[name for name, _ in COLUMNS]]
    cells += [[cell(row) for _, cell in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]

    def line(values: list[str]) -> str:
        first, *rest = zip(values, widths, strict=True)
        return "  ".join([first[0].ljust(first[1]), *(v.rjust(w) for v, w in rest)])

    lines = [line(values) for values in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def error_lines(results: Sequence[RunResult]) -> list[str]:
    lines = []
    for r in results:
        for kind, count in sorted(r.errors.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {r.scenario} c={r.concurrency}: {count} x {kind}")
        if r.outstanding_after != 0:
            lines.append(
                f"  {r.scenario} c={r.concurrency}: sidecar shows "
                f"{r.outstanding_after} outstanding requests after the run (want 0)"
            )
    return lines


def print_report(report: dict[str, Any], results: Sequence[RunResult]) -> None:
    s = report["settings"]
    m = report["machine"]
    print(f"command: {report['command']}")
    print(f"sidecar: {report['sidecar']['command']}")
    print(
        f"machine: nproc {m['nproc']}, {m['cpu_model']}, {m['python']}, client loop "
        f"{m['client_loop']}, cgroup cpu.max {m['cgroup_cpu_max']}"
    )
    busy = m["loadavg_1min_before"] > BUSY_LOADAVG
    note = " (the machine was busy before the run: numbers may be noisy)" if busy else ""
    print(f"load average (1 min) before the run: {m['loadavg_1min_before']:.2f}{note}")
    print(f"window {s['duration_s']:g} s after {s['warmup_s']:g} s warm-up per run")
    for name in s["scenarios"]:
        print(f"  {name}: {SCENARIOS[name].description}")
    print()
    print(table(report["results"]))
    print("TTFT of 'completions' is the time to the whole (non-streamed) response.")
    _print_problems(report, results)
    print(f"\nJSON: {report['out']}")


def _print_problems(report: dict[str, Any], results: Sequence[RunResult]) -> None:
    sidecar = report["sidecar"]
    errors = error_lines(results)
    if errors:
        print(f"\n!!! {report['errors_total']} ERRORS: these numbers are not trustworthy !!!")
        print("\n".join(errors))
    else:
        print("\nno errors: every response had status 200/OK and the expected chunks")
    if sidecar["exit_code"] != 0:
        print(f"!!! the sidecar exited with {sidecar['exit_code']} after SIGTERM (want 0)")
    if sidecar["log_problem_count"]:
        print(f"sidecar log ({sidecar['log']}): {sidecar['log_problem_count']} warnings and errors")
        print("\n".join(f"  {line}" for line in sidecar["log_problems"][:PRINTED_LOG_LINES]))


def build_report(
    settings: BenchSettings,
    sidecar: Child,
    results: Sequence[RunResult],
    load_before: float,
) -> dict[str, Any]:
    settings_json = {**asdict(settings), "out": str(settings.out)}
    problems = sidecar.log_problems()
    return {
        "benchmark": "sidecar_throughput",
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "settings": settings_json,
        "machine": {**machine_info(), "loadavg_1min_before": load_before},
        "sidecar": {
            "command": shlex.join(sidecar.argv),
            "exit_code": sidecar.exit_code,
            "log": str(sidecar.log_path),
            "log_problem_count": len(problems),
            "log_problems": problems[:MAX_LOG_LINES],
        },
        "errors_total": sum(r.error_count for r in results),
        "results": [r.to_json() for r in results],
        "out": str(settings.out),
    }


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]  # other work on the machine makes the numbers noisy
    log_path = settings.out.with_suffix(".sidecar.log")
    try:
        sidecar, results = run_loop(until_signal(bench(settings, log_path)))
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"interrupted ({str(exc) or 'SIGINT'}); the sidecar was stopped", file=sys.stderr)
        return 130
    except ChildFailed as exc:
        print(f"!!! {exc}", file=sys.stderr)
        return 1
    report = build_report(settings, sidecar, results, load_before)
    settings.out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report, results)
    failed = report["errors_total"] or report["sidecar"]["exit_code"] != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

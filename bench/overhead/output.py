"""What a person reads: the machine, the processes, the table, the targets, the problems."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from bench.common import no_plot
from bench.overhead import goals, plot, report

PRINTED_LOG_LINES = 5
BUSY_LOADAVG = 0.5  # a 1-min load average above this before the run gets a note
NOISY_OTHERS_PCT = 20  # other processes' mean CPU (% of one core) above this gets a warning


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    model = "unknown"
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
            break
    try:
        loop = f"uvloop {importlib.metadata.version('uvloop')}"
    except importlib.metadata.PackageNotFoundError:
        loop = "asyncio"
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "memory": (_read("/proc/meminfo") or "").split("\n", 1)[0],
        "cgroup_cpu_max": _read("/sys/fs/cgroup/cpu.max"),
        "kernel": platform.release(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "client_loop": loop,
        "aiohttp": aiohttp.__version__,
        "grpcio": grpc.__version__,
    }


def print_report(rep: dict[str, Any]) -> None:
    s, m = rep["settings"], rep["machine"]
    print(f"command: {rep['command']}")
    print(
        f"machine: nproc {m['nproc']}, {m['cpu_model']}, {m['memory']}, kernel {m['kernel']}, "
        f"{m['python']}, client {m['client_loop']} + aiohttp {m['aiohttp']} / grpcio {m['grpcio']}"
    )
    busy = m["loadavg_1min_before"] > BUSY_LOADAVG
    note = " (the machine was busy before the run: absolute numbers are noisy)" if busy else ""
    print(
        f"load average (1 min): {m['loadavg_1min_before']:.2f} before, "
        f"{m['loadavg_1min_after']:.2f} after{note}"
    )
    others = [r["others_cpu_pct"] for r in rep["rows"] if r["others_cpu_pct"] is not None]
    if others:
        mean = sum(others) / len(others)
        warn = " (!!! other work competed for the cores: ratios hold better than absolutes)"
        print(
            f"other processes' CPU during the windows: mean {mean:.0f}%, max {max(others):.0f}% "
            f"of one core{warn if mean > NOISY_OTHERS_PCT else ''}"
        )
    print(
        f"{s['repeats']} repeat(s) of {s['duration_s']:g} s windows after {s['warmup_s']:g} s "
        f"warm-up, targets interleaved; {rep['elapsed_s']:g} s in all"
    )
    for name, sc in rep["scenarios"].items():
        print(f"  {name}: {sc['description']}")
    print("one sidecar per target, all with these flags but their own ports:")
    for phase in rep["phases"]:
        code = phase["backend"].get("code") or {}
        dirty = code.get("uncommitted") or []
        changes = f", uncommitted: {' '.join(dirty)}" if dirty else ""
        print(f"  product code: commit {code.get('commit', '?')}{changes}")
        print(f"  {phase['backend']['argv']}")
        for t in phase["targets"]:
            if t["name"] == "direct":
                continue
            state = f"{t['version']}" if t["available"] else f"LEFT OUT: {t['reason']}"
            env = " ".join(f"{k}={v}" for k, v in t["env"].items())
            print(f"    {t['name']}: {state}")
            if t["available"]:
                print(f"      {(env + ' ') if env else ''}{shlex.join(t['argv'])}")
    print()
    print(report.table(rep["rows"]))
    print(
        "\nx direct: chunks/s ratio (completions, embeddings: req/s), pooled over repeats, (min-max per repeat)."
        "\nCPU-bound x: direct's (client + sidecar) CPU per chunk (completions, embeddings: per request) over"
        " the target's (client + router + sidecar): the ratio once these processes alone fill"
        " the cores, robust to other work on the machine."
        "\nTTFT: client-side, send to first SSE event / gRPC message; completions: the whole"
        " response. +p50/+p99: over direct in the same cell.\nrouter CPU: utime+stime of the"
        " router's process tree over the window; wait us/req: how long, a request, its"
        " threads were ready to run and had no core (the kernel's run delay, from schedstat;"
        " '-' without it); sidecar wait%: the same for the sidecar, over the window."
        "\ngRPC chunks are tokens: a message carries"
        " every token delta that waited while the reader was behind (msgs/req below)."
    )
    grpc_rows = [r for r in rep["rows"] if r["scenario"] == "grpc" and r["messages_per_request"]]
    for r in grpc_rows:
        per_msg = r.get("router_cpu_ms_per_1k_messages")
        print(
            f"  grpc c={r['concurrency']} {r['target']}: {r['messages_per_request']:.1f}"
            f" messages per 64-token stream"
            + (f", router {per_msg:.0f} ms CPU per 1k messages" if per_msg else "")
        )
    print("\nunitproxy against the issue's targets:")
    for v in rep["verdicts"]:
        print(f"  [{v['status']}] {v['target']}\n      {v['figures']}")
    _print_problems(rep)
    print(f"\nJSON: {rep['out']}\nPNG:  {rep['png']}")


def _print_problems(rep: dict[str, Any]) -> None:
    if rep["errors_total"]:
        print(
            f"\n!!! {rep['errors_total']} ERRORS: the rows that have them are not trustworthy !!!"
        )
        for row in rep["rows"]:
            for kind, n in row["errors"].items():
                print(f"  {row['scenario']} c={row['concurrency']} {row['target']}: {n} x {kind}")
    else:
        print("\nno errors: every response had status 200/OK and the expected chunks")
    for phase in rep["phases"]:
        backend = phase["backend"]
        step = f"{backend['decode_step_ms']:g} ms/token"
        # A JSON from before one sidecar per target had one shared sidecar.
        sidecars = backend.get("sidecars") or {"shared": backend}
        procs = [(f"sidecar of {name}", info) for name, info in sidecars.items()]
        procs += [(t["name"], t) for t in phase["targets"] if t["log"]]
        for name, info in procs:
            code, problems = info.get("exit_code"), info.get("log_problems") or []
            if code not in (0, None):
                print(f"{name} ({step}) exited with {code} on SIGTERM")
            if info.get("http2_preface_errors"):
                print(
                    f"{name} ({step}): {info['http2_preface_errors']} of its logged errors are "
                    "HTTP/2 prefaces sent to its HTTP port: sglang-router's gRPC-worker "
                    "detection at start-up"
                )
            # Each preface is logged as one error line and one traceback: nothing else to show.
            if problems and len(problems) > 2 * (info.get("http2_preface_errors") or 0):
                print(f"{name} ({step}) log: {len(problems)} warnings/errors, first ones:")
                for line in problems[:PRINTED_LOG_LINES]:
                    print(f"    {line[:160]}")


def draw(rep: dict[str, Any]) -> None:
    s, m = rep["settings"], rep["machine"]
    title = (
        f"bench/overhead: {m['nproc']} cores {m['cpu_model']}, {s['repeats']}x{s['duration_s']:g} s "
        f"windows per cell, targets interleaved, {rep['finished_at']}"
    )
    if (why := no_plot()) is not None:
        print(why)
        return
    plot.plot(rep["rows"], s["concurrency"], title, Path(rep["png"]))


def redraw(path: Path) -> int:
    """Print the report and draw the PNG again from a JSON this bench wrote."""
    rep = json.loads(path.read_text())
    for row in rep["rows"]:  # JSON keys are strings; older JSON has none
        row["rate_by_repeat"] = report.rate_by_repeat(
            [r for r in rep["runs"] if report.key(r) == report.key(row)]
        )
    rep["verdicts"] = [
        v.to_json() for v in goals.verdicts(rep["rows"], rep["settings"]["concurrency"])
    ]
    draw(rep)
    print_report(rep)
    return 1 if rep["errors_total"] else 0

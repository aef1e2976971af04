"""Router work per non-streamed request, counted in instructions: noise-free.

bench/overhead times routers on a shared, noisy 2-core machine: at concurrency 1 the
routers' rates move 10-40 % between runs while their order is within a few per cent.
This bench counts instead. Each router runs under valgrind's callgrind, which counts
the user-space instructions a process executes (the same count whatever else the
machine does), in front of its own sim sidecar (not counted). A client on one
connection sends ``--requests`` non-streamed completions after a warm-up. The same
router is then started again and left idle for as long as those requests took, so its
start, stop, timers, health checks and load reports cancel out:

    instructions per request = (count with the requests - idle count) / requests

Kernel work (system calls, TCP on loopback) is not counted: bench/overhead's router
CPU column has it. Threads are counted together, as the CPU is. Where the instructions
go is shown too: each function's own instructions (not its callees'), the idle run
subtracted in the same way, the ``--top`` largest per target (callgrind_annotate,
which comes with valgrind).

    python bench/overhead/instructions.py                   # every target, 2,000 requests
    python bench/overhead/instructions.py --targets unitproxy,unitproxy+compiled
    python bench/overhead/instructions.py --quick           # unitproxy, 100 requests

Needs valgrind (Debian package valgrind; without it nothing is measured, and the
bench says so); peers from bench/overhead/setup_peers.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the bench.overhead package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import MODEL, answers, code_version, cpu_model, free_ports, run_loop
from bench.overhead import targets
from proxy.procutil import python_m

TARGETS = ("unitproxy", targets.COMPILED, "vllm-router", "sglang-router")
BODY = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 8}).encode()
REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY)
) + BODY
START_TIMEOUT_S = 4 * targets.READY_TIMEOUT_S  # a router under valgrind starts 20-50x slower
SETTLE_S = 2.0  # after start and before stop: the same in both runs


async def _requests(url: str, n: int) -> None:
    """``n`` completions, one at a time on one connection; each must be a 200."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for _ in range(n):
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"{url}: {head[:200]!r}")
            lower = head.lower()
            at = lower.index(b"content-length:") + len(b"content-length:")
            await reader.readexactly(int(lower[at : lower.index(b"\r\n", at)]))
    finally:
        writer.close()


def _router_argv(name: str, backend: targets.Backend) -> tuple[list[str], dict[str, str], str]:
    """The router's command line, extra environment and URL."""
    port, other = free_ports(2)
    url = f"http://{targets.HOST}:{port}"
    if name in ("unitproxy", targets.COMPILED):
        argv = [
            *python_m("gateway"),
            "--host", targets.HOST, "--http-port", str(port), "--grpc-port", str(other),
            "--unit", f"u0={backend.http_url},{backend.grpc_target}", "--log-level", "warning",
        ]  # fmt: skip
        return argv, {}, url
    argv, env, _ = targets.PEERS[name](backend, port, other)
    return argv, env, url


# A function's line in callgrind_annotate's listing: count, share, file:function [object]
_FUNCTION_LINE = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(.+?)(?: \[([^\]]+)\])?$", re.M)


def _function_name(where: str, obj: str | None) -> str:
    """``file.c:function`` with the file's folders dropped (build paths differ); the
    object's file name where callgrind knows no source file."""
    file, _, function = where.partition(":")
    if file == "???" and obj:
        file = obj
    return f"{file.rsplit('/', 1)[-1]}:{function}"


def own_instructions(listing: str) -> dict[str, int]:
    """Each function's own instructions in callgrind_annotate's listings (one or more,
    joined), summed by name."""
    costs: dict[str, int] = {}
    for count, where, obj in _FUNCTION_LINE.findall(listing):
        if where.strip() == "PROGRAM TOTALS":
            continue
        name = _function_name(where, obj or None)
        costs[name] = costs.get(name, 0) + int(count.replace(",", ""))
    return costs


def rank(
    with_requests: dict[str, int], idle: dict[str, int], requests: int, top: int
) -> list[dict[str, Any]]:
    """The ``top`` functions by own instructions a request, the idle run's subtracted."""
    per_request = {
        name: (count - idle.get(name, 0)) / requests for name, count in with_requests.items()
    }
    ranked = sorted(per_request.items(), key=lambda item: item[1], reverse=True)[:top]
    return [{"function": name, "instructions_per_request": round(v)} for name, v in ranked]


async def _by_function(out_dir: Path) -> dict[str, int]:
    """Each function's own instructions, summed over the dumps callgrind wrote there."""
    listings = []
    for path in await asyncio.to_thread(_dumps, out_dir):
        annotate = await asyncio.create_subprocess_exec(
            "callgrind_annotate", "--inclusive=no", "--threshold=100", "--auto=no", str(path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        listing, _ = await annotate.communicate()
        if annotate.returncode != 0:
            raise targets.Unavailable(f"callgrind_annotate failed on {path}")
        listings.append(listing.decode(errors="replace"))
    return own_instructions("\n".join(listings))


async def top_functions(busy: Path, idle: Path, requests: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` functions by own instructions a request (the idle run subtracted)."""
    return rank(await _by_function(busy), await _by_function(idle), requests, top)


def _dumps(out_dir: Path) -> list[Path]:
    """The files callgrind wrote there: one per process and part."""
    return sorted(out_dir.glob("callgrind.*"))


def _counted(out_dir: Path) -> int:
    """Instructions in every dump callgrind wrote there."""
    total = 0
    for path in _dumps(out_dir):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("summary:") or line.startswith("totals:"):
                total += int(line.split()[1])
                break
    return total


def _run_dir(work: Path, name: str, idle: bool) -> Path:
    return work / f"{name}-{'idle' if idle else 'requests'}"


async def _one_run(
    name: str, cwd: Path | None, requests: int, warmup: int, idle_s: float | None, work: Path
) -> tuple[int, float]:
    """One router under callgrind: (instructions, seconds the measured part took)."""
    out_dir = _run_dir(work, name, idle_s is not None)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    async with AsyncExitStack() as stack:
        backend = await targets.start_backend(stack, 0.0, 256, out_dir, name)
        argv, env, url = _router_argv(name, backend)
        valgrind = [
            "valgrind", "--tool=callgrind", "--dump-instr=no", "--trace-children=no",
            f"--callgrind-out-file={out_dir}/callgrind.%p",
        ]  # fmt: skip
        child = await stack.enter_async_context(
            targets.running(name, [*valgrind, *argv], out_dir / "router.log", env=env, cwd=cwd)
        )
        await child.until(answers(url), START_TIMEOUT_S, "answering")
        await _requests(url, warmup)
        await asyncio.sleep(SETTLE_S)
        started = time.monotonic()
        if idle_s is None:
            await _requests(url, requests)
        else:
            await asyncio.sleep(idle_s)
        took = time.monotonic() - started
        await asyncio.sleep(SETTLE_S)
    counted = _counted(out_dir)
    if counted == 0:
        raise targets.Unavailable(f"{name}: callgrind wrote no counts in {out_dir}")
    return counted, took


async def measure(name: str, requests: int, warmup: int, work: Path, top: int) -> dict[str, Any]:
    cwd = await targets.compiled_tree() if name == targets.COMPILED else None
    busy, took = await _one_run(name, cwd, requests, warmup, None, work)
    idle, _ = await _one_run(name, cwd, requests, warmup, took, work)
    row: dict[str, Any] = {
        "target": name,
        "requests": requests,
        "instructions_with_requests": busy,
        "instructions_idle": idle,
        "instructions_per_request": (busy - idle) / requests,
        "seconds_under_valgrind": round(took, 1),
    }
    if top > 0 and shutil.which("callgrind_annotate") is not None:
        row["top_functions"] = await top_functions(
            _run_dir(work, name, False), _run_dir(work, name, True), requests, top
        )
    return row


def _top_lines(row: dict[str, Any]) -> list[str]:
    # Rust and C++ names can run to hundreds of characters; the JSON keeps them whole.
    return [
        f"  {f['instructions_per_request']:>10,}  {f['function'][:120]}"
        for f in row.get("top_functions", ())
    ]


def report(rows: Sequence[dict[str, Any]]) -> str:
    vllm = next((r for r in rows if r["target"] == "vllm-router"), None)
    lines = [f"{'target':<20} {'instructions/request':>21} {'x vllm-router':>14}"]
    for r in rows:
        ratio = (
            f"{r['instructions_per_request'] / vllm['instructions_per_request']:.2f}"
            if vllm and vllm["instructions_per_request"] > 0
            else "-"
        )
        lines.append(f"{r['target']:<20} {r['instructions_per_request']:>21,.0f} {ratio:>14}")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> int:
    work = args.out.with_suffix("").resolve()  # the compiled router runs in its own tree
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    if shutil.which("valgrind") is None:  # left out, saying so, as a missing peer is
        why = "valgrind is not installed (Debian package valgrind)"
        skipped = dict.fromkeys(args.targets, why)
        print(f"instructions: nothing measured: {why}", file=sys.stderr)
    for name in args.targets if not skipped else ():
        try:
            rows.append(await measure(name, args.requests, args.warmup, work, args.top))
        except targets.Unavailable as exc:
            skipped[name] = str(exc)
            print(f"instructions: {name} left out: {exc}", file=sys.stderr)
        else:
            print(f"instructions: {name}: {rows[-1]['instructions_per_request']:,.0f} a request")
            if rows[-1].get("top_functions"):
                print(
                    f"  its functions with the most own instructions a request (--top {args.top}):"
                )
                print("\n".join(_top_lines(rows[-1])))
    print(report(rows))
    result = {
        "benchmark": "overhead-instructions",
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {"cpu": cpu_model()},
        "code": code_version(),
        "rows": rows,
        "left_out": skipped,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON: {args.out}")
    return 0 if rows or shutil.which("valgrind") is None else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", help=f"comma-separated, of {', '.join(TARGETS)} (default all)")
    parser.add_argument("--requests", type=int, help="measured requests per target (default 2,000)")
    parser.add_argument("--warmup", type=int, help="requests before the count (default 300)")
    parser.add_argument("--out", type=Path, help="JSON (default bench/results/instructions.json)")
    parser.add_argument("--quick", action="store_true", help="unitproxy only, 100 requests")
    parser.add_argument(
        "--top", type=int, default=12,
        help="functions listed per target by own instructions a request (default 12; 0: none)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    names = args.targets.split(",") if args.targets else (["unitproxy"] if args.quick else TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown target {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    args.targets = list(dict.fromkeys(names))
    args.requests = args.requests or (100 if args.quick else 2000)
    args.warmup = args.warmup if args.warmup is not None else (50 if args.quick else 300)
    if args.requests < 1 or args.warmup < 0 or args.top < 0:
        parser.error("--requests must be at least 1, --warmup and --top at least 0")
    default = "instructions.quick.json" if args.quick else "instructions.json"
    args.out = args.out or Path(__file__).resolve().parents[1] / "results" / default
    return args


if __name__ == "__main__":
    sys.exit(run_loop(main(parse_args())))

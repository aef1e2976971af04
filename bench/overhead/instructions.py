"""Router work per non-streamed request, counted in instructions: noise-free.

bench/overhead times routers on a shared, noisy 2-core machine: at concurrency 1 the
routers' rates move 10-40 % between runs while their order is within a few per cent.
This bench counts instead. Each router runs under valgrind's callgrind, which counts
the user-space instructions a process executes (the same count whatever else the
machine does), in front of its own sim sidecar (not counted). A client on one
connection sends ``--requests`` requests of each ``--scenarios`` after a warm-up:
``completions`` (non-streamed, 8 tokens), ``stream-0ms`` (SSE, 64 tokens) and ``grpc``
(Inference/Generate, 64 tokens; unitproxy only), bench/overhead's scenarios. The same
router is then started again and left idle for as long as those requests took, so its
start, stop, timers, health checks and load reports cancel out:

    instructions per request = (count with the requests - idle count) / requests

For the compiled tree (``unitproxy+compiled``, ``+tenants``) the request's own path is
counted apart too: the inclusive instructions of the functions that handle a request
(``REQUEST_PATH``: the client connection's reads, the request's coroutine, the unit
connection's reads; over gRPC, the Generate handler), the idle run subtracted. It leaves
out the background work that the whole-process count carries and that the idle run
does not cancel exactly (timers, load reports, a Redis loop), so what a change to the
request's handling saves or adds shows there first. ``tenants add to it`` is that
path's growth over the whole request without tenants.

Kernel work (system calls, TCP on loopback) is not counted: bench/overhead's router
CPU column has it. Threads are counted together, as the CPU is. Where the instructions
go is shown too: each function's own instructions (not its callees'), the idle run
subtracted in the same way, the ``--top`` largest per target (callgrind_annotate,
which comes with valgrind).

    python bench/overhead/instructions.py                   # every target, 2,000 requests
    python bench/overhead/instructions.py --targets unitproxy,unitproxy+compiled
    python bench/overhead/instructions.py --quick           # unitproxy, 100 requests
    python bench/overhead/instructions.py --targets unitproxy,unitproxy+tenants \
        --scenarios completions,stream-0ms,grpc            # what tenants add, pure tree

The ``+tenants`` targets (``unitproxy+tenants``, ``unitproxy+compiled+tenants``) run the
gateway with bench/overhead's tenants file, its limits counted in a redis-server of the
bench's own (each replica's allotments: most admissions need no Redis call), and every
request of every target in the run carries the tenant's key; not in the defaults.

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
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the bench.overhead package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import MODEL, answers, code_version, cpu_model, free_ports, run_loop
from bench.overhead import targets
from bench.overhead.load import SCENARIOS, open_client
from bench.redisproc import redis_server, why_not
from proxy.procutil import python_m

TARGETS = ("unitproxy", targets.COMPILED, "vllm-router", "sglang-router")  # the defaults
KNOWN = (*TARGETS, targets.TENANTS, targets.COMPILED_TENANTS)
UNITPROXY = ("unitproxy", targets.COMPILED, targets.TENANTS, targets.COMPILED_TENANTS)
SCENARIO_NAMES = ("completions", "stream-0ms", "grpc")
BODY = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 8}).encode()


def http_request(api_key: str | None) -> bytes:
    """The non-streamed completion, raw, with ``api_key`` as a bearer token."""
    auth = b"" if api_key is None else b"Authorization: Bearer %s\r\n" % api_key.encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"%sContent-Length: %d\r\n\r\n" % (auth, len(BODY))
    ) + BODY


REQUEST = http_request(None)
START_TIMEOUT_S = 4 * targets.READY_TIMEOUT_S  # a router under valgrind starts 20-50x slower
SETTLE_S = 2.0  # after start and before stop: the same in both runs


async def _requests(
    url: str, grpc_target: str, n: int, scenario: str = "completions", api_key: str | None = None
) -> None:
    """``n`` requests of ``scenario``, one at a time on one connection; each must succeed."""
    if scenario != "completions":
        address = grpc_target if scenario == "grpc" else url
        async with open_client(SCENARIOS[scenario], address, MODEL, 1, api_key) as send:
            for _ in range(n):
                outcome = await send()
                if outcome.error is not None:
                    raise RuntimeError(f"{address}: {scenario}: {outcome.error}")
        return
    request = http_request(api_key)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for _ in range(n):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"{url}: {head[:200]!r}")
            lower = head.lower()
            at = lower.index(b"content-length:") + len(b"content-length:")
            await reader.readexactly(int(lower[at : lower.index(b"\r\n", at)]))
    finally:
        writer.close()


def _router_argv(
    name: str, backend: targets.Backend, tenants_args: Sequence[str] = ()
) -> tuple[list[str], dict[str, str], str, str]:
    """The router's command line, extra environment, URL and gRPC target."""
    port, other = free_ports(2)
    url = f"http://{targets.HOST}:{port}"
    if name in UNITPROXY:
        argv = [
            *python_m("gateway"),
            "--host", targets.HOST, "--http-port", str(port), "--grpc-port", str(other),
            "--unit", f"u0={backend.http_url},{backend.grpc_target}", "--log-level", "warning",
            *(tenants_args if targets.is_tenants(name) else ()),
        ]  # fmt: skip
        return argv, {}, url, f"{targets.HOST}:{other}"
    argv, env, _ = targets.PEERS[name](backend, port, other)
    return argv, env, url, ""


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
    return own_instructions(await _annotated(out_dir, False))


# The request's own path in the compiled tree, by mypyc's names of the functions that
# handle it: the client connection's reads (the head parsed, the key checked, the
# request started), the request's coroutine (admission, routing, the attempt, the
# answer written) and the unit connection's reads (its answer parsed). Each runs from
# the event loop, none inside another, so their inclusive counts add up; what they
# leave out (the loop itself, load reports, timers, the cycle collector where it ran
# outside them) is the rest of the whole-process count. Interpreted functions have no
# names of their own in callgrind's listing: the interpreted tree has no such column.
REQUEST_PATH = {
    "http": (
        "CPyDef_front___ClientConnection___data_received",
        "CPyDef_front____serve_ClientConnection_gen_____mypyc_generator_helper__",
        "CPyDef_pool___UnitConnection___data_received",
    ),
    "grpc": ("CPyDef_grpc_proxy___generate_GenerateProxy_gen_____mypyc_generator_helper__",),
}


def inclusive_of(listing: str, names: Sequence[str]) -> dict[str, int]:
    """The inclusive instructions of each of ``names`` (exact symbols) in
    ``callgrind_annotate --inclusive=yes`` listings (one or more, joined): per listing,
    the largest of a symbol's lines (code inlined from a header is a line of its own,
    counted within the function's), summed over listings. A symbol at a deeper recursion
    level (``name'2``) is counted within its first level's line, so it is not added."""
    found: dict[str, int] = {}
    for part in listing.split("PROGRAM TOTALS")[1:] or [listing]:
        best: dict[str, int] = {}
        for count, where, _obj in _FUNCTION_LINE.findall(part):
            symbol = where.rpartition(":")[2].strip()
            if symbol in names:
                best[symbol] = max(best.get(symbol, 0), int(count.replace(",", "")))
        for symbol, count in best.items():
            found[symbol] = found.get(symbol, 0) + count
    return found


async def _annotated(out_dir: Path, inclusive: bool) -> str:
    """callgrind_annotate's listings of every dump callgrind wrote there, joined."""
    listings = []
    for path in await asyncio.to_thread(_dumps, out_dir):
        annotate = await asyncio.create_subprocess_exec(
            "callgrind_annotate", f"--inclusive={'yes' if inclusive else 'no'}",
            "--threshold=100", "--auto=no", str(path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        listing, _ = await annotate.communicate()
        if annotate.returncode != 0:
            raise targets.Unavailable(f"callgrind_annotate failed on {path}")
        listings.append(listing.decode(errors="replace"))
    return "\n".join(listings)


async def request_path(
    busy: Path, idle: Path, requests: int, scenario: str
) -> dict[str, float] | None:
    """The request path's inclusive instructions a request (the idle run subtracted),
    by function and in all (``total``); None where the listing names none of them (an
    interpreted tree, or a router that is not unitproxy)."""
    names = REQUEST_PATH["grpc" if scenario == "grpc" else "http"]
    with_requests = inclusive_of(await _annotated(busy, True), names)
    if not with_requests:
        return None
    idle_counts = inclusive_of(await _annotated(idle, True), names)
    path = {n: (with_requests.get(n, 0) - idle_counts.get(n, 0)) / requests for n in names}
    return {**{n: round(v) for n, v in path.items()}, "total": round(sum(path.values()))}


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


def _run_dir(work: Path, name: str, idle: bool, scenario: str = "completions") -> Path:
    where = name if scenario == "completions" else f"{name}-{scenario}"
    return work / f"{where}-{'idle' if idle else 'requests'}"


@dataclass(frozen=True)
class Load:
    """What each run sends: ``scenario``, with ``api_key`` where the run has tenants."""

    scenario: str = "completions"
    api_key: str | None = None
    tenants_args: tuple[str, ...] = ()  # what a +tenants target gets


async def _one_run(
    name: str,
    cwd: Path | None,
    requests: int,
    warmup: int,
    idle_s: float | None,
    work: Path,
    load: Load = Load(),
) -> tuple[int, float]:
    """One router under callgrind: (instructions, seconds the measured part took)."""
    out_dir = _run_dir(work, name, idle_s is not None, load.scenario)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    async with AsyncExitStack() as stack:
        backend = await targets.start_backend(stack, 0.0, 256, out_dir, name)
        argv, env, url, grpc_target = _router_argv(name, backend, load.tenants_args)
        valgrind = [
            "valgrind", "--tool=callgrind", "--dump-instr=no", "--trace-children=no",
            f"--callgrind-out-file={out_dir}/callgrind.%p",
        ]  # fmt: skip
        child = await stack.enter_async_context(
            targets.running(name, [*valgrind, *argv], out_dir / "router.log", env=env, cwd=cwd)
        )
        await child.until(answers(url, load.api_key), START_TIMEOUT_S, "answering")
        await _requests(url, grpc_target, warmup, load.scenario, load.api_key)
        await asyncio.sleep(SETTLE_S)
        started = time.monotonic()
        if idle_s is None:
            await _requests(url, grpc_target, requests, load.scenario, load.api_key)
        else:
            await asyncio.sleep(idle_s)
        took = time.monotonic() - started
        await asyncio.sleep(SETTLE_S)
    counted = _counted(out_dir)
    if counted == 0:
        raise targets.Unavailable(f"{name}: callgrind wrote no counts in {out_dir}")
    return counted, took


async def measure(
    name: str, requests: int, warmup: int, work: Path, top: int, load: Load = Load()
) -> dict[str, Any]:
    if load.scenario == "grpc" and name not in UNITPROXY:
        raise targets.Unavailable("no gRPC front")
    cwd = await targets.compiled_tree() if targets.is_compiled(name) else None
    busy, took = await _one_run(name, cwd, requests, warmup, None, work, load)
    idle, _ = await _one_run(name, cwd, requests, warmup, took, work, load)
    row: dict[str, Any] = {
        "target": name,
        "scenario": load.scenario,
        "requests": requests,
        "instructions_with_requests": busy,
        "instructions_idle": idle,
        "instructions_per_request": (busy - idle) / requests,
        "seconds_under_valgrind": round(took, 1),
    }
    if shutil.which("callgrind_annotate") is not None:
        busy_dir = _run_dir(work, name, False, load.scenario)
        idle_dir = _run_dir(work, name, True, load.scenario)
        if targets.is_compiled(name):
            path = await request_path(busy_dir, idle_dir, requests, load.scenario)
            if path is not None:
                row["request_path"] = path
        if top > 0:
            row["top_functions"] = await top_functions(busy_dir, idle_dir, requests, top)
    return row


def _top_lines(row: dict[str, Any]) -> list[str]:
    # Rust and C++ names can run to hundreds of characters; the JSON keeps them whole.
    return [
        f"  {f['instructions_per_request']:>10,}  {f['function'][:120]}"
        for f in row.get("top_functions", ())
    ]


def _path_line(path: dict[str, int]) -> str:
    parts = ", ".join(f"{n.removeprefix('CPyDef_')} {v:,}" for n, v in path.items() if n != "total")
    return f"{path['total']:,} ({parts})"


# Each +tenants target and the same gateway without tenants: its A/B.
TENANTS_OFF = {targets.TENANTS: "unitproxy", targets.COMPILED_TENANTS: targets.COMPILED}


def report(rows: Sequence[dict[str, Any]]) -> str:
    """One line per scenario and target: instructions a request, the ratio to
    vllm-router's in the same scenario, and what tenants add over the same tree without."""
    lines = [
        f"{'scenario':<12} {'target':<27} {'instructions/request':>21} {'x vllm-router':>14}"
        f" {'tenants add':>12} {'request path':>13} {'tenants add to it':>18}"
    ]
    for r in rows:
        scenario = r.get("scenario", "completions")
        same = {x["target"]: x for x in rows if x.get("scenario", "completions") == scenario}
        vllm = same.get("vllm-router")
        ratio = (
            f"{r['instructions_per_request'] / vllm['instructions_per_request']:.2f}"
            if vllm and vllm["instructions_per_request"] > 0
            else "-"
        )
        off = same.get(TENANTS_OFF.get(r["target"], ""))
        added = (
            f"{r['instructions_per_request'] / off['instructions_per_request'] - 1:+.1%}"
            if off and off["instructions_per_request"] > 0
            else "-"
        )
        path = r.get("request_path", {}).get("total")
        off_path = off.get("request_path", {}).get("total") if off else None
        # what the request path gains, over the whole request without tenants
        path_added = (
            f"{(path - off_path) / off['instructions_per_request']:+.1%}"
            if off
            and path is not None
            and off_path is not None
            and off["instructions_per_request"] > 0
            else "-"
        )
        lines.append(
            f"{scenario:<12} {r['target']:<27} {r['instructions_per_request']:>21,.0f}"
            f" {ratio:>14} {added:>12} {'-' if path is None else f'{path:,}':>13} {path_added:>18}"
        )
    return "\n".join(lines)


async def _with_tenants(stack: AsyncExitStack, work: Path) -> Load:
    """The load of a run with a +tenants target: bench/overhead's tenants file and a
    redis-server of the bench's own (entered on ``stack``)."""
    why = why_not()
    if why is not None:
        raise targets.Unavailable(f"tenants need a Redis: {why}")
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    path = work / "tenants.toml"
    await asyncio.to_thread(path.write_text, targets.TENANTS_TOML)
    redis = await stack.enter_async_context(redis_server(work / "redis.log"))
    args = ("--tenants-file", str(path), "--redis-url", redis.url)
    return Load("completions", targets.TENANTS_API_KEY, args)


async def main(args: argparse.Namespace) -> int:
    work = args.out.with_suffix("").resolve()  # the compiled router runs in its own tree
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    if shutil.which("valgrind") is None:  # left out, saying so, as a missing peer is
        why = "valgrind is not installed (Debian package valgrind)"
        skipped = dict.fromkeys(args.targets, why)
        print(f"instructions: nothing measured: {why}", file=sys.stderr)
    tenants = any(map(targets.is_tenants, args.targets))
    runs = [(s, n) for s in args.scenarios for n in args.targets] if not skipped else []
    async with AsyncExitStack() as stack:
        load = Load()
        if tenants and runs:
            try:
                load = await _with_tenants(stack, work)
            except targets.Unavailable as exc:
                skipped = dict.fromkeys(args.targets, str(exc))
                runs = []
        for scenario, name in runs:
            key = name if scenario == "completions" else f"{name} ({scenario})"
            try:
                row = await measure(
                    name,
                    args.requests,
                    args.warmup,
                    work,
                    args.top,
                    replace(load, scenario=scenario),
                )
            except targets.Unavailable as exc:
                skipped[key] = str(exc)
                print(f"instructions: {key} left out: {exc}", file=sys.stderr)
                continue
            rows.append(row)
            print(f"instructions: {key}: {row['instructions_per_request']:,.0f} a request")
            if row.get("request_path"):
                print(
                    f"  its request path (inclusive, a request): {_path_line(row['request_path'])}"
                )
            if row.get("top_functions"):
                print(
                    f"  its functions with the most own instructions a request (--top {args.top}):"
                )
                print("\n".join(_top_lines(row)))
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
    parser.add_argument(
        "--targets",
        help=f"comma-separated, of {', '.join(KNOWN)} (default: {', '.join(TARGETS)})",
    )
    parser.add_argument(
        "--scenarios",
        help=f"comma-separated, of {', '.join(SCENARIO_NAMES)} (default completions; grpc:"
        " unitproxy's targets only)",
    )
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
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        parser.error(f"unknown target {', '.join(unknown)}; choose from {', '.join(KNOWN)}")
    args.targets = list(dict.fromkeys(names))
    scenarios = args.scenarios.split(",") if args.scenarios else ["completions"]
    unknown = [s for s in scenarios if s not in SCENARIO_NAMES]
    if unknown:
        parser.error(
            f"unknown scenario {', '.join(unknown)}; choose from {', '.join(SCENARIO_NAMES)}"
        )
    args.scenarios = list(dict.fromkeys(scenarios))
    args.requests = args.requests or (100 if args.quick else 2000)
    args.warmup = args.warmup if args.warmup is not None else (50 if args.quick else 300)
    if args.requests < 1 or args.warmup < 0 or args.top < 0:
        parser.error("--requests must be at least 1, --warmup and --top at least 0")
    default = "instructions.quick.json" if args.quick else "instructions.json"
    args.out = args.out or Path(__file__).resolve().parents[1] / "results" / default
    return args


if __name__ == "__main__":
    sys.exit(run_loop(main(parse_args())))

"""What the tenants' limiter costs the gateway per request, in CPU and Redis round trips.

In one process (as the gateway runs it, on uvloop), --requests requests, --concurrency
at a time, each ``admit`` then ``settle`` for a tenant with every limit set (requests
and tokens per minute, tokens per day, requests at once; never reached), three ways:

    none    a tenant without limits: the limiter counts nothing (the floor)
    local   no Redis: this process's own counts
    redis   counts shared through a redis-server of the bench's own on a free port

Per request: this process's CPU (time.process_time: what the gateway pays), its round
trips to Redis (script calls: the limiter sends nothing else here), the commands Redis
ran (scripts' own included), the bytes sent to Redis and Redis's own CPU (INFO). The
added cost of sharing is redis - local. With limits this large the replica admits from
its allotment (blocks of each limit counted in Redis ahead of the requests): the round
trips are the first requests' (before it holds one) and the give-back at close.

    .venv/bin/python bench/limiter_cost.py            # 20000 requests, 64 at a time
    .venv/bin/python bench/limiter_cost.py --quick    # 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the bench package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import code_version, cpu_model, loop_name, run_loop
from bench.redisproc import RedisProcess, redis_server, why_not
from proxy.ratelimit import Limiter
from proxy.redis_reports import connect
from proxy.settings import RedisSettings
from proxy.tenants import Tenant

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "limiter_cost.json"
BIG = 10**12  # a limit never reached
TOKENS, USED = 300, 250  # reserved at admission, used in the end


def limited() -> Tenant:
    return Tenant("acme", ["h"], "standard", requests_per_minute=BIG, tokens_per_minute=BIG,
                  max_concurrent=10**9, tokens_per_day=BIG)  # fmt: skip


async def drive(limiter: Limiter, tenant: Tenant, n: int, concurrency: int) -> None:
    left = [n]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            r = await limiter.admit(tenant, TOKENS)
            await asyncio.sleep(0)  # the request runs
            r.settle(USED)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await limiter.close()  # settlements on their way reach Redis


def calls(stats: dict[str, Any], only: str = "") -> int:
    """Commands run (those scripts ran included), or only those named ``only``, from
    INFO commandstats."""
    total = 0
    for name, value in stats.items():
        if name.startswith(f"cmdstat_{only}") and name != "cmdstat_info":
            total += (
                int(value["calls"])
                if isinstance(value, dict)
                else int(str(value).split("calls=")[1].split(",")[0])
            )
    return total


async def one(mode: str, args: argparse.Namespace, server: RedisProcess | None) -> dict[str, Any]:
    tenant = Tenant("free", ["h"]) if mode == "none" else limited()
    redis = None
    if mode == "redis":
        assert server is not None
        settings = RedisSettings(url=server.url, cluster=f"cost{time.monotonic_ns()}")
        redis = connect(settings)
        limiter = Limiter(redis, settings)
    else:
        limiter = Limiter()
    try:
        await drive(limiter, tenant, min(200, args.requests), args.concurrency)  # warm up
        if mode == "redis":
            limiter = Limiter(redis, settings)
        before = (await server.info("commandstats"), await server.info("stats"),
                  await server.info("cpu")) if server else None  # fmt: skip
        cpu, wall = time.process_time(), time.perf_counter()
        await drive(limiter, tenant, args.requests, args.concurrency)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        row: dict[str, Any] = {"mode": mode, "cpu_us": cpu / args.requests * 1e6,
                               "wall_us": wall / args.requests * 1e6}  # fmt: skip
        if server is not None and before is not None and mode == "redis":
            after = (await server.info("commandstats"), await server.info("stats"),
                     await server.info("cpu"))  # fmt: skip
            n = args.requests
            row["redis_calls"] = (calls(after[0]) - calls(before[0])) / n
            # the round trips: the limiter sends nothing but its script
            row["script_calls"] = (calls(after[0], "evalsha") - calls(before[0], "evalsha")) / n
            row["redis_cpu_us"] = sum(
                float(after[2][k]) - float(before[2][k]) for k in ("used_cpu_sys", "used_cpu_user")
            ) / n * 1e6  # fmt: skip
            row["redis_in_bytes"] = (int(after[1]["total_net_input_bytes"])
                                     - int(before[1]["total_net_input_bytes"])) / n  # fmt: skip
        return row
    finally:
        if redis is not None:
            await redis.aclose()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-limiter-") as tmp:
        async with redis_server(Path(tmp) / "redis.log") as server:
            for _ in range(args.rounds):  # interleaved: the machine's load hits each alike
                for mode in ("none", "local", "redis"):
                    rows.append(await one(mode, args, server))
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(row["mode"], []).append(row)

    def med(mode: str, key: str) -> float:
        values = sorted(r[key] for r in by[mode])
        return values[len(values) // 2]

    summary = {m: {k: med(m, k) for k in by[m][0] if k != "mode"} for m in by}
    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "code": code_version(),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "loop": loop_name()},
        "quick": args.quick,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "runs": rows,
        "median": summary,
        "added_cpu_us": summary["redis"]["cpu_us"] - summary["local"]["cpu_us"],
    }


def table(r: dict[str, Any]) -> str:
    m = r["median"]
    lines = [
        f"{r['requests']} requests, {r['concurrency']} at a time, median of {r['rounds']} "
        "interleaved rounds; per request:",
        f"{'mode':8} {'CPU us':>8} {'wall us':>8} {'round trips':>11} {'Redis cmds':>10} "
        f"{'Redis CPU us':>12} {'bytes to Redis':>14}",
    ]
    for mode, row in m.items():
        lines.append(
            f"{mode:8} {row['cpu_us']:>8.1f} {row['wall_us']:>8.1f} "
            f"{row.get('script_calls', 0):>11.3f} {row.get('redis_calls', 0):>10.2f} {row.get('redis_cpu_us', 0):>12.1f} "
            f"{row.get('redis_in_bytes', 0):>14.0f}"
        )
    lines.append(f"sharing through Redis adds {r['added_cpu_us']:.1f} us of CPU a request")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="2000 requests, 3 rounds")
    parser.add_argument("--requests", type=int, default=0, help="per run (default 20000)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests at a time")
    parser.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default 5)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result")
    args = parser.parse_args()
    args.requests = args.requests or (2000 if args.quick else 20000)
    args.rounds = args.rounds or (3 if args.quick else 5)
    return args


def run() -> int:
    args = parse_args()
    why = why_not()
    if why is not None:
        print(f"skipped: {why}")
        return 0
    result = run_loop(main(args))
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run())

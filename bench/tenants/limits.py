"""Limits accuracy: a tenant offering well over its tokens_per_minute through two gateway
replicas that share a redis-server of the bench's own, then with that Redis stopped.

Starts a redis-server on a free port (``--save '' --appendonly no``; stopping it touches
no other Redis), --units sim sidecars, and two gateways with the same tenants file and
``--redis-url``. Tenant ``lim`` has ``tokens_per_minute`` = --limit-tpm; the client sends
it non-streamed completions, Poisson arrivals at --limit-offer times its limit, each to
a replica drawn at random (so each gets about half), whatever the answers.

The limiter counts per minute (a sliding-window counter over fixed minute windows), so a
tenant's first minute may take its whole limit at once; from the next minute on, one
that keeps offering more is admitted at limit / 60 a second, evenly. The bench lets that
first minute pass (the load starts at once; measuring starts at the first minute
boundary at least 60 / offer + 3 s later, by when the first window is full), then:

    shared  tokens served (usage: prompt + completion) in --limit-measure s, against
            tokens_per_minute x measure / 60; goal within +-5 %
    stop    redis-server is stopped (SIGTERM) mid-minute; each replica then enforces
            limit / 2 from its own counts
    alone   the same measure over the next --limit-measure s; goal within +-10 %, and
            no answer but 200 and 429 rate_limited all along

The full run measures a whole minute in each (60 s: the window the limit is stated
over); --quick measures 15 s of each, which checks the same rate (limit / 60 a second)
over fewer requests (about 90 at the default settings, so +-1 request is about 1 %).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import MODEL, free_ports
from bench.redisproc import RedisProcess, redis_server, why_not
from proxy.procutil import python_m, running

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
TENANT = "lim"
PROMPT = "Count the tokens that this tenant is served against its limit per minute. " * 3
MAX_TOKENS = 24
SHARED_GOAL, ALONE_GOAL = 0.05, 0.10


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits")
    group.add_argument("--limits-only", action="store_true", help="run the limits scenario alone")
    group.add_argument("--skip-limits", action="store_true", help="leave the limits scenario out")
    group.add_argument("--limit-tpm", type=int, default=24_000,
                       help="the limited tenant's tokens_per_minute")  # fmt: skip
    group.add_argument("--limit-offer", type=float, default=4.0,
                       help="what it offers, in times its limit")  # fmt: skip
    group.add_argument("--limit-measure", type=float, default=0.0,
                       help="s measured with Redis, and again without (default 60; quick 15)")  # fmt: skip


@dataclass
class Answer:
    at: float  # time.time() it came back
    replica: int
    status: str  # "200", "429 rate_limited", or what else came
    tokens: int = 0  # usage: prompt + completion


@dataclass
class Load:
    answers: list[Answer] = field(default_factory=list)
    sent: int = 0

    def between(self, start: float, end: float) -> list[Answer]:
        return [a for a in self.answers if start <= a.at < end]


def tenants_file(path: Path, tpm: int) -> None:
    path.write_text(
        f'[[tenant]]\nname = "{TENANT}"\nkeys = ["sk-{TENANT}"]\ntokens_per_minute = {tpm}\n'
    )


@asynccontextmanager
async def fleet(
    args: argparse.Namespace, workdir: Path
) -> AsyncIterator[tuple[RedisProcess, list[str]]]:
    """A redis-server, --units sidecars and two gateways sharing that Redis."""
    path = workdir / "limits.toml"
    tenants_file(path, args.limit_tpm)
    ports = free_ports(2 * args.units + 4)
    async with AsyncExitStack() as stack:
        redis = await stack.enter_async_context(redis_server(workdir / "redis.log"))
        units = []
        for i in range(args.units):
            http, grpc = ports[2 * i], ports[2 * i + 1]
            argv = ["sidecar", "--host", HOST, "--http-port", str(http), "--grpc-port", str(grpc),
                    "--unit-id", f"u{i}", "--sim-max-num-seqs", str(args.slots),
                    "--sim-decode-step-ms", str(args.step_ms), "--sim-decode-ms-per-seq", "0",
                    "--sim-prefill-ms-per-token", "0.02", "--log-level", "warning"]  # fmt: skip
            unit = await stack.enter_async_context(
                running(f"u{i}", python_m(*argv), workdir / f"lu{i}.log", cwd=REPO)
            )
            unit.http_url = f"http://{HOST}:{http}"
            units.append(f"u{i}=http://{HOST}:{http},{HOST}:{grpc}")
            await unit.until_ready(START_TIMEOUT_S)
        urls = []
        for g in range(2):
            g_http, g_grpc = ports[2 * args.units + 2 * g], ports[2 * args.units + 2 * g + 1]
            argv = ["gateway", "--host", HOST, "--http-port", str(g_http),
                    "--grpc-port", str(g_grpc), "--tenants-file", str(path),
                    "--redis-url", redis.url, "--log-level", "warning"]  # fmt: skip
            for u in units:
                argv += ["--unit", u]
            gw = await stack.enter_async_context(
                running(f"gateway{g}", python_m(*argv), workdir / f"lgateway{g}.log", cwd=REPO)
            )
            gw.http_url = f"http://{HOST}:{g_http}"
            await gw.until_ready(START_TIMEOUT_S)
            urls.append(gw.http_url)
        yield redis, urls


async def send(http: aiohttp.ClientSession, url: str, replica: int, load: Load) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    headers = {"Authorization": f"Bearer sk-{TENANT}"}
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            data = await resp.json(content_type=None)
            status = str(resp.status)
            if resp.status == 200:
                usage = data["usage"]
                tokens = int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
                load.answers.append(Answer(time.time(), replica, status, tokens))
                return
            with contextlib.suppress(KeyError, TypeError):
                status += " " + str(data["error"]["code"])
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        status = type(exc).__name__
    load.answers.append(Answer(time.time(), replica, status))


async def offer(urls: list[str], rate: float, until: float, load: Load, seed: int = 7) -> None:
    """Poisson arrivals at ``rate`` a second until ``until`` (time.time()), each to a
    replica drawn at random (as a load balancer spreads them), not waiting for answers.
    (Arrivals in turn at even spacing alias with the limiter: every admitted one went
    to the same replica.)"""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        tasks: set[asyncio.Task[None]] = set()
        due = time.time()
        while (now := time.time()) < until:
            due += rng.expovariate(rate)
            if due > now:
                await asyncio.sleep(due - now)
            replica = rng.randrange(len(urls))
            task = asyncio.create_task(send(http, urls[replica], replica, load))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            load.sent += 1
        if tasks:
            await asyncio.wait(tasks, timeout=30)


def measure(load: Load, start: float, end: float, tpm: int) -> dict[str, Any]:
    answers = load.between(start, end)
    served = [a for a in answers if a.status == "200"]
    tokens = sum(a.tokens for a in served)
    per_minute = tokens * 60.0 / (end - start)
    per_replica = [sum(a.tokens for a in served if a.replica == r) * 60.0 / (end - start)
                   for r in (0, 1)]  # fmt: skip
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[a.status] = statuses.get(a.status, 0) + 1
    return {
        "from": start,
        "seconds": end - start,
        "served_requests": len(served),
        "tokens": tokens,
        "tokens_per_minute": per_minute,
        "per_replica_tokens_per_minute": per_replica,
        "error": per_minute / tpm - 1.0,
        "statuses": statuses,
    }


async def main(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    tpm, q = args.limit_tpm, args.limit_measure
    per_request = None
    async with fleet(args, workdir) as (redis, urls):
        # What one request costs (usage), to set the arrival rate; it counts against the
        # limit like any other, long before the measured minutes.
        load = Load()
        async with aiohttp.ClientSession() as http:
            await send(http, urls[0], 0, load)
        if load.answers[0].status != "200":
            raise RuntimeError(f"the first request failed: {load.answers[0].status}")
        per_request = load.answers[0].tokens
        rate = args.limit_offer * tpm / 60.0 / per_request
        started = time.time()
        fill = 60.0 / args.limit_offer + 3.0  # the first window fills by then
        boundary = math.ceil((started + fill) / 60.0) * 60.0
        shared = (boundary + 1.0, boundary + 1.0 + q)
        stop_at = shared[1] + (29.0 if q >= 60 else 1.0)  # mid-minute
        alone = (stop_at + 2.0, stop_at + 2.0 + q)
        load = Load()
        runner = asyncio.create_task(offer(urls, rate, alone[1] + 0.5, load))
        try:
            await asyncio.sleep(max(0.0, stop_at - time.time()))
            await redis.stop()
            stopped = time.time()
            await runner
        finally:
            runner.cancel()
    statuses: dict[str, int] = {}
    for a in load.answers:
        statuses[a.status] = statuses.get(a.status, 0) + 1
    others = {s: n for s, n in statuses.items() if s not in ("200", "429 rate_limited")}
    with_redis = measure(load, *shared, tpm)
    without = measure(load, *alone, tpm)
    return {
        "tokens_per_minute_limit": tpm,
        "offered_times_limit": args.limit_offer,
        "arrivals_per_s": rate,
        "tokens_per_request": per_request,
        "measured_s": q,
        "load_started": started,
        "redis_stopped": stopped,
        "with_redis": with_redis,
        "redis_stopped_each_replica_alone": without,
        "statuses": statuses,
        "other_errors": others,
        "served": [(round(a.at, 3), a.tokens) for a in load.answers if a.status == "200"],
        "goals": {
            "limits: tokens/min within 5 % of the limit (shared Redis)":
                abs(with_redis["error"]) <= SHARED_GOAL,
            "limits: within 10 % with Redis stopped (limit / 2 each)":
                abs(without["error"]) <= ALONE_GOAL,
            "limits: no error but 429": not others,
        },
    }  # fmt: skip


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The scenario, or why it was skipped (``skipped``)."""
    why = why_not()
    if why is not None:
        return {"skipped": why, "goals": {}}
    args.limit_measure = args.limit_measure or (15.0 if args.quick else 60.0)
    return await main(args, workdir)


def table(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"limits: skipped ({r['skipped']})"
    lim = r["tokens_per_minute_limit"]
    lines = [
        f"limits: tenant {TENANT}, tokens_per_minute {lim}, offered {r['offered_times_limit']:g}x "
        f"({r['arrivals_per_s']:.1f} requests/s of {r['tokens_per_request']} tokens) through 2 "
        f"gateway replicas; each phase measured over {r['measured_s']:g} s",
        f"{'phase':34} {'served tok/min':>14} {'vs limit':>9} {'replica 0':>10} {'replica 1':>10}"
        f" {'200':>5} {'429':>5} {'other':>5}",
    ]
    for name, key in (("shared Redis", "with_redis"),
                      ("Redis stopped (limit / 2 each)", "redis_stopped_each_replica_alone")):  # fmt: skip
        m = r[key]
        st = m["statuses"]
        other = sum(n for s, n in st.items() if s not in ("200", "429 rate_limited"))
        lines.append(
            f"{name:34} {m['tokens_per_minute']:>14.0f} {m['error'] * 100:>+8.1f}% "
            f"{m['per_replica_tokens_per_minute'][0]:>10.0f} "
            f"{m['per_replica_tokens_per_minute'][1]:>10.0f} {st.get('200', 0):>5} "
            f"{st.get('429 rate_limited', 0):>5} {other:>5}"
        )
    lines.append(f"answers over the whole run: {r['statuses']}")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    """Tokens served a second (5 s bins) across the run, the limit and Redis's stop."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    t0 = r["load_started"]
    times = r.get("served", [])
    if times:
        end = max(t for t, _ in times)
        bins = [0.0] * (int((end - t0) // 5) + 1)
        for t, n in times:
            bins[int((t - t0) // 5)] += n / 5.0
        ax.step([5 * i for i in range(len(bins))], bins, where="post", label="served")
    ax.axhline(r["tokens_per_minute_limit"] / 60.0, color="tab:red", ls="--", label="limit")
    ax.axvline(r["redis_stopped"] - t0, color="k", ls=":", label="Redis stopped")
    for key, color in (("with_redis", "tab:green"), ("redis_stopped_each_replica_alone", "tab:orange")):  # fmt: skip
        m = r[key]
        ax.axvspan(m["from"] - t0, m["from"] - t0 + m["seconds"], color=color, alpha=0.15)
    ax.set_xlabel("s since the load started")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"tenant {TENANT}: tokens served against tokens_per_minute")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Limits accuracy: a tenant offering well over its tokens_per_minute through two gateway
replicas that share a redis-server of the bench's own, then with that Redis stopped; and
the same through two replicas of LiteLLM's proxy with per-key TPM, as the reference.

Starts --units sim sidecars, a redis-server on a free port (``--save '' --appendonly
no``; stopping it touches no other Redis) and two gateways with the same tenants file
and ``--redis-url``; where LiteLLM is installed (``bash bench/overhead/setup_peers.sh
litellm``), also a second redis-server and two LiteLLM proxies in front of the same
units, sharing it. Tenant ``lim`` has ``tokens_per_minute`` = --limit-tpm; the client
sends it non-streamed completions, Poisson arrivals at --limit-offer times its limit,
each to a replica drawn at random (so each gets about half), whatever the answers.

LiteLLM without its database: its per-key limits belong to virtual keys, which need its
Postgres; here its ``general_settings.custom_auth`` (bench/tenants/litellm_auth.py)
returns the key with ``tpm_limit`` set, and its rate limiter hook enforces that as for
a virtual key, counting in ``general_settings.coordination_redis`` (the second Redis).

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

LiteLLM gets the same arrivals (the same seed, rate and schedule) after the gateways'
run, with its own Redis stopped the same way; its figures are the reference, not goals.

Before the loads, added latency at a light load (one request at a time, well below the
limit): TTFT of streamed and whole-request latency of non-streamed completions, direct
to a unit, through a gateway and through LiteLLM, interleaved in rounds.

The full run measures a whole minute in each (60 s: the window the limit is stated
over); --quick measures 15 s of each, which checks the same rate (limit / 60 a second)
over fewer requests (about 90 at the default settings, so +-1 request is about 1 %).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import secrets
import shutil
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import MODEL, answers, free_ports
from bench.redisproc import RedisProcess, redis_server, why_not
from proxy.procutil import python_m, running

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
TENANT = "lim"
KEY = f"sk-{TENANT}"
PROMPT = "Count the tokens that this tenant is served against its limit per minute. " * 3
MAX_TOKENS = 24
SHARED_GOAL, ALONE_GOAL = 0.05, 0.10
LITELLM = REPO / "bench" / ".venvs" / "litellm"
LITELLM_SETUP = "bash bench/overhead/setup_peers.sh litellm"
LITELLM_AUTH = Path(__file__).with_name("litellm_auth.py")
LITELLM_START_TIMEOUT_S = 180.0  # its imports alone take seconds on a busy host
OURS, THEIRS = "unitproxy", "LiteLLM"


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
    group.add_argument("--no-litellm", action="store_true",
                       help="leave LiteLLM's proxy (the reference) out, even where installed")  # fmt: skip
    group.add_argument("--latency-rounds", type=int, default=0,
                       help="light-load latency rounds, one request of each kind to each "
                            "target a round (default 50; quick 10)")  # fmt: skip


@dataclass
class Answer:
    at: float  # time.time() it came back
    replica: int
    status: str  # "200", "429 rate_limited" (LiteLLM: "429 throttling_error"), or what else came
    tokens: int = 0  # usage: prompt + completion
    sent: float = 0.0  # time.time() it was sent


@dataclass
class Load:
    answers: list[Answer] = field(default_factory=list)
    sent: int = 0

    def between(self, start: float, end: float) -> list[Answer]:
        return [a for a in self.answers if start <= a.at < end]


@dataclass
class Pair:
    """Two replicas of one system sharing one Redis of the bench's own."""

    name: str
    redis: RedisProcess
    urls: list[str]


@dataclass
class Fleet:
    units: list[str]  # the units' HTTP addresses
    ours: Pair
    litellm: Pair | None  # None: LiteLLM left out (``skipped`` says why)
    skipped: str | None = None


def tenants_file(path: Path, tpm: int) -> None:
    path.write_text(f'[[tenant]]\nname = "{TENANT}"\nkeys = ["{KEY}"]\ntokens_per_minute = {tpm}\n')


def litellm_why_not() -> str | None:
    """Why LiteLLM's proxy cannot be run here (None: it can)."""
    exe = LITELLM / "bin" / "litellm"
    if not exe.exists():
        return f"LiteLLM is not installed ({exe} missing): run {LITELLM_SETUP}"
    return None


def litellm_config(path: Path, units: list[str], redis: RedisProcess) -> None:
    """The proxy's config (JSON, which YAML reads): a deployment per unit under the sim's
    model name (OpenAI's text completions API), the custom auth and the shared Redis."""
    config = {
        "model_list": [
            {"model_name": MODEL,
             "litellm_params": {"model": f"text-completion-openai/{MODEL}",
                                "api_base": f"{url}/v1", "api_key": "unused"}}
            for url in units
        ],
        "general_settings": {
            # Required to start; no request uses it (custom_auth decides every key).
            "master_key": "sk-" + secrets.token_hex(32),
            "custom_auth": "litellm_auth.user_api_key_auth",
            "coordination_redis": {"host": HOST, "port": redis.port},
        },
    }  # fmt: skip
    path.write_text(json.dumps(config, indent=1) + "\n")
    shutil.copy(LITELLM_AUTH, path.parent / LITELLM_AUTH.name)


@asynccontextmanager
async def fleet(args: argparse.Namespace, workdir: Path) -> AsyncIterator[Fleet]:
    """--units sidecars; a redis-server and two gateways sharing it; where LiteLLM runs,
    a second redis-server and two LiteLLM proxies sharing that, before the same units."""
    path = workdir / "limits.toml"
    tenants_file(path, args.limit_tpm)
    ports = free_ports(2 * args.units + 6)
    skipped = "left out (--no-litellm)" if args.no_litellm else litellm_why_not()
    async with AsyncExitStack() as stack:
        redis = await stack.enter_async_context(redis_server(workdir / "redis.log"))
        units, unit_urls = [], []
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
            unit_urls.append(unit.http_url)
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
        theirs = None
        if skipped is None:
            their_redis = await stack.enter_async_context(
                redis_server(workdir / "redis-litellm.log")
            )
            lite_dir = workdir / "litellm"
            lite_dir.mkdir()
            config = lite_dir / "config.yaml"
            litellm_config(config, unit_urls, their_redis)
            env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of its price list
                   "LITELLM_LOG": "WARNING",  # as the gateways' --log-level warning
                   "BENCH_LITELLM_KEY": KEY, "BENCH_LITELLM_TPM": str(args.limit_tpm)}  # fmt: skip
            proxies = []
            for g in range(2):
                port = ports[2 * args.units + 4 + g]
                argv = [str(LITELLM / "bin" / "litellm"), "--config", str(config),
                        "--host", HOST, "--port", str(port)]  # fmt: skip
                proxy = await stack.enter_async_context(
                    running(
                        f"litellm{g}",
                        argv,
                        workdir / f"llitellm{g}.log",
                        env=env,
                        cwd=lite_dir,
                        group=True,
                    )
                )
                proxy.http_url = f"http://{HOST}:{port}"
                proxies.append(proxy)
            await asyncio.gather(*(
                p.until(answers(p.http_url, KEY), LITELLM_START_TIMEOUT_S, "answering")
                for p in proxies
            ))  # fmt: skip
            theirs = Pair(THEIRS, their_redis, [p.http_url for p in proxies])
        yield Fleet(unit_urls, Pair(OURS, redis, urls), theirs, skipped)


async def send(http: aiohttp.ClientSession, url: str, replica: int, load: Load) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    headers = {"Authorization": f"Bearer {KEY}"}
    sent = time.time()
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            data = await resp.json(content_type=None)
            status = str(resp.status)
            if resp.status == 200:
                usage = data["usage"]
                tokens = int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
                load.answers.append(Answer(time.time(), replica, status, tokens, sent))
                return
            with contextlib.suppress(KeyError, TypeError, AttributeError):
                error = data["error"]
                code = str(error["code"])  # LiteLLM's is the status again: its type says more
                status += " " + (str(error["type"]) if code == status else code)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        status = type(exc).__name__
    load.answers.append(Answer(time.time(), replica, status, 0, sent))


def rejected(status: str) -> bool:
    """A rate limiter's refusal: ours says rate_limited, LiteLLM's throttling_error."""
    return status in ("429 rate_limited", "429 throttling_error")


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
    # Sent in the phase and answered neither 200 nor 429 (an error, or no answer: a
    # request that hangs ends in a timeout, or when the load's connections close, after
    # the phase, so its status above is not among the phase's answers).
    failed = [a for a in load.answers
              if start <= a.sent < end and a.status != "200" and not rejected(a.status)]  # fmt: skip
    return {
        "from": start,
        "failed_of_sent": len(failed),
        "seconds": end - start,
        "served_requests": len(served),
        "tokens": tokens,
        "tokens_per_minute": per_minute,
        "per_replica_tokens_per_minute": per_replica,
        "error": per_minute / tpm - 1.0,
        "statuses": statuses,
    }


async def timed(
    http: aiohttp.ClientSession, url: str, stream: bool
) -> tuple[float | None, float, str]:
    """One completion: (s to the first streamed event, s to the end, status)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}
    headers = {"Authorization": f"Bearer {KEY}"}
    first = None
    t0 = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - t0
            return first, time.perf_counter() - t0, str(resp.status)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return None, time.perf_counter() - t0, type(exc).__name__


async def latency(targets: dict[str, list[str]], rounds: int) -> dict[str, Any]:
    """One request at a time: each round, to each target in a shuffled order, a streamed
    completion (its TTFT) then a non-streamed one (its whole time); a target's addresses
    in turn (replicas, or the units when direct). Far below any limit: at most one
    request in flight."""
    rng = random.Random(11)
    ttft: dict[str, list[float]] = {name: [] for name in targets}
    whole: dict[str, list[float]] = {name: [] for name in targets}
    failed: dict[str, int] = {name: 0 for name in targets}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for urls in targets.values():  # one of each first, not measured: warm connections
            await timed(http, urls[0], True)
        for i in range(rounds):
            order = list(targets)
            rng.shuffle(order)
            for name in order:
                url = targets[name][i % len(targets[name])]
                first, _, status = await timed(http, url, True)
                _, total, status2 = await timed(http, url, False)
                if status == "200" and first is not None:
                    ttft[name].append(first)
                else:
                    failed[name] += 1
                if status2 == "200":
                    whole[name].append(total)
                else:
                    failed[name] += 1

    def pct(xs: list[float], q: float) -> float | None:
        if not xs:
            return None
        xs = sorted(xs)
        return 1000.0 * xs[min(len(xs) - 1, int(q * len(xs)))]

    return {
        name: {
            "requests": len(ttft[name]) + len(whole[name]),
            "failed": failed[name],
            "ttft_ms_p50": 1000.0 * statistics.median(ttft[name]) if ttft[name] else None,
            "ttft_ms_p90": pct(ttft[name], 0.9),
            "whole_ms_p50": 1000.0 * statistics.median(whole[name]) if whole[name] else None,
            "whole_ms_p90": pct(whole[name], 0.9),
        }
        for name in targets
    }


async def limits_run(
    args: argparse.Namespace, pair: Pair, rate: float, per_request: int
) -> dict[str, Any]:
    """The load through ``pair``: shared Redis measured from the first full minute, then
    its Redis stopped mid-minute and measured again."""
    tpm, q = args.limit_tpm, args.limit_measure
    started = time.time()
    fill = 60.0 / args.limit_offer + 3.0  # the first window fills by then
    boundary = math.ceil((started + fill) / 60.0) * 60.0
    shared = (boundary + 1.0, boundary + 1.0 + q)
    stop_at = shared[1] + (29.0 if q >= 60 else 1.0)  # mid-minute
    alone = (stop_at + 2.0, stop_at + 2.0 + q)
    load = Load()
    runner = asyncio.create_task(offer(pair.urls, rate, alone[1] + 0.5, load))
    try:
        await asyncio.sleep(max(0.0, stop_at - time.time()))
        await pair.redis.stop()
        stopped = time.time()
        await runner
    finally:
        runner.cancel()
    statuses: dict[str, int] = {}
    for a in load.answers:
        statuses[a.status] = statuses.get(a.status, 0) + 1
    by_replica = []  # what each replica answered over the run, and how long after the stop
    for r in (0, 1):
        mine = [a for a in load.answers if a.replica == r]
        counts: dict[str, int] = {}
        for a in mine:
            counts[a.status] = counts.get(a.status, 0) + 1
        last_200 = max((a.at for a in mine if a.status == "200"), default=None)
        by_replica.append({
            "statuses": counts,
            "last_200_after_stop_s": None if last_200 is None else last_200 - stopped,
        })  # fmt: skip
    return {
        "system": pair.name,
        "by_replica": by_replica,
        "load_started": started,
        "redis_stopped": stopped,
        "with_redis": measure(load, *shared, tpm),
        "redis_stopped_each_replica_alone": measure(load, *alone, tpm),
        "statuses": statuses,
        "other_errors": {s: n for s, n in statuses.items() if s != "200" and not rejected(s)},
        "served": [(round(a.at, 3), a.tokens) for a in load.answers if a.status == "200"],
    }


async def main(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    tpm = args.limit_tpm
    async with fleet(args, workdir) as f:
        targets = {"unit": f.units, OURS: f.ours.urls}
        if f.litellm is not None:
            targets[THEIRS] = f.litellm.urls
        light = await latency(targets, args.latency_rounds)
        # What one request costs (usage), to set the arrival rate; it counts against the
        # limit like any other, long before the measured minutes.
        load = Load()
        async with aiohttp.ClientSession() as http:
            await send(http, f.ours.urls[0], 0, load)
            if f.litellm is not None:
                await send(http, f.litellm.urls[0], 0, load)
        if any(a.status != "200" for a in load.answers):
            raise RuntimeError(f"a first request failed: {[a.status for a in load.answers]}")
        per_request = load.answers[0].tokens
        their_request = load.answers[-1].tokens
        rate = args.limit_offer * tpm / 60.0 / per_request
        ours = await limits_run(args, f.ours, rate, per_request)
        theirs: dict[str, Any] = {"skipped": f.skipped}
        if f.litellm is not None:
            theirs = await limits_run(args, f.litellm, rate, per_request)
            theirs["tokens_per_request"] = their_request
    with_redis, without = ours["with_redis"], ours["redis_stopped_each_replica_alone"]
    return {
        **ours,
        "tokens_per_minute_limit": tpm,
        "offered_times_limit": args.limit_offer,
        "arrivals_per_s": rate,
        "tokens_per_request": per_request,
        "measured_s": args.limit_measure,
        "litellm": theirs,
        "latency": {"rounds": args.latency_rounds, "targets": light},
        "goals": {
            "limits: tokens/min within 5 % of the limit (shared Redis)":
                abs(with_redis["error"]) <= SHARED_GOAL,
            "limits: within 10 % with Redis stopped (limit / 2 each)":
                abs(without["error"]) <= ALONE_GOAL,
            "limits: no error but 429": not ours["other_errors"],
        },
    }  # fmt: skip


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The scenario, or why it was skipped (``skipped``)."""
    why = why_not()
    if why is not None:
        return {"skipped": why, "goals": {}}
    args.limit_measure = args.limit_measure or (15.0 if args.quick else 60.0)
    args.latency_rounds = args.latency_rounds or (10 if args.quick else 50)
    return await main(args, workdir)


def table(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"limits: skipped ({r['skipped']})"
    lim = r["tokens_per_minute_limit"]
    lines = [
        f"limits: tenant {TENANT}, tokens_per_minute {lim}, offered {r['offered_times_limit']:g}x "
        f"({r['arrivals_per_s']:.1f} requests/s of {r['tokens_per_request']} tokens) through 2 "
        f"replicas each; each phase measured over {r['measured_s']:g} s",
        f"{'system':10} {'phase':32} {'served tok/min':>14} {'vs limit':>9} {'replica 0':>10}"
        f" {'replica 1':>10} {'200':>5} {'429':>5} {'failed':>6}",
    ]
    runs = [(OURS, r, "Redis stopped (limit / 2 each)")]
    if "with_redis" in r["litellm"]:
        runs.append((THEIRS, r["litellm"], "Redis stopped"))
    for system, run_, stopped in runs:
        for name, key in (("shared Redis", "with_redis"),
                          (stopped, "redis_stopped_each_replica_alone")):  # fmt: skip
            m = run_[key]
            st = m["statuses"]
            no = sum(n for s, n in st.items() if rejected(s))
            other = m["failed_of_sent"]
            lines.append(
                f"{system:10} {name:32} {m['tokens_per_minute']:>14.0f} "
                f"{m['error'] * 100:>+8.1f}% {m['per_replica_tokens_per_minute'][0]:>10.0f} "
                f"{m['per_replica_tokens_per_minute'][1]:>10.0f} {st.get('200', 0):>5} "
                f"{no:>5} {other:>6}"
            )
        lines.append(f"{system}: answers over the whole run: {run_['statuses']}")
        for i, rep in enumerate(run_["by_replica"]):
            last = rep["last_200_after_stop_s"]
            when = "none" if last is None else f"{last:+.1f} s"
            lines.append(
                f"    replica {i}: {rep['statuses']}; its last 200 at {when} from the stop"
            )
    if "skipped" in r["litellm"]:
        lines.append(f"{THEIRS}: skipped ({r['litellm']['skipped']})")
    lat = r["latency"]
    lines.append(
        f"latency at a light load (one request at a time, {lat['rounds']} rounds; "
        f"{MAX_TOKENS} tokens out), ms:"
    )
    lines.append(f"{'target':10} {'TTFT p50':>9} {'p90':>7} {'whole p50':>10} {'p90':>7}"
                 f" {'+TTFT p50':>10} {'+whole p50':>11}")  # fmt: skip
    base = lat["targets"]["unit"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    for name, t in lat["targets"].items():
        add_ttft = add_whole = None
        if t["ttft_ms_p50"] is not None and base["ttft_ms_p50"] is not None:
            add_ttft = t["ttft_ms_p50"] - base["ttft_ms_p50"]
        if t["whole_ms_p50"] is not None and base["whole_ms_p50"] is not None:
            add_whole = t["whole_ms_p50"] - base["whole_ms_p50"]
        lines.append(
            f"{name:10} {ms(t['ttft_ms_p50']):>9} {ms(t['ttft_ms_p90']):>7} "
            f"{ms(t['whole_ms_p50']):>10} {ms(t['whole_ms_p90']):>7} {ms(add_ttft):>10} "
            f"{ms(add_whole):>11}" + (f"  ({t['failed']} failed)" if t["failed"] else "")
        )
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    """Tokens served a second (5 s bins) across each run, the limit and Redis's stop."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r] + ([r["litellm"]] if "with_redis" in r["litellm"] else [])
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 3.5 * len(runs)), squeeze=False)
    for ax, run_ in zip(axes[:, 0], runs, strict=True):
        t0 = run_["load_started"]
        times = run_.get("served", [])
        if times:
            end = max(t for t, _ in times)
            bins = [0.0] * (int((end - t0) // 5) + 1)
            for t, n in times:
                bins[int((t - t0) // 5)] += n / 5.0
            ax.step([5 * i for i in range(len(bins))], bins, where="post", label="served")
        ax.axhline(r["tokens_per_minute_limit"] / 60.0, color="tab:red", ls="--", label="limit")
        ax.axvline(run_["redis_stopped"] - t0, color="k", ls=":", label="Redis stopped")
        for key, color in (("with_redis", "tab:green"), ("redis_stopped_each_replica_alone", "tab:orange")):  # fmt: skip
            m = run_[key]
            ax.axvspan(m["from"] - t0, m["from"] - t0 + m["seconds"], color=color, alpha=0.15)
        ax.set_xlabel("s since the load started")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{run_.get('system', OURS)}: tenant {TENANT}'s tokens served against "
                     "its tokens per minute")  # fmt: skip
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

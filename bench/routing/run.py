"""Routing policies on a simulated heterogeneous fleet: goodput and TTFT under load.

Starts N ``python -m proxy sidecar --engine sim`` units on 127.0.0.1 (half of them
1.25-1.5x slower, every other one with half the batch slots; admission capacity 4x
slots, so queues form inside the engines and TTFT grows instead of 429s), then:

1. saturation: a closed loop through a ``lor`` gateway with twice as many requests in
   flight as the fleet has slots; output tokens/s over the mean output length is the
   fleet's saturation throughput in requests/s (printed beside what the simulator
   parameters predict);
2. for each load (% of that rate) and policy: a fresh ``python -m proxy gateway``,
   open-loop Poisson arrivals of streamed /v1/completions for ``--duration`` seconds
   (long-tailed prompt and output lengths, the same seeded sequence for every policy
   at one load), every request waited for (up to ``--drain`` s), the gateway stopped,
   and every unit's /load waited on until it shows 0 outstanding.

With ``--burst-period S`` each load alternates every S s between 40/110 of it and
it (``--loads 110 --burst-period 20``: 40 % and 110 % of capacity, every 20 s).

Policies: lor, p2c, round_robin, random, latency (the least predicted TTFT, its gateway
given ``--slo-ttft``; each run reports its median prediction error), latency-goodput
(the same with ``--latency-goodput true``: a request past the objective everywhere goes
to the unit predicted slowest), and lor-delayed (lor with every load report
applied ``--report-delay`` s late and no correction by the gateway's own counts: herding
on stale load) and lor-delayed-corrected (the same delay, correction on); lor-unbudgeted
(every unit reports at its own rate: no report budget, no report_min_interval_s) and
lor-as-at-1000 (each unit asked for one report every 4 s, as a gateway asks of 1,000
units); prefix-guess (policy prefix on its own index only, not on the blocks the units
report holding), and -2gw / -3gw after lor, prefix or prefix-guess: that many gateway
replicas over the fleet, clients spread over them. Beside them the
peer routers' load-aware policies over the same fleet, each run started fresh like the
gateway (``peers.py`` says what each does, how it measures load and why it was chosen):
vllm-router:power_of_two, vllm-router:cache_aware, sglang-router:power_of_two,
sglang-router:cache_aware, and sglang-router:cache_aware-jsq (tuned to join the shortest
queue). A peer that is not installed is reported and skipped. A second goal line puts
lor's goodput@1s against every peer policy's at the same load.

    .venv/bin/python -m bench.routing.run            # the full run, 11 policies: about 24 min
    .venv/bin/python -m bench.routing.run --quick    # smoke run: about 5 min
    .venv/bin/python bench/routing/run.py --policies lor,round_robin --loads 85 --duration 30
    .venv/bin/python -m bench.routing.run --quick --policies lor,vllm-router:power_of_two

Writes a table to stdout, JSON to bench/results/routing.json, a PNG beside it, and the
children's logs to bench/results/routing-logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

if __package__ in (None, ""):  # run as a file: make the bench.routing package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.common import (
    Interrupted,
    code_version,
    cpu_model,
    loop_name,
    no_plot,
    run_loop,
    until_signal,
)
from bench.routing import client, fleet, imbalance, peers, report, workload
from proxy.procutil import Child, ChildFailed

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "bench" / "results" / "routing.json"
QUICK_OUT = DEFAULT_OUT.with_suffix(".quick.json")  # a smoke run keeps the full results
OWN_POLICIES = ("lor", "prefix", "prefix-strict", "prefix-unfed", "p2c", "round_robin",
                "random", "lor-delayed", "lor-delayed-corrected", "lor-unbudgeted",
                "lor-as-at-1000", "lor-2gw", "lor-3gw", "prefix-2gw", "prefix-3gw", "prefix-guess",
                "prefix-guess-2gw", "prefix-guess-3gw", "prefix-slots", "prefix-slack", "latency",
                "latency-goodput")  # fmt: skip
# -Ngw: N gateway replicas, each with its own index and counts; clients spread over them
REPLICATED = re.compile(r"(.+)-([23])gw")
ALL_POLICIES = (*OWN_POLICIES, *peers.PEER_POLICIES)
# policy prefix with its bound set: prefix-b0.3 (--prefix-balance 0.3), prefix-b0.3-s0
# (and --prefix-slack 0), to trace hit rate against imbalance; -t1: and --prefix-ttft 1;
# -slots: and --prefix-free-slots true
PREFIX_BOUND = re.compile(
    r"prefix-b([0-9]*\.?[0-9]+)(?:-s([0-9]+))?(?:-t([0-9]*\.?[0-9]+))?(-slots)?"
)
# policy prefix with a bound of its own while the fleet is saturated: prefix-sat0.5
# (--prefix-saturated-balance 0.5)
PREFIX_SATURATED = re.compile(r"prefix-sat([0-9]*\.?[0-9]+)")


def own_policy(name: str) -> bool:
    return (
        name in OWN_POLICIES
        or PREFIX_BOUND.fullmatch(name) is not None
        or PREFIX_SATURATED.fullmatch(name) is not None
    )


# --quick's saturation window with --load-reference prefix: long enough for the units'
# prefix caches to fill (the closed loop starts on cold ones)
QUICK_PREFIX_WINDOW_S = 10.0
SATURATION_INFLIGHT_PER_SLOT = 2  # closed-loop requests per batch slot of the fleet
RUN_LIMIT_FACTOR = 2.0  # a run sends at most this many times the expected requests (+100)
GATEWAY_TRIES = 3  # starts of a run's gateway before the run is given up
GATEWAY_RETRY_PAUSE_S = 10.0
T = TypeVar("T")
# With shared prefixes: prefix goodput@1s >= 1.3x lor's at 85 % load; without: >= 0.97x.
PREFIX_GOAL = ("prefix", "lor", 85, 1.3)
PLAIN_GOAL = ("prefix", "lor", 85, 0.97)


@dataclass(frozen=True)
class BenchSettings:
    duration_s: float
    warmup_s: float
    drain_s: float
    loads: tuple[int, ...]
    policies: tuple[str, ...]
    units: int
    fleet: str
    seed: int
    report_delay_s: float
    saturation_warmup_s: float
    saturation_window_s: float
    quick: bool
    out: Path
    workload: str = "plain"
    load_reference: str = "lor"  # the loads are % of the saturation through this policy
    burst_period_s: float = 0.0  # > 0: each load alternates with 40/110 of it (workload)
    slo_ttft_s: float = 1.0  # policy latency's objective (--slo-ttft), as goodput@1s

    @property
    def png(self) -> Path:
        return self.out.with_suffix(".png")

    @property
    def log_dir(self) -> Path:
        return self.out.parent / f"{self.out.stem}-logs"

    @property
    def mix(self) -> workload.Workload | workload.PrefixWorkload:
        mix = workload.WORKLOADS[self.workload]
        return workload.quick(mix) if self.quick else mix

    def gateway_args(self, policy: str) -> list[str]:
        """The gateway's policy flags for one of OWN_POLICIES."""
        delay = ["--report-delay", f"{self.report_delay_s:g}"]
        if replicated := REPLICATED.fullmatch(policy):
            return self.gateway_args(replicated.group(1))
        if bound := PREFIX_BOUND.fullmatch(policy):
            balance, slack = bound.group(1), bound.group(2) or "1"
            ttft = ["--prefix-ttft", bound.group(3)] if bound.group(3) else []
            free = ["--prefix-free-slots", "true"] if bound.group(4) else []
            flags = ["--prefix-balance", balance, "--prefix-slack", slack, *ttft, *free]
            return ["--policy", "prefix", *flags]
        if saturated := PREFIX_SATURATED.fullmatch(policy):
            return ["--policy", "prefix", "--prefix-saturated-balance", saturated.group(1)]
        return {
            "lor-delayed": ["--policy", "lor", *delay, "--correct-load", "false"],
            "lor-delayed-corrected": ["--policy", "lor", *delay, "--correct-load", "true"],
            # bounded load with no slack: at most (1 + balance) x the mean, however few
            "prefix-strict": ["--policy", "prefix", "--prefix-slack", "0"],
            # the index not corrected by the units' prefix-cache counters
            "prefix-unfed": ["--policy", "prefix", "--prefix-engine-feedback", "false"],
            # prefix by this gateway's guess alone: not the blocks the units report holding
            "prefix-guess": ["--policy", "prefix", "--prefix-engine-blocks", "false"],
            # above the bound over the mean, prefix_slack alone decides (not the prefill
            # the holder saves weighed against its queue: the default before it)
            "prefix-slack": ["--policy", "prefix", "--prefix-weigh-prefill", "false"],
            # a holder with an engine slot free for the request takes it above the bound
            "prefix-slots": ["--policy", "prefix", "--prefix-free-slots", "true"],
            # Every unit at its own report rate (no budget, no floor), and every unit asked
            # for a report every 4 s, as the default budget asks of a fleet of 1,000.
            "lor-unbudgeted": [
                "--policy",
                "lor",
                "--report-budget",
                "0",
                "--report-min-interval",
                "0",
            ],
            "lor-as-at-1000": ["--policy", "lor", "--report-budget", f"{self.units / 4:g}"],
            "latency": ["--policy", "latency", "--slo-ttft", f"{self.slo_ttft_s:g}"],
            # past the objective everywhere: to the unit predicted slowest
            "latency-goodput": [
                "--policy",
                "latency",
                "--slo-ttft",
                f"{self.slo_ttft_s:g}",
                "--latency-goodput",
                "true",
            ],
        }.get(policy, ["--policy", policy])


# -- the two phases -------------------------------------------------------------------


@dataclass
class Saturation:
    """What the fleet completes when overloaded, in requests/s of the workload's mix.

    ``measured`` is output tokens/s streamed in the window over the mean output length:
    every busy slot makes one token per step whatever the mix, whereas counting
    completions in a window after a synchronized start favours short requests.
    """

    measured: float
    model: float  # what the simulator parameters predict
    completions_per_s: float  # completions in the window, for comparison
    tokens_per_s: float
    concurrency: int
    window_s: float
    errors: dict[str, int]
    per_unit: dict[str, int]
    outstanding_after: dict[str, int]
    policy: str = "lor"  # the gateway's policy in the closed loop


async def measure_saturation(
    s: BenchSettings,
    units: fleet.Fleet,
    session: aiohttp.ClientSession,
    means: tuple[float, float],
    policy: str = "lor",
) -> Saturation:
    concurrency = SATURATION_INFLIGHT_PER_SLOT * sum(u.slots for u in units.specs)
    log = s.log_dir / f"gateway-saturation-{policy}.log"
    async with fleet.running_gateway(units, ["--policy", policy], session, log) as gateway:
        run = await client.closed_loop(
            session,
            f"{gateway.http_url}/v1/completions",
            workload.request_stream(s.mix, s.seed),
            concurrency,
            s.saturation_warmup_s,
            s.saturation_window_s,
        )
    if run.tokens_per_s == 0:
        raise ChildFailed(
            f"the saturation run streamed no tokens (errors {dict(run.errors)}); see {log}"
        )
    return Saturation(
        measured=run.tokens_per_s / means[1],
        model=sum(spec.model_rate(*means) for spec in units.specs),
        completions_per_s=run.completions_per_s,
        tokens_per_s=run.tokens_per_s,
        concurrency=concurrency,
        window_s=run.window_s,
        errors=dict(run.errors),
        per_unit=dict(sorted(run.per_unit.items())),
        outstanding_after=await units.wait_idle(session),
        policy=policy,
    )


class RouterProcess(Protocol):
    """A run's router: the gateway (a procutil.Child) or a peer (peers.RunningPeer)."""

    @property
    def http_url(self) -> str: ...

    @property
    def exit_code(self) -> int | None: ...

    def cpu_s(self) -> float: ...

    def log_problems(self) -> list[str]: ...


def running_router(
    s: BenchSettings,
    policy: str,
    units: fleet.Fleet,
    session: aiohttp.ClientSession,
    log: Path,
) -> contextlib.AbstractAsyncContextManager[RouterProcess]:
    peer = peers.PEER_POLICIES.get(policy)
    if peer is not None:
        return peers.running_peer(peer, units, log)
    if replicated := REPLICATED.fullmatch(policy):
        n = int(replicated.group(2))
        return running_replicas(s.gateway_args(policy), units, session, log, n)
    return fleet.running_gateway(units, s.gateway_args(policy), session, log)


class Replicas:
    """Several gateways over one fleet, as one router: clients spread over them."""

    def __init__(self, gateways: Sequence[Child]) -> None:
        self.gateways = list(gateways)

    @property
    def http_url(self) -> str:
        return self.gateways[0].http_url

    @property
    def http_urls(self) -> list[str]:
        return [g.http_url for g in self.gateways]

    @property
    def exit_code(self) -> int | None:
        codes = [g.exit_code for g in self.gateways]
        return next((c for c in codes if c), codes[0])

    def cpu_s(self) -> float:
        return sum(g.cpu_s() for g in self.gateways)

    def log_problems(self) -> list[str]:
        return [p for g in self.gateways for p in g.log_problems()]


@contextlib.asynccontextmanager
async def running_replicas(
    args: list[str], units: fleet.Fleet, session: aiohttp.ClientSession, log: Path, n: int
) -> AsyncIterator[Replicas]:
    async with contextlib.AsyncExitStack() as stack:
        gateways = [
            await stack.enter_async_context(
                fleet.running_gateway(units, args, session, log.with_suffix(f".{k}.log"))
            )
            for k in range(n)
        ]
        yield Replicas(gateways)


def router_urls(router: RouterProcess) -> list[str]:
    return router.http_urls if isinstance(router, Replicas) else [router.http_url]


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds so far: the gateway, the sidecars, this process; the host's jiffies."""

    at: float
    gateway: float
    sidecars: float
    client: float
    host_busy: int
    host_total: int

    @classmethod
    def take(cls, gateway: RouterProcess, units: fleet.Fleet) -> CpuSample:
        busy, total = _host_jiffies()
        return cls(
            time.perf_counter(), gateway.cpu_s(), units.cpu_s(), time.process_time(), busy, total
        )

    def percent_since(self, before: CpuSample) -> dict[str, float]:
        """Each as % of one core over the interval."""
        wall = self.at - before.at
        gateway = self.gateway - before.gateway
        ours = gateway + self.sidecars - before.sidecars + self.client - before.client
        cores = os.cpu_count() or 1
        host = (self.host_busy - before.host_busy) / max(1, self.host_total - before.host_total)
        return {
            "gateway": 100 * gateway / wall,
            "ours": 100 * ours / wall,
            "host_busy": 100 * cores * host,
        }


def _host_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


async def policy_run(
    s: BenchSettings,
    policy: str,
    load_pct: int,
    rate: float,
    units: fleet.Fleet,
    session: aiohttp.ClientSession,
) -> report.RunMetrics:
    limit = int(RUN_LIMIT_FACTOR * rate * s.duration_s) + 100
    arrivals = workload.poisson_arrivals(
        s.mix, rate, s.duration_s, s.seed * 1000 + load_pct, limit, s.burst_period_s
    )
    name = policy.replace(":", "-") if policy in peers.PEER_POLICIES else f"gateway-{policy}"
    log = s.log_dir / f"{name}-{load_pct}.log"
    started = time.perf_counter()
    async with running_router(s, policy, units, session, log) as gateway:
        before = CpuSample.take(gateway, units)
        urls = [f"{url}/v1/completions" for url in router_urls(gateway)]
        # the caches' counters as the measured window opens, as its goodput and TTFT do
        cache_warm = asyncio.create_task(_later(s.warmup_s, lambda: units.prefix_cache(session)))
        try:
            run = await client.open_loop(session, urls, arrivals, s.drain_s)
            cache_before = await cache_warm
        finally:
            cache_warm.cancel()
        after = CpuSample.take(gateway, units)
        cache_after = await units.prefix_cache(session)
        error = await prediction_error(session, router_urls(gateway))
    metrics = report.run_metrics(policy, load_pct, rate, run, s.warmup_s, s.duration_s)
    queries, hits = (a - b for a, b in zip(cache_after, cache_before, strict=True))
    metrics.prefix_hit_rate = hits / queries if queries else None
    metrics.prediction_error_p50 = error
    if s.mix.shares_prefixes:  # after the run: nothing is being timed
        metrics.ideal_hit_rate = await asyncio.to_thread(
            workload.ideal_hit_rate, arrivals, from_s=s.warmup_s
        )
    spread = load_imbalance(s, units, run)
    metrics.peak_over_mean_p50, metrics.peak_over_mean_p99 = spread.p50, spread.p99
    metrics.ideal_over_mean_p99 = spread.ideal_p99
    metrics.arrivals_over_mean_p99 = spread.at_arrivals_p99
    metrics.load_changes, metrics.load_busy_s = spread.changes, spread.busy_s
    metrics.cpu = after.percent_since(before)
    metrics.timing_s = {
        "gateway_ready": round(before.at - started, 2),
        "requests": round(run.wall_s, 2),
        "gateway_stop": round(time.perf_counter() - after.at, 2),
    }
    metrics.gateway_exit = gateway.exit_code
    metrics.gateway_problems = gateway.log_problems()
    idle_from = time.perf_counter()
    metrics.outstanding_after = await units.wait_idle(session)
    metrics.timing_s["idle_wait"] = round(time.perf_counter() - idle_from, 2)
    return metrics


async def prediction_error(session: aiohttp.ClientSession, urls: list[str]) -> float | None:
    """The median of policy latency's |predicted - actual| / actual TTFT over the run,
    from the gateways' unitproxy_latency_prediction_error_ratio (interpolated within its
    bucket); None where no gateway predicted (another policy, a peer router)."""
    buckets: dict[float, float] = {}
    for url in urls:
        try:
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text() if resp.status == 200 else ""
        except aiohttp.ClientError:
            continue
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:  # a peer router's page that is not Prometheus' text format
            continue
        for family in families:
            if family.name != "unitproxy_latency_prediction_error_ratio":
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + sample.value
    return bucket_quantile(0.5, buckets)


def bucket_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative ``buckets`` (bound -> count)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if not total:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


async def _later(delay_s: float, what: Callable[[], Awaitable[T]]) -> T:
    await asyncio.sleep(delay_s)
    return await what()


BUSY_PER_UNIT = 4  # the fleet counts as busy with this many outstanding per unit


def load_imbalance(
    s: BenchSettings, units: fleet.Fleet, run: client.OpenLoopRun
) -> imbalance.Imbalance:
    """max/mean of the units' outstanding over capacity at every change of it, over the
    measured window (``imbalance``), from each request's unit and times."""
    spans = (
        imbalance.Span(o.unit, o.sent_s, math.inf if o.done_s is None else o.done_s)
        for o in run.outcomes
        if o.unit is not None and o.sent_s is not None
    )
    capacities = {spec.id: spec.capacity for spec in units.specs}
    return imbalance.measure(spans, capacities, s.warmup_s, s.duration_s, BUSY_PER_UNIT)


# -- the whole benchmark --------------------------------------------------------------


@dataclass
class Results:
    """Filled in as the benchmark goes, so an interrupted or failed one still reports."""

    specs: list[fleet.UnitSpec]
    means: tuple[float, float]
    saturation: Saturation | None = None  # through lor
    saturation_prefix: Saturation | None = None  # with shared prefixes, when prefix runs too
    rows: list[report.RunMetrics] = field(default_factory=list)
    failed_runs: list[dict[str, Any]] = field(default_factory=list)
    sidecar_exits: dict[str, int | None] = field(default_factory=dict)
    sidecar_problems: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # policy: why it was not run
    get_load: str | None = None  # what a unit answers to the peers' load poll
    load_reference: str = "lor"  # whose saturation the loads are % of

    @property
    def reference(self) -> Saturation | None:
        """The saturation that the loads are percentages of."""
        return self.saturation_prefix if self.load_reference == "prefix" else self.saturation

    http2_probes: int = 0  # log records on the units from sglang-router's HTTP/2 preface
    stopped_by: str | None = None  # why the benchmark ended early, if it did


async def bench(s: BenchSettings, results: Results) -> None:
    """A fresh fleet for the saturation run and for each run: no run starts with what
    an earlier one left in the units' prefix caches (the plain workload's prompts
    repeat across runs, which share no prefix within one)."""
    connector = aiohttp.TCPConnector(limit=8192, limit_per_host=8192)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with fleet_for(s, results, session) as units:
            progress(
                f"fleet of {len(units.specs)} units up ({s.mix.name} workload); measuring "
                f"saturation ({s.saturation_warmup_s:g} s + {s.saturation_window_s:g} s)"
            )
            if any(p in peers.PEER_POLICIES for p in s.policies):
                results.get_load = await peers.get_load_answer(session, units.sidecars[0].http_url)
                progress(results.get_load)
            results.saturation = sat = await measure_saturation(s, units, session, results.means)
            progress(
                f"saturation {sat.measured:.1f} r/s from tokens/s (model {sat.model:.1f} r/s, "
                f"completions in the window {sat.completions_per_s:.1f} r/s)"
            )
        if s.mix.shares_prefixes and ("prefix" in s.policies or s.load_reference == "prefix"):
            # What the fleet sustains through prefix: the loads' reference with
            # --load-reference prefix, else for the record (one offered rate per load).
            async with fleet_for(s, results, session) as cold:
                by_prefix = await measure_saturation(s, cold, session, results.means, "prefix")
            results.saturation_prefix = by_prefix
            progress(f"saturation through prefix {by_prefix.measured:.1f} r/s")
        results.load_reference = s.load_reference
        reference = results.reference
        assert reference is not None  # measured above
        for load_pct, policy in _runs(s, results):
            async with fleet_for(s, results, session) as cold:
                await one_run(s, policy, load_pct, reference.measured, cold, session, results)


def _runs(s: BenchSettings, results: Results) -> list[tuple[int, str]]:
    return [(load, p) for load in s.loads for p in s.policies if p not in results.skipped]


@contextlib.asynccontextmanager
async def fleet_for(
    s: BenchSettings, results: Results, session: aiohttp.ClientSession
) -> AsyncIterator[fleet.Fleet]:
    units: fleet.Fleet | None = None
    try:
        async with fleet.running_fleet(results.specs, session, s.log_dir) as units:
            yield units
    finally:
        if units is not None:  # the fleet started: say how each unit ended
            results.sidecar_exits |= {c.name: c.exit_code for c in units.sidecars}
            for child in units.sidecars:
                problems, probes = peers.unit_log_problems(child.log_path)
                results.sidecar_problems[child.name] = [
                    *results.sidecar_problems.get(child.name, []),
                    *problems,
                ]
                results.http2_probes += probes


async def one_run(
    s: BenchSettings,
    policy: str,
    load_pct: int,
    saturation: float,
    units: fleet.Fleet,
    session: aiohttp.ClientSession,
    results: Results,
) -> None:
    """One (policy, load) run; a gateway that fails to start is tried again a few times
    (the tree may be mid-edit), then the run is recorded as failed and the next goes on."""
    rate = saturation * load_pct / 100
    for attempt in range(1, GATEWAY_TRIES + 1):
        units.check_alive()
        try:
            results.rows.append(await policy_run(s, policy, load_pct, rate, units, session))
            progress(_progress_line(results.rows[-1]))
            return
        except fleet.GatewayFailed as exc:
            progress(f"{policy} @ {load_pct} %: attempt {attempt}: {exc}")
            if attempt < GATEWAY_TRIES:
                await asyncio.sleep(GATEWAY_RETRY_PAUSE_S)
            else:
                results.failed_runs.append(
                    {"policy": policy, "load_pct": load_pct, "error": str(exc)}
                )


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def _progress_line(m: report.RunMetrics) -> str:
    return (
        f"{m.policy} @ {m.load_pct} %: {m.sent} sent, good@1s {m.goodput['1s']:.1f} r/s, "
        f"TTFT p50 {m.ttft_p50_ms} p99 {m.ttft_p99_ms} ms, {m.error_count} errors, "
        f"{m.unfinished} unfinished, prediction error p50 {m.prediction_error_p50}; "
        f"timing {m.timing_s}"
    )


# -- settings -------------------------------------------------------------------------


def _names(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


def _loads(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in _names(text))
    if any(not 0 < v <= 200 for v in values):
        raise argparse.ArgumentTypeError("loads are percentages above 0 and at most 200")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Routing policies on a simulated heterogeneous fleet: goodput and TTFT."
    )
    add = parser.add_argument
    add("--duration", type=float, help="arrivals per run, in s. Default 20 (--quick: 5).")
    add(
        "--warmup",
        type=float,
        help="first seconds of each run left out of the metrics. Default 4 (--quick: 1).",
    )
    add(
        "--drain",
        type=float,
        default=60.0,
        help="after the last arrival, longest wait for requests still running, in s; what is "
        "left is cancelled and counted unfinished. Default 60.",
    )
    add(
        "--loads",
        type=_loads,
        metavar="PCT[,PCT...]",
        help="loads in %% of the saturation throughput measured through lor, or prefix with "
        "--load-reference prefix (one offered rate "
        "per load for every policy). Default 50,70,85,95 "
        "(--quick: 50,85).",
    )
    add(
        "--policies",
        type=_names,
        metavar="NAME[,NAME...]",
        help=f"of {', '.join(ALL_POLICIES)}, or prefix-bB[-sS][-tT][-slots] (policy "
        "prefix with --prefix-balance B and --prefix-slack S, default 1; -tT: and "
        "--prefix-ttft T; -slots: and --prefix-free-slots true), or prefix-satB (policy prefix "
        "with --prefix-saturated-balance B). Default all; a peer router's "
        "policies are skipped, and reported, when it is not installed.",
    )
    add("--units", type=int, default=8, help="simulated units in the fleet. Default 8.")
    add(
        "--workload",
        choices=tuple(workload.WORKLOADS),
        default="plain",
        help="plain: no shared prefixes; chat: multi-turn conversations; tenants: Zipf-popular "
        "tenants with 1-4k-token system prompts; tenants-hot: tenant 0 sends half; b2b: 60 "
        "tenants with 3-6k-token prefixes, the loads a ramp; agent: multi-turn agent "
        "sessions over one shared 2k-token preamble, long tool results, short actions. "
        "Default plain.",
    )
    add(
        "--fleet",
        choices=fleet.FLEETS,
        default="mixed",
        help="mixed: odd units have half the slots; tiered: the slow half has half the "
        f"slots; deep: mixed with {fleet.DEEP}x the slots, each sequence as much slower (the "
        "same throughput, that many more requests outstanding). Default mixed.",
    )
    add("--seed", type=int, default=1, help="seed of the workload and the units. Default 1.")
    add(
        "--burst-period",
        type=float,
        default=0.0,
        help="bursty load: each load alternates every this many s between 40/110 of it "
        "(first) and it, so --loads 110 gives 40 %% and 110 %% of capacity. Default 0: steady.",
    )
    add(
        "--slo-ttft",
        type=float,
        default=1.0,
        help="policy latency's TTFT objective (--slo-ttft of its gateway), in s. Default 1.",
    )
    add(
        "--load-reference",
        choices=("lor", "prefix"),
        default="lor",
        help="the loads are %% of the saturation measured through this policy (prefix: what "
        "the fleet sustains with its caches used; shared-prefix workloads only). Default lor.",
    )
    add(
        "--report-delay",
        type=float,
        default=2.0,
        help="report delay of the lor-delayed policies, in s. Default 2.",
    )
    add(
        "--saturation-window",
        type=float,
        help="measured window of the saturation run, in s (after 5 s warm-up; --quick: 2). "
        f"Default 20 (--quick: 4, or {QUICK_PREFIX_WINDOW_S:g} with --load-reference prefix).",
    )
    add(
        "--out",
        type=Path,
        help=f"JSON results; the PNG goes beside it. Default "
        f"{DEFAULT_OUT.relative_to(REPO)} (--quick: {QUICK_OUT.name}).",
    )
    add(
        "--quick",
        action="store_true",
        help="smoke run: 5 s runs, loads 50 and 85, outputs capped at 96 tokens.",
    )
    return parser


def parse_settings(argv: Sequence[str] | None) -> BenchSettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    policies = tuple(dict.fromkeys(args.policies or ALL_POLICIES))
    unknown = [p for p in policies if p not in ALL_POLICIES and not own_policy(p)]
    if unknown:
        parser.error(f"unknown policy {', '.join(unknown)}; choose from {', '.join(ALL_POLICIES)}")
    duration = args.duration if args.duration is not None else (5.0 if quick else 20.0)
    warmup = args.warmup if args.warmup is not None else (1.0 if quick else 4.0)
    if not 0 <= warmup < duration or args.drain <= 0 or args.units < 1:
        parser.error("need 0 <= --warmup < --duration, --drain above 0 and --units at least 1")
    window = args.saturation_window or (4.0 if quick else 20.0)
    if quick and not args.saturation_window and args.load_reference == "prefix":
        # through prefix the units' caches are cold for the first seconds of the closed
        # loop: 4 s of it measured 8-13 r/s of b2b's 21-23 r/s, and a ramp of such a
        # reference ended below the fleet's knee
        window = QUICK_PREFIX_WINDOW_S
    if args.load_reference == "prefix" and not workload.WORKLOADS[args.workload].shares_prefixes:
        parser.error("--load-reference prefix needs a workload with shared prefixes")
    return BenchSettings(
        duration_s=duration,
        warmup_s=warmup,
        drain_s=args.drain,
        loads=tuple(dict.fromkeys(args.loads or ((50, 85) if quick else (50, 70, 85, 95)))),
        policies=policies,
        units=args.units,
        fleet=args.fleet,
        seed=args.seed,
        report_delay_s=args.report_delay,
        saturation_warmup_s=2.0 if quick else 5.0,
        saturation_window_s=window,
        quick=quick,
        out=args.out or default_out(args.workload, quick),
        workload=args.workload,
        load_reference=args.load_reference,
        burst_period_s=max(0.0, args.burst_period),
        slo_ttft_s=args.slo_ttft,
    )


def default_out(name: str, quick: bool) -> Path:
    out = DEFAULT_OUT if name == "plain" else DEFAULT_OUT.with_stem(f"routing-{name}")
    return out.with_suffix(".quick.json") if quick else out


# -- the report -----------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "client_loop": loop_name(),
        "aiohttp": aiohttp.__version__,
        "loadavg_1min_before": os.getloadavg()[0],
        "code": code_version(),  # the gateway measured: commit and uncommitted files
    }


def build_report(
    s: BenchSettings, r: Results, machine: dict[str, Any], wall_s: float
) -> dict[str, Any]:
    mean_prompt, mean_output = r.means
    return {
        "benchmark": "routing",
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "wall_s": round(wall_s, 1),
        "settings": {**asdict(s), "out": str(s.out)},
        "machine": machine,
        "workload": {
            **asdict(s.mix),
            "mean_prompt_tokens": mean_prompt,
            "mean_output_tokens": mean_output,
        },
        "fleet": [{**spec.to_json(), "model_rate": spec.model_rate(*r.means)} for spec in r.specs],
        "gateway_args": {p: s.gateway_args(p) for p in s.policies if own_policy(p)},
        "peers": {
            p: peers.PEER_POLICIES[p].to_json() for p in s.policies if p in peers.PEER_POLICIES
        },
        "skipped_policies": r.skipped,
        "get_load": r.get_load,
        "sidecar_http2_probes": r.http2_probes,
        "complete": r.stopped_by is None and not r.failed_runs,
        "stopped_by": r.stopped_by,
        "saturation": asdict(r.saturation) if r.saturation else None,
        "saturation_prefix": asdict(r.saturation_prefix) if r.saturation_prefix else None,
        "runs": [m.to_json() for m in r.rows],
        "failed_runs": r.failed_runs,
        "goal": report.goal(
            r.rows, PREFIX_GOAL if s.mix.shares_prefixes else report.GOAL, s.load_reference
        ),
        "goal_peers": report.peer_goal(
            r.rows,
            list(peers.PEER_POLICIES),
            ("prefix", 85) if "prefix" in s.policies else report.PEER_GOAL,
        ),
        "goal_plain": report.goal(r.rows, PLAIN_GOAL) if not s.mix.shares_prefixes else None,
        "ramp": report.ramp(r.rows) if r.rows else None,
        "goal_ramp": (
            report.ramp_goal(report.ramp(r.rows), list(peers.PEER_POLICIES))
            if r.rows and s.workload == "b2b"
            else None
        ),
        # the same goal with 2 and 3 gateway replicas, where both sides of it were run
        "goal_ramp_replicas": (
            report.replica_ramp_goals(report.ramp(r.rows)) if r.rows and s.workload == "b2b" else []
        ),
        "sidecar_exits": r.sidecar_exits,
        "sidecar_problems": {k: v[:50] for k, v in r.sidecar_problems.items() if v},
        "png": str(s.png),
        "logs": str(s.log_dir),
    }


def command_line() -> str:
    """The command as typed: ``python -m bench.routing.run ...`` or ``python .../run.py ...``."""
    if __spec__ is not None and __spec__.name == "bench.routing.run" and __name__ == "__main__":
        return shlex.join([sys.executable, "-m", __spec__.name, *sys.argv[1:]])
    return shlex.join([sys.executable, *sys.argv])


def fleet_table(specs: Sequence[fleet.UnitSpec], means: tuple[float, float]) -> str:
    lines = ["unit  slots  capacity  slowdown  step ms  ms/seq  prefill ms/tok  model r/s"]
    for u in specs:
        lines.append(
            f"{u.id:<4}  {u.slots:>5}  {u.capacity:>8}  {u.slowdown:>8.3g}  "
            f"{u.decode_step_ms:>7.4g}  {u.decode_ms_per_seq:>6.4g}  "
            f"{u.prefill_ms_per_token:>14.4g}  {u.model_rate(*means):>9.2f}"
        )
    return "\n".join(lines)


def print_report(data: dict[str, Any], r: Results) -> None:
    m, sat = data["machine"], r.saturation
    print(f"command: {data['command']}")
    print(
        f"machine: nproc {m['nproc']}, {m['cpu_model']}, {m['python']}, client loop "
        f"{m['client_loop']}, load average (1 min) before: {m['loadavg_1min_before']:.2f}"
    )
    code = m["code"]
    dirty = f", uncommitted: {' '.join(code['uncommitted'])}" if code["uncommitted"] else ""
    print(f"product code: commit {code['commit']}{dirty}")
    w = data["workload"]
    shape = f"prompt lognormal {w['prompt']}" if "prompt" in w else _prefix_shape(w)
    print(
        f"workload {w['name']}: {shape}, output {w['output']} (exact, ignore_eos); "
        f"means {w['mean_prompt_tokens']:.0f} / {w['mean_output_tokens']:.0f} tokens"
    )
    print(f"\n{fleet_table(r.specs, r.means)}\n")
    if sat is not None:
        print(
            f"saturation: {sat.measured:.2f} r/s measured = {sat.tokens_per_s:.0f} output tok/s "
            f"/ {r.means[1]:.1f} mean output tokens (closed loop, {sat.concurrency} in flight "
            f"through {sat.policy}, {sat.window_s:g} s window; completions in it "
            f"{sat.completions_per_s:.2f} r/s); model {sat.model:.2f} r/s; "
            f"errors {sat.errors or 0}"
        )
    if r.saturation_prefix is not None and sat is not None:
        by_prefix = r.saturation_prefix.measured
        print(
            f"saturation through prefix: {by_prefix:.2f} r/s, {by_prefix / sat.measured:.2f}x "
            f"lor's ({r.saturation_prefix.window_s:g} s window)"
        )
    if (ref := r.reference) is not None:
        print(
            f"load: every policy is offered the same rate, load % x {ref.measured:.2f} r/s "
            f"(the saturation through {ref.policy})"
        )
    s = data["settings"]
    print(
        f"runs: {s['duration_s']:g} s of Poisson arrivals each, metrics over "
        f"[{s['warmup_s']:g}, {s['duration_s']:g}] s; CPU % of one core (nproc {m['nproc']})\n"
    )
    print(report.table(r.rows))
    shares = _capacity_shares(r)
    for load_pct in sorted({row.load_pct for row in r.rows})[-2:]:
        print(f"\nshare of requests per unit at {load_pct} % load:")
        print(report.routing_table(r.rows, load_pct, shares))
    print(f"\n{data['goal']['line']}")
    if data["goal_plain"] is not None:
        print(data["goal_plain"]["line"])
    print("\n".join(data["goal_peers"]["lines"]))
    if data["ramp"]:
        print("\nover the ramp (output tok/s by load; the knee: the most at any load):")
        print(report.ramp_table(data["ramp"]))
    if data["goal_ramp"] is not None:
        print("\n".join(data["goal_ramp"]["lines"]))
    for goal in data["goal_ramp_replicas"]:
        print("\n".join(goal["lines"][:1]))
    _print_peers(data)
    _print_problems(r)
    print(f"\nwall time {data['wall_s'] / 60:.1f} min; JSON {s['out']}; PNG {data['png']}")


def _prefix_shape(w: dict[str, Any]) -> str:
    if w["name"] == "agent":
        return (
            f"{w['conversations']} agent sessions of up to {w['turns']} turns over one "
            f"{w['preamble']}-token preamble, tasks {w['system'][0]}-{w['system'][1]} tokens, "
            f"tool results {w['message']}"
        )
    if w["name"] == "chat":
        return (
            f"{w['conversations']} conversations of up to {w['turns']} turns, system prompt "
            f"{w['system'][0]}-{w['system'][1]} tokens, user turns {w['message']}"
        )
    hot = f", tenant 0 sends {w['hot_share']:.0%}" if w["hot_share"] else ""
    return (
        f"{w['tenants']} tenants (Zipf {w['zipf']:g}{hot}), system prompts "
        f"{w['system'][0]}-{w['system'][1]} tokens, user messages {w['message']}"
    )


def _print_peers(data: dict[str, Any]) -> None:
    run = {p: info for p, info in data["peers"].items() if p not in data["skipped_policies"]}
    if run:
        print(f"\npeer policies (load signal); {data['get_load']}:")
    for name, info in run.items():
        print(f"  {name} {info['version']}: {info['load_signal']}")


def _capacity_shares(r: Results) -> dict[str, float]:
    rates = {spec.id: spec.model_rate(*r.means) for spec in r.specs}
    total = sum(rates.values())
    return {unit: rate / total for unit, rate in rates.items()}


def _print_problems(r: Results) -> None:
    lines = [f"  {policy}: SKIPPED: {why}" for policy, why in r.skipped.items()]
    if r.stopped_by:
        lines.append(f"  the benchmark stopped early: {r.stopped_by}")
    lines += [
        f"  {f['policy']} @ {f['load_pct']} %: run FAILED: {f['error']}" for f in r.failed_runs
    ]
    sat = r.saturation
    if sat is not None and sat.errors:
        lines.append(f"  saturation run: errors {sat.errors}")
    if sat is not None and any(sat.outstanding_after.values()):
        lines.append(f"  saturation run: units not idle after it: {sat.outstanding_after}")
    for m in r.rows:
        where = f"  {m.policy} @ {m.load_pct} %"
        router = "router" if m.policy in peers.PEER_POLICIES else "gateway"
        lines += [f"{where}: {n} x {kind}" for kind, n in m.errors.items()]
        if m.unfinished:
            lines.append(f"{where}: {m.unfinished} requests unfinished after the drain bound")
        if any(m.outstanding_after.values()):
            lines.append(f"{where}: units not idle after the run: {m.outstanding_after}")
        if m.gateway_exit != 0:
            lines.append(f"{where}: {router} exited with {m.gateway_exit} after SIGTERM")
        lines += [f"{where}: {router} log: {line}" for line in m.gateway_problems[:5]]
        if m.send_lag_p99_ms is not None and m.send_lag_p99_ms > 50:
            lines.append(f"{where}: arrivals sent late, p99 {m.send_lag_p99_ms:.0f} ms")
    for unit, code in r.sidecar_exits.items():
        if code != 0:
            lines.append(f"  sidecar {unit} exited with {code} after SIGTERM")
    for unit, problems in r.sidecar_problems.items():
        lines += [f"  sidecar {unit} log: {line}" for line in problems[:3]]
    if r.http2_probes:
        print(
            f"\n(left out below: {r.http2_probes} log records on the units from "
            "sglang-router's HTTP/2 preface, its gRPC-worker probe at start)"
        )
    print("\nproblems:" if lines else "\nno problems: no errors, every unit idle after each run")
    print("\n".join(lines[:80]))


# -- main -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_settings(argv)
    s.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    machine = machine_info()
    results = Results(fleet.fleet_specs(s.units, s.seed, s.fleet), s.mix.means())
    results.skipped = skipped_policies(s.policies)
    for policy, why in results.skipped.items():
        progress(f"{policy}: skipped: {why}")
    try:
        run_loop(until_signal(bench(s, results)))
    except Interrupted as exc:
        results.stopped_by = f"interrupted by {exc}"
    except ChildFailed as exc:
        results.stopped_by = f"failed: {exc}"
    if results.stopped_by:
        print(
            f"routing benchmark {results.stopped_by}; every process it started was stopped; "
            "reporting what was measured",
            file=sys.stderr,
        )
    data = build_report(s, results, machine, time.perf_counter() - started)
    s.out.write_text(json.dumps(data, indent=2) + "\n")
    if results.rows and (why := no_plot()) is not None:
        print(why)
    elif results.rows:
        report.plot(results.rows, s.png, plot_title(results, s, machine))
    print_report(data, results)
    if results.stopped_by:
        return 130 if results.stopped_by.startswith("interrupted") else 1
    return 1 if results.failed_runs else 0


def skipped_policies(policies: Sequence[str]) -> dict[str, str]:
    """The peer policies whose router is not installed here, and why."""
    found = {}
    for policy in policies:
        peer = peers.PEER_POLICIES.get(policy)
        why = peer.router.unavailable() if peer is not None else None
        if why is not None:
            found[policy] = why
    return found


def plot_title(results: Results, s: BenchSettings, machine: dict[str, Any]) -> str:
    measured = results.saturation.measured if results.saturation else math.nan
    return (
        f"{len(results.specs)} simulated units, saturation {measured:.1f} r/s; "
        f"{s.duration_s:g} s runs; {machine['cpu_model']} x{machine['nproc']}"
    )


if __name__ == "__main__":
    sys.exit(main())

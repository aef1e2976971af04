"""Peer routers over the same fleet: vllm-router and sglang-router, load-aware policies.

A peer policy is named ``ROUTER:POLICY``. Each run starts the router fresh with every
unit's HTTP URL as a worker, waits until its worker list shows every unit healthy and a
completion comes back through it, and stops it after (SIGTERM to its process group).
Its CPU is that of its whole process tree. The routers come from
``bash bench/overhead/setup_peers.sh``; one that is not installed is reported and its
policies are skipped.

What the policies do (read in the routers' source, then checked: a worker that logs
what it is asked, the routers' debug logs, and their GET /workers "load" against the
units' outstanding counts with 12 requests in flight; vllm-router 0.1.17, sglang-router
0.3.2). Both poll each worker's ``GET /get_load`` every 30 s for power_of_two; the
sidecar has no such endpoint (404), so no polled load reaches either router:

    vllm-router:power_of_two
                  two distinct healthy workers at random, the one with the lower load:
                  the router's own count of requests in flight to it (plus the polled
                  value, absent here). As the only router in front of the fleet, its
                  counts are each unit's outstanding requests, fresher than a 30 s poll;
                  nothing of the signal is lost. Measured: counts match the units'.
    sglang-router:power_of_two
                  the same choice, but on the polled value only, falling back to the
                  router's request counts when a worker has none, and 0.3.2's regular
                  HTTP router never counts requests for it (measured: /workers load 0
                  and "X=0 vs Y=0" in its debug log with 12 in flight). Here it is a
                  random pick of two: it needs /get_load, which the sidecar lacks; with
                  it, its load would be up to 30 s old.
    cache_aware   both routers' default: when the in-flight counts are imbalanced
                  (max - min > 64 AND max > 1.5 min, the shipped thresholds) the worker
                  with the fewest in flight; otherwise the worker whose approximate
                  prefix tree best matches the prompt, or, below a 0.3 match, the one
                  with the smallest tree (fewest prompt characters routed to it).
                  The prompts here share no prefixes, so balanced means "least prompt
                  text so far", and the shortest-queue branch only acts on imbalance
                  above 64 requests.
    sglang-router:cache_aware-jsq
                  cache_aware tuned to be as load-aware as it gets:
                  ``--balance-abs-threshold 0 --balance-rel-threshold 1.0`` take the
                  shortest-queue branch whenever the counts differ, so every request
                  goes to the worker with the fewest in flight (join the shortest
                  queue on exact counts), the prefix tree only breaking full ties.
                  One router is enough: vllm-router's cache_aware is the same code.

What they ask of a unit besides /v1/completions: both GET /health; sglang-router also
GETs /server_info, /get_server_info, /model_info, /get_model_info (404 on the sidecar:
it warns and goes on), refuses token-id prompts and a body without "model", and opens
each worker's HTTP port with an HTTP/2 preface (its gRPC-worker probe), which the
sidecar logs (an ERROR with a traceback, or one WARNING line in newer trees). Those expected lines are left out of the
problems reported (``EXPECTED``, ``unit_log_problems``); the run checks the sidecar's
GET /get_load itself and says what it answered.

Left out: round_robin and random (not load-aware; unitproxy's own are run), vllm-router's
kv_aware (needs the engines' ZMQ KV events), consistent_hash (affinity, no load) and
sticky_least_loaded (least *sessions*: without a session id every count stays 0 and the
choice is a hash of the request), sglang-router's manual (sticky keys).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import answers, free_ports, tree_cpu_s
from bench.overhead.targets import SETUP, VENVS, _peer_version
from bench.routing import fleet
from proxy.procutil import PROBLEM_MARKS, Child, ChildFailed, Probe, running

READY_TIMEOUT_S = 60.0  # every worker healthy in the router, and a completion through it
# Warnings the routers log on every start or stop against the sidecar; not problems.
EXPECTED = (
    "Concurrency queue processor shutting down",  # vllm-router, on SIGTERM
    "returned 404, falling back to",  # sglang-router: /server_info, /model_info
    "No tokenizer_path or model_path found",  # sglang-router: no tokenizer wanted
)
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
HTTP2_PREFACE = "Pause on PRI/Upgrade"  # the sidecar's error on sglang-router's probe
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d ", re.MULTILINE)


@dataclass(frozen=True)
class Router:
    name: str
    dist: str  # the installed distribution, for its version
    level: str  # its --log-level for warnings and above

    @property
    def venv(self) -> Path:
        return VENVS / self.name

    def command(self) -> list[str]:
        if self.name == "vllm-router":
            return [str(self.venv / "bin" / "vllm-router")]
        return [str(self.venv / "bin" / "python"), "-m", "sglang_router.launch_router"]

    def version(self) -> str:
        return _peer_version(self.name, self.dist)

    def unavailable(self) -> str | None:
        """Why this router cannot run here, or None."""
        if not Path(self.command()[0]).exists() or not self.version():
            return f"{self.name} is not installed (in {self.venv}): run {SETUP}"
        return None


ROUTERS = {
    "vllm-router": Router("vllm-router", "vllm_router", "warning"),
    "sglang-router": Router("sglang-router", "sglang_router", "warn"),
}


@dataclass(frozen=True)
class PeerPolicy:
    router: Router
    policy: str
    load_signal: str  # one line for the report: what it compares
    variant: str = ""  # the name's suffix when ``flags`` tune the policy
    flags: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        suffix = f"-{self.variant}" if self.variant else ""
        return f"{self.router.name}:{self.policy}{suffix}"

    def argv(self, worker_urls: Sequence[str], port: int, metrics_port: int) -> list[str]:
        argv = [
            *self.router.command(),
            "--host", fleet.HOST, "--port", str(port),
            "--worker-urls", *worker_urls,
            "--policy", self.policy,
            "--prometheus-host", fleet.HOST, "--prometheus-port", str(metrics_port),
            "--log-level", self.router.level,
            *self.flags,
        ]  # fmt: skip
        if self.router.name == "sglang-router":
            argv += ["--shutdown-grace-period-secs", "1"]  # its default waits 180 s
        return argv

    def to_json(self) -> dict[str, Any]:
        return {
            "router": self.router.name,
            "policy": self.policy,
            "flags": list(self.flags),
            "version": self.router.version(),
            "load_signal": self.load_signal,
            "unavailable": self.router.unavailable(),
        }


OWN_COUNTS = "its own in-flight requests per unit (/get_load: 404 on the sidecar)"
NO_SIGNAL = (
    "NONE here: it needs /get_load (404 on the sidecar) and counts no in-flight requests "
    "itself, so it picks at random"
)
SHORTEST_QUEUE = (
    "its own in-flight requests, only when max - min > 64 and max > 1.5 min; "
    "otherwise the prompt's prefix tree"
)
JSQ = "its own in-flight requests: the fewest, whenever the counts differ"
# The shortest-queue branch whenever max > min: (max - min) > 0 and max > 1.0 * min.
BALANCE_ALWAYS = ("--balance-abs-threshold", "0", "--balance-rel-threshold", "1.0")
PEER_POLICIES = {
    p.name: p
    for p in (
        PeerPolicy(ROUTERS["vllm-router"], "power_of_two", OWN_COUNTS),
        PeerPolicy(ROUTERS["vllm-router"], "cache_aware", SHORTEST_QUEUE),
        PeerPolicy(ROUTERS["sglang-router"], "power_of_two", NO_SIGNAL),
        PeerPolicy(ROUTERS["sglang-router"], "cache_aware", SHORTEST_QUEUE),
        PeerPolicy(ROUTERS["sglang-router"], "cache_aware", JSQ, "jsq", BALANCE_ALWAYS),
    )
}


def installed() -> list[str]:
    return [name for name, p in PEER_POLICIES.items() if p.router.unavailable() is None]


# -- one router per run ---------------------------------------------------------------


@dataclass
class RunningPeer:
    """What a run needs of its router: the URL, CPU, and how it ended."""

    policy: PeerPolicy
    child: Child
    http_url: str

    def cpu_s(self) -> float:
        return tree_cpu_s(self.child.pid)  # the whole process tree

    @property
    def exit_code(self) -> int | None:
        return self.child.exit_code

    def log_problems(self) -> list[str]:
        problems = self.child.log_problems()
        return [line for line in problems if not any(e in line for e in EXPECTED)]


def unit_log_problems(path: Path) -> tuple[list[str], int]:
    """A unit's problem lines, less the log records of sglang-router's HTTP/2 preface;
    and how many such records there were."""
    text = path.read_text(errors="replace")
    starts = [m.start() for m in RECORD_START.finditer(text)]
    records = [text[a:b] for a, b in zip([0, *starts], [*starts, len(text)], strict=True)]
    probes = sum(HTTP2_PREFACE in r for r in records)
    lines = [
        line
        for record in records
        if HTTP2_PREFACE not in record
        for line in record.splitlines()
        if any(mark in line for mark in PROBLEM_MARKS)
    ]
    return lines, probes


async def get_load_answer(session: aiohttp.ClientSession, unit_url: str) -> str:
    """What a unit answers to GET /get_load, the peers' load poll: a line for the report."""
    try:
        async with session.get(f"{unit_url}/get_load", timeout=PROBE_TIMEOUT) as resp:
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"GET /get_load on a unit failed ({type(exc).__name__})"
    if status == 404:
        return (
            "the sidecar has no GET /get_load (404), the peers' polled load for "
            "power_of_two (see bench/routing/peers.py)"
        )
    return f"GET /get_load on a unit answered {status}: the peers may use it"


def _all_healthy(url: str, units: int) -> Probe:
    """Ready when the router's GET /workers lists every unit as healthy."""

    async def probe(session: aiohttp.ClientSession) -> bool:
        async with session.get(f"{url}/workers") as resp:
            workers = (await resp.json(content_type=None))["workers"]
        return len(workers) == units and all(w["is_healthy"] for w in workers)

    return probe


@asynccontextmanager
async def running_peer(
    policy: PeerPolicy, units: fleet.Fleet, log_path: Path
) -> AsyncIterator[RunningPeer]:
    """A fresh peer router over the fleet, once it sees every unit healthy and answers."""
    if (why := policy.router.unavailable()) is not None:
        raise fleet.GatewayFailed(why)
    port, metrics_port = free_ports(2)
    worker_urls = [child.http_url for child in units.sidecars]
    argv = policy.argv(worker_urls, port, metrics_port)
    url = f"http://{fleet.HOST}:{port}"
    # The shared launcher, signals to the process group: a router may fork workers.
    async with running(policy.name, argv, log_path, group=True) as child:
        try:
            await child.until(_all_healthy(url, len(worker_urls)), READY_TIMEOUT_S)
            await child.until(answers(url), READY_TIMEOUT_S, "answering")
        except ChildFailed as exc:
            units.check_alive()  # a dead unit is the fleet's failure, not the router's
            raise fleet.GatewayFailed(str(exc)) from exc
        yield RunningPeer(policy, child, url)

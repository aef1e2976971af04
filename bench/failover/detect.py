"""How fast a unit notices a failed follower: time from the fault to NOT_SERVING.

Each repetition starts a fresh ``python -m proxy follower`` and a fresh
``python -m proxy sidecar --engine sim --follower f1=TARGET`` on 127.0.0.1 (ports 0,
read back from their logs), holds two gRPC streams to the sidecar from this process,
waits until both say SERVING, lets a random share of one probe interval pass (so the
fault lands at a random phase of the probe cycle), then signals the follower agent.
Measured from just before ``os.kill`` (monotonic clock, this process):

    WatchLoad     the first unitproxy.v1.LoadReporting/WatchLoad report with state
                  NOT_SERVING
    health Watch  the first grpc.health.v1 Watch message for "unitproxy.v1.Inference"
                  with status NOT_SERVING
    in sidecar    the failed node's since_ms in that report minus the wall-clock time
                  of the fault: when the sidecar decided, without the delivery

Scenarios (health flags always passed explicitly; defaults from proxy.settings):

    kill-watch       SIGKILL, probe grpc-watch: the held Watch stream breaks at once
    kill-poll        SIGKILL, probe grpc: Check fails fast, the threshold decides
    stop-watch       SIGSTOP, probe grpc-watch: only the Check timeout can see a hang
    stop-watch-fast  SIGSTOP, probe grpc-watch, --health-interval 0.2 --health-timeout 0.2

    .venv/bin/python bench/failover/detect.py             # about 2 minutes
    .venv/bin/python bench/failover/detect.py --quick     # 2 repetitions each
    .venv/bin/python bench/failover/detect.py --scenarios kill-watch --repeat 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the bench package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import Interrupted, cpu_model, loop_name, run_loop, until_signal
from proxy import procutil
from proxy.checks import CheckPolicy
from proxy.load import LoadReport
from proxy.pb.unitproxy.v1 import load_pb2, load_pb2_grpc
from proxy.procutil import Child, ChildFailed, python_m
from proxy.settings import HealthSettings

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "bench" / "results" / "failover_detect.json"
HOST = "127.0.0.1"
FOLLOWER = "f1"
INFERENCE_SERVICE = "unitproxy.v1.Inference"
REPETITION_TIMEOUT_S = 30.0  # start, settle, fault and detection; past this: a failure
START_TIMEOUT_S = 15.0  # a child must log its addresses within this
STOP_TIMEOUT_S = 5.0  # SIGCONT + SIGTERM, then SIGKILL after this
SETTLE_MIN_S = 0.3  # after SERVING, before the fault: the Watch stream is surely held
KILL_GOAL_S = 0.100
FOLLOWER_LINE = re.compile(rb"follower \S+: gRPC health (\S+), HTTP (\S+),")
SIDECAR_LINE = re.compile(rb"sidecar \S+: HTTP (\S+), gRPC (\S+),")
ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+:\d+")  # in failure reasons, to group them


# -- scenarios ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Policy:
    interval_s: float
    timeout_s: float
    unhealthy_threshold: int
    jitter: float  # share of the interval, either way (not a flag: proxy.checks)

    @classmethod
    def defaults(cls, **changes: float) -> Policy:
        fields = HealthSettings.model_fields
        values: dict[str, Any] = {
            "interval_s": fields["interval_s"].default,
            "timeout_s": fields["timeout_s"].default,
            "unhealthy_threshold": fields["unhealthy_threshold"].default,
            "jitter": CheckPolicy().jitter,
        }
        return cls(**(values | changes))

    def flags(self) -> list[str]:
        return [
            "--health-interval", f"{self.interval_s:g}",
            "--health-timeout", f"{self.timeout_s:g}",
            "--unhealthy-threshold", str(self.unhealthy_threshold),
        ]  # fmt: skip

    def polling_goal_s(self) -> float:
        return self.interval_s * self.unhealthy_threshold + self.timeout_s

    def jitter_s(self) -> float:
        return self.interval_s * self.jitter * self.unhealthy_threshold

    def text(self) -> str:
        return (
            f"interval {self.interval_s:g} s, timeout {self.timeout_s:g} s, "
            f"threshold {self.unhealthy_threshold}"
        )


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    fault: signal.Signals
    probe: str
    policy: Policy
    goal_s: float
    goal_text: str
    # What the Checker's fixed-rate loop (interval +- jitter) allows: (lo, hi) s.
    model_s: tuple[float, float]

    def describe(self) -> str:
        return f"{self.fault.name}, probe {self.probe}, {self.policy.text()}"


def kill_model(p: Policy) -> tuple[float, float]:
    # Each Check fails at once (connection refused); the first lands within one interval.
    n, lo, hi = p.unhealthy_threshold, p.interval_s * (1 - p.jitter), p.interval_s * (1 + p.jitter)
    return (n - 1) * lo, n * hi


def stop_model(p: Policy) -> tuple[float, float]:
    # Probes start at a fixed rate (timeout <= interval), each waits out its timeout:
    # the n-th failure is known a timeout after the n-th probe started.
    n, lo, hi = p.unhealthy_threshold, p.interval_s * (1 - p.jitter), p.interval_s * (1 + p.jitter)
    return (n - 1) * lo + p.timeout_s, n * hi + p.timeout_s


def stop_scenario(name: str, policy: Policy) -> Scenario:
    goal = policy.polling_goal_s() + policy.jitter_s()
    text = (
        f"interval x threshold + timeout + jitter = {policy.interval_s:g} x "
        f"{policy.unhealthy_threshold} + {policy.timeout_s:g} + {policy.jitter_s():g} s"
    )
    return Scenario(name, signal.SIGSTOP, "grpc-watch", policy, goal, text, stop_model(policy))


def all_scenarios() -> dict[str, Scenario]:
    p = Policy.defaults()
    kill_goal = f"<= {KILL_GOAL_S * 1000:g} ms (the Watch stream breaks)"
    poll_goal = (
        f"interval x threshold + timeout = {p.interval_s:g} x {p.unhealthy_threshold} "
        f"+ {p.timeout_s:g} s"
    )
    found = [
        Scenario("kill-watch", signal.SIGKILL, "grpc-watch", p, KILL_GOAL_S, kill_goal, (0, 0)),
        Scenario(
            "kill-poll", signal.SIGKILL, "grpc", p, p.polling_goal_s(), poll_goal, kill_model(p)
        ),
        stop_scenario("stop-watch", p),
        stop_scenario("stop-watch-fast", Policy.defaults(interval_s=0.2, timeout_s=0.2)),
    ]
    return {s.name: s for s in found}


# -- child processes ------------------------------------------------------------------
# One follower and one sidecar a repetition, on ports 0, with no gateway: ``unitproxy
# up`` would add a gateway and take CPU from the timings; the shared launcher starts them.

PROBLEM_MARKS = (" ERROR ", "Traceback")


@asynccontextmanager
async def running(name: str, args: Sequence[str], log: Path) -> AsyncIterator[Child]:
    """``python -m proxy ARGS``, output to ``log``; stopped on the way out, whatever happened."""
    argv = python_m(*args)
    async with procutil.running(name, argv, log, cwd=REPO, stop_timeout_s=STOP_TIMEOUT_S) as child:
        yield child


def follower_args() -> list[str]:
    return ["follower", "--host", HOST, "--http-port", "0", "--grpc-port", "0",
            "--node-name", FOLLOWER]  # fmt: skip


def sidecar_args(scenario: Scenario, unit_id: str, follower_target: str) -> list[str]:
    return [
        "sidecar", "--engine", "sim", "--host", HOST, "--http-port", "0", "--grpc-port", "0",
        "--unit-id", unit_id, "--follower", f"{FOLLOWER}={follower_target}",
        "--probe", scenario.probe, *scenario.policy.flags(),
    ]  # fmt: skip


# -- observing the sidecar ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Seen:
    at: float  # time.monotonic() when this process received the message
    state: str  # unit state or health status name; "STREAM ..." when the stream broke
    reason: str = ""  # why the follower is unhealthy, as the report says
    since_ms: int = 0  # wall clock ms of the follower's last transition, as the report says


class StateLog:
    """Every message of one stream, with a way to wait for the first that matches."""

    def __init__(self) -> None:
        self.entries: list[Seen] = []
        self._changed = asyncio.Event()

    def add(self, seen: Seen) -> None:
        self.entries.append(seen)
        self._changed.set()

    async def first(self, match: Callable[[Seen], bool]) -> Seen:
        checked = 0
        while True:
            for seen in self.entries[checked:]:
                if seen.state.startswith("STREAM"):
                    raise ChildFailed(f"observer: {seen.state}")
                if match(seen):
                    return seen
            checked = len(self.entries)
            self._changed.clear()
            await self._changed.wait()


def from_report(at: float, report: LoadReport) -> Seen:
    node = next((n for n in report.nodes if n.name == FOLLOWER), None)
    if node is None or node.healthy:
        return Seen(at, str(report.state))
    return Seen(at, str(report.state), node.reason, node.since_ms)


async def follow_load(channel: grpc.aio.Channel, log: StateLog) -> None:
    stub = load_pb2_grpc.LoadReportingStub(channel)
    try:
        async for msg in stub.WatchLoad(load_pb2.WatchLoadRequest()):
            log.add(from_report(time.monotonic(), LoadReport.from_pb(msg)))
        log.add(Seen(time.monotonic(), "STREAM WatchLoad ended"))
    except grpc.aio.AioRpcError as exc:
        log.add(Seen(time.monotonic(), f"STREAM WatchLoad broke: {exc.code().name}"))


async def follow_health(channel: grpc.aio.Channel, log: StateLog) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name
    try:
        async for msg in stub.Watch(health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE)):
            log.add(Seen(time.monotonic(), name(msg.status)))
        log.add(Seen(time.monotonic(), "STREAM health Watch ended"))
    except grpc.aio.AioRpcError as exc:
        log.add(Seen(time.monotonic(), f"STREAM health Watch broke: {exc.code().name}"))


async def cancel_all(tasks: Sequence[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def is_state(state: str, after: float = 0.0) -> Callable[[Seen], bool]:
    return lambda seen: seen.state == state and seen.at >= after


# -- one repetition -------------------------------------------------------------------


@dataclass(slots=True)
class Repetition:
    index: int
    ok: bool = False
    error: str = ""
    load_ms: float | None = None
    health_ms: float | None = None
    sidecar_ms: float | None = None
    reason: str = ""
    settle_s: float = 0.0
    follower_exit: int | None = None
    sidecar_exit: int | None = None
    log_problems: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Fault:
    at: float  # time.monotonic(), just before os.kill
    wall_ms: float  # time.time() in ms, at the same moment


def inject(child: Child, sig: signal.Signals) -> Fault:
    fault = Fault(time.monotonic(), time.time() * 1000)
    child.signal(sig)
    return fault


async def observe(channel: grpc.aio.Channel, stack: AsyncExitStack) -> tuple[StateLog, StateLog]:
    load, health = StateLog(), StateLog()
    tasks = [
        asyncio.create_task(follow_load(channel, load), name="WatchLoad"),
        asyncio.create_task(follow_health(channel, health), name="health Watch"),
    ]
    stack.push_async_callback(cancel_all, tasks)
    await load.first(is_state("SERVING"))
    await health.first(is_state("SERVING"))
    return load, health


async def measure(
    scenario: Scenario,
    rep: Repetition,
    workdir: Path,
    rng: random.Random,
    stack: AsyncExitStack,
    children: dict[str, Child],
) -> None:
    tag = f"{scenario.name}-{rep.index}"
    follower = children["follower"] = await stack.enter_async_context(
        running("follower", follower_args(), workdir / f"{tag}.follower.log")
    )
    target = (await follower.wait_for_line(FOLLOWER_LINE, START_TIMEOUT_S))[1].decode()
    args = sidecar_args(scenario, f"bench-{tag}", target)
    sidecar = children["sidecar"] = await stack.enter_async_context(
        running("sidecar", args, workdir / f"{tag}.sidecar.log")
    )
    grpc_target = (await sidecar.wait_for_line(SIDECAR_LINE, START_TIMEOUT_S))[2].decode()
    # Entered after the sidecar, so closed before it stops: no stream holds its grace.
    channel = await stack.enter_async_context(grpc.aio.insecure_channel(grpc_target))
    load, health = await observe(channel, stack)
    rep.settle_s = round(SETTLE_MIN_S + rng.uniform(0, scenario.policy.interval_s), 3)
    await asyncio.sleep(rep.settle_s)
    fault = inject(follower, scenario.fault)
    down = await load.first(is_state("NOT_SERVING", fault.at))
    rep.load_ms = round((down.at - fault.at) * 1000, 2)
    rep.sidecar_ms, rep.reason = round(down.since_ms - fault.wall_ms, 1), down.reason
    health_down = await health.first(is_state("NOT_SERVING", fault.at))
    rep.health_ms = round((health_down.at - fault.at) * 1000, 2)
    rep.ok = True


def record_exits(rep: Repetition, children: dict[str, Child]) -> None:
    if "follower" in children:
        rep.follower_exit = children["follower"].exit_code
    if "sidecar" in children:
        rep.sidecar_exit = children["sidecar"].exit_code
        rep.log_problems = children["sidecar"].log_problems(PROBLEM_MARKS)


async def repetition(
    scenario: Scenario, index: int, workdir: Path, rng: random.Random
) -> Repetition:
    rep, children = Repetition(index), dict[str, Child]()
    async with AsyncExitStack() as stack:
        try:
            async with asyncio.timeout(REPETITION_TIMEOUT_S):
                await measure(scenario, rep, workdir, rng, stack, children)
        except TimeoutError:
            rep.error = f"gave up after {REPETITION_TIMEOUT_S:g} s"
        except ChildFailed as exc:
            rep.error = str(exc)
    record_exits(rep, children)  # every child is stopped by now
    if rep.ok and rep.sidecar_exit != 0:
        rep.error = f"sidecar exited with {rep.sidecar_exit} after SIGTERM (want 0)"
    return rep


# -- results --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stats:
    min: float
    p50: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Stats | None:
        known = [v for v in values if v is not None]
        if not known:
            return None
        return cls(min(known), statistics.median(known), max(known))

    def text(self) -> str:
        return f"{self.min:.1f} / {self.p50:.1f} / {self.max:.1f}"


@dataclass(slots=True)
class ScenarioResult:
    scenario: Scenario
    repetitions: list[Repetition]

    def ok(self) -> list[Repetition]:
        return [r for r in self.repetitions if r.ok]

    def stats(self, attr: str) -> Stats | None:
        return Stats.of([getattr(r, attr) for r in self.ok()])

    def goal_met(self) -> bool:
        load = self.stats("load_ms")
        all_ok = len(self.ok()) == len(self.repetitions)
        return all_ok and load is not None and load.max <= self.scenario.goal_s * 1000

    def to_json(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "name": s.name,
            "fault": s.fault.name,
            "probe": s.probe,
            "policy": asdict(s.policy),
            "goal_ms": s.goal_s * 1000,
            "goal": s.goal_text,
            "model_ms": [v * 1000 for v in s.model_s],
            "goal_met": self.goal_met(),
            "ok": len(self.ok()),
            "repetitions_total": len(self.repetitions),
            "watch_load_ms": _stats_json(self.stats("load_ms")),
            "health_watch_ms": _stats_json(self.stats("health_ms")),
            "in_sidecar_ms": _stats_json(self.stats("sidecar_ms")),
            "repetitions": [asdict(r) for r in self.repetitions],
        }


def _stats_json(stats: Stats | None) -> dict[str, float] | None:
    return None if stats is None else asdict(stats)


def _cell(stats: Stats | None) -> str:
    return "-" if stats is None else stats.text()


def _model_cell(model_s: tuple[float, float]) -> str:
    lo, hi = model_s
    return "~0 (event)" if hi == 0 else f"{lo * 1000:.0f}-{hi * 1000:.0f}"


def table(results: Sequence[ScenarioResult]) -> str:
    head = ("scenario", "ok", "WatchLoad ms min/p50/max", "health Watch ms min/p50/max",
            "in sidecar ms p50", "goal ms", "model ms", "goal met")  # fmt: skip
    rows = [head]
    for r in results:
        s, inside = r.scenario, r.stats("sidecar_ms")
        rows.append((
            s.name, f"{len(r.ok())}/{len(r.repetitions)}", _cell(r.stats("load_ms")),
            _cell(r.stats("health_ms")), "-" if inside is None else f"{inside.p50:.0f}",
            f"{s.goal_s * 1000:.0f}", _model_cell(s.model_s),
            "yes" if r.goal_met() else "NO",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def notes(results: Sequence[ScenarioResult]) -> list[str]:
    lines = []
    for r in results:
        s = r.scenario
        lines.append(f"  {s.name}: {s.describe()}; goal {s.goal_text}")
        reasons = sorted({ADDRESS.sub("HOST:PORT", rep.reason) for rep in r.ok()})
        lines += [f"      detected by: {reason}" for reason in reasons]
        for rep in r.repetitions:
            if rep.error:
                lines.append(f"      !!! repetition {rep.index}: {rep.error}")
            if rep.log_problems:
                lines.append(f"      !!! repetition {rep.index}: sidecar log has "
                             f"{len(rep.log_problems)} error lines: {rep.log_problems[0]}")  # fmt: skip
    return lines


# -- machine and report ---------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "loop": loop_name(),
        "grpcio": grpc.__version__,
    }


@dataclass(frozen=True, slots=True)
class BenchSettings:
    repeat: int
    scenarios: tuple[str, ...]
    out: Path
    keep_logs: bool
    seed: int | None


def build_report(
    settings: BenchSettings, results: Sequence[ScenarioResult], logs: str, seconds: float
) -> dict[str, Any]:
    return {
        "benchmark": "failover_detect",
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "settings": {**asdict(settings), "out": str(settings.out)},
        "machine": machine_info(),
        "duration_s": round(seconds, 1),
        "logs": logs,
        "out": str(settings.out),
        "scenarios": [r.to_json() for r in results],
    }


def print_report(report: dict[str, Any], results: Sequence[ScenarioResult]) -> None:
    m = report["machine"]
    print(f"command: {report['command']}")
    print(f"machine: nproc {m['nproc']}, {m['cpu_model']}, {m['python']}, loop {m['loop']}, "
          f"grpcio {m['grpcio']}")  # fmt: skip
    print(f"{report['settings']['repeat']} repetitions per scenario, fresh follower and "
          f"sidecar each; {report['duration_s']:g} s in all\n")  # fmt: skip
    print(table(results))
    print("time from just before os.kill to the first NOT_SERVING seen; goal met = every "
          "repetition ok and max WatchLoad <= goal; model = what the checker's loop allows")  # fmt: skip
    print("\n".join(notes(results)))
    print(f"\nlogs: {report['logs']}\nJSON: {report['out']}")


# -- main -----------------------------------------------------------------------------


async def run_all(settings: BenchSettings, workdir: Path) -> list[ScenarioResult]:
    catalog, rng = all_scenarios(), random.Random(settings.seed)
    results = []
    for name in settings.scenarios:
        reps = []
        for index in range(settings.repeat):
            rep = await repetition(catalog[name], index, workdir, rng)
            shown = f"{rep.load_ms:.1f} ms" if rep.ok and rep.load_ms is not None else rep.error
            print(f"  {name} #{index}: {shown}", file=sys.stderr, flush=True)
            reps.append(rep)
        results.append(ScenarioResult(catalog[name], reps))
    return results


def _scenario_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in all_scenarios()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenarios {unknown}; know {list(all_scenarios())}"
        )
    return names


def parse_settings(argv: Sequence[str] | None) -> BenchSettings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=5, help="repetitions per scenario (5)")
    parser.add_argument("--quick", action="store_true", help="2 repetitions per scenario")
    parser.add_argument("--scenarios", type=_scenario_names, default=tuple(all_scenarios()),
                        help=f"comma-separated, of {','.join(all_scenarios())} (all)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON ({DEFAULT_OUT})")
    parser.add_argument("--keep-logs", action="store_true", help="keep child logs even if all ok")
    parser.add_argument("--seed", type=int, default=None, help="seed of the fault phase")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    repeat = 2 if args.quick else args.repeat
    return BenchSettings(repeat, args.scenarios, args.out, args.keep_logs, args.seed)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    workdir = Path(tempfile.mkdtemp(prefix="failover-detect-"))
    started = time.monotonic()
    try:
        results = run_loop(until_signal(run_all(settings, workdir)))
    except (KeyboardInterrupt, Interrupted):
        print(f"interrupted; every child was stopped; logs in {workdir}", file=sys.stderr)
        return 130
    failed = any(len(r.ok()) != len(r.repetitions) for r in results)
    logs = str(workdir)
    if not failed and not settings.keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)
        logs += " (removed: every repetition ok; --keep-logs keeps them)"
    report = build_report(settings, results, logs, time.monotonic() - started)
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    settings.out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report, results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

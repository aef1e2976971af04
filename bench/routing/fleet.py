"""The processes: a heterogeneous fleet of simulated units and one gateway per run.

Every child is ``python -m proxy ...`` on 127.0.0.1 with ports 0, read back from its
log line; it runs in its own session (Ctrl-C reaches only the benchmark, which stops
it) and gets SIGTERM if the benchmark dies (``die_with_parent``). Stopping is SIGTERM,
then SIGKILL after a bound, also when the stop itself is interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from proxy.procutil import die_with_parent

HOST = "127.0.0.1"
READY_TIMEOUT_S = 30.0  # a child must log its endpoints and be ready within this
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this
IDLE_TIMEOUT_S = 30.0  # after a run, every unit must show 0 outstanding within this
ENDPOINTS = re.compile(rb"(?:sidecar \S+|gateway): HTTP (http://\S+), gRPC (\S+?),")
PROBLEM_MARKS = (" WARNING ", " ERROR ", " CRITICAL ", "Traceback")


# -- the fleet's shape ----------------------------------------------------------------


@dataclass(frozen=True)
class UnitSpec:
    """One simulated unit: the sidecar flags, and what they make it able to do."""

    id: str
    slots: int  # --sim-max-num-seqs
    capacity: int  # --capacity: admission limit, well above slots so queues form in the engine
    slowdown: float  # 1.0 fast; above: every simulated cost multiplied by this
    decode_step_ms: float
    decode_ms_per_seq: float
    prefill_ms_per_token: float
    seed: int

    def args(self) -> list[str]:
        return [
            "sidecar",
            "--engine",
            "sim",
            "--unit-id",
            self.id,
            "--host",
            HOST,
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--capacity",
            str(self.capacity),
            "--sim-max-num-seqs",
            str(self.slots),
            "--sim-decode-step-ms",
            f"{self.decode_step_ms:g}",
            "--sim-decode-ms-per-seq",
            f"{self.decode_ms_per_seq:g}",
            "--sim-prefill-ms-per-token",
            f"{self.prefill_ms_per_token:g}",
            "--sim-seed",
            str(self.seed),
        ]

    def model_rate(self, mean_prompt: float, mean_output: float) -> float:
        """Requests/s this unit completes with every slot busy.

        A full step takes ``T = step + per_seq * slots`` and gives each slot one token; a
        request holds its slot for ``output`` steps and adds its prefill to one step, so
        ``rate * (T * output / slots + prefill * prompt) = 1 s``.
        """
        full_step_ms = self.decode_step_ms + self.decode_ms_per_seq * self.slots
        ms_per_request = full_step_ms * mean_output / self.slots
        ms_per_request += self.prefill_ms_per_token * mean_prompt
        return 1000.0 / ms_per_request

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "argv": self.args()}


# Base costs of a fast unit; half the fleet is 1.25-1.5x slower, every other unit has
# half the slots. Chosen to keep a 2-core machine well below saturation by itself.
# Prefill against decode as on real hardware: prefill is compute-bound (2 x parameters
# FLOPs a token), a decode step memory-bound (the weights read once a step), so one
# prompt token costs about 1/250-1/400 of a full decode step (70B on 8 H100s: about
# 0.045 ms a token at 40 % of peak, a step of 11-15 ms). Here a full step of 16
# sequences is 34 ms and a prompt token 0.1 ms (1/340): a 4k-token prompt is 400 ms of
# prefill, chunked over steps of at most 2,048 tokens (the simulator's default).
BASE_SLOTS = 16
BASE_DECODE_STEP_MS = 30.0
BASE_DECODE_MS_PER_SEQ = 0.25
BASE_PREFILL_MS_PER_TOKEN = 0.1
CAPACITY_PER_SLOT = 4


FLEETS = ("mixed", "tiered")


def fleet_specs(units: int, seed: int, kind: str = "mixed") -> list[UnitSpec]:
    """The first half fast, the second half 1.25x to 1.5x slower.

    ``mixed``: odd units have half the slots, fast or slow. ``tiered``: the slow half
    has half the slots too, like an older generation of hardware with less memory.
    """
    fast = units - units // 2
    slow = units - fast
    specs = []
    for i in range(units):
        k = i - fast
        slowdown = 1.0 if k < 0 else 1.25 + (0.25 * k / (slow - 1) if slow > 1 else 0.0)
        small = k >= 0 if kind == "tiered" else i % 2 == 1
        slots = BASE_SLOTS // 2 if small else BASE_SLOTS
        specs.append(
            UnitSpec(
                id=f"u{i}",
                slots=slots,
                capacity=CAPACITY_PER_SLOT * slots,
                slowdown=round(slowdown, 3),
                decode_step_ms=round(BASE_DECODE_STEP_MS * slowdown, 3),
                decode_ms_per_seq=round(BASE_DECODE_MS_PER_SEQ * slowdown, 4),
                prefill_ms_per_token=round(BASE_PREFILL_MS_PER_TOKEN * slowdown, 4),
                seed=seed * 1000 + i,
            )
        )
    return specs


# -- one child process ----------------------------------------------------------------


class ChildFailed(Exception):
    pass


class GatewayFailed(ChildFailed):
    """A run's gateway did not start; the fleet may be fine."""


@dataclass
class Child:
    name: str
    argv: list[str]
    process: asyncio.subprocess.Process
    log_path: Path
    http_url: str = ""
    grpc_target: str = ""
    exit_code: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def check_alive(self) -> None:
        if self.process.returncode is not None:
            raise ChildFailed(
                f"{self.name} exited with {self.process.returncode}; see {self.log_path}"
            )

    def log_problems(self) -> list[str]:
        """Lines at WARNING or above, and tracebacks, from the child's log."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [line for line in lines if any(m in line for m in PROBLEM_MARKS)]

    def cpu_s(self) -> float:
        """utime + stime of the child (all its threads), in seconds; 0 once it is gone."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return 0.0
        fields = stat.rsplit(")", 1)[1].split()  # utime, stime: fields 14, 15
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@asynccontextmanager
async def running(name: str, args: Sequence[str], log_path: Path) -> AsyncIterator[Child]:
    """Start ``python -m proxy ARGS`` with its output to ``log_path``; always stop it."""
    argv = [sys.executable, "-m", "proxy", *args]
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
    child = Child(name, argv, process, log_path)
    try:
        yield child
    finally:
        child.exit_code = await stop(process, STOP_TIMEOUT_S)


async def read_endpoints(child: Child, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait for the child's log line with its HTTP URL and gRPC target (ports were 0)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        match = ENDPOINTS.search(child.log_path.read_bytes())
        if match:
            child.http_url, child.grpc_target = match[1].decode(), match[2].decode()
            return
        child.check_alive()
        await asyncio.sleep(0.05)
    raise ChildFailed(f"{child.name} logged no endpoints in {timeout_s:g} s; see {child.log_path}")


async def stop(process: asyncio.subprocess.Process, timeout_s: float) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
    try:
        if process.returncode is None:
            _signal(process, signal.SIGTERM)
            async with asyncio.timeout(timeout_s):
                return await process.wait()
        return process.returncode
    except TimeoutError:
        print(f"pid {process.pid} ignored SIGTERM for {timeout_s:g} s; killing it", file=sys.stderr)
        _signal(process, signal.SIGKILL)
        return await process.wait()
    except BaseException:  # interrupted while stopping: do not leave it behind
        _signal(process, signal.SIGKILL)
        raise


def _signal(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(sig)


# -- readiness and idleness -----------------------------------------------------------


async def _get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with session.get(url, timeout=timeout) as resp:
        return resp.status, await resp.json(content_type=None)


async def wait_until(
    session: aiohttp.ClientSession,
    child: Child,
    path: str,
    ready: Callable[[int, Any], bool],
    timeout_s: float = READY_TIMEOUT_S,
) -> Any:
    """Poll ``GET path`` until ``ready(status, body)`` holds; returns the last body."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    body: Any = None
    while loop.time() < deadline:
        child.check_alive()
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            status, body = await _get_json(session, f"{child.http_url}{path}")
            if ready(status, body):
                return body
        await asyncio.sleep(0.05)
    raise ChildFailed(f"{child.name}: GET {path} not ready in {timeout_s:g} s (last: {body})")


READY_BODY = b'{"model":"unitproxy-sim","prompt":"ready?","max_tokens":2}'


async def answers(
    session: aiohttp.ClientSession, child: Child, timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Wait until a real completion comes back through the child (a gateway whose
    /ready holds can still fail every request, say in a tree that is mid-edit)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = ""
    while loop.time() < deadline:
        child.check_alive()
        try:
            async with session.post(
                f"{child.http_url}/v1/completions",
                data=READY_BODY,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=5.0),
            ) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            last = type(exc).__name__
        await asyncio.sleep(0.2)
    raise ChildFailed(f"{child.name}: no completion through it in {timeout_s:g} s (last: {last})")


PREFIX_CACHE = re.compile(r"^unitproxy_engine_prefix_cache_(queries|hits)_total ([0-9.e+]+)$", re.M)


@dataclass
class Fleet:
    specs: list[UnitSpec]
    sidecars: list[Child]

    def unit_flags(self) -> list[str]:
        flags = []
        for spec, child in zip(self.specs, self.sidecars, strict=True):
            flags += ["--unit", f"{spec.id}={child.http_url},{child.grpc_target}"]
        return flags

    def cpu_s(self) -> float:
        return sum(c.cpu_s() for c in self.sidecars)

    def check_alive(self) -> None:
        for child in self.sidecars:
            child.check_alive()

    async def outstanding(self, session: aiohttp.ClientSession) -> dict[str, int]:
        async def one(child: Child) -> int:
            _, body = await _get_json(session, f"{child.http_url}/load")
            return int(body["outstanding"])

        counts = await asyncio.gather(*(one(c) for c in self.sidecars))
        return {spec.id: n for spec, n in zip(self.specs, counts, strict=True)}

    async def prefix_cache(self, session: aiohttp.ClientSession) -> tuple[int, int]:
        """Prompt tokens the units looked up in their prefix caches, and found, so far."""

        async def one(child: Child) -> tuple[int, int]:
            timeout = aiohttp.ClientTimeout(total=2.0)
            async with session.get(f"{child.http_url}/metrics", timeout=timeout) as resp:
                text = await resp.text()
            found = dict(PREFIX_CACHE.findall(text))
            return int(float(found.get("queries", 0))), int(float(found.get("hits", 0)))

        counts = await asyncio.gather(*(one(c) for c in self.sidecars))
        return sum(q for q, _ in counts), sum(h for _, h in counts)

    async def wait_idle(self, session: aiohttp.ClientSession) -> dict[str, int]:
        """Poll every unit's /load until all show 0 outstanding, or IDLE_TIMEOUT_S passed;
        returns the last counts (all 0 when idle)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + IDLE_TIMEOUT_S
        while True:
            self.check_alive()
            counts = await self.outstanding(session)
            if not any(counts.values()) or loop.time() > deadline:
                return counts
            await asyncio.sleep(0.1)


@asynccontextmanager
async def running_fleet(
    specs: Sequence[UnitSpec], session: aiohttp.ClientSession, log_dir: Path
) -> AsyncIterator[Fleet]:
    async with AsyncExitStack() as stack:
        sidecars = [
            await stack.enter_async_context(
                running(s.id, s.args(), log_dir / f"sidecar-{s.id}.log")
            )
            for s in specs
        ]
        # Started one after another, waited for together: they boot in parallel.
        await asyncio.gather(*(read_endpoints(c) for c in sidecars))
        for child in sidecars:
            await wait_until(session, child, "/ready", lambda status, _: status == 200)
        yield Fleet(list(specs), sidecars)


@asynccontextmanager
async def running_gateway(
    fleet: Fleet,
    policy_args: Sequence[str],
    session: aiohttp.ClientSession,
    log_path: Path,
) -> AsyncIterator[Child]:
    """A fresh gateway over the fleet, once every unit's report reached it and a
    completion came back through it."""
    args = [
        "gateway",
        "--host",
        HOST,
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        *fleet.unit_flags(),
        *policy_args,
    ]
    units = len(fleet.specs)
    async with running("gateway", args, log_path) as gateway:
        try:
            await read_endpoints(gateway)
            await wait_until(
                session, gateway, "/ready", lambda _, body: body.get("serving_units") == units
            )
            await answers(session, gateway)
        except ChildFailed as exc:
            fleet.check_alive()  # a dead unit is the fleet's failure, not the gateway's
            raise GatewayFailed(str(exc)) from exc
        yield gateway

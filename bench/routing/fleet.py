"""The processes: a heterogeneous fleet of simulated units and one gateway per run.

Every child is ``python -m proxy ...`` on 127.0.0.1 with ports 0, read back from its
log line, started and stopped by the shared launcher (``proxy.procutil``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import answers
from proxy.procutil import Child, ChildFailed, Probe, python_m, running

HOST = "127.0.0.1"
READY_TIMEOUT_S = 30.0  # a child must log its endpoints and be ready within this
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this
IDLE_TIMEOUT_S = 30.0  # after a run, every unit must show 0 outstanding within this
ENDPOINTS = re.compile(rb"(?:sidecar \S+|gateway): HTTP (http://\S+), gRPC (\S+?),")


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


FLEETS = ("mixed", "tiered", "deep")
# ``deep``: a unit runs this many times the sequences at once, each as much slower
# (the step's fixed part that much longer), so it finishes the same tokens a second
# with this many times the requests outstanding, as engines with large batches do.
DEEP = 4


def fleet_specs(units: int, seed: int, kind: str = "mixed") -> list[UnitSpec]:
    """The first half fast, the second half 1.25x to 1.5x slower.

    ``mixed``: odd units have half the slots, fast or slow. ``tiered``: the slow half
    has half the slots too, like an older generation of hardware with less memory.
    ``deep``: ``mixed`` with ``DEEP`` x the slots and the decode step's fixed part, the
    same throughput a unit with about 25 requests outstanding at 85 % load, not 6.
    """
    depth = DEEP if kind == "deep" else 1
    fast = units - units // 2
    slow = units - fast
    specs = []
    for i in range(units):
        k = i - fast
        slowdown = 1.0 if k < 0 else 1.25 + (0.25 * k / (slow - 1) if slow > 1 else 0.0)
        small = k >= 0 if kind == "tiered" else i % 2 == 1
        slots = depth * (BASE_SLOTS // 2 if small else BASE_SLOTS)
        specs.append(
            UnitSpec(
                id=f"u{i}",
                slots=slots,
                capacity=CAPACITY_PER_SLOT * slots,
                slowdown=round(slowdown, 3),
                decode_step_ms=round(depth * BASE_DECODE_STEP_MS * slowdown, 3),
                decode_ms_per_seq=round(BASE_DECODE_MS_PER_SEQ * slowdown, 4),
                prefill_ms_per_token=round(BASE_PREFILL_MS_PER_TOKEN * slowdown, 4),
                seed=seed * 1000 + i,
            )
        )
    return specs


# -- the children ---------------------------------------------------------------------
# The shared launcher, not ``unitproxy up``: every unit has flags of its own (slots,
# costs, seed), and up gives all its sidecars the same; each run has a fresh gateway
# over the same fleet.


class GatewayFailed(ChildFailed):
    """A run's gateway did not start; the fleet may be fine."""


async def start(name: str, args: Sequence[str], log_path: Path, stack: AsyncExitStack) -> Child:
    """``python -m proxy ARGS`` on ports 0, stopped with ``stack``."""
    argv = python_m(*args)
    return await stack.enter_async_context(
        running(name, argv, log_path, stop_timeout_s=STOP_TIMEOUT_S)
    )


async def read_endpoints(child: Child) -> None:
    """Its HTTP URL and gRPC target, from its log line (its ports were 0)."""
    match = await child.wait_for_line(ENDPOINTS, READY_TIMEOUT_S)
    child.http_url, child.grpc_target = match[1].decode(), match[2].decode()


async def _get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with session.get(url, timeout=timeout) as resp:
        return resp.status, await resp.json(content_type=None)


def serving_units(url: str, units: int) -> Probe:
    """A probe: the gateway's /ready counts every unit serving."""

    async def probe(session: aiohttp.ClientSession) -> bool:
        _, body = await _get_json(session, f"{url}/ready")
        return bool(body.get("serving_units") == units)

    return probe


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
        sidecars = [await start(s.id, s.args(), log_dir / f"sidecar-{s.id}.log", stack)
                    for s in specs]  # fmt: skip
        # Started one after another, waited for together: they boot in parallel.
        await asyncio.gather(*(read_endpoints(c) for c in sidecars))
        for child in sidecars:
            await child.until_ready(READY_TIMEOUT_S)
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
    args = ["gateway", "--host", HOST, "--http-port", "0", "--grpc-port", "0",
            *fleet.unit_flags(), *policy_args]  # fmt: skip
    async with AsyncExitStack() as stack:
        try:
            gateway = await start("gateway", args, log_path, stack)
            await read_endpoints(gateway)
            await gateway.until(serving_units(gateway.http_url, len(fleet.specs)), READY_TIMEOUT_S)
            await gateway.until(answers(gateway.http_url), READY_TIMEOUT_S, "answering")
        except ChildFailed as exc:
            fleet.check_alive()  # a dead unit is the fleet's failure, not the gateway's
            raise GatewayFailed(str(exc)) from exc
        yield gateway

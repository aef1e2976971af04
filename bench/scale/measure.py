"""What bench/scale measures of one gateway process, and of the router on its own."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from proxy.gateway.router import Outcome, Router
from proxy.load import LoadReport, UnitState
from proxy.registry import POLICIES
from proxy.settings import GatewaySettings, UnitTarget

PAGE = 4096


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- selection, in process -------------------------------------------------------------


def selection_us(policy: str, units: int, budget_s: float, seed: int = 1) -> float | None:
    """µs of CPU per request for ``Router.pick`` + ``release`` over ``units`` units whose
    load moves (a report every few requests, as a loaded fleet's would); None when the
    policy does not exist in this build."""
    if policy not in POLICIES:
        return None
    rng = random.Random(seed)
    targets = [UnitTarget(id=f"u{i}", http_url=f"http://u{i}:1", grpc_target=f"u{i}:2")
               for i in range(units)]  # fmt: skip
    router = Router(GatewaySettings(policy=policy), targets, rng=random.Random(seed))
    seq = 1
    for t in targets:
        router.apply_report(t.id, LoadReport(t.id, UnitState.SERVING, rng.randrange(48), 64, seq=1))
    held: list[Any] = []
    done = 0
    started = time.process_time()
    while time.process_time() - started < budget_s:
        for _ in range(200):
            unit = router.pick()
            assert unit is not None
            held.append(unit)
            if len(held) > 64:  # concurrency 64: the oldest finishes
                router.release(held.pop(0), Outcome.OK)
            if done % 4 == 0:  # load moves: some unit reports
                seq += 1
                uid = f"u{rng.randrange(units)}"
                outstanding = rng.randrange(48)
                router.apply_report(
                    uid, LoadReport(uid, UnitState.SERVING, outstanding, 64, seq=seq)
                )
            done += 1
    spent = time.process_time() - started
    return spent / done * 1e6


# --- the gateway process ---------------------------------------------------------------


@dataclass
class Requests:
    count: int = 0
    errors: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0

    def add(self, other: Requests) -> None:
        """Pool another round's requests into these."""
        self.count += other.count
        self.errors += other.errors
        self.ttft_ms += other.ttft_ms
        self.elapsed_s += other.elapsed_s

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.count,
            "errors": self.errors,
            "req_per_s": round(self.count / self.elapsed_s, 1) if self.elapsed_s else 0,
            "ttft_p50_ms": round(quantile(self.ttft_ms, 0.5), 3),
            "ttft_p99_ms": round(quantile(self.ttft_ms, 0.99), 3),
        }


async def drive(urls: list[str], concurrency: int, duration_s: float, seed: int = 1) -> Requests:
    """Streamed /v1/completions, ``concurrency`` at a time, each to a URL chosen at random
    from ``urls`` (one gateway, or every unit directly), for ``duration_s``."""
    rng = random.Random(seed)
    out = Requests()
    body = json.dumps({"model": "fleet-emulator", "prompt": "hi", "max_tokens": 8,
                       "stream": True}).encode()  # fmt: skip
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + duration_s

        async def one() -> None:
            while loop.time() < deadline:
                url = urls[rng.randrange(len(urls))] + "/v1/completions"
                sent = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        first = True
                        async for _ in resp.content.iter_any():
                            if first:
                                out.ttft_ms.append((time.perf_counter() - sent) * 1000)
                                first = False
                        if resp.status != 200:
                            out.errors += 1
                except aiohttp.ClientError:
                    out.errors += 1
                out.count += 1

        started = loop.time()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        out.elapsed_s = loop.time() - started
    return out


async def report_ages(session: aiohttp.ClientSession, gateway: str) -> list[float]:
    async with session.get(f"{gateway}/units") as resp:
        units = (await resp.json())["units"]
    return [u["report_age_s"] for u in units if u["report_age_s"] is not None]


async def wait_serving(
    session: aiohttp.ClientSession, gateway: str, units: int, timeout_s: float
) -> float:
    """Seconds until the gateway counts ``units`` SERVING units."""
    started = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                async with session.get(f"{gateway}/ready") as resp:
                    body = await resp.json()
                if body.get("serving_units", 0) >= units:
                    return time.monotonic() - started
            except (aiohttp.ClientError, ValueError):
                pass
            await asyncio.sleep(0.25)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")

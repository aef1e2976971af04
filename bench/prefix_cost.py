"""What policy prefix costs the gateway: µs per request to choose a unit, and the index's memory.

The routing core alone (``proxy.gateway.router.Router``, no network), fed the request
bodies of bench/routing's shared-prefix workloads: per request the gateway parses the
body, hashes its prompt's blocks (``core.json_want``'s work) and picks a unit, then the
request is released after about a fleet's worth of others (a steady state of 8 in
flight per unit). Measured at 8 and 256 units for lor (no parsing) and prefix; the
index's memory is tracemalloc's count of what it holds after the run, at its bound
when the run sends more blocks than the index keeps.

    .venv/bin/python bench/prefix_cost.py            # about a minute
    .venv/bin/python bench/prefix_cost.py --requests 2000 --chunk-chars 256,512

Each figure is the best of ``--repeats`` runs (3): on a shared machine the others'
work only ever adds time.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import tracemalloc
from collections import deque
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.routing import workload
from proxy.gateway.policies.prefix import PrefixAffinity
from proxy.gateway.prefix import PrefixIndex
from proxy.gateway.request import json_want
from proxy.gateway.router import NO_WANT, Outcome, Router
from proxy.gateway.units import Unit
from proxy.load import LoadReport, UnitState
from proxy.settings import GatewaySettings, UnitTarget

IN_FLIGHT_PER_UNIT = 8


def fleet(units: int, policy: str, chunk_chars: int | None = None) -> Router:
    targets = [UnitTarget(id=f"u{i}", http_url=f"http://u{i}:1", grpc_target=f"u{i}:2")
               for i in range(units)]  # fmt: skip
    chunk = {} if chunk_chars is None else {"prefix_chunk_chars": chunk_chars}
    # a clock that stands still: reports never go stale however long the run takes
    router = Router(
        GatewaySettings(policy=policy, **chunk), targets, rng=random.Random(1), clock=lambda: 0.0
    )
    for t in targets:
        router.apply_report(t.id, LoadReport(t.id, UnitState.SERVING, 0, 64, seq=1))
    return router


def index_of(router: Router) -> PrefixIndex | None:
    """Policy prefix's index of prompt blocks; None under another policy."""
    policy = router.policy
    return policy.index if isinstance(policy, PrefixAffinity) else None


def run(router: Router, units: int, bodies: list[bytes]) -> float:
    """Seconds to route every body."""
    in_flight: deque[Unit] = deque()
    began = time.perf_counter()
    for body in bodies:
        policy = router.policy
        want = json_want(body, policy.prompt_blocks) if policy.reads_prompt else NO_WANT
        unit = router.pick(want=want)
        assert unit is not None
        in_flight.append(unit)
        if len(in_flight) > IN_FLIGHT_PER_UNIT * units:
            router.release(in_flight.popleft(), Outcome.OK)
    return time.perf_counter() - began


def measure(
    units: int, policy: str, bodies: list[bytes], chunk: int | None, repeats: int
) -> dict[str, float]:
    elapsed = min(run(fleet(units, policy, chunk), units, bodies) for _ in range(repeats))
    router = fleet(units, policy, chunk)  # again, with tracemalloc on, for the index's memory
    tracemalloc.start()
    run(router, units, bodies)
    held = 0
    index = index_of(router)
    if index is not None:
        snapshot = tracemalloc.take_snapshot()
        held = sum(
            s.size for s in snapshot.statistics("filename")
            if s.traceback[0].filename.endswith("prefix.py")
        )  # fmt: skip
    tracemalloc.stop()
    blocks = index.stats()[1] if index is not None else 0
    return {"us_per_request": 1e6 * elapsed / len(bodies), "index_mb": held / 1e6,
            "blocks": blocks}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000, help="per run. Default 5000.")
    parser.add_argument("--repeats", type=int, default=3, help="runs, the best kept. Default 3.")
    parser.add_argument(
        "--chunk-chars",
        default="",
        help="comma-separated prefix_chunk_chars to compare. Default: the gateway's default.",
    )
    parser.add_argument("--quick", action="store_true", help="200 requests, 1 run: a smoke run.")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats = 200, 1
    chunks = [int(c) for c in args.chunk_chars.split(",") if c] or [None]
    default = GatewaySettings().prefix_chunk_chars
    print("workload      units  policy  chunk  µs/request  index MB  blocks")
    for name in ("chat", "tenants"):
        source, rng = workload.WORKLOADS[name].source(), random.Random(1)
        bodies = [source.draw(rng, i)[1] for i in range(args.requests)]
        for units in (8, 256):
            runs = [("lor", None), *(("prefix", c) for c in chunks)]
            for policy, chunk in runs:
                m = measure(units, policy, bodies, chunk, args.repeats)
                shown = "" if policy == "lor" else str(chunk or default)
                print(f"{name:<12}  {units:>5}  {policy:<6}  {shown:>5}  "
                      f"{m['us_per_request']:>10.1f}  {m['index_mb']:>8.2f}  "
                      f"{m['blocks']:>6.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Policy prefix and model-aware routing on the routing core: injected clock, no sleeps."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from proxy.errors import NotFound
from proxy.gateway.prefix import Want
from proxy.gateway.router import NoUnit, Outcome, Router
from proxy.load import LoadReport, UnitState
from proxy.settings import GatewaySettings, UnitTarget
from tests.test_router import Clock


def system(tenant: int) -> str:
    return f"You are the assistant of tenant {tenant}. Answer briefly and politely. " * 30


def fleet(n: int, capacity: int = 64, models: dict[str, tuple[str, ...]] | None = None,
          **settings: object) -> Router:  # fmt: skip
    ids = [f"u{i}" for i in range(n)]
    targets = [UnitTarget(id=i, http_url=f"http://{i}:1", grpc_target=f"{i}:2") for i in ids]
    r = Router(GatewaySettings(**settings), targets, rng=random.Random(1), clock=Clock())
    for i in ids:
        served = (models or {}).get(i, ("m",))
        r.apply_report(i, LoadReport(i, UnitState.SERVING, 0, capacity, seq=10, models=served))
    return r


def want(r: Router, text: str, model: str | None = None) -> Want:
    assert r.prefix is not None
    return Want(model, r.prefix.hashes(text))


async def test_a_prompt_goes_back_to_the_unit_that_holds_its_prefix() -> None:
    r = fleet(8, policy="prefix")
    first = await r.acquire(want=want(r, system(1) + "first question"))
    for i in range(20):  # the others fill up a little, evenly
        u = await r.acquire(want=want(r, f"unrelated prompt {i} " * 50))
    again = await r.acquire(want=want(r, system(1) + "another question"))
    assert again is first
    other = await r.acquire(want=want(r, system(2) + "first question"))
    assert other is not first  # lor: first now has more than the least loaded
    assert u.inflight >= 1


async def test_bounded_load_a_hot_prefix_spreads_and_no_unit_runs_far_above_the_mean() -> None:
    r = fleet(8, policy="prefix", prefix_balance=0.2, prefix_slack=2)
    hot = system(0)
    started = []
    peaks = []
    rng = random.Random(3)
    for i in range(2000):
        text = hot if rng.random() < 0.5 else system(1 + i % 50)
        started.append(await r.acquire(want=want(r, text + f"question {i}")))
        if len(started) > 200:  # a steady state of about 200 in flight
            r.release(started.pop(rng.randrange(len(started))), Outcome.OK)
        counts = [u.inflight for u in r.units.values()]
        if sum(counts) >= 8 * 8:
            peaks.append(max(counts) * len(counts) / sum(counts))
    peaks.sort()
    assert peaks[int(0.99 * len(peaks))] <= 1.25
    assert r.prefix is not None
    holders = next(r.prefix.matches(want(r, hot).blocks, 0.0))[1]
    assert len(holders) >= 2  # the hot prefix overflowed to more units, which keep it


async def test_prefix_memory_is_bounded_and_a_restarted_unit_is_forgotten() -> None:
    r = fleet(2, policy="prefix", prefix_max_blocks=50)
    for i in range(100):
        u = await r.acquire(want=want(r, f"{i} " * 2000))
        r.release(u, Outcome.OK)
    assert r.prefix is not None
    assert r.prefix.stats()[1] <= 2 * 50
    held = r.prefix.stats()[1]
    # u0's sidecar restarts: seq starts over, newer timestamp
    r.apply_report("u0", LoadReport("u0", UnitState.SERVING, 0, 64, seq=1, timestamp_ms=10**12))
    assert r.prefix.stats()[1] < held and "u0" not in dict.fromkeys(r.prefix._units)


async def test_requests_go_only_to_units_serving_their_model() -> None:
    models = {"u0": ("llama",), "u1": ("llama", "llama-lora-sql"), "u2": ("qwen",)}
    r = fleet(3, models=models)
    assert r.reads_requests
    seen = Counter()
    for _ in range(30):
        u = await r.acquire(want=Want("llama"))
        seen[u.id] += 1
    assert set(seen) == {"u0", "u1"}
    assert (await r.acquire(want=Want("llama-lora-sql"))).id == "u1"
    assert (await r.acquire(want=Want("qwen"))).id == "u2"
    assert (await r.acquire()).id in {"u0", "u1", "u2"}  # no model: any unit
    with pytest.raises(NotFound) as caught:
        r.check_model("mistral")
    assert caught.value.code == "model_not_found"
    r.check_model("qwen")
    r.apply_report("u2", LoadReport("u2", UnitState.DRAINING, 0, 64, seq=11, models=("qwen",)))
    with pytest.raises(NoUnit, match="no unit serving 'qwen'"):
        await r.acquire(want=Want("qwen"))


def test_one_model_everywhere_reads_no_request() -> None:
    r = fleet(3)
    assert not r.reads_requests
    assert fleet(3, policy="prefix").reads_requests

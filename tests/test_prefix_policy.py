"""Policy prefix and model-aware routing on the routing core: injected clock, no sleeps."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from proxy.errors import NotFound
from proxy.gateway.index import LeastLoaded
from proxy.gateway.policies.prefix import Budget, PrefixAffinity, prefix_affinity
from proxy.gateway.prefix import PrefixIndex
from proxy.gateway.request import Want
from proxy.gateway.router import NoUnit, Outcome, Router
from proxy.gateway.units import CORRECTED, Unit
from proxy.load import LoadReport, PrefixBlocks, UnitState
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


def index(r: Router) -> PrefixIndex:
    """The router's policy prefix's index."""
    assert isinstance(r.policy, PrefixAffinity)
    return r.policy.index


def want(r: Router, text: str, model: str | None = None) -> Want:
    return Want(model, index(r).hashes(text))


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


def unit(id: str, outstanding: int, capacity: int = 64) -> Unit:
    u = Unit(id, f"http://{id}:1", f"{id}:2")
    u.apply(LoadReport(id, UnitState.SERVING, outstanding, capacity, seq=1), 0.0)
    return u


def test_a_holder_is_chosen_only_within_the_bound_over_the_mean() -> None:
    # mean load 0.25 with this request; (1 + 0.2) x 0.25 x 64 = 19.2, plus 1 request
    a, b, least = unit("a", 19), unit("b", 20), unit("c", 0)
    mean = 0.25
    assert prefix_affinity(least, [[a]], CORRECTED, mean, 0.2, 1) is a  # 19 + 1 <= 20.2
    assert prefix_affinity(least, [[b]], CORRECTED, mean, 0.2, 1) is least  # 21 > 20.2
    assert prefix_affinity(least, [[b]], CORRECTED, mean, 0.2, 2) is b  # 21 <= 21.2
    # the longest match is over the bound: the next shorter match that is within it
    shorter = unit("d", 10)
    assert prefix_affinity(least, [[b], [shorter]], CORRECTED, mean, 0.2, 1) is shorter
    # of the holders at one depth, the least loaded by outstanding / capacity
    small = unit("e", 4, capacity=16)  # 0.25 against a's 0.30
    assert prefix_affinity(least, [[a, small]], CORRECTED, mean, 0.2, 1) is small
    # a small unit's share of the bound is its capacity's: 4 + 1 > 1.2 x 0.25 x 16 + 0
    assert prefix_affinity(least, [[small]], CORRECTED, mean, 0.2, 0) is least


async def test_bounded_load_no_choice_puts_a_unit_above_the_mean_bound() -> None:
    """Every choice, checked as it is made: a unit holding the prefix is chosen only
    while its outstanding, this request counted, is within (1 + balance) x the mean
    plus the slack; anything else is the least loaded unit (lor)."""
    balance, slack = 0.1, 1
    capacities = {f"u{i}": 64 if i % 2 == 0 else 32 for i in range(8)}
    r = fleet(8, policy="prefix", prefix_balance=balance, prefix_slack=slack)
    for i, cap in capacities.items():
        r.apply_report(i, LoadReport(i, UnitState.SERVING, 0, cap, seq=11, models=("m",)))
    hot = system(0)
    started: list[Unit] = []
    rng = random.Random(3)
    by_affinity = 0
    for i in range(3000):
        text = hot if rng.random() < 0.5 else system(1 + i % 50)
        units = list(r.units.values())
        before = {u.id: u.inflight for u in units}
        lowest = min(u.inflight / u.capacity for u in units)
        mean = (sum(before.values()) + 1) / sum(capacities.values())
        chosen = await r.acquire(want=want(r, text + f"question {i}"))
        started.append(chosen)
        after = chosen.inflight
        within = after <= (1 + balance) * mean * chosen.capacity + slack + 1e-9
        least = before[chosen.id] / chosen.capacity == lowest
        assert within or least, (i, chosen.id, before, mean)
        by_affinity += within and not least
        # a steady state of 100-300 in flight: departures at random
        while len(started) > 100 + (i // 500 % 3) * 100:
            r.release(started.pop(rng.randrange(len(started))), Outcome.OK)
    assert by_affinity > 1000  # the bound did not simply turn the policy into lor
    holders = next(index(r).matches(want(r, hot).blocks, 0.0))[1]
    assert len(holders) >= 4  # the hot prefix (half the traffic) overflowed to more units


async def test_bounded_load_a_hot_prefix_keeps_every_unit_near_the_mean() -> None:
    r = fleet(8, policy="prefix")  # the default bound
    hot = system(0)
    started = []
    peaks = []
    rng = random.Random(3)
    for i in range(2000):
        text = hot if rng.random() < 0.5 else system(1 + i % 50)
        started.append(await r.acquire(want=want(r, text + f"question {i}")))
        if len(started) > 100:  # a steady state of about 100 in flight
            r.release(started.pop(rng.randrange(len(started))), Outcome.OK)
        counts = [u.inflight for u in r.units.values()]
        if sum(counts) >= 8 * 8:
            peaks.append(max(counts) * len(counts) / sum(counts))
    peaks.sort()
    assert peaks[int(0.99 * len(peaks))] <= 1.25


def test_the_heap_keeps_the_fleet_sums_of_its_live_units() -> None:
    rng = random.Random(5)
    heap = LeastLoaded(rng)
    units = [unit(f"u{i}", rng.randrange(10), capacity=16 * (1 + i % 2)) for i in range(6)]
    live: set[str] = set()
    for step in range(500):
        u = rng.choice(units)
        action = rng.randrange(3)
        if action == 0:
            u.inflight += 1
            u.started_since_report += 1
            heap.update(u)
            live.add(u.id)
        elif action == 1:
            heap.remove(u)
            live.discard(u.id)
        else:
            heap.hold(u, until=float(step))
            live.discard(u.id)
        mine = [v for v in units if v.id in live]
        assert heap.outstanding == sum(v.estimate() for v in mine)
        assert heap.capacity == sum(v.capacity for v in mine)
        if mine:
            total = sum(v.capacity for v in mine)
            assert heap.mean_load() == (sum(v.estimate() for v in mine) + 1) / total


def test_lor_keeps_no_sums_and_chooses_as_with_them() -> None:
    with_sums, without = LeastLoaded(random.Random(3)), LeastLoaded(random.Random(3), sums=False)
    units = [unit(f"u{i}", i % 4, capacity=8) for i in range(8)]
    for u in units:
        with_sums.update(u)
        without.update(u)
    for _ in range(20):
        a = with_sums.least(0.0, 5.0, 0.0)
        b = without.least(0.0, 5.0, 0.0)
        assert a is not None and a is b
        a.inflight += 1
        a.started_since_report += 1
        with_sums.update(a)
        without.update(a)
    with pytest.raises(RuntimeError):
        without.mean_load()
    assert with_sums.mean_load() > 0


async def test_prefix_memory_is_bounded_and_a_restarted_unit_is_forgotten() -> None:
    r = fleet(2, policy="prefix", prefix_max_blocks=50)
    for i in range(100):
        u = await r.acquire(want=want(r, f"{i} " * 2000))
        r.release(u, Outcome.OK)
    assert index(r).stats()[1] <= 2 * 50
    held = index(r).stats()[1]
    # u0's sidecar restarts: seq starts over, newer timestamp
    r.apply_report("u0", LoadReport("u0", UnitState.SERVING, 0, 64, seq=1, timestamp_ms=10**12))
    assert index(r).stats()[1] < held and "u0" not in dict.fromkeys(index(r)._units)


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


def calibrated(id: str, outstanding: int, queued: float, rate: float) -> Unit:
    u = Unit(id, f"http://{id}:1", f"{id}:2")
    metrics = {"prefill_queue_tokens": queued, "prefill_tokens_per_s": rate}
    u.apply(LoadReport(id, UnitState.SERVING, outstanding, 64, seq=1, named_metrics=metrics), 0.0)
    return u


def test_calibration_bounds_affinity_by_the_prefill_a_unit_clears_in_the_tolerated_ttft() -> None:
    # mean 0.25: the bound over the mean is 1.2 x 0.25 x 64 = 19.2 requests, + slack 1
    least = unit("c", 0)
    budget = Budget(ttft_s=0.5, rate=0.0)  # each unit's own measured rate
    budget.new_tokens = 100
    # 30 outstanding, far over the bound and the slack, but its queued prefill (1,900
    # tokens) and this request's 100 clear within 0.5 s at 4,000 tokens/s: kept
    clears = calibrated("a", 30, queued=1900, rate=4000)
    assert budget.fits(clears) == 1
    assert prefix_affinity(least, [[clears]], CORRECTED, 0.25, 0.2, 1, budget.fits) is clears
    assert prefix_affinity(least, [[clears]], CORRECTED, 0.25, 0.2, 1) is least, "by slack"
    # 19 outstanding, within the slack, but 2,000 queued tokens at 4,000/s miss 0.5 s
    behind = calibrated("b", 19, queued=2000, rate=4000)
    assert budget.fits(behind) == 0
    assert prefix_affinity(least, [[behind]], CORRECTED, 0.25, 0.2, 1, budget.fits) is least
    assert prefix_affinity(least, [[behind]], CORRECTED, 0.25, 0.2, 1) is behind, "by slack"
    # a given rate overrides the unit's; a unit that reports no queue falls back to slack
    assert Budget(ttft_s=0.5, rate=10_000).fits(behind) == 1
    assert budget.fits(unit("d", 19)) == -1
    assert prefix_affinity(least, [[unit("d", 19)]], CORRECTED, 0.25, 0.2, 1, budget.fits).id == "d"
    assert Budget(ttft_s=0.0, rate=4000).fits(clears) == -1, "no tolerated TTFT: off"


async def test_the_router_bounds_affinity_by_the_units_reported_prefill_when_a_ttft_is_set() -> (
    None
):
    text = system(3) + "a question"
    cases = [(0.0, 100.0, True, "u1"), (0.5, 100.0, True, "u0"), (0.5, 5e4, True, "u1")]
    # prefix_engine_blocks false: what u0 reports holding is not read, lor decides
    cases.append((0.5, 100.0, False, "u1"))
    for ttft_s, queued, engine_blocks, goes_to in cases:
        r = fleet(2, policy="prefix", prefix_ttft_s=ttft_s, prefix_engine_blocks=engine_blocks)
        blocks = index(r).hashes(text)
        metrics = {"prefill_queue_tokens": queued, "prefill_tokens_per_s": 20_000.0}
        held = PrefixBlocks(1, 0, 1, True, tuple(blocks), (), 512)
        # u0 holds the prompt's prefix (its engine says so) and is far above the mean
        report = LoadReport("u0", UnitState.SERVING, 40, 64, seq=11, named_metrics=metrics,
                            prefix_blocks=held)  # fmt: skip
        r.apply_report("u0", report)
        chosen = await r.acquire(want=Want(None, blocks, len(text)))
        assert chosen.id == goes_to, (ttft_s, queued)


def test_weighed_a_holder_above_the_bound_keeps_the_request_while_it_starts_it_no_later() -> None:
    # mean 0.25: the bound over the mean is 1.1 x 0.25 x 64 = 17.6 requests, + slack 1
    least = calibrated("c", 0, queued=500, rate=4000)
    budget = Budget(ttft_s=0.0, rate=0.0, weigh=True)
    budget.new_tokens = 100  # the holder lacks 100 of the prompt's tokens
    budget.against(least, 2100)  # the least loaded unit would prefill all 2,100
    assert budget.least_s == pytest.approx((500 + 2100) / 4000)
    # 30 outstanding, far over the bound and the slack: its queue of 2,400 tokens and
    # the 100 it lacks (0.625 s) start it no later than 500 + 2,100 at c (0.65 s)
    deep = calibrated("a", 30, queued=2400, rate=4000)
    assert budget.fits(deep) == 1
    assert prefix_affinity(least, [[deep]], CORRECTED, 0.25, 0.1, 1, budget.fits) is deep
    assert prefix_affinity(least, [[deep]], CORRECTED, 0.25, 0.1, 1) is least, "by slack"
    # 2,600 queued: 0.675 s against 0.65 s, the prefill it saves no longer pays
    deeper = calibrated("b", 30, queued=2600, rate=4000)
    assert budget.fits(deeper) == 0
    assert prefix_affinity(least, [[deeper]], CORRECTED, 0.25, 0.1, 1, budget.fits) is least
    # within the bound the weighing is not asked: the holder takes it
    near = calibrated("e", 10, queued=9000, rate=4000)
    assert prefix_affinity(least, [[near]], CORRECTED, 0.25, 0.1, 1, budget.fits) is near
    # the rates count: the holder prefills twice as fast
    assert budget.fits(calibrated("f", 30, queued=4800, rate=8000)) == 1
    # nothing queued at the holder: it starts at once there, whatever its measured rate
    slow = calibrated("h", 30, queued=0, rate=10)
    assert budget.prefill_s(slow, 100) > budget.least_s and budget.fits(slow) == 1
    # either side unknown: -1, and the slack decides
    assert budget.fits(unit("d", 30)) == -1
    budget.against(unit("g", 0), 2100)
    assert budget.least_s == -1 and budget.fits(deep) == -1
    # what this gateway sent a unit since its report is queued there too, until the next
    budget.against(least, 2100)
    budget.chose(deep, 200)
    assert budget.queued(deep) == 2600 and budget.fits(deep) == 0
    budget.reported(deep)
    assert budget.queued(deep) == 2400 and budget.fits(deep) == 1
    off = Budget(ttft_s=0.0, rate=0.0, weigh=False)
    off.against(least, 2100)
    assert off.fits(deep) == -1, "not weighed: the slack decides"
    # a tolerated TTFT, where set, decides instead: 2,500 tokens miss 0.5 s at 4,000/s
    capped = Budget(ttft_s=0.5, rate=0.0, weigh=True)
    capped.new_tokens = 100
    capped.against(least, 2100)
    assert capped.fits(deep) == 0


async def test_the_router_weighs_the_prefill_a_holder_saves_against_its_queue() -> None:
    text = system(3) + "a question"  # 1,930 characters: 482 tokens, 3 whole blocks
    # u0 holds the prompt's prefix (its engine says so: 1,536 characters) and is far
    # above the mean; u1 is idle with a queue of 200 tokens; both prefill 20,000
    # tokens a second. u0 lacks 394 characters (98.5 tokens): 100 queued start it sooner
    # than u1's 200 + 482.5, 600 queued do not
    cases = [(True, 100.0, "u0"), (True, 600.0, "u1"), (False, 100.0, "u1")]
    for weigh, queued, goes_to in cases:
        r = fleet(2, policy="prefix", prefix_weigh_prefill=weigh)
        blocks = index(r).hashes(text)
        held = PrefixBlocks(1, 0, 1, True, tuple(blocks), (), 512)
        metrics = {"prefill_queue_tokens": queued, "prefill_tokens_per_s": 20_000.0}
        report = LoadReport("u0", UnitState.SERVING, 40, 64, seq=11, named_metrics=metrics,
                            prefix_blocks=held)  # fmt: skip
        r.apply_report("u0", report)
        # (one request outstanding there, whose 200 tokens wait)
        idle = {"prefill_queue_tokens": 200.0, "prefill_tokens_per_s": 20_000.0}
        r.apply_report("u1", LoadReport("u1", UnitState.SERVING, 1, 64, seq=11, named_metrics=idle))
        chosen = await r.acquire(want=Want(None, blocks, len(text)))
        assert chosen.id == goes_to, (weigh, queued)


def test_weighed_a_full_holder_gives_way_to_a_least_loaded_unit_with_a_free_slot() -> None:
    # prefill alone says the holder (2,400 + 100 tokens against 500 + 2,100), but its 16
    # engine slots are taken: there the request would wait for a running one to end
    view = CORRECTED
    budget = Budget(ttft_s=0.0, rate=0.0, weigh=True, view=view)
    budget.new_tokens = 100

    def shaped(id: str, outstanding: int, queued: float, slots: float) -> Unit:
        u = Unit(id, f"http://{id}:1", f"{id}:2")
        named = {"prefill_queue_tokens": queued, "prefill_tokens_per_s": 4000.0,
                 "engine_slots": slots}  # fmt: skip
        u.apply(LoadReport(id, UnitState.SERVING, outstanding, 64, seq=1, named_metrics=named), 0.0)
        return u

    full = shaped("a", 16, queued=2400, slots=16)
    roomy = shaped("b", 15, queued=2400, slots=16)
    budget.against(shaped("c", 3, queued=500, slots=16), 2100)
    assert budget.least_free == 1
    assert budget.fits(full) == 0 and budget.fits(roomy) == 1
    # the least loaded unit full too: both wait for a slot, the prefill decides
    budget.against(shaped("d", 16, queued=500, slots=16), 2100)
    assert budget.least_free == 0 and budget.fits(full) == 1
    # no slots reported: the prefill decides
    budget.against(shaped("e", 3, queued=500, slots=0), 2100)
    assert budget.least_free == -1 and budget.fits(full) == 1


async def test_weighed_the_prompts_sent_since_a_units_report_count_in_its_queue() -> None:
    text = system(3) + "a question"  # as above: u0 lacks 98.5 of its 482.5 tokens
    r = fleet(2, policy="prefix")
    blocks = index(r).hashes(text)
    held = PrefixBlocks(1, 0, 1, True, tuple(blocks), (), 512)

    def report(seq: int) -> None:
        metrics = {"prefill_queue_tokens": 400.0, "prefill_tokens_per_s": 20_000.0}
        r.apply_report("u0", LoadReport("u0", UnitState.SERVING, 40, 64, seq=seq,
                                        named_metrics=metrics, prefix_blocks=held))  # fmt: skip
        idle = {"prefill_queue_tokens": 200.0, "prefill_tokens_per_s": 20_000.0}
        r.apply_report(
            "u1", LoadReport("u1", UnitState.SERVING, 1, 64, seq=seq, named_metrics=idle)
        )

    async def choose() -> str:
        return (await r.acquire(want=Want(None, blocks, len(text)))).id

    report(11)
    # 400 + 98.5, then 400 + 98.5 + 98.5, are no more than u1's 200 + 482.5; with the
    # two sent since its report u0's queue is 597, and 597 + 98.5 is more
    assert [await choose() for _ in range(3)] == ["u0", "u0", "u1"]
    assert isinstance(r.policy, PrefixAffinity)
    assert r.policy.budget.sent == pytest.approx({"u0": 197, "u1": 482.5})
    report(12)  # each unit's next report counts what it was sent (as its queue)
    assert r.policy.budget.sent == {}


async def test_weighed_what_a_holder_was_sent_stops_counting_once_it_holds_no_request() -> None:
    # u0 holds the prompt's prefix and prefills 20 times slower than u1 (rates measured
    # on few prompts are rough): it keeps the prefix only while nothing waits there
    text = system(3) + "a question"  # u0 lacks 98.5 of its 482.5 tokens
    r = fleet(2, policy="prefix")
    assert isinstance(r.policy, PrefixAffinity)
    blocks = index(r).hashes(text)
    held = PrefixBlocks(1, 0, 1, True, tuple(blocks), (), 512)

    def report(unit_id: str, seq: int, outstanding: int, queued: float, rate: float) -> None:
        metrics = {"prefill_queue_tokens": queued, "prefill_tokens_per_s": rate}
        r.apply_report(unit_id, LoadReport(
            unit_id, UnitState.SERVING, outstanding, 64, seq=seq, named_metrics=metrics,
            prefix_blocks=held if unit_id == "u0" else None,
            watcher_outstanding=outstanding,  # every request there is this gateway's
        ))  # fmt: skip

    want = Want(None, blocks, len(text))
    report("u0", 11, 0, 0.0, 1_000.0)
    report("u1", 11, 0, 0.0, 20_000.0)
    # one request after another, each ended before the units' next report: what was
    # sent u0 is not queued there once it ended (it would be 98.5 + 98.5 tokens at
    # 1,000/s against 482.5 at 20,000/s at u1)
    for _ in range(3):
        chosen = await r.acquire(want=want)
        assert chosen.id == "u0"
        assert r.policy.budget.sent == {"u0": pytest.approx(98.5)}, "queued there meanwhile"
        r.release(chosen, Outcome.OK)
        assert r.policy.budget.sent == {}
    # a report taken while this gateway's request waited there, read after it ended:
    # the unit holds no request, so nothing waits
    chosen = await r.acquire(want=want)
    report("u0", 12, 1, 98.5, 1_000.0)
    r.release(chosen, Outcome.OK)
    assert r.policy.budget.queued(chosen) == 0
    assert (await r.acquire(want=want)).id == "u0"
    # while it holds one, its queue and what was sent it since count, and u1 starts
    # the request sooner
    report("u0", 13, 1, 98.5, 1_000.0)
    assert r.policy.budget.queued(chosen) == pytest.approx(98.5)
    assert (await r.acquire(want=want)).id == "u1"


def slotted(id: str, outstanding: int, slots: float, capacity: int = 64) -> Unit:
    u = Unit(id, f"http://{id}:1", f"{id}:2")
    named = {"engine_slots": slots}
    u.apply(
        LoadReport(id, UnitState.SERVING, outstanding, capacity, seq=1, named_metrics=named), 0.0
    )
    return u


def test_a_holder_with_a_free_engine_slot_takes_the_request_above_the_bound() -> None:
    # mean 0.05: the bound over the mean is 1.1 x 0.05 x 64 = 3.5 requests, + slack 1
    least, mean = unit("c", 0), 0.05
    free = slotted("a", 10, slots=16)  # 10 + 1 > 4.5, but 11 <= 16: a slot is free for it
    assert prefix_affinity(least, [[free]], CORRECTED, mean, 0.1, 1, None, True) is free
    assert prefix_affinity(least, [[free]], CORRECTED, mean, 0.1, 1) is least, "off: the bound"
    # the request would wait for a slot: the bound over the mean decides (lor here)
    full = slotted("b", 16, slots=16)  # 17 > 16
    assert prefix_affinity(least, [[full]], CORRECTED, mean, 0.1, 1, None, True) is least
    assert (
        prefix_affinity(least, [[slotted("e", 15, 16)]], CORRECTED, mean, 0.1, 1, None, True).id
        == "e"
    )
    # a unit that reports no slots has none free
    assert prefix_affinity(least, [[unit("d", 10)]], CORRECTED, mean, 0.1, 1, None, True) is least
    # the longest match's holder is full: the next shorter match's, which has a slot
    assert prefix_affinity(least, [[full], [free]], CORRECTED, mean, 0.1, 1, None, True) is free
    # where the TTFT budget says no, a free slot does not override it
    never = Budget(ttft_s=0.5, rate=1.0)
    behind = Unit("q", "http://q:1", "q:2")
    named = {"engine_slots": 16.0, "prefill_queue_tokens": 5000.0, "prefill_tokens_per_s": 4000.0}
    behind.apply(LoadReport("q", UnitState.SERVING, 10, 64, seq=1, named_metrics=named), 0.0)
    assert never.fits(behind) == 0
    assert prefix_affinity(least, [[behind]], CORRECTED, mean, 0.1, 1, never.fits, True) is least


async def test_the_router_keeps_a_prefix_on_its_holder_while_it_has_a_free_slot() -> None:
    text = system(4) + "a question"
    for free_slots, slots, goes_to in [(True, 16.0, "u0"), (False, 16.0, "u1"), (True, 8.0, "u1")]:
        r = fleet(2, policy="prefix", prefix_free_slots=free_slots)
        blocks = index(r).hashes(text)
        held = PrefixBlocks(1, 0, 1, True, tuple(blocks), (), 512)
        # u0 holds the prompt's prefix (its engine says so): 8 running of its slots, u1 idle,
        # so u0 is far above the bound over the mean (1.1 x 9 / 128 x 64 + 1 = 5.95)
        report = LoadReport("u0", UnitState.SERVING, 8, 64, seq=11,
                            named_metrics={"engine_slots": slots}, prefix_blocks=held)  # fmt: skip
        r.apply_report("u0", report)
        chosen = await r.acquire(want=Want(None, blocks, len(text)))
        assert chosen.id == goes_to, (free_slots, slots)


async def test_a_saturated_fleet_keeps_a_prefix_on_its_holder_within_the_looser_bound() -> None:
    text = system(4) + "a question"
    # u0 holds the prefix with 20 outstanding of 16 slots; u1 has 14 outstanding. Mean
    # (20 + 14 + 1) / 128: the bound over it 1.1 x that x 64 + 1 = 20.25 requests, under
    # u0's 21; with prefix_saturated_balance 0.5, 1.5 x that x 64 + 1 = 27.25.
    cases = [  # (saturated balance, u1's slots, where the request goes)
        (0.0, 8.0, "u1"),  # off: the bound over the mean
        (0.5, 8.0, "u0"),  # u1 has no slot free either: the fleet is saturated
        (0.5, 16.0, "u1"),  # u1 starts it at once: not saturated, the usual bound
        (0.05, 8.0, "u1"),  # not above prefix_balance: the usual bound
    ]
    for saturated, slots, goes_to in cases:
        r = fleet(2, policy="prefix", prefix_saturated_balance=saturated)
        blocks = index(r).hashes(text)
        held = PrefixBlocks(1, 0, 1, True, tuple(blocks), (), 512)
        r.apply_report("u0", LoadReport("u0", UnitState.SERVING, 20, 64, seq=11,
                                        named_metrics={"engine_slots": 16.0},
                                        prefix_blocks=held))  # fmt: skip
        r.apply_report("u1", LoadReport("u1", UnitState.SERVING, 14, 64, seq=11,
                                        named_metrics={"engine_slots": slots}))  # fmt: skip
        chosen = await r.acquire(want=Want(None, blocks, len(text)))
        assert chosen.id == goes_to, (saturated, slots)

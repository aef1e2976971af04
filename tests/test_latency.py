"""Policy latency: the online TTFT model on injected time, the choice it makes in a
fleet of fast and slow units, shedding batch work past the objective, the prediction
error metric and the fleet's saturation; and the feed from real attempts through a
gateway to simulated units."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from proxy.errors import Overloaded
from proxy.gateway.core import MIN_TOKENS, per_token
from proxy.gateway.latency import WARM, Latencies, Regression, slot_wait
from proxy.gateway.policies.latency import DEFAULT_TOKENS, LeastPredictedTtft
from proxy.gateway.request import Want, grpc_want, json_want
from proxy.gateway.router import Outcome, Router
from proxy.load import LoadReport, UnitState
from proxy.metrics import GatewayMetrics
from proxy.pb.unitproxy.v1.inference_pb2 import GenerateRequest, SamplingParams
from proxy.settings import GatewaySettings, UnitTarget
from proxy.tenants import RANK
from tests.test_router import Clock

pytestmark = pytest.mark.timeout(60)


def true_ttft(a: float, b: float, c: float, ahead: float, chars: float) -> float:
    return a + b * ahead + c * chars / 1000


def test_the_model_converges_on_synthetic_observations() -> None:
    clock, rng = Clock(), random.Random(5)
    fit = Latencies(clock, half_life_s=60)
    for _ in range(300):
        clock.now += 0.05
        ahead, chars = rng.randrange(8), rng.randrange(100, 8000)
        noise = 1 + rng.uniform(-0.02, 0.02)
        fit.observe("u", ahead, chars, true_ttft(0.04, 0.03, 0.05, ahead, chars) * noise)
    for ahead, chars in [(0, 500), (3, 4000), (7, 7500)]:
        expected = true_ttft(0.04, 0.03, 0.05, ahead, chars)
        assert fit.predict("u", ahead, chars) == pytest.approx(expected, rel=0.05)


def test_the_model_forgets_by_time_and_learns_a_unit_that_slowed_down() -> None:
    clock, rng = Clock(), random.Random(6)
    fit = Latencies(clock, half_life_s=2)
    for _ in range(200):
        clock.now += 0.05
        ahead, chars = rng.randrange(8), rng.randrange(100, 8000)
        fit.observe("u", ahead, chars, true_ttft(0.04, 0.03, 0.05, ahead, chars))
    clock.now += 30  # much later, the unit is 4x slower
    for _ in range(60):
        clock.now += 0.5
        ahead, chars = rng.randrange(8), rng.randrange(100, 8000)
        fit.observe("u", ahead, chars, true_ttft(0.16, 0.12, 0.2, ahead, chars))
    assert fit.predict("u", 4, 2000) == pytest.approx(true_ttft(0.16, 0.12, 0.2, 4, 2000), 0.05)


def test_a_unit_has_no_prediction_before_it_is_warm() -> None:
    fit = Latencies(Clock(), half_life_s=60)
    for i in range(WARM - 1):
        fit.observe("u", i, 1000, 0.1)
    assert not fit.warm("u") and fit.predict("u", 0, 0) == -1.0
    fit.observe("u", 0, 1000, 0.1)
    assert fit.warm("u") and fit.predict("u", 0, 1000) >= 0.0


def test_the_covariance_does_not_wind_up_without_excitation() -> None:
    r = Regression(half_life_s=0.001)  # forgets as much as it may at every observation
    for i in range(5000):
        r.update(0.0, 0.0, 0.1, float(i))
    assert sum(r.p[i * 4] for i in range(3)) <= 1e6 + 1
    assert r.predict(0.0, 0.0) == pytest.approx(0.1)


def test_time_per_token_is_learnt_against_the_batch() -> None:
    clock, rng = Clock(), random.Random(7)
    fit = Latencies(clock, half_life_s=60)
    assert fit.predict_tpot("u", 3) == -1.0  # nothing learnt
    for _ in range(100):
        clock.now += 0.1
        ahead = rng.randrange(16)
        fit.observe_tpot("u", ahead, 0.01 + 0.002 * (ahead + 1))
    assert fit.predict_tpot("u", 9) == pytest.approx(0.01 + 0.002 * 10, rel=0.01)
    # Within 0.03 s per token the unit's batch may be (0.03 - 0.01) / 0.002 = 10.
    assert fit.holds("u", 0.0, 0.03, 64) == pytest.approx(10, rel=0.01)
    assert fit.holds("u", 0.0, 0.03, 8) == 8  # never above its capacity
    assert fit.holds("u", 0.0, 0.005, 8) == 0  # its fixed cost alone misses it
    assert fit.holds("u", 0.0, 0.0, 8) == 8  # no objective


def test_a_streams_time_per_token_is_taken_after_its_first() -> None:
    # First event 0.2 s after the request was sent, the last of 11 at 0.7 s: 0.05 s each.
    assert per_token(0.2, 0.7, 11) == pytest.approx(0.05)
    assert per_token(0.2, 0.7, MIN_TOKENS - 1) == -1.0  # too few to tell
    assert per_token(-1.0, 0.7, 11) == -1.0  # no first token


# -- the policy in a fleet ------------------------------------------------------------------

# Fast and slow units: (fixed, per request ahead, per 1000 prompt characters), in s.
SPEEDS = {"fast1": (0.03, 0.02, 0.02), "fast2": (0.03, 0.02, 0.02), "slow": (0.2, 0.15, 0.2)}


def fleet(**settings: Any) -> tuple[Router, Clock, GatewayMetrics]:
    clock = Clock()
    metrics = GatewayMetrics(CollectorRegistry())
    targets = [UnitTarget(id=u, http_url=f"http://{u}:1", grpc_target=f"{u}:2") for u in SPEEDS]
    # No bound on load unless a test sets one: the choices here are the predictions'.
    s = GatewaySettings(policy="latency", **{"latency_balance": 100.0, **settings})
    router = Router(s, targets, rng=random.Random(1), clock=clock, metrics=metrics)
    for u in SPEEDS:
        router.apply_report(u, LoadReport(u, UnitState.SERVING, 0, 8, seq=1))
    return router, clock, metrics


class Attempt:
    """An attempt as the model reads it: its first token's time once set (-1 before)."""

    def __init__(self, ttft_s: float = -1.0):
        self.ttft_s = ttft_s

    def first_token_s(self) -> float:
        return self.ttft_s


def answer(router: Router, unit_id: str, want: Want, ttft_s: float, tpot_s: float = -1.0) -> None:
    """One attempt sent to the unit and answered after ``ttft_s``, as the core reports it."""
    unit = router.units[unit_id]
    attempt = Attempt()
    sent = router.sent(unit, want, attempt)
    assert sent is not None
    attempt.ttft_s = ttft_s
    router.answered(unit, want, sent, True, tpot_s)


def serve(router: Router, clock: Clock, want: Want, hold: list[Any]) -> str:
    """One request as the core serves it: picked, its TTFT observed as the unit's speed
    gives it (from the requests it holds), kept there ``hold`` long."""
    unit = router.pick((), want)
    assert unit is not None
    attempt = Attempt()
    sent = router.sent(unit, want, attempt)
    assert sent is not None and sent.ahead == router.ahead(unit)
    a, b, c = SPEEDS[unit.id]
    attempt.ttft_s = true_ttft(a, b, c, sent.ahead, want.chars)
    router.answered(unit, want, sent, True)
    hold.append(unit)
    return unit.id


def learn(router: Router) -> None:
    """Every unit answers 30 requests, with 0 to 12 requests ahead and prompts of 200 to
    8000 characters, as its speed gives."""
    rng = random.Random(4)
    for u, (a, b, c) in SPEEDS.items():
        for _ in range(30):
            ahead, chars = rng.randrange(13), rng.randrange(200, 8000)
            policy = router.policy
            assert isinstance(policy, LeastPredictedTtft)
            policy.latencies.observe(u, ahead, chars, true_ttft(a, b, c, ahead, chars))


def test_the_policy_learns_then_picks_the_fast_units_in_a_heterogeneous_fleet() -> None:
    router, clock, _ = fleet()
    assert isinstance(router.policy, LeastPredictedTtft)
    rng, held, chosen = random.Random(2), [], []
    for _step in range(400):
        clock.now += 0.01
        chosen.append(serve(router, clock, Want(chars=rng.randrange(200, 4000)), held))
        while len(held) > 4:  # about 4 requests in the fleet at once
            router.release(held.pop(0), Outcome.OK)
    learnt = chosen[3 * WARM :]
    assert learnt.count("slow") <= len(learnt) * 0.02  # at 4 in flight a fast one is faster
    assert {"fast1", "fast2"} <= set(learnt)
    assert chosen[: 3 * WARM].count("slow") == WARM  # each unit was learnt first


def test_the_slow_unit_takes_what_the_fast_ones_would_start_later() -> None:
    router, clock, _ = fleet()
    held: list[Any] = []
    learn(router)
    # Load the fast units: 8 requests each ahead would cost 0.03 + 0.02 * 8 + 0.02 =
    # 0.21 s against the idle slow unit's 0.2 + 0.2 = 0.4 s; at 20 ahead, 0.45 s.
    chosen = [serve(router, clock, Want(chars=1000), held) for _ in range(14)]
    assert "slow" not in chosen
    for u in ("fast1", "fast2"):  # as if reported: each holds 7 (capacity 8)
        router.apply_report(u, LoadReport(u, UnitState.SERVING, 7, 8, seq=2))
    assert router.pick((), Want(chars=1000)).id in ("fast1", "fast2")  # type: ignore[union-attr]
    router.apply_report("slow", LoadReport("slow", UnitState.SERVING, 0, 30, seq=2))
    for u in ("fast1", "fast2"):
        router.apply_report(u, LoadReport(u, UnitState.SERVING, 20, 30, seq=3))
    assert router.pick((), Want(chars=1000)).id == "slow"  # type: ignore[union-attr]


def test_a_cached_prefix_counts_for_the_prefill_it_saves() -> None:
    router, clock, _ = fleet()
    policy = router.policy
    assert isinstance(policy, LeastPredictedTtft)
    learn(router)
    text = "x" * 40000
    want = Want(blocks=policy.prompt_blocks(text), chars=len(text))
    first = serve(router, clock, want, [])  # a fast unit; it holds the prompt once answered
    assert first in ("fast1", "fast2")
    other = "fast2" if first == "fast1" else "fast1"
    # The other fast unit is idle, the first holds one request; the first is still
    # predicted faster: 0.02 s for one ahead against 0.8 s of prefill it does not need.
    assert router.pick((), want).id == first  # type: ignore[union-attr]
    assert policy.uncached(router.units[other], want) == len(text)
    assert policy.uncached(router.units[first], want) < len(text) * 0.05


def test_a_unit_past_the_load_bound_is_not_taken_however_fast_it_is_predicted() -> None:
    router, _, _ = fleet(latency_balance=0.1, prefix_slack=1)
    learn(router)
    held: list[Any] = []
    chosen = [serve(router, Clock(), Want(chars=1000), held) for _ in range(12)]
    # The mean load with the request is n / 24: a unit of capacity 8 takes it while its
    # own + 1 <= 1.1 x 8 x (n + 1) / 24 + 1, so the slow unit takes its share early.
    assert chosen.count("slow") >= 2
    # None above 1.1 x the mean load of 12 / 24 x its capacity 8, plus 1: 5.4.
    assert max(router.units[u].inflight for u in SPEEDS) == 5
    assert "slow" not in chosen[:4]  # the fast units first, while within the bound
    # The default bound, 1: twice the mean plus 1. The fast units take more of the 12.
    router, _, _ = fleet(latency_balance=GatewaySettings().latency_balance, prefix_slack=1)
    learn(router)
    held = []
    looser = [serve(router, Clock(), Want(chars=1000), held) for _ in range(12)]
    assert looser.count("slow") < chosen.count("slow")


def test_batch_is_shed_when_no_unit_meets_its_objective_and_the_others_are_not() -> None:
    router, _, _ = fleet(slo_ttft_s=0.5, slo_ttft_batch_s=0.25)
    learn(router)
    # Idle fast units: 0.05 s predicted; every class goes.
    assert router.pick((), Want(chars=1000, rank=RANK["batch"])) is not None
    for u in SPEEDS:  # each holds 11: fast 0.03 + 0.22 + 0.02 = 0.27 s, slow 1.05 s
        router.apply_report(u, LoadReport(u, UnitState.SERVING, 11, 30, seq=5))
    with pytest.raises(Overloaded) as shed:
        router.pick((), Want(chars=1000, rank=RANK["batch"]))
    assert shed.value.code == "shed" and shed.value.http_status == 429
    for priority in ("standard", "interactive"):
        unit = router.pick((), Want(chars=1000, rank=RANK[priority]))
        assert unit is not None and unit.id != "slow"


async def test_a_shed_batch_request_leaves_the_router_as_429_shed() -> None:
    router, _, _ = fleet(slo_ttft_s=0.1)
    learn(router)
    for u in SPEEDS:
        router.apply_report(u, LoadReport(u, UnitState.SERVING, 6, 30, seq=5))
    with pytest.raises(Overloaded) as shed:
        await router.acquire((), Want(chars=1000, rank=RANK["batch"]))
    assert shed.value.code == "shed"
    assert (await router.acquire((), Want(chars=1000))).id != "slow"


def test_units_within_the_tpot_objective_come_first_and_batch_is_shed_without_one() -> None:
    router, _, _ = fleet(slo_tpot_s=0.03)
    learn(router)
    policy = router.policy
    assert isinstance(policy, LeastPredictedTtft)
    for u, (d, e) in {
        "fast1": (0.01, 0.004),
        "fast2": (0.01, 0.004),
        "slow": (0.02, 0.0005),
    }.items():
        for ahead in range(12):
            policy.latencies.observe_tpot(u, ahead, d + e * (ahead + 1))
    # Idle: every unit streams within 0.03 s; the fast ones start sooner.
    assert router.pick((), Want(chars=1000)).id != "slow"  # type: ignore[union-attr]
    # With 6 ahead a fast unit's batch of 7 streams at 0.038 s, the slow one's at 0.024 s:
    # the slow unit, though it starts later.
    for u in SPEEDS:
        router.apply_report(u, LoadReport(u, UnitState.SERVING, 6, 30, seq=5))
    assert router.pick((), Want(chars=1000)).id == "slow"  # type: ignore[union-attr]
    router.apply_report("slow", LoadReport("slow", UnitState.SERVING, 25, 30, seq=6))
    assert router.pick((), Want(chars=1000)).id != "slow"  # type: ignore[union-attr]
    with pytest.raises(Overloaded) as shed:  # none streams within 0.03 s
        router.pick((), Want(chars=1000, rank=RANK["batch"]))
    assert shed.value.code == "shed" and "per token" in shed.value.message
    # The saturation counts what each holds within both objectives: fast (0.03 - 0.01) /
    # 0.004 = 5, slow (0.03 - 0.02) / 0.0005 = 20, under TTFT's no objective: capacity.
    assert router.policy.limit(router.units["fast1"]) == pytest.approx(5, rel=0.02)
    assert router.policy.limit(router.units["slow"]) == pytest.approx(20, rel=0.02)


def test_the_prediction_error_is_a_metric() -> None:
    router, clock, metrics = fleet()
    rng, held = random.Random(3), []
    for _ in range(200):
        clock.now += 0.01
        serve(router, clock, Want(chars=rng.randrange(200, 4000)), held)
        while len(held) > 3:
            router.release(held.pop(0), Outcome.OK)
    samples = {
        s.name: s.value
        for m in metrics.prediction_error.collect()
        for s in m.samples
        if s.name.endswith(("_count", "_bucket")) and s.labels.get("le") in (None, "0.05")
    }
    count = samples["unitproxy_latency_prediction_error_ratio_count"]
    assert count == 200 - 3 * WARM  # one per observation of a learnt unit
    # Noiseless linear units: nearly every prediction within 5 % once learnt.
    assert samples["unitproxy_latency_prediction_error_ratio_bucket"] >= count * 0.9


def test_fleet_saturation_is_load_over_what_meets_the_objective() -> None:
    router, _, metrics = fleet()  # no objective: outstanding / capacity
    for u, n in (("fast1", 4), ("fast2", 2), ("slow", 2)):
        router.apply_report(u, LoadReport(u, UnitState.SERVING, n, 8, seq=2))
    assert router.saturation() == pytest.approx(8 / 24)
    gauge = next(iter(metrics.fleet_saturation.collect())).samples[0]
    assert gauge.name == "unitproxy_fleet_saturation" and gauge.value == pytest.approx(8 / 24)

    router, _, metrics = fleet(slo_ttft_s=0.2)
    learn(router)
    # Within 0.2 s a fast unit holds those ahead, (0.2 - 0.03 - 0.02 x the mean prompt's
    # kchars) / 0.02, and the one arriving; the slow one none (0.2 alone is its fixed cost).
    policy = router.policy
    assert isinstance(policy, LeastPredictedTtft)
    kchars = policy.latencies.mean_kchars
    assert 0.2 < kchars < 8
    holds = (0.2 - 0.03 - 0.02 * kchars) / 0.02 + 1
    for u, n in (("fast1", 4), ("fast2", 4), ("slow", 4)):
        router.apply_report(u, LoadReport(u, UnitState.SERVING, n, 8, seq=2))
    assert policy.limit(router.units["slow"]) == 0.0
    assert policy.limit(router.units["fast1"]) == pytest.approx(holds, rel=0.02)
    assert router.saturation() == pytest.approx(12 / (2 * holds), rel=0.02)
    assert router.saturation() > 12 / 24  # more than outstanding / capacity
    router.apply_report("slow", LoadReport("slow", UnitState.NOT_SERVING, 4, 8, seq=3))
    assert router.saturation() == pytest.approx(8 / (2 * holds), rel=0.02)  # SERVING only


def test_the_default_policy_learns_nothing() -> None:
    router = Router(GatewaySettings())
    assert router.policy.learns is False and router.learns is False


# -- through a gateway, to simulated units ---------------------------------------------------


async def test_real_attempts_feed_the_model_and_the_fast_unit_is_chosen(
    start_sidecar: Any, start_gateway: Any, http: aiohttp.ClientSession
) -> None:
    """Two sim units, one of them 20x slower to prefill: every answered stream's TTFT
    reaches the policy (through the core and the router), and once both are learnt the
    requests go to the fast one."""
    fast = await start_sidecar(sidecar={"unit_id": "fast"}, sim={"prefill_ms_per_token": 0.01})
    slow = await start_sidecar(sidecar={"unit_id": "slow"}, sim={"prefill_ms_per_token": 0.2})
    gw = await start_gateway([fast, slow], policy="latency")
    policy = gw.router.policy
    assert isinstance(policy, LeastPredictedTtft)
    url = f"{gw.http_url}/v1/completions"
    units = []
    for i in range(2 * WARM + 10):
        body = {"prompt": f"{i} " + "word " * 300, "max_tokens": 6, "stream": True}
        async with http.post(url, json=body) as resp:
            assert resp.status == 200
            await resp.read()
            units.append(resp.headers["x-unitproxy-unit"])
        await asyncio.sleep(0)
    fits = policy.latencies.units
    assert fits["fast"].n + fits["slow"].n == len(units)  # one observation per attempt
    assert fits["fast"].warm and fits["slow"].warm
    tpot = policy.latencies.tpot  # each stream's time per token too
    assert tpot["fast"].n + tpot["slow"].n == len(units)
    assert units[2 * WARM :] == ["fast"] * 10
    assert policy.latencies.predict("slow", 0, 1500) > policy.latencies.predict("fast", 0, 1500)


async def test_a_batch_tenants_request_is_shed_429_when_no_unit_meets_its_objective(
    start_sidecar: Any, start_gateway: Any, http: aiohttp.ClientSession, tmp_path: Any
) -> None:
    """The priority class comes from the tenant (or the request lowering its own): once
    the units are learnt, a batch request that no unit is predicted to start within its
    objective (1 microsecond here: none can) is 429 shed; a standard one is served."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        '[[tenant]]\nname = "online"\nkeys = ["sk-online"]\n\n'
        '[[tenant]]\nname = "nightly"\nkeys = ["sk-nightly"]\npriority = "batch"\n'
    )
    a = await start_sidecar(sidecar={"unit_id": "a"})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    gw = await start_gateway(
        [a, b], policy="latency", slo_ttft_batch_s=1e-6, tenants_file=str(tenants)
    )
    url = f"{gw.http_url}/v1/completions"

    async def post(key: str, **headers: str) -> tuple[int, Any]:
        body = {"prompt": "hello there", "max_tokens": 4, "stream": True}
        auth = {"Authorization": f"Bearer {key}", **headers}
        async with http.post(url, json=body, headers=auth) as resp:
            return resp.status, await resp.read()

    for _ in range(2 * WARM):  # both units learnt
        status, _ = await post("sk-online")
        assert status == 200
    status, body = await post("sk-nightly")
    assert status == 429 and b'"shed"' in body
    status, body = await post("sk-online", **{"x-unitproxy-priority": "batch"})
    assert status == 429 and b'"shed"' in body
    assert (await post("sk-online"))[0] == 200


def test_the_model_learns_the_wait_for_a_slot_past_the_engines_slots() -> None:
    """An engine of 4 slots: below them a request ahead costs 10 ms a step, past them
    each waits 200 ms for a slot; the fit predicts both sides."""
    clock, rng = Clock(), random.Random(8)
    fit = Latencies(clock, half_life_s=60)

    def waiting(ahead: int) -> int:  # of the requests ahead and this one, for a slot
        return max(0, ahead + 1 - 4)

    def ttft(ahead: int) -> float:
        return 0.05 + 0.01 * ahead + 0.2 * waiting(ahead)

    for _ in range(300):
        clock.now += 0.05
        ahead = rng.randrange(12)
        fit.observe("u", ahead, 0, ttft(ahead), waiting(ahead))
    for ahead in (0, 2, 3, 6, 11):
        assert fit.predict("u", ahead, 0, waiting(ahead)) == pytest.approx(ttft(ahead), rel=0.02)
    # Within 0.5 s: 3 ahead (0.08 s) fits, 5 ahead (0.1 + 0.4 s) just does, 6 not.
    assert fit.holds("u", 0.5, 0.0, 64, slots=4) == pytest.approx(6, rel=0.02)


def test_prompts_sent_and_not_started_are_prefill_queued_before_the_next() -> None:
    """Each unit's ledger of attempts with no first token yet: their uncached prompts
    are prefill the engine does before a request sent now, so a unit given a long
    prompt a moment ago is predicted slower before anything is answered; a first token
    seen at a choice goes to the fit at once, and the attempt's end does not count it
    twice."""
    router, _, _ = fleet()
    policy = router.policy
    assert isinstance(policy, LeastPredictedTtft)
    learn(router)
    fast1, fast2 = router.units["fast1"], router.units["fast2"]
    long, short = Want(chars=40000), Want(chars=1000)
    unstarted = Attempt()
    sent = router.sent(fast1, long, unstarted)
    assert sent is not None and sent.prefill_chars == 40000 and sent.own_chars == 40000
    assert sent.predicted_s == pytest.approx(true_ttft(0.03, 0.02, 0.02, 0, 40000), rel=0.02)
    started = Attempt(0.05)  # fast2 holds one request too, whose first token came
    other = router.sent(fast2, short, started)
    assert other is not None
    # fast1: 0.03 + 0.02 x 1 ahead + 0.02 x 41 kchars = 0.87 s; fast2: 0.07 s.
    assert policy.predict(fast1, short, 1) == pytest.approx(0.87, rel=0.02)
    assert policy.predict(fast2, short, 1) == pytest.approx(0.07, rel=0.02)
    assert router.pick((), short) is fast2
    again = router.sent(fast1, short, Attempt())
    assert again is not None and again.prefill_chars == 41000  # behind the long prompt
    n = policy.latencies.units["fast1"].n
    unstarted.ttft_s = 0.85  # its first token came: out of the ledger, into the fit
    assert policy.scan("fast1")[0] == 1000 and policy.latencies.units["fast1"].n == n + 1
    router.answered(fast1, long, sent, True)
    assert policy.latencies.units["fast1"].n == n + 1  # once
    router.answered(fast1, short, again, False)  # failed: out of the ledger, nothing learnt
    assert policy.scan("fast1")[0] == 0 and policy.latencies.units["fast1"].n == n + 1


def test_the_engines_slots_are_the_units_own_figure_where_it_reports_one() -> None:
    router, _, _ = fleet()
    policy = router.policy
    assert isinstance(policy, LeastPredictedTtft)
    router.apply_report("fast1", LoadReport("fast1", UnitState.SERVING, 3, 8, running=3, seq=2))
    assert policy.slots["fast1"] == 3  # the most seen running, without a figure
    named = {"engine_slots": 16.0}
    report = LoadReport("fast1", UnitState.SERVING, 2, 64, running=2, seq=3, named_metrics=named)
    router.apply_report("fast1", report)
    assert policy.slots["fast1"] == 16


def test_the_wait_for_a_slot_is_when_the_running_requests_end() -> None:
    # 4 slots, 3 running with 0.5, 0.1 and 0.3 s of output left: one free slot.
    assert slot_wait([0.5, 0.1, 0.3], 0, 4, 0.2) == 0.0
    assert slot_wait([0.5, 0.1, 0.3], 1, 4, 0.2) == pytest.approx(0.1)  # it took the free one
    assert slot_wait([0.5, 0.1, 0.3], 3, 4, 0.2) == pytest.approx(0.5)
    assert slot_wait([0.5, 0.1, 0.3], 5, 4, 0.2) == pytest.approx(0.5 + 2 * 0.2)  # turnover
    assert slot_wait([0.5], 9, 0, 0.2) == 0.0  # slots not known: no wait reckoned


def test_the_policy_reckons_the_wait_from_the_output_each_running_request_has_left() -> None:
    """A unit of 2 slots (its engine_slots) runs two requests that asked for 100 and 10
    tokens, at 0.01 s a token: a request sent now waits for the shorter one to end; one
    sent behind another that has not started waits for the longer; the wait is what
    the fit sees, and the output a request asks for comes from its max_tokens."""
    router, clock, _ = fleet()
    policy = router.policy
    assert isinstance(policy, LeastPredictedTtft)
    named = {"engine_slots": 2.0}
    router.apply_report("fast1", LoadReport("fast1", UnitState.SERVING, 0, 8, seq=2,
                                            named_metrics=named))  # fmt: skip
    assert policy.slots["fast1"] == 2
    policy.mean_per_token_s = 0.01
    unit = router.units["fast1"]
    for tokens in (100, 10):
        sent = router.sent(unit, Want(chars=100, max_tokens=tokens), Attempt(0.02))
        assert sent is not None and sent.tokens == tokens
    assert policy.scan("fast1") == (0.0, pytest.approx(0.1))  # both started: 0.1 s left
    clock.now += 0.04
    assert policy.scan("fast1") == (0.0, pytest.approx(0.06))
    behind = router.sent(unit, Want(chars=300, max_tokens=5), Attempt())
    assert behind is not None and behind.wait == pytest.approx(0.06)
    assert policy.scan("fast1") == (300.0, pytest.approx(0.96))  # after the 100 tokens
    unit2 = router.units["fast2"]
    sent = router.sent(unit2, Want(chars=100), Attempt())  # no max_tokens: the mean
    assert sent is not None and DEFAULT_TOKENS > sent.tokens > 5


def test_a_requests_max_tokens_is_read_with_its_prompt_over_http_and_grpc() -> None:
    router, _, _ = fleet()
    read = router.policy.prompt_blocks
    body = b'{"prompt": "hello", "max_tokens": 40}'
    assert json_want(body, read).max_tokens == 40
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7}'
    assert json_want(chat, read).max_tokens == 7
    assert json_want(b'{"prompt": "hello"}', read).max_tokens == 0
    assert json_want(b'{"prompt": "x", "max_tokens": "many"}', read).max_tokens == 0
    asked = GenerateRequest(prompt="hello", sampling=SamplingParams(max_tokens=33))
    assert grpc_want(asked.SerializeToString(), read).max_tokens == 33
    assert grpc_want(GenerateRequest(prompt="hello").SerializeToString(), read).max_tokens == 0


def test_with_goodput_a_request_past_the_objective_everywhere_goes_to_the_slowest() -> None:
    """A TTFT objective of 0.25 s: with the fast units idle a request goes to one of
    them either way; once each holds 11 (fast 0.27 s, slow 1.05 s predicted: none meets
    it), the fastest takes it by default, the slowest with latency_goodput, leaving the
    fast units' queues to requests that can still meet it; batch is still shed."""
    for goodput, expected in ((False, {"fast1", "fast2"}), (True, {"slow"})):
        router, _, _ = fleet(slo_ttft_s=0.25, latency_goodput=goodput)
        learn(router)
        assert router.pick((), Want(chars=1000)).id in ("fast1", "fast2")  # type: ignore[union-attr]
        for u in SPEEDS:
            router.apply_report(u, LoadReport(u, UnitState.SERVING, 11, 30, seq=5))
        assert router.pick((), Want(chars=1000)).id in expected  # type: ignore[union-attr]
        with pytest.raises(Overloaded):
            router.pick((), Want(chars=1000, rank=RANK["batch"]))

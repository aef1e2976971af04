"""bench/routing's workloads: what shares a prefix does, and the same seed repeats; how
a run's imbalance is measured from its requests; and bench/prefix_cost.py's smoke run."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.routing import imbalance, report, workload  # noqa: E402
from engine.prefix_cache import PrefixCache  # noqa: E402
from engine.tokens import TokenCounter  # noqa: E402

sys.path.remove(str(ROOT))


def prompts(name: str, n: int, seed: int = 1) -> list[str]:
    source, rng = workload.WORKLOADS[name].source(), random.Random(seed)
    return [json.loads(source.draw(rng, i)[1])["prompt"] for i in range(n)]


def test_each_chat_turn_resends_the_history_of_its_conversation() -> None:
    drawn = prompts("chat", 600)
    extended = sum(
        any(later.startswith(earlier) for later in drawn[i + 1 :])
        for i, earlier in enumerate(drawn)
    )
    assert extended > 300  # most turns come back as the start of a later one
    assert all(p.startswith("<|system|>\n") and p.endswith("<|assistant|>\n") for p in drawn)


def test_agent_sessions_share_one_preamble_and_grow_by_tool_results() -> None:
    drawn = prompts("agent", 400)
    preamble = drawn[0].split("<|user|>")[0]
    assert len(preamble) > 2000 * 4  # 2k tokens of words of about 5 characters
    assert all(p.startswith(preamble) for p in drawn)  # every session opens with it
    extended = sum(
        any(later.startswith(earlier) for later in drawn[i + 1 :])
        for i, earlier in enumerate(drawn)
    )
    assert extended > 250  # most turns come back as the start of the session's next
    assert max(p.count("<|tool|>") for p in drawn) >= 10  # long sessions
    assert all(p.endswith("<|assistant|>\n") for p in drawn)


def test_a_ramp_says_each_policy_s_knee_ttft_p90_and_success() -> None:
    def row(
        policy: str, load: int, tok_s: float, ttfts: list[float], errors: int = 0
    ) -> report.RunMetrics:
        m = report.RunMetrics(policy, load, 1.0, 10.0, 10, 1.0, 1.0, None, None, {"1s": 1.0},
                              {"x": errors} if errors else {}, 0, {}, None)  # fmt: skip
        m.output_tok_s, m.ttfts_s = tok_s, ttfts
        return m

    rows = [
        row("prefix", 50, 500.0, [0.1] * 9 + [0.2]),
        row("prefix", 90, 900.0, [0.3] * 10),
        row("prefix-guess", 50, 480.0, [0.2] * 10),
        row("prefix-guess", 90, 600.0, [2.0] * 10, errors=1),
        row("sglang-router:cache_aware", 50, 450.0, [0.5] * 10),
        row("sglang-router:cache_aware", 90, 700.0, [math.inf] * 10),
    ]
    ramp = report.ramp(rows)
    assert ramp["prefix"]["knee_tok_s"] == 900.0 and ramp["prefix"]["knee_load_pct"] == 90
    assert ramp["prefix"]["ttft_p90_ms"] == 300.0 and ramp["prefix"]["success"] == 1.0
    assert ramp["prefix-guess"]["success"] == 19 / 20
    assert math.isinf(ramp["sglang-router:cache_aware"]["ttft_p90_ms"])
    goal = report.ramp_goal(ramp, ["sglang-router:cache_aware", "vllm-router:cache_aware"])
    assert goal["by"] == {"vs_guess": True, "vs_peers_tok_s": True, "vs_peers_ttft": True,
                          "success": True} and goal["met"]  # fmt: skip
    assert "1.50x (want >= 1.25x): MET" in goal["lines"][0]
    assert "tok/s@90%" in report.ramp_table(ramp)
    slower = report.ramp_goal(report.ramp(rows[:2] + rows[2:3]), [])
    assert slower["by"]["vs_guess"] and len(slower["lines"]) == 2
    replicas = [row(f"{r.policy}-2gw", r.load_pct, r.output_tok_s, r.ttfts_s) for r in rows[:4]]
    replicas.append(row("prefix-3gw", 50, 400.0, [0.1] * 10))  # no prefix-guess-3gw
    (two,) = report.replica_ramp_goals(report.ramp(rows + replicas))
    assert (
        "prefix-2gw output 900 tok/s at the knee vs prefix-guess-2gw 600: 1.50x" in two["lines"][0]
    )


def test_tenants_share_system_prompts_zipf_and_hot() -> None:
    def tenant_shares(name: str) -> list[float]:
        counts = Counter(p.split(":", 1)[0] for p in prompts(name, 4000))
        return [n / 4000 for _, n in counts.most_common()]

    zipf, hot = tenant_shares("tenants"), tenant_shares("tenants-hot")
    assert 0.12 < zipf[0] < 0.26 and zipf[0] > 1.5 * zipf[1]
    assert 0.45 < hot[0] < 0.55
    lengths = [len(p) for p in prompts("tenants", 50)]
    assert min(lengths) > 1000 * 4  # 1-4k tokens of words of about 5 characters


def test_the_same_seed_gives_the_same_requests() -> None:
    for name in workload.WORKLOADS:
        assert prompts(name, 50, seed=3) == prompts(name, 50, seed=3)
        assert prompts(name, 50, seed=3) != prompts(name, 50, seed=4)


def test_ideal_hit_rate_is_one_unbounded_cache_that_saw_every_prompt() -> None:
    # The simulator's own cache, large enough never to evict, fed every prompt in order.
    for name, low, high in (("chat", 0.1, 0.8), ("tenants", 0.3, 0.95), ("plain", 0.0, 0.0)):
        arrivals = workload.poisson_arrivals(workload.WORKLOADS[name], 20.0, 6.0, 1, 1000)
        cache, count = PrefixCache(16, capacity=10**9), TokenCounter()
        for arrival in arrivals:
            prompt = json.loads(arrival.body)["prompt"]
            cache.admit(cache.text_blocks(prompt), count(prompt))
        ideal = workload.ideal_hit_rate(arrivals)
        assert ideal == pytest.approx(cache.hit_rate)
        assert low <= ideal <= high, name


def test_ideal_hit_rate_counts_a_repeated_prompt_less_its_last_token() -> None:
    prompt = " ".join(["word"] * 64)  # 64 tokens: 4 blocks of 16
    body = json.dumps({"prompt": prompt}).encode()
    once = workload.Arrival(0, 0.0, workload.RequestSpec(64, 1), body)
    twice = [once, dataclasses.replace(once, index=1)]
    assert workload.ideal_hit_rate([once]) == 0.0
    assert workload.ideal_hit_rate(twice) == pytest.approx(63 / 128)
    later = [once, dataclasses.replace(once, index=1, at_s=5.0)]
    assert workload.ideal_hit_rate(later, from_s=5.0) == pytest.approx(63 / 64)  # the window
    assert workload.ideal_hit_rate([]) is None


def test_imbalance_weighs_every_change_by_its_duration() -> None:
    # Two units of capacity 4 and 2; busy from 2 requests a unit (4 in all).
    Span = imbalance.Span
    spans = [
        Span("a", 0.0, 10.0), Span("a", 0.0, 10.0), Span("a", 0.0, 10.0),
        Span("b", 0.0, 10.0),
        Span("a", 1.0, 2.0),  # [1, 2): a 4/4, b 1/2: max/mean 1.0 / 0.75
        Span("b", 5.0, math.inf),  # [5, 10): a 3/4, b 2/2: 1.0 / 0.875; never ended
        Span("zz", 0.0, 10.0),  # not a unit of the fleet
    ]  # fmt: skip
    # [0, 1) and [2, 5): a 3/4, b 1/2: 0.75 / 0.625; [10, 12): b alone, 1 < 4: not busy
    got = imbalance.measure(spans, {"a": 4, "b": 2}, 0.0, 12.0, busy_per_unit=2)
    assert got.changes == 4 and got.busy_s == pytest.approx(10.0)
    assert got.p50 == pytest.approx(1.0 / 0.875)  # 5 s of 10 at 1.14, 4 at 1.2, 1 at 1.33
    assert got.p99 == pytest.approx(1.0 / 0.75)
    # 4 requests spread as evenly as can be: 2/4 and 2/2 (1.33) or 3/4 and 1/2 (1.2);
    # 5: 3/4 and 2/2 (1.14), not 4/4 and 1/2 (1.33)
    assert got.ideal_p99 == pytest.approx(0.75 / 0.625)
    assert got.ideal_p50 == pytest.approx(1.0 / 0.875)
    # at the three instants a request reached a unit: 1.2 (t 0), 1.33 (t 1), 1.14 (t 5)
    assert got.at_arrivals_p99 == pytest.approx(1.0 / 0.75)
    # only the window counts: [5, 8) alone
    assert imbalance.measure(spans, {"a": 4, "b": 2}, 5.0, 8.0, 2).busy_s == pytest.approx(3.0)


def test_weighted_percentile() -> None:
    values = [(1.0, 98.0), (5.0, 1.5), (2.0, 0.5)]
    assert imbalance.weighted_percentile(values, 50) == 1.0
    assert imbalance.weighted_percentile(values, 99) == 5.0  # 98.5 of 100 at or below 2
    assert imbalance.weighted_percentile(values, 98) == 1.0
    assert imbalance.weighted_percentile([], 99) is None


@pytest.mark.timeout(120)
def test_prefix_cost_quick_mode_runs() -> None:
    root = Path(__file__).resolve().parent.parent
    argv = [sys.executable, "bench/prefix_cost.py", "--quick", "--chunk-chars", "256,512"]
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    # per workload and fleet size: lor, then prefix at each chunk size
    assert [r[2] for r in rows] == ["lor", "prefix", "prefix"] * 4
    assert all(float(r[-3]) > 0 for r in rows)  # µs per request
    assert all(float(r[-1]) > 0 for r in rows if r[2] == "prefix")  # blocks held


def test_prefix_bound_policies_name_their_gateway_flags() -> None:
    from bench.routing import run

    s = run.parse_settings(["--quick", "--policies", "lor,prefix-b0.3,prefix-b1-s0"])
    assert s.gateway_args("prefix-b0.3") == [
        "--policy", "prefix", "--prefix-balance", "0.3", "--prefix-slack", "1",
    ]  # fmt: skip
    assert s.gateway_args("prefix-b1-s0")[-4:] == ["--prefix-balance", "1", "--prefix-slack", "0"]
    assert s.gateway_args("lor") == ["--policy", "lor"]
    assert s.gateway_args("prefix-b0.5-s4-t1-slots")[2:] == [
        "--prefix-balance", "0.5", "--prefix-slack", "4", "--prefix-ttft", "1",
        "--prefix-free-slots", "true",
    ]  # fmt: skip
    assert s.gateway_args("prefix-slots") == ["--policy", "prefix", "--prefix-free-slots", "true"]
    assert s.gateway_args("prefix-sat0.5") == [
        "--policy", "prefix", "--prefix-saturated-balance", "0.5",
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        run.parse_settings(["--policies", "prefix-bhigh"])


def test_a_quick_run_through_prefix_measures_its_saturation_over_warm_caches() -> None:
    from bench.routing import run

    def window(*argv: str) -> float:
        return run.parse_settings(["--quick", "--workload", "b2b", *argv]).saturation_window_s

    assert window() == 4.0  # loads as % of lor's
    assert window("--load-reference", "prefix") == run.QUICK_PREFIX_WINDOW_S
    assert window("--load-reference", "prefix", "--saturation-window", "3") == 3.0
    assert run.parse_settings(["--workload", "b2b", "--load-reference", "prefix"]
                              ).saturation_window_s == 20.0  # fmt: skip


def test_the_latency_policies_name_their_objective_and_the_goodput_switch() -> None:
    from bench.routing import run
    from proxy.cli import build_parser

    s = run.parse_settings(["--quick", "--policies", "latency,latency-goodput", "--slo-ttft", "2"])
    assert s.gateway_args("latency") == ["--policy", "latency", "--slo-ttft", "2"]
    flags = s.gateway_args("latency-goodput")
    assert flags == ["--policy", "latency", "--slo-ttft", "2", "--latency-goodput", "true"]
    args = build_parser().parse_args(["gateway", *flags])  # flags the gateway takes
    assert getattr(args, "gateway.latency_goodput") == "true"


def test_the_deep_fleet_finishes_as_much_with_more_requests_outstanding() -> None:
    from bench.routing import fleet

    mixed, deep = fleet.fleet_specs(8, 1, "mixed"), fleet.fleet_specs(8, 1, "deep")
    for a, b in zip(mixed, deep, strict=True):
        assert b.slots == fleet.DEEP * a.slots and b.capacity == fleet.DEEP * a.capacity
        assert b.model_rate(2000, 50) == pytest.approx(a.model_rate(2000, 50))
        # a request holds its slot DEEP x as long: Little's law, DEEP x outstanding
        step_a = a.decode_step_ms + a.decode_ms_per_seq * a.slots
        step_b = b.decode_step_ms + b.decode_ms_per_seq * b.slots
        assert step_b == pytest.approx(fleet.DEEP * step_a)


def test_bursty_arrivals_alternate_between_40_and_110_percent_of_capacity() -> None:
    # Capacity 20 r/s: --loads 110 --burst-period 10 over 40 s: 8 r/s, 22 r/s, 8, 22.
    arrivals = workload.poisson_arrivals(
        workload.WORKLOADS["plain"], 22.0, 40.0, 1, 10_000, burst_period_s=10.0
    )
    per_phase = Counter(int(a.at_s // 10) for a in arrivals)
    assert [per_phase[i] for i in range(4)] == [80, 220, 80, 220]
    assert [a.at_s for a in arrivals] == sorted(a.at_s for a in arrivals)
    steady = workload.poisson_arrivals(workload.WORKLOADS["plain"], 22.0, 40.0, 1, 10_000)
    assert len(steady) == 880


def test_the_median_prediction_error_is_read_as_prometheus_reads_a_histogram() -> None:
    from bench.routing.run import bucket_quantile

    # 10 observations: 4 up to 0.05, 8 up to 0.1, all up to +Inf.
    buckets = {0.05: 4.0, 0.1: 8.0, math.inf: 10.0}
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.05 + 0.05 * (5 - 4) / (8 - 4))
    assert bucket_quantile(0.5, {}) is None
    assert bucket_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None

"""unitproxy plan: lengths, the virtual fleet (the sim's own step model), the search, the command."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import selectors
from pathlib import Path
from typing import Any

import pytest

from engine.base import EngineRequest, SamplingParams
from engine.settings import SimSettings
from engine.sim import SimEngine
from engine.sim_model import State, StepModel
from proxy import cli
from proxy.plan.fleet import FleetSim
from proxy.plan.planner import Objectives, percentile, plan, simulate
from proxy.plan.workload import (
    Exponential,
    Fixed,
    LogNormal,
    Request,
    Traffic,
    Uniform,
    parse_lengths,
)

pytestmark = pytest.mark.timeout(60)


def shape(**knobs: Any) -> SimSettings:
    base: dict[str, Any] = {"decode_step_ms": 10.0, "decode_ms_per_seq": 0.0,
                            "prefill_ms_per_token": 1.0, "max_num_batched_tokens": 0}  # fmt: skip
    return SimSettings(**(base | knobs))


# -- the step model's priority ------------------------------------------------------------


class _Seq:
    """A sequence as ``StepModel`` sees it, with its output counted by the test."""

    def __init__(self, prompt_tokens: int, priority: int) -> None:
        self.prompt_tokens, self.priority = prompt_tokens, priority
        self.completion_tokens = self.arrival = self.preempted = self.prefill_left = 0
        self.blocks: list[int] = []
        self.state: State = "waiting"


def test_a_higher_priority_preempts_the_latest_lowest_which_prefills_its_output_again() -> None:
    model: StepModel[_Seq] = StepModel(shape(max_num_seqs=2))
    early, late = _Seq(10, priority=2), _Seq(10, priority=2)
    model.add(early)
    model.add(late)
    assert model.plan_step() == pytest.approx(0.030)  # both prompts, one step
    for _ in range(3):
        assert model.plan_step() == pytest.approx(0.010)
        for seq in model.decoding:
            seq.completion_tokens += 1
    urgent = _Seq(5, priority=0)
    model.add(urgent)
    assert not model.steady(), "a slot is there for the taking"
    # the latest of the lowest class gives its slot; the urgent one prefills 5 tokens
    assert model.plan_step() == pytest.approx(0.015)
    assert model.preemptions == 1 and late.preempted == 1 and early.preempted == 0
    assert late.state == "waiting" and list(model.waiting) == [late]
    assert model.steady(), "nothing waiting outranks what runs"
    model.discard(urgent)
    # back in a slot, it prefills its prompt and its 3 tokens of output again
    assert model.plan_step() == pytest.approx(0.023)
    assert late.state == "running" and late in model.started


def test_the_queue_is_by_priority_then_arrival_and_one_priority_never_preempts() -> None:
    model: StepModel[_Seq] = StepModel(shape(max_num_seqs=1))
    first, second, third = _Seq(4, 1), _Seq(4, 1), _Seq(4, 0)
    for seq in (first, second):
        model.add(seq)
    model.plan_step()
    assert model.steady() and list(model.waiting) == [second]
    model.plan_step()
    assert model.preemptions == 0 and list(model.waiting) == [second]
    model.add(third)  # a higher priority jumps the queue and preempts
    model.plan_step()
    assert model.preemptions == 1 and [*model.prefilling, *model.decoding] == [third]
    assert list(model.waiting) == [first, second], "the preempted one heads its class"


# -- lengths ----------------------------------------------------------------------------


def test_lengths_are_a_number_or_a_distribution() -> None:
    assert parse_lengths("512") == Fixed(512)
    assert parse_lengths("uniform:10:20") == Uniform(10, 20)
    assert parse_lengths("lognormal:300:0.8") == LogNormal(300, 0.8)
    assert parse_lengths("lognormal:300:0.8:2000") == LogNormal(300, 0.8, 2000)
    assert parse_lengths("exponential:64") == Exponential(64)
    for bad in ("0", "-3", "uniform:20:10", "lognormal:300", "gamma:1:2", "abc", "uniform:a:b"):
        with pytest.raises(ValueError, match="want a number"):
            parse_lengths(bad)


def test_a_lognormal_has_the_mean_it_is_given() -> None:
    rng = random.Random(1)
    lengths = parse_lengths("lognormal:400:1")
    draws = [lengths.draw(rng) for _ in range(40_000)]
    assert 380 < sum(draws) / len(draws) < 420
    capped = parse_lengths("lognormal:400:1:1000")
    assert max(capped.draw(rng) for _ in range(10_000)) == 1000


def test_poisson_traffic_offers_its_rate() -> None:
    traffic = Traffic(10.0, 600.0, Fixed(100), Fixed(10)).requests(seed=3)
    assert 5700 < len(traffic) < 6300
    assert all(0 <= a.at_s < b.at_s < 600 for a, b in itertools.pairwise(traffic))
    assert traffic == Traffic(10.0, 600.0, Fixed(100), Fixed(10)).requests(seed=3)


# -- the virtual fleet --------------------------------------------------------------------


def test_one_request_takes_the_sims_step_times() -> None:
    # prefill 100 tokens at 1 ms + a 10 ms step, then 4 more steps of 10 ms
    outcome = FleetSim(shape(), units=1, capacity=8).run([Request(0.0, 100, 5)], 1.0)
    assert outcome.ttft_s == [pytest.approx(0.110)]
    assert outcome.tpot_s == [pytest.approx(0.010)]
    assert outcome.end_s == pytest.approx(0.150)


def test_a_busy_unit_takes_a_request_at_its_next_step_and_the_batch_slows_every_step() -> None:
    s = shape(decode_ms_per_seq=5.0, prefill_ms_per_token=0.0)
    # r0's first step: 10 + 5 ms; r1 arrives during it, joins at 15 ms; from then on
    # two sequences: 20 ms steps
    outcome = FleetSim(s, 1, 8).run([Request(0.0, 10, 3), Request(0.004, 10, 2)], 1.0)
    assert outcome.ttft_s == [pytest.approx(0.015), pytest.approx(0.035 - 0.004)]
    assert outcome.tpot_s == [pytest.approx(0.020), pytest.approx(0.020)]


def test_steps_that_cost_nothing_take_no_time() -> None:
    s = shape(decode_step_ms=0.0, prefill_ms_per_token=0.0)
    # capacity 1: the second waits in the gateway and is sent as a run of steps ends
    outcome = FleetSim(s, 1, 1).run([Request(0.0, 10, 50), Request(0.0, 10, 50)], 1.0)
    assert outcome.ttft_s == [0.0, 0.0] and outcome.end_s == 0.0


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    s = shape(max_num_batched_tokens=100)
    outcome = FleetSim(s, 1, 8).run([Request(0.0, 250, 1)], 1.0)
    # 100 + 100 + 50 tokens over three steps of 10 ms each plus their prefill
    assert outcome.ttft_s == [pytest.approx(0.100 + 0.100 + 0.050 + 0.030)]


def test_runs_of_same_steps_give_what_stepping_one_at_a_time_gives() -> None:
    s = SimSettings(max_num_seqs=8, max_num_batched_tokens=512)
    traffic = Traffic(30.0, 60.0, parse_lengths("lognormal:300:1"),
                      parse_lengths("uniform:1:60"), 0.5, 4).requests(seed=5)  # fmt: skip
    fast = FleetSim(s, 3, 16, seed=2).run(traffic, 60.0)
    slow = FleetSim(s, 3, 16, seed=2, runs=False).run(traffic, 60.0)
    assert fast.events < slow.events / 3  # the runs are what makes an hour take seconds
    assert sorted(fast.ttft_s) == pytest.approx(sorted(slow.ttft_s))
    assert sorted(fast.tpot_s) == pytest.approx(sorted(slow.tpot_s))
    assert fast.prefix_hit_rate == slow.prefix_hit_rate


def test_least_outstanding_spreads_requests_over_the_units() -> None:
    # Far more work than one unit can hold at once: a second unit halves the queue.
    traffic = [Request(i * 0.001, 50, 50) for i in range(64)]
    one = FleetSim(shape(max_num_seqs=4), 1, 64).run(traffic, 0.064)
    two = FleetSim(shape(max_num_seqs=4), 2, 64).run(traffic, 0.064)
    assert percentile(two.ttft_s, 99) < 0.6 * percentile(one.ttft_s, 99)  # type: ignore[operator]


def test_when_every_unit_is_full_the_gateway_queues() -> None:
    traffic = [Request(0.0, 10, 5), Request(0.0, 10, 5)]
    outcome = FleetSim(shape(), 1, capacity=1).run(traffic, 0.1)
    # the second waits in the gateway for the first to end: 5 steps, then its own first
    assert sorted(outcome.ttft_s) == [pytest.approx(0.020), pytest.approx(0.060 + 0.020)]


def test_a_shared_prefix_is_prefilled_once_per_unit() -> None:
    s = shape(prefill_ms_per_token=0.5, block_size=16)
    spaced = [i * 1.0 for i in range(20)]  # one at a time: TTFT is prefill + a step
    shared = [Request(t, 1024, 2, group=0, prefix_tokens=960) for t in spaced]
    alone = [Request(t, 1024, 2) for t in spaced]
    with_cache = FleetSim(s, 1, 8).run(shared, 20.0)
    without = FleetSim(s, 1, 8).run(alone, 20.0)
    assert with_cache.prefix_hit_rate is not None and with_cache.prefix_hit_rate > 0.85
    assert without.prefix_hit_rate is None
    assert percentile(with_cache.ttft_s, 50) == pytest.approx(0.010 + 64 * 0.0005)
    assert percentile(without.ttft_s, 50) == pytest.approx(0.010 + 1024 * 0.0005)


# -- the search -----------------------------------------------------------------------------


def test_the_plan_is_the_fewest_units_that_meet_the_objective() -> None:
    s = SimSettings()
    traffic = Traffic(30.0, 300.0, parse_lengths("lognormal:512:1:8192"),
                      parse_lengths("lognormal:128:0.8:1024")).requests(seed=1)  # fmt: skip
    objectives = Objectives(ttft_p99_s=0.5, tpot_p99_s=0.05)
    result = plan(s, 64, traffic, objectives, 300.0, max_units=64)
    tried = {t.units: t for t in result.trials}
    assert result.units is not None and result.units > 2
    assert tried[result.units].meets
    assert result.units - 1 in tried and not tried[result.units - 1].meets
    # doubling, then bisection: powers of two up to the first that meets
    doubled = [u for u in sorted(tried) if u & (u - 1) == 0]
    assert [t.units for t in result.trials][: len(doubled)] == doubled
    # the fleets past the answer are not needed; the fleet tried whole meets it whole
    whole = simulate(s, result.units - 1, 64, traffic, objectives, 300.0, stop_early=False)
    assert not whole.meets and not whole.stopped
    assert whole.ttft_p99_s is not None and whole.ttft_p99_s > 0.5


def test_no_fleet_up_to_the_limit_says_so() -> None:
    traffic = [Request(i * 0.001, 4000, 10) for i in range(200)]
    result = plan(shape(), 64, traffic, Objectives(0.01), 0.2, max_units=4)
    assert result.units is None
    assert [t.units for t in result.trials] == [1, 2, 4]


# -- the command ----------------------------------------------------------------------------


def test_plan_json_prints_one_object_with_units(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--rate", "20", "--duration", "300", "--prompt-tokens", "lognormal:512:1",
            "--output-tokens", "uniform:64:192", "--slo-ttft-p99", "0.5", "--slo-tpot-p99",
            "0.05", "--sim-decode-step-ms", "12", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data["units"], int) and data["units"] >= 2
    rows = {t["units"]: t for t in data["trials"]}
    assert rows[data["units"]]["meets"] and not rows[data["units"] - 1]["meets"]
    assert data["objectives"] == {"ttft_p99_s": 0.5, "tpot_p99_s": 0.05}


def test_plan_without_a_capacity_takes_the_sims_slots_as_a_unit_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--rate", "20", "--duration", "60", "--slo-ttft-p99", "0.5",
            "--sim-max-num-seqs", "4", "--json"]  # fmt: skip
    outputs = []
    for extra in ([], ["--capacity", "4"], ["--capacity", "64"]):
        assert cli.main([*argv, *extra]) == 0
        data = json.loads(capsys.readouterr().out)
        outputs.append([(t["units"], t["ttft_p99_s"]) for t in data["trials"]])
    assert outputs[0] == outputs[1], "no capacity: the engine's 4 slots"
    assert outputs[0] != outputs[2]


def test_plan_prints_the_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "plan.png"
    argv = ["plan", "--rate", "5", "--duration", "120", "--slo-ttft-p99", "1", "--plot",
            str(plot)]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "units   TTFT p50   TTFT p99   TPOT p50   TPOT p99  goodput/s  meets" in out
    assert "units: 1" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot: matplotlib is not installed" in out
        assert not plot.exists()
    else:
        assert plot.stat().st_size > 1000


def test_plan_reads_a_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [{"at_s": 100 + i * 0.05, "prompt_tokens": 300, "output_tokens": 40,
             "prefix_group": f"t{i % 3}", "prefix_tokens": 200} for i in range(2000)]  # fmt: skip
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    argv = ["plan", "--trace", str(trace), "--slo-ttft-p99", "0.2", "--json"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["requests"] == 2000 and data["duration_s"] == pytest.approx(99.95)
    best = next(t for t in data["trials"] if t["units"] == data["units"])
    assert best["prefix_hit_rate"] > 0.5


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--rate", "5"], "plan.slo_ttft_p99_s"),
        (["--slo-ttft-p99", "1"], "plan.rate_per_s"),
        (["--rate", "5", "--trace", "t.jsonl", "--slo-ttft-p99", "1"], "plan.rate_per_s"),
        (["--rate", "5", "--slo-ttft-p99", "1", "--prompt-tokens", "gamma:3"], "prompt_tokens"),
    ],
)
def test_plan_says_what_is_missing(
    argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", *argv]) == 2
    assert problem in capsys.readouterr().err


def test_a_bad_trace_line_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"at_s": 0, "prompt_tokens": 10, "output_tokens": 5}\n{"at_s": 1}\n')
    assert cli.main(["plan", "--trace", str(trace), "--slo-ttft-p99", "1"]) == 2
    assert f"{trace}:2" in capsys.readouterr().err


# -- the same model as the simulator ----------------------------------------------------------


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Waiting for a timer moves the loop's clock to it at once."""

    loop: VirtualTimeLoop

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        if timeout is not None and timeout > 0:
            self.loop.now += timeout
        return super().select(0)  # type: ignore[no-any-return]


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


def _on_sim_engine(s: SimSettings, traffic: list[Request]) -> tuple[list[float], list[float]]:
    """TTFT and TPOT of each request through a real SimEngine, on virtual time."""

    async def one(engine: SimEngine, index: int, r: Request) -> tuple[float, float | None]:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(r.at_s - loop.time())
        shared = [r.group * 100_000 + k for k in range(r.prefix_tokens)]
        own = [10_000_000 + index * 10_000 + k for k in range(r.prompt_tokens - len(shared))]
        request = EngineRequest(f"r{index}", prompt_token_ids=tuple(shared + own),
                                sampling=SamplingParams(max_tokens=r.output_tokens))  # fmt: skip
        first = last = -1.0
        async for _ in engine.generate(request):
            last = loop.time()
            first = last if first < 0 else first
        tpot = (last - first) / (r.output_tokens - 1) if r.output_tokens > 1 else None
        return first - r.at_s, tpot

    async def main() -> list[tuple[float, float | None]]:
        engine = SimEngine(s)
        await engine.start()
        try:
            return await asyncio.gather(*(one(engine, i, r) for i, r in enumerate(traffic)))
        finally:
            await engine.stop()

    loop = VirtualTimeLoop()
    try:
        results = loop.run_until_complete(main())
    finally:
        loop.close()
    return [t for t, _ in results], [p for _, p in results if p is not None]


@pytest.mark.parametrize("rate", [3.0, 12.0])  # free slots mostly; a queue at times
def test_one_planned_unit_gives_the_sim_engines_own_times(rate: float) -> None:
    # The simulator itself, stepping on a virtual clock, against the planner's one unit:
    # slots, the queue, chunked prefill, the prefix cache and step times all agree.
    s = SimSettings(max_num_seqs=6, max_num_batched_tokens=700, decode_step_ms=20.0,
                    decode_ms_per_seq=1.5, prefill_ms_per_token=0.2, prefix_cache_blocks=60,
                    block_size=16)  # fmt: skip
    traffic = Traffic(rate, 20.0, parse_lengths("lognormal:400:0.8:2000"),
                      parse_lengths("uniform:1:40"), 0.6, 3).requests(seed=9)  # fmt: skip
    ttft, tpot = _on_sim_engine(s, traffic)
    planned = FleetSim(s, 1, 10_000).run(traffic, 20.0)
    assert len(traffic) > 40
    assert sorted(planned.ttft_s) == pytest.approx(sorted(ttft), abs=1e-9)
    assert sorted(planned.tpot_s) == pytest.approx(sorted(tpot), abs=1e-9)

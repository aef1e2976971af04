"""bench/scale's quick mode runs end to end, so it never breaks unseen."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_run_measures_every_cell(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    argv = [sys.executable, "-m", "bench.scale.run", "--quick", "--sizes", "30",
            "--sources", "watch,watch-grpc,watch-http,poll,redis", "--policies", "lor,p2c,no-such-policy",
            "--window", "1.5", "--request-window", "1", "--out", str(out)]  # fmt: skip
    # 30 units on a budget of 60 reports/s: each asked for one every 0.5 s.
    env = {**os.environ, "UNITPROXY_GATEWAY__REPORT_BUDGET_PER_S": "60"}
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=220, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    cells = result["cells"]
    assert [(c["units"], c["source"]) for c in cells] == [
        (30, s) for s in ("watch", "watch-grpc", "watch-http", "poll", "redis")
    ]
    for cell in cells:
        assert "error" not in cell, cell
        # the gateway's CPU comes in clock ticks of 10 ms: a light source (poll) in a
        # window this short may read none
        assert cell["reports_per_s"] > 0 and cell["us_per_report"] >= 0, cell
        assert cell["report_age_p99_s"] < 5, cell  # every unit's view stayed fresh
        assert not cell["gateway_problems"], cell
        if cell["source"] != "redis":  # the gateway's budget held (Redis: units decide)
            assert cell["reports_per_s"] < 60 * 1.3, cell
    watch = [c for c in cells if c["source"] == "watch"]
    for cell in watch:
        assert cell["through"]["requests"] > 0 and cell["through"]["errors"] == 0, cell
        assert cell["direct"]["requests"] > 0 and cell["direct"]["errors"] == 0, cell
        assert len(cell["added_ttft_p50_ms_by_round"]) == 2, cell  # quick: 2 rounds
    selection = {(r["policy"], r["units"]): r["us_per_request"] for r in result["selection"]}
    assert selection["no-such-policy", 30] is None
    assert selection["lor", 30] > 0 and selection["p2c", 30] > 0
    assert "goals:" in done.stdout


def emulated_fleet(*argv: str) -> Any:
    from bench.scale import fleet

    return fleet.Fleet(fleet.parse_args(["--ready-file", "unused", *argv]))


def test_the_lazy_load_model_draws_the_queue_s_transient() -> None:
    # From x0 requests, after dt: Binomial(x0, p) + Poisson(lambda/mu (1 - p)), p = e^-mu dt;
    # a capacity far above the mean, so that the clipping takes nothing off.
    f = emulated_fleet("--units", "1", "--capacity", "400", "--utilization", "0.1")
    lam, mu = f.arrival_rate[0], f.finish_rate[0]
    for dt in (0.05, 0.5, 5.0):
        p = math.exp(-mu * dt)
        mean = 60 * p + lam / mu * (1 - p)
        variance = 60 * p * (1 - p) + lam / mu * (1 - p)
        draws = []
        for _ in range(20_000):
            f.outstanding[0], f.drawn_at[0] = 60, 0.0
            draws.append(f.draw(0, dt))
        assert statistics.fmean(draws) == pytest.approx(mean, rel=0.02), dt
        assert statistics.variance(draws) == pytest.approx(variance, rel=0.1), dt


def test_the_lazy_load_model_stays_within_capacity_and_schedules_one_change() -> None:
    f = emulated_fleet("--units", "3", "--capacity", "8", "--utilization", "1.5")
    now = f.clock()
    assert all(0 <= f.draw(i, now + 10.0) <= 8 for i in range(3) for _ in range(100))
    unit = f.units[1]
    seen = unit.changes.version
    unit.report()
    unit.report()  # a change is scheduled already: not another
    assert len(f._scheduled) == 1 and f.stats["draws"] >= 1
    f.notify_due(now)  # not due yet (an exponential wait from the report)
    assert unit.changes.version == seen
    f.notify_due(now + 3600.0)
    assert unit.changes.version == seen + 1 and f.stats["changes"] == 1 and not f._scheduled


def test_the_redis_publisher_s_schedule_follows_the_asked_interval() -> None:
    from bench.scale.fleet import RedisSchedule

    schedule = RedisSchedule(3, interval_s=1.0)
    assert sorted(schedule.due(0.5)) == [0, 1, 2]  # every unit's first report at once
    schedule.changed(0)
    assert schedule.due(0.6) == [0]  # nothing asked: a change goes out at the next tick
    assert schedule.due(1.4) == []
    schedule.ask(2.0)  # the gateways ask for a report every 2 s: heartbeats move too
    schedule.changed(1)  # folds into its report 2 s after the last, at 2.5
    assert schedule.due(2.4) == []
    assert sorted(schedule.due(2.5)) == [1, 2]  # unit 1's change, unit 2's heartbeat
    assert schedule.due(2.6) == [0]
    schedule.changed(2)
    schedule.changed(2)  # one report for both
    assert sorted(schedule.due(4.5)) == [1, 2]  # unit 2 once, unit 1 its heartbeat


def test_emulated_units_report_their_prefix_blocks_as_a_sidecar_s_change_stream() -> None:
    f = emulated_fleet("--units", "2", "--chunks-per-request", "10", "--held-blocks", "64")
    unit = f.units[0]
    first = unit.report()
    assert first.prefix_blocks is not None and first.prefix_blocks.full
    assert len(first.prefix_blocks.added) == 64  # starts full
    f.arrival_rate[0] = 300.0  # a few requests (fewer chunks than held), 10 chunks each
    f.drawn_at[0] = unit.blocks_at = unit.blocks_at - 0.01
    later = unit.report((first.prefix_blocks.epoch, first.prefix_blocks.seq))
    blocks = later.prefix_blocks
    assert blocks is not None and not blocks.full and blocks.from_seq == first.prefix_blocks.seq
    # each chunk stored past the bound evicts the oldest: as many removed as added
    assert len(blocks.added) == len(blocks.removed) > 0
    assert set(blocks.removed) <= set(first.prefix_blocks.added)
    assert emulated_fleet("--units", "1").units[0].report().prefix_blocks is None
    # More stores than the set holds: a reader from before gets the whole new set.
    held = unit.held
    assert held is not None
    at = held.seq
    held.store(f.rng, 200)
    assert held.seq == at + 2 * 200 and len(held) == 64
    again = held.delta(blocks.epoch, at)
    assert again.full and not set(again.added) & set(blocks.added)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_quick_run_with_prefix_blocks_says_their_bytes_per_unit(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    argv = [sys.executable, "-m", "bench.scale.run", "--quick", "--sizes", "30",
            "--sources", "watch,redis", "--request-sources", "none", "--policies", "prefix",
            "--window", "1.5", "--chunks-per-request", "10", "--held-blocks", "128",
            "--out", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    cells = json.loads(out.read_text())["cells"]
    assert [c["source"] for c in cells] == ["watch", "redis"]
    for cell in cells:
        assert "error" not in cell and not cell["gateway_problems"], cell
        assert cell["chunks_per_request"] == 10 and cell["held_blocks"] == 128, cell
        assert cell["bytes_per_unit_s"] > 0 and cell["reports_per_s"] > 0, cell
    assert "prefix blocks reported: 10 chunks stored per request" in done.stdout

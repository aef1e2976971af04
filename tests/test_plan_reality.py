"""The planner against a real sim fleet: the count it gives meets the objective on real
processes, and one unit fewer misses it.

The workload is sized so the answer is far from the edge on both sides (a loaded two-core
machine slows every process): one unit gets 120 % of what it can do, so its queue grows
the whole run and TTFT p99 ends near 3x the objective; two get 60 % each and stay near a
third of it. The same seeded traffic goes to the planner and, open loop, to real
``python -m proxy sidecar --engine sim`` units behind a ``lor`` gateway (bench/plan's
machinery, which bench/routing's fleet starts and stops).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.plan.run import Case, bodies, real_run
from proxy.plan.planner import Objectives, plan, simulate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CASE = Case("reality", 6.0, "100", "20", 1.5, slots=4, decode_step_ms=40.0,
            decode_ms_per_seq=0.0, prefill_ms_per_token=0.1)  # fmt: skip
DURATION_S = 15.0


async def test_the_planned_count_meets_the_objective_and_one_fewer_misses(tmp_path: Path) -> None:
    requests = CASE.traffic(DURATION_S, seed=1)
    objectives = Objectives(CASE.slo_ttft_p99_s)
    result = plan(CASE.settings(), 64, requests, objectives, DURATION_S, max_units=8)
    assert result.units == 2
    arrivals = bodies(requests, seed=1)
    for units, meets in ((2, True), (1, False)):
        predicted = simulate(CASE.settings(), units, 64, requests, objectives, DURATION_S,
                             stop_early=False)  # fmt: skip
        measured = await real_run(CASE, units, arrivals, predicted, tmp_path)
        assert measured.errors == 0
        assert measured.meets is meets, (units, measured.ttft_p99_s, predicted.ttft_p99_s)
        assert predicted.meets is meets

"""``unitproxy plan --measure URL``: a unit's shape measured from a real sim sidecar on
loopback matches the knobs it was started with, and the plan uses it."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest

from proxy.plan.measure import MeasureError, line, measure
from tests.procs import Procs, free_ports

KNOBS = {  # far from the defaults, so that a default taken for a measure shows
    "max_num_seqs": 6,
    "prefill_ms_per_token": 0.2,
    "decode_step_ms": 15.0,
    "decode_ms_per_seq": 1.5,
}
CAPACITY = 12


def test_a_line_through_points() -> None:
    assert line([(1, 3), (2, 5), (4, 9)]) == pytest.approx((1.0, 2.0))
    assert line([(3, 4), (3, 6)]) == (5.0, 0.0)  # one x: the mean, no slope


async def run_plan(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "plan", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 100)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_the_measured_shape_of_a_sim_unit_is_the_shape_it_was_started_with(
    procs: Procs,
) -> None:
    flags = [f"--sim-{k.replace('_', '-')}" for k in KNOBS]
    knobs = [arg for flag, v in zip(flags, KNOBS.values(), strict=True) for arg in (flag, str(v))]
    unit = await procs.sidecar(
        *free_ports(2), "--unit-id", "m0", "--engine", "sim", "--capacity", str(CAPACITY), *knobs
    )
    workload = ["--rate", "20", "--duration", "120", "--prompt-tokens", "300"]
    workload += ["--output-tokens", "40", "--slo-ttft-p99", "1", "--json"]
    code, out, err = await run_plan("--measure", unit.http_url, *workload)
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    measured = result["measured"]
    assert measured["max_num_seqs"] == KNOBS["max_num_seqs"]  # the most running at once
    assert measured["capacity"] == CAPACITY
    # Timed on a shared machine: within 25 % (the per-sequence cost, a small slope, 40 %).
    assert measured["prefill_ms_per_token"] == pytest.approx(KNOBS["prefill_ms_per_token"], 0.25)
    assert measured["decode_step_ms"] == pytest.approx(KNOBS["decode_step_ms"], rel=0.25)
    assert measured["decode_ms_per_seq"] == pytest.approx(KNOBS["decode_ms_per_seq"], rel=0.4)
    assert result["units"] is not None and result["units"] >= 1
    # The same plan with the sim flags it was started with: the same answer, or one
    # unit apart where the workload is near an edge.
    code, out, err = await run_plan(*knobs, "--capacity", str(CAPACITY), *workload)
    assert code == 0, err
    assert abs(json.loads(out)["units"] - result["units"]) <= 1


async def test_a_unit_that_does_not_answer_is_an_error_not_a_plan() -> None:
    (port,) = free_ports(1)
    with pytest.raises(MeasureError):
        await measure(f"http://127.0.0.1:{port}", timeout_s=5)
    code, out, err = await run_plan(
        "--measure", f"http://127.0.0.1:{port}", "--rate", "1", "--slo-ttft-p99", "1"
    )
    assert code == 1 and "plan.measure_url" in err and not out

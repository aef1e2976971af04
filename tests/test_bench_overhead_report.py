"""bench/overhead's report: targets compared repeat by repeat, and the verdict on
non-streamed requests against the peers (pure functions over made-up runs)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.overhead import goals, report


def _run(target: str, repeat: int, requests: int, concurrency: int = 16) -> dict[str, Any]:
    return {
        "scenario": "completions", "concurrency": concurrency, "target": target,
        "repeat": repeat, "window_s": 1.0, "requests": requests, "chunks": 0,
        "messages": 0, "ttfts": [0.001] * 4, "errors": {}, "outstanding_after": 0,
        "cpu_s": {"router": 0.1, "sidecar": 0.2, "client": 0.1, "machine": 0.5},
    }  # fmt: skip


def _rows(rates: dict[str, list[int]], concurrency: int = 16) -> list[dict[str, Any]]:
    runs = [
        _run(target, repeat, rate, concurrency)
        for target, by_repeat in rates.items()
        for repeat, rate in enumerate(by_repeat)
    ]
    return report.aggregate(runs)


def test_sign_test_matches_the_binomial_tail() -> None:
    assert report.sign_test(0, 0) == 1.0
    assert report.sign_test(5, 10) == 1.0
    # 10 of 10: both tails of 1/1024
    assert math.isclose(report.sign_test(10, 10), 2 / 1024)
    assert math.isclose(report.sign_test(0, 10), 2 / 1024)
    # 9 of 15: P(X >= 9) = 9,949 / 32,768, doubled
    assert math.isclose(report.sign_test(9, 15), 2 * 9949 / 32768)


def test_paired_compares_the_same_repeats_only() -> None:
    rows = _rows({"direct": [100, 100, 100], "unitproxy": [90, 50, 80], "vllm-router": [80, 60]})
    up = report.find(rows, "completions", 16, "unitproxy")
    peer = report.find(rows, "completions", 16, "vllm-router")
    assert up is not None and peer is not None
    wins, n, median = report.paired(up, peer)
    assert (wins, n) == (1, 2)  # repeat 2 has no vllm-router run
    assert median == pytest.approx((90 / 80 + 50 / 60) / 2)


def test_the_pooled_rate_decides_and_every_concurrency_counts() -> None:
    ahead = {"direct": [100] * 4, "unitproxy": [90, 91, 92, 93],
             "vllm-router": [80] * 4, "sglang-router": [85] * 4}  # fmt: skip
    rows = _rows(ahead, 1) + _rows({**ahead, "sglang-router": [95] * 4}, 16)
    verdict = goals._non_streaming_cells(rows, [1, 16])
    assert verdict.status == "MISSED"  # behind sglang-router at c=16
    assert "c=1: unitproxy 92/s" in verdict.figures
    assert "faster in 4/4 repeats" in verdict.figures
    assert "faster in 0/4 repeats" in verdict.figures
    assert goals._non_streaming_cells(_rows(ahead, 1), [1]).status == "MET"


def test_no_peer_rows_is_not_measured() -> None:
    rows = _rows({"direct": [100], "unitproxy": [90]})
    assert goals._non_streaming_cells(rows, [16]).status == "NOT MEASURED"


def test_the_compiled_build_is_judged_beside_the_pure_one() -> None:
    rates = {"direct": [100] * 3, "unitproxy": [80] * 3, "unitproxy+compiled": [90] * 3,
             "vllm-router": [85] * 3, "sglang-router": [70] * 3}  # fmt: skip
    rows = _rows(rates, 1)
    judged = {v.target: v for v in goals.verdicts(rows, [1])}
    cells = "non-streamed req/s (completions) above both peers' at every concurrency"
    assert judged[cells].status == "MISSED"
    assert "c=1: unitproxy 80/s" in judged[cells].figures
    compiled = judged[f"[unitproxy+compiled] {cells}"]
    assert compiled.status == "MET"
    assert "c=1: unitproxy+compiled 90/s" in compiled.figures
    # Without a compiled row, only unitproxy is judged.
    pure_only = goals.verdicts(_rows({k: v for k, v in rates.items() if "+" not in k}, 1), [1])
    assert not any(v.target.startswith("[") for v in pure_only)


def test_run_queue_waits_are_pooled_per_request_and_absent_without_schedstat() -> None:
    def runs(waits: dict[str, float] | None) -> list[dict[str, Any]]:
        out = []
        for target in ("direct", "unitproxy"):
            for repeat in range(2):
                run = _run(target, repeat, 1000)
                if waits is not None:
                    run["cpu_s"] = {**run["cpu_s"], **waits}
                out.append(run)
        return out

    waits = {"router_wait": 0.02, "sidecar_wait": 0.1, "client_wait": 0.05}
    rows = {r["target"]: r for r in report.aggregate(runs(waits))}
    # 0.04 s over 2,000 requests; 0.2 s of sidecar wait over a 2 s window.
    assert rows["unitproxy"]["router_wait_us_per_request"] == pytest.approx(20.0)
    assert rows["unitproxy"]["sidecar_wait_pct"] == pytest.approx(10.0)
    assert rows["unitproxy"]["client_wait_pct"] == pytest.approx(5.0)
    assert rows["direct"]["router_wait_us_per_request"] is None
    older = {r["target"]: r for r in report.aggregate(runs(None))}
    assert older["unitproxy"]["router_wait_us_per_request"] is None
    assert older["unitproxy"]["sidecar_wait_pct"] is None
    assert "wait us/req" in report.table(list(rows.values())).splitlines()[0]

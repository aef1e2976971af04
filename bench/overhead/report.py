"""From measured windows to rows: ratios to direct, the table, the issue's targets, the PNG.

A row pools every repeat of one (scenario, concurrency, target): counts, CPU and time
are summed, TTFT percentiles are taken over all samples. Ratios and added TTFT compare
a row with the ``direct`` row of the same scenario and concurrency; the per-repeat
range of the throughput ratio (each repeat against the direct run beside it) shows
how much the machine's noise moved it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from bench.loadgen import percentile

Run = dict[str, Any]  # one measured window: see run.py's run_one
Row = dict[str, Any]


def _pct(seconds: float | None, window: float) -> float | None:
    return None if seconds is None or not window else 100 * seconds / window


def _per(value: float, count: int, scale: float) -> float | None:
    return value * scale / count if count else None


# The scenarios whose answers are whole (no chunks): their throughput is requests.
WHOLE = frozenset({"completions", "embeddings"})


def _main_count(scenario: str) -> str:
    """The throughput that matters: requests for non-streamed answers, else chunks."""
    return "requests" if scenario in WHOLE else "chunks"


def aggregate(runs: Sequence[Run]) -> list[Row]:
    groups: dict[tuple[str, int, str], list[Run]] = defaultdict(list)
    for run in runs:
        groups[(run["scenario"], run["concurrency"], run["target"])].append(run)
    rows = {key: _pool(key, group) for key, group in groups.items()}
    for (scenario, concurrency, _), row in rows.items():
        direct = rows.get((scenario, concurrency, "direct"))
        _compare(row, direct, groups.get((scenario, concurrency, "direct"), []), groups)
    return list(rows.values())


def _pool(key: tuple[str, int, str], runs: list[Run]) -> Row:
    scenario, concurrency, target = key
    window = sum(r["window_s"] for r in runs)
    requests = sum(r["requests"] for r in runs)
    chunks = sum(r["chunks"] for r in runs)
    messages = sum(r.get("messages", r["chunks"]) for r in runs)  # older JSON: none
    ttfts = [t for r in runs for t in r["ttfts"]]
    roles = ("router", "sidecar", "client", "machine")
    cpu = {role: sum(r["cpu_s"].get(role, 0.0) for r in runs) for role in roles}
    # Whatever else ran on the machine meanwhile (other work, idle routers): noise.
    others = cpu["machine"] - cpu["router"] - cpu["sidecar"] - cpu["client"]
    # Run-queue waits, where the kernel kept them (older JSON and kernels without
    # schedstat: None).
    waits = {
        role: sum(r["cpu_s"][role] for r in runs) if all(role in r["cpu_s"] for r in runs) else None
        for role in ("router_wait", "sidecar_wait", "client_wait")
    }
    errors: dict[str, int] = defaultdict(int)
    for r in runs:
        for kind, n in r["errors"].items():
            errors[kind] += n
        if r["outstanding_after"] not in (0, None):
            errors[f"sidecar showed {r['outstanding_after']} outstanding after the run"] += 1
    p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    router = target != "direct"
    return {
        "scenario": scenario,
        "concurrency": concurrency,
        "target": target,
        "repeats": len(runs),
        "window_s": window,
        "requests": requests,
        "chunks": chunks,
        "messages": messages,
        "messages_per_request": messages / requests if requests else None,
        "requests_per_s": requests / window if window else 0.0,
        "chunks_per_s": chunks / window if window else 0.0,
        "ttft_samples": len(ttfts),
        "ttft_p50_ms": None if p50 is None else p50 * 1000,
        "ttft_p99_ms": None if p99 is None else p99 * 1000,
        "router_cpu_s": cpu["router"] if router else None,
        "router_cpu_pct": 100 * cpu["router"] / window if router and window else None,
        "router_cpu_ms_per_1k_chunks": _per(cpu["router"], chunks, 1e6) if router else None,
        "router_cpu_ms_per_1k_messages": _per(cpu["router"], messages, 1e6) if router else None,
        "router_cpu_us_per_request": _per(cpu["router"], requests, 1e6) if router else None,
        "router_wait_us_per_request": (
            _per(waits["router_wait"], requests, 1e6)
            if router and waits["router_wait"] is not None
            else None
        ),
        "sidecar_cpu_pct": 100 * cpu["sidecar"] / window if window else None,
        "sidecar_wait_pct": _pct(waits["sidecar_wait"], window),
        "client_wait_pct": _pct(waits["client_wait"], window),
        "sidecar_cpu_us_per_request": _per(cpu["sidecar"], requests, 1e6),
        "client_cpu_pct": 100 * cpu["client"] / window if window else None,
        "client_cpu_us_per_request": _per(cpu["client"], requests, 1e6),
        "others_cpu_pct": max(0.0, 100 * others / window) if window else None,
        # Client + router + sidecar CPU per unit of throughput: what bounds the rate once
        # they alone fill the cores, whatever else the machine was doing.
        "total_cpu_us_per_unit": _per(
            cpu["client"] + cpu["sidecar"] + (cpu["router"] if router else 0.0),
            requests if _main_count(scenario) == "requests" else chunks,
            1e6,
        ),
        "errors": dict(errors),
        "error_count": sum(errors.values()),
        # Targets of one repeat ran seconds apart: compared repeat by repeat, the
        # machine's slower drifts fall out.
        "rate_by_repeat": rate_by_repeat(runs),
    }


def key(run_or_row: Run | Row) -> tuple[str, int, str]:
    return run_or_row["scenario"], run_or_row["concurrency"], run_or_row["target"]


def rate_by_repeat(runs: Sequence[Run]) -> dict[int, float]:
    """Each repeat's rate (requests or chunks, as the scenario counts) of one target."""
    return {
        r["repeat"]: r[_main_count(r["scenario"])] / r["window_s"] for r in runs if r["window_s"]
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _diff(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def _compare(
    row: Row,
    direct: Row | None,
    direct_runs: list[Run],
    groups: dict[tuple[str, int, str], list[Run]],
) -> None:
    d = direct or {}
    row["requests_ratio"] = _ratio(row["requests_per_s"], d.get("requests_per_s"))
    row["chunks_ratio"] = _ratio(row["chunks_per_s"] or None, d.get("chunks_per_s"))
    row["added_ttft_p50_ms"] = _diff(row["ttft_p50_ms"], d.get("ttft_p50_ms"))
    row["added_ttft_p99_ms"] = _diff(row["ttft_p99_ms"], d.get("ttft_p99_ms"))
    count = _main_count(row["scenario"])
    by_repeat = {r["repeat"]: r for r in direct_runs}
    ratios = []
    for run in groups[(row["scenario"], row["concurrency"], row["target"])]:
        base = by_repeat.get(run["repeat"])
        if base and base[count] and base["window_s"] and run["window_s"]:
            rate, base_rate = run[count] / run["window_s"], base[count] / base["window_s"]
            ratios.append(rate / base_rate)
    row["ratio_of"] = count
    row["cpu_bound_ratio"] = _ratio(d.get("total_cpu_us_per_unit"), row["total_cpu_us_per_unit"])
    row["ratio_per_repeat"] = ratios


def paired(a: Row, b: Row) -> tuple[int, int, float | None]:
    """``a`` against ``b`` repeat by repeat: (repeats where a was faster, repeats both ran,
    the median of a's rate over b's)."""
    ratios = sorted(
        rate / other
        for repeat, rate in a["rate_by_repeat"].items()
        if (other := b["rate_by_repeat"].get(repeat))
    )
    if not ratios:
        return 0, 0, None
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return sum(r > 1 for r in ratios), len(ratios), median


def sign_test(wins: int, n: int) -> float:
    """Two-sided sign test: how likely a split at least this uneven is when either side
    is as likely to be faster in each repeat (1.0: no evidence either way)."""
    if n == 0:
        return 1.0
    k = max(wins, n - wins)
    tail = sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n
    return min(1.0, 2 * tail)


def find(rows: Sequence[Row], scenario: str, concurrency: int, target: str) -> Row | None:
    for row in rows:
        if (row["scenario"], row["concurrency"], row["target"]) == (scenario, concurrency, target):
            return row
    return None


# -- the table ------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 0, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+,.{digits}f}" if sign else f"{value:,.{digits}f}"


def _spread(row: Row) -> str:
    ratios = row["ratio_per_repeat"]
    main = row[f"{row['ratio_of']}_ratio"]
    if main is None or row["target"] == "direct":
        return "-"
    if len(ratios) < 2:
        return f"{main:.2f}"
    return f"{main:.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


COLUMNS: tuple[tuple[str, Callable[[Row], str]], ...] = (
    ("scenario", lambda r: r["scenario"]),
    ("conc", lambda r: str(r["concurrency"])),
    ("target", lambda r: r["target"]),
    ("req/s", lambda r: fmt(r["requests_per_s"])),
    ("chunks/s", lambda r: fmt(r["chunks_per_s"] or None)),
    ("x direct (repeats)", _spread),
    ("CPU-bound x", lambda r: fmt(r["cpu_bound_ratio"], 2) if r["target"] != "direct" else "-"),
    ("TTFT p50", lambda r: fmt(r["ttft_p50_ms"], 2)),
    ("p99 ms", lambda r: fmt(r["ttft_p99_ms"], 2)),
    (
        "+p50",
        lambda r: fmt(r["added_ttft_p50_ms"], 2, sign=True) if r["target"] != "direct" else "",
    ),
    (
        "+p99 ms",
        lambda r: fmt(r["added_ttft_p99_ms"], 2, sign=True) if r["target"] != "direct" else "",
    ),
    ("router CPU%", lambda r: fmt(r["router_cpu_pct"])),
    ("ms/1k chunks", lambda r: fmt(r["router_cpu_ms_per_1k_chunks"], 1)),
    ("us/req", lambda r: fmt(r["router_cpu_us_per_request"])),
    ("wait us/req", lambda r: fmt(r.get("router_wait_us_per_request"))),
    ("sidecar CPU%", lambda r: fmt(r["sidecar_cpu_pct"])),
    ("wait%", lambda r: fmt(r.get("sidecar_wait_pct"))),
    ("client CPU%", lambda r: fmt(r["client_cpu_pct"])),
    ("others CPU%", lambda r: fmt(r["others_cpu_pct"])),
    ("errors", lambda r: str(r["error_count"])),
)


def table(rows: Sequence[Row]) -> str:
    cells = [[name for name, _ in COLUMNS]]
    cells += [[cell(row) for _, cell in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]

    def line(values: list[str]) -> str:
        out = []
        for i, (v, w) in enumerate(zip(values, widths, strict=True)):
            out.append(v.ljust(w) if i in (0, 2) else v.rjust(w))
        return "  ".join(out)

    lines = [line(values) for values in cells]
    body, previous = [], None
    for row, text in zip(rows, lines[1:], strict=True):
        key = (row["scenario"], row["concurrency"])
        if previous is not None and key != previous:
            body.append("")
        body.append(text)
        previous = key
    return "\n".join([lines[0], "-" * len(lines[0]), *body])

"""The issue's targets for unitproxy, each judged MET, MISSED or NOT MEASURED from the rows.

Throughput targets are judged on the measured ratios, as the issue states them; beside
each, the same judgement on the CPU-bound estimate (``cpu_bound_ratio``), which holds
when other work shares the machine's cores and squeezes every measured ratio to 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.overhead.report import Row, find, fmt, paired, sign_test

UNITPROXY = "unitproxy"
COMPILED = "unitproxy+compiled"  # the same tree, its request path compiled (setup.py)
PEER_GROUPS = {
    "vllm-router": ("vllm-router",),
    "sglang-router": ("sglang-router", "sglang-router+nodelay"),
}


@dataclass(frozen=True)
class Verdict:
    target: str
    status: str  # MET, MISSED, NOT MEASURED
    figures: str

    def to_json(self) -> dict[str, str]:
        return {"target": self.target, "status": self.status, "figures": self.figures}


def _status(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def verdicts(rows: Sequence[Row], concurrency: Sequence[int]) -> list[Verdict]:
    """The targets for ``unitproxy``; when the run had ``unitproxy+compiled`` too, the same
    targets for it after them, its name in each target's."""
    judged = [_verdicts(rows, concurrency, UNITPROXY)]
    if any(r["target"] == COMPILED for r in rows):
        judged.append(
            [
                Verdict(f"[{COMPILED}] {v.target}", v.status, v.figures)
                for v in _verdicts(rows, concurrency, COMPILED)
            ]
        )
    return [v for group in judged for v in group]


def _verdicts(rows: Sequence[Row], concurrency: Sequence[int], up: str) -> list[Verdict]:
    sat = max(concurrency)
    return [
        _streaming(rows, sat, up),
        _non_streaming(rows, sat, up),
        _non_streaming_cells(rows, concurrency, up),
        *(_ttft(rows, c, p50, p99, up) for c, p50, p99 in ((16, 0.5, 1.0), (64, 2.0, 2.0))),
        _grpc(rows, concurrency, up),
    ]


def _peer_best(
    rows: Sequence[Row], scenario: str, c: int, key: str
) -> dict[str, tuple[str, float]]:
    """Each peer's best variant by ``key``: {peer: (variant, value)}."""
    best = {}
    for peer, variants in PEER_GROUPS.items():
        found = [(v, r[key]) for v in variants if (r := find(rows, scenario, c, v)) and r[key]]
        if found:
            best[peer] = max(found, key=lambda item: item[1])
    return best


def _cpu_bound_note(ok: bool, figures: list[str]) -> str:
    """The verdict again on the CPU-bound estimate (robust when other work shared the cores)."""
    return f"; CPU-bound estimate: {'; '.join(figures)} -> {_status(ok)}"


def _streaming(rows: Sequence[Row], sat: int, subject: str = UNITPROXY) -> Verdict:
    name = f"streaming chunks/s at saturation (stream-0ms, c={sat}) >= 0.6x direct and above both peers"
    up = find(rows, "stream-0ms", sat, subject)
    if up is None or up["chunks_ratio"] is None:
        return Verdict(name, "NOT MEASURED", f"no {subject}/direct stream-0ms row")
    peers = _peer_best(rows, "stream-0ms", sat, "chunks_per_s")
    figures = [f"{subject} {up['chunks_ratio']:.2f}x direct ({up['chunks_per_s']:,.0f}/s)"]
    figures += [f"{v} {val:,.0f}/s" for v, val in peers.values()]
    ok = up["chunks_ratio"] >= 0.6 and all(up["chunks_per_s"] > val for _, val in peers.values())
    missing = [p for p in PEER_GROUPS if p not in peers]
    status = _status(ok)
    if missing and ok:
        status = "MET (only against the peers measured)"
        figures.append(f"not measured: {', '.join(missing)}")
    text = "; ".join(figures)
    cpu_peers = _peer_best(rows, "stream-0ms", sat, "cpu_bound_ratio")
    if up["cpu_bound_ratio"] is not None:
        cpu_ok = up["cpu_bound_ratio"] >= 0.6 and all(
            up["cpu_bound_ratio"] > val for _, val in cpu_peers.values()
        )
        cpu_figures = [f"{subject} {up['cpu_bound_ratio']:.2f}x"]
        cpu_figures += [f"{v} {val:.2f}x" for v, val in cpu_peers.values()]
        text += _cpu_bound_note(cpu_ok, cpu_figures)
    return Verdict(name, status, text)


def _non_streaming(rows: Sequence[Row], sat: int, subject: str = UNITPROXY) -> Verdict:
    name = f"non-streaming req/s at saturation (completions, c={sat}) >= 0.5x direct, router CPU/request <= vllm-router's"
    up = find(rows, "completions", sat, subject)
    if up is None or up["requests_ratio"] is None:
        return Verdict(name, "NOT MEASURED", f"no {subject}/direct completions row")
    vllm = find(rows, "completions", sat, "vllm-router")
    figures = [
        f"{subject} {up['requests_ratio']:.2f}x direct ({up['requests_per_s']:,.0f}/s), "
        f"{fmt(up['router_cpu_us_per_request'])} us CPU/request"
    ]
    cpu_ok = up["cpu_bound_ratio"] is not None and up["cpu_bound_ratio"] >= 0.5
    note = f"; CPU-bound estimate {fmt(up['cpu_bound_ratio'], 2)}x direct"
    if vllm is None or vllm["router_cpu_us_per_request"] is None:
        figures.append("vllm-router not measured")
        ok = up["requests_ratio"] >= 0.5
        status = "MET (req/s part only)" if ok else "MISSED"
        return Verdict(name, status, "; ".join(figures) + note + f" -> {_status(cpu_ok)}")
    figures.append(f"vllm-router {vllm['router_cpu_us_per_request']:,.0f} us CPU/request")
    cheaper = up["router_cpu_us_per_request"] <= vllm["router_cpu_us_per_request"]
    ok = up["requests_ratio"] >= 0.5 and cheaper
    return Verdict(
        name, _status(ok), "; ".join(figures) + note + f" -> {_status(cpu_ok and cheaper)}"
    )


def _non_streaming_cells(
    rows: Sequence[Row], concurrency: Sequence[int], subject: str = UNITPROXY
) -> Verdict:
    """unitproxy's req/s above each peer's in every completions cell. Beside each pooled
    rate: in how many repeats unitproxy was the faster, and a sign test on that split
    (a small p says the order is not the machine's noise)."""
    name = "non-streamed req/s (completions) above both peers' at every concurrency"
    cells, ok, measured = [], True, False
    for c in concurrency:
        up = find(rows, "completions", c, subject)
        if up is None:
            continue
        parts = []
        for variants in PEER_GROUPS.values():
            found = [r for v in variants if (r := find(rows, "completions", c, v))]
            if not found:
                continue
            best = max(found, key=lambda r: r["requests_per_s"])
            measured = True
            ok = ok and up["requests_per_s"] > best["requests_per_s"]
            wins, n, median = paired(up, best)
            parts.append(
                f"{best['target']} {best['requests_per_s']:,.0f}/s, {subject} faster in "
                f"{wins}/{n} repeats (median {fmt(median, 2)}x, sign test p={sign_test(wins, n):.2f})"
            )
        if parts:
            cells.append(f"c={c}: {subject} {up['requests_per_s']:,.0f}/s; " + "; ".join(parts))
    if not measured:
        return Verdict(name, "NOT MEASURED", f"no {subject} and peer completions rows")
    return Verdict(name, _status(ok), " | ".join(cells))


def _ttft(
    rows: Sequence[Row], c: int, max_p50: float, max_p99: float, subject: str = UNITPROXY
) -> Verdict:
    name = f"added TTFT at 5 ms/token, c={c}: <= {max_p50:g} ms p50 and <= {max_p99:g} ms p99"
    up = find(rows, "stream-5ms", c, subject)
    if up is None or up["added_ttft_p50_ms"] is None:
        return Verdict(name, "NOT MEASURED", f"no {subject}/direct stream-5ms c={c} row")
    p50, p99 = up["added_ttft_p50_ms"], up["added_ttft_p99_ms"]
    figures = f"{subject} {p50:+.2f} ms p50, {p99:+.2f} ms p99 ({up['ttft_samples']} samples)"
    return Verdict(name, _status(p50 <= max_p50 and p99 <= max_p99), figures)


def _grpc(rows: Sequence[Row], concurrency: Sequence[int], subject: str = UNITPROXY) -> Verdict:
    name = (
        "gRPC proxying <= 100 ms router CPU per 1,000 token messages (every concurrency;"
        " a token message is one token delta as the unit made it)"
    )
    found = [(c, r) for c in concurrency if (r := find(rows, "grpc", c, subject))]
    values = [
        (c, r["router_cpu_ms_per_1k_chunks"], r.get("messages_per_request"))
        for c, r in found
        if r["router_cpu_ms_per_1k_chunks"]
    ]
    if not values:
        return Verdict(name, "NOT MEASURED", f"no {subject} grpc row")
    figures = ", ".join(
        f"c={c}: {v:.0f} ms" + (f" ({m:.1f} wire messages per 64 tokens)" if m else "")
        for c, v, m in values
    )
    return Verdict(name, _status(all(v <= 100 for _, v, _ in values)), figures)

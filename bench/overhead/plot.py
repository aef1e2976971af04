"""The PNG: throughput ratios, added TTFT, router CPU per chunk and per request."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.overhead.report import Row, find

COLORS = {
    "direct": "#888888",
    "unitproxy": "#1f77b4",
    "unitproxy+compiled": "#17becf",
    "vllm-router": "#ff7f0e",
    "sglang-router": "#2ca02c",
    "sglang-router+nodelay": "#98df8a",
}


def plot(rows: Sequence[Row], concurrency: Sequence[int], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sat = max(concurrency)
    routers = [t for t in COLORS if t != "direct" and any(r["target"] == t for r in rows)]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9.5))
    _bars(
        axes[0][0],
        rows,
        routers,
        [
            ("stream-0ms", sat, "chunks_ratio"),
            ("stream-5ms", sat, "chunks_ratio"),
            ("completions", sat, "requests_ratio"),
            ("grpc", sat, "chunks_ratio"),
        ],
        f"throughput / direct at c={sat} (chunks/s; completions: req/s)",
        "x direct",
        lines=[(0.6, "0.6x (streaming target)"), (0.5, "0.5x (non-streaming target)")],
        fmt="%.2f",
    )
    _ttft_panel(axes[0][1], rows, routers, concurrency)
    _bars(
        axes[1][0],
        rows,
        routers,
        [
            (s, c, "router_cpu_ms_per_1k_chunks")
            for s in ("stream-0ms", "grpc")
            for c in concurrency
        ],
        "router CPU per 1,000 chunks (0 ms/token)",
        "ms CPU / 1k chunks",
        lines=[(100, "100 ms (gRPC target)")],
    )
    _bars(
        axes[1][1],
        rows,
        routers,
        [("completions", c, "router_cpu_us_per_request") for c in concurrency],
        "router CPU per non-streamed request",
        "us CPU / request",
        lines=[],
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(
    ax: Any,
    rows: Sequence[Row],
    targets: Sequence[str],
    groups: Sequence[tuple[str, int, str]],
    title: str,
    ylabel: str,
    lines: Sequence[tuple[float, str]],
    fmt: str = "%.0f",
) -> None:
    values = {
        (j, t): row[key]
        for j, (scenario, c, key) in enumerate(groups)
        for t in targets
        if (row := find(rows, scenario, c, t)) is not None and row[key] is not None
    }
    groups_present = [j for j in range(len(groups)) if any((j, t) in values for t in targets)]
    width = 0.8 / max(1, len(targets))
    for target in targets:
        xs, ys = [], []
        for x, j in enumerate(groups_present):
            present = [t for t in targets if (j, t) in values]
            if target in present:
                xs.append(x + (present.index(target) - (len(present) - 1) / 2) * width)
                ys.append(values[(j, target)])
        bars = ax.bar(xs, ys, width, label=target, color=COLORS[target])
        ax.bar_label(bars, fmt=fmt, fontsize=7)
    for y, label in lines:
        ax.axhline(y, color="red", linestyle="--", linewidth=0.8, label=label)
    names = [f"{groups[j][0]}\nc={groups[j][1]}" for j in groups_present]
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    # Head room above the tallest bar or line for the legend.
    top = max([*values.values(), *(y for y, _ in lines), 0.0])
    ax.set_ylim(0, top * 1.35 or 1.0)
    ax.legend(fontsize=7, loc="upper right", ncol=2)


def _ttft_panel(
    ax: Any, rows: Sequence[Row], targets: Sequence[str], concurrency: Sequence[int]
) -> None:
    width = 0.8 / max(1, len(targets))
    labels = [f"c={c}\n{p}" for c in concurrency for p in ("p50", "p99")]
    for i, target in enumerate(targets):
        xs, ys = [], []
        for j, (c, p) in enumerate((c, p) for c in concurrency for p in ("p50", "p99")):
            row = find(rows, "stream-5ms", c, target)
            if row is not None and row[f"added_ttft_{p}_ms"] is not None:
                xs.append(j + (i - (len(targets) - 1) / 2) * width)
                ys.append(row[f"added_ttft_{p}_ms"])
        bars = ax.bar(xs, ys, width, label=target, color=COLORS[target])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.axhline(0, color="black", linewidth=0.6)
    limits = {16: (0.5, 1.0), 64: (2.0, 2.0)}
    for j, (c, p) in enumerate((c, p) for c in concurrency for p in ("p50", "p99")):
        if c in limits:
            y = limits[c][0 if p == "p50" else 1]
            ax.hlines(y, j - 0.45, j + 0.45, color="red", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_yscale("symlog", linthresh=1.0)
    bottom, top = ax.get_ylim()
    ax.set_ylim(bottom, max(top, 1.0) * 8)  # head room for the legend
    ax.set_title("added TTFT over direct, stream at 5 ms/token (red: target)", fontsize=10)
    ax.set_ylabel("ms (symlog)")
    ax.legend(fontsize=7, loc="upper left", ncol=2)

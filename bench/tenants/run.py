"""Tenants sharing a fleet: isolation, fairness and priority through the gateway's queue.

Starts --units sidecars (engine sim, --slots batch slots each, no capacity set: a unit's
capacity is its slots) and one gateway with a tenants file, as child processes on
127.0.0.1, then runs these phases, each for --duration s (fairness: --fair-duration):

    alone        tenants b and c (interactive) stream light requests, 2 at a time each
    flood        the same, while tenant a (batch) streams --flood requests at once
                 (10x its fair share of the fleet's slots by default): b's and c's TTFT
                 against alone (isolation), and against alone for priority; a's tokens/s
    batch alone  tenant a's flood alone: the fleet's batch tokens/s with nothing else
    one class    a2, b2, c2, all standard: a2 floods, b2 and c2 light (fairness alone,
                 no priority), against the time a unit takes to free a slot
    fairness     three backlogged standard tenants of different request sizes (16, 64
                 and 256 output tokens): Jain's index over the tokens (prompt and
                 output, as limits and the fair queue count them) each was served in
                 each 10 s window

Then the limits scenario (bench/tenants/limits.py, its own fleet: two gateway replicas
sharing a Redis of the bench's own; --limits-only, --skip-limits): a tenant offering 4x
its tokens_per_minute, tokens served against the limit with Redis and with that Redis
stopped; the same through two LiteLLM proxies with per-key TPM as the reference, where
bench/.venvs/litellm is installed (bash bench/overhead/setup_peers.sh litellm;
--no-litellm leaves it out), and the latency each adds at a light load. Its PNG is
<out>_limits.png.

Goals (issue 32): b and c TTFT p99 under the flood <= 1.5x alone, interactive <= 1.2x
alone (priority); one class <= 0.5 s; Jain's index >= 0.95 in every window; batch
tokens/s under the interactive load >= 50 % of the fleet's spare capacity.

    .venv/bin/python bench/tenants/run.py            # 20 s phases, 30 s of fairness (~2.5 min)
                                                     # and limits measured 60 s (~4 min;
                                                     # ~9 min with LiteLLM)
    .venv/bin/python bench/tenants/run.py --quick    # 4 s phases, 10 s of fairness (~45 s)
                                                     # and limits measured 15 s (~1.5 min;
                                                     # ~4 min with LiteLLM)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the bench package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp

from bench.common import (
    MODEL,
    code_version,
    cpu_model,
    free_ports,
    loop_name,
    no_plot,
    run_loop,
    until_signal,
)
from bench.tenants import limits
from proxy.procutil import python_m, running

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "bench" / "results" / "tenants.json"
HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
WINDOW_S = 10.0  # fairness: Jain's index per window of this long
TENANTS = {  # name: class
    "a": "batch", "b": "interactive", "c": "interactive",
    "a2": "standard", "b2": "standard", "c2": "standard",
    "f16": "standard", "f64": "standard", "f256": "standard",
}  # fmt: skip
LIGHT_TOKENS = 16  # a light request's output
FLOOD_TOKENS = 128  # a flood request's output
PROMPT = "Summarize the following text in one short paragraph please. " * 2


def tenants_file(path: Path) -> None:
    path.write_text(
        "".join(
            f'[[tenant]]\nname = "{name}"\nkeys = ["sk-{name}"]\npriority = "{cls}"\n\n'
            for name, cls in TENANTS.items()
        )
    )


@dataclass
class Stats:
    """What one tenant's streams got in one phase."""

    ttft_s: list[float] = field(default_factory=list)
    # (when, tokens): each output token as it came, and the prompt's at the first one
    tokens: list[tuple[float, int]] = field(default_factory=list)
    output_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    durations_s: list[float] = field(default_factory=list)

    def p(self, q: float) -> float:
        if not self.ttft_s:
            return float("nan")
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def tokens_between(self, start: float, end: float) -> int:
        return sum(n for at, n in self.tokens if start <= at < end)


# -- processes -------------------------------------------------------------------------


@asynccontextmanager
async def fleet(args: argparse.Namespace, workdir: Path) -> AsyncIterator[str]:
    """--units sidecars and a gateway with the tenants file; yields the gateway's URL."""
    path = workdir / "tenants.toml"
    tenants_file(path)
    ports = free_ports(2 * args.units + 2)
    # The secret the fleet shares, as unitproxy up makes one: units grant interactive
    # only to requests a gateway signed with it.
    env = {"UNITPROXY_SERVER__RESUME_SECRET": secrets.token_hex(16)}
    async with AsyncExitStack() as stack:
        units = []
        for i in range(args.units):
            http, grpc = ports[2 * i], ports[2 * i + 1]
            argv = ["sidecar", "--host", HOST, "--http-port", str(http), "--grpc-port", str(grpc),
                    "--unit-id", f"u{i}", "--sim-max-num-seqs", str(args.slots),
                    "--sim-decode-step-ms", str(args.step_ms), "--sim-decode-ms-per-seq", "0",
                    "--sim-prefill-ms-per-token", "0.02", "--log-level", "warning"]  # fmt: skip
            unit = await stack.enter_async_context(
                running(f"u{i}", python_m(*argv), workdir / f"u{i}.log", env=env, cwd=REPO)
            )
            unit.http_url = f"http://{HOST}:{http}"
            units.append(f"u{i}=http://{HOST}:{http},{HOST}:{grpc}")
            await unit.until_ready(START_TIMEOUT_S)
        g_http, g_grpc = ports[-2], ports[-1]
        argv = ["gateway", "--host", HOST, "--http-port", str(g_http), "--grpc-port", str(g_grpc),
                "--tenants-file", str(path), "--queue-size", "4096", "--queue-timeout", "120",
                "--log-level", "warning"]  # fmt: skip
        for u in units:
            argv += ["--unit", u]
        gw = await stack.enter_async_context(
            running("gateway", python_m(*argv), workdir / "gateway.log", env=env, cwd=REPO)
        )
        gw.http_url = f"http://{HOST}:{g_http}"
        await gw.until_ready(START_TIMEOUT_S)
        yield gw.http_url


# -- clients ---------------------------------------------------------------------------


async def stream_once(
    http: aiohttp.ClientSession,
    url: str,
    tenant: str,
    max_tokens: int,
    stats: Stats,
    settled: float,
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"Authorization": f"Bearer sk-{tenant}"}
    started = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                code = str(resp.status)
                with contextlib.suppress(ValueError, KeyError, TypeError, aiohttp.ClientError):
                    code += " " + str((await resp.json())["error"]["code"])
                stats.errors[code] = stats.errors.get(code, 0) + 1
                return
            first_at = 0.0
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if b'"usage":{' in line:  # the last chunk: the prompt's tokens
                    usage = json.loads(line[6:])["usage"]
                    stats.tokens.append((first_at or now, int(usage["prompt_tokens"])))
                    continue
                if not first_at:
                    first_at = now
                    if started >= settled:  # not in the phase's opening burst
                        stats.ttft_s.append(now - started)
                stats.tokens.append((now, 1))  # the sim sends one token a chunk
                stats.output_tokens += 1
        stats.durations_s.append(time.perf_counter() - started)
    except (aiohttp.ClientError, TimeoutError) as exc:
        name = type(exc).__name__
        stats.errors[name] = stats.errors.get(name, 0) + 1


async def tenant_load(
    url: str,
    tenant: str,
    concurrency: int,
    max_tokens: int,
    until: float,
    stats: Stats,
    settled: float,
) -> None:
    """``concurrency`` streams of ``tenant`` back to back until ``until``."""
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def worker() -> None:
            while time.perf_counter() < until:
                await stream_once(http, url, tenant, max_tokens, stats, settled)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def phase(url: str, duration_s: float, loads: list[tuple[str, int, int]]) -> dict[str, Stats]:
    """Each (tenant, concurrency, output tokens) at once for ``duration_s``; light
    tenants' TTFT counts only once the others are in full flow (after the first 10 %)."""
    stats = {tenant: Stats() for tenant, _, _ in loads}
    now = time.perf_counter()
    until, settled = now + duration_s, now + duration_s / 10
    await asyncio.gather(
        *(tenant_load(url, t, c, n, until, stats[t], settled) for t, c, n in loads)
    )
    return stats


def jain(values: list[float]) -> float:
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else float("nan")


# -- the run ---------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> dict[str, Any]:
    d, fair_d = args.duration, args.fair_duration
    slots = args.units * args.slots
    flood = args.flood or max(1, round(10 * slots / 3))  # 10x a fair third of the slots
    light = [("b", 2, LIGHT_TOKENS), ("c", 2, LIGHT_TOKENS)]
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp:
        async with fleet(args, Path(tmp)) as url:
            await phase(url, 1.0, light)  # warm up
            alone = await phase(url, d, light)
            flooded = await phase(url, d, [("a", flood, FLOOD_TOKENS), *light])
            batch_alone = await phase(url, d, [("a", flood, FLOOD_TOKENS)])
            light2 = [("b2", 2, LIGHT_TOKENS), ("c2", 2, LIGHT_TOKENS)]
            one_class = await phase(url, d, [("a2", flood, FLOOD_TOKENS), *light2])
            started = time.perf_counter()
            fair_loads = [(f"f{n}", max(8, slots), n) for n in (16, 64, 256)]
            fair = await phase(url, fair_d, fair_loads)
    windows = []
    for k in range(max(1, int(fair_d // WINDOW_S))):
        start = started + k * WINDOW_S
        served = {t: fair[t].tokens_between(start, start + WINDOW_S) for t, _, _ in fair_loads}
        windows.append({"tokens": served, "jain": jain([float(v) for v in served.values()])})

    def tps(s: Stats) -> float:  # output tokens a second
        return s.output_tokens / d

    def ttft(s: Stats) -> dict[str, Any]:
        return {"n": len(s.ttft_s), "p50_s": s.p(0.5), "p99_s": s.p(0.99), "errors": s.errors}

    iso = {t: flooded[t].p(0.99) / alone[t].p(0.99) for t in ("b", "c")}
    batch_tps, fleet_tps = tps(flooded["a"]), tps(batch_alone["a"])
    spare = fleet_tps - tps(flooded["b"]) - tps(flooded["c"])
    hold_s = sorted(batch_alone["a"].durations_s)[len(batch_alone["a"].durations_s) // 2]
    free_every_s = hold_s / slots  # a slot frees this often with the whole fleet flooded
    one_p99 = max(one_class["b2"].p(0.99), one_class["c2"].p(0.99))
    errors = sum(sum(s.errors.values()) for p in (alone, flooded, one_class, fair)
                 for s in p.values())  # fmt: skip
    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "code": code_version(),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "loop": loop_name()},
        "quick": args.quick,
        "fleet": {"units": args.units, "slots_per_unit": args.slots, "step_ms": args.step_ms},
        "duration_s": d,
        "fair_duration_s": fair_d,
        "flood_concurrency": flood,
        "isolation": {
            "alone": {t: ttft(alone[t]) for t in ("b", "c")},
            "flood_batch": {t: ttft(flooded[t]) for t in ("b", "c")},
            "p99_ratio": iso,
            "one_class": {t: ttft(one_class[t]) for t in ("b2", "c2")},
            "one_class_p99_s": one_p99,
            "flood_request_s_p50": hold_s,
            "slot_frees_every_s": free_every_s,
        },
        "priority": {
            "interactive_p99_ratio": max(iso.values()),
            "batch_tokens_per_s": batch_tps,
            "batch_alone_tokens_per_s": fleet_tps,
            "spare_tokens_per_s": spare,
            "batch_share_of_spare": batch_tps / spare if spare > 0 else float("nan"),
            "batch_errors": flooded["a"].errors,
        },
        "fairness": {"windows": windows, "min_jain": min(w["jain"] for w in windows)},
        "errors": errors,
        "goals": {
            "isolation: b, c TTFT p99 <= 1.5x alone": max(iso.values()) <= 1.5,
            "one class: b2, c2 TTFT p99 <= 0.5 s": one_p99 <= 0.5,
            "fairness: Jain >= 0.95 every window": min(w["jain"] for w in windows) >= 0.95,
            "priority: interactive TTFT p99 <= 1.2x alone": max(iso.values()) <= 1.2,
            "priority: batch >= 50 % of spare": spare > 0 and batch_tps >= 0.5 * spare,
            "no error": errors == 0,
        },
    }


def table(r: dict[str, Any]) -> str:
    iso, pri, fair = r["isolation"], r["priority"], r["fairness"]
    f = r["fleet"]
    lines = [
        f"{f['units']} sim units x {f['slots_per_unit']} slots, {f['step_ms']} ms a step; "
        f"phases of {r['duration_s']:g} s, flood at {r['flood_concurrency']} streams",
        f"{'TTFT':30} {'p50 ms':>8} {'p99 ms':>8} {'n':>5}",
    ]
    rows = [("b alone (interactive)", iso["alone"]["b"]), ("c alone (interactive)", iso["alone"]["c"]),
            ("b under batch flood", iso["flood_batch"]["b"]), ("c under batch flood", iso["flood_batch"]["c"]),
            ("b2 one class, flooded", iso["one_class"]["b2"]), ("c2 one class, flooded", iso["one_class"]["c2"])]  # fmt: skip
    for name, t in rows:
        lines.append(f"{name:30} {t['p50_s'] * 1000:>8.1f} {t['p99_s'] * 1000:>8.1f} {t['n']:>5}")
    lines += [
        f"isolation p99 ratio: b {iso['p99_ratio']['b']:.2f}x, c {iso['p99_ratio']['c']:.2f}x",
        f"one class p99 {iso['one_class_p99_s'] * 1000:.0f} ms; a flood request holds a slot "
        f"{iso['flood_request_s_p50'] * 1000:.0f} ms (p50): with every slot taken one frees "
        f"every {iso['slot_frees_every_s'] * 1000:.0f} ms",
        f"batch {pri['batch_tokens_per_s']:.0f} tokens/s under the interactive load, "
        f"{pri['batch_alone_tokens_per_s']:.0f} alone; {pri['batch_share_of_spare'] * 100:.0f} % "
        "of the spare capacity",
        "fairness (prompt + output tokens per 10 s window): "
        + "; ".join(
            ", ".join(f"{t} {n}" for t, n in w["tokens"].items()) + f" -> Jain {w['jain']:.3f}"
            for w in fair["windows"]
        ),
        "",
    ]
    lines += [f"{'met' if ok else 'MISSED'}: {goal}" for goal, ok in r["goals"].items()]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> str | None:
    why = no_plot()
    if why is not None:
        return why
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    iso = r["isolation"]
    names = ["b alone", "c alone", "b flood", "c flood", "b2 1-class", "c2 1-class"]
    values = [iso["alone"]["b"], iso["alone"]["c"], iso["flood_batch"]["b"],
              iso["flood_batch"]["c"], iso["one_class"]["b2"], iso["one_class"]["c2"]]  # fmt: skip
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [v["p99_s"] * 1000 for v in values], color="tab:blue", label="p99")
    left.bar(names, [v["p50_s"] * 1000 for v in values], color="tab:orange", label="p50")
    left.set_ylabel("TTFT, ms")
    left.set_title("light tenants' TTFT")
    left.legend()
    left.tick_params(axis="x", labelrotation=30)
    windows = r["fairness"]["windows"]
    for tenant in windows[0]["tokens"]:
        right.plot([w["tokens"][tenant] for w in windows], marker="o", label=tenant)
    right.set_xlabel("10 s window")
    right.set_ylabel("tokens served")
    right.set_title("backlogged tenants of different sizes")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="4 s phases, 10 s of fairness")
    parser.add_argument("--duration", type=float, default=0.0, help="s per phase (default 20)")
    parser.add_argument("--fair-duration", type=float, default=0.0,
                        help="s of the fairness phase (default 30)")  # fmt: skip
    parser.add_argument("--units", type=int, default=2, help="sim units")
    parser.add_argument("--slots", type=int, default=8, help="batch slots per unit")
    parser.add_argument("--step-ms", type=float, default=5.0, help="sim decode step, ms")
    parser.add_argument("--flood", type=int, default=0,
                        help="flood streams (default 10x a fair third of the slots)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result")
    limits.add_args(parser)
    args = parser.parse_args()
    args.duration = args.duration or (4.0 if args.quick else 20.0)
    args.fair_duration = args.fair_duration or (10.0 if args.quick else 30.0)
    return args


def run() -> int:
    args = parse_args()
    result: dict[str, Any] = {"goals": {}}
    if not args.limits_only:
        result = run_loop(until_signal(main(args)))
        print(table(result))
    if not args.skip_limits:  # its own fleet: two gateways sharing a Redis of its own
        with tempfile.TemporaryDirectory(prefix="bench-limits-") as tmp:
            result["limits"] = run_loop(until_signal(limits.run(args, Path(tmp))))
        result["goals"].update(result["limits"]["goals"])
        print(limits.table(result["limits"]))
        for goal, ok in result["limits"]["goals"].items():
            print(f"{'met' if ok else 'MISSED'}: {goal}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    why = no_plot() if args.limits_only else plot(result, args.out.with_suffix(".png"))
    limits_png = args.out.with_name(args.out.stem + "_limits.png")
    if why is None and "with_redis" in result.get("limits", {}):
        limits.plot(result["limits"], limits_png)
    print(why or f"wrote {args.out} and its PNGs")
    return 0 if all(result["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(run())

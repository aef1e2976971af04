"""bench/tenants's limits scenario (--quick --limits-only) runs end to end: a redis-server
of its own, two gateway replicas sharing it in front of sim units, a tenant offering 4x
its tokens_per_minute, then that Redis stopped mid-run. What does not depend on the
machine's load is asserted: only 200s and 429s came back, both replicas served in both
phases, and the tokens served stayed near the limit (the bench's own goals, +-5 % and
+-10 %, are in its table).

With LiteLLM's proxy as the reference (where bench/.venvs/litellm is installed), the
same arrivals through two LiteLLM proxies sharing a Redis: that its per-key limit held
across both, and that the light-load latency has all three targets."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


LITELLM = REPO / "bench" / ".venvs" / "litellm" / "bin" / "litellm"


def need_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip(
            "needs the redis-server binary on PATH (the bench starts a Redis of its own): apt-get install redis-server"
        )


async def quick_limits(tmp_path: Path, timeout_s: float, *flags: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "tenants.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "bench/tenants/run.py", "--quick", "--limits-only", "--out", str(out), *flags,
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with asyncio.timeout(timeout_s):
            output, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = output.decode(errors="replace")
    assert out.exists(), text
    return json.loads(out.read_text())["limits"], text


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_limits_scenario_quick(tmp_path: Path) -> None:
    need_redis()
    r, text = await quick_limits(tmp_path, 210, "--no-litellm")
    assert r["other_errors"] == {}, text
    assert r["statuses"]["429 rate_limited"] > 0, "it offered more than its limit"
    for phase in ("with_redis", "redis_stopped_each_replica_alone"):
        m = r[phase]
        assert all(t > 0 for t in m["per_replica_tokens_per_minute"]), text
        assert abs(m["error"]) < 0.25, text
    assert r["redis_stopped"] < r["redis_stopped_each_replica_alone"]["from"]
    assert "Redis stopped (limit / 2 each)" in text
    assert r["litellm"] == {"skipped": "left out (--no-litellm)"}
    assert set(r["latency"]["targets"]) == {"unit", "unitproxy"}


@pytest.mark.slow
@pytest.mark.timeout(480)
async def test_limits_scenario_quick_with_litellm(tmp_path: Path) -> None:
    need_redis()
    if not LITELLM.exists():
        pytest.skip(
            f"LiteLLM's proxy is not installed ({LITELLM}): bash bench/overhead/setup_peers.sh litellm"
        )
    r, text = await quick_limits(tmp_path, 450)
    lite = r["litellm"]
    assert "with_redis" in lite, text
    assert lite["tokens_per_request"] == r["tokens_per_request"], (
        "the same requests, the same usage"
    )
    assert lite["statuses"].get("429 throttling_error", 0) > 0, "its per-key limit refused some"
    # LiteLLM counts in fixed windows that start with a request: from the load's start to
    # Redis's stop at most floor(span / 60) + 1 windows began, each admitting about the
    # limit across both proxies (two that counted apart would admit twice that).
    span = lite["redis_stopped"] - lite["load_started"]
    windows = math.floor(span / 60.0) + 1
    served = sum(n for t, n in lite["served"] if t < lite["redis_stopped"])
    assert 0 < served <= 1.1 * windows * r["tokens_per_minute_limit"], text
    targets = r["latency"]["targets"]
    assert set(targets) == {"unit", "unitproxy", "LiteLLM"}, text
    for name, t in targets.items():
        assert t["failed"] == 0 and t["ttft_ms_p50"] and t["whole_ms_p50"], (name, text)
    assert "LiteLLM    shared Redis" in text

"""bench/tenants's limits scenario (--quick --limits-only) runs end to end: a redis-server
of its own, two gateway replicas sharing it in front of sim units, a tenant offering 4x
its tokens_per_minute, then that Redis stopped mid-run. What does not depend on the
machine's load is asserted: only 200s and 429s came back, both replicas served in both
phases, and the tokens served stayed near the limit (the bench's own goals, +-5 % and
+-10 %, are in its table)."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_limits_scenario_quick(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip(
            "needs the redis-server binary on PATH (the bench starts a Redis of its own): apt-get install redis-server"
        )
    out = tmp_path / "tenants.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "bench/tenants/run.py", "--quick", "--limits-only", "--out", str(out),
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with asyncio.timeout(210):
            output, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = output.decode(errors="replace")
    assert out.exists(), text
    r = json.loads(out.read_text())["limits"]
    assert r["other_errors"] == {}, text
    assert r["statuses"]["429 rate_limited"] > 0, "it offered more than its limit"
    for phase in ("with_redis", "redis_stopped_each_replica_alone"):
        m = r[phase]
        assert all(t > 0 for t in m["per_replica_tokens_per_minute"]), text
        assert abs(m["error"]) < 0.25, text
    assert r["redis_stopped"] < r["redis_stopped_each_replica_alone"]["from"]
    assert "Redis stopped (limit / 2 each)" in text

"""bench/limiter_cost.py --quick runs end to end against a redis-server of its own: each
mode measured, and with Redis every request counted there in a few round trips for all
of them (the replica's allotments, taken ahead in blocks). CPU figures depend on the
machine's load and are in its table, not asserted here."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
async def test_limiter_cost_bench_quick(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip(
            "needs the redis-server binary on PATH (the bench starts a Redis of its own): apt-get install redis-server"
        )
    out = tmp_path / "cost.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "bench/limiter_cost.py", "--quick", "--requests", "600", "--out",
        str(out), cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with asyncio.timeout(100):
            output, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = output.decode(errors="replace")
    assert proc.returncode == 0 and out.exists(), text
    result = json.loads(out.read_text())
    assert set(result["median"]) == {"none", "local", "redis"}
    shared = result["median"]["redis"]
    # every request counted in Redis through the replica's allotment (blocks of the
    # limits taken ahead, given back at close): a few script calls for all of them
    assert shared["redis_calls"] > 0, text
    assert 0 < shared["script_calls"] < 0.05, text
    assert "unreachable" not in text, text
    assert "sharing through Redis adds" in text

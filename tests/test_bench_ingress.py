"""bench/ingress --quick runs end to end and meets the goals that do not depend on how
busy this machine is, under the mixed attack and each single one (TTFT under attack is
in its table, not asserted here)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_ingress_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "ingress.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "bench/ingress/run.py", "--quick", "--out", str(out), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with asyncio.timeout(270):
            output, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert out.exists(), output.decode(errors="replace")
    result = json.loads(out.read_text())
    goals = result["goals"]
    assert goals["every hostile connection closed in time"], output.decode()
    assert goals["rss_max_mb <= 200"], output.decode()
    assert goals["no error"], output.decode()
    assert all(k["still_open"] == 0 for k in result["kinds"].values())
    # gRPC streams never read: each given up, its unit slot freed, memory bounded.
    assert goals["gRPC unread: every unread call given up, its unit slot freed"], output.decode()
    assert goals["gRPC unread: rss_max_mb <= 200"], output.decode()
    assert result["grpc_unread"]["ended"] == {"DEADLINE_EXCEEDED": 10}
    # Each single attack: RSS within its goal, no error and no empty reply.
    assert set(result["attacks"]) == {"pipelined", "declared-hold", "idle-sockets", "upgrade"}
    for name in result["attacks"]:
        assert goals[f"{name}: rss_max_mb <= 200"], output.decode()
        assert goals[f"{name}: no error"], output.decode()

"""bench/tenants --quick runs end to end: a sim fleet and a gateway with tenants on
loopback, every phase, the table, the JSON and the PNG. Its latency goals depend on how
busy this machine is and are in its table, not asserted here; what does not depend on
it is: no request failed, each tenant was served, and the fairness windows are there."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from bench.tenants.run import jain

REPO = Path(__file__).resolve().parent.parent


def test_jains_index() -> None:
    assert jain([5.0, 5.0, 5.0]) == 1.0
    assert jain([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_tenants_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "tenants.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "bench/tenants/run.py", "--quick", "--skip-limits", "--out", str(out),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
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
    result = json.loads(out.read_text())
    assert result["goals"]["no error"], text
    iso = result["isolation"]
    for phase in ("alone", "flood_batch"):
        assert all(t["n"] > 0 for t in iso[phase].values()), text
    assert result["priority"]["batch_tokens_per_s"] > 0, "batch is never starved"
    (window,) = result["fairness"]["windows"]
    assert all(n > 0 for n in window["tokens"].values()), text
    assert "Jain" in text and "isolation p99 ratio" in text

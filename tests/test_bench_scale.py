"""bench/scale's quick mode runs end to end, so it never breaks unseen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_run_measures_every_cell(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    argv = [sys.executable, "-m", "bench.scale.run", "--quick", "--sizes", "30",
            "--sources", "watch,watch-grpc,watch-http,poll,redis", "--policies", "lor,p2c,no-such-policy",
            "--window", "1.5", "--request-window", "1", "--out", str(out)]  # fmt: skip
    # 30 units on a budget of 60 reports/s: each asked for one every 0.5 s.
    env = {**os.environ, "UNITPROXY_GATEWAY__REPORT_BUDGET_PER_S": "60"}
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=220, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    cells = result["cells"]
    assert [(c["units"], c["source"]) for c in cells] == [
        (30, s) for s in ("watch", "watch-grpc", "watch-http", "poll", "redis")
    ]
    for cell in cells:
        assert "error" not in cell, cell
        assert cell["reports_per_s"] > 0 and cell["us_per_report"] > 0, cell
        assert cell["report_age_p99_s"] < 5, cell  # every unit's view stayed fresh
        assert not cell["gateway_problems"], cell
        if cell["source"] != "redis":  # the gateway's budget held (Redis: units decide)
            assert cell["reports_per_s"] < 60 * 1.3, cell
    watch = [c for c in cells if c["source"] == "watch"]
    for cell in watch:
        assert cell["through"]["requests"] > 0 and cell["through"]["errors"] == 0, cell
        assert cell["direct"]["requests"] > 0 and cell["direct"]["errors"] == 0, cell
    selection = {(r["policy"], r["units"]): r["us_per_request"] for r in result["selection"]}
    assert selection["no-such-policy", 30] is None
    assert selection["lor", 30] > 0 and selection["p2c", 30] > 0
    assert "goals:" in done.stdout

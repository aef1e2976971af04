"""Every bench program runs: its quick mode, through bench/all.py, must exit 0.

Benchmarks are programs, not timed tests; this only keeps them from breaking
silently (a check that no longer matches the product, a flag that went away). Each
runs its ``--quick`` mode narrowed further by its own flags where the quick mode alone
takes minutes, so each test stays within about two minutes on two busy cores. Peer
routers that are not installed are left out by the benches themselves, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# bench name (in bench/all.py) -> the flags that bound its quick mode here
SMOKE: dict[str, tuple[str, ...]] = {
    "sidecar_throughput": (),
    "overhead": ("--concurrency", "4", "--duration", "0.5", "--warmup", "0.2"),
    "overhead_instructions": ("--requests", "40", "--warmup", "10"),
    "routing": (
        "--loads",
        "85",
        "--duration",
        "3",
        "--warmup",
        "1",
        "--policies",
        "lor,random",
        "--saturation-window",
        "2",
    ),
    "plan": ("--duration", "10", "--max-units", "6"),
    "failover_detect": ("--scenarios", "kill-watch,stop-watch"),
    "failover_under_load": ("--scenarios", "sidecar-kill", "--settle", "1", "--watch", "2"),
}


def test_every_bench_has_a_smoke_run() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench.all import BENCHES
    finally:
        sys.path.remove(str(ROOT))
    needs_vllm = {"vllm_side_by_side"}  # its own venv; run with `bench/all.py --quick`
    # tests/test_bench_ingress.py, test_bench_tenants*.py and test_bench_limiter_cost.py
    # run these and check them
    own_test = {"ingress", "tenants", "limiter_cost"}
    assert {b.name for b in BENCHES} - needs_vllm - own_test == set(SMOKE)


# Seconds a smoke run may take; overhead_instructions runs every target under callgrind
# (about 50 times slower than the CPU), which a host busy with other work stretches.
SMOKE_TIMEOUT_S = {"overhead_instructions": 400}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_bench_quick_mode_runs(name: str, tmp_path: Path) -> None:
    argv = [sys.executable, "bench/all.py", "--quick", "--only", name, "--out", str(tmp_path),
            "--", *SMOKE[name]]  # fmt: skip
    timeout = SMOKE_TIMEOUT_S.get(name, 190)
    done = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    results = tmp_path / f"{name}.json"
    assert results.exists(), output[-3000:]
    assert json.loads(results.read_text()), f"{results} is empty"


@pytest.mark.timeout(620)
@pytest.mark.skipif(
    os.environ.get("UNITPROXY_EXPECT_COMPILED") == "1",
    reason="in the compiled copy itself; the source tree's run covers this target",
)
def test_overhead_runs_the_compiled_gateway(tmp_path: Path) -> None:
    """Target unitproxy+compiled builds build/compiled (minutes, once; .ci/run's compiled
    test run then finds it up to date) and is judged beside unitproxy; the same tree with
    tenants (unitproxy+compiled+tenants) runs beside it."""
    out = tmp_path / "overhead.json"
    argv = [sys.executable, "bench/overhead/run.py", "--quick", "--out", str(out),
            "--targets", "unitproxy,unitproxy+compiled,unitproxy+compiled+tenants",
            "--scenarios", "completions",
            "--concurrency", "2", "--duration", "0.5", "--warmup", "0.2"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    report = json.loads(out.read_text())
    rows = {r["target"]: r for r in report["rows"]}
    assert rows["unitproxy+compiled"]["requests_per_s"] > 0, output[-3000:]
    assert rows["unitproxy+compiled"]["error_count"] == 0
    statuses = [
        s
        for phase in report["phases"]
        for s in phase["targets"]
        if s["name"] == "unitproxy+compiled"
    ]
    assert statuses and "compiled" in statuses[0]["version"], statuses
    assert any(v["target"].startswith("[unitproxy+compiled] ") for v in report["verdicts"])
    (tenants,) = [s for p in report["phases"] for s in p["targets"]
                  if s["name"] == "unitproxy+compiled+tenants"]  # fmt: skip
    assert "compiled" in tenants["version"] and "--tenants-file" in tenants["argv"], tenants
    assert rows["unitproxy+compiled+tenants"]["requests_per_s"] > 0, output[-3000:]
    assert rows["unitproxy+compiled+tenants"]["error_count"] == 0


@pytest.mark.timeout(200)
def test_overhead_runs_the_gateway_with_tenants(tmp_path: Path) -> None:
    """Target unitproxy+tenants: this tree's gateway with a tenants file and a Redis of the
    bench's own, beside unitproxy without and a commit's gateway with tenants
    (unitproxy+tenants@REF); every target's load sends the tenant's key."""
    out = tmp_path / "overhead.json"
    argv = [sys.executable, "bench/overhead/run.py", "--quick", "--out", str(out),
            "--targets", "unitproxy,unitproxy+tenants,unitproxy+tenants@HEAD",
            "--scenarios", "completions,grpc",
            "--concurrency", "2", "--duration", "0.5", "--warmup", "0.2"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=190, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    report = json.loads(out.read_text())
    rows = [r for r in report["rows"] if r["target"] == "unitproxy+tenants"]
    assert {r["scenario"] for r in rows} == {"completions", "grpc"}, output[-3000:]
    assert all(r["requests_per_s"] > 0 and r["error_count"] == 0 for r in rows), rows
    for name in ("unitproxy+tenants", "unitproxy+tenants@HEAD"):
        (status,) = [s for p in report["phases"] for s in p["targets"]
                     if s["name"] == name]  # fmt: skip
        assert "--tenants-file" in status["argv"] and "--redis-url" in status["argv"]
        assert ("commit" in status["version"]) == name.endswith("@HEAD"), status
        assert any(r["target"] == name and r["error_count"] == 0 for r in report["rows"])


@pytest.mark.timeout(200)
def test_overhead_runs_a_tracing_gateway(tmp_path: Path) -> None:
    """Targets unitproxy+traceR: this tree's gateway tracing R of its requests to the
    stand-in collector, beside unitproxy (the tracing A/B in docs/BENCHMARKS.md)."""
    out = tmp_path / "overhead.json"
    argv = [sys.executable, "bench/overhead/run.py", "--quick", "--out", str(out),
            "--targets", "unitproxy,unitproxy+trace1", "--scenarios", "completions",
            "--concurrency", "2", "--duration", "0.5", "--warmup", "0.2"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=190, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    report = json.loads(out.read_text())
    rows = {r["target"]: r for r in report["rows"]}
    assert rows["unitproxy+trace1"]["requests_per_s"] > 0, output[-3000:]
    assert rows["unitproxy+trace1"]["error_count"] == 0
    statuses = [
        s for p in report["phases"] for s in p["targets"] if s["name"] == "unitproxy+trace1"
    ]
    assert statuses and "tracing 100%" in statuses[0]["version"], statuses
    assert "--otlp-endpoint" in statuses[0]["argv"], statuses
    # The collector took every export: the gateway logged no failed one.
    assert not [line for line in statuses[0]["log_problems"] if "traces:" in line], statuses

"""Unit health with real follower processes: kill, stop, worker exit, stall, recovery hook.

Times are asserted only against generous bounds; bench/failover measures them.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from proxy.load import UnitState
from proxy.sidecar.server import Sidecar
from tests.conftest import SidecarFactory, wait_until
from tests.procs import Procs

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]

FAST_HEALTH = {
    "interval_s": 0.1,
    "timeout_s": 0.2,
    "unhealthy_threshold": 3,
    "healthy_threshold": 2,
}


def state(sidecar: Sidecar) -> UnitState:
    return sidecar.health.state


def node(sidecar: Sidecar, name: str) -> tuple[bool, str]:
    status = next(n for n in sidecar.health.nodes() if n.name == name)
    return status.healthy, status.reason


async def test_sigkill_of_follower_marks_unit_not_serving_at_once(
    start_sidecar: SidecarFactory, procs: Procs
) -> None:
    follower = await procs.follower("--node-name", "f1")
    # Long probe interval: only the held Watch stream can notice this fast.
    sidecar = await start_sidecar(
        sidecar={"followers": [f"f1={follower.grpc_target}"]},
        health={"interval_s": 5.0, "timeout_s": 1.0},
    )
    assert node(sidecar, "f1") == (True, "")
    follower.signal(signal.SIGKILL)
    started = time.monotonic()
    await wait_until(lambda: state(sidecar) is UnitState.NOT_SERVING, 3.0, "NOT_SERVING")
    assert time.monotonic() - started < 1.0, "the Watch stream, not the 5 s probe, noticed"
    assert "watch" in node(sidecar, "f1")[1]
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{sidecar.http_url}/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
        async with http.get(f"{sidecar.http_url}/ready") as resp:
            ready = await resp.json()
    assert resp.status == 503 and ready["state"] == "NOT_SERVING"
    f1 = next(n for n in ready["nodes"] if n["name"] == "f1")
    assert f1["healthy"] is False and f1["role"] == "follower" and f1["reason"]


async def test_sigstop_is_caught_by_timeout_and_sigcont_recovers(
    start_sidecar: SidecarFactory, procs: Procs
) -> None:
    follower = await procs.follower("--node-name", "f1")
    sidecar = await start_sidecar(
        sidecar={"followers": [f"f1={follower.grpc_target}"]}, health=FAST_HEALTH
    )
    follower.signal(signal.SIGSTOP)
    await wait_until(lambda: state(sidecar) is UnitState.NOT_SERVING, 5.0, "NOT_SERVING")
    assert "no answer" in node(sidecar, "f1")[1]
    follower.signal(signal.SIGCONT)
    await wait_until(lambda: state(sidecar) is UnitState.SERVING, 5.0, "SERVING again")
    transitions = sidecar.health_metrics.health_transitions
    assert transitions.labels("f1", "unhealthy")._value.get() == 1
    assert transitions.labels("f1", "healthy")._value.get() == 2  # first time, then recovery


@pytest.mark.parametrize("probe", ["grpc", "http", "tcp"])
async def test_polling_probes_see_a_dead_follower(
    start_sidecar: SidecarFactory, procs: Procs, probe: str
) -> None:
    follower = await procs.follower("--node-name", "f1")
    target = follower.http_url + "/ready" if probe == "http" else follower.grpc_target
    sidecar = await start_sidecar(
        sidecar={"followers": [f"f1={target}"], "probe": probe}, health=FAST_HEALTH
    )
    follower.signal(signal.SIGKILL)
    await wait_until(lambda: state(sidecar) is UnitState.NOT_SERVING, 5.0, "NOT_SERVING")


async def test_supervised_worker_exit_makes_node_not_serving(
    start_sidecar: SidecarFactory, procs: Procs, tmp_path: Path
) -> None:
    flag = tmp_path / "stop-worker"
    worker = [
        sys.executable, "-c",
        f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.02)\nraise SystemExit(3)",
    ]  # fmt: skip
    follower = await procs.follower("--node-name", "f1", worker=worker)
    sidecar = await start_sidecar(sidecar={"followers": [f"f1={follower.grpc_target}"]},
                                  health={"interval_s": 5.0})  # fmt: skip
    flag.touch()
    await wait_until(lambda: state(sidecar) is UnitState.NOT_SERVING, 5.0, "NOT_SERVING")
    assert "NOT_SERVING" in node(sidecar, "f1")[1]
    async with aiohttp.ClientSession() as http, http.get(f"{follower.http_url}/ready") as resp:
        assert resp.status == 503
        assert "status 3" in (await resp.json())["failing"]["worker"]
    assert follower.returncode is None, "the agent stays up to say so"


async def test_follower_forwards_sigterm_to_its_worker(procs: Procs, tmp_path: Path) -> None:
    got = tmp_path / "got-sigterm"
    worker = [
        sys.executable, "-c",
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(got)!r}, 'w').close(), sys.exit(0)))\n"
        "time.sleep(60)",
    ]  # fmt: skip
    follower = await procs.follower("--node-name", "f1", worker=worker)
    await asyncio.sleep(0.3)  # let the worker install its handler
    follower.signal(signal.SIGTERM)
    assert await follower.wait(10) == 0
    assert got.exists()


async def test_follower_checks_decide_node_health(procs: Procs, tmp_path: Path) -> None:
    beat = tmp_path / "heartbeat"
    beat.touch()
    sleeper = await asyncio.create_subprocess_exec("sleep", "30")
    follower = await procs.follower(
        "--node-name", "f1",
        "--check", f"process:{sleeper.pid}",
        "--check", f"heartbeat:{beat}:30",
        "--check", "command:true",
        "--health-interval", "0.1", "--health-timeout", "0.5", "--unhealthy-threshold", "2",
    )  # fmt: skip
    async with aiohttp.ClientSession() as http:

        async def ready() -> tuple[int, dict[str, str]]:
            async with http.get(f"{follower.http_url}/ready") as resp:
                return resp.status, (await resp.json())["failing"]

        async with asyncio.timeout(10):
            while (await ready())[0] != 200:
                await asyncio.sleep(0.05)
        sleeper.kill()
        await sleeper.wait()
        async with asyncio.timeout(10):
            while (status := await ready())[0] != 503:
                await asyncio.sleep(0.05)
        assert "is gone" in status[1][f"process:{sleeper.pid}"]


async def test_stalled_engine_makes_leader_unhealthy(start_sidecar: SidecarFactory) -> None:
    sidecar = await start_sidecar(
        sim={"hang_after_requests": 1},
        health={**FAST_HEALTH, "stall_timeout_s": 0.3},
    )
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(
            http.post(f"{sidecar.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 5})
        )
        await wait_until(lambda: state(sidecar) is UnitState.NOT_SERVING, 5.0, "NOT_SERVING")
        assert "no progress" in node(sidecar, "leader")[1]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await wait_until(lambda: sidecar.core.outstanding == 0, what="outstanding 0")


async def test_no_flapping_while_the_engine_is_saturated(start_sidecar: SidecarFactory) -> None:
    # Two slots, eight requests: six wait in the engine queue, yet tokens keep coming.
    sidecar = await start_sidecar(
        sim={"max_num_seqs": 2, "decode_step_ms": 5.0},
        sidecar={"capacity": 8},
        health={**FAST_HEALTH, "stall_timeout_s": 0.5},
    )
    seen: set[UnitState] = set()

    async def sample() -> None:
        while True:
            seen.add(state(sidecar))
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    async with aiohttp.ClientSession() as http:

        async def one() -> int:
            body = {"prompt": "x", "max_tokens": 60}
            async with http.post(f"{sidecar.http_url}/v1/completions", json=body) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(one() for _ in range(8)))
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    assert statuses == [200] * 8
    assert seen == {UnitState.SERVING}
    assert sidecar.health_metrics.health_transitions.labels("leader", "unhealthy")._value.get() == 0


async def test_recovery_hook_runs_once_per_backoff_window(
    start_sidecar: SidecarFactory, procs: Procs, tmp_path: Path
) -> None:
    record = tmp_path / "recovery.log"
    follower = await procs.follower("--node-name", "f1")
    sidecar = await start_sidecar(
        sidecar={
            "unit_id": "unit-r",
            "followers": [f"f1={follower.grpc_target}"],
            "recovery": {
                "command": f'echo "$UNITPROXY_UNIT_ID $UNITPROXY_FAILED_NODES" >> {record}',
                "grace_s": 0.3,
                "backoff_initial_s": 1.0,
                "backoff_max_s": 10.0,
            },
        },
    )
    follower.signal(signal.SIGKILL)
    await wait_until(lambda: state(sidecar) is UnitState.NOT_SERVING, 5.0, "NOT_SERVING")
    started = time.monotonic()
    await wait_until(lambda: record.exists(), 5.0, "first recovery run")
    assert time.monotonic() - started >= 0.25, "not before the grace period"
    # Runs at about 0.3 s, 1.3 s and 3.3 s after NOT_SERVING: two within 2.5 s.
    await asyncio.sleep(2.5 - (time.monotonic() - started))
    lines = record.read_text().splitlines()
    assert lines == ["unit-r f1", "unit-r f1"]
    assert sidecar.recovery is not None and sidecar.recovery.runs == 2

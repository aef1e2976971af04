"""`unitproxy up`: a whole local cell as real processes on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy import procutil
from proxy import settings as config
from proxy.cli import build_parser, cli_values
from proxy.up import Cell, allocate_ports, plan
from tests.procs import Proc, Procs

STARTUP_TIMEOUT_S = 60
FAST = ("--health-interval", "0.2", "--sim-decode-step-ms", "1")


def _alive(pid: int) -> bool:
    """Running, and not a zombie (an orphan's new parent may be slow to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill()
    return stat.rpartition(")")[2].split()[0] != "Z"


def _pids(state: dict[str, Any]) -> dict[str, int]:
    pids = {"gateway": state["gateway"]["pid"]}
    for unit in state["units"]:
        pids[unit["unit_id"]] = unit["sidecar"]["pid"]
        pids.update({f["node"]: f["pid"] for f in unit["followers"]})
    return pids


async def _until(predicate: Any, timeout_s: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


async def _start_up(procs: Procs, tmp_path: Path, *args: str) -> tuple[Proc, dict[str, Any]]:
    """`unitproxy up` in a subprocess; returns once its state file is written."""
    state_file = tmp_path / "cell" / "cell.json"
    up = await procs.start("up", "--state-file", str(state_file), *FAST, *args, name="up")

    def written() -> bool:
        if up.returncode is not None:
            pytest.fail(f"up exited with {up.returncode}:\n{up.output()}")
        return state_file.exists()

    await _until(written, STARTUP_TIMEOUT_S, "the state file")
    return up, json.loads(state_file.read_text())


@contextlib.asynccontextmanager
async def _reaping(state: dict[str, Any]) -> Any:
    """SIGKILL whatever the test left of the cell, so no test leaves processes behind."""
    try:
        yield
    finally:
        for pid in _pids(state).values():
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


async def _ready(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/ready") as response:
        return response.status


async def _complete(http: aiohttp.ClientSession, url: str) -> tuple[int, str, dict[str, Any]]:
    body = {"prompt": "hello", "max_tokens": 4}
    async with http.post(f"{url}/v1/completions", json=body) as response:
        return response.status, response.headers.get("x-unitproxy-unit", ""), await response.json()


# --- the plan: names, ports, flags (no processes) ---------------------------------


def _plan(**sections: dict[str, Any]) -> Cell:
    settings = config.load(sections)
    return plan(settings, allocate_ports(settings.up))


def test_plan_names_ports_and_flags() -> None:
    cell = _plan(
        up={"units": 2, "followers": 2, "base_port": 20000},
        engine={"sim": {"seed": 7}},
        sidecar={"capacity": 8},
        gateway={"policy": "p2c"},
    )
    ports = [p for c in cell.children for p in (c.http_port, c.grpc_port)]
    assert sorted(ports) == list(range(20000, 20000 + 2 * (1 + 2 * 3)))
    assert [f.name for u in cell.units for f in u.followers] == ["u0-f0", "u0-f1", "u1-f0", "u1-f1"]
    sidecar = cell.units[1].sidecar
    args = " ".join(sidecar.args)
    assert args.startswith("sidecar --host 127.0.0.1 --log-level info")
    assert "--unit-id unit-1" in args
    assert f"--follower u1-f1=127.0.0.1:{cell.units[1].followers[1].grpc_port}" in args
    assert "--sim-seed 7" in args and "--capacity 8" in args
    assert "--engine" not in args  # only what was given goes on
    gateway = " ".join(cell.gateway.args)
    unit0 = cell.units[0].sidecar
    assert f"--unit unit-0={unit0.http_url},{unit0.grpc_target}" in gateway
    assert "--policy p2c" in gateway
    assert cell.units[0].followers[0].log_path == Path(".unitproxy/logs/follower-u0-f0.log")
    assert cell.gateway.log_path == Path(".unitproxy/logs/gateway.log")


def test_the_gateway_and_the_sidecars_share_a_resume_secret_in_their_environment() -> None:
    cell = _plan(up={"units": 2, "followers": 1})
    secret = cell.gateway.env["UNITPROXY_SERVER__RESUME_SECRET"]
    assert len(secret) == 64  # 32 random bytes, hex
    assert [u.sidecar.env["UNITPROXY_SERVER__RESUME_SECRET"] for u in cell.units] == [secret] * 2
    assert all(secret not in " ".join(c.args) for c in cell.children)
    assert _plan().gateway.env["UNITPROXY_SERVER__RESUME_SECRET"] != secret  # a new one
    given = _plan(server={"resume_secret": "our-fleet"})
    assert given.gateway.env["UNITPROXY_SERVER__RESUME_SECRET"] == "our-fleet"
    assert given.units[0].sidecar.env["UNITPROXY_SERVER__RESUME_SECRET"] == "our-fleet"


def test_units_of_different_models() -> None:
    cell = _plan(
        up={"units": 3, "followers": 0, "unit_models": ["llama", "qwen"]},
        engine={"served_model_name": "ignored"},
        gateway={"policy": "prefix"},
    )
    served = [
        u.sidecar.args[u.sidecar.args.index("--served-model-name", -3) + 1] for u in cell.units
    ]
    assert served == ["llama", "qwen", "llama"]
    assert "--policy prefix" in " ".join(cell.gateway.args)


def test_up_passes_the_otlp_endpoint_to_every_process() -> None:
    args = build_parser().parse_args(
        ["up", "--units", "2", "--otlp-endpoint", "http://collector:4318",
         "--trace-sample-ratio", "0.25"]
    )  # fmt: skip
    cell = plan(config.load(cli_values(args)), allocate_ports(config.load({}).up))
    traced = [cell.gateway, *(u.sidecar for u in cell.units)]
    for child in traced:
        args_text = " ".join(child.args)
        assert "--otlp-endpoint http://collector:4318" in args_text, child.name
        assert "--trace-sample-ratio 0.25" in args_text, child.name
    assert all("--otlp-endpoint" not in " ".join(f.args) for u in cell.units for f in u.followers)


def test_up_passes_the_tenants_file_to_the_gateway(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    args = build_parser().parse_args(["up", "--tenants-file", str(path)])
    cell = plan(config.load(cli_values(args)), allocate_ports(config.load({}).up))
    assert f"--tenants-file {path}" in " ".join(cell.gateway.args)
    assert "--tenants-file" not in " ".join(cell.units[0].sidecar.args)


def test_free_ports_are_distinct() -> None:
    cell = _plan(up={"units": 3, "followers": 2})
    ports = [p for c in cell.children for p in (c.http_port, c.grpc_port)]
    assert len(set(ports)) == len(ports) == 2 * (1 + 3 * 3)
    # Below the ephemeral range: no outgoing connection can take one before it is bound.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(procutil.LOW_PORT <= p < low for p in ports), ports


def test_base_port_must_leave_room() -> None:
    with pytest.raises(config.ConfigError) as exc:
        config.load({"up": {"base_port": 65530}})
    assert exc.value.problems == [
        "up.base_port: leaves too few ports for 10; use at most 65526 (got 65530)"
    ]


# --- real cells ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_up_starts_a_cell_and_sigterm_stops_it(
    procs: Procs, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    up, state = await _start_up(procs, tmp_path, "--units", "2", "--followers", "1")
    async with _reaping(state):
        assert [u["unit_id"] for u in state["units"]] == ["unit-0", "unit-1"]
        assert [[f["node"] for f in u["followers"]] for u in state["units"]] == [
            ["u0-f0"],
            ["u1-f0"],
        ]
        assert set(state["gateway"]) == {"http", "grpc", "pid"}
        for unit in state["units"]:
            assert set(unit["sidecar"]) == {"http", "grpc", "pid"}
            assert set(unit["followers"][0]) == {"node", "grpc", "http", "pid"}
            assert await _ready(http, unit["sidecar"]["http"]) == 200
            assert await _ready(http, unit["followers"][0]["http"]) == 200
        pids = _pids(state)
        assert all(_alive(pid) for pid in pids.values()), pids
        assert "u1-f0" in up.output() and str(pids["gateway"]) in up.output()  # the table
        assert (tmp_path / "cell" / "logs" / "sidecar-unit-0.log").exists()

        assert await _ready(http, state["gateway"]["http"]) == 200
        status, unit_id, body = await _complete(http, state["gateway"]["http"])
        assert status == 200, body
        assert unit_id in ("unit-0", "unit-1")

        up.signal(signal.SIGTERM)
        assert await up.wait(20) == 0
        gone = [name for name, pid in pids.items() if _alive(pid)]
        assert gone == [], f"still running after up exited: {gone}"
        assert not (tmp_path / "cell" / "cell.json").exists(), "its pids are gone"


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_children_stop_when_up_is_killed(procs: Procs, tmp_path: Path) -> None:
    up, state = await _start_up(procs, tmp_path, "--units", "2", "--followers", "1")
    async with _reaping(state):
        pids = _pids(state)
        up.signal(signal.SIGKILL)
        assert await up.wait(10) == -signal.SIGKILL
        await _until(
            lambda: not any(_alive(pid) for pid in pids.values()), 15, "the children to exit"
        )


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_dead_follower_is_logged_and_the_rest_keep_running(
    procs: Procs, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    up, state = await _start_up(procs, tmp_path)
    async with _reaping(state):
        pids = _pids(state)
        os.kill(pids["u0-f0"], signal.SIGKILL)
        await _until(
            lambda: f"follower u0-f0 (pid {pids['u0-f0']}) exited: signal SIGKILL" in up.output(),
            10,
            "up to log the follower's exit",
        )
        unit0, unit1 = (u["sidecar"]["http"] for u in state["units"])
        deadline = asyncio.get_running_loop().time() + 10
        while await _ready(http, unit0) != 503:
            assert asyncio.get_running_loop().time() < deadline, "unit-0 still ready"
            await asyncio.sleep(0.1)
        assert await _ready(http, unit1) == 200
        assert [n for n, pid in pids.items() if not _alive(pid)] == ["u0-f0"]
        assert up.returncode is None

        assert await _ready(http, state["gateway"]["http"]) == 200
        status, unit_id, body = await _complete(http, state["gateway"]["http"])
        assert (status, unit_id) == (200, "unit-1"), body

        up.signal(signal.SIGTERM)
        assert await up.wait(20) == 0


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_child_that_cannot_start_fails_up_and_stops_the_rest(
    procs: Procs, tmp_path: Path
) -> None:
    state_file = tmp_path / "cell" / "cell.json"
    # No vLLM here (and were it installed, no model by that name): the sidecars exit.
    up = await procs.start(
        "up", "--state-file", str(state_file), "--engine", "vllm", "--model", "/nonexistent",
        "--log-level", "debug", name="up",
    )  # fmt: skip
    assert await up.wait(STARTUP_TIMEOUT_S) == 1
    output = up.output()
    assert "unitproxy up: sidecar unit-" in output
    # The cause, from the end of the sidecar's log, in up's own output.
    assert "while the cell was starting: unitproxy: invalid configuration: engine.kind: " in output
    assert "; its log: " in output
    assert str(tmp_path / "cell" / "logs" / "sidecar-unit-") in output
    assert not state_file.exists()
    pids = [int(pid) for pid in re.findall(r"started \S+(?: \S+)? \(pid (\d+)\)", output)]
    assert len(pids) == 5, output
    assert [pid for pid in pids if _alive(pid)] == []


def test_table_values_reach_the_sidecars_as_json() -> None:
    from proxy.flags import ENGINE
    from proxy.settings import load
    from proxy.up import given_flags, given_secrets

    settings = load({"engine": {"engine_args": {"enforce_eager": True}, "kind": "sim",
                                "speculative_config": {"n": 2}}})  # fmt: skip
    argv = given_flags(settings, ENGINE)
    assert argv[argv.index("--speculative-config") + 1] == '{"n": 2}'
    # engine_args may carry a token: the environment, not the command line, takes them.
    assert "--engine-args" not in argv
    env = given_secrets(settings, ENGINE)
    assert env == {"UNITPROXY_ENGINE__ENGINE_ARGS": '{"enforce_eager": true}'}


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_restart_brings_a_dead_child_back_and_ctrl_c_stops_it_too(
    procs: Procs, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    up, state = await _start_up(procs, tmp_path, "--units", "1", "--followers", "1", "--restart")
    state_file = tmp_path / "cell" / "cell.json"
    seen = [state]
    async with _reaping(state):
        pids = _pids(state)
        os.kill(pids["u0-f0"], signal.SIGKILL)

        def new_follower() -> bool:
            current = json.loads(state_file.read_text())
            return _pids(current)["u0-f0"] != pids["u0-f0"]

        await _until(new_follower, 15, "the state file to list the restarted follower")
        restarted = json.loads(state_file.read_text())
        seen.append(restarted)
        new_pid = _pids(restarted)["u0-f0"]
        assert _alive(new_pid)
        assert restarted["units"][0]["followers"] == [
            {**state["units"][0]["followers"][0], "pid": new_pid}
        ]  # same ports
        output = up.output()
        assert f"follower u0-f0 (pid {pids['u0-f0']}) exited: signal SIGKILL" in output
        assert "restarting it in 1 s" in output
        assert f"restarted follower u0-f0 (pid {new_pid}, was {pids['u0-f0']})" in output
        # The unit comes back by itself.
        deadline = asyncio.get_running_loop().time() + 20
        while await _ready(http, state["units"][0]["sidecar"]["http"]) != 200:
            assert asyncio.get_running_loop().time() < deadline, "unit-0 did not come back"
            await asyncio.sleep(0.1)

        up.signal(signal.SIGINT)
        assert await up.wait(20) == 0
        left = [pid for pid in [*pids.values(), new_pid] if _alive(pid)]
        assert left == [], f"still running after up exited: {left}"
        assert not state_file.exists(), "the state file of a stopped cell is removed"
    for old in seen:
        assert not any(_alive(pid) for pid in _pids(old).values())


@contextlib.contextmanager
def _taken_base(count: int) -> Any:
    """A port held by a listener whose next ``count - 1`` ports are free."""
    for base in procutil.free_ports(20):
        with contextlib.ExitStack() as stack:
            taken = stack.enter_context(socket.socket())
            try:
                taken.bind(("127.0.0.1", base))
                for port in range(base + 1, base + count):
                    with socket.socket() as probe:
                        probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            taken.listen()
            yield base
            return
    pytest.fail(f"no port with {count - 1} free ports after it")


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_a_child_whose_port_is_taken_says_so_in_ups_output(
    procs: Procs, tmp_path: Path
) -> None:
    with _taken_base(4) as base:
        state_file = tmp_path / "cell" / "cell.json"
        # --base-port: the gateway's HTTP port comes first, and it is taken.
        up = await procs.start("up", "--state-file", str(state_file), "--units", "1",
                               "--followers", "0", "--base-port", str(base), name="up")  # fmt: skip
        assert await up.wait(STARTUP_TIMEOUT_S) == 1
    output = up.output()
    assert (
        f"gateway exited (status 1) while the cell was starting: unitproxy: cannot listen on "
        f"127.0.0.1:{base} (HTTP): Address already in use; its log: "
    ) in output, output
    assert not state_file.exists()


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_up_with_a_tenants_file_makes_its_gateway_ask_for_keys(
    procs: Procs, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "team"\nkeys = ["sk-team"]\nrequests_per_minute = 5\n')
    up, state = await _start_up(procs, tmp_path, "--units", "1", "--followers", "0",
                                "--tenants-file", str(tenants))  # fmt: skip
    async with _reaping(state):
        url = state["gateway"]["http"]
        status, _, _ = await _complete(http, url)
        assert status == 401
        body = {"prompt": "hello", "max_tokens": 4}
        headers = {"Authorization": "Bearer sk-team"}
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            assert response.status == 200
            assert response.headers["x-ratelimit-limit-requests"] == "5"
        up.signal(signal.SIGTERM)
        assert await up.wait(20) == 0

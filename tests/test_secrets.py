"""Secrets stay secret: not on a command line (`ps`), not in a log, not in /metrics.

`unitproxy up` hands the engine's secrets to its sidecars through the environment; the
vLLM engine logs its arguments without the values of ``engine_args`` (a hub token goes
there); a sidecar and a gateway given every kind of key log none of them, at debug.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import aiohttp
import pytest

from engine.vllm import loggable_kwargs
from proxy.gateway.server import Gateway
from proxy.settings import load
from tests.conftest import GatewayFactory, SidecarFactory, wait_until
from tests.procs import Procs, free_ports
from tests.test_up import _pids, _reaping, _start_up

UPSTREAM_KEY = "sk-upstream-7a1b2c"
HUB_TOKEN = "hf_token_3e4f5a"
API_KEY = "sk-client-0d9c8b"
ADMIN_TOKEN = "admin-6b5a4c"
UNIT_KEY = "sk-unit-1f2e3d"


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def environ(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n").decode()


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_up_passes_secrets_to_children_in_their_environment(
    procs: Procs, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = tmp_path / "up.toml"
    config.write_text(
        f'[engine]\nupstream_api_key = "{UPSTREAM_KEY}"\n'
        f'engine_args = {{hf_token = "{HUB_TOKEN}"}}\n'
    )
    up, state = await _start_up(
        procs, tmp_path, "--config", str(config), "--units", "1", "--followers", "0",
        "--log-level", "debug",
    )  # fmt: skip
    async with _reaping(state):
        pids = _pids(state)
        sidecar = pids["unit-0"]
        for name, pid in {"up": up.pid, **pids}.items():
            line = cmdline(pid)
            assert UPSTREAM_KEY not in line and HUB_TOKEN not in line, f"{name}: {line}"
        env = environ(sidecar)
        assert f"UNITPROXY_ENGINE__UPSTREAM_API_KEY={UPSTREAM_KEY}" in env
        assert json.loads(env.split("UNITPROXY_ENGINE__ENGINE_ARGS=", 1)[1].split("\n")[0]) == {
            "hf_token": HUB_TOKEN
        }
        for url in (state["gateway"]["http"], state["units"][0]["sidecar"]["http"]):
            async with http.get(f"{url}/metrics") as resp:
                text = await resp.text()
            assert UPSTREAM_KEY not in text and HUB_TOKEN not in text
        up.signal(signal.SIGTERM)
        assert await up.wait(20) == 0
    logs = [up.output(), *(p.read_text() for p in (tmp_path / "cell" / "logs").glob("*.log"))]
    assert "started sidecar" in up.output()  # the debug line that names the command
    for text in logs:
        assert UPSTREAM_KEY not in text and HUB_TOKEN not in text


def test_vllm_engine_arguments_are_logged_without_engine_args_values() -> None:
    settings = load(
        {"engine": {"kind": "vllm", "model": "m", "engine_args": {"hf_token": HUB_TOKEN}}}
    ).engine
    kwargs = {"model": "m", "hf_token": HUB_TOKEN, "tensor_parallel_size": 1}
    shown = loggable_kwargs(kwargs, settings)
    assert HUB_TOKEN not in shown
    assert "model='m'" in shown and "hf_token=<hidden>" in shown


async def test_no_key_in_logs_or_metrics(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    sidecar = await start_sidecar(
        server={"api_keys": [UNIT_KEY], "admin_token": ADMIN_TOKEN},
        engine={"upstream_api_key": UPSTREAM_KEY},
    )
    gateway = await start_gateway([sidecar], unit_api_key=UNIT_KEY)
    body = {"prompt": "x", "max_tokens": 1}
    async with http.post(f"{gateway.http_url}/v1/completions", json=body) as resp:
        assert resp.status == 200  # the gateway presents the unit key
    for key in ("nope", API_KEY):
        headers = {"Authorization": f"Bearer {key}"}
        async with http.post(
            f"{sidecar.http_url}/v1/completions", json=body, headers=headers
        ) as resp:
            assert resp.status == 401
    secrets = (API_KEY, ADMIN_TOKEN, UNIT_KEY, UPSTREAM_KEY)
    for url in (sidecar.http_url, gateway.http_url):
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        assert not [s for s in secrets if s in text]
    assert not [s for s in secrets if s in caplog.text]
    settings = load(
        {"server": {"api_keys": [API_KEY]}, "engine": {"upstream_api_key": UPSTREAM_KEY}}
    )
    assert not [s for s in secrets if s in repr(settings)]


async def test_errors_name_units_by_id_not_address(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    # The unit reports SERVING over gRPC, but its HTTP port refuses connections.
    reports = await start_sidecar(sidecar={"unit_id": "a"})
    closed = free_ports(1)[0]
    settings = load({
        "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
        "gateway": {"units": [f"a=http://127.0.0.1:{closed},{reports.grpc_target}"],
                    "unit_api_key": UNIT_KEY, "retries": 0},
    })  # fmt: skip
    async with Gateway(settings) as gw:
        await wait_until(lambda: bool(gw.router.serving()), what="a reports SERVING")
        body = {"prompt": "x", "max_tokens": 1}
        async with http.post(f"{gw.http_url}/v1/completions", json=body) as resp:
            assert resp.status == 503
            text = await resp.text()
        async with http.get(f"{gw.http_url}/v1/models") as resp:
            assert resp.status == 200  # from the reports: no call to the unit
            models = await resp.text()
        assert '"units":["a"]' in models.replace(" ", "")
        text += models
    assert "unit a" in text
    assert str(closed) not in text and "127.0.0.1" not in text, text

"""A real Prometheus against a real cell, with the shipped rules and dashboard.

Prometheus (Debian package ``prometheus``; .ci/run installs it) scrapes every process
of a cell of real unitproxy processes every second and evaluates
deploy/prometheus/rules.yaml. The test puts traffic on the cell, then holds the
monitoring we ship to what an operator needs: every dashboard query returns data
(or is on the short list of queries known to be empty in such a cell, each with its
reason; the gateway runs tenants, one of them over its limit, so the Tenants row has
data), a stream that broke after it started counts under its error status, and
killing a sidecar makes the shipped alerts go pending. The gateway's count of a
broken stream is checked last: until the gateway counts it under its error status the
test ends as an expected failure there, every other check having passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.procs import HOST, Proc, Procs, free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "unitproxy.json"
SIM = ("--sim-decode-step-ms", "2", "--health-interval", "0.2", "--log-level", "warning")
# Dashboard queries that return nothing in this cell, and why; any other empty one fails.
KNOWN_EMPTY: dict[str, str] = {}
# The gateway's tenants: the traffic comes as "acme"; "capped" sends two requests in a
# minute, so its second is refused 429 rate_limited (whatever the minute's boundary: the
# sliding window still counts the first) and the limited series has data.
TENANTS = """
[[tenant]]
name = "acme"
keys = ["sk-acme"]

[[tenant]]
name = "capped"
keys = ["sk-capped"]
requests_per_minute = 1
"""
ACME = {"Authorization": "Bearer sk-acme"}
CAPPED = {"Authorization": "Bearer sk-capped"}


def _prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("prometheus is not installed (Debian package prometheus; .ci/run installs it)")
    return path


class Prometheus:
    def __init__(self, url: str, http: aiohttp.ClientSession):
        self.url = url
        self._http = http

    async def query(self, expr: str) -> list[dict[str, Any]]:
        async with self._http.get(f"{self.url}/api/v1/query", params={"query": expr}) as resp:
            body = await resp.json()
        assert body["status"] == "success", f"{expr}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def value(self, expr: str) -> float:
        result = await self.query(expr)
        assert len(result) == 1, f"{expr}: {result}"
        return float(result[0]["value"][1])

    async def alerts(self) -> list[dict[str, Any]]:
        async with self._http.get(f"{self.url}/api/v1/alerts") as resp:
            alerts: list[dict[str, Any]] = (await resp.json())["data"]["alerts"]
        return alerts

    async def targets_up(self) -> dict[str, float]:
        return {r["metric"]["instance"]: float(r["value"][1]) for r in await self.query("up")}


@contextlib.asynccontextmanager
async def prometheus(
    tmp_path: Path, targets: dict[str, str], http: aiohttp.ClientSession
) -> AsyncIterator[Prometheus]:
    """Prometheus on a free loopback port, scraping ``targets`` (instance -> host:port)."""
    binary = _prometheus()
    (port,) = free_ports(1)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "unitproxy",  # the job UnitproxyTargetDown looks at
                "scrape_timeout": "900ms",
                "static_configs": [
                    {"targets": [address], "labels": {"instance": instance}}
                    for instance, address in targets.items()
                ],
            }
        ],
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        binary, f"--config.file={config_file}", f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address={HOST}:{port}", "--log.level=warn",
        stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
    )  # fmt: skip
    url = f"http://{HOST}:{port}"
    try:
        async with asyncio.timeout(30):
            while True:
                assert proc.returncode is None, (tmp_path / "prometheus.log").read_text()
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/-/ready") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.1)
        yield Prometheus(url, http)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


async def until(check: Any, what: str, timeout_s: float = 30) -> Any:
    try:
        async with asyncio.timeout(timeout_s):
            while not (found := await check()):
                await asyncio.sleep(0.25)
            return found
    except TimeoutError:
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


async def start_cell(procs: Procs, tmp_path: Path) -> dict[str, Proc]:
    """Two units of a sidecar and a follower behind a gateway with tenants; a unit whose
    every stream breaks after 2 tokens, behind a gateway of its own."""
    cell: dict[str, Proc] = {}
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    ports = iter(free_ports(10))
    for unit in ("u0", "u1"):
        follower = await procs.follower("--node-name", f"{unit}-f0", "--health-interval", "0.2")
        cell[f"{unit}-f0"] = follower
        cell[unit] = await procs.sidecar(next(ports), next(ports), "--unit-id", unit, *SIM,
                                         "--follower", f"{unit}-f0={follower.grpc_target}")  # fmt: skip
    cell["broken"] = await procs.sidecar(next(ports), next(ports), "--unit-id", "broken", *SIM,
                                         "--sim-error-after-tokens", "2")  # fmt: skip
    for name, units, extra in (
        ("gateway", ("u0", "u1"), ("--tenants-file", str(tenants))),
        ("gateway-broken", ("broken",), ()),
    ):
        flags = [a for u in units
                 for a in ("--unit", f"{u}={cell[u].http_url},{cell[u].grpc_target}")]  # fmt: skip
        cell[name] = await procs.gateway(next(ports), next(ports), *flags, *extra,
                                         "--log-level", "warning")  # fmt: skip
    return cell


async def traffic(http: aiohttp.ClientSession, cell: dict[str, Proc]) -> None:
    """Some of each kind through the gateway, and a tenant over its limit; broken streams
    straight and through theirs."""
    gateway = cell["gateway"].http_url
    for i in range(6):
        stream = i % 2 == 0
        body = {"prompt": "hello", "max_tokens": 8, "stream": stream}
        async with http.post(f"{gateway}/v1/completions", json=body, headers=ACME) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
        async with http.post(f"{gateway}/v1/chat/completions", json=chat, headers=ACME) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
    body = {"prompt": "hello", "max_tokens": 8}
    async with http.post(f"{gateway}/v1/completions", json=body, headers=CAPPED) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    async with http.post(f"{gateway}/v1/completions", json=body, headers=CAPPED) as resp:
        assert resp.status == 429, await resp.text()
        assert (await resp.json())["error"]["code"] == "rate_limited"
    for url in (cell["broken"].http_url, cell["gateway-broken"].http_url):
        body = {"prompt": "hello", "max_tokens": 8, "stream": True}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200  # the stream started, then broke
            assert b'"error"' in await resp.read()


def dashboard_queries() -> list[str]:
    from tests.test_deploy import dashboard_expressions

    exprs = dashboard_expressions(json.loads(DASHBOARD.read_text()))
    return [
        e.replace("$__rate_interval", "30s").replace("$instance", ".*")
        for e in exprs
        if not e.startswith("label_values(")
    ]


async def test_shipped_rules_and_dashboard_against_a_real_cell(
    procs: Procs, tmp_path: Path
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        cell = await start_cell(procs, tmp_path)
        targets = {name: proc.http_url.removeprefix("http://") for name, proc in cell.items()}
        async with prometheus(tmp_path, targets, http) as prom:

            async def all_up() -> bool:
                up = await prom.targets_up()
                return set(up) == set(targets) and all(v == 1 for v in up.values())

            await until(all_up, "every target scraped")
            await traffic(http, cell)
            await asyncio.sleep(3)  # a few scrapes after the traffic

            # Every dashboard query returns data, or is known to be empty and why.
            empty = [q for q in dashboard_queries() if not await prom.query(q)]
            assert sorted(empty) == sorted(KNOWN_EMPTY), "\n".join(empty)
            # The refusal counts under its tenant and the limit it hit.
            limited = 'unitproxy_tenant_limited_total{tenant="capped", limit="requests_per_minute"}'
            assert await prom.value(f"sum({limited})") == 1

            # A stream that broke after it started counts under its error, not 200.
            broken = 'unitproxy_requests_total{instance="broken", route="completions"'
            assert await prom.value(f'sum({broken}, code=~"5.."}})') >= 1
            assert await prom.value(f'sum({broken}, code="200"}})') == 0
            # Counters exist at 0 before their first event: increase() sees the first.
            assert (
                await prom.value(
                    'unitproxy_health_transitions_total{instance="u0", node="u0-f0", to="unhealthy"}'
                )
                == 0
            )

            # A dead leader: its target is down and the gateway has lost its unit.
            cell["u1"].signal(signal.SIGKILL)

            async def pending() -> dict[str, dict[str, Any]]:
                seen = {a["labels"]["alertname"]: a for a in await prom.alerts()}
                wanted = ("UnitproxyTargetDown", "UnitproxyUnitLost")
                return seen if all(name in seen for name in wanted) else {}

            alerts = await until(pending, "the alerts for a dead leader", timeout_s=45)
            assert alerts["UnitproxyTargetDown"]["labels"]["instance"] == "u1"
            assert alerts["UnitproxyUnitLost"]["labels"]["unit"] == "u1"
            assert {alerts[n]["state"] for n in ("UnitproxyTargetDown", "UnitproxyUnitLost")} <= {
                "pending",
                "firing",
            }
            # The dashboard shows the unit as LOST, not idle.
            states = await prom.query("max by (unit, state) (unitproxy_gateway_unit_state) == 1")
            assert {"unit": "u1", "state": "LOST"} in [r["metric"] for r in states]
            assert not await prom.query('unitproxy_unit_load{unit="u1"}')

            # The gateway in front of the broken unit: a stream that broke after it started
            # counts under its error status there too.
            via = 'unitproxy_requests_total{instance="gateway-broken", route="completions"'
            assert await prom.value(f'sum({via}, code="200"}})') == 0
            assert await prom.value(f'sum({via}, code=~"5.."}})') >= 1

"""The autoscaling examples (deploy/kubernetes/autoscaling/): KEDA's ScaledObject and an
HPA with prometheus-adapter's rule scale the units' LeaderWorkerSet on
unitproxy_fleet_saturation, and their queries, evaluated by a real Prometheus scraping
a real gateway in front of simulated units, follow the fleet's load: 0 idle, the
outstanding share of the capacity under load, above 1 once requests wait."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.procs import Procs, free_ports
from tests.test_deploy import _promtool_check_rules, metric_names
from tests.test_prometheus import prometheus, until

ROOT = Path(__file__).resolve().parent.parent
AUTOSCALING = ROOT / "deploy" / "kubernetes" / "autoscaling"


def keda() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((AUTOSCALING / "keda.yaml").read_text())
    return doc


def hpa() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((AUTOSCALING / "hpa.yaml").read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    return by_kind["HorizontalPodAutoscaler"], by_kind["ConfigMap"]


def keda_query() -> str:
    (trigger,) = keda()["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query: str = trigger["metadata"]["query"]
    return query


def adapter_query() -> str:
    """The adapter's external rule as it asks Prometheus, with no label matchers (the
    HPA's metric has no selector)."""
    _, rules = hpa()
    (rule,) = yaml.safe_load(rules["data"]["config.yaml"])["externalRules"]
    assert rule["name"]["as"] == "unitproxy_fleet_saturation"
    query: str = rule["metricsQuery"]
    return query.replace("<<.Series>>", rule["seriesQuery"].strip("'")).replace(
        "{<<.LabelMatchers>>}", ""
    )


def desired(units: int, saturation: float, target: float) -> int:
    """What the HPA (and KEDA, metricType Value) asks for."""
    return math.ceil(units * saturation / target)


def test_both_examples_scale_the_units_on_the_saturation_with_the_same_target() -> None:
    unit = next(
        d
        for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/unit.yaml").read_text())
        if d and d["kind"] == "LeaderWorkerSet"
    )
    scaled, (autoscaler, _) = keda()["spec"], hpa()
    for ref in (scaled["scaleTargetRef"], autoscaler["spec"]["scaleTargetRef"]):
        assert (ref["kind"], ref["name"]) == ("LeaderWorkerSet", unit["metadata"]["name"])
        assert ref["apiVersion"] == unit["apiVersion"]
    (trigger,) = scaled["triggers"]
    (metric,) = autoscaler["spec"]["metrics"]
    assert trigger["metricType"] == metric["external"]["target"]["type"] == "Value"
    assert float(trigger["metadata"]["threshold"]) == 0.8
    assert metric["external"]["target"]["value"] == "800m"
    assert metric["external"]["metric"]["name"] == "unitproxy_fleet_saturation"
    assert scaled["minReplicaCount"] == autoscaler["spec"]["minReplicas"]
    assert scaled["maxReplicaCount"] == autoscaler["spec"]["maxReplicas"]


def test_the_queries_are_valid_promql_on_exported_metrics(tmp_path: Path) -> None:
    queries = [keda_query(), adapter_query()]
    assert metric_names(queries, "autoscaling") == {"unitproxy_fleet_saturation"}
    rules = [{"record": f"unitproxy:autoscaling:{i}", "expr": q} for i, q in enumerate(queries)]
    _promtool_check_rules([{"name": "autoscaling", "rules": rules}], tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_queries_follow_the_fleets_load_on_a_real_prometheus(
    procs: Procs, tmp_path: Path
) -> None:
    ports = iter(free_ports(6))
    sim = ("--sim-decode-step-ms", "40", "--health-interval", "0.2", "--log-level", "warning")
    units = {}
    for unit in ("u0", "u1"):  # 2 requests each
        units[unit] = await procs.sidecar(next(ports), next(ports), "--unit-id", unit,
                                          "--capacity", "2", *sim)  # fmt: skip
    flags = [a for u, p in units.items() for a in ("--unit", f"{u}={p.http_url},{p.grpc_target}")]
    gateway = await procs.gateway(next(ports), next(ports), *flags, "--log-level", "warning")
    targets = {"gateway": gateway.http_url.removeprefix("http://")}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        prometheus(tmp_path, targets, http) as prom,
    ):

        async def saturation_is(value: float) -> bool:
            result = await prom.query("unitproxy_fleet_saturation")
            return len(result) == 1 and float(result[0]["value"][1]) == pytest.approx(value)

        await until(lambda: saturation_is(0.0), "an idle fleet's saturation")
        assert await prom.value(keda_query()) == 0.0
        assert await prom.value(adapter_query()) == 0.0

        async def stream() -> None:
            body = {"prompt": "hello", "max_tokens": 600, "stream": True}
            async with http.post(f"{gateway.http_url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()

        held = [asyncio.create_task(stream()) for _ in range(2)]
        try:
            # 2 of the 4 requests the units hold: 0.5.
            await until(lambda: saturation_is(0.5), "half the fleet busy")
            keda_value, adapter_value = (
                await prom.value(keda_query()),
                await prom.value(adapter_query()),
            )
            assert 0 < keda_value <= 0.5 and adapter_value == pytest.approx(keda_value)
            # 4 more: 4 run, 2 wait in the gateway: 6 / 4 = 1.5, past full.
            held += [asyncio.create_task(stream()) for _ in range(4)]
            await until(lambda: saturation_is(1.5), "a fleet past full")
            assert desired(2, 1.5, 0.8) == 4  # the 2 units asked to double
            assert 0.5 < await prom.value(keda_query()) <= 1.5
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)

"""The loop's own counters and histograms (proxy/metrics.py) export what
prometheus_client's would: the same text, sample for sample."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy.metrics import LATENCY_BUCKETS, LoopCounter, LoopHistogram, TenantMetrics

pytestmark = pytest.mark.timeout(10)

OBSERVED = (0.0005, 0.001, 0.0011, 0.3, 5.0, 1000.0, 0.01, 0.0)


def _fill(counter: Counter | LoopCounter, histogram: Histogram | LoopHistogram) -> None:
    for value in OBSERVED:
        histogram.labels("completions").observe(value)
    histogram.labels("chat")  # a series at zero
    counter.labels("completions", "200").inc()
    counter.labels("completions", "200").inc(2.5)
    counter.labels("chat", "503")


def _exposition(loop: bool) -> str:
    registry = CollectorRegistry()
    if loop:
        counter: Counter | LoopCounter = LoopCounter(
            "requests", "Doc.", ["route", "code"], registry
        )
        histogram: Histogram | LoopHistogram = LoopHistogram(
            "request_duration_seconds", "Doc.", ["route"], LATENCY_BUCKETS, registry
        )
    else:
        counter = Counter(
            "requests", "Doc.", ["route", "code"], namespace="unitproxy", registry=registry
        )
        histogram = Histogram(
            "request_duration_seconds", "Doc.", ["route"], buckets=LATENCY_BUCKETS,
            namespace="unitproxy", registry=registry,
        )  # fmt: skip
    _fill(counter, histogram)
    text = generate_latest(registry).decode()
    # The creation times differ between the two; their series must not.
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text)


def test_the_exposition_is_prometheus_clients() -> None:
    ours = _exposition(loop=True)
    assert ours == _exposition(loop=False)
    assert 'unitproxy_requests_total{code="200",route="completions"} 3.5' in ours
    assert 'unitproxy_request_duration_seconds_bucket{le="0.001",route="completions"} 3.0' in ours
    assert 'unitproxy_request_duration_seconds_bucket{le="+Inf",route="completions"} 8.0' in ours
    assert 'unitproxy_request_duration_seconds_count{route="chat"} 0.0' in ours
    assert 'unitproxy_requests_created{code="503",route="chat"} T' in ours


def test_created_series_can_be_switched_off_as_in_prometheus_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PROMETHEUS_DISABLE_CREATED_SERIES", "True")
    ours = _exposition(loop=True)
    assert "_created" not in ours
    assert "unitproxy_requests_total" in ours


def test_series_read_back_through_the_registry() -> None:
    registry = CollectorRegistry()
    counter = LoopCounter("routed_requests", "Doc.", ["unit"], registry)
    histogram = LoopHistogram("ttft_seconds", "Doc.", ["route"], (0.1, 1.0), registry)
    counter.labels("a").inc()
    assert counter.labels("a") is counter.labels("a"), "one series per label values"
    histogram.labels("chat").observe(0.5)
    histogram.labels("chat").observe(2.0)
    value = registry.get_sample_value
    assert value("unitproxy_routed_requests_total", {"unit": "a"}) == 1.0
    assert value("unitproxy_ttft_seconds_bucket", {"route": "chat", "le": "0.1"}) == 0.0
    assert value("unitproxy_ttft_seconds_bucket", {"route": "chat", "le": "1.0"}) == 1.0
    assert value("unitproxy_ttft_seconds_bucket", {"route": "chat", "le": "+Inf"}) == 2.0
    assert value("unitproxy_ttft_seconds_sum", {"route": "chat"}) == 2.5


def test_wrong_labels_and_duplicate_names_are_refused() -> None:
    registry = CollectorRegistry()
    counter = LoopCounter("requests", "Doc.", ["route", "code"], registry)
    with pytest.raises(ValueError, match="labels"):
        counter.labels("completions")
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        LoopCounter("requests", "Doc.", ["route"], registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("requests", "Doc.", namespace="unitproxy", registry=registry)


def test_tenant_series_are_found_by_name_and_bounded_as_the_labels() -> None:
    registry = CollectorRegistry()
    m = TenantMetrics(registry, max_tenants=2, max_models=2)
    first = m.series("alpha", "m1")
    assert m.series("alpha", "m1") is first  # found again, not made again
    first.requests.inc()
    first.prompt.inc(7)
    first.wait.observe(0.01)
    assert m.series("alpha", "m2") is not first
    # a third model and a third tenant count as "other"
    assert m.series("alpha", "m3") is m.usage("alpha", "other")
    assert m.series("beta", "m1") is m.usage("beta", "m1")
    assert m.series("gamma", "m1") is m.series("delta", "m1") is m.usage("other", "m1")
    # many names: the lookup by name keeps at most max + 1 of each, as the labels do
    for i in range(50):
        m.series(f"t{i}", f"model{i}").requests.inc()
        m.series("alpha", f"model{i}").requests.inc()
    assert len(m._series) <= 3 + 1
    assert all(len(models) <= 2 + 1 for models in m._series.values())
    value = registry.get_sample_value
    assert value("unitproxy_tenant_requests_total", {"tenant": "alpha", "model": "m1"}) == 1
    assert value("unitproxy_tenant_prompt_tokens_total", {"tenant": "alpha", "model": "m1"}) == 7
    assert value("unitproxy_tenant_wait_seconds_count", {"tenant": "alpha"}) == 1
    assert value("unitproxy_tenant_requests_total", {"tenant": "other", "model": "other"}) == 50

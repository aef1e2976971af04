"""Every metric unitproxy exports, declared once, on a registry the caller injects.

Names carry the ``unitproxy_`` prefix. Label values come from small fixed sets: a
route name, a status code, a state, a node or unit id from configuration; never
request data. Series whose label values are known up front (routes and codes, states,
nodes, units, retry reasons) are created at zero at start, so the first event shows
in ``increase()`` and ``rate()``; a role exports only the series it can fill.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

PREFIX = "unitproxy"

# Time to first token and request durations span 1 ms (loopback, idle) to minutes.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0,
)  # fmt: skip
TOKEN_GAP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
# A prediction's relative error: 1 % to 10x.
PREDICTION_ERROR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0)
PROBE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

UNIT_STATES = ("STARTING", "SERVING", "NOT_SERVING", "DRAINING")
HTTP_ROUTES = ("completions", "chat")
GRPC_ROUTE = "grpc_generate"
# The statuses an inference request can end with (499: the client went away).
HTTP_CODES = ("200", "400", "401", "404", "413", "429", "499", "500", "503", "504")
GRPC_CODES = (
    "OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "NOT_FOUND", "RESOURCE_EXHAUSTED",
    "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL",
)  # fmt: skip
RETRY_REASONS = ("429", "503", "connect", "resource_exhausted", "unavailable")
MIGRATION_REASONS = ("unit_failed", "broken", "idle", "unit_lost")
SPAN_DROP_REASONS = ("queue_full", "export_failed")
HEALTH_TRANSITIONS = ("healthy", "unhealthy")
GATEWAY_UNIT_STATES = (*UNIT_STATES, "LOST", "UNKNOWN")


def _created_series() -> bool:
    """prometheus_client's switch for the ``_created`` series, honoured here too."""
    flag = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "false")
    return flag.lower() not in ("true", "1", "t")


# How prometheus_client writes a bucket's bound (the le label); untyped there.
_go_float: Callable[[float], str] = floatToGoString


class LoopCount:
    """One series of a LoopCounter."""

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopBuckets:
    """One series of a LoopHistogram: a count per bucket (not cumulative) and the sum."""

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        i = 0
        for bound in self.bounds:  # the last bound is +Inf
            if amount <= bound:
                break
            i += 1
        self.counts[i] += 1.0


class _LoopFamily(Collector):
    """Labelled series that only the event loop's thread updates, built into a metric
    family at scrape time (which runs on that loop too). An update is a float addition:
    prometheus_client's series take a lock and several calls per update, which the
    gateway paid three to five times a request. The exposition is prometheus_client's
    (the same samples, ``_created`` included)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ):
        self.name = f"{PREFIX}_{name}"
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.created = _created_series()
        registry.register(self)

    def _check(self, values: tuple[str, ...]) -> None:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, given {values}")


class LoopCounter(_LoopFamily):
    """A counter (``_total``) with labels; see _LoopFamily."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ):
        self._series: dict[tuple[str, ...], LoopCount] = {}
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> LoopCount:
        series = self._series.get(values)
        if series is None:
            self._check(values)
            series = self._series[values] = LoopCount()
        return series

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):
            family.add_metric(
                values, series.value, created=series.created if self.created else None
            )
        yield family


class LoopHistogram(_LoopFamily):
    """A histogram with labels; see _LoopFamily."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ):
        self._bounds = [float(b) for b in buckets]
        if self._bounds[-1] != float("inf"):
            self._bounds.append(float("inf"))
        self._les = [_go_float(b) for b in self._bounds]
        self._series: dict[tuple[str, ...], LoopBuckets] = {}
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> LoopBuckets:
        series = self._series.get(values)
        if series is None:
            self._check(values)
            series = self._series[values] = LoopBuckets(self._bounds)
        return series

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        created = []
        for values, series in list(self._series.items()):
            total = 0.0
            buckets = []
            for le, count in zip(self._les, series.counts, strict=True):
                total += count
                buckets.append((le, total))
            family.add_metric(values, buckets, series.sum)
            created.append((values, series.created))
        if self.created:
            for values, at in created:
                family.add_sample(
                    f"{self.name}_created", dict(zip(self.labelnames, values, strict=True)), at
                )
        yield family


class ServingMetrics:
    """What any process that serves inference requests exports (sidecar and gateway).

    ``tokens=False`` (the gateway, which forwards bytes and does not count tokens):
    the token series are kept off the registry, so they are not exported as zeros.
    """

    def __init__(self, registry: CollectorRegistry, tokens: bool = True):
        self.registry = registry
        token_registry = registry if tokens else CollectorRegistry(auto_describe=False)
        self.requests = LoopCounter(
            "requests",
            "Inference requests answered, by route and status code.",
            ["route", "code"],
            registry,
        )
        self.outstanding = Gauge(
            "outstanding_requests",
            "Requests admitted and not yet finished.",
            namespace=PREFIX,
            registry=registry,
        )
        self.request_duration = LoopHistogram(
            "request_duration_seconds",
            "Time from admission to the end of the response.",
            ["route"],
            LATENCY_BUCKETS,
            registry,
        )
        self.ttft = LoopHistogram(
            "time_to_first_token_seconds",
            "Time from admission to the first token sent.",
            ["route"],
            LATENCY_BUCKETS,
            registry,
        )
        self.inter_token = Histogram(
            "inter_token_latency_seconds",
            "Time between two token deltas of one stream.",
            buckets=TOKEN_GAP_BUCKETS,
            namespace=PREFIX,
            registry=token_registry,
        )
        self.generated_tokens = Counter(
            "generated_tokens",
            "Tokens generated and sent.",
            namespace=PREFIX,
            registry=token_registry,
        )
        for route, codes in (*((r, HTTP_CODES) for r in HTTP_ROUTES), (GRPC_ROUTE, GRPC_CODES)):
            self.request_duration.labels(route)
            self.ttft.labels(route)
            for code in codes:
                self.requests.labels(route, code)


# Why the server closed a client connection (see proxy/ingress.py).
CLOSE_REASONS = (
    "head_timeout",
    "body_timeout",
    "write_timeout",
    "idle",
    "max_connections",
    "max_client_connections",
    "fd_limit",
    "body_buffer",
)


class IngressMetrics:
    """Client connections on an HTTP port, and those the ingress limits closed."""

    def __init__(self, registry: CollectorRegistry):
        self.connections = Gauge(
            "client_connections",
            "Client connections open on the HTTP port.",
            namespace=PREFIX,
            registry=registry,
        )
        self.closed = Counter(
            "client_connections_closed",
            "Client connections the server closed by a limit (timeouts, max_connections, body_buffer).",
            ["reason"],
            namespace=PREFIX,
            registry=registry,
        )
        for reason in CLOSE_REASONS:
            self.closed.labels(reason)
        self.body_buffer = Gauge(
            "body_buffer_bytes",
            "Bytes of request bodies coming in on the HTTP port, each from its head until "
            "it is whole (at most server.max_body_buffer_bytes).",
            namespace=PREFIX,
            registry=registry,
        )
        self.pipelined = Gauge(
            "pipelined_bytes",
            "Bytes of later requests held behind requests being served on the HTTP port "
            "(about server.max_pipelined_bytes at most).",
            namespace=PREFIX,
            registry=registry,
        )


class TracingMetrics:
    """Spans this process recorded for its traces (tracing.otlp_endpoint), and their fate."""

    def __init__(self, registry: CollectorRegistry):
        self.exported = Counter(
            "trace_spans_exported",
            "Spans the OTLP collector took.",
            namespace=PREFIX,
            registry=registry,
        )
        self.dropped = Counter(
            "trace_spans_dropped",
            "Spans dropped: the queue was full (tracing.max_queued_spans), or the collector "
            "refused or did not answer their export.",
            ["reason"],
            namespace=PREFIX,
            registry=registry,
        )
        for reason in SPAN_DROP_REASONS:
            self.dropped.labels(reason)


class HealthMetrics:
    """Node health as seen by whoever checks it (sidecar for its unit, follower for itself)."""

    def __init__(self, registry: CollectorRegistry):
        self.node_healthy = Gauge(
            "node_healthy",
            "1 while the node is healthy, else 0.",
            ["node", "role"],
            namespace=PREFIX,
            registry=registry,
        )
        self.probe_duration = Histogram(
            "health_probe_duration_seconds",
            "Time one health probe of a node took.",
            ["node"],
            buckets=PROBE_BUCKETS,
            namespace=PREFIX,
            registry=registry,
        )
        self.health_transitions = Counter(
            "health_transitions",
            "Changes of a node's health, by the health it changed to.",
            ["node", "to"],
            namespace=PREFIX,
            registry=registry,
        )

    def add_node(self, node: str, role: str) -> None:
        """The node's series at zero: unhealthy until checked, no transition yet."""
        self.node_healthy.labels(node, role).set(0)
        self.probe_duration.labels(node)
        for to in HEALTH_TRANSITIONS:
            self.health_transitions.labels(node, to)


class UnitMetrics:
    """The unit's state and its engine's load, exported by the sidecar."""

    def __init__(self, registry: CollectorRegistry):
        self.unit_state = Gauge(
            "unit_state",
            "1 for the unit's current state, 0 for the others.",
            ["state"],
            namespace=PREFIX,
            registry=registry,
        )
        self.engine_running = Gauge(
            "engine_running",
            "Sequences the engine is running.",
            namespace=PREFIX,
            registry=registry,
        )
        self.engine_waiting = Gauge(
            "engine_waiting",
            "Sequences waiting in the engine's queue.",
            namespace=PREFIX,
            registry=registry,
        )
        self.engine_kv_cache_usage = Gauge(
            "engine_kv_cache_usage",
            "Share of the engine's KV cache in use (0..1; -1 when unknown).",
            namespace=PREFIX,
            registry=registry,
        )
        self.engine_prefix_cache_hit_rate = Gauge(
            "engine_prefix_cache_hit_rate",
            "Share of prompt tokens found in the engine's prefix cache (0..1; -1 when unknown).",
            namespace=PREFIX,
            registry=registry,
        )

        self._prefix_cache = _PrefixCacheCounters()
        registry.register(self._prefix_cache)

    def count_prefix_cache(self, read: Callable[[], tuple[int, int]]) -> None:
        """Export the engine's prefix-cache counters (prompt tokens looked up, and
        found), as vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``; 0 until
        this is called."""
        self._prefix_cache.read = read

    def set_state(self, state: str) -> None:
        for name in UNIT_STATES:
            self.unit_state.labels(name).set(1 if name == state else 0)


class _PrefixCacheCounters(Collector):
    """Counters the engine keeps itself, read at each scrape."""

    def __init__(self) -> None:
        self.read: Callable[[], tuple[int, int]] = lambda: (0, 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        queries, hits = self.read()
        yield CounterMetricFamily(
            f"{PREFIX}_engine_prefix_cache_queries",
            "Prompt tokens the engine looked up in its prefix cache.",
            value=queries,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_engine_prefix_cache_hits",
            "Prompt tokens the engine found in its prefix cache (no prefill needed).",
            value=hits,
        )


# What the engines' prefix-cache counters did to the gateway's prefix index
# (proxy/gateway/prefix.py, EngineFeedback).
PREFIX_CORRECTIONS = ("shrunk", "grown", "forgotten")


class _PrefixCorrections(Collector):
    """unitproxy_prefix_index_corrections_total, from the feedback's own counts."""

    def __init__(self) -> None:
        self.read: Callable[[], dict[str, int]] = dict

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            f"{PREFIX}_prefix_index_corrections",
            "Changes the engines' prefix-cache counters made to the prefix index, by action: "
            "shrunk, grown (a unit's block limit), forgotten (its engine emptied its cache).",
            labels=["action"],
        )
        counts = self.read()
        for action in PREFIX_CORRECTIONS:
            family.add_metric([action], counts.get(action, 0))
        yield family


# One unit as the gateway sees it: id, state (GATEWAY_UNIT_STATES), report age in s
# (-1: none yet), estimated outstanding (None: LOST or UNKNOWN, no series).
UnitView = tuple[str, str, float, float | None]


class _UnitViews(Collector):
    """The per-unit series, made at scrape time from the gateway's units: as Gauge
    children refreshed for every unit twice a second they cost about 5 KB of memory a
    unit and, at 1,000 units, more of the gateway's CPU than the units' load reports."""

    def __init__(self) -> None:
        self.views: Callable[[], Iterable[UnitView]] = tuple

    def collect(self) -> Iterator[GaugeMetricFamily]:
        states = GaugeMetricFamily(
            f"{PREFIX}_gateway_unit_state",
            "1 for the state this gateway sees a unit in, 0 for the others: the state of "
            "its last fresh report, LOST when its reports stopped, UNKNOWN before any.",
            labels=["unit", "state"],
        )
        loads = GaugeMetricFamily(
            f"{PREFIX}_unit_load",
            "Estimated outstanding requests of a unit (its report corrected by this gateway's own).",
            labels=["unit"],
        )
        ages = GaugeMetricFamily(
            f"{PREFIX}_load_report_age_seconds",
            "Age of the last load report of a unit, in seconds (-1: none yet).",
            labels=["unit"],
        )
        for unit, state, age_s, load in self.views():
            for name in GATEWAY_UNIT_STATES:
                states.add_metric([unit, name], 1.0 if name == state else 0.0)
            ages.add_metric([unit], age_s)
            if load is not None:  # a dead unit must not read as idle
                loads.add_metric([unit], load)
        yield from (states, loads, ages)


# Why a unit registered in Redis was refused (see proxy/gateway/discovery.py).
DISCOVERY_REFUSALS = ("not_allowed", "max_units", "bad_id", "tls")


class GatewayMetrics:
    """Everything a gateway records: its requests (``serving``), routing, retries and
    migrations, and its view of each unit's load. One object, handed to each component
    that records (router, core, the two wires), which records there itself."""

    def __init__(self, registry: CollectorRegistry):
        self.serving = ServingMetrics(registry, tokens=False)
        self.routed = LoopCounter(
            "routed_requests",
            "Attempts sent to a unit (a retried request counts once per unit tried).",
            ["unit"],
            registry,
        )
        self.retries = LoopCounter(
            "retries",
            "Requests sent again to another unit that took them, by why the previous unit did not take them.",
            ["reason"],
            registry,
        )
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        self.migrations = LoopCounter(
            "migrations",
            "Requests continued on another unit that took them after the unit that had them failed under them, by how it failed.",
            ["reason"],
            registry,
        )
        for reason in MIGRATION_REASONS:
            self.migrations.labels(reason)
        self.migration_pause = Histogram(
            "migration_pause_seconds",
            "Time from a unit's failure under a request to the next unit's first byte to the client.",
            buckets=LATENCY_BUCKETS,
            namespace=PREFIX,
            registry=registry,
        )
        self.no_unit_available = Counter(
            "no_unit_available",
            "Requests answered 503 because no unit was SERVING.",
            namespace=PREFIX,
            registry=registry,
        )
        # unitproxy_gateway_unit_state, unitproxy_unit_load and
        # unitproxy_load_report_age_seconds: from ``watch_units``, at scrape time.
        self._units = _UnitViews()
        registry.register(self._units)
        self.discovery_refused = Counter(
            "discovery_refused",
            "Load reports of units in Redis that this gateway refused to route to, by reason.",
            ["reason"],
            namespace=PREFIX,
            registry=registry,
        )
        for reason in DISCOVERY_REFUSALS:
            self.discovery_refused.labels(reason)
        self.queue_waiting = Gauge(
            "queue_waiting_requests",
            "Requests waiting because every SERVING unit is full.",
            namespace=PREFIX,
            registry=registry,
        )
        self._prefix_corrections = _PrefixCorrections()
        registry.register(self._prefix_corrections)
        self.fleet_saturation = Gauge(
            "fleet_saturation",
            "The fleet's load against what it can hold within the latency objective: (estimated outstanding on the SERVING units + requests waiting) / the requests those units can hold (each its capacity, or fewer where policy latency learnt that more would miss gateway.slo_ttft_s). 0 idle, 1 full, above 1 past it.",
            namespace=PREFIX,
            registry=registry,
        )
        self.prediction_error = Histogram(
            "latency_prediction_error_ratio",
            "Policy latency: |predicted - actual| / actual time to first token of each answered attempt on a unit it had learnt.",
            buckets=PREDICTION_ERROR_BUCKETS,
            namespace=PREFIX,
            registry=registry,
        )

    def count_prefix_corrections(self, read: Callable[[], dict[str, int]]) -> None:
        """Export unitproxy_prefix_index_corrections_total from ``read``, the count of
        each PREFIX_CORRECTIONS action so far (policy prefix with the engines' feedback
        on); 0 until this is called."""
        self._prefix_corrections.read = read

    def watch_units(
        self, views: Callable[[], Iterable[UnitView]], waiting: Callable[[], int]
    ) -> None:
        """Where the per-unit series and the queue's length are read from at scrape time."""
        self._units.views = views
        self.queue_waiting.set_function(waiting)

    def watch_saturation(self, saturation: Callable[[], float]) -> None:
        """Where unitproxy_fleet_saturation is read from at scrape time."""
        self.fleet_saturation.set_function(saturation)

    def add_unit(self, unit: str) -> None:
        self.routed.labels(unit)


TENANT_LIMITS = ("requests_per_minute", "tokens_per_minute", "tokens_per_day", "max_concurrent")
OTHER = "other"


class TenantSeries:
    """The series one request of a tenant and model counts into (``TenantMetrics.series``):
    found with one lookup, not one a series."""

    __slots__ = ("completion", "prompt", "requests", "wait")

    def __init__(
        self, requests: LoopCount, prompt: LoopCount, completion: LoopCount, wait: LoopBuckets
    ) -> None:
        self.requests = requests
        self.prompt = prompt
        self.completion = completion
        self.wait = wait


class TenantMetrics:
    """Usage per tenant and model, for cost (only with tenants configured). The tenant
    label takes the first ``max_tenants`` names seen and the model label the first
    ``max_models``; the rest count as ``other``, so a label never grows without bound."""

    def __init__(self, registry: CollectorRegistry, max_tenants: int = 100, max_models: int = 64):
        self._max_tenants = max_tenants
        self._max_models = max_models
        self._tenants: set[str] = set()
        self._models: set[str] = set()
        # Labelled series, found once: as bounded as the labels. Loop series (updated on
        # the event loop only, as every request's accounting is): a float addition each,
        # where prometheus_client's took a lock and several calls, four times a request.
        self._usage: dict[tuple[str, str], TenantSeries] = {}
        # By the names as requests give them (tenant, then model): at most max_tenants +
        # 1 tenants and, per tenant, max_models + 1 models are kept (a model named by a
        # client is looked up through the labels past that).
        self._series: dict[str, dict[str, TenantSeries]] = {}
        labels = ["tenant", "model"]
        self.requests = LoopCounter(
            "tenant_requests", "Requests admitted, by tenant and model.", labels, registry
        )
        self.prompt_tokens = LoopCounter(
            "tenant_prompt_tokens", "Prompt tokens charged, by tenant and model.", labels, registry
        )
        self.completion_tokens = LoopCounter(
            "tenant_completion_tokens", "Completion tokens charged, by tenant and model.",
            labels, registry,
        )  # fmt: skip
        self.limited = LoopCounter(
            "tenant_limited", "Requests refused 429 rate_limited, by tenant and the limit hit.",
            ["tenant", "limit"], registry,
        )  # fmt: skip
        self.wait = LoopHistogram(
            "tenant_wait_seconds",
            "Time from a request's arrival to its first attempt on a unit (the wait for a free one), by tenant.",
            ["tenant"], LATENCY_BUCKETS, registry,
        )  # fmt: skip
        self.shared = Gauge(
            "tenant_limits_shared",
            "1 while tenant limits are counted in Redis with every gateway replica; 0 while this replica enforces limit / replicas from its own counts (Redis unreachable) or counts alone (no Redis).",
            namespace=PREFIX, registry=registry,
        )  # fmt: skip

    def tenant(self, name: str) -> str:
        """The label for tenant ``name``."""
        return _bounded(name, self._tenants, self._max_tenants)

    def series(self, tenant: str, model: str) -> TenantSeries:
        """The series a request of tenant ``tenant`` for ``model`` counts into (by their
        names; the labels bounded as ``tenant`` and ``model`` say)."""
        models = self._series.get(tenant)
        if models is not None:
            found = models.get(model)
            if found is not None:
                return found
        found = self.usage(self.tenant(tenant), self.model(model))
        if models is None:
            if len(self._series) > self._max_tenants:
                return found
            models = self._series[tenant] = {}
        if len(models) <= self._max_models:
            models[model] = found
        return found

    def usage(self, tenant: str, model: str) -> TenantSeries:
        """The series of these labels."""
        key = (tenant, model)
        found = self._usage.get(key)
        if found is None:
            found = self._usage[key] = TenantSeries(
                self.requests.labels(tenant, model), self.prompt_tokens.labels(tenant, model),
                self.completion_tokens.labels(tenant, model), self.wait.labels(tenant),
            )  # fmt: skip
        return found

    def model(self, name: str | None) -> str:
        return _bounded(name or "", self._models, self._max_models)


def _bounded(value: str, seen: set[str], most: int) -> str:
    if value in seen:
        return value
    if len(seen) < most:
        seen.add(value)
        return value
    return OTHER

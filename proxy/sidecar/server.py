"""The sidecar's composition root: builds every object from settings and owns lifetimes."""

from __future__ import annotations

import asyncio
import logging
import random

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from engine import create_engine
from engine.base import Engine
from proxy.auth import ApiKeys
from proxy.broadcast import Broadcast
from proxy.checks import Checker, CheckPolicy, ProbeFailed
from proxy.errors import EngineError
from proxy.httputil import describe_admin
from proxy.ingress import Limits
from proxy.load import UnitState
from proxy.metrics import HealthMetrics, IngressMetrics, ServingMetrics, UnitMetrics
from proxy.otlp import open_tracer
from proxy.pb.unitproxy.v1 import inference_pb2_grpc, load_pb2_grpc
from proxy.resume import HintKey
from proxy.serving import Drain, Service, advertised_host, cancel_tasks, start_grpc, start_http
from proxy.settings import FollowerTarget, Settings
from proxy.sidecar import grpc_api, http
from proxy.sidecar.core import SidecarCore
from proxy.sidecar.followers import FollowerMonitor, probe_kind
from proxy.sidecar.health import UnitHealth
from proxy.sidecar.publisher import ReportPublisher
from proxy.sidecar.recovery import RecoveryHook
from proxy.sidecar.watch import ReportWatch
from proxy.timers import Wheel
from proxy.tls import server_tls
from proxy.tracing import engine_settings

log = logging.getLogger(__name__)

INFERENCE_SERVICE = "unitproxy.v1.Inference"
LEADER = "leader"
LOAD_PROGRESS_S = 1.0  # how often the leader's reason shows the engine load's time so far


class Sidecar(Service):
    """A running sidecar: ``async with Sidecar(settings) as sidecar`` serves until exit."""

    def __init__(self, settings: Settings, engine: Engine | None = None):
        super().__init__()
        self.settings = settings
        self.registry = CollectorRegistry()
        self.changes = Broadcast()
        self.serving_metrics = ServingMetrics(self.registry)
        self.unit_metrics = UnitMetrics(self.registry)
        self.health_metrics = HealthMetrics(self.registry)
        self.ingress_metrics = IngressMetrics(self.registry)
        self.engine = engine or create_engine(engine_settings(settings.engine, settings.tracing))
        unit_id = settings.sidecar.unit_id
        self.health = UnitHealth(unit_id, self.unit_metrics, self.health_metrics, self.changes)
        self.core = SidecarCore(
            unit_id=unit_id,
            engine=self.engine,
            health=self.health,
            metrics=self.serving_metrics,
            changes=self.changes,
            capacity=settings.sidecar.capacity,
            retry_after_s=settings.sidecar.retry_after_s,
            resume_key=_resume_key(settings.server.resume_secret),
            prefix_chunk_chars=settings.sidecar.prefix_chunk_chars,
            prefix_report_blocks=settings.sidecar.prefix_report_blocks,
            priority_headroom=settings.sidecar.priority_headroom,
        )
        self.health_service = HealthServicer()
        self.recovery: RecoveryHook | None = None
        self.publisher: ReportPublisher | None = None
        self.api_keys = ApiKeys()
        self.drain = Drain(
            lambda: self.core.outstanding, self.changes, settings.server.drain_timeout_s
        )
        self.http_url = ""
        self.grpc_target = ""
        self._tasks: list[asyncio.Task[None]] = []

    async def _start(self) -> None:
        """Ports first, then the engine: a long model load is visible and probe-able
        (STARTING, /ready 503 naming the load and its time so far, /metrics)."""
        s = self.settings
        stack = self._stack
        # First in, last out: the spans of the requests a drain waits for go out too.
        self.core.tracer = await open_tracer(stack, s.tracing, self.registry, "unitproxy-sidecar")
        self._watch_engine_gauges()
        await self._open_ports()
        self.health.add_node(LEADER, "leader", self.grpc_target)
        for follower in s.sidecar.followers:
            self.health.add_node(follower.name, "follower", follower.target)
        session = await stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32))
        )
        stack.push_async_callback(cancel_tasks, self._tasks)
        self._spawn(self._publish_health(), "grpc health")
        for follower in s.sidecar.followers:
            self._spawn(self._monitor(follower, session).run(), f"follower {follower.name}")
        if s.redis.url is not None:
            # Entered after the tasks: on exit it stops first, with a last report.
            held = self.core.held
            publisher = ReportPublisher(
                s.redis,
                self.core.report,
                self.changes,
                s.sidecar.report_interval_s,
                full_blocks=None if held is None else held.full,
            )
            self.publisher = await stack.enter_async_context(publisher)
        await self._load_engine()
        # Stopping runs in reverse: requests still in flight (a forced stop, a drain that
        # ran out of time) end with the unit-failure error event or status, then the
        # engine stops, then the servers close. After a drain there is none.
        stack.push_async_callback(self._let_go_all)
        stack.push_async_callback(cancel_tasks, self._tasks)  # before the engine stops
        self._spawn(self._leader_checker().run(), "leader health")
        self._spawn(self.core.watch_failures(), "unit failure")
        recovery = s.sidecar.recovery
        if recovery.command or recovery.url:
            self.recovery = RecoveryHook(recovery, self.health, session)
            self._spawn(self.recovery.run(), "recovery hook")
        log.info(
            "sidecar %s: engine %s%s loaded, HTTP %s, gRPC %s",
            s.sidecar.unit_id, self.engine.model_name,
            " (simulator)" if self.engine.is_simulator else "", self.http_url, self.grpc_target,
        )  # fmt: skip

    async def _open_ports(self) -> None:
        s, stack = self.settings, self._stack
        http_port, grpc_port = s.ports("sidecar")
        self.api_keys = await ApiKeys.load(s.server)
        tls = await server_tls(s.server)
        self.watch = ReportWatch(
            self.core, self.changes, s.sidecar.report_interval_s, s.sidecar.report_coalesce_s
        )
        app = http.build_app(
            self.core,
            self.watch,
            self.registry,
            self.serving_metrics,
            max_body_bytes=s.server.max_body_bytes,
            max_prompt_chars=s.server.max_prompt_chars,
            drain=self.start_drain,
            admin_token=_secret(s.server.admin_token),
            api_keys=self.api_keys,
        )
        await self.health_service.set(INFERENCE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        _, bound_grpc = await start_grpc(
            stack, s.server.host, grpc_port, self._register_grpc, tls=tls
        )
        wheel = Wheel(asyncio.get_running_loop())
        stack.callback(wheel.close)
        limits = Limits(s.server, wheel, self.ingress_metrics, "sidecar")
        bound_http = await start_http(stack, app, s.server.host, http_port, tls=tls, limits=limits)
        stack.push_async_callback(self.watch.close)  # before the servers close
        host = advertised_host(s.server.host, s.server.advertise_host)
        scheme = "http" if tls is None else "https"
        self.http_url = self.core.http_url = f"{scheme}://{host}:{bound_http}"
        self.grpc_target = self.core.grpc_target = f"{host}:{bound_grpc}"
        log.info("sidecar %s: HTTP %s, gRPC %s, STARTING: loading the engine",
                 s.sidecar.unit_id, self.http_url, self.grpc_target)  # fmt: skip
        log.info("sidecar %s: %s", s.sidecar.unit_id, describe_admin(_secret(s.server.admin_token)))

    async def _load_engine(self) -> None:
        """Start the engine while the ports answer; the leader node says how long the
        load has taken so far. Stopping runs in reverse: the engine stops before the
        servers close, so a request still in flight (a forced stop) ends with an error
        event or status, not a cut connection. After a drain there is none."""
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def progress() -> None:
            while True:
                took = loop.time() - started
                self.health.set_node(LEADER, False, f"engine loading ({took:.0f} s so far)")
                await asyncio.sleep(LOAD_PROGRESS_S)

        shown = asyncio.create_task(progress(), name="engine load progress")
        try:
            await self._stack.enter_async_context(self.engine)
        finally:
            await cancel_tasks([shown])
        self.health.set_node(LEADER, False, "engine loaded; first health check pending")
        log.info("unit %s: engine loaded in %.1f s", self.core.unit_id, loop.time() - started)

    def start_drain(self) -> None:
        """DRAINING at once: readiness and health say so, new requests get 503."""
        if self.drain.start():
            log.info(
                "unit %s: draining, %d requests in flight", self.core.unit_id, self.core.outstanding
            )
            self.health.start_drain()

    async def wait_drained(self) -> None:
        await self.drain.wait()

    async def _let_go_all(self, wait_s: float = 1.0) -> None:
        """Stopping with requests in flight: each gets its unit-failure error first."""
        if self.core.let_go("the sidecar is stopping") == 0:
            return
        log.warning("unit %s: stopping with %d requests in flight: each ends with unit_failed",
                    self.core.unit_id, self.core.outstanding)  # fmt: skip
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_s
        while self.core.running and (left := until - loop.time()) > 0:
            seen = self.changes.version
            await self.changes.wait(seen, left)

    def _register_grpc(self, server: grpc.aio.Server) -> None:
        s = self.settings
        inference = grpc_api.InferenceService(
            self.core, self.serving_metrics, s.server.max_prompt_chars, self.api_keys,
            s.server.write_timeout_s,
        )  # fmt: skip
        load = grpc_api.LoadService(self.core, self.watch)
        inference_pb2_grpc.add_InferenceServicer_to_server(inference, server)
        load_pb2_grpc.add_LoadReportingServicer_to_server(load, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health_service, server)

    def _spawn(self, coro: object, name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))  # type: ignore[arg-type]

    def _policy(self) -> CheckPolicy:
        h = self.settings.health
        return CheckPolicy(h.interval_s, h.timeout_s, h.unhealthy_threshold, h.healthy_threshold)

    def _monitor(self, follower: FollowerTarget, session: aiohttp.ClientSession) -> FollowerMonitor:
        def verdict(ok: bool, reason: str) -> None:
            self.health.set_node(follower.name, ok, reason)

        return FollowerMonitor(
            follower,
            probe_kind(follower, self.settings.sidecar.probe),
            self._policy(),
            verdict,
            session,
            observe=self.health_metrics.probe_duration.labels(follower.name).observe,
        )

    def _leader_checker(self) -> Checker:
        policy = self._policy()
        h = self.settings.health
        core, stall_timeout = self.core, h.stall_timeout_s

        async def probe() -> None:
            try:
                await core.engine.check_health()
            except EngineError as exc:
                raise ProbeFailed(f"engine: {exc.message}") from exc
            stalled = core.stalled_for()
            if stalled > stall_timeout:
                raise ProbeFailed(
                    f"engine made no progress for {stalled:.1f} s "
                    f"with {core.outstanding} requests outstanding"
                )

        def verdict(ok: bool, reason: str) -> None:
            self.health.set_node(LEADER, ok, reason)

        return Checker(
            LEADER,
            probe,
            policy,
            verdict,
            observe=self.health_metrics.probe_duration.labels(LEADER).observe,
            rng=random.Random(),
        )

    async def _publish_health(self) -> None:
        """Keep grpc.health.v1 in step with the unit state, at once on each change."""
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        published: UnitState | None = None
        while True:
            seen = self.health.state_changes.version
            state = self.health.state
            if state is not published:
                await self.health_service.set(
                    INFERENCE_SERVICE, serving if state is UnitState.SERVING else not_serving
                )
                await self.health_service.set(
                    "", not_serving if state is UnitState.DRAINING else serving
                )
                published = state
            await self.health.state_changes.wait(seen)

    def _watch_engine_gauges(self) -> None:
        m, engine = self.unit_metrics, self.engine
        m.engine_running.set_function(lambda: engine.stats().running)
        m.engine_waiting.set_function(lambda: engine.stats().waiting)
        m.engine_kv_cache_usage.set_function(lambda: engine.stats().kv_cache_usage)
        m.engine_prefix_cache_hit_rate.set_function(lambda: engine.stats().prefix_cache_hit_rate)

        def prefix_cache() -> tuple[int, int]:
            stats = engine.stats()
            return stats.prefix_cache_queries, stats.prefix_cache_hits

        m.count_prefix_cache(prefix_cache)


def _secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()


def _resume_key(secret: SecretStr | None) -> HintKey | None:
    return None if secret is None else HintKey(secret.get_secret_value())

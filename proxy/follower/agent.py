"""The follower agent: the health of one follower node, in the standard gRPC protocol.

Node health = the supervised worker (if any) is running and every configured check
passes. The worker's exit makes the node NOT_SERVING at once; checks flip the node by
their thresholds. A Watch on ``grpc.health.v1`` sees every change as it happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from pathlib import Path

import aiohttp
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from proxy import ingress, probes
from proxy.broadcast import Broadcast
from proxy.checks import Checker, CheckPolicy, Probe
from proxy.httputil import json_response
from proxy.ingress import Limits
from proxy.metrics import HealthMetrics, IngressMetrics
from proxy.procutil import die_with_parent
from proxy.serving import Service, advertised_host, cancel_tasks, start_grpc, start_http
from proxy.settings import CheckSpec, Settings
from proxy.timers import Wheel

log = logging.getLogger(__name__)

ROLE = "follower"
WORKER = "worker"


class NodeState:
    """Verdicts of each check and of the worker; healthy when all are."""

    def __init__(self, node: str, metrics: HealthMetrics):
        self.node = node
        self.changes = Broadcast()
        self._metrics = metrics
        self._verdicts: dict[str, tuple[bool, str]] = {}
        self.healthy = False
        metrics.add_node(node, ROLE)

    def expect(self, name: str, reason: str) -> None:
        self._verdicts[name] = (False, reason)
        self.refresh()

    def set(self, name: str, ok: bool, reason: str) -> None:
        if self._verdicts.get(name) == (ok, reason):
            return
        self._verdicts[name] = (ok, reason)
        self.refresh()

    def reasons(self) -> dict[str, str]:
        return {name: reason for name, (ok, reason) in self._verdicts.items() if not ok}

    def refresh(self) -> None:
        healthy = all(ok for ok, _ in self._verdicts.values())
        if healthy != self.healthy:
            self.healthy = healthy
            to = "healthy" if healthy else "unhealthy"
            self._metrics.node_healthy.labels(self.node, ROLE).set(int(healthy))
            self._metrics.health_transitions.labels(self.node, to).inc()
            why = "; ".join(f"{n}: {r}" for n, r in self.reasons().items())
            log.log(logging.INFO if healthy else logging.WARNING,
                    "node %s is %s%s", self.node, to, f" ({why})" if why else "")  # fmt: skip
        self.changes.notify()


class FollowerAgent(Service):
    def __init__(self, settings: Settings, worker_command: list[str] | None = None):
        super().__init__()
        self.settings = settings
        self.node = settings.follower.node_name
        self.registry = CollectorRegistry()
        self.metrics = HealthMetrics(self.registry)
        self.ingress_metrics = IngressMetrics(self.registry)
        self.state = NodeState(self.node, self.metrics)
        self.health_service = HealthServicer()
        self.worker_command = worker_command
        self.worker: asyncio.subprocess.Process | None = None
        self.worker_exited = asyncio.Event()
        self.http_url = ""
        self.grpc_target = ""
        self._tasks: list[asyncio.Task[None]] = []

    async def _start(self) -> None:
        s, stack = self.settings, self._stack
        await self.health_service.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        http_port, grpc_port = s.ports("follower")
        _, bound_grpc = await start_grpc(stack, s.server.host, grpc_port, self._register)
        wheel = Wheel(asyncio.get_running_loop())
        stack.callback(wheel.close)
        limits = Limits(s.server, wheel, self.ingress_metrics, "follower")
        bound_http = await start_http(
            stack, self._http_app(), s.server.host, http_port, limits=limits
        )
        host = advertised_host(s.server.host, s.server.advertise_host)
        self.http_url, self.grpc_target = f"http://{host}:{bound_http}", f"{host}:{bound_grpc}"
        stack.push_async_callback(cancel_tasks, self._tasks)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        for spec in s.follower.checks:
            self.state.expect(spec.name, "not checked yet")
            checker = self._checker(spec, session)
            self._tasks.append(asyncio.create_task(checker.run(), name=f"check {spec.name}"))
        if self.worker_command:
            await self._start_worker(self.worker_command)
        self.state.refresh()  # no checks and no worker: healthy now
        self._tasks.append(asyncio.create_task(self._publish(), name="grpc health"))
        log.info("follower %s: gRPC health %s, HTTP %s, %d checks%s",
                 self.node, self.grpc_target, self.http_url, len(s.follower.checks),
                 f", worker {self.worker_command[0]}" if self.worker_command else "")  # fmt: skip

    def _register(self, server: object) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.health_service, server)

    def _checker(self, spec: CheckSpec, session: aiohttp.ClientSession) -> Checker:
        h = self.settings.health
        policy = CheckPolicy(h.interval_s, h.timeout_s, h.unhealthy_threshold, h.healthy_threshold)
        return Checker(
            spec.name,
            _probe(spec),
            policy,
            lambda ok, reason: self.state.set(spec.name, ok, reason),
            observe=self.metrics.probe_duration.labels(self.node).observe,
            rng=random.Random(),
        )

    async def _start_worker(self, command: list[str]) -> None:
        self.worker = await asyncio.create_subprocess_exec(*command, preexec_fn=die_with_parent())
        self.state.set(WORKER, True, "")
        self._tasks.append(asyncio.create_task(self._reap_worker(self.worker), name="worker"))
        self._stack.push_async_callback(self.stop_worker)

    async def _reap_worker(self, worker: asyncio.subprocess.Process) -> None:
        code = await worker.wait()
        reason = f"worker exited with status {code}" if code >= 0 else (
            f"worker killed by {signal.Signals(-code).name}")  # fmt: skip
        self.state.set(WORKER, False, reason)
        self.worker_exited.set()

    async def stop_worker(self) -> None:
        """Forward SIGTERM to the worker; SIGKILL it after the stop timeout."""
        worker = self.worker
        if worker is None or worker.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            worker.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self.settings.follower.worker_stop_timeout_s):
                await worker.wait()
        except TimeoutError:
            log.warning("worker did not stop within the timeout; killing it")
            with contextlib.suppress(ProcessLookupError):
                worker.kill()
            await worker.wait()

    async def _publish(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        published: bool | None = None
        while True:
            seen = self.state.changes.version
            if self.state.healthy is not published:
                published = self.state.healthy
                await self.health_service.set("", serving if published else not_serving)
            await self.state.changes.wait(seen)

    def _http_app(self) -> web.Application:
        app = web.Application(middlewares=[ingress.phase_middleware()])
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics_page)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        body = {"node": self.node, "healthy": self.state.healthy, "failing": self.state.reasons()}
        return json_response(body, status=200 if self.state.healthy else 503)

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


def _probe(spec: CheckSpec) -> Probe:
    if spec.kind == "process":
        return probes.process_probe(int(spec.arg))
    if spec.kind == "tcp":
        return probes.tcp_probe(spec.arg, spec.port)
    if spec.kind == "command":
        return probes.command_probe(spec.arg)
    return probes.heartbeat_probe(Path(spec.arg), spec.max_age_s)

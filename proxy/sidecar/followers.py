"""Watching the unit's follower nodes from the leader.

One ``FollowerMonitor`` per node. The periodic probe (kind grpc, http or tcp) runs
under a ``Checker``, which owns timing and thresholds. Kind ``grpc-watch`` adds a held
``grpc.health.v1`` Watch stream: a NOT_SERVING message or a broken stream means the
node's process is gone or says so, and marks it unhealthy at once; the periodic Check
still runs to catch a node that is alive but hung (its stream just goes quiet).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proxy import probes
from proxy.checks import Checker, CheckPolicy, Probe
from proxy.settings import FollowerTarget, ProbeKind

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)
WATCH_BACKOFF_S = (0.05, 2.0)  # first and longest wait before re-opening a broken Watch


def probe_kind(target: FollowerTarget, configured: ProbeKind | None) -> ProbeKind:
    if configured is not None:
        return configured
    return "http" if target.is_http else "grpc-watch"


class FollowerMonitor:
    def __init__(
        self,
        target: FollowerTarget,
        kind: ProbeKind,
        policy: CheckPolicy,
        verdict: Callable[[bool, str], None],
        session: aiohttp.ClientSession,
        observe: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
    ):
        self.target = target
        self.kind = kind
        self._rng = rng or random.Random()
        self._channel: grpc.aio.Channel | None = None
        self._stub: health_pb2_grpc.HealthStub | None = None
        if kind in ("grpc", "grpc-watch"):
            self._channel = grpc.aio.insecure_channel(target.target, options=CHANNEL_OPTIONS)
            self._stub = health_pb2_grpc.HealthStub(self._channel)
        self.checker = Checker(
            target.name,
            self._probe(kind, session),
            policy,
            verdict,
            observe=observe,
            rng=self._rng,
        )

    def _probe(self, kind: ProbeKind, session: aiohttp.ClientSession) -> Probe:
        target = self.target.target
        if kind == "http":
            url = target if self.target.is_http else f"http://{target}/health"
            return probes.http_probe(session, url)
        if kind == "tcp":
            host, _, port = target.removeprefix("http://").split("/")[0].rpartition(":")
            return probes.tcp_probe(host, int(port))
        assert self._stub is not None
        return probes.grpc_health_probe(self._stub)

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.checker.run())
                if self.kind == "grpc-watch":
                    group.create_task(self._watch())
        finally:
            if self._channel is not None:
                await self._channel.close()

    async def _watch(self) -> None:
        assert self._stub is not None
        backoff = WATCH_BACKOFF_S[0]
        while True:
            try:
                reason = await self._hold_watch(self._stub)
                backoff = WATCH_BACKOFF_S[0] if reason is None else backoff
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("health watch of %s failed unexpectedly", self.target.name)
            await asyncio.sleep(backoff * self._rng.uniform(0.5, 1.0))
            backoff = min(backoff * 2, WATCH_BACKOFF_S[1])

    async def _hold_watch(self, stub: health_pb2_grpc.HealthStub) -> str | None:
        """Hold one Watch stream until it breaks; return why, or None if it ever served."""
        call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        served = False
        try:
            async for reply in call:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    served = True
                    self.checker.record(True, "")
                else:
                    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                    self.checker.fail_now(f"node says {name}")
            reason = "health watch stream ended"
        except grpc.aio.AioRpcError as exc:
            reason = f"health watch broke: {exc.code().name}"
        finally:
            call.cancel()
        self.checker.fail_now(reason)
        return None if served else reason

"""The unit's health: one record per node, and the unit state derived from them.

STARTING until every node was healthy once; SERVING while every node is healthy;
NOT_SERVING otherwise; DRAINING once a drain began (final). Checkers report what they
saw with ``set_node``; every change is announced at once on ``changes`` (with the
load), a change of unit state also on ``state_changes``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.broadcast import Broadcast
from proxy.load import NodeStatus, UnitState
from proxy.metrics import HealthMetrics, UnitMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Node:
    name: str
    role: str
    address: str
    healthy: bool = False
    reason: str = "not checked yet"
    since_ms: int = 0
    ever_healthy: bool = False

    def status(self) -> NodeStatus:
        return NodeStatus(
            self.name, self.role, self.address, self.healthy, self.reason, self.since_ms
        )


class UnitHealth:
    def __init__(
        self,
        unit_id: str,
        metrics: UnitMetrics,
        health_metrics: HealthMetrics,
        changes: Broadcast,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ):
        self.unit_id = unit_id
        self._metrics = metrics
        self._health_metrics = health_metrics
        self._changes = changes
        self.state_changes = Broadcast()
        self._wall_ms = wall_ms
        self._nodes: dict[str, _Node] = {}
        self._draining = False
        self.state = UnitState.STARTING
        metrics.set_state(self.state)

    def add_node(self, name: str, role: str, address: str) -> None:
        if name in self._nodes:
            raise ValueError(f"node {name!r} is configured twice")
        self._nodes[name] = _Node(name, role, address, since_ms=self._wall_ms())
        self._health_metrics.add_node(name, role)
        self._update_state()

    def set_node(self, name: str, healthy: bool, reason: str = "") -> None:
        node = self._nodes[name]
        if node.healthy == healthy and (healthy or node.reason == reason):
            return
        if node.healthy != healthy:
            node.since_ms = self._wall_ms()
            to = "healthy" if healthy else "unhealthy"
            self._health_metrics.health_transitions.labels(name, to).inc()
            self._health_metrics.node_healthy.labels(name, node.role).set(1 if healthy else 0)
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "unit %s: node %s (%s) is %s%s",
                self.unit_id, name, node.role, to, f": {reason}" if reason else "",
            )  # fmt: skip
        node.healthy = healthy
        node.reason = "" if healthy else reason
        node.ever_healthy |= healthy
        self._update_state()
        self._changes.notify()

    def start_drain(self) -> None:
        self._draining = True
        self._update_state()

    @property
    def draining(self) -> bool:
        return self._draining

    def nodes(self) -> tuple[NodeStatus, ...]:
        return tuple(n.status() for n in self._nodes.values())

    def failed_nodes(self) -> list[str]:
        return [n.name for n in self._nodes.values() if not n.healthy]

    def _derive(self) -> UnitState:
        if self._draining:
            return UnitState.DRAINING
        nodes = self._nodes.values()
        if not all(n.ever_healthy for n in nodes):
            return UnitState.STARTING
        if all(n.healthy for n in nodes):
            return UnitState.SERVING
        return UnitState.NOT_SERVING

    def _update_state(self) -> None:
        state = self._derive()
        if state == self.state:
            return
        log.info("unit %s: %s -> %s", self.unit_id, self.state, state)
        self.state = state
        self._metrics.set_state(state)
        self.state_changes.notify()
        self._changes.notify()

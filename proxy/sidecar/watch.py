"""The stream of load reports a watcher gets, over gRPC (WatchLoad) or HTTP (/load/watch).

The current report at once, then one per change, and a heartbeat at least every
``interval_s``. Changes that arrive while a report is sent, or within ``coalesce_s``
after it, fold into the next report; a change of unit state goes out at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from proxy.broadcast import Broadcast
from proxy.load import LoadReport


class _Health(Protocol):
    @property
    def state_changes(self) -> Broadcast: ...


class Reporter(Protocol):
    """What a watch needs of a unit (``SidecarCore``; bench/scale's emulated units)."""

    @property
    def health(self) -> _Health: ...

    def report(self) -> LoadReport: ...


class ReportWatch:
    def __init__(
        self, core: Reporter, changes: Broadcast, interval_s: float, coalesce_s: float = 0.0
    ):
        self._core = core
        self._changes = changes
        self._interval_s = interval_s
        self._coalesce_s = coalesce_s
        self.closed = False

    async def reports(self) -> AsyncIterator[LoadReport]:
        """Reports until ``close()``: the sidecar is stopping."""
        loop = asyncio.get_running_loop()
        states = self._core.health.state_changes
        while not self.closed:
            seen, state_seen = self._changes.version, states.version
            yield self._core.report()
            sent_at = loop.time()
            await self._changes.wait(seen, self._interval_s)
            hold = sent_at + self._coalesce_s - loop.time()
            if hold > 0 and states.version == state_seen and not self.closed:
                await states.wait(state_seen, hold)

    async def close(self) -> None:
        """End every stream (after its current wait), so a stop is not held up by them."""
        self.closed = True
        self._changes.notify()

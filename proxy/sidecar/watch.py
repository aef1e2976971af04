"""The stream of load reports a watcher gets, over gRPC (WatchLoad) or HTTP (/load/watch).

The current report at once (with the whole set of prefix blocks the engine holds), then
one per change (with the prefix blocks' changes since the previous report), and a heartbeat at least every
``interval_s``. Changes that arrive while a report is sent, or within ``coalesce_s``
after it, fold into the next report; a change of unit state goes out at once. A
watcher may ask for fewer reports (a longer coalescing and heartbeat, for itself only).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Protocol

from proxy.broadcast import Broadcast
from proxy.load import MAX_DELTA_BLOCKS, LoadReport

MAX_ASKED_S = 60.0  # the longest interval a watcher may ask for


class _Health(Protocol):
    @property
    def state_changes(self) -> Broadcast: ...


class Reporter(Protocol):
    """What a watch needs of a unit (``SidecarCore``; bench/scale's emulated units)."""

    @property
    def health(self) -> _Health: ...

    def report(
        self, blocks_since: tuple[int, int] | None = None, watcher: str | None = None
    ) -> LoadReport: ...


class ReportWatch:
    def __init__(
        self,
        core: Reporter,
        changes: Broadcast,
        interval_s: float,
        coalesce_s: float = 0.0,
        rng: random.Random | None = None,
    ):
        self._core = core
        self._changes = changes
        self._interval_s = interval_s
        self._coalesce_s = coalesce_s
        self._rng = rng or random.Random()
        self.closed = False

    async def reports(
        self, min_interval_s: float = 0.0, heartbeat_s: float = 0.0, watcher: str | None = None
    ) -> AsyncIterator[LoadReport]:
        """Reports until ``close()``: the sidecar is stopping.

        A watcher may ask for fewer reports: changes no more often than
        ``min_interval_s`` (never more often than this unit coalesces), a heartbeat every
        ``heartbeat_s``; each at most ``MAX_ASKED_S``. Zero keeps the unit's own. The
        first interval after the first report is a random part of the asked one: a
        gateway that opens thousands of streams at once then does not get their reports
        in bursts of thousands, in step, for as long as the streams last. ``watcher``:
        the watching gateway's name, whose requests each report counts apart.
        """
        loop = asyncio.get_running_loop()
        states = self._core.health.state_changes
        coalesce_s = max(self._coalesce_s, min(min_interval_s, MAX_ASKED_S))
        interval_s = min(heartbeat_s, MAX_ASKED_S) if heartbeat_s > 0 else self._interval_s
        phase = self._rng.random() if min_interval_s > 0 or heartbeat_s > 0 else 1.0
        held: tuple[int, int] | None = None  # the prefix blocks this watcher holds
        while not self.closed:
            seen, state_seen = self._changes.version, states.version
            report = self._core.report(held, watcher)
            blocks = report.prefix_blocks
            if blocks is not None:
                held = blocks.epoch, blocks.seq
                if not blocks.full and blocks.seq - blocks.from_seq >= MAX_DELTA_BLOCKS:
                    seen = -1  # likely more changes than one report carries: next at once
            yield report
            sent_at = loop.time()
            await self._changes.wait(seen, interval_s * phase)
            hold = sent_at + coalesce_s * phase - loop.time()
            phase = 1.0
            if hold > 0 and states.version == state_seen and not self.closed:
                await states.wait(state_seen, hold)

    async def close(self) -> None:
        """End every stream (after its current wait), so a stop is not held up by them."""
        self.closed = True
        self._changes.notify()

"""Publishing the unit's load report to Redis (docs/api.md, Load report).

On every change (coalesced: changes that arrive while one report is on its way fold
into the next) and at least every report interval, one MULTI: ``SET unit:{id}`` with
a TTL of 3 report intervals, ``SADD units``, ``PUBLISH load``, and a ``GET`` of the
interval gateways ask for (``report_interval_ms``): while one is set, load changes go
out at most that often, and a heartbeat at least that often; a change of state still
goes out at once. While Redis is down
the sidecar serves as before; the latest report goes out as soon as Redis is back.
On a clean stop a last report says the unit is going away, if Redis answers within
its timeout.

The prefix blocks the engine holds: the key holds the whole set, each message on the
channel the changes since the previous message, so a gateway that missed one (its seq
does not follow on) re-reads the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import Callable
from types import TracebackType
from typing import Self

from proxy.broadcast import Broadcast
from proxy.load import MAX_DELTA_BLOCKS, LoadReport, PrefixBlocks, UnitState
from proxy.redis_reports import REDIS_ERRORS, Keys, Outage, asked_s, connect
from proxy.settings import RedisSettings

log = logging.getLogger(__name__)

TTL_INTERVALS = 3  # a report lives this many report intervals in Redis


class ReportPublisher:
    """``async with ReportPublisher(...)`` publishes until the block ends."""

    def __init__(
        self,
        settings: RedisSettings,
        report: Callable[[tuple[int, int] | None], LoadReport],
        changes: Broadcast,
        interval_s: float,
        rng: random.Random | None = None,
        full_blocks: Callable[[], PrefixBlocks] | None = None,
    ):
        self._settings = settings
        self._report = report
        self._full_blocks = full_blocks  # the whole set, for the key
        self._blocks_since: tuple[int, int] | None = None  # as of the last message
        self._changes = changes
        self._interval_s = interval_s
        self._ttl_ms = max(1, round(TTL_INTERVALS * interval_s * 1000))
        self._keys = Keys(settings.cluster)
        self._redis = connect(settings)
        self._outage = Outage("sidecar report publisher", settings, rng)
        self._task: asyncio.Task[None] | None = None
        self.published = 0
        self.asked_s = 0.0  # the report interval gateways ask for; 0: none

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self.run(), name="redis publisher")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self._publish_final()
        finally:
            await self._redis.aclose()

    async def run(self) -> None:
        while True:
            try:
                await self._publish_changes()
            except asyncio.CancelledError:
                raise
            except REDIS_ERRORS as exc:
                self._outage.failed(exc, "the unit keeps serving")
            except Exception as exc:
                log.exception("publishing load reports to Redis failed unexpectedly")
                self._outage.failed(exc, "the unit keeps serving")
            await self._outage.backoff()

    async def _publish_changes(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            seen = self._changes.version
            report = self._report(self._blocks_since)
            await self.publish(report)
            self._outage.recovered()
            blocks = report.prefix_blocks
            if blocks is not None:
                self._blocks_since = blocks.epoch, blocks.seq
                if not blocks.full and blocks.seq - blocks.from_seq >= MAX_DELTA_BLOCKS:
                    continue  # likely more changes than one message carries
            sent_at, asked = loop.time(), self.asked_s
            await self._changes.wait(seen, max(self._interval_s, asked))
            await self._hold(report.state, sent_at + asked)

    async def _hold(self, state: UnitState, until: float) -> None:
        """Gateways asked for fewer reports: changes fold in until ``until``, unless the
        unit's state changes."""
        loop = asyncio.get_running_loop()
        while (left := until - loop.time()) > 0:
            if self._report(self._blocks_since).state is not state:
                return
            await self._changes.wait(self._changes.version, left)

    async def publish(self, report: LoadReport) -> None:
        data = key_data = report.to_json()
        blocks = report.prefix_blocks
        if blocks is not None and not blocks.full and self._full_blocks is not None:
            key_data = dataclasses.replace(report, prefix_blocks=self._full_blocks()).to_json()
        ttl_ms = max(self._ttl_ms, round(TTL_INTERVALS * self.asked_s * 1000))
        async with asyncio.timeout(self._settings.timeout_s):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self._keys.unit(report.unit_id), key_data, px=ttl_ms)
                pipe.sadd(self._keys.units, report.unit_id)
                pipe.publish(self._keys.channel, data)
                pipe.get(self._keys.asked)
                *_, asked = await pipe.execute()
        self.published += 1
        self.asked_s = asked_s(asked)

    async def _publish_final(self) -> None:
        """The unit is stopping: say it takes no new requests, if Redis answers in time."""
        report = self._report(None)
        if report.state in (UnitState.STARTING, UnitState.SERVING):
            report = dataclasses.replace(report, state=UnitState.DRAINING)
        try:
            await self.publish(report)
        except REDIS_ERRORS as exc:
            log.debug("final load report not published to Redis: %s", exc)

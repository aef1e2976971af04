"""Publishing the unit's load report to Redis (docs/api.md, Load report).

On every change (coalesced: changes that arrive while one report is on its way fold
into the next) and at least every report interval, one MULTI: ``SET unit:{id}`` with
a TTL of 3 report intervals, ``SADD units``, ``PUBLISH load``. While Redis is down
the sidecar serves as before; the latest report goes out as soon as Redis is back.
On a clean stop a last report says the unit is going away, if Redis answers within
its timeout.
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
from proxy.load import LoadReport, UnitState
from proxy.redis_reports import REDIS_ERRORS, Keys, Outage, connect
from proxy.settings import RedisSettings

log = logging.getLogger(__name__)

TTL_INTERVALS = 3  # a report lives this many report intervals in Redis


class ReportPublisher:
    """``async with ReportPublisher(...)`` publishes until the block ends."""

    def __init__(
        self,
        settings: RedisSettings,
        report: Callable[[], LoadReport],
        changes: Broadcast,
        interval_s: float,
        rng: random.Random | None = None,
    ):
        self._settings = settings
        self._report = report
        self._changes = changes
        self._interval_s = interval_s
        self._ttl_ms = max(1, round(TTL_INTERVALS * interval_s * 1000))
        self._keys = Keys(settings.cluster)
        self._redis = connect(settings)
        self._outage = Outage("sidecar report publisher", settings, rng)
        self._task: asyncio.Task[None] | None = None
        self.published = 0

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
        while True:
            seen = self._changes.version
            await self.publish(self._report())
            self._outage.recovered()
            await self._changes.wait(seen, self._interval_s)

    async def publish(self, report: LoadReport) -> None:
        data = report.to_json()
        async with asyncio.timeout(self._settings.timeout_s):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self._keys.unit(report.unit_id), data, px=self._ttl_ms)
                pipe.sadd(self._keys.units, report.unit_id)
                pipe.publish(self._keys.channel, data)
                await pipe.execute()
        self.published += 1

    async def _publish_final(self) -> None:
        """The unit is stopping: say it takes no new requests, if Redis answers in time."""
        report = self._report()
        if report.state in (UnitState.STARTING, UnitState.SERVING):
            report = dataclasses.replace(report, state=UnitState.DRAINING)
        try:
            await self.publish(report)
        except REDIS_ERRORS as exc:
            log.debug("final load report not published to Redis: %s", exc)

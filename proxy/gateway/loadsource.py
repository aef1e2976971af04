"""Keeping the router's view of unit load current.

``watch`` (default): one held WatchLoad stream per unit; the sidecar pushes a report
on every change and a heartbeat every interval. A broken stream means the sidecar is
gone or restarting: the unit gets no new requests until it reports again, and the
stream is re-opened with exponential backoff and jitter.
``poll``: GET /load every interval.
Either can delay each report on purpose (``report_delay_s``) for benchmarks.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import aiohttp
import grpc

from proxy.gateway.router import Router
from proxy.gateway.units import Unit
from proxy.load import LoadReport
from proxy.pb.unitproxy.v1 import load_pb2, load_pb2_grpc

log = logging.getLogger(__name__)

BACKOFF_S = (0.05, 2.0)  # first and longest wait before reconnecting


class LoadSource:
    def __init__(self, router: Router, rng: random.Random | None = None):
        self._router = router
        self._rng = rng or random.Random()
        self._delay_s = router.settings.report_delay_s

    def _deliver(self, unit: Unit, report: LoadReport) -> None:
        if self._delay_s > 0:
            loop = asyncio.get_running_loop()
            loop.call_later(self._delay_s, self._router.apply_report, unit.id, report)
        else:
            self._router.apply_report(unit.id, report)

    async def _backoff(self, attempt: int) -> None:
        first, most = BACKOFF_S
        await asyncio.sleep(min(first * 2**attempt, most) * self._rng.uniform(0.5, 1.0))


class WatchSource(LoadSource):
    def __init__(
        self,
        router: Router,
        channel_for: Callable[[Unit], grpc.aio.Channel],
        rng: random.Random | None = None,
    ):
        super().__init__(router, rng)
        self._channel_for = channel_for

    async def run(self, unit: Unit) -> None:
        stub = load_pb2_grpc.LoadReportingStub(self._channel_for(unit))
        attempt = 0
        while True:
            try:
                received = await self._hold(unit, stub)
                why = "load stream ended"
            except grpc.aio.AioRpcError as exc:
                received, why = False, f"load stream broke: {exc.code().name}"
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("load watch of unit %s failed unexpectedly", unit.id)
                received, why = False, "load watch failed"
            self._router.forget_report(unit.id, why)
            attempt = 0 if received else attempt + 1
            await self._backoff(attempt)

    async def _hold(self, unit: Unit, stub: load_pb2_grpc.LoadReportingStub) -> bool:
        call = stub.WatchLoad(load_pb2.WatchLoadRequest())
        received = False
        try:
            async for msg in call:
                received = True
                self._deliver(unit, LoadReport.from_pb(msg))
        finally:
            call.cancel()
        return received


class PollSource(LoadSource):
    def __init__(
        self, router: Router, session: aiohttp.ClientSession, rng: random.Random | None = None
    ):
        super().__init__(router, rng)
        self._session = session
        self._interval_s = router.settings.poll_interval_s

    async def run(self, unit: Unit) -> None:
        while True:
            try:
                await self._poll(unit)
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
                log.debug("polling unit %s failed: %s", unit.id, exc)
            except Exception:
                log.exception("polling unit %s failed unexpectedly", unit.id)
            await asyncio.sleep(self._interval_s * self._rng.uniform(0.9, 1.1))

    async def _poll(self, unit: Unit) -> None:
        timeout = aiohttp.ClientTimeout(total=self._interval_s)
        async with self._session.get(f"{unit.http_url}/load", timeout=timeout) as resp:
            resp.raise_for_status()
            self._deliver(unit, LoadReport.from_dict(await resp.json()))

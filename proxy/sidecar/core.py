"""What the sidecar does for one request, whatever wire it came on.

``admit`` decides at once (429 full, 503 not serving) and hands out a ``Lease``;
``run`` drives the engine, passes each delta to the caller's ``emit``, observes the
latency metrics and releases the lease on every path: finished, engine error,
deadline, client gone (the caller's task cancelled).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from engine.base import Engine, EngineRequest, TokenDelta
from proxy.broadcast import Broadcast
from proxy.errors import DeadlineExceeded, EngineError, Overloaded, Unavailable
from proxy.load import LoadReport, UnitState
from proxy.metrics import ServingMetrics
from proxy.sidecar.health import UnitHealth

_T = TypeVar("_T")
# How often a request awaiting a whole answer looks at the engine's step count.
_PROGRESS_POLL_S = 1.0


class Lease:
    """One admitted request; ``release`` takes it off the outstanding count once."""

    __slots__ = ("_core", "admitted_at", "released")

    def __init__(self, core: SidecarCore, admitted_at: float):
        self._core = core
        self.admitted_at = admitted_at
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._core._release()


class SidecarCore:
    def __init__(
        self,
        *,
        unit_id: str,
        engine: Engine,
        health: UnitHealth,
        metrics: ServingMetrics,
        changes: Broadcast,
        capacity: int,
        retry_after_s: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.unit_id = unit_id
        self.engine = engine
        self.health = health
        self.capacity = capacity
        self.outstanding = 0
        self.http_url = ""
        self.grpc_target = ""
        self.last_progress_at = clock()
        # Requests whose last token waits on a slow client: the engine owes them nothing.
        self._on_client = 0
        self._metrics = metrics
        self._changes = changes
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._seq = 0

    def admit(self) -> Lease:
        state = self.health.state
        if state is not UnitState.SERVING:
            raise Unavailable(f"unit {self.unit_id} is {state}", code=state.lower())
        if self.outstanding >= self.capacity:
            raise Overloaded(
                f"unit {self.unit_id} is at capacity ({self.capacity} outstanding requests)",
                retry_after_s=self._retry_after_s,
                code="unit_at_capacity",
            )
        if self.outstanding == self._on_client:
            self.last_progress_at = self._clock()  # the watchdog's clock starts with work
        self.outstanding += 1
        self._metrics.outstanding.set(self.outstanding)
        self._changes.notify()
        return Lease(self, self._clock())

    def _release(self) -> None:
        self.outstanding -= 1
        self._metrics.outstanding.set(self.outstanding)
        self._changes.notify()

    async def run(
        self,
        lease: Lease,
        request: EngineRequest,
        route: str,
        emit: Callable[[TokenDelta], Awaitable[None]],
        deadline: float | None = None,
    ) -> TokenDelta:
        """Generate ``request``, passing each delta to ``emit``; return the last delta.

        ``deadline`` is on the event loop's clock. Always releases ``lease``.
        """
        metrics = self._metrics
        last: TokenDelta | None = None
        previous = lease.admitted_at
        timeout = asyncio.timeout_at(deadline)
        try:
            async with timeout, aclosing(self.engine.generate(request)) as deltas:
                async for delta in deltas:
                    now = self._clock()
                    self.last_progress_at = now
                    if last is None:
                        metrics.ttft.labels(route).observe(now - previous)
                    else:
                        metrics.inter_token.observe(now - previous)
                    previous = now
                    metrics.generated_tokens.inc(len(delta.token_ids))
                    await self._emit(emit, delta)
                    last = delta
        except TimeoutError as exc:
            if timeout.expired():
                raise DeadlineExceeded("the request's deadline passed") from exc
            raise
        finally:
            lease.release()
            metrics.request_duration.labels(route).observe(self._clock() - lease.admitted_at)
        if last is None:
            raise EngineError("the engine ended the request without output")
        return last

    async def _emit(self, emit: Callable[[_T], Awaitable[None]], delta: _T) -> None:
        # A client that stops reading blocks here (backpressure): that is no engine stall,
        # and must not make the watchdog take the unit out of service.
        self._on_client += 1
        try:
            await emit(delta)
        finally:
            self._on_client -= 1
        if self.outstanding - self._on_client == 1:
            self.last_progress_at = self._clock()  # back to the engine, the only one waiting

    async def relay(
        self,
        lease: Lease,
        chunks: AsyncGenerator[bytes, None],
        route: str,
        emit: Callable[[bytes], Awaitable[None]],
        deadline: float | None = None,
    ) -> None:
        """Pass an engine's own response bytes to ``emit``, as ``run`` does deltas.

        For engines that serve the OpenAI routes themselves (engine/frontend.py): each
        piece counts as progress and as a token for the latency metrics; the engine
        counts the tokens themselves. Closing ``chunks`` aborts the request in the
        engine. Always releases ``lease``.
        """
        metrics = self._metrics
        previous, first = lease.admitted_at, True
        timeout = asyncio.timeout_at(deadline)
        try:
            async with timeout, aclosing(chunks):
                async for chunk in chunks:
                    now = self._clock()
                    self.last_progress_at = now
                    if first:
                        metrics.ttft.labels(route).observe(now - previous)
                        first = False
                    else:
                        metrics.inter_token.observe(now - previous)
                    previous = now
                    await self._emit(emit, chunk)
        except TimeoutError as exc:
            if timeout.expired():
                raise DeadlineExceeded("the request's deadline passed") from exc
            raise
        finally:
            self.finish(lease, route)

    def finish(self, lease: Lease, route: str) -> None:
        """Release ``lease`` and observe its duration, once."""
        if not lease.released:
            lease.release()
            self._metrics.request_duration.labels(route).observe(self._clock() - lease.admitted_at)

    async def wait_whole(self, answer: Awaitable[_T], steps: Callable[[], int | None]) -> _T:
        """Await a whole (non-streamed) answer, feeding the progress watchdog meanwhile.

        ``steps`` is the engine's step count: each change counts as progress. An engine
        that cannot tell (None) is trusted while it works: the request is left out of
        the watchdog, as one waiting on its client is.
        """
        first = steps()
        if first is None:
            self._on_client += 1
            try:
                return await answer
            finally:
                self._on_client -= 1
        task = asyncio.ensure_future(answer)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_PROGRESS_POLL_S)
                if done:
                    return task.result()
                now = steps()
                if now != first:
                    first, self.last_progress_at = now, self._clock()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})

    def count_tokens(self, generated: int) -> None:
        """Tokens an engine's own layer generated (``relay`` cannot see them)."""
        self._metrics.generated_tokens.inc(generated)

    def stalled_for(self) -> float:
        """Seconds the engine has had work and produced no token; 0 when idle."""
        if self.outstanding <= self._on_client:
            return 0.0  # idle, or every request waits on its client
        return self._clock() - self.last_progress_at

    def report(self) -> LoadReport:
        self._seq += 1
        stats = self.engine.stats()
        return LoadReport(
            unit_id=self.unit_id,
            state=self.health.state,
            outstanding=self.outstanding,
            capacity=self.capacity,
            running=stats.running,
            waiting=stats.waiting,
            kv_cache_usage=stats.kv_cache_usage,
            nodes=self.health.nodes(),
            seq=self._seq,
            timestamp_ms=int(time.time() * 1000),
            http_url=self.http_url,
            grpc_target=self.grpc_target,
        )

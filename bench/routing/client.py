"""The load generator: streamed /v1/completions through a gateway, open or closed loop.

Times are offsets from the run's start on ``time.perf_counter`` (uvloop's
``loop.time()`` has only millisecond resolution). TTFT is client-side: from sending
to the first SSE data event. A request succeeds when it had status 200, exactly
``max_tokens`` data events and the final ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.routing.workload import Arrival, RequestSpec
from proxy.httputil import UNIT_HEADER

now = time.perf_counter
HEADERS = {"Content-Type": "application/json"}
EVENT = b"data: "
DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Outcome:
    """One request; filled in as it goes, so a cancelled one still says how far it got."""

    arrival_s: float  # when it was due (open loop) or sent (closed loop)
    max_tokens: int
    sent_s: float | None = None
    ttft_s: float | None = None
    done_s: float | None = None  # when it ended, well or not
    error: str | None = None
    unit: str | None = None

    @property
    def ok(self) -> bool:
        return self.done_s is not None and self.error is None


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    t0: float,
    out: Outcome,
    on_events: Callable[[int], None] | None = None,
) -> None:
    sent = now()
    out.sent_s = sent - t0
    try:
        async with session.post(url, data=body, headers=HEADERS) as resp:
            out.unit = resp.headers.get(UNIT_HEADER)
            if resp.status != 200:
                out.error = await _http_error(resp)
            else:
                out.error = await _read_stream(resp, out, sent, on_events)
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.error = type(exc).__name__
    out.done_s = now() - t0


async def _http_error(resp: aiohttp.ClientResponse) -> str:
    try:
        code = (await resp.json(content_type=None))["error"]["code"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        code = "?"
    return f"http {resp.status} {code}"


async def _read_stream(
    resp: aiohttp.ClientResponse,
    out: Outcome,
    sent: float,
    on_events: Callable[[int], None] | None,
) -> str | None:
    """Count data events without splitting lines; None when the stream was complete."""
    events, carry, tail = 0, b"", b""
    async for data in resp.content.iter_any():
        joined = carry + data  # an event marker split across two reads is counted once
        new = joined.count(EVENT)
        events += new
        if on_events is not None and new:
            on_events(new)
        if events and out.ttft_s is None:
            out.ttft_s = now() - sent
        carry = joined[-(len(EVENT) - 1) :]
        tail = (tail + data)[-len(DONE) :]
    if tail != DONE:
        return f"stream cut after {events} events"  # an SSE error event ends it this way
    if events - 1 != out.max_tokens:
        return f"stream: {events - 1} chunks, want {out.max_tokens}"
    return None


# -- open loop ------------------------------------------------------------------------


@dataclass
class OpenLoopRun:
    outcomes: list[Outcome]
    send_lag_s: list[float]  # how late each request was sent against its schedule
    unfinished: int  # still running when the drain bound passed; cancelled
    wall_s: float


async def open_loop(
    session: aiohttp.ClientSession,
    url: str | Sequence[str],
    arrivals: list[Arrival],
    drain_s: float,
) -> OpenLoopRun:
    """Send each arrival at its time, as its own task; then wait for all, within drain_s.
    With several URLs (gateway replicas), arrival i goes to the (i mod n)-th: clients
    spread over them with no stickiness."""
    urls = [url] if isinstance(url, str) else list(url)
    outcomes = [Outcome(a.at_s, a.spec.max_tokens) for a in arrivals]
    tasks: list[asyncio.Task[None]] = []
    lags: list[float] = []
    t0 = now()
    try:
        for arrival, out in zip(arrivals, outcomes, strict=True):
            delay = t0 + arrival.at_s - now()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(now() - t0 - arrival.at_s)
            target = urls[arrival.index % len(urls)]
            tasks.append(asyncio.create_task(stream_one(session, target, arrival.body, t0, out)))
        pending: set[asyncio.Task[None]] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_s)
    finally:
        await cancel(tasks)
    _raise_bugs(tasks)
    return OpenLoopRun(outcomes, lags, len(pending), now() - t0)


async def cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _raise_bugs(tasks: list[asyncio.Task[None]]) -> None:
    """An exception other than cancellation in a request task is a bug of this program."""
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


# -- closed loop ----------------------------------------------------------------------


@dataclass
class ClosedLoopRun:
    concurrency: int
    window_s: float
    completed: int = 0  # successes that ended inside the window
    streamed_tokens: int = 0  # tokens received inside the window, of any request
    errors: Counter[str] = field(default_factory=Counter)
    per_unit: Counter[str] = field(default_factory=Counter)

    @property
    def completions_per_s(self) -> float:
        return self.completed / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return self.streamed_tokens / self.window_s


async def closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    requests: Iterator[tuple[RequestSpec, bytes]],
    concurrency: int,
    warmup_s: float,
    window_s: float,
) -> ClosedLoopRun:
    """``concurrency`` workers each send the next request as theirs ends; counts what
    completes and every token streamed in ``[warmup_s, warmup_s + window_s]``, then
    cancels what is in flight."""
    run = ClosedLoopRun(concurrency, window_s)
    t0 = now()
    end = warmup_s + window_s

    def count_tokens(events: int) -> None:
        if warmup_s <= now() - t0 <= end:
            run.streamed_tokens += events  # [DONE] too: taken back in _count

    async def worker() -> None:
        while now() - t0 < end:
            spec, body = next(requests)
            out = Outcome(now() - t0, spec.max_tokens)
            await stream_one(session, url, body, t0, out, count_tokens)
            _count(run, out, warmup_s, end)

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.wait(workers, timeout=end)
    finally:
        await cancel(workers)  # in-flight requests are abandoned: the client disconnects
    _raise_bugs(workers)
    return run


def _count(run: ClosedLoopRun, out: Outcome, start: float, end: float) -> None:
    if out.error is not None:
        run.errors[out.error] += 1
    elif out.done_s is not None and start <= out.done_s <= end:
        run.completed += 1
        run.streamed_tokens -= 1  # its [DONE] event
        run.per_unit[out.unit or "?"] += 1

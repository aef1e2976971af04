"""Stream writes that merge what piles up while the reader is behind.

A gRPC message costs the same whether it carries one token or fifty, and a grpc.aio
write takes about a tenth of a millisecond of CPU. ``Coalescer`` writes each item at
once while the peer keeps up; items put while a write is in flight wait and go out
merged, as one item, in the next write. So a stream's first token is never held back,
and a client that falls behind gets fewer, larger messages instead of a growing queue.
(vLLM does the same between its engine and a slow ``generate`` consumer.)

``put`` returns at once unless ``limit`` items already wait: then it waits for the
write in flight, which is the backpressure a stalled client puts on its producer.
``offer`` is ``put`` for a producer that is a protocol callback: it never waits, and
pauses the producer's reading instead until the writer has taken what waits.

``writing_since`` is the loop time the write in flight began (0.0 when none is): a
writer that waits that long on a peer's flow control is the owner's to give up on.

``interval_s`` spaces the writes: after one, the next waits until that much time has
passed (or ``close``), merging what comes meanwhile. The first item still goes out at
once, and an item that comes after a quiet spell of that length waits for nothing;
under a fast producer each write carries about ``interval_s`` of its items. Where a
write costs far more than an item (a message on a socket against a token), that is
fewer writes for the same items, at the price of holding an item back up to
``interval_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")

DEFAULT_LIMIT = 256


class Reader(Protocol):
    """What ``offer`` pauses: a connection's reading."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Coalescer(Generic[T]):
    def __init__(
        self,
        write: Callable[[T], Awaitable[object]],
        merge: Callable[[Sequence[T]], T],
        limit: int = DEFAULT_LIMIT,
        interval_s: float = 0.0,
    ):
        self._write = write
        self._merge = merge
        self._limit = limit
        self._interval_s = interval_s
        self._pending: list[T] = []
        self._closing = False
        self._loop = asyncio.get_running_loop()
        self._wake: asyncio.Future[None] | None = None  # the writer waits for items
        self._room: asyncio.Future[None] | None = None  # a producer waits for the writer
        self._paused: Reader | None = None  # a producer that offer paused
        self._spacing: asyncio.Future[None] | None = None  # the writer waits out interval_s
        self._task = self._loop.create_task(self._run())
        self.writes = 0
        self.writing_since = 0.0  # loop time the write in flight began; 0.0: none is

    async def put(self, item: T) -> None:
        """Queue ``item``; raises the writer's error if a write failed."""
        if self._task.done():
            self._task.result()  # the writer's error; CancelledError if cancelled
            raise RuntimeError("put after close")
        self._pending.append(item)
        _wake(self._wake)
        if len(self._pending) >= self._limit:
            self._room = room = self._loop.create_future()
            await asyncio.wait([room, self._task], return_when=asyncio.FIRST_COMPLETED)
            if self._task.done():
                self._task.result()

    def offer(self, item: T, reader: Reader) -> None:
        """Queue ``item`` without waiting; past ``limit`` items waiting, ``reader`` is
        paused until the writer takes them. After the writer stopped (its error is
        raised by ``close``) items are dropped."""
        if self._task.done():
            return
        self._pending.append(item)
        _wake(self._wake)
        if len(self._pending) >= self._limit and self._paused is None:
            self._paused = reader
            reader.pause_reading()

    @property
    def stopped(self) -> bool:
        """The writer is done: closed, cancelled or failed."""
        return self._task.done()

    async def close(self) -> None:
        """Write what waits, then return; raises the writer's error."""
        self._closing = True
        _wake(self._wake)
        _wake(self._spacing)
        await self._task

    def cancel(self) -> None:
        """Drop what waits and stop writing (the stream is over)."""
        task = self._task
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()  # retrieved: the caller has its own error to report

    async def _run(self) -> None:
        while True:
            pending = self._pending
            if not pending:
                if self._closing:
                    return
                self._wake = self._loop.create_future()
                await self._wake
                self._wake = None
                continue
            self._pending = []
            _wake(self._room)
            if self._paused is not None:
                reader, self._paused = self._paused, None
                reader.resume_reading()
            item = pending[0] if len(pending) == 1 else self._merge(pending)
            self.writes += 1
            self.writing_since = self._loop.time()
            await self._write(item)
            self.writing_since = 0.0
            if self._interval_s > 0 and not self._closing:
                await self._space()

    async def _space(self) -> None:
        self._spacing = spacing = self._loop.create_future()
        timer = self._loop.call_later(self._interval_s, _wake, spacing)
        try:
            await spacing
        finally:
            timer.cancel()
            self._spacing = None


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)

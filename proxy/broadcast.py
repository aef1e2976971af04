"""A change signal many tasks can wait on; waiters see the latest state, not each change."""

from __future__ import annotations

import asyncio


class Broadcast:
    def __init__(self) -> None:
        self.version = 0
        self._event: asyncio.Event | None = None  # made by the first waiter: notify is cheap

    def notify(self) -> None:
        self.version += 1
        event, self._event = self._event, None
        if event is not None:
            event.set()

    async def wait(self, seen: int, max_wait_s: float | None = None) -> bool:
        """Wait until version moves past ``seen``; False when ``max_wait_s`` ran out first."""
        if self.version != seen:
            return True
        event = self._event
        if event is None:
            event = self._event = asyncio.Event()
        try:
            async with asyncio.timeout(max_wait_s):
                await event.wait()
        except TimeoutError:
            return False
        return True

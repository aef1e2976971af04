"""The gateway's count of requests in flight, and its refusal of new ones once draining.

Every request enters and leaves it, so it is compiled with the request path (setup.py).
"""

from __future__ import annotations

from prometheus_client import Gauge

from proxy.broadcast import Broadcast
from proxy.errors import Unavailable


class Gate:
    """Counts requests in flight; once closed (draining) it refuses new ones with 503."""

    def __init__(self, what: str, changes: Broadcast, gauge: Gauge):
        self.what = what
        self.in_flight = 0
        self.closed = False
        self._changes = changes
        gauge.set_function(lambda: self.in_flight)  # read at scrape: nothing per request

    def enter(self) -> None:
        if self.closed:
            raise Unavailable(f"{self.what} is draining", code="draining")
        self.in_flight += 1

    def exit(self) -> None:
        self.in_flight -= 1
        self._changes.notify()

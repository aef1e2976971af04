"""Load reports in Redis (docs/api.md, Load report): key names, the client, and riding out outages.

Keys under ``unitproxy:{cluster}:``: ``unit:{id}`` holds a unit's latest report as JSON
with a TTL of 3 report intervals; the set ``units`` lists unit ids; the channel
``load`` carries each report as it changes. ``report_interval_ms``, set by gateways in
front of a large fleet (with a TTL), asks every sidecar for fewer reports: load
changes at most, and a heartbeat at least, that often. Sidecars write them
(``proxy.sidecar.publisher``), gateways read them (``RedisSource`` in
``proxy.gateway.loadsource``).

Redis is never on a request's path. When it is down a sidecar keeps serving and a
gateway keeps routing; each logs the outage once when it begins and once when it ends
(attempts in between log at debug), and reconnects with exponential backoff and
jitter.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from proxy.settings import RedisSettings

log = logging.getLogger(__name__)

# What a lost or refused Redis connection raises: redis-py's own errors, the OS's, and
# the asyncio timeout around a command.
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, OSError, TimeoutError)


@dataclass(frozen=True, slots=True)
class Keys:
    cluster: str

    @property
    def units(self) -> str:
        return f"unitproxy:{self.cluster}:units"

    @property
    def channel(self) -> str:
        return f"unitproxy:{self.cluster}:load"

    @property
    def asked(self) -> str:
        """How often gateways want reports, in ms (``proxy.gateway.rates``)."""
        return f"unitproxy:{self.cluster}:report_interval_ms"

    def unit(self, unit_id: str) -> str:
        return f"unitproxy:{self.cluster}:unit:{unit_id}"


MAX_ASKED_MS = 60_000  # the longest report interval gateways may ask of sidecars


def asked_s(value: str | None) -> float:
    """The interval in ``Keys.asked``, in s; 0 when unset or unreadable."""
    if value is None or not (value.isascii() and value.isdigit()):
        return 0.0
    return min(int(value), MAX_ASKED_MS) / 1000


def connect(settings: RedisSettings) -> Redis:
    """A client for ``settings.url``; it connects lazily, on the first command."""
    assert settings.url is not None
    # No retries inside redis-py: callers own the backoff and the outage log.
    return Redis.from_url(
        settings.url,
        socket_timeout=settings.timeout_s,
        socket_connect_timeout=settings.timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
        client_name="unitproxy",
    )


def where(url: str) -> str:
    """The URL without user or password, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class Outage:
    """Tracks one connection to Redis: backoff between attempts, a log line per outage."""

    def __init__(self, who: str, settings: RedisSettings, rng: random.Random | None = None):
        self._who = who
        self._where = where(settings.url or "")
        self._first_s = settings.backoff_initial_s
        self._most_s = settings.backoff_max_s
        self._rng = rng or random.Random()
        self._attempt = 0
        self.down_since: float | None = None  # time.monotonic() of the first failure

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, exc: BaseException, consequence: str) -> None:
        self._attempt += 1
        why = f"{type(exc).__name__}: {exc}".rstrip(": ")
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("%s: Redis %s unreachable (%s); %s; reconnecting with backoff",
                        self._who, self._where, why, consequence)  # fmt: skip
        else:
            log.debug("%s: Redis %s still unreachable (%s), attempt %d",
                      self._who, self._where, why, self._attempt)  # fmt: skip

    def recovered(self) -> None:
        if self.down_since is not None:
            log.info("%s: Redis %s reachable again after %.1f s",
                     self._who, self._where, time.monotonic() - self.down_since)  # fmt: skip
        self.down_since = None
        self._attempt = 0

    async def backoff(self) -> None:
        """Exponential from backoff_initial_s up to backoff_max_s, each wait 50-100 %."""
        doublings = min(max(self._attempt - 1, 0), 30)
        wait = min(self._first_s * 2**doublings, self._most_s)
        await asyncio.sleep(wait * self._rng.uniform(0.5, 1.0))

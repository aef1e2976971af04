"""Tenants' limits: requests and tokens per minute, tokens per day, requests at once.

Windows. Each rate is a sliding-window counter: a count per fixed window (a minute, or
a day for tokens_per_day) and the estimate ``previous x (1 - elapsed share of the
current window) + current``. It is as cheap as a fixed window (two integers a limit, an
INCRBY each in Redis) without a fixed window's burst of twice the limit across a window
boundary, and it says exactly when the estimate falls low enough for a request, which
gives ``retry-after``. (A log of every request's time would be exact, at a sorted-set
entry per request and per token count.)

Tokens are reserved at admission (the prompt as the simulator counts it plus
``max_tokens`` or ``gateway.tenant_estimate_max_tokens``, capped at the limit so that a
large ``max_tokens`` alone never makes a request impossible) and settled when the
request ends to what it used: ``Reservation.settle`` adds the difference to the window
the reservation went into (when that window still counts). A reservation is settled
exactly once, whatever ends the request.

Sharing. With Redis every gateway replica counts in the same keys,
``unitproxy:{cluster}:limit:{tenant}:{rpm|tpm|tpd}:{window}`` and
``...:{tenant}:concurrent`` (a sorted set of requests in flight, each with a lease the
replica renews, so a replica that dies frees its slots within ``LEASE_S``); one Lua
script checks every limit of a tenant and counts the request only if all pass, so two
replicas never both take the last slot. Admissions and settlements go to Redis in
batches: one script call at a time per replica, carrying every admission and settlement
that arrived while the previous call was on its way (one connection, one round trip a
batch; each answer also says how many replicas are present). Each replica also keeps its own counts. While
Redis cannot be reached each replica enforces ``limit / replicas`` from those (replicas
as last seen in Redis, or ``gateway.replicas``), says so in the log and in
``unitproxy_tenant_limits_shared``, and goes back to Redis once it answers again.
Times come from an injected wall clock (replicas must agree on window boundaries).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from prometheus_client import Gauge
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from engine.errors import Overloaded
from proxy.redis_reports import REDIS_ERRORS, Outage
from proxy.settings import RedisSettings
from proxy.tenants import Tenant

log = logging.getLogger(__name__)

MINUTE_S = 60.0
DAY_S = 86_400.0
LEASE_S = 300.0  # a request in flight holds its concurrency slot this long unless renewed
RENEW_S = 60.0  # how often leases and this replica's presence are renewed
PRESENCE_S = 3 * RENEW_S  # a replica not heard from for this long no longer counts
PROBE_S = 1.0  # while Redis is down, how often it is tried again
MAX_UNSENT = 10_000  # settlements kept for Redis while it is down
MAX_KEY_SETS = 4096  # tenants' key lists kept (one a tenant a minute): then built anew


class RateLimited(Overloaded):
    """A tenant is over one of its limits: 429, code rate_limited."""

    def __init__(self, message: str, retry_after_s: float, headers: dict[str, str], limit: str):
        self.limit = limit  # which: a Tenant limit's name
        super().__init__(message, retry_after_s=max(1, math.ceil(round(retry_after_s, 3))),
                         code="rate_limited")  # fmt: skip
        self.headers = headers


def sliding(prev: float, cur: float, frac: float) -> float:
    """The sliding-window estimate of a count ``frac`` of the way into the window."""
    return prev * (1.0 - frac) + cur


def wait_s(
    prev: float, cur: float, need: float, limit: float, frac: float, window_s: float
) -> float:
    """Seconds until ``need`` more fits under ``limit`` (0: it fits now). ``need`` is at
    most ``limit``, so it always fits by the end of the next window."""
    if sliding(prev, cur, frac) + need <= limit:
        return 0.0
    if cur + need <= limit:  # the previous window's share fades out in this one
        return max(0.0, (1.0 - (limit - cur - need) / prev) - frac) * window_s
    # The next window: this one's count becomes the previous one and fades.
    g = 0.0 if cur <= 0 else max(0.0, 1.0 - (limit - need) / cur)
    return (1.0 - frac + g) * window_s


def reset_s(prev: float, cur: float, frac: float, window_s: float) -> float:
    """Seconds until the estimate is back to nothing."""
    if cur > 0:
        return (2.0 - frac) * window_s
    if prev > 0:
        return (1.0 - frac) * window_s
    return 0.0


def duration(seconds: float) -> str:
    """OpenAI's form of a reset time: ``20ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    return f"{m}m{s}s" if m else f"{s}s"


class Counts:
    """The counts of one tenant at one moment: (prev, cur) of each rate, and in flight."""

    __slots__ = ("concurrent", "rpm", "tpd", "tpm")

    def __init__(
        self,
        rpm: tuple[float, float],
        tpm: tuple[float, float],
        tpd: tuple[float, float],
        concurrent: int,
    ):
        self.rpm = rpm
        self.tpm = tpm
        self.tpd = tpd
        self.concurrent = concurrent


class Check:
    """What admission decided: the first limit refused (or ""), with its wait and the
    x-ratelimit-* headers."""

    __slots__ = ("headers", "refused", "wait_s")

    def __init__(self, refused: str, wait: float, headers: dict[str, str]):
        self.refused = refused
        self.wait_s = wait
        self.headers = headers


def decide(tenant: Tenant, counts: Counts, need: int, now: float, share: float) -> Check:
    """Admission of one request needing ``need`` tokens, from the counts before it, with
    each limit scaled by ``share`` (1, or 1 / replicas while Redis is down)."""
    fm, fd = (now % MINUTE_S) / MINUTE_S, (now % DAY_S) / DAY_S
    rates = (
        ("requests_per_minute", tenant.requests_per_minute, counts.rpm, 1, fm, MINUTE_S),
        ("tokens_per_minute", tenant.tokens_per_minute, counts.tpm, need, fm, MINUTE_S),
        ("tokens_per_day", tenant.tokens_per_day, counts.tpd, need, fd, DAY_S),
    )
    refused, wait = "", 0.0
    for name, full, (prev, cur), n, frac, window in rates:
        if not full:
            continue
        limit = full * share
        w = wait_s(prev, cur, min(n, limit), limit, frac, window)
        if w > 0 and not refused:
            refused, wait = name, w
    conc = tenant.max_concurrent * share
    if not refused and tenant.max_concurrent and counts.concurrent + 1 > conc:
        refused, wait = "max_concurrent", 1.0
    return Check(refused, wait, headers(tenant, counts, need, fm, share, admitted=not refused))


def headers(
    tenant: Tenant, counts: Counts, need: int, frac: float, share: float, admitted: bool
) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers, for the per-minute limits the tenant has."""
    found: dict[str, str] = {}
    for kind, full, (prev, cur), n in (
        ("requests", tenant.requests_per_minute, counts.rpm, 1),
        ("tokens", tenant.tokens_per_minute, counts.tpm, need),
    ):
        if not full:
            continue
        limit = full * share
        n = min(n, int(limit)) if admitted else 0
        used = sliding(prev, cur + n, frac)
        found[f"x-ratelimit-limit-{kind}"] = str(int(limit))
        found[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(limit - used)))
        found[f"x-ratelimit-reset-{kind}"] = duration(reset_s(prev, cur + n, frac, MINUTE_S))
    return found


class _Window:
    """One rate's local count: the current fixed window and the one before."""

    __slots__ = ("cur", "index", "prev", "size")

    def __init__(self, size: float):
        self.size = size
        self.index = -1
        self.cur = 0.0
        self.prev = 0.0

    def at(self, now: float) -> tuple[float, float]:
        index = int(now // self.size)
        if index != self.index:
            self.prev = self.cur if index == self.index + 1 else 0.0
            self.cur, self.index = 0.0, index
        return self.prev, self.cur

    def add(self, index: int, n: float) -> None:
        if index == self.index:
            self.cur = max(0.0, self.cur + n)
        elif index == self.index - 1:
            self.prev = max(0.0, self.prev + n)


class _Local:
    """This replica's own counts of one tenant."""

    __slots__ = ("concurrent", "rpm", "tpd", "tpm")

    def __init__(self) -> None:
        self.rpm = _Window(MINUTE_S)
        self.tpm = _Window(MINUTE_S)
        self.tpd = _Window(DAY_S)
        self.concurrent = 0

    def counts(self, now: float) -> Counts:
        return Counts(self.rpm.at(now), self.tpm.at(now), self.tpd.at(now), self.concurrent)


# One script for a batch of operations, so that a gateway under load makes one round trip
# to Redis for every admission and settlement that arrived meanwhile, not one each.
# KEYS[1]: the set of gateway replicas present (scores: when each presence ends); then
# each operation's keys. ARGV[1]: now; then one argument an operation, its fields joined
# by commas (one string to encode and send, not a dozen):
# admit "a,frac minute,frac day,rpm,tpm,tpd,max_concurrent,tokens needed,member,lease
#        end,minute key ttl,day key ttl" (limits 0: none); KEYS rpm cur, rpm prev, tpm
#        cur, tpm prev, tpd cur, tpd prev, concurrent (a sorted set). Gives "admitted
#        0|1,refused limit index (1 rpm, 2 tpm, 3 tpd, 4 concurrent; 0 none),the counts
#        before this request: rpm cur,prev,tpm cur,prev,tpd cur,prev,in flight".
# settle "s,token difference (may be negative),member"; KEYS tpm key, tpd key (of the
#        reservation's windows), concurrent. Gives nothing.
# Returns {replicas present, then what each admit gives, in order}.
BATCH = """
local now = tonumber(ARGV[1])
local function admit(k, f)
  local fm, fd = tonumber(f[2]), tonumber(f[3])
  local need = tonumber(f[8])
  local c = {}
  for i = 1, 6 do c[i] = tonumber(redis.call('GET', KEYS[k + i - 1]) or '0') end
  local conc_key = KEYS[k + 6]
  redis.call('ZREMRANGEBYSCORE', conc_key, '-inf', now)
  local inflight = redis.call('ZCARD', conc_key)
  local checks = {{1, 1, fm}, {3, need, fm}, {5, need, fd}}
  local refused = 0
  for i, chk in ipairs(checks) do
    local limit = tonumber(f[3 + i])
    if refused == 0 and limit > 0 then
      local n = math.min(chk[2], limit)
      if c[chk[1] + 1] * (1 - chk[3]) + c[chk[1]] + n > limit then refused = i end
    end
  end
  local conc = tonumber(f[7])
  if refused == 0 and conc > 0 and inflight + 1 > conc then refused = 4 end
  local out = table.concat({refused == 0 and 1 or 0, refused, c[1], c[2], c[3], c[4], c[5],
                            c[6], inflight}, ',')
  if refused ~= 0 then return out end
  redis.call('INCRBY', KEYS[k], 1)
  redis.call('EXPIRE', KEYS[k], f[11])
  if need > 0 then
    redis.call('INCRBY', KEYS[k + 2], need)
    redis.call('EXPIRE', KEYS[k + 2], f[11])
    redis.call('INCRBY', KEYS[k + 4], need)
    redis.call('EXPIRE', KEYS[k + 4], f[12])
  end
  if conc > 0 then
    redis.call('ZADD', conc_key, f[10], f[9])
    redis.call('EXPIRE', conc_key, math.ceil(tonumber(f[10]) - now))
  end
  return out
end
local function settle(k, f)
  local d = tonumber(f[2])
  for i = 0, 1 do
    if d ~= 0 and redis.call('EXISTS', KEYS[k + i]) == 1 then
      local v = redis.call('INCRBY', KEYS[k + i], d)
      if v < 0 then redis.call('SET', KEYS[k + i], 0, 'KEEPTTL') end
    end
  end
  redis.call('ZREM', KEYS[k + 2], f[3])
end
local out = {redis.call('ZCOUNT', KEYS[1], '(' .. ARGV[1], '+inf')}
local k = 2
for a = 2, #ARGV do
  local f = {}
  for v in string.gmatch(ARGV[a], '[^,]+') do f[#f + 1] = v end
  if f[1] == 'a' then
    out[#out + 1] = admit(k, f)
    k = k + 7
  else
    settle(k, f)
    k = k + 3
  end
end
return out
"""
BATCH_MOST = 256  # operations in one script call (Redis runs a script alone)
SETTLE_WITHIN_S = 0.05  # a settlement waits this long at most for an admission to go with

REFUSED = ("", "requests_per_minute", "tokens_per_minute", "tokens_per_day", "max_concurrent")
WHAT = {
    "requests_per_minute": "requests per minute",
    "tokens_per_minute": "tokens per minute",
    "tokens_per_day": "tokens per day",
    "max_concurrent": "requests at once",
}


class Reservation:
    """A request's hold on its tenant's limits: settle it once, when the request ends."""

    __slots__ = (
        "_limiter",
        "day",
        "headers",
        "member",
        "minute",
        "settled",
        "shared",
        "tenant",
        "tokens",
    )  # fmt: skip

    def __init__(
        self,
        limiter: Limiter,
        tenant: Tenant,
        tokens: int,
        minute: int,
        day: int,
        member: str,
        shared: bool,
        headers: dict[str, str],
    ):
        self._limiter = limiter
        self.tenant = tenant
        self.tokens = tokens  # reserved
        self.minute = minute  # the windows the reservation went into
        self.day = day
        self.member = member
        self.shared = shared  # counted in Redis too
        self.headers = headers
        self.settled = False

    def settle(self, used_tokens: int | None) -> None:
        """Charge what the request used (None: nothing is known, keep the estimate) and
        free its concurrency slot. Only the first call counts."""
        if self.settled:
            return
        self.settled = True
        used = self.tokens if used_tokens is None else max(0, used_tokens)
        self._limiter._settle(self, used - self.tokens)


def _evalsha(sha: str, keys: list[str], args: list[str]) -> bytes:
    """EVALSHA as Redis reads it (RESP), from strings. redis-py's pack_command checks and
    converts each argument and joins its growing buffer again for each: in a profile of
    a gateway under load it was most of a batch's cost."""
    parts = [
        b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n"
        % (len(keys) + len(args) + 3, len(sha), sha.encode())
    ]
    n = str(len(keys)).encode()
    parts.append(b"$%d\r\n%s\r\n" % (len(n), n))
    for text in (*keys, *args):
        data = text.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _Op:
    """One admission or settlement waiting for the next script call."""

    __slots__ = ("arg", "difference", "done", "keys", "member", "need", "reservation")

    def __init__(
        self,
        keys: list[str],
        arg: str,  # the script's argument for it
        done: asyncio.Future[str] | None,  # an admission's answer; None: a settlement
        reservation: Reservation | None = None,
        difference: int = 0,
        need: int = 0,
        member: str = "",
    ):
        self.keys = keys
        self.arg = arg
        self.done = done
        self.reservation = reservation  # a settlement's, kept if its batch fails
        self.difference = difference
        self.need = need  # an admission's tokens and member: given back if it went away
        self.member = member


class Limiter:
    """Every tenant's limits, shared through Redis when there is one."""

    def __init__(
        self,
        redis: Redis | None = None,
        redis_settings: RedisSettings | None = None,
        replicas: int = 0,
        clock: Callable[[], float] = time.time,
        shared_gauge: Gauge | None = None,
        cluster: str | None = None,
    ):
        self._redis = redis
        self._clock = clock
        settings = redis_settings or RedisSettings.model_validate({})
        self._prefix = f"unitproxy:{cluster or settings.cluster}"
        self._outage = Outage("tenant limits", settings)
        self._replicas_setting = replicas
        self.replicas_seen = 1
        self._local: dict[str, _Local] = {}
        self._live: set[Reservation] = set()
        self._unsent: list[tuple[Reservation, int]] = []  # settlements Redis missed
        self._batch: Any = None if redis is None else redis.register_script(BATCH)
        self._ops: list[_Op] = []  # for the next script call
        self._sender: asyncio.Task[None] | None = None  # sends _ops, one call at a time
        self._conn: Any = None  # the connection it sends them on
        self._timer: asyncio.TimerHandle | None = None  # sends settlements that wait alone
        self.id = uuid.uuid4().hex[:12]  # this replica, in Redis
        self._admitted = 0
        self._gauge = shared_gauge
        self._set_gauge()
        # A tenant's seven keys for a minute and a day (rpm, tpm, tpd: this one and the
        # one before; concurrent), built once, not per request.
        self._keys: dict[tuple[str, int, int], list[str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # get_running_loop: a getpid()

    @property
    def shared(self) -> bool:
        """Whether limits are counted in Redis now."""
        return self._redis is not None and not self._outage.down

    @property
    def replicas(self) -> int:
        return self._replicas_setting or self.replicas_seen

    @property
    def share(self) -> float:
        """The part of each limit this replica enforces from its own counts."""
        if self._redis is None:
            return 1.0 / self._replicas_setting if self._replicas_setting else 1.0
        return 1.0 if self.shared else 1.0 / max(1, self.replicas)

    def _set_gauge(self) -> None:
        if self._gauge is not None:
            self._gauge.set(1 if self.shared else 0)

    def local_counts(self, tenant: str) -> Counts:
        return self._local_of(tenant).counts(self._clock())

    def _local_of(self, name: str) -> _Local:
        local = self._local.get(name)
        if local is None:
            local = self._local[name] = _Local()
        return local

    def _key(self, tenant: str, what: str) -> str:
        return f"{self._prefix}:limit:{tenant}:{what}"

    def _keys_of(self, name: str, minute: int, day: int) -> list[str]:
        """The admission's keys (``_keys``); a settlement's are [2], [4], [6]."""
        found = self._keys.get((name, minute, day))
        if found is None:
            if len(self._keys) >= MAX_KEY_SETS:  # the minutes before: dropped
                self._keys.clear()
            found = self._keys[(name, minute, day)] = [
                self._key(name, f"rpm:{minute}"), self._key(name, f"rpm:{minute - 1}"),
                self._key(name, f"tpm:{minute}"), self._key(name, f"tpm:{minute - 1}"),
                self._key(name, f"tpd:{day}"), self._key(name, f"tpd:{day - 1}"),
                self._key(name, "concurrent"),
            ]  # fmt: skip
        return found

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    # -- admission -------------------------------------------------------------------

    async def admit(self, tenant: Tenant, tokens: int) -> Reservation:
        """Count a request needing about ``tokens`` against ``tenant``'s limits, or raise
        RateLimited saying which limit and when it frees."""
        now = self._clock()
        if not tenant.limited:  # nothing to count: no Redis round trip either
            return Reservation(self, tenant, 0, 0, 0, "", False, {})
        need = tokens if tenant.counts_tokens else 0
        if tenant.tokens_per_minute:
            need = min(need, tenant.tokens_per_minute)
        if tenant.tokens_per_day:
            need = min(need, tenant.tokens_per_day)
        local = self._local_of(tenant.name)
        self._admitted += 1
        member = f"{self.id}-{self._admitted}"  # unique across replicas
        check: Check | None = None
        if self.shared:
            check = await self._admit_shared(tenant, need, now, member)
        shared, share = check is not None, 1.0
        if check is None:  # no Redis, or it failed just now
            share = self.share
            check = decide(tenant, local.counts(now), need, now, share)
        if check.refused:
            what = WHAT[check.refused]
            limit = getattr(tenant, check.refused)
            scaled = "" if share == 1.0 else f" (this replica's share: {limit * share:g})"
            raise RateLimited(
                f"tenant {tenant.name} is over its limit of {limit} {what}{scaled}",
                check.wait_s,
                check.headers,
                check.refused,
            )
        local.counts(now)  # roll the windows to now
        local.rpm.add(local.rpm.index, 1)
        local.tpm.add(local.tpm.index, need)
        local.tpd.add(local.tpd.index, need)
        local.concurrent += 1
        reservation = Reservation(
            self, tenant, need, int(now // MINUTE_S), int(now // DAY_S), member, shared,
            check.headers,
        )  # fmt: skip
        self._live.add(reservation)
        return reservation

    async def _admit_shared(
        self, tenant: Tenant, need: int, now: float, member: str
    ) -> Check | None:
        keys = self._keys_of(tenant.name, int(now // MINUTE_S), int(now // DAY_S))
        fm, fd = (now % MINUTE_S) / MINUTE_S, (now % DAY_S) / DAY_S
        arg = (
            f"a,{fm!r},{fd!r},{tenant.requests_per_minute},{tenant.tokens_per_minute},"
            f"{tenant.tokens_per_day},{tenant.max_concurrent},{need},{member},"
            f"{now + LEASE_S!r},{int(2 * MINUTE_S + 10)},{int(2 * DAY_S + 10)}"
        )
        done: asyncio.Future[str] = self._running_loop().create_future()
        self._send(_Op(keys, arg, done, need=need, member=member))
        try:
            answer = await done
        except REDIS_ERRORS:
            return None  # the batch failed: Redis is down
        out = answer.split(",")
        counts = Counts(
            (float(out[3]), float(out[2])), (float(out[5]), float(out[4])),
            (float(out[7]), float(out[6])), int(out[8]),
        )  # fmt: skip
        refused = REFUSED[int(out[1])]
        if not refused:
            return Check("", 0.0, headers(tenant, counts, need, fm, 1.0, admitted=True))
        check = decide(tenant, counts, need, now, 1.0)
        if check.refused != refused:  # rounding at the edge: Redis's word counts
            wait = 1.0 if refused == "max_concurrent" else check.wait_s or 1.0
            return Check(refused, wait, headers(tenant, counts, need, fm, 1.0, admitted=False))
        return check

    # -- settlement ------------------------------------------------------------------

    def _settle(self, r: Reservation, difference: int) -> None:
        if not r.tenant.limited:
            return
        self._live.discard(r)
        local = self._local_of(r.tenant.name)
        local.counts(self._clock())
        local.concurrent = max(0, local.concurrent - 1)
        if difference:
            local.tpm.add(r.minute, difference)
            local.tpd.add(r.day, difference)
        if not difference and not r.tenant.max_concurrent:
            return  # nothing to tell Redis: the estimate stands, no slot to free
        if r.shared and self._redis is not None:
            if self._outage.down:
                self._unsent_settle(r, difference)
                return
            self._settle_shared(r, difference)

    def _unsent_settle(self, r: Reservation, difference: int) -> None:
        """Kept to be sent when Redis answers again (its slot would otherwise stay
        taken until its lease ends), up to MAX_UNSENT."""
        if len(self._unsent) < MAX_UNSENT:
            self._unsent.append((r, difference))

    def _settle_shared(self, r: Reservation, difference: int) -> _Op:
        """Goes out with the next batch; kept for later if that batch fails."""
        every = self._keys_of(r.tenant.name, r.minute, r.day)
        keys = [every[2], every[4], every[6]]
        op = _Op(keys, f"s,{difference},{r.member}", None, r, difference)
        self._ops.append(op)
        if self._timer is None and (self._sender is None or self._sender.done()):
            self._timer = self._running_loop().call_later(SETTLE_WITHIN_S, self._start)
        return op

    # -- the batches to Redis --------------------------------------------------------

    def _send(self, op: _Op) -> None:
        """Queue ``op`` for the next script call, which goes at once. One call is in
        flight at a time: what arrives while it is on its way goes in the next one, so
        the round trips to Redis grow with the load only until one call carries
        everything that waited. A settlement waits up to SETTLE_WITHIN_S for an
        admission to ride with (``_settle_shared``)."""
        self._ops.append(op)
        self._start()

    def _start(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ops and (self._sender is None or self._sender.done()):
            self._sender = self._running_loop().create_task(self._send_loop())

    async def _send_loop(self) -> None:
        while self._ops:
            ops, self._ops = self._ops[:BATCH_MOST], self._ops[BATCH_MOST:]
            now = self._clock()
            keys, args = [f"{self._prefix}:gateways"], [repr(now)]
            for op in ops:
                keys += op.keys
                args.append(op.arg)
            try:
                out = await self._call(keys, args)
            except asyncio.CancelledError:
                for op in ops:
                    if op.done is not None and not op.done.done():
                        op.done.cancel()
                raise
            except Exception as exc:
                if not isinstance(exc, REDIS_ERRORS):  # never leave an admission waiting
                    log.exception("tenant limits: the batch to Redis failed")
                    exc = RedisError(f"{type(exc).__name__}: {exc}")
                self._down(exc)
                for op in ops:
                    if op.done is None:
                        assert op.reservation is not None
                        self._unsent_settle(op.reservation, op.difference)
                    elif not op.done.done():
                        op.done.set_exception(exc)
                continue
            self.replicas_seen = max(1, int(out[0]))
            i = 1
            for op in ops:
                if op.done is None:
                    continue
                result = out[i]
                i += 1
                if not op.done.done():
                    op.done.set_result(result)
                elif op.done.cancelled() and result[0] == "1":
                    # The request went away while Redis admitted it: give the tokens
                    # and its slot back.
                    keys = [op.keys[2], op.keys[4], op.keys[6]]  # tpm, tpd, concurrent
                    self._ops.append(_Op(keys, f"s,{-op.need},{op.member}", None))

    async def _call(self, keys: list[str], args: list[str]) -> Any:
        """EVALSHA of the batch script on a connection this limiter keeps to itself (one
        call is in flight at a time): redis-py's per-command machinery (pool, retries,
        timing) costs more than the call itself. SCRIPT LOAD where Redis lacks it."""
        redis = self._redis
        assert redis is not None
        conn = self._conn
        if conn is None:
            conn = self._conn = await redis.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            await conn.send_packed_command(_evalsha(self._batch.sha, keys, args), False)
            return await conn.read_response()
        except NoScriptError:
            await conn.send_command("SCRIPT", "LOAD", BATCH, check_health=False)
            await conn.read_response()
            await conn.send_packed_command(_evalsha(self._batch.sha, keys, args), False)
            return await conn.read_response()
        except BaseException:
            await self._drop_conn()
            raise

    async def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and self._redis is not None:
            with contextlib.suppress(Exception):
                await conn.disconnect()
            await self._redis.connection_pool.release(conn)

    async def _flushed(self) -> None:
        """Until what is queued now has been sent (or failed)."""
        self._start()
        while self._sender is not None and not self._sender.done():
            await asyncio.shield(self._sender)

    # -- Redis's health, presence and leases -----------------------------------------

    def _down(self, exc: BaseException) -> None:
        was = self._outage.down
        share = 1.0 / max(1, self.replicas)
        self._outage.failed(exc, f"each tenant limit is enforced here at {share:.3g} of it "
                                 f"({self.replicas} replicas) from this replica's own counts")  # fmt: skip
        if not was:
            self._set_gauge()

    async def run(self) -> None:
        """Renew this replica's presence and its requests' leases; while Redis is down,
        try it again every PROBE_S. Until cancelled."""
        if self._redis is None:
            return
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("tenant limits: refresh failed")
            await asyncio.sleep(PROBE_S if self._outage.down else RENEW_S)

    async def refresh(self) -> None:
        """One round of presence and lease renewal; it also finds that Redis is back."""
        redis = self._redis
        if redis is None:
            return
        now = self._clock()
        presence = f"{self._prefix}:gateways"
        try:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.zadd(presence, {self.id: now + PRESENCE_S})
                pipe.zremrangebyscore(presence, "-inf", now)
                pipe.zcard(presence)
                for r in list(self._live):
                    if r.shared and r.tenant.max_concurrent:
                        pipe.zadd(self._key(r.tenant.name, "concurrent"),
                                  {r.member: now + LEASE_S}, xx=True)  # fmt: skip
                results = await pipe.execute()
        except REDIS_ERRORS as exc:
            self._down(exc)
            return
        self.replicas_seen = max(1, int(results[2]))
        if self._outage.down:
            await self._drop_conn()  # it may be one Redis closed
            self._outage.recovered()
            self._set_gauge()
        unsent, self._unsent = self._unsent, []
        for r, difference in unsent:
            self._settle_shared(r, difference)
        await self._flushed()

    async def close(self) -> None:
        """Wait for settlements on their way to Redis, and leave the presence set."""
        if self._ops or (self._sender is not None and not self._sender.done()):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flushed(), 2.0)
        await self._drop_conn()
        if self._redis is not None and not self._outage.down:
            with contextlib.suppress(*REDIS_ERRORS):
                await self._redis.zrem(f"{self._prefix}:gateways", self.id)

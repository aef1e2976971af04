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
``...:{tenant}:concurrent`` (a sorted set of requests in flight and of slots replicas
hold, each with a lease the replica renews, so a replica that dies frees its slots
within ``LEASE_S``); one Lua script checks every limit of a tenant and counts the
request only if all pass, so two replicas never both take the last slot.

Allotments. So that a request does not wait for Redis, each replica takes from Redis,
ahead of its requests, a block of each of a tenant's limits: requests and tokens of the
current minute, tokens of the current day, a few concurrency slots (members of the
concurrent set). Redis counts a block as used the moment it grants it, so what the
replicas hold and what they admitted never add up to more than a limit. A request that
its replica's allotment covers is admitted from it, with no I/O; when any part of the
allotment falls below half a block, the replica asks for more in the background; a
request the allotment cannot cover goes to Redis, which checks and counts it alone as
it did before allotments (the allotment goes back with it, so the check counts only
what was used) and grants a new block if there is room. A block is limit / (replicas x
``BLOCK_PARTS``) (none where that is below one request's need, nor for a limit that
small: every request is checked in Redis), and Redis grants at most (limit - estimate)
/ (2 x replicas present) of it: near a limit blocks shrink to nothing and every request
is checked there, one by one, so the replicas together come to the limit, never over
it, short of it by no more than the small blocks others still hold unused. A
settlement's difference goes into the allotment when it is of the same window (Redis
counted the reservation; the tokens stay the replica's to use), else to Redis; a
request's slot goes back to the replica's free slots (up to a block of them). Unused
allotment goes back to Redis, to the window it was counted in, when that window ends,
when the tenant is idle on the replica for ``IDLE_S`` (``sweep``), at close, and after
an outage. The x-ratelimit-* headers of a request admitted from the allotment come from
the shared counts its last answer from Redis gave, less what the replica holds, plus
what it admitted since.

Admissions that go to Redis, asks for allotment, settlements and give-backs go in
batches: one script call at a time per replica, carrying every operation that arrived
while the previous call was on its way (one connection, one round trip a batch; each
answer also says how many replicas are present). Each replica also keeps its own
counts. While Redis cannot be reached each replica enforces ``limit / replicas`` from
those (replicas as last seen in Redis, or ``gateway.replicas``), spends no allotment
(it goes back to Redis when Redis answers), says so in the log and in
``unitproxy_tenant_limits_shared``, and counts in Redis again once it answers.
Times come from an injected wall clock (replicas must agree on window boundaries).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

from prometheus_client import Gauge
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from engine.errors import Overloaded
from proxy.redis_reports import REDIS_ERRORS, Outage
from proxy.settings import RedisSettings
from proxy.tenants import Tenant

log = logging.getLogger(__name__)

# (Final: compiled code reads these as constants, not from the module's dict.)
MINUTE_S: Final = 60.0
DAY_S: Final = 86_400.0
MINUTES_A_DAY: Final = 1_440
LEASE_S = 300.0  # a request in flight holds its concurrency slot this long unless renewed
RENEW_S = 60.0  # how often leases and this replica's presence are renewed
PRESENCE_S = 3 * RENEW_S  # a replica not heard from for this long no longer counts
PROBE_S = 1.0  # while Redis is down, how often it is tried again
MAX_UNSENT = 10_000  # settlements kept for Redis while it is down
MAX_KEY_SETS = 4096  # tenants' key lists kept (one a tenant a minute): then built anew
BLOCK_PARTS = 16  # an allotment's block of a limit: limit / (replicas x BLOCK_PARTS)
SLOTS_GRANT = 8  # concurrency slots asked for at once, at most
IDLE_S = 10.0  # a tenant's allotment unused this long goes back to Redis
SWEEP_S = 1.0  # how often ended windows and idle allotments are looked for


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
    found = _DURATIONS.get(s)
    if found is None:
        h, rest = divmod(s, 3600)
        m, sec = divmod(rest, 60)
        found = f"{h}h{m}m{sec}s" if h else (f"{m}m{sec}s" if m else f"{sec}s")
        if len(_DURATIONS) < MAX_DURATIONS:
            _DURATIONS[s] = found
    return found


# Whole seconds' texts as found: a per-minute limit's reset is 1 to 120 seconds.
_DURATIONS: Final[dict[int, str]] = {}
MAX_DURATIONS = 4096


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
    (rp, rc), (tp, tc) = counts.rpm, counts.tpm
    return dict(header_pairs(tenant, rp, rc, tp, tc, need, frac, share, admitted))


def header_pairs(
    tenant: Tenant,
    rp: float,
    rc: float,
    tp: float,
    tc: float,
    need: int,
    frac: float,
    share: float,
    admitted: bool,
) -> list[tuple[str, str]]:
    """``headers`` as (name, value) pairs, from the per-minute counts (prev, cur) of
    requests and tokens before the request: what gRPC's trailing metadata and an error's
    headers are written from (``header_block`` renders the same as an HTTP head's lines)."""
    found: list[tuple[str, str]] = []
    full = tenant.requests_per_minute
    if full:
        limit = full * share
        cur = rc + (min(1, int(limit)) if admitted else 0)
        left = math.floor(limit - (rp * (1.0 - frac) + cur))
        found.append(("x-ratelimit-limit-requests", str(int(limit))))
        found.append(("x-ratelimit-remaining-requests", str(left) if left > 0 else "0"))
        found.append(("x-ratelimit-reset-requests", _reset(rp, cur, frac)))
    full = tenant.tokens_per_minute
    if full:
        limit = full * share
        cur = tc + (min(need, int(limit)) if admitted else 0)
        left = math.floor(limit - (tp * (1.0 - frac) + cur))
        found.append(("x-ratelimit-limit-tokens", str(int(limit))))
        found.append(("x-ratelimit-remaining-tokens", str(left) if left > 0 else "0"))
        found.append(("x-ratelimit-reset-tokens", _reset(tp, cur, frac)))
    return found


def admitted_pairs(
    tenant: Tenant,
    rp: float,
    rc: float,
    tp: float,
    tc: float,
    need: int,
    frac: float,
) -> list[tuple[str, str]]:
    """``header_pairs`` of an admitted request at its whole limits (share 1), built as
    ``header_block`` is: from the tenant's fixed texts and one reset text for both."""
    reset = _DURATIONS.get(math.ceil((2.0 - frac) * MINUTE_S))
    if reset is None:
        reset = duration((2.0 - frac) * MINUTE_S)
    found: list[tuple[str, str]] = []
    full = tenant.requests_per_minute
    if full:
        left = full - (rp * (1.0 - frac) + rc + 1.0)  # int(left): floor(left) where > 0
        found.append(("x-ratelimit-limit-requests", tenant.limit_texts[0]))
        found.append(("x-ratelimit-remaining-requests", str(int(left)) if left > 0 else "0"))
        found.append(("x-ratelimit-reset-requests", reset))
    full = tenant.tokens_per_minute
    if full:
        cur = tc + (need if need < full else full)
        left = full - (tp * (1.0 - frac) + cur)
        found.append(("x-ratelimit-limit-tokens", tenant.limit_texts[1]))
        found.append(("x-ratelimit-remaining-tokens", str(int(left)) if left > 0 else "0"))
        found.append(("x-ratelimit-reset-tokens", reset if cur > 0 else _reset(tp, cur, frac)))
    return found


def header_block(
    tenant: Tenant,
    rp: float,
    rc: float,
    tp: float,
    tc: float,
    need: int,
    frac: float,
) -> str:
    """``header_pairs`` of an admitted request at its whole limits (share 1), as the
    lines of a response head: ``name: value\\r\\n`` each, in the same order. One text
    from the tenant's fixed parts (``Tenant.request_lines``, ``token_lines``) and the
    counts, where the pairs are six tuples a head then writes one by one."""
    # An admitted request counts in the current window, so each limit's estimate is
    # back to nothing when the next window ends: one reset text for both.
    reset = _DURATIONS.get(math.ceil((2.0 - frac) * MINUTE_S))
    if reset is None:
        reset = duration((2.0 - frac) * MINUTE_S)
    requests = tenant.requests_per_minute
    r_left = 0
    if requests:
        left = requests - (rp * (1.0 - frac) + rc + 1.0)  # int(left): floor(left) where > 0
        r_left = int(left) if left > 0 else 0
    tokens = tenant.tokens_per_minute
    t_left = 0
    t_reset = reset
    if tokens:
        cur = tc + (need if need < tokens else tokens)
        left = tokens - (tp * (1.0 - frac) + cur)
        t_left = int(left) if left > 0 else 0
        if cur <= 0:
            t_reset = _reset(tp, cur, frac)
    # one text built, not one a limit and then both
    rh, rm = tenant.request_lines
    th, tm = tenant.token_lines
    if requests and tokens:
        return f"{rh}{r_left}{rm}{reset}\r\n{th}{t_left}{tm}{t_reset}\r\n"
    if requests:
        return f"{rh}{r_left}{rm}{reset}\r\n"
    if tokens:
        return f"{th}{t_left}{tm}{t_reset}\r\n"
    return ""


def _reset(prev: float, cur: float, frac: float) -> str:
    """``duration(reset_s(...))`` of a per-minute count; a whole second's text is kept."""
    if cur > 0:
        seconds = (2.0 - frac) * MINUTE_S
        if seconds >= 1:
            found = _DURATIONS.get(math.ceil(seconds))
            if found is not None:
                return found
    return duration(reset_s(prev, cur, frac, MINUTE_S))


def minute_of(now: float) -> int:
    """``int(now // MINUTE_S)``: the minute ``now`` falls in. One division and a check,
    where float ``//`` takes an ``fmod`` too (compiled, about a third of the cost): a
    quotient rounded up to the next whole minute is stepped back, and ``int()`` of a
    negative one (truncated toward zero) likewise."""
    minute = int(now / MINUTE_S)
    if minute * MINUTE_S > now:
        minute -= 1
    return minute


class _Window:
    """One rate's local count: the current fixed window and the one before."""

    __slots__ = ("cur", "index", "prev", "size")

    def __init__(self, size: float):
        self.size = size
        self.index = -1
        self.cur = 0.0
        self.prev = 0.0

    def at(self, now: float) -> tuple[float, float]:
        self.move(now)
        return self.prev, self.cur

    def move(self, now: float) -> None:
        """To the window of ``now``."""
        index = int(now // self.size)
        if index != self.index:
            self.prev = self.cur if index == self.index + 1 else 0.0
            self.cur = 0.0
            self.index = index

    def add(self, index: int, n: float) -> None:
        if index == self.index:
            cur = self.cur + n
            self.cur = cur if cur > 0.0 else 0.0
        elif index == self.index - 1:
            prev = self.prev + n
            self.prev = prev if prev > 0.0 else 0.0


class _Local:
    """This replica's own counts of one tenant."""

    __slots__ = ("concurrent", "minute", "rpm", "tpd", "tpm")

    def __init__(self) -> None:
        self.rpm = _Window(MINUTE_S)
        self.tpm = _Window(MINUTE_S)
        self.tpd = _Window(DAY_S)
        self.concurrent = 0
        self.minute = -1  # the windows are at this minute (and its day)

    def counts(self, now: float) -> Counts:
        self.roll(now)
        rpm, tpm, tpd = self.rpm, self.tpm, self.tpd
        return Counts((rpm.prev, rpm.cur), (tpm.prev, tpm.cur), (tpd.prev, tpd.cur),
                      self.concurrent)  # fmt: skip

    def roll(self, now: float) -> None:
        """The windows moved to ``now`` (a day's windows end where a minute's do: in the
        same minute, nothing moves)."""
        minute = minute_of(now)
        if minute != self.minute:
            self.minute = minute
            self.rpm.move(now)
            self.tpm.move(now)
            self.tpd.move(now)


# One script for a batch of operations, so that a gateway under load makes one round trip
# to Redis for every admission, allotment and settlement that arrived meanwhile, not one
# each. KEYS[1]: the set of gateway replicas present (scores: when each presence ends);
# then each operation's keys. ARGV[1]: now; then one argument an operation, its fields
# joined by commas (one string to encode and send, not a dozen):
# admit "a,check 0|1,frac minute,frac day,rpm,tpm,tpd,max_concurrent,tokens needed,member
#        (-: none),lease end,minute key ttl,day key ttl,back rpm,back tpm,back tpd,want
#        rpm,want tpm,want tpd,want slots,slot member prefix" (limits 0: none); KEYS rpm
#        cur, rpm prev, tpm cur, tpm prev, tpd cur, tpd prev, concurrent (a sorted set).
#        First gives back the replica's unused allotment (back: to the current windows),
#        then with check 1 checks and counts one request as before allotments existed,
#        then grants what it can of each want: at most (limit - estimate) / (2 x replicas
#        present), none if that is below one request's need (so near a limit every
#        request is checked here, one by one). Gives "admitted 0|1,refused limit index
#        (1 rpm, 2 tpm, 3 tpd, 4 concurrent; 0 none),the counts before this request: rpm
#        cur,prev,tpm cur,prev,tpd cur,prev,in flight,granted rpm,tpm,tpd,slots" (slots:
#        members prefix..1 to prefix..n, leased like a request's).
# settle "s,rpm difference,tpm difference,tpd difference[,member...]" (differences may
#        be negative: tokens settled, allotment given back); KEYS rpm, tpm, tpd keys (of
#        the windows they were counted in), concurrent. Removes the members. Gives nothing.
# Returns {replicas present, then what each admit gives, in order}.
BATCH = """
local now = tonumber(ARGV[1])
local present = redis.call('ZCOUNT', KEYS[1], '(' .. ARGV[1], '+inf')
local share = 2 * math.max(1, present)
local function add(key, d)
  if d ~= 0 and redis.call('EXISTS', key) == 1 then
    local v = redis.call('INCRBY', key, d)
    if v < 0 then redis.call('SET', key, 0, 'KEEPTTL') end
  end
end
local function grant(key, want, least, limit, estimate, ttl)
  if want <= 0 or limit <= 0 then return 0 end
  local g = math.min(want, math.floor((limit - estimate) / share))
  if g < least then return 0 end
  redis.call('INCRBY', key, g)
  redis.call('EXPIRE', key, ttl)
  return g
end
local function admit(k, f)
  local check = f[2] == '1'
  local fm, fd = tonumber(f[3]), tonumber(f[4])
  local need = tonumber(f[9])
  for i = 0, 2 do add(KEYS[k + 2 * i], -tonumber(f[14 + i])) end
  local c = {}
  for i = 1, 6 do c[i] = tonumber(redis.call('GET', KEYS[k + i - 1]) or '0') end
  local conc_key = KEYS[k + 6]
  redis.call('ZREMRANGEBYSCORE', conc_key, '-inf', now)
  local inflight = redis.call('ZCARD', conc_key)
  local conc = tonumber(f[8])
  local member = f[10]
  local refused = 0
  if check then
    local checks = {{1, 1, fm}, {3, need, fm}, {5, need, fd}}
    for i, chk in ipairs(checks) do
      local limit = tonumber(f[4 + i])
      if refused == 0 and limit > 0 then
        local n = math.min(chk[2], limit)
        if c[chk[1] + 1] * (1 - chk[3]) + c[chk[1]] + n > limit then refused = i end
      end
    end
    if refused == 0 and conc > 0 and member ~= '-' and inflight + 1 > conc then refused = 4 end
  end
  local out = {(check and refused == 0) and 1 or 0, refused, c[1], c[2], c[3], c[4], c[5],
               c[6], inflight, 0, 0, 0, 0}
  if refused ~= 0 then return table.concat(out, ',') end
  local lease = tonumber(f[11])
  if check then
    redis.call('INCRBY', KEYS[k], 1)
    redis.call('EXPIRE', KEYS[k], f[12])
    if need > 0 then
      redis.call('INCRBY', KEYS[k + 2], need)
      redis.call('EXPIRE', KEYS[k + 2], f[12])
      redis.call('INCRBY', KEYS[k + 4], need)
      redis.call('EXPIRE', KEYS[k + 4], f[13])
    end
    c[1], c[3], c[5] = c[1] + 1, c[3] + need, c[5] + need
    if conc > 0 and member ~= '-' then
      redis.call('ZADD', conc_key, lease, member)
      redis.call('EXPIRE', conc_key, math.ceil(lease - now))
      inflight = inflight + 1
    end
  end
  local least = math.max(need, 1)
  out[10] = grant(KEYS[k], tonumber(f[17]), 1, tonumber(f[5]), c[2] * (1 - fm) + c[1], f[12])
  out[11] = grant(KEYS[k + 2], tonumber(f[18]), least, tonumber(f[6]), c[4] * (1 - fm) + c[3], f[12])
  out[12] = grant(KEYS[k + 4], tonumber(f[19]), least, tonumber(f[7]), c[6] * (1 - fd) + c[5], f[13])
  local want = tonumber(f[20])
  if want > 0 and conc > 0 then
    local s = math.max(0, math.min(want, math.floor((conc - inflight) / share)))
    for j = 1, s do redis.call('ZADD', conc_key, lease, f[21] .. j) end
    if s > 0 then redis.call('EXPIRE', conc_key, math.ceil(lease - now)) end
    out[13] = s
  end
  return table.concat(out, ',')
end
local function settle(k, f)
  for i = 0, 2 do add(KEYS[k + i], tonumber(f[2 + i])) end
  for j = 5, #f do redis.call('ZREM', KEYS[k + 3], f[j]) end
end
local out = {present}
local k = 2
for a = 2, #ARGV do
  local f = {}
  for v in string.gmatch(ARGV[a], '[^,]+') do f[#f + 1] = v end
  if f[1] == 'a' then
    out[#out + 1] = admit(k, f)
    k = k + 7
  else
    settle(k, f)
    k = k + 4
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
    """A request's hold on its tenant's limits: settle it once, when the request ends.
    Its x-ratelimit-* headers are built when first asked for (``pairs``, ``block``),
    from the counts it was admitted on."""

    __slots__ = (
        "_block",
        "_frac",
        "_limiter",
        "_local",
        "_pairs",
        "_rc",
        "_rp",
        "_tc",
        "_tp",
        "day",
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
        pairs: list[tuple[str, str]] | None,
        rp: float = 0.0,
        rc: float = 0.0,
        tp: float = 0.0,
        tc: float = 0.0,
        frac: float = 0.0,
        local: _Local | None = None,
    ):
        self._limiter = limiter
        self._local = local  # the tenant's counts on this replica
        self.tenant = tenant
        self.tokens = tokens  # reserved
        self.minute = minute  # the windows the reservation went into
        self.day = day
        self.member = member
        self.shared = shared  # counted in Redis too
        self.settled = False
        # The headers, or (None) the per-minute counts before the request to build
        # them from (with ``frac`` of the minute gone) when they are asked for.
        self._pairs = pairs
        self._block: str | None = None  # the head's lines, once built
        self._rp, self._rc, self._tp, self._tc, self._frac = rp, rc, tp, tc, frac

    def block(self) -> str:
        """The x-ratelimit-* headers as the lines of a response head (``header_block``)."""
        found = self._block
        if found is None:
            pairs = self._pairs
            if pairs is None:  # from the counts: no pairs built on the way
                found = header_block(self.tenant, self._rp, self._rc, self._tp, self._tc,
                                     self.tokens, self._frac)  # fmt: skip
            else:
                found = "".join([f"{name}: {value}\r\n" for name, value in pairs])
            self._block = found
        return found

    def pairs(self) -> list[tuple[str, str]]:
        """The x-ratelimit-* headers, as (name, value) pairs in the order written."""
        found = self._pairs
        if found is None:
            found = self._pairs = admitted_pairs(
                self.tenant, self._rp, self._rc, self._tp, self._tc, self.tokens, self._frac
            )
        return found

    @property
    def headers(self) -> dict[str, str]:
        """The x-ratelimit-* headers, by name."""
        return dict(self.pairs())

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


class _Allot:
    """This replica's allotment of one tenant's limits: what it took from Redis ahead of
    its requests and has not used yet (counted in Redis already, so no other replica can
    take it), and the shared counts as last seen, for the x-ratelimit-* headers."""

    __slots__ = ("asking", "cap_s", "d", "day", "free", "held", "minute", "r", "rc", "rp",
                 "t", "tc", "tp", "used_at", "want_d", "want_r", "want_s", "want_t")  # fmt: skip

    def __init__(self, minute: int, day: int, now: float):
        self.minute = minute  # the window r and t are counted in
        self.day = day  # d's
        self.r = 0  # requests left of requests_per_minute
        self.t = 0  # tokens left of tokens_per_minute
        self.d = 0  # tokens left of tokens_per_day
        self.free: list[str] = []  # concurrency slots held and not in use (members)
        self.held: set[str] = set()  # every slot held, in use or not
        self.want_r = self.want_t = self.want_d = self.want_s = 0  # the blocks asked for
        self.cap_s = 0  # most free slots kept
        self.asking = False  # an ask for more is on its way to Redis
        # requests and tokens per minute (prev, cur) in Redis as last seen, less what this
        # replica holds unused, plus what it admitted since
        self.rp = self.rc = self.tp = self.tc = 0.0
        self.used_at = now

    def low(self) -> bool:
        """Below half of a block of some limit: time to ask for more."""
        # Each test on its own (``x and y < z`` is an int or a bool, which compiled code
        # boxes), and x * 2 < w as x < w - w // 2 (a product of two large ints is
        # not a native one in compiled code).
        if self.want_r > 0 and self.r < self.want_r - (self.want_r >> 1):
            return True
        if self.want_t > 0 and self.t < self.want_t - (self.want_t >> 1):
            return True
        if self.want_d > 0 and self.d < self.want_d - (self.want_d >> 1):
            return True
        return self.want_s > 0 and len(self.free) < self.want_s - (self.want_s >> 1)


def _credit(left: int, want: int, difference: int) -> tuple[int, int]:
    """A settlement's token ``difference`` taken out of (or put into) an allotment that
    has ``left``, keeping at most ``want``: the allotment's new amount, and what still
    goes to Redis (more used than it has; more given back than it keeps)."""
    after = left - difference
    if after < 0:
        return 0, -after
    if after > want:
        return want, want - after
    return after, 0


class _Op:
    """One operation waiting for the next script call: an admission (kind "a", answered
    through ``done``), an ask for allotment ("g") or a settlement / give-back ("s")."""

    __slots__ = ("allot", "arg", "asked", "day", "done", "keys", "kind", "member", "minute",
                 "need", "prefix", "tenant")  # fmt: skip

    def __init__(
        self,
        kind: str,
        keys: list[str],
        arg: str,  # the script's argument for it
        done: asyncio.Future[list[str]] | None = None,
        allot: _Allot | None = None,
        tenant: str = "",
        minute: int = 0,
        day: int = 0,
        need: int = 0,
        member: str = "",
        prefix: str = "",
        asked: bool = False,
    ):
        self.kind = kind
        self.keys = keys
        self.arg = arg
        self.done = done
        self.allot = allot  # an admission's or ask's: where the grants go
        self.tenant = tenant
        self.minute = minute  # the windows its keys are of
        self.day = day
        self.need = need  # an admission's tokens and member: given back if it went away
        self.member = member
        self.prefix = prefix  # of the slots granted
        self.asked = asked  # it asks for allotment (the allotment's asking flag)


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
        script_call: Callable[[list[str], list[str]], Awaitable[Any]] | None = None,
    ):
        self._redis = redis
        # The batch script's call to Redis (keys, args -> its answer): ``_call`` unless
        # another is given (tests: a call that fails or answers oddly).
        self._script_call = script_call
        self._clock = clock
        settings = redis_settings or RedisSettings.model_validate({})
        self._prefix = f"unitproxy:{cluster or settings.cluster}"
        self._outage = Outage("tenant limits", settings)
        self._replicas_setting = replicas
        self.replicas_seen = 1
        self._local: dict[str, _Local] = {}
        self._allots: dict[str, _Allot] = {}
        self._live: set[Reservation] = set()
        self._unsent: list[_Op] = []  # settlements and give-backs Redis missed
        self._batch: Any = None if redis is None else redis.register_script(BATCH)
        self._ops: list[_Op] = []  # for the next script call
        self._sender: asyncio.Task[None] | None = None  # sends _ops, one call at a time
        self._conn: Any = None  # the connection it sends them on
        self._timer: asyncio.TimerHandle | None = None  # sends settlements that wait alone
        self.id = uuid.uuid4().hex[:12]  # this replica, in Redis
        self._admitted = 0
        self._asks = 0
        self.calls = 0  # script calls made to Redis (round trips)
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

    def allotment(self, tenant: str) -> tuple[int, int, int, int]:
        """What this replica holds of ``tenant``'s limits unused: requests and tokens
        per minute, tokens per day, free concurrency slots."""
        a = self._allots.get(tenant)
        return (0, 0, 0, 0) if a is None else (a.r, a.t, a.d, len(a.free))

    def _local_of(self, name: str) -> _Local:
        local = self._local.get(name)
        if local is None:
            local = self._local[name] = _Local()
        return local

    def _key(self, tenant: str, what: str) -> str:
        return f"{self._prefix}:limit:{tenant}:{what}"

    def _keys_of(self, name: str, minute: int, day: int) -> list[str]:
        """The admission's keys (``_keys``); a settlement's are [0], [2], [4], [6]."""
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

    def try_admit(self, tenant: Tenant, tokens: int) -> Reservation | None:
        """``admit`` where it is decided here, with no I/O and no await: a tenant with no
        limits, a request its allotment covers, or limits counted on this replica alone
        (no Redis, or Redis down). None: Redis has to say (``await admit``). Raises
        RateLimited as ``admit`` does."""
        if not tenant.limited:  # nothing to count: no Redis round trip either
            return Reservation(self, tenant, 0, 0, 0, "", False, [])
        now = self._clock()
        need = self._need(tenant, tokens)
        local = self._local.get(tenant.name)
        if local is None:
            local = self._local_of(tenant.name)
        if self._redis is not None and self._outage.down_since is None:
            return self._take(tenant, need, now, local)
        return self._admit_local(tenant, need, now, local, "")

    async def admit(self, tenant: Tenant, tokens: int) -> Reservation:
        """Count a request needing about ``tokens`` against ``tenant``'s limits, or raise
        RateLimited saying which limit and when it frees."""
        now = self._clock()
        if not tenant.limited:  # nothing to count: no Redis round trip either
            return Reservation(self, tenant, 0, 0, 0, "", False, [])
        need = self._need(tenant, tokens)
        local = self._local_of(tenant.name)
        if not self.shared:
            return self._admit_local(tenant, need, now, local, "")
        taken = self._take(tenant, need, now, local)
        if taken is not None:  # from this replica's allotment: no I/O
            return taken
        self._admitted += 1
        member = f"{self.id}-{self._admitted}"  # unique across replicas
        check, member = await self._admit_shared(tenant, need, now, member)
        if check is None:  # Redis failed just now
            return self._admit_local(tenant, need, now, local, member)
        return self._admitted_by(tenant, need, now, local, member, True, check, 1.0)

    @staticmethod
    def _need(tenant: Tenant, tokens: int) -> int:
        need = tokens if tenant.counts_tokens else 0
        if tenant.tokens_per_minute:
            need = min(need, tenant.tokens_per_minute)
        if tenant.tokens_per_day:
            need = min(need, tenant.tokens_per_day)
        return need

    def _admit_local(
        self, tenant: Tenant, need: int, now: float, local: _Local, member: str
    ) -> Reservation:
        """Admission from this replica's own counts, at its share of each limit."""
        if not member:
            self._admitted += 1
            member = f"{self.id}-{self._admitted}"  # unique across replicas
        share = self.share
        check = decide(tenant, local.counts(now), need, now, share)
        return self._admitted_by(tenant, need, now, local, member, False, check, share)

    def _admitted_by(
        self,
        tenant: Tenant,
        need: int,
        now: float,
        local: _Local,
        member: str,
        shared: bool,
        check: Check,
        share: float,
    ) -> Reservation:
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
        self._count(local, need, now, int(now // MINUTE_S))
        reservation = Reservation(
            self, tenant, need, int(now // MINUTE_S), int(now // DAY_S), member, shared,
            list(check.headers.items()), local=local,
        )  # fmt: skip
        self._live.add(reservation)
        return reservation

    @staticmethod
    def _count(local: _Local, need: int, now: float, minute: int) -> None:
        """One admitted request counted on this replica (``minute``: ``now``'s)."""
        if minute != local.minute:
            local.roll(now)
        local.rpm.cur += 1
        local.tpm.cur += need
        local.tpd.cur += need
        local.concurrent += 1

    def _take(self, tenant: Tenant, need: int, now: float, local: _Local) -> Reservation | None:
        """Admission from the tenant's allotment, when it covers every limit (None: it
        does not, ask Redis)."""
        a = self._allots.get(tenant.name)
        if a is None:
            return None
        # One float division: a day's windows end where a minute's do, and ``now`` less
        # its minute's start is exact (so this is ``now % MINUTE_S``, which divides too).
        minute = minute_of(now)
        day = minute // MINUTES_A_DAY
        frac = (now - minute * MINUTE_S) / MINUTE_S
        if minute != a.minute or day != a.day:
            self._roll(tenant.name, a, minute, day)
        least = need if need > 0 else 1
        rpm = tenant.requests_per_minute
        tpm = tenant.tokens_per_minute
        tpd = tenant.tokens_per_day
        if (
            (rpm and a.r < 1)
            or (tpm and a.t < least)
            or (tpd and a.d < least)
            or (tenant.max_concurrent and not a.free)
        ):
            return None
        member = ""
        if tenant.max_concurrent:
            member = a.free.pop()
        if rpm:
            a.r -= 1
        if tpm:
            a.t -= need
        if tpd:
            a.d -= need
        a.used_at = now
        # The headers are built from these counts when a response is written.
        reservation = Reservation(
            self, tenant, need, minute, day, member, True, None if rpm or tpm else [],
            a.rp, a.rc, a.tp, a.tc, frac, local,
        )  # fmt: skip
        a.rc += 1
        a.tc += need
        self._count(local, need, now, minute)
        if not a.asking and a.low():
            self._ask(tenant, a, need, now, minute, day)
        self._live.add(reservation)
        return reservation

    def _size(self, tenant: Tenant, need: int, a: _Allot) -> None:
        """The blocks to hold of each limit: limit / (replicas x BLOCK_PARTS), none where
        that is less than one request's need (every request then asks Redis); slots
        asked SLOTS_GRANT at a time at most."""
        parts = max(1, self.replicas) * BLOCK_PARTS
        least = need if need > 0 else 1
        a.want_r = tenant.requests_per_minute // parts
        t, d = tenant.tokens_per_minute // parts, tenant.tokens_per_day // parts
        a.want_t = t if t >= least else 0
        a.want_d = d if d >= least else 0
        a.cap_s = tenant.max_concurrent // parts
        a.want_s = min(SLOTS_GRANT, a.cap_s)

    def _admit_op(
        self,
        kind: str,
        tenant: Tenant,
        a: _Allot,
        need: int,
        now: float,
        member: str,
        back: tuple[int, int, int],
        want: tuple[int, int, int, int],
        done: asyncio.Future[list[str]] | None,
    ) -> _Op:
        minute, day = int(now // MINUTE_S), int(now // DAY_S)
        keys = self._keys_of(tenant.name, minute, day)
        fm, fd = (now % MINUTE_S) / MINUTE_S, (now % DAY_S) / DAY_S
        asked = any(want)
        if asked:
            a.asking = True
        self._asks += 1
        prefix = f"{self.id}-g{self._asks}-"
        arg = (
            f"a,{1 if kind == 'a' else 0},{fm!r},{fd!r},{tenant.requests_per_minute},"
            f"{tenant.tokens_per_minute},{tenant.tokens_per_day},{tenant.max_concurrent},"
            f"{need},{member or '-'},{now + LEASE_S!r},{int(2 * MINUTE_S + 10)},"
            f"{int(2 * DAY_S + 10)},{back[0]},{back[1]},{back[2]},{want[0]},{want[1]},"
            f"{want[2]},{want[3]},{prefix}"
        )
        return _Op(kind, keys, arg, done, a, tenant.name, minute, day, need, member, prefix,
                   asked)  # fmt: skip

    def _ask(self, tenant: Tenant, a: _Allot, need: int, now: float, minute: int, day: int) -> None:
        """Top the allotment up to a block of each limit, in the background."""
        want = (
            max(0, a.want_r - a.r), max(0, a.want_t - a.t), max(0, a.want_d - a.d),
            max(0, a.want_s - len(a.free)),
        )  # fmt: skip
        if any(want):
            self._send(self._admit_op("g", tenant, a, need, now, "", (0, 0, 0), want, None))

    async def _admit_shared(
        self, tenant: Tenant, need: int, now: float, member: str
    ) -> tuple[Check | None, str]:
        """One request checked in Redis, as every request was before allotments; the
        allotment goes back with it (so the check counts only what is used) and a new
        one is asked for. Gives the check (None: Redis failed) and the request's slot."""
        name = tenant.name
        minute, day = int(now // MINUTE_S), int(now // DAY_S)
        a = self._allots.get(name)
        if a is None:
            a = self._allots[name] = _Allot(minute, day, now)
        elif minute != a.minute or day != a.day:
            self._roll(name, a, minute, day)
        a.used_at = now
        back = (a.r, a.t, a.d)
        a.r = a.t = a.d = 0
        self._size(tenant, need, a)
        own = a.free.pop() if tenant.max_concurrent and a.free else ""
        want = (0, 0, 0, 0)
        if not a.asking:
            want = (a.want_r, a.want_t, a.want_d, max(0, a.want_s - len(a.free)))
        done: asyncio.Future[list[str]] = self._running_loop().create_future()
        self._send(self._admit_op("a", tenant, a, need, now, "" if own else member, back,
                                  want, done))  # fmt: skip
        try:
            out = await done
        except REDIS_ERRORS:
            if own:
                self._slot_back(name, own)
            return None, member  # the batch failed: Redis is down
        except asyncio.CancelledError:
            if own:
                self._slot_back(name, own)
            raise
        fm = (now % MINUTE_S) / MINUTE_S
        counts = Counts(
            (float(out[3]), float(out[2])), (float(out[5]), float(out[4])),
            (float(out[7]), float(out[6])), int(out[8]),
        )  # fmt: skip
        refused = REFUSED[int(out[1])]
        if not refused:
            if own:
                member = own
            elif tenant.max_concurrent and a.cap_s and self._allots.get(name) is a:
                a.held.add(member)  # a slot of the replica's from now on
            return Check("", 0.0, headers(tenant, counts, need, fm, 1.0, admitted=True)), member
        if own:
            self._slot_back(name, own)
        check = decide(tenant, counts, need, now, 1.0)
        if check.refused != refused:  # rounding at the edge: Redis's word counts
            wait = 1.0 if refused == "max_concurrent" else check.wait_s or 1.0
            return Check(
                refused, wait, headers(tenant, counts, need, fm, 1.0, admitted=False)
            ), member
        return check, member

    def _granted(self, op: _Op, out: list[str]) -> None:
        """What Redis granted with an admission or an ask goes into the allotment, or
        back to Redis where that allotment is gone or its window has passed."""
        a = op.allot
        assert a is not None
        if op.asked:
            a.asking = False
        g_r, g_t, g_d, g_s = int(out[9]), int(out[10]), int(out[11]), int(out[12])
        live = self._allots.get(op.tenant) is a
        back_r = back_t = back_d = 0
        slots = [f"{op.prefix}{j}" for j in range(1, g_s + 1)]
        if live and a.minute == op.minute:
            a.r += g_r
            a.t += g_t
            admitted = out[0] == "1"
            a.rp, a.tp = float(out[3]), float(out[5])
            a.rc = max(0.0, float(out[2]) + admitted + g_r - a.r)
            a.tc = max(0.0, float(out[4]) + (op.need if admitted else 0) + g_t - a.t)
        else:
            back_r, back_t = g_r, g_t
        if live and a.day == op.day:
            a.d += g_d
        else:
            back_d = g_d
        if live:
            a.held.update(slots)
            a.free += slots
            slots = []
        if back_r or back_t or back_d or slots:
            arg = f"s,{-back_r},{-back_t},{-back_d}" + "".join(f",{m}" for m in slots)
            self._ops.append(_Op("s", [op.keys[0], op.keys[2], op.keys[4], op.keys[6]], arg))

    # -- giving back -----------------------------------------------------------------

    def _give(
        self, name: str, minute: int, day: int, r: int, t: int, d: int, slots: list[str]
    ) -> None:
        """Give unused allotment back to the windows it was counted in, and free slots."""
        if not (r or t or d or slots):
            return
        every = self._keys_of(name, minute, day)
        arg = f"s,{-r},{-t},{-d}" + "".join(f",{m}" for m in slots)
        self._queue(_Op("s", [every[0], every[2], every[4], every[6]], arg))

    def _roll(self, name: str, a: _Allot, minute: int, day: int) -> None:
        """A window of the allotment has ended: what is left of it goes back to it."""
        r = t = d = 0
        old_minute, old_day = a.minute, a.day
        if minute != a.minute:
            r, t, a.r, a.t = a.r, a.t, 0, 0
            follows = minute == a.minute + 1
            a.rp, a.tp = (a.rc, a.tc) if follows else (0.0, 0.0)
            a.rc = a.tc = 0.0
            a.minute = minute
        if day != a.day:
            d, a.d, a.day = a.d, 0, day
        self._give(name, old_minute, old_day, r, t, d, [])

    def _release(self, name: str, a: _Allot) -> None:
        """Give all of an allotment back (its slots in use stay held until settled)."""
        self._give(name, a.minute, a.day, a.r, a.t, a.d, a.free)
        a.held.difference_update(a.free)
        a.r = a.t = a.d = 0
        a.free = []
        # Until Redis grants it more, settlements go to Redis and slots back to it.
        a.want_r = a.want_t = a.want_d = a.want_s = a.cap_s = 0

    def _slot_back(self, name: str, member: str) -> None:
        a = self._allots.get(name)
        if a is not None and member in a.held:
            a.free.append(member)
        else:
            self._give(name, 0, 0, 0, 0, 0, [member])

    def sweep(self) -> None:
        """Give back what is left of allotments whose windows ended, and all of those of
        tenants idle for IDLE_S (``run`` does it every SWEEP_S)."""
        if not self.shared:
            return
        now = self._clock()
        minute, day = int(now // MINUTE_S), int(now // DAY_S)
        for name, a in list(self._allots.items()):
            if minute != a.minute or day != a.day:
                self._roll(name, a, minute, day)
            if now - a.used_at >= IDLE_S:
                self._release(name, a)
                if not a.held and not a.asking:
                    del self._allots[name]

    # -- settlement ------------------------------------------------------------------

    def _settle(self, r: Reservation, difference: int) -> None:
        t = r.tenant
        if not t.limited:
            return
        self._live.discard(r)
        local = r._local
        if local is None:
            local = self._local_of(t.name)
        # Not rolled to now: ``add`` puts the difference into the reservation's own
        # windows wherever they stand (the current one, the one before, or none).
        if local.concurrent > 0:
            local.concurrent -= 1
        if difference:
            local.tpm.add(r.minute, difference)
            local.tpd.add(r.day, difference)
        if not r.shared or self._redis is None:
            return
        d_t = difference if t.tokens_per_minute else 0
        d_d = difference if t.tokens_per_day else 0
        member = r.member if t.max_concurrent else ""
        a = self._allots.get(t.name)
        if a is not None and self._outage.down_since is None:
            # Into the allotment where its window is the reservation's: no Redis call.
            if d_t and a.minute == r.minute:
                tc = a.tc + d_t  # for the headers
                a.tc = tc if tc > 0.0 else 0.0
            if d_t and a.want_t and a.minute == r.minute:
                a.t, d_t = _credit(a.t, a.want_t, d_t)
            if d_d and a.want_d and a.day == r.day:
                a.d, d_d = _credit(a.d, a.want_d, d_d)
            if member and member in a.held:
                if len(a.free) < a.cap_s:
                    a.free.append(member)  # the slot stays this replica's
                    member = ""
                else:
                    a.held.discard(member)
        if not (d_t or d_d or member):
            return  # nothing to tell Redis: the estimate stands, no slot to free
        every = self._keys_of(t.name, r.minute, r.day)
        arg = f"s,0,{d_t},{d_d}" + (f",{member}" if member else "")
        self._queue(_Op("s", [every[0], every[2], every[4], every[6]], arg))

    def _queue(self, op: _Op) -> None:
        """A settlement or give-back: with the next batch (it waits up to SETTLE_WITHIN_S
        for an admission to ride with), or kept for Redis's return while it is down."""
        if self._outage.down:
            if len(self._unsent) < MAX_UNSENT:
                self._unsent.append(op)
            return
        self._ops.append(op)
        if self._timer is None and (self._sender is None or self._sender.done()):
            self._timer = self._running_loop().call_later(SETTLE_WITHIN_S, self._start)

    # -- the batches to Redis --------------------------------------------------------

    def _send(self, op: _Op) -> None:
        """Queue ``op`` for the next script call, which goes at once. One call is in
        flight at a time: what arrives while it is on its way goes in the next one, so
        the round trips to Redis grow with the load only until one call carries
        everything that waited. A settlement waits up to SETTLE_WITHIN_S for an
        admission to ride with (``_queue``)."""
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
            self.calls += 1
            try:
                call = self._script_call
                out = await (self._call(keys, args) if call is None else call(keys, args))
            except asyncio.CancelledError:
                for op in ops:
                    if op.asked and op.allot is not None:
                        op.allot.asking = False
                    if op.done is not None and not op.done.done():
                        op.done.cancel()
                raise
            except Exception as exc:
                if not isinstance(exc, REDIS_ERRORS):  # never leave an admission waiting
                    log.exception("tenant limits: the batch to Redis failed")
                    exc = RedisError(f"{type(exc).__name__}: {exc}")
                self._down(exc)
                for op in ops:
                    if op.kind == "s":
                        if len(self._unsent) < MAX_UNSENT:
                            self._unsent.append(op)
                        continue
                    if op.asked and op.allot is not None:
                        op.allot.asking = False
                    if op.done is not None and not op.done.done():
                        op.done.set_exception(exc)
                continue
            self.replicas_seen = max(1, int(out[0]))
            i = 1
            for op in ops:
                if op.kind == "s":
                    continue
                i += 1
                try:
                    result = out[i - 1]
                    fields = (result.decode() if isinstance(result, bytes) else result).split(",")
                    self._granted(op, fields)
                except Exception as exc:  # never leave an admission waiting
                    log.exception("tenant limits: an answer from Redis of an unexpected shape")
                    error = RedisError(f"{type(exc).__name__}: {exc}")
                    self._down(error)  # counted alone until Redis answers a refresh
                    if op.asked and op.allot is not None:
                        op.allot.asking = False
                    if op.done is not None and not op.done.done():
                        op.done.set_exception(error)
                    continue
                if op.done is None:
                    continue
                if not op.done.done():
                    op.done.set_result(fields)
                elif op.done.cancelled() and fields[0] == "1":
                    # The request went away while Redis admitted it: give the tokens
                    # and its slot back.
                    member = f",{op.member}" if op.member else ""
                    keys = [op.keys[0], op.keys[2], op.keys[4], op.keys[6]]
                    self._ops.append(_Op("s", keys, f"s,0,{-op.need},{-op.need}{member}"))

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
            # Allotments are not spent while Redis is away (each replica keeps to its
            # share of its own counts): given back once it answers again.
            for name, a in self._allots.items():
                self._release(name, a)
            self._allots.clear()

    async def run(self) -> None:
        """Renew this replica's presence and its slots' leases every RENEW_S; while Redis
        is down, try it again every PROBE_S; give back allotments of ended windows and
        idle tenants every SWEEP_S. Until cancelled."""
        if self._redis is None:
            return
        last = -math.inf
        while True:
            try:
                if time.monotonic() - last >= (PROBE_S if self._outage.down else RENEW_S):
                    last = time.monotonic()
                    await self.refresh()
                self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("tenant limits: refresh failed")
            await asyncio.sleep(SWEEP_S)

    async def refresh(self) -> None:
        """One round of presence and lease renewal; it also finds that Redis is back."""
        redis = self._redis
        if redis is None:
            return
        now = self._clock()
        presence = f"{self._prefix}:gateways"
        slots: set[tuple[str, str]] = set()
        for name, a in self._allots.items():
            slots.update((name, m) for m in a.held)
        for r in list(self._live):
            if r.shared and r.tenant.max_concurrent and r.member:
                slots.add((r.tenant.name, r.member))
        try:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.zadd(presence, {self.id: now + PRESENCE_S})
                pipe.zremrangebyscore(presence, "-inf", now)
                pipe.zcard(presence)
                for name, member in slots:
                    pipe.zadd(self._key(name, "concurrent"), {member: now + LEASE_S}, xx=True)
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
        self._ops += unsent
        await self._flushed()

    async def close(self) -> None:
        """Give allotments back, wait for settlements on their way to Redis, and leave
        the presence set."""
        if self.shared:
            for name, a in self._allots.items():
                self._release(name, a)
            self._allots.clear()
        if self._ops or (self._sender is not None and not self._sender.done()):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flushed(), 2.0)
        await self._drop_conn()
        if self._redis is not None and not self._outage.down:
            with contextlib.suppress(*REDIS_ERRORS):
                await self._redis.zrem(f"{self._prefix}:gateways", self.id)

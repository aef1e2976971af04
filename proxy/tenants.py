"""Tenants: who a request comes from, by its API key, with a priority class and limits.

A tenant is a name with keys (plaintext or their sha256), a priority class and optional
limits. They come from a TOML file of ``[[tenant]]`` tables (``gateway.tenants_file``),
and optionally from Redis (``unitproxy:{cluster}:tenant:{name}``, a JSON object with the
same fields); the flat ``server.api_keys`` are tenant ``default``. ``TenantSource``
keeps the set current: it looks at the file every ``tenants_poll_s`` and on SIGHUP,
reads it off the event loop, and keeps the last good set when a new one does not parse
or validate (saying why in the log).

A request is matched by the sha256 of its key: one hash and one dict lookup, whatever
the number of tenants, and no comparison whose time depends on a stored key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import signal
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from proxy.errors import Forbidden, InvalidRequest, Unauthenticated
from proxy.redis_reports import REDIS_ERRORS

log = logging.getLogger(__name__)

BEARER = "Bearer "
PRIORITY_HEADER = "x-unitproxy-priority"
# A gateway's credential for PRIORITY_HEADER interactive: HMAC under server.resume_secret
# over the request's x-request-id and the class (HintKey.sign_priority).
PRIORITY_SIG_HEADER = "x-unitproxy-priority-sig"
# Highest first: a lower rank is served first.
PRIORITIES = ("interactive", "standard", "batch")
RANK = {name: rank for rank, name in enumerate(PRIORITIES)}
DEFAULT_TENANT = "default"
NAME = re.compile(r"[a-z0-9_-]{1,64}")
SHA256 = re.compile(r"[0-9a-f]{64}")
LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "tokens_per_day")
FIELDS = frozenset({"name", "keys", "key_sha256", "priority", "models", *LIMITS})
# Authorization values already identified, kept by each set of tenants (a dict lookup,
# not a sha256 a request): known keys only, so unknown keys cannot grow it; emptied when
# this full.
MAX_KNOWN_KEYS = 4096


class TenantsError(ValueError):
    """A tenants file or entry that is not valid; the message names tenant and field."""


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# A tenant's fields (its __slots__: a compiled class has no such attribute to read).
TENANT_FIELDS = (
    "counts_tokens", "key_hashes", "limit_texts", "limited", "max_concurrent", "models", "name",
    "priority", "requests_per_minute", "request_lines", "token_lines", "tokens_per_day",
    "tokens_per_minute",
)  # fmt: skip


class Tenant:
    """One tenant. (A plain class: it is read on every request.)"""

    __slots__ = (
        "counts_tokens", "key_hashes", "limit_texts", "limited", "max_concurrent", "models",
        "name", "priority", "request_lines", "requests_per_minute", "token_lines",
        "tokens_per_day", "tokens_per_minute",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        key_hashes: Sequence[str] = (),
        priority: str = "standard",
        requests_per_minute: int = 0,  # each limit: 0 is none
        tokens_per_minute: int = 0,
        max_concurrent: int = 0,
        tokens_per_day: int = 0,
        models: frozenset[str] | None = None,  # None: every model
    ):
        self.name = name
        self.key_hashes = tuple(key_hashes)
        self.priority = priority
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self.max_concurrent = max_concurrent
        self.tokens_per_day = tokens_per_day
        self.models = models
        # Read on every request: found once (a tenant is not changed once made).
        self.limited = bool(requests_per_minute or tokens_per_minute or max_concurrent
                            or tokens_per_day)  # fmt: skip
        self.counts_tokens = bool(tokens_per_minute or tokens_per_day)
        # The fixed text of the x-ratelimit-* lines of its per-minute limits (before the
        # remaining count, and between it and the reset time): every response of the
        # tenant is written with them (proxy.ratelimit.header_block).
        self.request_lines = (
            f"x-ratelimit-limit-requests: {requests_per_minute}\r\n"
            "x-ratelimit-remaining-requests: ",
            "\r\nx-ratelimit-reset-requests: ",
        )
        self.token_lines = (
            f"x-ratelimit-limit-tokens: {tokens_per_minute}\r\nx-ratelimit-remaining-tokens: ",
            "\r\nx-ratelimit-reset-tokens: ",
        )
        # The same limits' values as gRPC's metadata carries them (proxy.ratelimit.admitted_pairs)
        self.limit_texts = (str(requests_per_minute), str(tokens_per_minute))

    def check_model(self, model: str) -> None:
        """Raise Forbidden when the tenant's allow-list does not name ``model``."""
        if self.models is not None and not model:
            raise Forbidden(
                f"tenant {self.name} must name its model: one of {', '.join(sorted(self.models))}",
                param="model",
                code="model_not_allowed",
            )
        if self.models is not None and model not in self.models:
            raise Forbidden(
                f"tenant {self.name} may not use model {model!r}",
                param="model",
                code="model_not_allowed",
            )

    def priority_for(self, asked: str | None) -> str:
        """The class of one request: the tenant's, or a lower one the request asks for
        (``PRIORITY_HEADER``); never higher than the tenant's."""
        if asked is None:
            return self.priority
        asked = asked.strip().lower()
        rank = RANK.get(asked)
        if rank is None:
            raise InvalidRequest(
                f"{PRIORITY_HEADER} must be one of {', '.join(PRIORITIES)}, not {asked!r}",
                param=PRIORITY_HEADER,
            )
        return asked if rank > RANK[self.priority] else self.priority

    def same_as(self, other: Tenant) -> bool:
        return all(getattr(self, f) == getattr(other, f) for f in TENANT_FIELDS)

    def __repr__(self) -> str:
        return f"Tenant({self.name!r}, {self.priority})"


def _int_limit(raw: Mapping[str, Any], field: str, where: str) -> int:
    value = raw.get(field, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TenantsError(f"{where}: {field} must be a whole number >= 0 (0: none), not {value!r}")
    return value


def _strings(raw: Mapping[str, Any], field: str, where: str) -> list[str]:
    value = raw.get(field, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TenantsError(f"{where}: {field} must be a list of non-empty strings")
    return value


def tenant_from(raw: Any, where: str) -> Tenant:
    """A tenant from one ``[[tenant]]`` table (or Redis entry); raises TenantsError."""
    if not isinstance(raw, dict):
        raise TenantsError(f"{where}: must be a table of fields")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise TenantsError(f"{where}: name must match [a-z0-9_-]{{1,64}}, not {name!r}")
    where = f"tenant {name}"
    unknown = sorted(set(raw) - FIELDS)
    if unknown:
        raise TenantsError(f"{where}: unknown field {', '.join(unknown)}")
    hashes = [key_hash(k) for k in _strings(raw, "keys", where)]
    for h in _strings(raw, "key_sha256", where):
        if not SHA256.fullmatch(h.lower()):
            raise TenantsError(f"{where}: key_sha256 must be 64 hex digits, not {h!r}")
        hashes.append(h.lower())
    if not hashes:
        raise TenantsError(f"{where}: keys or key_sha256 must give at least one key")
    priority = raw.get("priority", "standard")
    if priority not in RANK:
        raise TenantsError(
            f"{where}: priority must be one of {', '.join(PRIORITIES)}, not {priority!r}"
        )
    models = frozenset(_strings(raw, "models", where)) if "models" in raw else None
    rpm, tpm, conc, tpd = (_int_limit(raw, field, where) for field in LIMITS)
    return Tenant(name, hashes, priority, rpm, tpm, conc, tpd, models)


def parse_file(text: str, source: str) -> list[Tenant]:
    """The tenants of a TOML file's text; raises TenantsError saying what is wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsError(f"{source}: not valid TOML: {exc}") from exc
    unknown = sorted(set(doc) - {"tenant"})
    if unknown:
        raise TenantsError(f"{source}: unknown table {', '.join(unknown)} (tenants are [[tenant]])")
    tables = doc.get("tenant", [])
    if not isinstance(tables, list):
        raise TenantsError(f"{source}: tenant must be an array of tables ([[tenant]])")
    return [tenant_from(t, f"{source}: tenant #{i + 1}") for i, t in enumerate(tables)]


class Tenants:
    """One validated set of tenants, and the lookup from a request's key."""

    def __init__(self, tenants: Iterable[Tenant] = ()):
        self.by_name: dict[str, Tenant] = {}
        self._by_hash: dict[str, Tenant] = {}
        self._known: dict[str, Tenant] = {}  # authorization -> its tenant, as identified
        for tenant in tenants:
            if tenant.name in self.by_name:
                raise TenantsError(f"tenant {tenant.name}: the name is given twice")
            self.by_name[tenant.name] = tenant
            for h in tenant.key_hashes:
                other = self._by_hash.get(h)
                if other is not None:
                    raise TenantsError(
                        f"tenant {tenant.name}: a key of it is also tenant {other.name}'s"
                    )
                self._by_hash[h] = tenant

    @classmethod
    def build(cls, tenants: Iterable[Tenant], flat_keys: Sequence[str] = ()) -> Tenants:
        """``tenants`` plus tenant ``default`` for the flat keys (server.api_keys): added
        to a tenant of that name if there is one, else one with no limits."""
        listed = list(tenants)
        hashes = [key_hash(k) for k in flat_keys if k]
        if hashes:
            named = next((t for t in listed if t.name == DEFAULT_TENANT), None)
            if named is None:
                listed.append(Tenant(DEFAULT_TENANT, hashes))
            else:  # a copy: the file's tenant may be reused for the next set
                both = list(dict.fromkeys(named.key_hashes + tuple(hashes)))
                merged = Tenant(DEFAULT_TENANT, both, named.priority, named.requests_per_minute,
                                named.tokens_per_minute, named.max_concurrent,
                                named.tokens_per_day, named.models)  # fmt: skip
                listed[listed.index(named)] = merged
        return cls(listed)

    def __len__(self) -> int:
        return len(self.by_name)

    def identify(self, authorization: str | None) -> Tenant:
        """The tenant whose key ``authorization`` carries; raises Unauthenticated."""
        if authorization:
            known = self._known.get(authorization)
            if known is not None:
                return known
        if not authorization or not authorization.startswith(BEARER):
            raise Unauthenticated(
                "an API key is required: 'Authorization: Bearer KEY'", code="missing_api_key"
            )
        tenant = self._by_hash.get(key_hash(authorization[len(BEARER) :]))
        if tenant is None:
            raise Unauthenticated("the API key is not valid", code="invalid_api_key")
        if len(self._known) >= MAX_KNOWN_KEYS:
            self._known.clear()
        self._known[authorization] = tenant
        return tenant

    def identify_metadata(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Tenant:
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        return self.identify(value.decode(errors="replace") if isinstance(value, bytes) else value)

    def same_as(self, other: Tenants) -> bool:
        mine, theirs = self.by_name, other.by_name
        return mine.keys() == theirs.keys() and all(t.same_as(theirs[n]) for n, t in mine.items())


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class TenantSource:
    """Keeps ``current`` up to date from the tenants file (and Redis, if given).

    ``load()`` reads the first set and raises TenantsError if it is bad; afterwards a bad
    file (or Redis entry) is logged and the last good set stays in force."""

    def __init__(
        self,
        path: Path | None,
        flat_keys: Sequence[str] = (),
        poll_s: float = 1.0,
        redis: Redis | None = None,
        cluster: str = "default",
        on_change: Callable[[Tenants], None] = lambda tenants: None,
    ):
        self.path = path
        self._flat_keys = tuple(flat_keys)
        self._poll_s = poll_s
        self._redis = redis
        self._pattern = f"unitproxy:{cluster}:tenant:*"
        self._on_change = on_change
        self._signature: tuple[int, int, int] | None = None  # the file's, as last read
        # Its signature at the last look: a change is read once two looks agree on it
        # (a file written in place is read whole, not while it is empty or half there).
        self._seen: tuple[int, int, int] | None = None
        self._from_file: list[Tenant] | None = None  # the file's last good tenants
        self._wake = asyncio.Event()
        self.current = Tenants.build((), flat_keys)
        self.reloads = 0  # sets put in force after the first
        self.rejected = 0  # new sets refused (bad file or entry)
        self.last_error: str | None = None

    async def load(self) -> Tenants:
        """Read the first set; raises TenantsError (the gateway must not start)."""
        self.current = await self._read()
        log.info("tenants: %d loaded%s", len(self.current),
                 f" from {self.path}" if self.path else "")  # fmt: skip
        return self.current

    async def check(self, reread: bool = True) -> bool:
        """Read again (the file too unless ``reread`` is false: only Redis may have
        changed); True when a new set is in force."""
        try:
            fresh = await self._read(reread)
        except TenantsError as exc:
            if str(exc) != self.last_error:
                log.warning("tenants: keeping the last good set (%d tenants): %s",
                            len(self.current), exc)  # fmt: skip
            self.last_error = str(exc)
            self.rejected += 1
            return False
        self.last_error = None
        if fresh.same_as(self.current):
            return False
        self.current = fresh
        self.reloads += 1
        log.info("tenants: %d in force after a reload", len(fresh))
        self._on_change(fresh)
        return True

    def reload_now(self) -> None:
        """Look at the file at once (SIGHUP)."""
        self._wake.set()

    async def run(self) -> None:
        """Poll every ``poll_s`` and on SIGHUP until cancelled."""
        with self._sighup():
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._poll_s)
                forced = self._wake.is_set()
                self._wake.clear()
                try:
                    await self.look(forced)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("tenants: reload failed")

    async def look(self, forced: bool = False) -> bool:
        """One look (``run`` makes one every ``poll_s``): the file read again where it
        changed and has stayed the same since the look before, or where ``forced``
        (SIGHUP); Redis read at every look. True when a new set is in force."""
        changed = forced or await asyncio.to_thread(self._changed)
        if changed or self._redis is not None:
            return await self.check(reread=changed)
        return False

    @contextlib.contextmanager
    def _sighup(self) -> Any:
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self.reload_now)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            yield
            return
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGHUP)

    def _changed(self) -> bool:
        """Whether the file changed since it was read, and has stayed the same since the
        look before (one poll interval): a file written in place passes through an empty
        or partial text that may parse (an empty file is no tenants), which must not be
        put in force for a moment. Blocking (a stat): run it in a thread."""
        if self.path is None:
            return False
        now = _signature(self.path)
        seen, self._seen = self._seen, now
        return now != self._signature and now == seen

    async def _read(self, reread: bool = True) -> Tenants:
        if self.path is not None and (reread or self._from_file is None):
            path = self.path
            signature, text = await asyncio.to_thread(_read_file, path)
            self._signature = signature  # a bad file is read once, not at every look
            self._from_file = parse_file(text, str(path))
        listed = {t.name: t for t in self._from_file or ()}
        if self._redis is not None:
            listed.update({t.name: t for t in await self._read_redis()})
        return Tenants.build(listed.values(), self._flat_keys)

    async def _read_redis(self) -> list[Tenant]:
        redis = self._redis
        assert redis is not None
        try:
            keys = sorted([k async for k in redis.scan_iter(match=self._pattern, count=500)])
            values = await redis.mget(keys) if keys else []
        except REDIS_ERRORS as exc:
            raise TenantsError(f"Redis: cannot read tenants: {exc}") from exc
        found = []
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue  # deleted between the scan and the read
            try:
                raw = json.loads(value)
            except ValueError as bad:
                raise TenantsError(f"Redis {key}: not a JSON object: {bad}") from bad
            tenant = tenant_from(raw, f"Redis {key}")
            if not key.endswith(f":{tenant.name}"):
                raise TenantsError(f"Redis {key}: holds tenant {tenant.name}")
            found.append(tenant)
        return found


def _read_file(path: Path) -> tuple[tuple[int, int, int] | None, str]:
    """Blocking: run it in a thread. The signature is taken first, so a change while
    reading is seen at the next look."""
    signature = _signature(path)
    try:
        return signature, path.read_text()
    except OSError as exc:
        raise TenantsError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as bad:
        raise TenantsError(f"{path}: not UTF-8 text: {bad}") from bad

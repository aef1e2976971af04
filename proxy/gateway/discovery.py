"""Which units a gateway accepts from Redis: anyone who can publish there could
otherwise point client traffic (and client keys) at any address, and create units,
connection pools and metric labels without end.

A discovered unit is accepted when its id is short and plain, its HTTP URL (as
``scheme://host:port``, with no user, path or query) matches one of
``gateway.discover_allow`` (shell-style patterns, e.g. ``http://10.0.*:8080``), its
gRPC target is on the same host as that URL, its scheme agrees with the gateway's TLS
settings, and the gateway knows fewer than ``gateway.max_units`` units. A refusal is
logged once per unit id (for the first ``LOGGED_MAX`` ids) and counted by reason.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from urllib.parse import urlsplit

from prometheus_client import Counter

from proxy.metrics import DISCOVERY_REFUSALS
from proxy.settings import GatewaySettings, UnitTarget

log = logging.getLogger(__name__)

REASONS = DISCOVERY_REFUSALS
UNIT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
LOGGED_MAX = 1024  # refused unit ids remembered, so each is logged once


class Discovery:
    def __init__(self, settings: GatewaySettings, refused: Counter):
        self._allow = [p.lower() for p in settings.discover_allow]
        self._max_units = settings.max_units
        self._tls_only = settings.tls_ca_file is not None
        self._counter = refused
        self._logged: set[str] = set()

    def refusal(self, target: UnitTarget, known: int) -> str | None:
        """Why ``target`` may not be routed to (a reason of REASONS), or None."""
        if not UNIT_ID.fullmatch(target.id):
            return "bad_id"
        if not self._allowed(target):
            return "not_allowed"
        if self._tls_only and not target.http_url.startswith("https://"):
            return "tls"
        if known >= self._max_units:
            return "max_units"
        return None

    def admit(self, target: UnitTarget, known: int) -> bool:
        """True to route to ``target``; else the refusal is counted (and logged once)."""
        reason = self.refusal(target, known)
        if reason is None:
            return True
        self._counter.labels(reason).inc()
        if target.id not in self._logged and len(self._logged) < LOGGED_MAX:
            self._logged.add(target.id)
            log.warning("unit %r registered in Redis is refused (%s): %s", target.id[:80],
                        reason, _EXPLAIN[reason])  # fmt: skip
            if len(self._logged) == LOGGED_MAX:
                log.warning("%d units refused from Redis: further refusals are only counted",
                            LOGGED_MAX)  # fmt: skip
        return False

    def _allowed(self, target: UnitTarget) -> bool:
        try:
            parts = urlsplit(target.http_url.lower())
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return False
        if parts.username is not None or parts.path.strip("/") or parts.query or not parts.hostname:
            return False  # patterns are matched against scheme://host:port and nothing else
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        url = f"{parts.scheme}://{shown}:{port}"
        if not any(fnmatch.fnmatchcase(url, pattern) for pattern in self._allow):
            return False
        grpc_host = target.grpc_target.rpartition(":")[0].strip("[]").lower()
        return grpc_host == host


_EXPLAIN = {
    "bad_id": "a unit id is 1 to 63 letters, digits, '.', '_' or '-'",
    "not_allowed": "its HTTP URL matches no gateway.discover_allow pattern, or its gRPC "
    "target is on another host",
    "tls": "gateway.tls_ca_file is set: units must be https://",
    "max_units": "gateway.max_units units are known already",
}

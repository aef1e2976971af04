"""Where the Redis tests find their server, and what they say when there is none.

The tests that need Redis use the fixtures ``redis`` and ``cluster`` of tests/conftest.py:
they skip, naming the address, where no server answers.
"""

from __future__ import annotations

import os
from typing import Any

REDIS_URL = os.environ.get("UNITPROXY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
NO_REDIS = (
    "needs a Redis server: start one with `redis-server --port 6379` "
    "(Debian/Ubuntu: apt-get install redis-server) or set UNITPROXY_TEST_REDIS_URL"
)


def redis_section(url: str, cluster: str) -> dict[str, Any]:
    """The ``redis`` settings section of a test process: short timeouts and backoff, so
    outages are noticed and ridden out quickly."""
    return {
        "url": url,
        "cluster": cluster,
        "timeout_s": 0.5,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.3,
    }

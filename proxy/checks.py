"""Health checking: timing, jitter and thresholds, around probes that make one call each.

A probe is an async callable that returns when the target is healthy and raises
``ProbeFailed`` (or anything else) when not. The ``Checker`` runs it every interval
(with jitter), bounds it by a timeout, and reports a verdict only after the
unhealthy or healthy threshold of consecutive results. The very first success counts
at once, so a unit starts serving as soon as every node answered once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

Probe = Callable[[], Awaitable[None]]
Verdict = Callable[[bool, str], None]


class ProbeFailed(Exception):
    """The target answered, and the answer was 'unhealthy'; the message says why."""


@dataclass(frozen=True, slots=True)
class CheckPolicy:
    interval_s: float = 1.0
    timeout_s: float = 1.0
    unhealthy_threshold: int = 3
    healthy_threshold: int = 2
    jitter: float = 0.1  # share of the interval, either way


class Checker:
    def __init__(
        self,
        name: str,
        probe: Probe,
        policy: CheckPolicy,
        verdict: Verdict,
        *,
        observe: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name = name
        self._probe = probe
        self._policy = policy
        self._verdict = verdict
        self._observe = observe
        self._rng = rng or random.Random()
        self._clock = clock
        self._healthy: bool | None = None
        self._streak = 0

    async def run(self) -> None:
        # Probes start at a fixed rate: a probe that waits out its timeout delays the
        # next one only by what exceeds the interval, so a hung node is declared
        # within about interval x threshold + timeout.
        while True:
            started = self._clock()
            try:
                ok, reason = await self.probe_once()
                self.record(ok, reason)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("health check of %s failed unexpectedly", self.name)
            await asyncio.sleep(max(0.0, self._next_interval() - (self._clock() - started)))

    async def probe_once(self) -> tuple[bool, str]:
        started = self._clock()
        try:
            async with asyncio.timeout(self._policy.timeout_s):
                await self._probe()
        except TimeoutError:
            return False, f"no answer within {self._policy.timeout_s:g} s"
        except ProbeFailed as exc:
            return False, str(exc)
        except (OSError, ConnectionError) as exc:
            return False, f"{type(exc).__name__}: {exc}"
        finally:
            if self._observe is not None:
                self._observe(self._clock() - started)
        return True, ""

    def record(self, ok: bool, reason: str) -> None:
        """Count one result; pass a verdict on when a threshold is reached."""
        if self._healthy is None:
            # Before the first verdict: a success counts at once, failures by threshold.
            if ok:
                self._flip(True, "")
                return
        elif ok == self._healthy:
            self._streak = 0
            if not ok:
                self._verdict(False, reason)  # keep the latest reason
            return
        self._streak += 1
        needed = self._policy.healthy_threshold if ok else self._policy.unhealthy_threshold
        if self._streak >= needed:
            self._flip(ok, reason)

    def fail_now(self, reason: str) -> None:
        """A definite failure (the process is gone or says so): no threshold."""
        self._flip(False, reason)

    def _flip(self, ok: bool, reason: str) -> None:
        self._healthy = ok
        self._streak = 0
        self._verdict(ok, reason)

    def _next_interval(self) -> float:
        p = self._policy
        return p.interval_s * (1 + self._rng.uniform(-p.jitter, p.jitter))

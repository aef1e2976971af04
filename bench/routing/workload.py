"""The seeded workload: long-tailed prompt and output lengths, Poisson arrivals.

Prompts are text of whitespace-separated numbers, one simulated token each (the
simulator counts words exactly; sglang-router refuses token-id prompts), distinct per
request with no shared prefixes; outputs are exact: the simulator generates
``max_tokens`` tokens, with ``ignore_eos`` sent as a real engine would need it, and
``model`` as sglang-router needs it. The same seed and rate give the same requests at the same offsets, so
every policy at one load sees the identical sequence.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

MODEL = "unitproxy-sim"  # the sim engine's served model


@dataclass(frozen=True)
class LogNormal:
    """Lognormal lengths, in tokens: ``median * exp(sigma * N(0, 1))``, clipped."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return max(self.low, min(self.high, round(value)))


@dataclass(frozen=True)
class Workload:
    prompt: LogNormal
    output: LogNormal

    def request(self, rng: random.Random) -> RequestSpec:
        return RequestSpec(self.prompt.draw(rng), self.output.draw(rng))

    def means(self, samples: int = 50_000, seed: int = 12345) -> tuple[float, float]:
        """Mean prompt and output length, from a large sample (the clipping has no closed form)."""
        rng = random.Random(seed)
        drawn = [self.request(rng) for _ in range(samples)]
        return (
            statistics.fmean(r.prompt_tokens for r in drawn),
            statistics.fmean(r.max_tokens for r in drawn),
        )


DEFAULT_WORKLOAD = Workload(
    prompt=LogNormal(median=200, sigma=1.0, low=8, high=4096),
    output=LogNormal(median=48, sigma=0.8, low=4, high=256),
)
# A smoke run keeps the drain after each run short: no output above 96 tokens.
QUICK_WORKLOAD = Workload(prompt=DEFAULT_WORKLOAD.prompt, output=LogNormal(48, 0.8, 4, 96))


@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt_tokens: int
    max_tokens: int

    def body(self, index: int) -> bytes:
        # Distinct words per request, so the simulated text differs; the count is what costs.
        words = " ".join(str((index + i) % 50_000) for i in range(self.prompt_tokens))
        request = {
            "model": MODEL,
            "prompt": words,
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        return json.dumps(request, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Arrival:
    index: int
    at_s: float  # offset from the start of the run
    spec: RequestSpec
    body: bytes


def poisson_arrivals(
    workload: Workload, rate_per_s: float, duration_s: float, seed: int, limit: int
) -> list[Arrival]:
    """Open-loop arrivals in ``[0, duration_s)``: a Poisson process conditioned on its
    count, ``rate * duration`` (at most ``limit``) uniform times, so every load offers
    what it says while keeping Poisson's bursts."""
    rng = random.Random(seed)
    count = min(limit, round(rate_per_s * duration_s))
    times = sorted(rng.uniform(0.0, duration_s) for _ in range(count))
    arrivals = []
    for index, at in enumerate(times):
        spec = workload.request(rng)
        arrivals.append(Arrival(index, at, spec, spec.body(index)))
    return arrivals


def request_stream(workload: Workload, seed: int) -> Iterator[tuple[RequestSpec, bytes]]:
    """An endless seeded stream of requests, for the closed loop."""
    rng = random.Random(seed)
    index = 0
    while True:
        spec = workload.request(rng)
        yield spec, spec.body(index)
        index += 1

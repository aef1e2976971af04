"""The seeded workloads: long-tailed prompt and output lengths, Poisson arrivals.

``plain`` (the default): prompts are text of whitespace-separated numbers, distinct per
request with no shared prefixes (the simulator counts a number of up to three digits as
one token; sglang-router refuses token-id prompts). Two workloads share prefixes, so
that where a request goes decides how much of its prompt is already in a unit's KV
cache (``engine.prefix_cache`` in the simulator):

``chat``      a few hundred conversations, each turn a request for the next answer: the
              whole history so far (system prompt, every user turn and answer) then the
              new user turn. The answers in the history are text of the length the
              previous turn asked for (the benchmark does not wait for the real one), so
              each turn's prompt extends the previous turn's.
``tenants``   many tenants, each with its own 1-4k-token system prompt and a popularity
              following Zipf's law (``tenants-hot``: tenant 0 sends half the requests);
              each request is the tenant's system prompt and a distinct user message.
``b2b``       the shape of llm-d's shared-prefix benchmark scaled to the sim fleet: 60
              tenants of equal popularity, each with a long shared prefix (3-6k tokens),
              a distinct 0.3k-token query (long-tailed up to 1.2k) per request; the
              loads (``--loads``) are the ramp of Poisson arrival rates.
``agent``     a multi-turn agent trace: sessions of a coding agent, every one opening with
              the same long tool-definition preamble (2k tokens, shared by all), then its
              own task; each turn appends the model's short action (a tool call) and the
              tool's long result (a file, a test log), so a session's context grows by
              hundreds of tokens a turn over up to 24 turns, while each answer is short.

Every prompt is sent as /v1/completions text (the chat rendered with role markers), so
every router, the peers' included, sees the same bytes. Outputs are exact: the
simulator generates ``max_tokens`` tokens, with ``ignore_eos`` sent as a real engine
would need it, and ``model`` as sglang-router needs it. The same seed and rate give the
same requests at the same offsets, so every policy at one load sees the identical
sequence.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.prefix_cache import PrefixCache
from engine.tokens import WORDS, TokenCounter

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


class Source(Protocol):
    """A seeded sequence of requests: ``draw`` is called with the index of each in turn."""

    def draw(self, rng: random.Random, index: int) -> tuple[RequestSpec, bytes]: ...


@dataclass(frozen=True)
class Workload:
    prompt: LogNormal
    output: LogNormal
    name: str = "plain"
    shares_prefixes: bool = False

    def request(self, rng: random.Random) -> RequestSpec:
        return RequestSpec(self.prompt.draw(rng), self.output.draw(rng))

    def source(self) -> Source:
        return _Plain(self)

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


BURST_LOW = 40 / 110  # a bursty run's low phase, as a share of its high one


def poisson_arrivals(
    workload: Workload | PrefixWorkload,
    rate_per_s: float,
    duration_s: float,
    seed: int,
    limit: int,
    burst_period_s: float = 0.0,
) -> list[Arrival]:
    """Open-loop arrivals in ``[0, duration_s)``: a Poisson process conditioned on its
    count, ``rate * duration`` (at most ``limit``) uniform times, so every load offers
    what it says while keeping Poisson's bursts. With ``burst_period_s``, the rate
    alternates every that many seconds between ``BURST_LOW`` x ``rate`` (first) and
    ``rate``: the same conditioning in each phase."""
    rng = random.Random(seed)
    times: list[float] = []
    period = burst_period_s if burst_period_s > 0 else duration_s
    start, phase = 0.0, 0
    while start < duration_s:
        end = min(duration_s, start + period)
        rate = rate_per_s * (BURST_LOW if burst_period_s > 0 and phase % 2 == 0 else 1.0)
        count = round(rate * (end - start))
        times += (rng.uniform(start, end) for _ in range(count))
        start, phase = end, phase + 1
    times = sorted(times)[:limit]
    source = workload.source()
    arrivals = []
    for index, at in enumerate(times):
        spec, body = source.draw(rng, index)
        arrivals.append(Arrival(index, at, spec, body))
    return arrivals


def ideal_hit_rate(
    arrivals: Sequence[Arrival], block_size: int = 16, from_s: float = 0.0
) -> float | None:
    """The fleet's prefix-cache hit rate had every unit's cache been one, unbounded:
    each prompt's leading full blocks (the simulator's, ``engine.prefix_cache``) that
    some earlier prompt of the run already had, less the last prompt token, as the
    simulator counts a hit; over the prompts that arrive from ``from_s`` on (the earlier
    ones fill the cache). No policy does better on a fleet whose caches start empty:
    what it misses beyond this is a prefix it sent where the prefix was not, or one the
    cache evicted. None for a run without prompts."""
    cache, count = PrefixCache(block_size, capacity=0), TokenCounter()
    seen: set[int] = set()
    queries = hits = 0
    for arrival in arrivals:
        prompt = json.loads(arrival.body)["prompt"]
        blocks = cache.text_blocks(prompt)
        held = next((i for i, block in enumerate(blocks) if block not in seen), len(blocks))
        seen.update(blocks)
        if arrival.at_s >= from_s:
            tokens = count(prompt)
            queries += tokens
            hits += max(0, min(held * block_size, tokens - 1))
    return hits / queries if queries else None


def request_stream(
    workload: Workload | PrefixWorkload, seed: int
) -> Iterator[tuple[RequestSpec, bytes]]:
    """An endless seeded stream of requests, for the closed loop."""
    rng = random.Random(seed)
    source = workload.source()
    index = 0
    while True:
        yield source.draw(rng, index)
        index += 1


class _Plain:
    def __init__(self, workload: Workload) -> None:
        self._workload = workload

    def draw(self, rng: random.Random, index: int) -> tuple[RequestSpec, bytes]:
        spec = self._workload.request(rng)
        return spec, spec.body(index)


# -- shared prefixes --------------------------------------------------------------------

VOCABULARY = tuple(f" {w}" for w in WORDS)  # one simulated token each


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(VOCABULARY, k=n))


def _body(prompt: str, max_tokens: int) -> bytes:
    request = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    return json.dumps(request, separators=(",", ":")).encode()


@dataclass(frozen=True)
class PrefixWorkload:
    """``chat`` or ``tenants`` (see the module docstring); lengths in tokens."""

    name: str
    output: LogNormal
    message: LogNormal  # a user turn
    conversations: int = 200  # chat
    turns: int = 10  # chat: then the conversation starts over, a new one
    system: tuple[int, int] = (100, 400)  # chat: its system prompt; tenants: 1000-4000
    tenants: int = 100
    zipf: float = 1.0
    hot_share: float = 0.0  # tenants-hot: tenant 0's share of the requests
    shares_prefixes: bool = True
    preamble: int = 0  # agent: tokens of the preamble every session opens with

    def source(self) -> Source:
        if self.name == "agent":
            return _Agent(self)
        return _Chat(self) if self.name == "chat" else _Tenants(self)

    def means(self, samples: int = 20_000, seed: int = 12345) -> tuple[float, float]:
        rng, source = random.Random(seed), self.source()
        drawn = [source.draw(rng, i)[0] for i in range(samples)]
        return (
            statistics.fmean(r.prompt_tokens for r in drawn),
            statistics.fmean(r.max_tokens for r in drawn),
        )


class _Chat:
    def __init__(self, w: PrefixWorkload) -> None:
        self._w = w
        self._histories: list[list[str]] = [[] for _ in range(w.conversations)]
        self._lengths = [0] * w.conversations  # tokens of each history
        self._turns = [0] * w.conversations

    def draw(self, rng: random.Random, index: int) -> tuple[RequestSpec, bytes]:
        w, c = self._w, rng.randrange(self._w.conversations)
        history = self._histories[c]
        if self._turns[c] >= w.turns or not history:
            n = rng.randint(*w.system)
            history[:] = [f"<|system|>\n{words(rng, n)}\n"]
            self._lengths[c], self._turns[c] = n + 4, 0
        n = w.message.draw(rng)
        history.append(f"<|user|>\n{words(rng, n)}\n<|assistant|>\n")
        self._lengths[c] += n + 8
        max_tokens = w.output.draw(rng)
        spec = RequestSpec(self._lengths[c], max_tokens)
        body = _body("".join(history), max_tokens)
        # the answer, as the next turn will resend it
        history.append(f"{words(rng, max_tokens)}\n")
        self._lengths[c] += max_tokens + 1
        self._turns[c] += 1
        return spec, body


class _Agent:
    """Agent sessions: the shared preamble, the session's task, then turns of an
    action (the previous answer, as long as it was asked to be) and a tool result."""

    def __init__(self, w: PrefixWorkload) -> None:
        self._w = w
        rng = random.Random(11)  # the preamble is the same whatever the run's seed
        self._preamble = f"<|system|>\ntools:{words(rng, w.preamble)}\n"
        self._histories: list[list[str]] = [[] for _ in range(w.conversations)]
        self._lengths = [0] * w.conversations
        self._turns = [0] * w.conversations

    def draw(self, rng: random.Random, index: int) -> tuple[RequestSpec, bytes]:
        w, c = self._w, rng.randrange(self._w.conversations)
        history = self._histories[c]
        if self._turns[c] >= w.turns or not history:
            n = rng.randint(*w.system)  # the task
            history[:] = [self._preamble, f"<|user|>\ntask:{words(rng, n)}\n"]
            self._lengths[c], self._turns[c] = w.preamble + 4 + n + 5, 0
        else:  # the tool's result for the last action
            n = w.message.draw(rng)
            history.append(f"<|tool|>\n{words(rng, n)}\n")
            self._lengths[c] += n + 4
        history.append("<|assistant|>\n")
        max_tokens = w.output.draw(rng)
        spec = RequestSpec(self._lengths[c] + 4, max_tokens)
        body = _body("".join(history), max_tokens)
        history.append(f"{words(rng, max_tokens)}\n")  # the action, as the next turn resends it
        self._lengths[c] += 4 + max_tokens + 1
        self._turns[c] += 1
        return spec, body


class _Tenants:
    def __init__(self, w: PrefixWorkload) -> None:
        self._w = w
        rng = random.Random(7)  # the tenants are the same whatever the run's seed
        lengths = [rng.randint(*w.system) for _ in range(w.tenants)]
        self._system = [
            (f"<|system|>\ntenant {t}:{words(rng, n)}\n", n + 7) for t, n in enumerate(lengths)
        ]
        weights = [1 / (k + 1) ** w.zipf for k in range(w.tenants)]
        if w.hot_share:
            rest = sum(weights[1:])
            weights = [rest * w.hot_share / (1 - w.hot_share), *weights[1:]]
        self._weights = list(itertools.accumulate(weights))

    def draw(self, rng: random.Random, index: int) -> tuple[RequestSpec, bytes]:
        w = self._w
        tenant = rng.choices(range(w.tenants), cum_weights=self._weights)[0]
        system, tokens = self._system[tenant]
        n = w.message.draw(rng)
        prompt = f"{system}<|user|>\n{words(rng, n)}\n<|assistant|>\n"
        max_tokens = w.output.draw(rng)
        return RequestSpec(tokens + n + 8, max_tokens), _body(prompt, max_tokens)


OUTPUT = DEFAULT_WORKLOAD.output
CHAT = PrefixWorkload("chat", OUTPUT, LogNormal(median=60, sigma=0.7, low=4, high=400))
TENANTS = PrefixWorkload(
    "tenants", OUTPUT, LogNormal(median=80, sigma=0.8, low=4, high=800), system=(1000, 4000)
)
TENANTS_HOT = PrefixWorkload(
    "tenants-hot",
    OUTPUT,
    TENANTS.message,
    system=TENANTS.system,
    hot_share=0.5,
)
B2B = PrefixWorkload(
    "b2b",
    OUTPUT,
    LogNormal(median=300, sigma=0.5, low=50, high=1200),
    system=(3000, 6000),
    tenants=60,
    zipf=0.0,
)
AGENT = PrefixWorkload(
    "agent",
    LogNormal(median=60, sigma=0.6, low=8, high=300),  # an action: a tool call
    LogNormal(median=250, sigma=0.9, low=20, high=2000),  # a tool's result
    conversations=48,
    turns=24,
    system=(50, 300),  # the session's task
    preamble=2000,
)
WORKLOADS: dict[str, Workload | PrefixWorkload] = {
    "plain": DEFAULT_WORKLOAD,
    "chat": CHAT,
    "tenants": TENANTS,
    "tenants-hot": TENANTS_HOT,
    "b2b": B2B,
    "agent": AGENT,
}


def quick(workload: Workload | PrefixWorkload) -> Workload | PrefixWorkload:
    """The same, with no output above 96 tokens: a smoke run's drain stays short."""
    return dataclasses.replace(workload, output=LogNormal(48, 0.8, 4, 96))

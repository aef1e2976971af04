"""The planner's workload: arrivals with prompt and output lengths, and shared prefixes.

Lengths are a fixed number of tokens or a distribution, written as text:

    512                    every request 512 tokens
    uniform:LO:HI          uniform integers in [LO, HI]
    lognormal:MEAN:SIGMA   lognormal with this mean (not median) and shape (the sigma of
                           the log), optionally :MAX to cut its tail
    exponential:MEAN       exponential with this mean

Every draw is at least 1 token. Arrivals are Poisson at a rate, or read from a trace
file (JSON lines, one request each: ``{"at_s": 0.25, "prompt_tokens": 812,
"output_tokens": 120}``, optionally ``"prefix_group"`` (any string or number) and
``"prefix_tokens"`` (how many leading tokens of the prompt it shares with its group).

Prefix sharing: with ``share`` > 0 each request belongs to one of ``groups`` groups,
picked at random, and the first ``share`` of its prompt is its group's prefix, so two
requests of a group share the shorter of their two prefixes, as prompts that open with
the same system prompt and tools do.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Lengths(Protocol):
    def draw(self, rng: random.Random) -> int: ...

    @property
    def mean(self) -> float: ...


@dataclass(frozen=True)
class Fixed:
    value: int

    def draw(self, rng: random.Random) -> int:
        return self.value

    @property
    def mean(self) -> float:
        return float(self.value)


@dataclass(frozen=True)
class Uniform:
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2


@dataclass(frozen=True)
class LogNormal:
    mean_tokens: float
    sigma: float
    high: int | None = None

    def draw(self, rng: random.Random) -> int:
        mu = math.log(self.mean_tokens) - self.sigma**2 / 2
        value = max(1, round(rng.lognormvariate(mu, self.sigma)))
        return value if self.high is None else min(self.high, value)

    @property
    def mean(self) -> float:
        return self.mean_tokens  # before the cut at high


@dataclass(frozen=True)
class Exponential:
    mean_tokens: float

    def draw(self, rng: random.Random) -> int:
        return max(1, round(rng.expovariate(1.0 / self.mean_tokens)))

    @property
    def mean(self) -> float:
        return self.mean_tokens


def parse_lengths(spec: str) -> Lengths:
    """``512``, ``uniform:LO:HI``, ``lognormal:MEAN:SIGMA[:MAX]`` or ``exponential:MEAN``;
    ValueError says what is wrong."""
    kind, *args = spec.strip().split(":")
    try:
        numbers = [float(a) for a in args]
        if not args and kind.isdigit() and int(kind) >= 1:
            return Fixed(int(kind))
        if kind == "uniform" and len(numbers) == 2 and 1 <= numbers[0] <= numbers[1]:
            return Uniform(int(numbers[0]), int(numbers[1]))
        if kind == "lognormal" and len(numbers) in (2, 3) and numbers[0] >= 1 and numbers[1] >= 0:
            high = int(numbers[2]) if len(numbers) == 3 else None
            if high is None or high >= 1:
                return LogNormal(numbers[0], numbers[1], high)
        if kind == "exponential" and len(numbers) == 1 and numbers[0] >= 1:
            return Exponential(numbers[0])
    except ValueError:
        pass
    raise ValueError(
        f"{spec!r}: want a number of tokens (at least 1), uniform:LO:HI, "
        "lognormal:MEAN:SIGMA[:MAX] or exponential:MEAN"
    )


@dataclass(frozen=True, slots=True)
class Request:
    at_s: float  # arrival, from the start of the traffic
    prompt_tokens: int
    output_tokens: int
    group: int = -1  # its prefix group (-1: none)
    prefix_tokens: int = 0  # leading prompt tokens shared with its group


@dataclass(frozen=True)
class Traffic:
    """Poisson arrivals at ``rate_per_s`` for ``duration_s``, lengths drawn per request."""

    rate_per_s: float
    duration_s: float
    prompt: Lengths
    output: Lengths
    prefix_share: float = 0.0
    prefix_groups: int = 1

    def requests(self, seed: int) -> list[Request]:
        rng = random.Random(seed)
        out: list[Request] = []
        at = rng.expovariate(self.rate_per_s)
        share, groups = self.prefix_share, self.prefix_groups
        while at < self.duration_s:
            prompt = self.prompt.draw(rng)
            output = self.output.draw(rng)
            if share > 0:
                out.append(Request(at, prompt, output, rng.randrange(groups), int(share * prompt)))
            else:
                out.append(Request(at, prompt, output))
            at += rng.expovariate(self.rate_per_s)
        return out


class TraceError(ValueError):
    """A trace file that cannot be read; says the file and line."""


def read_trace(path: Path) -> list[Request]:
    """The requests of a JSON-lines trace, sorted by arrival, times from the first."""
    groups: dict[str, int] = {}
    requests = sorted(_trace_lines(path, groups), key=lambda r: r.at_s)
    if not requests:
        raise TraceError(f"{path}: no requests")
    start = requests[0].at_s
    return [
        Request(r.at_s - start, r.prompt_tokens, r.output_tokens, r.group, r.prefix_tokens)
        for r in requests
    ]


def _trace_lines(path: Path, groups: dict[str, int]) -> Iterator[Request]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror}") from exc
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, output = int(row["prompt_tokens"]), int(row["output_tokens"])
            at = float(row["at_s"])
            group = row.get("prefix_group")
            shared = int(row.get("prefix_tokens", 0))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TraceError(
                f"{path}:{number}: want an object with at_s, prompt_tokens, output_tokens "
                f"(and optionally prefix_group, prefix_tokens): {exc!r}"
            ) from exc
        if prompt < 1 or output < 1 or not math.isfinite(at) or not 0 <= shared <= prompt:
            raise TraceError(f"{path}:{number}: lengths must be at least 1, at_s a number")
        index = -1 if group is None else groups.setdefault(str(group), len(groups))
        yield Request(at, prompt, output, index, shared if index >= 0 else 0)

"""A unit's shape measured from the unit itself: ``unitproxy plan --measure URL``.

A short calibration load is driven against a running unit's sidecar (its HTTP port)
and the simulator's model knobs are fitted to what it does, so that the planner
simulates units of that shape rather than of the ``--sim-*`` knobs:

1. slots (``max_num_seqs``): as many streams at once as the unit admits (its
   ``capacity``, at most ``MAX_STREAMS``), ``GET /load`` polled meanwhile: the most
   requests its engine reported running;
2. decode (``decode_step_ms``, ``decode_ms_per_seq``): batches of 1 to ``slots``
   streams started together, short prompts; each stream's time per output token after
   its first few (the batch decoding together), its median per batch, and a line
   through them by least squares: time per token = step + per sequence x batch;
3. prefill (``prefill_ms_per_token``): one request at a time on the idle unit, prompts
   of 32 to about 1,000 tokens (their count as the unit's usage says), one output
   token each; a line through the times against the prompt tokens: its slope is the
   prefill cost per token (the rest, the one decode step and the round trip, is the
   intercept).

Each prompt starts with a word of its own, so no prefix cache holds any of it. What
is not measured (``max_num_batched_tokens``, the prefix cache's size) stays as the
settings give it. The unit should be idle, and nothing else sent to it meanwhile:
another client's requests would count as this one's batch.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

MAX_STREAMS = 64  # the most streams sent at once to find the slots
SLOT_TOKENS = 48  # output of each stream that finds the slots
DECODE_TOKENS = 40  # output of each stream that times decoding
SKIP_TOKENS = 4  # of those, the first ones left out (the batch still starting)
PREFILL_WORDS = (16, 128, 256, 384, 512, 768)  # prompt lengths timed, in words
REPEATS = 3  # of each prefill length
POLL_S = 0.01  # GET /load while the slots fill


class MeasureError(Exception):
    """The unit could not be measured (unreachable, or its answers made no sense)."""


@dataclass(frozen=True)
class Shape:
    """The knobs fitted, and what they came from."""

    max_num_seqs: int
    prefill_ms_per_token: float
    decode_step_ms: float
    decode_ms_per_seq: float
    capacity: int  # the unit's admission limit, as it reports it
    decode_points: list[tuple[int, float]]  # (batch, median ms per token)
    prefill_points: list[tuple[int, float]]  # (prompt tokens, ms)
    wall_s: float

    def knobs(self) -> dict[str, Any]:
        """The engine.sim settings this shape sets."""
        return {
            "max_num_seqs": self.max_num_seqs,
            "prefill_ms_per_token": self.prefill_ms_per_token,
            "decode_step_ms": self.decode_step_ms,
            "decode_ms_per_seq": self.decode_ms_per_seq,
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares through (x, y): (intercept, slope); slope 0 for one distinct x."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


class _Unit:
    def __init__(self, session: aiohttp.ClientSession, url: str, api_key: str | None):
        self.session = session
        self.url = url.rstrip("/")
        self.headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self.model: str | None = None

    async def load(self) -> dict[str, Any]:
        async with self.session.get(f"{self.url}/load") as resp:
            if resp.status != 200:
                raise MeasureError(f"GET {self.url}/load answered {resp.status}")
            data: dict[str, Any] = await resp.json()
            return data

    def body(self, words: int, max_tokens: int, stream: bool) -> dict[str, Any]:
        prompt = secrets.token_hex(8) + " " + " ".join(f"w{i % 97}" for i in range(words))
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
        body["ignore_eos"] = True  # every token asked for (engines that stop early)
        if self.model is not None:
            body["model"] = self.model
        return body

    async def stream(self, words: int, max_tokens: int) -> list[float]:
        """One streamed completion; the times its token events came (monotonic)."""
        times: list[float] = []
        url = f"{self.url}/v1/completions"
        body = self.body(words, max_tokens, True)
        async with self.session.post(url, json=body, headers=self.headers) as resp:
            if resp.status != 200:
                raise MeasureError(f"POST {url} answered {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                text = raw.strip()
                if not text.startswith(b"data:") or text == b"data: [DONE]":
                    continue
                event = json.loads(text[5:])
                if event.get("choices"):
                    times.append(time.monotonic())
        return times

    async def once(self, words: int) -> tuple[int, float]:
        """One request of one output token: (its prompt tokens, its time in ms)."""
        url = f"{self.url}/v1/completions"
        body = self.body(words, 1, False)
        start = time.monotonic()
        async with self.session.post(url, json=body, headers=self.headers) as resp:
            data = await resp.json(content_type=None)
            took = (time.monotonic() - start) * 1000
            if resp.status != 200:
                raise MeasureError(f"POST {url} answered {resp.status}: {data}")
        tokens = int((data.get("usage") or {}).get("prompt_tokens") or 0)
        if tokens <= 0:
            raise MeasureError(f"POST {url}: no usage.prompt_tokens in the answer")
        return tokens, took


async def _slots(unit: _Unit, streams: int) -> int:
    """The most requests the unit's engine reported running under ``streams`` at once."""
    most = 0
    running = [asyncio.ensure_future(unit.stream(8, SLOT_TOKENS)) for _ in range(streams)]
    try:
        while not all(task.done() for task in running):
            most = max(most, int((await unit.load()).get("running") or 0))
            await asyncio.sleep(POLL_S)
        for task in running:
            task.result()  # a failure surfaces
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return most


async def _per_token_ms(unit: _Unit, batch: int) -> float:
    """The median over ``batch`` streams started together of each one's ms per token
    after its first ``SKIP_TOKENS``."""
    runs = await asyncio.gather(*(unit.stream(8, DECODE_TOKENS) for _ in range(batch)))
    each = []
    for times in runs:
        if len(times) < SKIP_TOKENS + 3:
            raise MeasureError(f"a stream of {DECODE_TOKENS} tokens brought {len(times)}")
        later = times[SKIP_TOKENS:]
        each.append((later[-1] - later[0]) * 1000 / (len(later) - 1))
    return statistics.median(each)


def _batches(slots: int) -> list[int]:
    """Batch sizes from 1 to ``slots``, about five of them."""
    sizes = {1, slots, max(1, slots // 2), max(1, slots // 4), max(1, (3 * slots) // 4)}
    return sorted(sizes)


async def measure(url: str, api_key: str | None = None, timeout_s: float = 120.0) -> Shape:
    """Drive the calibration load against the sidecar at ``url``; the fitted shape."""
    started = time.monotonic()
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=client_timeout) as session:
            unit = _Unit(session, url, api_key)
            report = await unit.load()
            if report.get("state") != "SERVING":
                raise MeasureError(f"the unit at {url} is {report.get('state')}, not SERVING")
            models = report.get("models") or []
            unit.model = models[0] if models else None
            capacity = int(report.get("capacity") or 0)
            streams = min(capacity, MAX_STREAMS) if capacity > 0 else MAX_STREAMS
            slots = await _slots(unit, streams)
            if slots <= 0:
                raise MeasureError(f"the unit at {url} never reported a request running")
            decode = [(b, await _per_token_ms(unit, b)) for b in _batches(slots)]
            prefill = []
            for words in PREFILL_WORDS:  # the median of each length: one slow answer is noise
                timed = [await unit.once(words) for _ in range(REPEATS)]
                prefill.append((timed[0][0], statistics.median(ms for _, ms in timed)))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise MeasureError(f"measuring {url}: {exc!r}") from exc
    step, per_seq = line([(float(b), ms) for b, ms in decode])
    _, per_token = line([(float(t), ms) for t, ms in prefill])
    return Shape(
        max_num_seqs=slots,
        prefill_ms_per_token=_round(max(0.0, per_token)),
        decode_step_ms=_round(max(0.0, step)),
        decode_ms_per_seq=_round(max(0.0, per_seq)),
        capacity=capacity,
        decode_points=[(b, round(ms, 3)) for b, ms in decode],
        prefill_points=[(t, round(ms, 3)) for t, ms in prefill],
        wall_s=round(time.monotonic() - started, 2),
    )


def _round(value: float) -> float:
    return 0.0 if value == 0 or not math.isfinite(value) else float(f"{value:.4g}")

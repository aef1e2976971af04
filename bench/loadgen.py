"""The load generator the benches share: one request of each kind, and one closed-loop
measured window.

The client is this process: asyncio (on uvloop where the bench runs it), one aiohttp
session (or one gRPC channel) per run, C workers that each send the next request when
the last finished. SSE bodies are not split into lines: the client counts ``data: ``
markers in the raw pieces as they arrive (TTFT is the first piece that holds one) and
checks the end of the stream once (every chunk, finish_reason "length", then
``data: [DONE]``), so the client's own cost per chunk stays small. Every response is
checked; only requests that finish inside the window count (with all their chunks);
errors count over the whole run.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc

from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc

REQUEST_TIMEOUT_S = 10.0  # one request, end to end; also the drain bound after a window
JSON_HEADERS = {"Content-Type": "application/json"}
DATA = b"data: "
DONE = b"data: [DONE]"
TAIL_BYTES = 2048  # the end of a stream kept for its checks
FINISH_LENGTH = re.compile(rb'"finish_reason"\s*:\s*"length"')

# Every timestamp: uvloop's loop.time() has only millisecond resolution.
now = time.perf_counter


# -- one request ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request: time to first chunk, chunks seen, or what was wrong.

    ``chunks`` are token deltas: SSE events, or the tokens the gRPC messages carried;
    ``messages`` what came on the wire (gRPC merges deltas while the reader is behind).
    """

    ttft_s: float = 0.0
    chunks: int = 0
    messages: int = 0
    error: str | None = None


RequestFn = Callable[[], Awaitable[Outcome]]


async def _http_error(resp: aiohttp.ClientResponse) -> Outcome:
    text = (await resp.read())[:80].decode(errors="replace")
    return Outcome(error=f"http {resp.status} {text}")


async def complete(session: aiohttp.ClientSession, url: str, body: bytes, want: int) -> Outcome:
    """A non-streaming completion; its TTFT is the time to the whole response."""
    sent = now()
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        if resp.status != 200:
            return await _http_error(resp)
        raw = await resp.read()
    ttft = now() - sent
    data = json.loads(raw)
    got = data["usage"]["completion_tokens"]
    choice = data["choices"][0]
    if got != want or choice["finish_reason"] != "length" or not choice["text"]:
        return Outcome(error=f"completion: {got} tokens, finish {choice['finish_reason']!r}")
    return Outcome(ttft, 0)


async def embed(session: aiohttp.ClientSession, url: str, body: bytes, want: int) -> Outcome:
    """A non-streamed embedding of one input; its TTFT is the time to the whole response."""
    sent = now()
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        if resp.status != 200:
            return await _http_error(resp)
        raw = await resp.read()
    ttft = now() - sent
    data = json.loads(raw)["data"]
    if len(data) != 1 or len(data[0]["embedding"]) != want:
        return Outcome(error=f"embeddings: {len(data)} vectors, not 1 of {want} numbers")
    return Outcome(ttft, 0)


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: bytes, want: int
) -> Outcome:
    """A streamed completion: counts SSE data events in the raw pieces, [DONE] aside."""
    sent = now()
    ttft, events, carry, tail = 0.0, 0, b"", b""
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        if resp.status != 200:
            return await _http_error(resp)
        async for piece in resp.content.iter_any():
            # A marker split between pieces is found in carry + piece, and only there:
            # the carry is too short to hold a whole one.
            joined = carry + piece
            found = joined.count(DATA)
            if found and not events:
                ttft = now() - sent
            events += found
            carry = joined[1 - len(DATA) :]
            tail = (tail + piece)[-TAIL_BYTES:]
    return _check_stream(ttft, events - 1, tail, want)


def _check_stream(ttft: float, chunks: int, tail: bytes, want: int) -> Outcome:
    end = tail.rstrip()
    if not end.endswith(DONE):
        return Outcome(error=f"stream: no [DONE] at the end ({end[-60:]!r})")
    if chunks != want:
        return Outcome(error=f"stream: {chunks} chunks, want {want}")
    last = end[: -len(DONE)].rstrip().rsplit(DATA, 1)[-1]
    if not FINISH_LENGTH.search(last):
        return Outcome(error=f"stream: last chunk without finish_reason 'length' ({last[:80]!r})")
    return Outcome(ttft, chunks, chunks)


async def generate(
    stub: inference_pb2_grpc.InferenceStub, request: inference_pb2.GenerateRequest, want: int
) -> Outcome:
    """One gRPC Generate stream: counts messages and the tokens they carry, checks the
    last one and the status. Token deltas that waited on a write go out merged in one
    message, so a stream has up to ``want`` messages and exactly ``want`` tokens."""
    sent = now()
    ttft, tokens, messages = 0.0, 0, 0
    last: inference_pb2.GenerateChunk | None = None
    try:
        async for chunk in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            if messages == 0:
                ttft = now() - sent
            messages += 1
            tokens += len(chunk.token_ids)
            last = chunk
    except grpc.aio.AioRpcError as exc:
        return Outcome(error=f"grpc {exc.code().name}: {exc.details()}"[:120])
    if tokens != want or last is None or messages > want:
        return Outcome(error=f"grpc: {tokens} tokens in {messages} messages, want {want}")
    if last.finish_reason != "length" or last.usage.completion_tokens != want:
        return Outcome(error=f"grpc: last finish_reason {last.finish_reason!r}")
    return Outcome(ttft, tokens, messages)


# -- a client for one run -------------------------------------------------------------


@asynccontextmanager
async def http_client(
    base_url: str, body: dict[str, Any], concurrency: int
) -> AsyncIterator[RequestFn]:
    """POST ``body`` to /v1/completions (streamed when it says so), ``concurrency``
    connections at most."""
    data, url, want = json.dumps(body).encode(), f"{base_url}/v1/completions", body["max_tokens"]
    send = stream_completion if body.get("stream") else complete
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield lambda: send(session, url, data, want)


@asynccontextmanager
async def embeddings_client(
    base_url: str, body: dict[str, Any], concurrency: int, dim: int
) -> AsyncIterator[RequestFn]:
    """POST ``body`` to /v1/embeddings (not streamed), ``concurrency`` connections at most;
    each answer must hold one vector of ``dim`` numbers."""
    data, url = json.dumps(body).encode(), f"{base_url}/v1/embeddings"
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield lambda: embed(session, url, data, dim)


@asynccontextmanager
async def grpc_client(target: str, prompt: str, max_tokens: int) -> AsyncIterator[RequestFn]:
    # One channel (one HTTP/2 connection) carries all workers' streams.
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt=prompt, sampling=inference_pb2.SamplingParams(max_tokens=max_tokens)
        )
        yield lambda: generate(stub, request, max_tokens)


# -- one run: closed loop, warm-up, measured window -----------------------------------


@dataclass(slots=True)
class Tally:
    """What one run saw. Successes count only when they finish inside the window."""

    window_start: float
    window_end: float
    max_requests: int
    started: int = 0
    requests: int = 0
    chunks: int = 0
    messages: int = 0
    ttfts: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    def record(self, outcome: Outcome, finished_at: float) -> None:
        if outcome.error is not None:
            self.errors[outcome.error] += 1
        elif self.window_start <= finished_at <= self.window_end:
            self.requests += 1
            self.chunks += outcome.chunks
            self.messages += outcome.messages
            self.ttfts.append(outcome.ttft_s)


async def worker(request: RequestFn, tally: Tally) -> None:
    while now() < tally.window_end and tally.started < tally.max_requests:
        tally.started += 1
        try:
            outcome = await request()
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError) as exc:
            outcome = Outcome(error=f"{type(exc).__name__}: {exc}"[:120])
        tally.record(outcome, now())


CpuReader = Callable[[], dict[str, float]]  # CPU seconds used so far, by process role


@dataclass(frozen=True)
class Window:
    """One measured window: counts, TTFTs in seconds, CPU seconds by role."""

    window_s: float
    requests: int
    chunks: int
    messages: int
    ttfts: list[float]
    cpu_s: dict[str, float]
    errors: dict[str, int]


async def measure(
    request: RequestFn,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    max_requests: int,
    read_cpu: CpuReader,
) -> Window:
    start = now() + warmup_s
    tally = Tally(start, start + duration_s, max_requests)
    workers = [asyncio.create_task(worker(request, tally)) for _ in range(concurrency)]
    try:
        await asyncio.sleep(start - now())
        t0, cpu0 = now(), read_cpu()
        # Returns early only when the request cap stopped every worker.
        await asyncio.wait(workers, timeout=tally.window_end - now())
        t1, cpu1 = now(), read_cpu()
        await _drain(workers, REQUEST_TIMEOUT_S)
    finally:
        await _cancel(workers)
    return Window(
        window_s=t1 - t0,
        requests=tally.requests,
        chunks=tally.chunks,
        messages=tally.messages,
        ttfts=tally.ttfts,
        cpu_s={role: cpu1[role] - cpu0[role] for role in cpu0},
        errors=dict(tally.errors),
    )


async def _drain(workers: list[asyncio.Task[None]], grace_s: float) -> None:
    """Let requests in flight at the window's end finish (uncounted), within a bound."""
    await asyncio.wait(workers, timeout=grace_s)
    for task in workers:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]  # a bug in this benchmark


async def _cancel(workers: list[asyncio.Task[None]]) -> None:
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)


async def outstanding_when_idle(http_url: str, timeout_s: float) -> int | None:
    """A sidecar's outstanding count, polled until 0 or ``timeout_s``; None if unreadable.
    Anything but 0 once the load stopped is a leak."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        while True:
            try:
                async with session.get(f"{http_url}/load") as resp:
                    outstanding = int((await resp.json())["outstanding"])
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                return None
            if outstanding == 0 or loop.time() > deadline:
                return outstanding
            await asyncio.sleep(0.05)


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]

"""The load: the scenarios, and a client for one run of each (bench/loadgen.py makes
the requests and measures the window)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from bench import loadgen
from bench.loadgen import RequestFn, measure

__all__ = ["SCENARIOS", "Scenario", "measure", "open_client"]

PROMPT = "Benchmark the router overhead with this short prompt"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    decode_step_ms: (
        float  # the sim engine's per-token step: scenarios that share it share a backend
    )
    protocol: str  # "http" or "grpc"
    stream: bool
    max_tokens: int


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("stream-0ms", "SSE POST /v1/completions, 64 tokens, 0 ms/token", 0.0, "http", True, 64),
        Scenario("stream-5ms", "SSE POST /v1/completions, 64 tokens, 5 ms/token", 5.0, "http", True, 64),
        Scenario("completions", "POST /v1/completions, max_tokens 16, not streamed", 0.0, "http", False, 16),
        Scenario("grpc", "gRPC Inference/Generate, 64 tokens, 0 ms/token", 0.0, "grpc", True, 64),
        Scenario("embeddings", "POST /v1/embeddings, one short input, not streamed", 0.0, "http", False, 0),
    )
}  # fmt: skip
EMBEDDING_DIM = 384  # the simulator's default (--sim-embedding-dim)


def open_client(
    scenario: Scenario, address: str, model: str, concurrency: int
) -> AbstractAsyncContextManager[RequestFn]:
    """``address``: the base HTTP URL, or the gRPC target for the grpc scenario."""
    if scenario.protocol == "grpc":
        return loadgen.grpc_client(address, PROMPT, scenario.max_tokens)
    if scenario.name == "embeddings":
        body = {"model": model, "input": PROMPT}
        return loadgen.embeddings_client(address, body, concurrency, EMBEDDING_DIM)
    # "model" is in every body: sglang-router refuses a completion without one.
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": scenario.max_tokens,
        "stream": scenario.stream,
    }
    return loadgen.http_client(address, body, concurrency)

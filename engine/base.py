"""The engine interface the sidecar drives: one small async contract, three kinds.

An engine is started and stopped by its owner (``async with engine``), generates
token deltas for one request at a time per call (``generate``), counts the tokens of
a text (``count_tokens``), says whether it is alive (``check_health``) and how busy it
is (``stats``). Cancelling or closing the iterator returned by ``generate`` aborts the
request inside the engine.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from engine.frontend import OpenAIFrontend
    from engine.kv_events import KVEvents


@dataclass(frozen=True, slots=True)
class SamplingParams:
    # None: the engine's default; 0: no output, finish_reason "length" at once (a
    # resumed request whose delivered output used up its max_tokens)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation. Exactly one of prompt, prompt_token_ids and messages is set.

    For messages, as vLLM's chat fields: ``add_generation_prompt`` opens the
    assistant's turn after them; ``continue_final_message`` leaves the final message
    open and continues it instead (a partial assistant message, say).
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # None: the engine's model; else another of its ``served_models()`` (an adapter)
    model: str | None = None
    # Prefill only (embeddings, scores): no output; one last delta, finish_reason
    # "stop", once the prompt is prefilled.
    pooling: bool = False
    # Its priority class inside the engine, as vLLM's priority: lower goes first
    # (PRIORITY_RANK: 0 interactive, 1 standard, 2 batch).
    priority: int = 1
    # W3C trace context (traceparent, tracestate) of the request's span in the sidecar:
    # an engine that traces (vLLM with its otlp_traces_endpoint) makes its spans its
    # children. None: not traced.
    trace_headers: Mapping[str, str] | None = None


# A priority class's value for an engine (EngineRequest.priority; vLLM's lower-first).
PRIORITY_RANK = {"interactive": 0, "standard": 1, "batch": 2}


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output since the previous delta. The last delta has a finish_reason."""

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int  # cumulative, including this delta
    finish_reason: str | None = None  # "stop" | "length" | "abort"


# The named metric (LoadReport.named_metrics) under which a unit reports its engine's
# slots: the requests it runs at once (``Engine.slots``).
ENGINE_SLOTS = "engine_slots"


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = -1.0  # 0..1, -1 when unknown
    prefix_cache_hit_rate: float = -1.0  # 0..1, -1 when unknown
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of which were cached
    prefix_cache_resets: int = 0  # times the prefix cache was emptied, since start
    # Any other signal, by name: it reaches every gateway in the unit's load report
    # (LoadReport.named_metrics, bounded there) with no new field anywhere.
    named_metrics: dict[str, float] = field(default_factory=dict, hash=False)


class Engine(abc.ABC):
    """Base of every engine kind. Subclasses implement the six abstract methods."""

    #: the model name served, as /v1/models and responses show it
    model_name: str
    #: true for the simulator, so it can say so everywhere it shows up
    is_simulator: bool = False
    #: the engine's own OpenAI layer, when it has one: the HTTP routes go there whole
    frontend: OpenAIFrontend | None = None

    def served_models(self) -> tuple[str, ...]:
        """Every model name a request may give: ``model_name`` first, then what else
        the engine serves (LoRA adapters, an upstream's other models)."""
        return (self.model_name,)

    def takes_priority(self) -> bool:
        """Whether the engine schedules by ``EngineRequest.priority`` (and, with its own
        OpenAI layer, a body's ``priority``); false: it is not passed."""
        return False

    def slots(self) -> int | None:
        """Requests the engine runs at once, its batch (the simulator's and vLLM's
        max_num_seqs): more wait in its own queue. None: not known (yet)."""
        return None

    def subscribe_kv_events(self, listener: KVEvents) -> bool:
        """Tell ``listener`` of every change of the engine's prefix cache, as vLLM's KV
        cache events (``engine.kv_events``); False when this engine tells none."""
        return False

    def prompt_blocks(self, request: EngineRequest) -> tuple[str, list[tuple[int, int]]]:
        """The text the engine prefills for ``request`` and each full KV block of it:
        the block's hash (as its KV cache events name it) and where in that text it
        ends. ("", []) when the engine cannot tell (a prompt of token ids, say)."""
        return "", []

    async def find_prompt_blocks(self, request: EngineRequest) -> tuple[str, list[tuple[int, int]]]:
        """``prompt_blocks``, for an engine that needs its tokenizer to tell (vLLM): it
        runs off the event loop there."""
        return self.prompt_blocks(request)

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        """Stream deltas for ``request``; raises engine.errors.EngineError on failure."""

    @abc.abstractmethod
    async def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` is to this engine (no special tokens added)."""

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Return if the engine is alive; raise engine.errors.EngineError if not."""

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

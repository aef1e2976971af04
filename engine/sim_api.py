"""The simulator's own layer for the routes beyond chat and completions, with vLLM's bodies.

The Responses API (``POST /v1/responses``, streamed with OpenAI's event types or
whole; ``GET /v1/responses/{id}``, streamed for a streamed background response as
vLLM's, and ``.../cancel`` for the responses it keeps) and the pooling routes (``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``,
``/rerank``). Every request runs in the simulated engine: a response generates as a chat
request does (its input items are the messages); a pooling input is prefilled (it takes
a slot, pays the prefill cost, uses the prefix cache) and makes no output.

The vectors are a function of the engine seed and the input alone: each word of the
input adds a sparse random vector of its own, and the whole text a small dense one, so
equal inputs give equal vectors and texts that share words point alike (cosine scores
rank a document that shares the query's words above one that does not). Scores and
rerank relevance are the cosine of the two vectors, as vLLM scores with an embedding
model.

What the simulator cannot honour (tools, structured output, reasoning, logprobs, images,
files) is a 400 naming the field; the audio routes are a 400 saying that it has no
transcription model.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import re
import struct
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.base import ChatMessage, EngineRequest, SamplingParams, TokenDelta
from engine.errors import EngineError, InvalidRequest, NotFound, invalid_fields
from engine.frontend import FrontendReply, FrontendRequest, FrontendRoute, OpenAIFrontend, Tokens
from engine.settings import SimSettings

if TYPE_CHECKING:
    from engine.sim import SimEngine

ROUTES: frozenset[FrontendRoute] = frozenset(
    {"responses", "responses_retrieve", "responses_cancel", "embeddings", "pooling",
     "classify", "score", "rerank", "transcriptions", "translations"}
)  # fmt: skip
UNSERVED = "not supported by the simulator (engines vllm and openai serve it)"
MAX_UINT32 = 2**32 - 1
CLASS_LABELS = ("LABEL_0", "LABEL_1")

_WORD = re.compile(r"\w+")
_SPARSE = 8  # positions each word adds to
_DENSE_WEIGHT = 0.25  # of the whole text's dense part, against one word's


def sim_model_card(name: str) -> dict[str, Any]:
    """A model as /v1/models lists it: it says it is a simulator."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "unitproxy-simulator",
        "root": name,
        "parent": None,
        "max_model_len": None,  # no context limit
        "permission": [],
        "simulator": True,
        "description": "unitproxy's simulated engine: generates synthetic text, no model",
    }


# --- request bodies ------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Refusing(_Strict):
    """Fields the simulator cannot honour: each refused when set to other than its off value."""

    @staticmethod
    def refuse(value: Any, *off: Any) -> Any:
        if value is None or value in off:
            return value
        raise ValueError(UNSERVED)


class ResponsesBody(_Refusing):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_UINT32)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str = "auto"
    truncation: str = "disabled"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    request_id: str | None = None  # vLLM's: the response's id
    tools: Any = None
    tool_choice: Any = None
    text: Any = None
    reasoning: Any = None
    include: Any = None
    top_logprobs: Any = None
    prompt: Any = None
    conversation: Any = None

    @field_validator("tools", "include")
    @classmethod
    def _no_list(cls, value: Any) -> Any:
        return cls.refuse(value, [])

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        return cls.refuse(value, "auto", "none")

    @field_validator("text")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("format") in (None, {"type": "text"}):
            return value
        return cls.refuse(value)

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("effort") is None:
            return value
        return cls.refuse(value)

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        return cls.refuse(value, 0)

    @field_validator("prompt", "conversation")
    @classmethod
    def _nothing(cls, value: Any) -> Any:
        return cls.refuse(value)

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[dict[str, Any]]) -> Any:
        if not value:
            raise ValueError("must not be empty")
        return value


class _Pooling(_Strict):
    model: str | None = None


class EmbeddingsBody(_Pooling):
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = None  # vLLM's chat embeddings
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None
    user: str | None = None


class ClassifyBody(_Pooling):
    input: str | list[str]
    user: str | None = None


class ScoreBody(_Pooling):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankBody(_Pooling):
    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)


_M = TypeVar("_M", bound=BaseModel)


def _parse(schema: type[_M], body: dict[str, Any]) -> _M:
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise invalid_fields(exc) from exc


# --- vectors -------------------------------------------------------------------------


def embedding(
    seed: int, text: str | Sequence[int], dim: int, normalize: bool = True
) -> list[float]:
    """The simulator's vector of ``text`` (or of a prompt of token ids): a function of the
    seed and the input; inputs that share words point alike."""
    if isinstance(text, str):
        words, whole = _WORD.findall(text.lower()), text
    else:
        words = [f"#{i}" for i in text]
        whole = ",".join(words)
    acc = [0.0] * dim
    for word in words:
        digest = hashlib.blake2b(f"{seed}/w/{word}".encode(), digest_size=4 * _SPARSE).digest()
        for k in range(0, len(digest), 4):
            at = int.from_bytes(digest[k : k + 3], "little") % dim
            acc[at] += 1.0 if digest[k + 3] & 1 else -1.0
    dense = hashlib.shake_256(f"{seed}/t/{whole}".encode(errors="surrogatepass")).digest(2 * dim)
    weight = _DENSE_WEIGHT / 32768.0
    for i, v in enumerate(struct.unpack(f"<{dim}h", dense)):
        acc[i] += v * weight
    if not normalize:
        return acc
    norm = math.sqrt(sum(x * x for x in acc)) or 1.0
    return [x / norm for x in acc]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":  # as vLLM: float32, little-endian
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


# --- the stored responses ------------------------------------------------------------


@dataclass(slots=True)
class _Stored:
    response: dict[str, Any]
    messages: tuple[ChatMessage, ...]  # its input, instructions first (for follow-ups)
    task: asyncio.Task[None] | None = None  # a background response still running
    # A streamed background response's events, kept for streamed retrieves (as vLLM's
    # event store): each one SSE event, in order (its index is its sequence number).
    events: list[bytes] | None = None
    more: asyncio.Event = field(default_factory=asyncio.Event)  # an event came, or the end
    ended: bool = False  # no more events will come


@dataclass(slots=True)
class _Run:
    """One response being made: its body so far and what it generates from."""

    response: dict[str, Any]
    request: EngineRequest
    messages: tuple[ChatMessage, ...]
    item_id: str
    text: list[str] = field(default_factory=list)
    tokens: Tokens = field(default_factory=Tokens)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _usage(prompt: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0,
            "prompt_tokens_details": None}  # fmt: skip


class SimFrontend(OpenAIFrontend):
    """The Responses API and the pooling routes of the simulated engine."""

    routes = ROUTES

    def __init__(self, engine: SimEngine, settings: SimSettings) -> None:
        self._engine = engine
        self._settings = settings
        self._stored: OrderedDict[str, _Stored] = OrderedDict()
        self._serve: dict[str, Callable[[FrontendRequest], Awaitable[FrontendReply]]] = {
            "responses": self._responses,
            "responses_retrieve": self._retrieve,
            "responses_cancel": self._cancel,
            "embeddings": self._embeddings,
            "pooling": self._embeddings,
            "classify": self._classify,
            "score": self._score,
            "rerank": self._rerank,
            "transcriptions": self._audio,
            "translations": self._audio,
        }

    async def serve(self, request: FrontendRequest) -> FrontendReply:
        return await self._serve[request.route](request)

    async def models(self) -> list[dict[str, Any]]:
        return [sim_model_card(m) for m in self._engine.served_models()]

    def _model(self, asked: str | None) -> str:
        served = self._engine.served_models()
        if asked in (None, "", *served):
            return asked or served[0]
        raise NotFound(
            f"model '{asked}' is not served here (this unit serves "
            f"{', '.join(repr(m) for m in served)})",
            param="model",
            code="model_not_found",
        )

    async def _audio(self, request: FrontendRequest) -> FrontendReply:
        # No speech model, and no made-up transcript: a client would take it for one.
        raise InvalidRequest(
            f"the simulator has no transcription model: /v1/audio/{request.route} needs "
            "an engine with a speech-to-text model (engine vllm)",
            param="model",
        )

    # -- pooling ------------------------------------------------------------------------

    async def _prefill(self, request_id: str, inputs: Sequence[str | Sequence[int]]) -> int:
        """Prefill every input in the engine, as one batch; the prompt tokens of all."""

        async def one(i: int, item: str | Sequence[int]) -> int:
            if isinstance(item, str):
                req = EngineRequest(f"{request_id}-{i}", prompt=item, pooling=True)
            else:
                req = EngineRequest(f"{request_id}-{i}", prompt_token_ids=tuple(item), pooling=True)
            last: TokenDelta | None = None
            async with aclosing(self._engine.generate(req)) as deltas:
                async for delta in deltas:
                    last = delta
            if last is None:
                raise EngineError("the engine ended the request without an answer")
            return last.prompt_tokens

        return sum(await asyncio.gather(*(one(i, x) for i, x in enumerate(inputs))))

    async def _embeddings(self, request: FrontendRequest) -> FrontendReply:
        body = _parse(EmbeddingsBody, request.body)
        model = self._model(body.model)
        inputs = self._embedding_inputs(body)
        dim = self._settings.embedding_dim
        if body.dimensions is not None and body.dimensions > dim:
            raise InvalidRequest(
                f"dimensions: at most {dim} (--sim-embedding-dim)", param="dimensions"
            )
        prompt_tokens = await self._prefill(request.request_id, inputs)
        seed, normalize = self._settings.seed, body.normalize is not False
        size = body.dimensions or dim
        pooling = request.route == "pooling"
        data = []
        for i, item in enumerate(inputs):
            vector = embedding(seed, item, dim, normalize=False)[:size]
            if normalize:
                norm = math.sqrt(sum(x * x for x in vector)) or 1.0
                vector = [x / norm for x in vector]
            encoded = _encoded(vector, body.encoding_format)
            if pooling:
                data.append({"index": i, "object": "pooling", "data": encoded})
            else:
                data.append({"index": i, "object": "embedding", "embedding": encoded})
        prefix = "pool" if pooling else "embd"
        return self._whole({
            "id": f"{prefix}-{request.request_id}", "object": "list",
            "created": int(time.time()), "model": model, "data": data,
            "usage": _usage(prompt_tokens),
        })  # fmt: skip

    @staticmethod
    def _embedding_inputs(body: EmbeddingsBody) -> list[str | Sequence[int]]:
        if body.messages is not None:
            if body.input is not None:
                raise InvalidRequest("give input or messages, not both", param="messages")
            return ["".join(_chat_text(body.messages))]
        value = body.input
        if value is None or value == [] or value == "":
            raise InvalidRequest("input: must not be empty", param="input")
        if isinstance(value, str):
            return [value]
        if all(isinstance(v, int) for v in value):
            return [[v for v in value if isinstance(v, int)]]
        return [v for v in value if isinstance(v, str | list)]

    async def _classify(self, request: FrontendRequest) -> FrontendReply:
        body = _parse(ClassifyBody, request.body)
        model = self._model(body.model)
        inputs = [body.input] if isinstance(body.input, str) else body.input
        if not inputs:
            raise InvalidRequest("input: must not be empty", param="input")
        prompt_tokens = await self._prefill(request.request_id, inputs)
        data = []
        for i, text in enumerate(inputs):
            vector = embedding(self._settings.seed, text, self._settings.embedding_dim)
            logits = [8.0 * x for x in vector[: len(CLASS_LABELS)]]
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            probs = [e / sum(exps) for e in exps]
            label = CLASS_LABELS[probs.index(max(probs))]
            data.append({"index": i, "label": label, "probs": probs,
                         "num_classes": len(CLASS_LABELS)})  # fmt: skip
        return self._whole({
            "id": f"classify-{request.request_id}", "object": "list",
            "created": int(time.time()), "model": model, "data": data,
            "usage": _usage(prompt_tokens),
        })  # fmt: skip

    async def _scores(
        self, request_id: str, left: list[str], right: list[str]
    ) -> tuple[list[float], int]:
        """Cosine scores of the pairs (a single left text pairs with every right one)."""
        if len(left) == 1 and len(right) > 1:
            left = left * len(right)
        if len(left) != len(right):
            raise InvalidRequest(
                "text_1 and text_2 must have the same length (or text_1 one text)", param="text_2"
            )
        if not right:
            raise InvalidRequest("text_2: must not be empty", param="text_2")
        unique = list(dict.fromkeys([*left, *right]))
        prompt_tokens = await self._prefill(request_id, unique)
        seed, dim = self._settings.seed, self._settings.embedding_dim
        vectors = {text: embedding(seed, text, dim) for text in unique}
        return [
            cosine(vectors[a], vectors[b]) for a, b in zip(left, right, strict=True)
        ], prompt_tokens

    async def _score(self, request: FrontendRequest) -> FrontendReply:
        body = _parse(ScoreBody, request.body)
        model = self._model(body.model)
        left = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        right = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        scores, prompt_tokens = await self._scores(request.request_id, left, right)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return self._whole({
            "id": f"score-{request.request_id}", "object": "list",
            "created": int(time.time()), "model": model, "data": data,
            "usage": _usage(prompt_tokens),
        })  # fmt: skip

    async def _rerank(self, request: FrontendRequest) -> FrontendReply:
        body = _parse(RerankBody, request.body)
        model = self._model(body.model)
        if not body.documents:
            raise InvalidRequest("documents: must not be empty", param="documents")
        scores, prompt_tokens = await self._scores(
            request.request_id, [body.query], list(body.documents)
        )
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results = [
            {"index": i, "document": {"text": body.documents[i], "multi_modal": None},
             "relevance_score": scores[i]}
            for i in order
        ]  # fmt: skip
        return self._whole({
            "id": f"rerank-{request.request_id}", "model": model,
            "usage": {"total_tokens": prompt_tokens}, "results": results,
        })  # fmt: skip

    @staticmethod
    def _whole(body: dict[str, Any], tokens: Tokens | None = None) -> FrontendReply:
        return FrontendReply(200, body=_dumps(body).encode(), tokens=tokens or Tokens())

    # -- the Responses API ----------------------------------------------------------------

    async def _responses(self, request: FrontendRequest) -> FrontendReply:
        body = _parse(ResponsesBody, request.body)
        if body.background and not body.store:
            raise InvalidRequest(
                "background: can only be used when store is true", param="background"
            )
        run = self._start(body, request.request_id)
        if body.background and body.stream:
            # As vLLM: the response is made in the background, its events kept; this
            # stream reads them as a streamed retrieve does (a client gone stops only it).
            run.response["status"] = "queued"
            stored = self._keep(run)
            stored.events = []
            stored.task = asyncio.create_task(self._background_stream(run, stored))
            return FrontendReply(200, chunks=self._replay(stored, 0), tokens=run.tokens)
        if body.stream:
            return FrontendReply(200, chunks=self._events(run, body.store), tokens=run.tokens)
        if body.background:
            run.response["status"] = "queued"
            stored = self._keep(run)
            stored.task = asyncio.create_task(self._background(run, stored))
            return self._whole(run.response)
        try:
            async with aclosing(self._engine.generate(run.request)) as deltas:
                async for delta in deltas:
                    self._add(run, delta)
        except BaseException:
            self._failed(run)
            raise
        if body.store:
            self._keep(run)
        return self._whole(run.response, run.tokens)

    def _start(self, body: ResponsesBody, request_id: str) -> _Run:
        model = self._model(body.model)
        messages = self._messages(body)
        max_tokens = body.max_output_tokens or self._settings.default_max_tokens
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        response_id = body.request_id or f"resp_{uuid.uuid4().hex}"
        engine_request = EngineRequest(
            request_id=request_id,
            messages=messages,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p),
            model=None if model == self._engine.model_name else model,
        )
        response = {
            "id": response_id, "created_at": int(time.time()), "error": None,
            "incomplete_details": None, "instructions": body.instructions,
            "metadata": body.metadata, "model": model, "object": "response", "output": [],
            "parallel_tool_calls": body.parallel_tool_calls, "temperature": temperature,
            "tool_choice": body.tool_choice or "auto", "tools": [], "top_p": top_p,
            "background": body.background, "max_output_tokens": max_tokens,
            "max_tool_calls": body.max_tool_calls,
            "previous_response_id": body.previous_response_id, "prompt": None,
            "reasoning": body.reasoning, "service_tier": body.service_tier,
            "status": "in_progress", "text": body.text, "top_logprobs": 0,
            "truncation": body.truncation, "usage": None, "user": body.user,
        }  # fmt: skip
        return _Run(response, engine_request, messages, f"msg_{uuid.uuid4().hex}")

    def _messages(self, body: ResponsesBody) -> tuple[ChatMessage, ...]:
        """The conversation the response continues, as vLLM builds it: the instructions,
        the previous response's input (its own instructions left out) and output, the input."""
        messages: list[ChatMessage] = []
        if body.instructions:
            messages.append(ChatMessage("system", body.instructions))
        if body.previous_response_id is not None:
            previous = self._stored.get(body.previous_response_id)
            if previous is None:
                raise NotFound(
                    f"Response with id '{body.previous_response_id}' not found.",
                    param="previous_response_id",
                )
            before = previous.messages
            if before and before[0].role == "system":
                before = before[1:]
            messages += before
            messages += (ChatMessage("assistant", t) for t in _output_texts(previous.response))
        if isinstance(body.input, str):
            messages.append(ChatMessage("user", body.input))
        else:
            messages += _input_messages(body.input)
        return tuple(messages)

    def _add(self, run: _Run, delta: TokenDelta) -> None:
        run.text.append(delta.text)
        run.tokens.completion_tokens = delta.completion_tokens
        if delta.finish_reason is None:
            return
        incomplete = delta.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        response = run.response
        response["output"] = [_message(run.item_id, "".join(run.text), status)]
        response["status"] = status
        if incomplete:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["usage"] = {
            "input_tokens": delta.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": delta.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": delta.prompt_tokens + delta.completion_tokens,
        }

    def _failed(self, run: _Run) -> None:
        if run.response["status"] in ("queued", "in_progress"):
            run.response["status"] = "failed"

    def _keep(self, run: _Run) -> _Stored:
        stored = _Stored(run.response, run.messages)
        limit = self._settings.responses_stored
        if limit:
            self._stored[run.response["id"]] = stored
            while len(self._stored) > limit:
                _, oldest = self._stored.popitem(last=False)
                if oldest.task is not None:
                    oldest.task.cancel()
        return stored

    async def _background(self, run: _Run, stored: _Stored) -> None:
        run.response["status"] = "in_progress"
        try:
            async with aclosing(self._engine.generate(run.request)) as deltas:
                async for delta in deltas:
                    self._add(run, delta)
        except asyncio.CancelledError:
            run.response["status"] = "cancelled"
        except EngineError as exc:
            self._failed(run)
            run.response["error"] = {"code": "server_error", "message": exc.message}
        finally:
            stored.task = None

    async def _events(self, run: _Run, store: bool) -> AsyncGenerator[bytes, None]:
        """The stream of one response, as OpenAI's (and vLLM's) server-sent events."""
        if store:
            self._keep(run)  # retrievable while it streams
        async with aclosing(self._event_lists(run)) as lists:
            async for events in lists:
                yield b"".join(events)

    async def _event_lists(self, run: _Run) -> AsyncGenerator[list[bytes], None]:
        """The events of one response, those ready together in one list."""
        seq = 0
        item_id, response = run.item_id, run.response

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            payload = _dumps({"type": kind, "sequence_number": seq, **fields})
            seq += 1
            return f"event: {kind}\ndata: {payload}\n\n".encode()

        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        try:
            response["status"] = "in_progress"
            yield [event("response.created", response=response),
                   event("response.in_progress", response=response)]  # fmt: skip
            started = False
            async with aclosing(self._engine.generate(run.request)) as deltas:
                async for delta in deltas:
                    head = []
                    if not started:
                        started = True
                        head += [
                            event(
                                "response.output_item.added",
                                output_index=0,
                                item=_message(item_id, "", "in_progress", parts=False),
                            ),
                            event("response.content_part.added", **where, part=_part("")),
                        ]
                    self._add(run, delta)
                    if delta.text:
                        head.append(event("response.output_text.delta", **where,
                                          delta=delta.text, logprobs=[]))  # fmt: skip
                    if head:
                        yield head
        except BaseException:
            self._failed(run)
            raise
        text = "".join(run.text)
        item = response["output"][0]
        yield [
            event("response.output_text.done", **where, text=text, logprobs=[]),
            event("response.content_part.done", **where, part=_part(text)),
            event("response.output_item.done", output_index=0, item=item),
            event("response.completed", response=response),
        ]

    async def _background_stream(self, run: _Run, stored: _Stored) -> None:
        """Make a streamed background response, keeping each event for its readers."""
        kept = stored.events
        assert kept is not None
        try:
            async with aclosing(self._event_lists(run)) as lists:
                async for events in lists:
                    kept += events
                    stored.more.set()
        except asyncio.CancelledError:
            run.response["status"] = "cancelled"
        except EngineError as exc:
            run.response["error"] = {"code": "server_error", "message": exc.message}
        finally:
            stored.task = None
            stored.ended = True
            stored.more.set()

    async def _replay(self, stored: _Stored, start: int) -> AsyncGenerator[bytes, None]:
        """A stored response's events from index ``start`` on, as they come, to its end."""
        kept = stored.events
        assert kept is not None
        at = start
        while True:
            stored.more.clear()
            if at < len(kept):
                yield b"".join(kept[at:])
                at = len(kept)
                continue
            if stored.ended:
                return
            await stored.more.wait()

    async def _retrieve(self, request: FrontendRequest) -> FrontendReply:
        stored = self._find(request)
        if request.body.get("stream") is not True:
            return self._whole(stored.response)
        response_id = stored.response["id"]
        if stored.events is None:  # vLLM keeps the events of streamed background ones only
            raise InvalidRequest(f"Unknown response_id: {response_id}", param="response_id")
        after = request.body.get("starting_after")
        start = 0 if after is None else int(after) + 1
        return FrontendReply(200, chunks=self._replay(stored, max(start, 0)))

    async def _cancel(self, request: FrontendRequest) -> FrontendReply:
        stored = self._find(request)
        response = stored.response
        if response["status"] not in ("queued", "in_progress") or stored.task is None:
            raise InvalidRequest("Cannot cancel a synchronous response.")
        response["status"] = "cancelled"
        task, stored.task = stored.task, None
        task.cancel()
        return self._whole(response)

    def _find(self, request: FrontendRequest) -> _Stored:
        response_id = str(request.body.get("response_id"))
        stored = self._stored.get(response_id)
        if stored is None:
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        return stored


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str, status: str, parts: bool = True) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_part(text)] if parts else []}  # fmt: skip


def _output_texts(response: dict[str, Any]) -> list[str]:
    return [
        part["text"]
        for item in response.get("output") or ()
        if item.get("type") == "message"
        for part in item.get("content") or ()
        if part.get("type") == "output_text"
    ]


_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _input_messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """The messages of an input list; an item or part the simulator cannot read: 400."""
    messages = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        role = item.get("role")
        if kind != "message" or role not in _ROLES:
            what = f"items of type {kind!r}" if kind != "message" else f"role {role!r}"
            raise InvalidRequest(f"input[{i}]: {what}: {UNSERVED}", param="input")
        content = item.get("content")
        if isinstance(content, str):
            messages.append(ChatMessage(role, content))
            continue
        texts = []
        for part in content if isinstance(content, list) else [content]:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(
                    f"input[{i}].content: parts of type {kind!r}: {UNSERVED}", param="input"
                )
            texts.append(str(part.get("text", "")))
        messages.append(ChatMessage(role, "".join(texts)))
    return messages


def _chat_text(messages: list[dict[str, Any]]) -> list[str]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        out.append(
            f"<|{m.get('role', '')}|>\n{content if isinstance(content, str) else ''}<|end|>\n"
        )
    return out

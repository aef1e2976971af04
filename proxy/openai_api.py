"""The OpenAI-compatible wire format: request validation in, response bodies out.

Parsing turns a request body into an ``EngineRequest`` or raises ``InvalidRequest``
naming the field; unknown fields are ignored, as vLLM's server does. Encoding builds
the byte strings of SSE chunks with the per-request constant parts prepared once,
so a token costs one ``json.dumps`` of its text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from engine.base import ChatMessage, EngineRequest, SamplingParams, TokenDelta
from engine.errors import invalid_fields
from engine.sim_api import sim_model_card
from proxy.errors import InvalidRequest, NotFound, PayloadTooLarge

Route = Literal["completions", "chat"]
MAX_STOP_SEQUENCES = 16
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Integer ranges of the gRPC wire (uint32 counts, int32 top_k, int64 seed, as vLLM's
# own seed bound), so both wires accept the same requests and no engine sees a number
# it cannot hold.
MAX_UINT32 = 2**32 - 1
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


# Fields of OpenAI's API and vLLM's that this layer cannot honour (engine sim, and the
# gRPC wire of every engine): a request that sets one is refused, 400 naming the field,
# never served without what it asked for. Engines vllm and openai serve them over
# HTTP through their own layer (engine/frontend.py).
UNSERVED = "not supported by this engine (engines vllm and openai serve it)"
ONLY_ONE = "only 1 is supported by this engine (engines vllm and openai serve more)"
UNSERVED_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "top_logprobs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


class _Unserved(_Strict):
    """The UNSERVED_FIELDS, each refused when set to anything but its "off" value."""

    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    top_logprobs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator(*UNSERVED_FIELDS)
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        if value in (None, [], "none", 0) or value == {"type": "text"}:
            return value
        raise ValueError(UNSERVED)


class _SamplingFields(_Unserved):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_UINT32)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_tokens: int = Field(0, ge=0, le=MAX_UINT32)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-MAX_INT64 - 1, le=MAX_INT64)
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string or a list of strings")
        if len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return value

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})",
                param="min_tokens",
            )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_tokens=self.min_tokens,
            stop=tuple(s for s in stop if s),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
        )

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(ONLY_ONE)
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        o = self.stream_options
        return o is not None and o.include_usage and o.continuous_usage_stats


class CompletionBody(_SamplingFields):
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        # One prompt per request: a string, a list of token ids, or a batch of one.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            return value
        if isinstance(value, list) and value and all(_is_token_id(t) for t in value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
            raise ValueError("batched prompts are not supported: send one request per prompt")
        raise ValueError("must be a non-empty string or a non-empty list of token ids")

    # Field validators, not a model validator: the error then names the field (param).
    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError(UNSERVED)
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError(UNSERVED)
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(ONLY_ONE)
        return value


class MessageBody(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, value: str) -> str:
        if value not in CHAT_ROLES:
            raise ValueError(f"must be one of {', '.join(sorted(CHAT_ROLES))}")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    "messages: only text content parts are supported", param="messages"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatBody(_SamplingFields):
    messages: list[MessageBody] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_UINT32)
    logprobs: bool = False
    # vLLM's chat template fields, with vLLM's defaults and semantics.
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_open(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("cannot be true together with add_generation_prompt (set it false)")
        return value

    @field_validator("logprobs")
    @classmethod
    def _unsupported(cls, value: bool) -> bool:
        if value:
            raise ValueError(UNSERVED)
        return value


def model_card(name: str, simulator: bool) -> dict[str, Any]:
    """A model as /v1/models lists it; the simulator says it is one."""
    if simulator:
        return sim_model_card(name)
    return {"id": name, "object": "model", "created": 0, "owned_by": "unitproxy"}


def model_not_found(name: str) -> NotFound:
    return NotFound(f"the model '{name}' does not exist", param="model", code="model_not_found")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    route: Route
    engine_request: EngineRequest
    model: str
    stream: bool
    include_usage: bool
    # A resumed request (proxy.resume): the ``created`` its client saw (None: now) and
    # the output tokens another unit delivered (None: not resumed).
    created: int | None = None
    delivered_tokens: int | None = None
    continuous_usage: bool = False  # usage in every chunk (vLLM's continuous_usage_stats)


def parse(
    route: Route,
    body: bytes,
    *,
    request_id: str,
    served_model: str | Sequence[str],
    max_prompt_chars: int,
) -> ParsedRequest:
    """Validate an OpenAI request body; raise InvalidRequest/NotFound/PayloadTooLarge."""
    schema = _schema(route)
    try:
        req = schema.model_validate_json(body)
    except ValidationError as exc:
        raise invalid_fields(exc) from exc
    return _parsed(route, req, request_id, served_model, max_prompt_chars)


def parse_fields(
    route: Route,
    fields: dict[str, Any],
    *,
    request_id: str,
    served_model: str | Sequence[str],
    max_prompt_chars: int,
) -> ParsedRequest:
    """Like ``parse``, for fields that arrived another way (the gRPC request)."""
    try:
        req = _schema(route).model_validate(fields)
    except ValidationError as exc:
        raise invalid_fields(exc) from exc
    return _parsed(route, req, request_id, served_model, max_prompt_chars)


def _schema(route: Route) -> type[CompletionBody | ChatBody]:
    return CompletionBody if route == "completions" else ChatBody


def _parsed(
    route: Route,
    req: CompletionBody | ChatBody,
    request_id: str,
    served_model: str | Sequence[str],
    max_prompt_chars: int,
) -> ParsedRequest:
    served = (served_model,) if isinstance(served_model, str) else tuple(served_model)
    if req.model not in (None, "", *served):
        raise NotFound(
            f"model '{req.model}' is not served here (this unit serves "
            f"{', '.join(repr(m) for m in served)})",
            param="model",
            code="model_not_found",
        )
    model = req.model or served[0]
    if isinstance(req, CompletionBody):
        max_tokens = req.max_tokens
        prompt, ids, messages = _completion_input(req, max_prompt_chars)
        template: dict[str, Any] = {}
    else:
        max_tokens = req.max_completion_tokens or req.max_tokens
        prompt, ids, messages = None, None, _chat_input(req, max_prompt_chars)
        template = {
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
        }
    engine_request = EngineRequest(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=ids,
        messages=messages,
        sampling=req.sampling(max_tokens),
        model=None if model == served[0] else model,
        **template,
    )
    return ParsedRequest(
        route,
        engine_request,
        model,
        req.stream,
        req.include_usage,
        continuous_usage=req.continuous_usage,
    )


def _completion_input(
    req: CompletionBody, max_chars: int
) -> tuple[str | None, tuple[int, ...] | None, None]:
    if isinstance(req.prompt, str):
        if len(req.prompt) > max_chars:
            raise PayloadTooLarge(
                f"prompt: {len(req.prompt)} characters, over the limit of {max_chars}",
                param="prompt",
            )
        return req.prompt, None, None
    if len(req.prompt) > max_chars:
        raise PayloadTooLarge(
            f"prompt: {len(req.prompt)} tokens, over the limit of {max_chars}", param="prompt"
        )
    return None, tuple(req.prompt), None


def _chat_input(req: ChatBody, max_chars: int) -> tuple[ChatMessage, ...]:
    messages = tuple(ChatMessage(m.role, m.text()) for m in req.messages)
    size = sum(len(m.content) for m in messages)
    if size > max_chars:
        raise PayloadTooLarge(
            f"messages: {size} characters, over the limit of {max_chars}", param="messages"
        )
    return messages


# --- responses -------------------------------------------------------------------


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def usage(delta: TokenDelta) -> dict[str, int]:
    return {
        "prompt_tokens": delta.prompt_tokens,
        "completion_tokens": delta.completion_tokens,
        "total_tokens": delta.prompt_tokens + delta.completion_tokens,
    }


def created_of(parsed: ParsedRequest) -> int:
    """The response's ``created``: a resumed request's own, else now."""
    return int(time.time()) if parsed.created is None else parsed.created


def response_body(parsed: ParsedRequest, text: str, last: TokenDelta, created: int) -> bytes:
    """The whole non-streaming response."""
    rid = parsed.engine_request.request_id
    choice: dict[str, Any]
    if parsed.route == "completions":
        obj, rid = "text_completion", f"cmpl-{rid}"
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
    else:
        obj, rid = "chat.completion", f"chatcmpl-{rid}"
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": last.finish_reason,
        }
    body = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": parsed.model,
        "choices": [choice],
        "usage": usage(last),
    }
    return _dumps(body).encode()


DONE = b"data: [DONE]\n\n"
# A gateway counting its tenants' usage sends this header; a stream then ends with the
# usage as an SSE comment before [DONE] (``USAGE_COMMENT``, then the usage object), which
# the gateway reads and takes out: the client never gets it. (Reading the usage chunk
# of stream_options.include_usage instead would change the chunks the client gets.)
USAGE_HEADER = "x-unitproxy-usage"
USAGE_COMMENT = b": usage "


def usage_header(last: TokenDelta) -> str:
    """The value of ``USAGE_HEADER`` on a whole (not streamed) answer: its usage as
    "PROMPT_TOKENS COMPLETION_TOKENS", which a gateway reads without the answer's JSON."""
    return f"{last.prompt_tokens} {last.completion_tokens}"


class StreamEncoder:
    """SSE chunks of one stream; per-request parts are built once."""

    def __init__(self, parsed: ParsedRequest, created: int | None = None):
        created = created_of(parsed) if created is None else created
        rid = parsed.engine_request.request_id
        model = _dumps(parsed.model)
        self._chat = parsed.route == "chat"
        self._include_usage = parsed.include_usage
        self._continuous = parsed.continuous_usage
        if self._chat:
            head = f'{{"id":{_dumps("chatcmpl-" + rid)},"object":"chat.completion.chunk","created":{created},"model":{model},'
            self._prefix = f'data: {head}"choices":[{{"index":0,"delta":{{"content":'.encode()
            self._first = (
                f'data: {head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                f'"logprobs":null,"finish_reason":null}}]'
            )
            self._mid = b'},"logprobs":null,"finish_reason":'
        else:
            head = f'{{"id":{_dumps("cmpl-" + rid)},"object":"text_completion","created":{created},"model":{model},'
            self._prefix = f'data: {head}"choices":[{{"index":0,"text":'.encode()
            self._first = ""
            self._mid = b',"logprobs":null,"finish_reason":'
        if parsed.delivered_tokens is not None:
            self._first = ""  # resumed: its client already has the role chunk
        self._usage_head = f'data: {head}"choices":[],"usage":'.encode()
        self._tail = b'}],"usage":null}\n\n' if self._include_usage else b"}]}\n\n"

    def start(self) -> bytes:
        """What goes before the first token: the role chunk for chat, nothing else."""
        if not self._first:
            return b""
        usage_part = ',"usage":null' if self._include_usage else ""
        return f"{self._first}{usage_part}}}\n\n".encode()

    def chunk(self, delta: TokenDelta) -> bytes:
        reason = b"null" if delta.finish_reason is None else f'"{delta.finish_reason}"'.encode()
        tail = self._tail
        if self._continuous:
            tail = b'}],"usage":' + _dumps(usage(delta)).encode() + b"}\n\n"
        return b"".join((self._prefix, _dumps(delta.text).encode(), self._mid, reason, tail))

    def end(self, last: TokenDelta | None, comment: bool = False) -> bytes:
        """The usage chunk when asked for, then [DONE]; ``comment``: the usage comment
        for a gateway (``USAGE_HEADER``) before [DONE]."""
        end = DONE
        if comment and last is not None:
            end = USAGE_COMMENT + _dumps(usage(last)).encode() + b"\n\n" + end
        if self._include_usage and last is not None:
            return self._usage_head + _dumps(usage(last)).encode() + b"}\n\n" + end
        return end


def sse_error(error_body: dict[str, Any]) -> bytes:
    """An error after the stream started: one SSE event, then the caller ends the stream."""
    return b"data: " + _dumps(error_body).encode() + b"\n\n"

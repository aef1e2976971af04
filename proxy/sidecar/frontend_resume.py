"""A resumed request on an engine's own OpenAI layer (header ``x-unitproxy-resume``).

A gateway that moves a request off a failed unit re-issues it here with the output
already delivered appended (chat: a final assistant message and vLLM's
``continue_final_message``; completions: the prompt) and this hint:
``{"created": INT, "delivered_chars": INT}``. The engine's layer generates the rest;
this module makes its answer read as the rest of the first one:

- C0, the tokens already delivered: the engine's count of the delivered text (the
  last ``delivered_chars`` characters of the final assistant message or prompt),
  from its own /tokenize;
- ``max_tokens`` and ``max_completion_tokens`` reduced by C0 (``min_tokens`` too, not
  below 0); nothing left: the answer ends at once with finish_reason "length";
- a stream has no role chunk (the client has it) and every chunk the hint's
  ``created``; usage is as for one request: prompt_tokens minus C0, completion_tokens
  plus C0.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncGenerator
from typing import Any

from engine.frontend import FrontendReply, FrontendRequest, FrontendRoute, OpenAIFrontend, Tokens
from proxy.errors import InvalidRequest, NotFound
from proxy.httputil import RESUME_HEADER
from proxy.resume import ResumeHint, parse_hint

_CREATED = re.compile(rb'"created":\s*(\d+)')
_ROLE_DELTA = b'"delta":{"role":"assistant","content":""}'


__all__ = [
    "RESUME_HEADER",
    "ResumeHint",
    "parse_hint",
]  # one parser of the hint, shared with proxy.resume


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad(what: str) -> InvalidRequest:
    return InvalidRequest(f"header {RESUME_HEADER}: {what}", param=RESUME_HEADER)


def delivered_text(route: FrontendRoute, body: dict[str, Any], chars: int) -> str:
    """The last ``chars`` characters of the final assistant message (chat) or prompt."""
    if route == "chat":
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not isinstance(last, dict) or last.get("role") != "assistant":
            raise _bad("a resumed chat request ends with the assistant's message")
        text = last.get("content")
    else:
        text = body.get("prompt")
    if not isinstance(text, str):
        raise _bad("the resumed text must be a string")
    if chars > len(text):
        raise _bad(f"delivered_chars ({chars}) is longer than the text ({len(text)})")
    return text[len(text) - chars :]


async def count_tokens(
    frontend: OpenAIFrontend, text: str, request_id: str, body: dict[str, Any] | None = None
) -> int:
    """The engine's token count of ``text``, from its own /tokenize.

    ``body`` replaces the tokenize request (a chat's messages, counted through its
    template). An upstream without /tokenize (a server other than vLLM's) gets an
    estimate: one token per 4 characters, OpenAI's rule of thumb for English text.
    """
    if not text:
        return 0
    body = body or {"prompt": text, "add_special_tokens": False}
    try:
        reply = await frontend.serve(FrontendRequest("tokenize", body, f"{request_id}-resume"))
        return int(json.loads(reply.body or b"{}")["count"])
    except (NotFound, KeyError, ValueError):
        return max(1, round(len(text) / 4))


def reduce_limits(body: dict[str, Any], delivered: int) -> dict[str, Any] | None:
    """The body with its token limits reduced by ``delivered``; None if none is left."""
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and _count(value):
            if value - delivered <= 0:
                return None
            body[key] = value - delivered
    if _count(body.get("min_tokens")):
        body["min_tokens"] = max(0, body["min_tokens"] - delivered)
    return body


async def finished(
    frontend: OpenAIFrontend,
    route: FrontendRoute,
    fields: dict[str, Any],
    hint: ResumeHint,
    delivered: int,
    request_id: str,
) -> FrontendReply:
    """The answer of a resumed request whose delivered output already reaches its token
    limit: no engine work, one chunk with finish_reason "length" (and the usage, counted
    as for one request, where the client asked for it)."""
    chat = route == "chat"
    if chat:
        messages = fields.get("messages") or []
        text = "".join(m["content"] for m in messages if isinstance(m.get("content"), str))
        body = {"messages": messages, "add_generation_prompt": False}
        body["continue_final_message"] = True
        total = await count_tokens(frontend, text, request_id, body)
    else:
        total = await count_tokens(frontend, fields["prompt"], request_id)
    prompt = max(0, total - delivered)
    usage = {"prompt_tokens": prompt, "completion_tokens": delivered}
    usage["total_tokens"] = prompt + delivered
    created = hint.created if hint.created is not None else int(time.time())
    head: dict[str, Any] = {
        "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": fields.get("model"),
    }
    if fields.get("stream") is not True:
        content = {"message": {"role": "assistant", "content": ""}} if chat else {"text": ""}
        choice = {"index": 0, **content, "logprobs": None, "finish_reason": "length"}
        answer = {**head, "choices": [choice], "usage": usage}
        return FrontendReply(200, body=json.dumps(answer, separators=(",", ":")).encode())
    if chat:
        head["object"] = "chat.completion.chunk"
    content = {"delta": {"content": ""}} if chat else {"text": ""}
    last = {
        **head,
        "choices": [{"index": 0, **content, "logprobs": None, "finish_reason": "length"}],
    }
    events = [last]
    options = fields.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        events.append({**head, "choices": [], "usage": usage})

    async def chunks() -> AsyncGenerator[bytes, None]:
        for event in events:
            yield b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return FrontendReply(200, chunks=chunks(), tokens=Tokens(0))


class ResumedAnswer:
    """Rewrites the engine's answer to read as the rest of the first one."""

    def __init__(self, route: FrontendRoute, hint: ResumeHint, delivered: int):
        self._chat = route == "chat"
        self._created = hint.created
        self._delivered = delivered
        self._theirs: bytes | None = None  # the engine's own "created":N

    def body(self, data: bytes) -> bytes:
        answer = json.loads(data)
        if self._created is not None:
            answer["created"] = self._created
        self._usage(answer)
        return json.dumps(answer, separators=(",", ":")).encode()

    async def chunks(self, chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        try:
            async for piece in chunks:
                out = b"".join(self._event(e) for e in piece.split(b"\n\n") if e.strip())
                if out:
                    yield out
        finally:
            await chunks.aclose()

    def _event(self, event: bytes) -> bytes:
        if self._chat and _ROLE_DELTA in event:
            return b""  # the client has the role chunk of the first attempt
        if self._created is not None:
            if self._theirs is None and (found := _CREATED.search(event)):
                self._theirs = found.group(0)
            if self._theirs is not None:
                event = event.replace(self._theirs, b'"created":%d' % self._created, 1)
        if b'"usage":{' in event and event.startswith(b"data: {"):
            chunk = json.loads(event[6:])
            self._usage(chunk)
            event = b"data: " + json.dumps(chunk, separators=(",", ":")).encode()
        return event + b"\n\n"

    def _usage(self, answer: dict[str, Any]) -> None:
        usage = answer.get("usage")
        if isinstance(usage, dict) and "prompt_tokens" in usage:
            usage["prompt_tokens"] = max(0, usage["prompt_tokens"] - self._delivered)
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self._delivered


def wrap(reply: FrontendReply, answer: ResumedAnswer) -> FrontendReply:
    if reply.chunks is not None:
        return FrontendReply(reply.status, chunks=answer.chunks(reply.chunks), tokens=reply.tokens)
    return FrontendReply(reply.status, body=answer.body(reply.body or b"{}"), tokens=reply.tokens)

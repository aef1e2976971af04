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
from collections.abc import AsyncGenerator
from typing import Any

from engine.frontend import FrontendReply, FrontendRequest, FrontendRoute, OpenAIFrontend
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


async def count_tokens(frontend: OpenAIFrontend, text: str, request_id: str) -> int:
    """The engine's token count of ``text``, from its own /tokenize.

    An upstream without /tokenize (a server other than vLLM's) gets an estimate: one
    token per 4 characters, OpenAI's rule of thumb for English text.
    """
    if not text:
        return 0
    body = {"prompt": text, "add_special_tokens": False}
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

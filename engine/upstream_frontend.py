"""Engine ``openai``'s HTTP routes: the client's body goes to the upstream unchanged.

Whatever the upstream serves, the client gets: tools, ``tool_calls`` and
``tool_call_id`` in messages, ``response_format``, logprobs, ``n``, batched prompts.
The only field added is ``model`` when the client left it out (OpenAI servers other
than vLLM require it); no sampling default is set here, so the upstream applies its
model's own. The upstream's answer comes back byte for byte; an SSE stream is passed
on in whole events, so an error event added after a broken upstream stands alone.

The audio routes' forms go up as the client sent them (``forms_as_sent``: the bytes and
their content type, within the sidecar's ``server.max_body_bytes``, unread), and the
answer comes back with the upstream's content type (a transcription asked as ``text``
is ``text/plain``), a stream when the upstream answers ``text/event-stream``.

Token counts for the sidecar's metrics come from the answer's ``usage`` when it has
one (every non-streamed answer; a stream with ``stream_options.include_usage``),
else from the number of streamed events (an estimate: vLLM sends one token per event,
plus the role event of a chat stream).
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Callable
from typing import Any

import aiohttp

from engine.errors import EngineError
from engine.frontend import FORM_ROUTES, FrontendReply, FrontendRequest, OpenAIFrontend, Tokens

_PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "transcriptions": "/v1/audio/transcriptions",
    "translations": "/v1/audio/translations",
}
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_EVENT_END = b"\n\n"

Post = Callable[[str, dict[str, Any]], Any]  # the engine's POST: returns a response
PostRaw = Callable[[str, bytes, str | None], Any]  # the same with bytes of a content type


class UpstreamFrontend(OpenAIFrontend):
    routes = frozenset({"completions", "chat", "tokenize", "detokenize", *FORM_ROUTES})
    forms_as_sent = True

    def __init__(
        self,
        post: Post,
        get_json: Callable[[str], Any],
        model: Callable[[], str],
        post_raw: PostRaw,
    ):
        self._post = post
        self._post_raw = post_raw
        self._get_json = get_json
        self._model = model

    async def serve(self, request: FrontendRequest) -> FrontendReply:
        if request.route in FORM_ROUTES:
            return await self._form(request)
        body = request.body
        if request.route in ("completions", "chat") and not body.get("model"):
            body = {**body, "model": self._model()}
        resp: aiohttp.ClientResponse = await self._post(_PATHS[request.route], body)
        tokens = Tokens()
        if body.get("stream") is True and request.route in ("completions", "chat"):
            return FrontendReply(resp.status, chunks=_events(resp, tokens), tokens=tokens)
        try:
            data = await resp.read()
        except aiohttp.ClientError as exc:
            raise EngineError(f"upstream answer broke: {exc!r}") from exc
        finally:
            resp.release()
        tokens.completion_tokens = _usage_tokens(data) or 0
        return FrontendReply(resp.status, body=data, tokens=tokens)

    async def _form(self, request: FrontendRequest) -> FrontendReply:
        content_type = request.headers.get("Content-Type")
        resp: aiohttp.ClientResponse = await self._post_raw(
            _PATHS[request.route], request.raw, content_type
        )
        tokens = Tokens()
        if resp.content_type == "text/event-stream":
            return FrontendReply(resp.status, chunks=_events(resp, tokens), tokens=tokens)
        try:
            data = await resp.read()
        except aiohttp.ClientError as exc:
            raise EngineError(f"upstream answer broke: {exc!r}") from exc
        finally:
            resp.release()
        tokens.completion_tokens = _usage_tokens(data) or 0
        kind = resp.headers.get("Content-Type", "application/json")
        return FrontendReply(resp.status, body=data, tokens=tokens, content_type=kind)

    async def models(self) -> list[dict[str, Any]]:
        body = await self._get_json("/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise EngineError("upstream /v1/models has no list of models")
        return [m for m in data if isinstance(m, dict)]


def _usage_tokens(data: bytes) -> int | None:
    found = _COMPLETION_TOKENS.findall(data)
    return int(found[-1]) if found else None


async def _events(resp: aiohttp.ClientResponse, tokens: Tokens) -> AsyncGenerator[bytes, None]:
    """The upstream's SSE bytes in whole events; closing this closes the connection."""
    pending, events, usage, done = b"", 0, None, False
    try:
        async for piece in resp.content.iter_any():
            pending += piece
            cut = pending.rfind(_EVENT_END)
            if cut < 0:
                continue
            whole, pending = pending[: cut + 2], pending[cut + 2 :]
            events += whole.count(b"data: {")
            usage = _usage_tokens(whole) or usage
            tokens.completion_tokens = usage if usage is not None else events
            yield whole
        if pending.strip():
            yield pending + _EVENT_END
        done = True
    except aiohttp.ClientError as exc:
        raise EngineError(f"upstream stream broke: {exc!r}") from exc
    finally:
        if done:
            resp.release()
        else:
            resp.close()  # how the upstream learns that its client left

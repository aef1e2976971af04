"""The OpenAI routes of an engine that serves them itself (engine/frontend.py).

The body goes to the engine's own layer as the client sent it; the sidecar adds what
is its own around it: admission (429/503 before any engine work), the outstanding
count, the deadline, cancellation (a client gone closes the engine's stream, which
aborts the request), the unit and request-id headers, metrics and error bodies.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from engine.base import ChatMessage, EngineRequest
from engine.frontend import FrontendReply, FrontendRequest, FrontendRoute, OpenAIFrontend
from proxy import openai_api
from proxy.errors import InvalidRequest, UnitProxyError
from proxy.httputil import REQUEST_ID_HEADER, SSE_CONTENT_TYPE, UNIT_HEADER, ClientGone
from proxy.response_ids import new_response_id
from proxy.resume import HintKey, check_signed
from proxy.sidecar import frontend_resume
from proxy.sidecar.core import Lease, SidecarCore, engine_priority
from proxy.tenants import PRIORITY_HEADER

log = logging.getLogger(__name__)

# Routes on a stored response, named in the path: no engine work, so no admission.
BY_ID: frozenset[FrontendRoute] = frozenset({"responses_retrieve", "responses_cancel"})
# The status that the requests metric counts, when it differs from the response's.
OUTCOME = web.RequestKey("outcome", str)
# Response headers of a stream, as vLLM's server sends them.
_SSE_HEADERS = {"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache"}


def json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or the 400 that the parser would give."""
    try:
        fields = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(fields, dict):
        raise InvalidRequest("request body must be a JSON object")
    return fields


def blocks_request(
    route: FrontendRoute, fields: dict[str, Any], request_id: str
) -> EngineRequest | None:
    """The prompt of a chat or completion body, as the sidecar's own parser would make
    it, for naming the prefix blocks it fills; None where its prompt is not plain text
    (content parts, token ids, a batch of prompts)."""
    if route == "completions":
        prompt = fields.get("prompt")
        return EngineRequest(request_id, prompt=prompt) if isinstance(prompt, str) else None
    if route != "chat" or not isinstance(fields.get("messages"), list):
        return None
    messages: list[ChatMessage] = []
    for m in fields["messages"]:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return None
        messages.append(ChatMessage(str(m.get("role")), m["content"]))
    return EngineRequest(
        request_id,
        messages=tuple(messages),
        add_generation_prompt=fields.get("add_generation_prompt", True) is not False,
        continue_final_message=fields.get("continue_final_message") is True,
    )


async def serve(
    request: web.Request,
    route: FrontendRoute,
    request_id: str,
    core: SidecarCore,
    frontend: OpenAIFrontend,
    deadline: float | None,
) -> web.StreamResponse:
    """One OpenAI request through the engine's own layer; errors raise UnitProxyError."""
    fields = json_object(await request.read())
    if route == "responses" and not fields.get("request_id"):
        # vLLM's field for the response's id: one that names this unit, so that a
        # follow-up through a gateway comes back here (proxy/response_ids.py)
        fields["request_id"] = new_response_id(core.unit_id)
    if route in ("chat", "completions") and core.engine.takes_priority():
        # vLLM's body field, ours whatever the client put there (trusted downwards only)
        fields["priority"] = engine_priority(request.headers.get(PRIORITY_HEADER))
    hint = frontend_resume.parse_hint(request.headers.get(frontend_resume.RESUME_HEADER))
    lease = core.admit()
    try:
        async with core.tracked(lease, deadline):  # the deadline, and a unit that lets go
            resumed = None
            if hint is not None and route in ("chat", "completions"):
                fields, resumed = await _resume(
                    frontend, route, fields, hint, request_id, core.resume_key
                )
            named = blocks_request(route, fields, request_id)
            if named is not None:  # the prefix blocks it fills, for the load report
                await core.expect_blocks(named)
            fr = FrontendRequest(route, fields, request_id, request.headers)
            if isinstance(resumed, FrontendReply):
                reply, resumed = resumed, None  # nothing left to generate
            elif fields.get("stream") is True:
                reply = await frontend.serve(fr)  # returns at once: progress is in the chunks
            else:
                reply = await core.wait_whole(frontend.serve(fr), frontend.steps)
            if resumed is not None and reply.status == 200:  # an error is answered as it is
                reply = frontend_resume.wrap(reply, resumed)
    except BaseException:
        core.finish(lease, route)
        raise
    headers = {UNIT_HEADER: core.unit_id, REQUEST_ID_HEADER: request_id}
    if reply.chunks is None:
        core.finish(lease, route)
        core.count_tokens(reply.tokens.completion_tokens)
        return web.Response(
            body=reply.body, status=reply.status, content_type="application/json", headers=headers
        )
    return await _stream(request, route, core, lease, reply, headers, deadline)


async def by_id(
    request: web.Request,
    route: FrontendRoute,
    request_id: str,
    core: SidecarCore,
    frontend: OpenAIFrontend,
) -> web.Response:
    """Retrieve or cancel a stored response: ``{"response_id"}`` from the path."""
    fields = {"response_id": request.match_info["response_id"]}
    reply = await frontend.serve(FrontendRequest(route, fields, request_id, request.headers))
    headers = {UNIT_HEADER: core.unit_id, REQUEST_ID_HEADER: request_id}
    return web.Response(
        body=reply.body, status=reply.status, content_type="application/json", headers=headers
    )


async def _resume(
    frontend: OpenAIFrontend,
    route: FrontendRoute,
    fields: dict[str, Any],
    hint: frontend_resume.ResumeHint,
    request_id: str,
    resume_key: HintKey | None,
) -> tuple[dict[str, Any], frontend_resume.ResumedAnswer | FrontendReply]:
    """The body to send the engine, and what rewrites its answer; or, when the delivered
    output already reaches the token limit, the whole answer, made here."""
    if hint.delivered_chars is None:  # token ids are a gRPC input; this layer has text
        raise InvalidRequest(
            f"header {frontend_resume.RESUME_HEADER}: delivered_chars is required here",
            param=frontend_resume.RESUME_HEADER,
        )
    text = frontend_resume.delivered_text(route, fields, hint.delivered_chars)
    check_signed(resume_key, hint, text)
    delivered = await frontend_resume.count_tokens(frontend, text, request_id)
    reduced = frontend_resume.reduce_limits(fields, delivered)
    if reduced is None:
        done = await frontend_resume.finished(frontend, route, fields, hint, delivered, request_id)
        return fields, done
    return reduced, frontend_resume.ResumedAnswer(route, hint, delivered)


async def _stream(
    request: web.Request,
    route: str,
    core: SidecarCore,
    lease: Lease,
    reply: FrontendReply,
    headers: dict[str, str],
    deadline: float | None,
) -> web.StreamResponse:
    assert reply.chunks is not None
    response = web.StreamResponse(status=reply.status, headers={**headers, **_SSE_HEADERS})

    async def send(chunk: bytes) -> None:
        # Headers go out with the first chunk: an error before it is still a status.
        if not response.prepared:
            await response.prepare(request)
        await response.write(chunk)

    try:
        try:
            await core.relay(lease, reply.chunks, route, send, deadline)
        except UnitProxyError as exc:
            if not response.prepared:
                raise
            log.warning("request %s failed mid-stream: %s", headers[REQUEST_ID_HEADER], exc)
            request[OUTCOME] = str(exc.http_status)
            await response.write(openai_api.sse_error(exc.body()))
        finally:
            core.count_tokens(reply.tokens.completion_tokens)
        if not response.prepared:
            await response.prepare(request)
        await response.write_eof()
    except ConnectionResetError as exc:
        raise ClientGone(response) from exc
    return response

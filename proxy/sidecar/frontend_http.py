"""The OpenAI routes of an engine that serves them itself (engine/frontend.py).

The body goes to the engine's own layer as the client sent it; the sidecar adds what
is its own around it: admission (429/503 before any engine work), the outstanding
count, the deadline, cancellation (a client gone closes the engine's stream, which
aborts the request), the unit and request-id headers, metrics and error bodies.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from contextlib import aclosing
from typing import Any

from aiohttp import web

from engine.base import ChatMessage, EngineRequest
from engine.frontend import (
    FORM_ROUTES,
    FormFile,
    FrontendReply,
    FrontendRequest,
    FrontendRoute,
    OpenAIFrontend,
)
from proxy import multipart, openai_api
from proxy.errors import InvalidRequest, UnitProxyError
from proxy.httputil import REQUEST_ID_HEADER, SSE_CONTENT_TYPE, UNIT_HEADER, ClientGone
from proxy.load import GATEWAY_HEADER, gateway_name
from proxy.response_ids import new_response_id
from proxy.resume import HintKey, check_signed
from proxy.sidecar import frontend_resume
from proxy.sidecar.core import Lease, SidecarCore
from proxy.tenants import PRIORITY_HEADER, PRIORITY_SIG_HEADER
from proxy.tracing import TRACEPARENT, TRACESTATE, Trace

log = logging.getLogger(__name__)

# Routes on a stored response, named in the path: no engine work, so no admission.
BY_ID: frozenset[FrontendRoute] = frozenset({"responses_retrieve", "responses_cancel"})
# The status that the requests metric counts, when it differs from the response's.
OUTCOME = web.RequestKey("outcome", str)
TRACE: web.RequestKey[Trace | None] = web.RequestKey("trace")  # its spans, with tracing on
TRACE_HEADERS = (TRACEPARENT, TRACESTATE)
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


def form_fields(body: bytes, content_type: str | None) -> dict[str, Any]:
    """A multipart form's fields (proxy/multipart.py's bounds): text as str, files as
    FormFile, a name given more than once as the list of its values. As vLLM's server
    (starlette) reads a form: an url-encoded one's text fields too, and a body of another
    type (JSON, say) as no field at all: vLLM's request model then refuses the missing
    file (its 400), and an engine without the route answers its 404."""
    fields: dict[str, Any] = {}
    kind = multipart.kind_of(content_type)
    values: list[tuple[str, Any]] = []
    if kind == multipart.URLENCODED_TYPE:
        values += multipart.urlencoded(body)
    elif kind == multipart.FORM_TYPE:
        for part in multipart.parse(body, content_type):
            if part.filename is None:
                values.append((part.name, part.data.decode()))
            else:
                values.append((part.name, FormFile(part.filename, part.content_type, part.data)))
    for name, value in values:
        if name not in fields:
            fields[name] = value
        elif isinstance(fields[name], list):
            fields[name].append(value)
        else:
            fields[name] = [fields[name], value]
    return fields


def streamed(route: FrontendRoute, fields: dict[str, Any]) -> bool:
    """Whether the request asks for a stream (a form's fields are text)."""
    stream = fields.get("stream")
    if route in FORM_ROUTES and isinstance(stream, str):
        return stream.lower() in _TRUE
    return stream is True


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
    body = await request.read()
    raw = b""
    if route in FORM_ROUTES and frontend.forms_as_sent:
        fields, raw = {}, body
    elif route in FORM_ROUTES:
        fields = form_fields(body, request.headers.get("Content-Type"))
    else:
        fields = json_object(body)
    if route == "responses" and not fields.get("request_id"):
        # vLLM's field for the response's id: one that names this unit, so that a
        # follow-up through a gateway comes back here (proxy/response_ids.py)
        fields["request_id"] = new_response_id(core.unit_id)
    asked = request.headers
    priority = core.priority_of(
        asked.get(PRIORITY_HEADER), asked.get(PRIORITY_SIG_HEADER), asked.get(REQUEST_ID_HEADER)
    )
    if route in ("chat", "completions") and core.engine.takes_priority():
        # vLLM's body field, ours whatever the client put there (interactive only with
        # a gateway's credential)
        fields["priority"] = priority
    hint = frontend_resume.parse_hint(request.headers.get(frontend_resume.RESUME_HEADER))
    trace = request.get(TRACE)
    lease = core.admit(priority, trace, gateway_name(asked.get(GATEWAY_HEADER)))
    headers: Mapping[str, str] = request.headers
    if trace is not None:  # the engine's own spans hang under this request's
        headers = {k: v for k, v in headers.items() if k.lower() not in TRACE_HEADERS}
        headers.update(trace.headers(trace.root))
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
            fr = FrontendRequest(route, fields, request_id, headers, raw)
            if isinstance(resumed, FrontendReply):
                reply, resumed = resumed, None  # nothing left to generate
            elif streamed(route, fields):
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
        headers["Content-Type"] = reply.content_type
        return web.Response(body=reply.body, status=reply.status, headers=headers)
    return await _stream(request, route, core, lease, reply, headers, deadline)


async def by_id(
    request: web.Request,
    route: FrontendRoute,
    request_id: str,
    core: SidecarCore,
    frontend: OpenAIFrontend,
) -> web.StreamResponse:
    """Retrieve or cancel a stored response: ``{"response_id"}`` from the path, and for a
    retrieve vLLM's query parameters ``stream`` and ``starting_after`` (a streamed
    retrieve replays a streamed background response's events after that one, then
    follows it to its end). No engine work: no admission."""
    fields: dict[str, Any] = {"response_id": request.match_info["response_id"]}
    if route == "responses_retrieve":
        fields.update(retrieve_query(request.query))
    reply = await frontend.serve(FrontendRequest(route, fields, request_id, request.headers))
    headers = {UNIT_HEADER: core.unit_id, REQUEST_ID_HEADER: request_id}
    if reply.chunks is None:
        return web.Response(
            body=reply.body, status=reply.status, content_type="application/json", headers=headers
        )
    response = web.StreamResponse(status=reply.status, headers={**headers, **_SSE_HEADERS})
    try:
        async with aclosing(reply.chunks) as chunks:
            async for chunk in chunks:
                if not response.prepared:
                    await response.prepare(request)
                await response.write(chunk)
        if not response.prepared:
            await response.prepare(request)
        await response.write_eof()
    except ConnectionResetError as exc:
        raise ClientGone(response) from exc
    return response


_TRUE = frozenset({"1", "true", "on", "yes", "t", "y"})
_FALSE = frozenset({"0", "false", "off", "no", "f", "n"})


def retrieve_query(query: Mapping[str, str]) -> dict[str, Any]:
    """``stream`` and ``starting_after`` of a retrieve's query, read as vLLM's server
    (FastAPI) reads them; a value that does not parse is a 400 naming it."""
    fields: dict[str, Any] = {}
    stream = query.get("stream")
    if stream is not None:
        if stream.lower() not in _TRUE | _FALSE:
            raise InvalidRequest("stream: must be a boolean", param="stream")
        fields["stream"] = stream.lower() in _TRUE
    after = query.get("starting_after")
    if after is not None:
        try:
            fields["starting_after"] = int(after)
        except ValueError:
            raise InvalidRequest(
                "starting_after: must be an integer", param="starting_after"
            ) from None
    return fields


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

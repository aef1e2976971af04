"""The sidecar's HTTP API: OpenAI routes, health, readiness, load and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine.base import TokenDelta
from engine.frontend import FrontendRoute
from proxy import grpcweb, ingress, multipart, openai_api, resume
from proxy.auth import ApiKeys
from proxy.errors import InvalidRequest, NotFound, UnitProxyError
from proxy.httputil import (
    DEADLINE_HEADER,
    NOT_FOUND,
    REQUEST_ID_HEADER,
    RESUME_HEADER,
    SSE_CONTENT_TYPE,
    UNIT_HEADER,
    ClientGone,
    admin_drain,
    detail_response,
    error_middleware,
    error_response,
    json_response,
    timeout_s,
)
from proxy.load import GATEWAY_HEADER, UnitState, gateway_name
from proxy.metrics import ServingMetrics
from proxy.pb.unitproxy.v1.inference_pb2 import GenerateChunk, GenerateRequest
from proxy.sidecar import frontend_http, grpc_api
from proxy.sidecar.core import SidecarCore, with_priority
from proxy.sidecar.frontend_http import OUTCOME, TRACE
from proxy.sidecar.watch import ReportWatch
from proxy.tenants import PRIORITY_HEADER, PRIORITY_SIG_HEADER
from proxy.tracing import TRACEPARENT, TRACESTATE, finish

log = logging.getLogger(__name__)

CORE = web.AppKey("core", SidecarCore)
WATCH = web.AppKey("watch", ReportWatch)
REGISTRY = web.AppKey("registry", CollectorRegistry)
SERVING_METRICS = web.AppKey("serving_metrics", ServingMetrics)
MAX_PROMPT_CHARS = web.AppKey("max_prompt_chars", int)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The POST routes besides chat and completions, served where the engine's own layer has
# them (engine/frontend.py), as vLLM's server serves them.
ENGINE_ROUTES: dict[str, FrontendRoute] = {
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/pooling": "pooling",
    "/classify": "classify",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    # multipart forms (proxy/multipart.py): an audio file and its fields
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
}


def build_app(
    core: SidecarCore,
    watch: ReportWatch,
    registry: CollectorRegistry,
    metrics: ServingMetrics,
    *,
    max_body_bytes: int,
    max_prompt_chars: int,
    drain: Callable[[], None],
    admin_token: str | None = None,
    api_keys: ApiKeys | None = None,
) -> web.Application:
    middlewares = [ingress.phase_middleware(), error_middleware(core.unit_id)]
    if api_keys is not None and api_keys.enabled:
        middlewares.append(api_keys.middleware())
    middlewares.append(ingress.body_middleware())
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[CORE] = core
    app[WATCH] = watch
    app[REGISTRY] = registry
    app[SERVING_METRICS] = metrics
    app[MAX_PROMPT_CHARS] = max_prompt_chars
    keys = api_keys or ApiKeys()
    app.router.add_post(
        "/v1/completions", _inference("completions"), expect_handler=keys.expect_handler
    )
    app.router.add_post(
        "/v1/chat/completions", _inference("chat"), expect_handler=keys.expect_handler
    )
    # the API routes answer GET alone, as vLLM's server (FastAPI) does: HEAD is 405
    app.router.add_get("/v1/models", _models, allow_head=False)
    app.router.add_get("/v1/models/{model_id:.+}", _model, allow_head=False)
    # Served where the engine's own layer has them, else 404.
    for path, route in ENGINE_ROUTES.items():
        app.router.add_post(path, _inference(route), expect_handler=keys.expect_handler)
    app.router.add_get(
        "/v1/responses/{response_id}", _inference("responses_retrieve"), allow_head=False
    )
    app.router.add_post("/v1/responses/{response_id}/cancel", _inference("responses_cancel"))
    inference = grpc_api.InferenceService(core, metrics, max_prompt_chars, keys)
    app.router.add_post(grpcweb.PATH, _grpc_web(inference, core))
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/load", _load)
    app.router.add_get("/load/watch", _load_watch)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/admin/drain", admin_drain(drain, admin_token, lambda: _ready_body(core)))
    return app


def _inference(route: FrontendRoute) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        core = request.app[CORE]
        metrics = request.app[SERVING_METRICS]
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        code = "500"
        headers = request.headers
        trace = None
        if core.tracer is not None:  # named by the route, not the path (a response's id)
            resource = request.match_info.route.resource
            name = f"{request.method} {request.path if resource is None else resource.canonical}"
            trace = core.begin_trace(headers.get(TRACEPARENT), headers.get(TRACESTATE), name)
        request[TRACE] = trace
        try:
            response = await _serve(request, route, request_id, core)
            code = request.get(OUTCOME) or str(response.status)
            return response
        except UnitProxyError as exc:
            code = str(exc.http_status)
            if isinstance(exc, multipart.MalformedForm):  # vLLM's server's answer to it
                return detail_response(400, exc.detail, request_id, core.unit_id)
            return error_response(exc, request_id, core.unit_id)
        except web.RequestPayloadError:
            code = "400"  # the body could not be read; the error middleware answers
            raise
        except ClientGone as gone:
            code = "499"  # client closed the connection
            return gone.response
        except asyncio.CancelledError:
            code = "499"
            raise
        finally:
            metrics.requests.labels(route, code).inc()
            if trace is not None:
                finish(trace.root, code)

    return handle


async def _serve(
    request: web.Request, route: FrontendRoute, request_id: str, core: SidecarCore
) -> web.StreamResponse:
    frontend = core.engine.frontend
    if frontend is not None and route in frontend.routes:
        if route in frontend_http.BY_ID:
            return await frontend_http.by_id(request, route, request_id, core, frontend)
        deadline = _deadline(request)
        return await frontend_http.serve(request, route, request_id, core, frontend, deadline)
    if route not in ("completions", "chat") or (frontend is not None and not frontend.generates):
        # a route the model has no task for (a pooling model's chat): vLLM's server has
        # no such route, and answers as FastAPI does (NOT_FOUND)
        return web.Response(
            body=NOT_FOUND, status=404, content_type="application/json",
            headers={UNIT_HEADER: core.unit_id, REQUEST_ID_HEADER: request_id},
        )  # fmt: skip
    body = await request.read()
    parsed = openai_api.parse(
        route,
        body,
        request_id=request_id,
        served_model=core.engine.served_models(),
        max_prompt_chars=request.app[MAX_PROMPT_CHARS],
    )
    headers = request.headers
    priority = core.priority_of(
        headers.get(PRIORITY_HEADER),
        headers.get(PRIORITY_SIG_HEADER),
        headers.get(REQUEST_ID_HEADER),
    )
    parsed = dataclasses.replace(
        parsed, engine_request=with_priority(parsed.engine_request, priority)
    )
    hint = resume.parse_hint(request.headers.get(RESUME_HEADER))
    if hint is not None:
        parsed = await resume.resume(parsed, hint, core.engine.count_tokens, core.resume_key)
    deadline = _deadline(request)
    lease = core.admit(priority, request[TRACE], gateway_name(headers.get(GATEWAY_HEADER)))
    if parsed.stream:
        return await _stream(request, parsed, core, lease, deadline)
    return await _complete(
        parsed, core, lease, deadline, openai_api.USAGE_HEADER in request.headers
    )


def _deadline(request: web.Request) -> float | None:
    budget = timeout_s(request.headers.get(DEADLINE_HEADER))
    return None if budget is None else asyncio.get_running_loop().time() + budget


async def _complete(
    parsed: openai_api.ParsedRequest,
    core: SidecarCore,
    lease: Any,
    deadline: float | None,
    usage: bool = False,  # a gateway asked for the usage in a header (``USAGE_HEADER``)
) -> web.Response:
    parts: list[str] = []

    async def collect(delta: TokenDelta) -> None:
        parts.append(delta.text)

    last = await core.run(
        lease, parsed.engine_request, parsed.route, collect, deadline, parsed.delivered_tokens or 0
    )
    body = openai_api.response_body(parsed, "".join(parts), last, openai_api.created_of(parsed))
    headers = _headers(core, parsed.engine_request.request_id)
    if usage:
        headers[openai_api.USAGE_HEADER] = openai_api.usage_header(last)
    return web.Response(body=body, content_type="application/json", headers=headers)


async def _stream(
    request: web.Request,
    parsed: openai_api.ParsedRequest,
    core: SidecarCore,
    lease: Any,
    deadline: float | None,
) -> web.StreamResponse:
    encoder = openai_api.StreamEncoder(parsed)
    response = web.StreamResponse(headers=_headers(core, parsed.engine_request.request_id))
    response.headers["Content-Type"] = SSE_CONTENT_TYPE
    response.headers["Cache-Control"] = "no-cache"

    async def send(delta: TokenDelta) -> None:
        if not response.prepared:
            # Headers go out with the first token, so an error before it is still
            # a plain status code that a gateway can retry elsewhere.
            await response.prepare(request)
            await response.write(encoder.start() + encoder.chunk(delta))
        else:
            await response.write(encoder.chunk(delta))

    try:
        try:
            last = await core.run(
                lease, parsed.engine_request, parsed.route, send, deadline,
                parsed.delivered_tokens or 0,
            )  # fmt: skip
        except UnitProxyError as exc:
            if not response.prepared:
                raise
            log.warning("request %s failed mid-stream: %s", parsed.engine_request.request_id, exc)
            request[OUTCOME] = str(exc.http_status)
            await response.write(openai_api.sse_error(exc.body()))
            await response.write_eof()
            return response
        await response.write(encoder.end(last, openai_api.USAGE_HEADER in request.headers))
        await response.write_eof()
    except ConnectionResetError as exc:
        raise ClientGone(response) from exc
    return response


def _grpc_web(inference: grpc_api.InferenceService, core: SidecarCore) -> Handler:
    """Inference.Generate in the gRPC-Web framing (``proxy.grpcweb``): a gateway's unit
    leg. Every answer is a 200 whose last frame is the status, as on gRPC."""

    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": grpcweb.CONTENT_TYPE, UNIT_HEADER: core.unit_id}
        )

        async def write(chunk: GenerateChunk) -> None:
            if not response.prepared:
                await response.prepare(request)  # the head goes with the first chunk
            await response.write(grpcweb.frame(chunk.SerializeToString()))

        try:
            try:
                message = GenerateRequest.FromString(grpcweb.one_message(await request.read()))
            except (grpcweb.FrameError, DecodeError) as exc:
                raise InvalidRequest(f"not a GenerateRequest: {exc}") from None
            budget = timeout_s(request.headers.get(DEADLINE_HEADER))
            metadata = [(k.lower(), v) for k, v in request.headers.items()]
            hint = request.headers.get(RESUME_HEADER)
            interval_s = grpcweb.interval_s(request.headers.get(grpcweb.INTERVAL_HEADER))
            await inference.serve(message, metadata, hint, budget, write, interval_s)
            end = grpcweb.OK_TRAILERS
        except UnitProxyError as exc:
            end = grpcweb.trailers(exc.grpc_code, exc.message, exc.code)
        except ConnectionResetError:
            return response  # the gateway went away: nothing to tell it
        with contextlib.suppress(ConnectionResetError):
            if not response.prepared:
                await response.prepare(request)
            await response.write(end)
            await response.write_eof()
        return response

    return handle


def _headers(core: SidecarCore, request_id: str) -> dict[str, str]:
    return {UNIT_HEADER: core.unit_id, REQUEST_ID_HEADER: request_id}


async def _models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": await _model_cards(request.app[CORE])})


async def _model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    for card in await _model_cards(request.app[CORE]):
        if card.get("id") == model_id:
            return json_response(card)
    raise NotFound(f"model '{model_id}' is not served here", param="model", code="model_not_found")


async def _model_cards(core: SidecarCore) -> list[dict[str, Any]]:
    engine = core.engine
    if engine.frontend is not None:
        return await engine.frontend.models()
    return [openai_api.model_card(m, engine.is_simulator) for m in engine.served_models()]


async def _health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    core = request.app[CORE]
    status = 200 if core.health.state is UnitState.SERVING else 503
    return json_response(_ready_body(core), status=status)


def _ready_body(core: SidecarCore) -> dict[str, Any]:
    return {
        "state": str(core.health.state),
        "unit_id": core.unit_id,
        "nodes": [
            {
                "name": n.name,
                "role": n.role,
                "address": n.address,
                "healthy": n.healthy,
                "reason": n.reason,
                "since_ms": n.since_ms,
            }
            for n in core.health.nodes()
        ],
        "outstanding": core.outstanding,
    }


async def _load(request: web.Request) -> web.Response:
    """The report; ``?blocks_epoch=E&blocks_since=S``: the prefix blocks' changes since
    seq S of epoch E (the whole set when those are gone), else the whole set;
    ``watcher=NAME``: the requests of the gateway of that name counted apart."""
    since = None
    if "blocks_since" in request.query:
        since = _whole(request, "blocks_epoch"), _whole(request, "blocks_since")
    report = request.app[CORE].report(since, gateway_name(request.query.get("watcher")))
    return web.Response(text=report.to_json(), content_type="application/json")


async def _load_watch(request: web.Request) -> web.StreamResponse:
    """The reports of WatchLoad as server-sent events: ``data: REPORT-JSON``; the query
    may carry WatchLoadRequest's fields (``?min_interval_ms=500&heartbeat_ms=2000&watcher=NAME``)."""
    asked = _asked_ms(request, "min_interval_ms") / 1000, _asked_ms(request, "heartbeat_ms") / 1000
    response = web.StreamResponse(
        headers={"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        watcher = gateway_name(request.query.get("watcher"))
        async for report in request.app[WATCH].reports(*asked, watcher=watcher):
            await response.write(b"data: " + report.to_json().encode() + b"\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the watcher went away
    return response


def _asked_ms(request: web.Request, name: str) -> int:
    value = request.query.get(name, "0")
    if not (value.isascii() and value.isdigit()):  # int() refuses "²", isdigit() alone not
        raise InvalidRequest(f"{name} must be a whole number of ms (digits 0-9)", param=name)
    return int(value)


def _whole(request: web.Request, name: str) -> int:
    value = request.query.get(name, "0")
    if not (value.isascii() and value.isdigit() and len(value) <= 20):
        raise InvalidRequest(f"{name} must be a whole number (digits 0-9)", param=name)
    return int(value)


async def _metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[REGISTRY])
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

"""HTTP pieces shared by the sidecar and the gateway: header names, JSON and error responses."""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.errors import (
    Forbidden,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    Unauthenticated,
    Unavailable,
    UnitProxyError,
)

UNIT_HEADER = "x-unitproxy-unit"
NO_UNIT = "none"  # its value on a gateway's own answer to a request no unit was tried for
REQUEST_ID_HEADER = "x-request-id"
# The request's remaining time budget in milliseconds; passed on, reduced, at each hop.
DEADLINE_HEADER = "x-unitproxy-timeout-ms"
# Gateway to unit: this request continues a stream another unit started (HTTP header
# and gRPC metadata key; the value is compact JSON, see proxy/resume.py).
RESUME_HEADER = "x-unitproxy-resume"
MIGRATE_HEADER = "x-unitproxy-migrate"  # client to gateway: "0" opts out of migration
# A stream's content type, as vLLM's server sends it: clients that decode by the declared
# charset (``requests``, aiohttp's ``text()``) would take a bare one for ISO-8859-1.
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def new_request_id() -> str:
    """An id for a request that came without one (128 random bits, hex)."""
    return f"{random.getrandbits(128):032x}"


def timeout_s(raw: str | None) -> float | None:
    """The request's time budget from the DEADLINE_HEADER value, in seconds."""
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise InvalidRequest(f"header {DEADLINE_HEADER}: not a number of milliseconds") from None
    if not (math.isfinite(ms) and ms > 0):
        raise InvalidRequest(f"header {DEADLINE_HEADER}: must be a finite number above 0 ms")
    return ms / 1000


def timeout_header(left_s: float) -> str:
    """The DEADLINE_HEADER value for ``left_s`` seconds (to the microsecond)."""
    return f"{left_s * 1000:.3f}"


class ClientClosed(Exception):
    """The client closed the connection while its response was being written."""

    def __init__(self) -> None:
        super().__init__("client closed the connection")


class ClientGone(ClientClosed):
    """ClientClosed, with the aiohttp response that was being written (to return it)."""

    def __init__(self, response: web.StreamResponse):
        super().__init__()
        self.response = response


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data, separators=(",", ":")),
        status=status,
        content_type="application/json",
    )


def error_parts(
    exc: UnitProxyError, request_id: str | None, unit_id: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and OpenAI error body for ``exc``."""
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    if unit_id:
        headers[UNIT_HEADER] = unit_id
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(exc.retry_after_s)
    elif isinstance(exc, Unavailable):
        headers["Retry-After"] = "1"
    return exc.http_status, headers, json.dumps(exc.body(), separators=(",", ":")).encode()


def error_response(
    exc: UnitProxyError, request_id: str | None, unit_id: str | None = None
) -> web.Response:
    status, headers, body = error_parts(exc, request_id, unit_id)
    return web.Response(status=status, body=body, headers=headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# Bodies a browser may send cross-site without a preflight; the API takes JSON only.
MAX_REQUEST_ID = 256
FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data"})
# The routes whose body is a multipart form (an audio file and its fields), as vLLM's.
FORM_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})


# vLLM's server's answer for a path it has no route for (FastAPI's), application/json.
NOT_FOUND = b'{"detail":"Not Found"}'
# unitproxy's own paths, which vLLM's server has not: an unknown one under them is
# answered with unitproxy's error body.
OWN_PATHS = ("/admin", "/units", "/load")
# vLLM's API routes outside /v1/ and /v2/: a wrong method on an API route is answered
# as vLLM's server (FastAPI) answers it, on unitproxy's own paths with its error body.
API_ROOT_PATHS = frozenset(
    {"/pooling", "/classify", "/score", "/rerank", "/tokenize", "/detokenize"}
)


def detail_response(
    status: int,
    detail: str,
    request_id: str | None,
    unit_id: str | None = None,
    allow: str | None = None,
) -> web.Response:
    """An answer in FastAPI's shape, ``{"detail": ...}`` (application/json), as vLLM's
    server gives it for a path or method it has no route for or a form that does not
    parse, with unitproxy's headers."""
    headers = {"Content-Type": "application/json"}
    if allow is not None:
        headers["Allow"] = allow
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    if unit_id:
        headers[UNIT_HEADER] = unit_id
    body = json.dumps({"detail": detail}, separators=(",", ":")).encode()
    return web.Response(status=status, body=body, headers=headers)


def not_found(request_id: str | None, unit_id: str | None = None) -> web.Response:
    """vLLM's 404 for a path it has no route for, with unitproxy's headers."""
    return detail_response(404, "Not Found", request_id, unit_id)


def _own_path(path: str) -> bool:
    return any(path == own or path.startswith(own + "/") for own in OWN_PATHS)


def _api_path(path: str) -> bool:
    return path.startswith(("/v1/", "/v2/")) or path in API_ROOT_PATHS


def error_middleware(unit_id: str | None = None) -> Any:
    """Answer our errors, and aiohttp's own refusals, with the OpenAI error body; an
    unknown path (``NOT_FOUND``), and a wrong method on an API route, as vLLM's server
    answers them, but for unitproxy's own paths."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        try:
            _check_request(request, request_id)
            return await handler(request)
        except UnitProxyError as exc:
            return error_response(exc, id_to_answer(request_id), unit_id)
        except web.HTTPException as refusal:
            if isinstance(refusal, web.HTTPNotFound) and not _own_path(request.path):
                return not_found(id_to_answer(request_id), unit_id)
            err = _from_http_exception(request, refusal)
            if not isinstance(refusal, web.HTTPMethodNotAllowed):
                return error_response(err, id_to_answer(request_id), unit_id)
            allow = ", ".join(sorted(refusal.allowed_methods))
            if _api_path(request.path):  # as vLLM's server (FastAPI) answers it
                return detail_response(
                    405, "Method Not Allowed", id_to_answer(request_id), unit_id, allow
                )
            response = error_response(err, id_to_answer(request_id), unit_id)
            response.headers["Allow"] = allow
            return response
        except web.RequestPayloadError as unreadable:  # e.g. not the gzip it claims
            err = InvalidRequest(
                f"request body could not be read: {unreadable.__cause__ or unreadable}"
            )
            return error_response(err, id_to_answer(request_id), unit_id)

    return errors


def _check_request(request: web.Request, request_id: str | None) -> None:
    if request_id is not None and (problem := bad_request_id(request_id)) is not None:
        raise InvalidRequest(problem)
    if request.path in FORM_PATHS:
        if request.headers.get("Origin") is not None and request.content_type in FORM_TYPES:
            # a form a web page posts cross-site with no preflight; SDKs send no Origin
            raise Forbidden(
                "a form body from a browser (Origin header) is refused", code="browser_request"
            )
        return
    if request.path.startswith("/v1/") and request.content_type in FORM_TYPES:
        raise InvalidRequest(
            f"content-type {request.content_type} is not accepted: send application/json"
        )


def bad_request_id(request_id: str) -> str | None:
    """Why a client's request id is refused (with a 400), or None when it is fine."""
    if _id_to_echo(request_id) is None:
        # aiohttp keeps bytes that are not UTF-8 as surrogates: they cannot be echoed.
        return f"header {REQUEST_ID_HEADER}: must be ASCII or UTF-8 text"
    if len(request_id) > MAX_REQUEST_ID:
        # It is echoed in every streamed chunk: keep it short.
        return f"header {REQUEST_ID_HEADER}: at most {MAX_REQUEST_ID} characters"
    return None


def id_to_answer(request_id: str | None) -> str | None:
    """The x-request-id of an answer to a request that came with ``request_id``: that
    one, a new one if it came with none, None if it cannot go back in a header."""
    return new_request_id() if request_id is None else _id_to_echo(request_id)


def _id_to_echo(request_id: str | None) -> str | None:
    """The request id, if there is one that can go back in a header; else None."""
    if request_id is None:
        return None
    try:
        request_id.encode()
    except UnicodeEncodeError:
        return None
    return request_id


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> UnitProxyError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return PayloadTooLarge(f"request body over the limit of {request.client_max_size} bytes")
    if isinstance(exc, web.HTTPNotFound):
        return NotFound(f"no route {request.method} {request.path}", code="unknown_path")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return MethodNotAllowed(
            f"method {request.method} is not allowed on {request.path}; use {allowed}"
        )
    return InvalidRequest(f"{exc.status} {exc.reason}")


def check_admin(request: web.Request, token: str | None) -> None:
    """Allow an /admin request, or raise.

    With a token: 401 without 'Authorization: Bearer', 403 with a wrong one (a web page
    cannot send that header to another site without asking it first). Without: only
    loopback clients, and nothing a web page open on that machine may send without
    asking (a form body): 403. A request that names its Origin comes from a browser:
    403 either way, as an admin call comes from a tool.
    """
    if request.headers.get("Origin") is not None:
        raise Forbidden(
            "admin routes refuse browser requests (Origin header)", code="browser_request"
        )
    if token is None:
        if request.content_type in BROWSER_TYPES:
            raise Forbidden(
                f"admin routes refuse a {request.content_type} body (what a web form sends): "
                "send none",
                code="browser_request",
            )
        if not is_loopback(request.remote):
            raise Forbidden(
                "admin routes take loopback clients only when no admin token is set",
                code="not_loopback",
            )
        return
    given = request.headers.get("Authorization", "")
    if not given.startswith("Bearer "):
        raise Unauthenticated(
            "admin routes need 'Authorization: Bearer TOKEN'", code="missing_token"
        )
    if not hmac.compare_digest(given.removeprefix("Bearer ").encode(), token.encode()):
        raise Forbidden("the admin token is not valid", code="invalid_token")


# What an HTML form posts (text/plain too): sent cross-site without a CORS preflight.
BROWSER_TYPES = frozenset({*FORM_TYPES, "text/plain"})


def is_loopback(remote: str | None) -> bool:
    try:
        address = ipaddress.ip_address((remote or "").split("%", 1)[0])
    except ValueError:
        return False  # a Unix socket or an unknown peer: not known to be local
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def describe_admin(token: str | None) -> str:
    """For the start-up log: who may call /admin routes."""
    if token is None:
        return "admin routes: loopback clients only (no server.admin_token)"
    return "admin routes: need server.admin_token"


def admin_drain(
    drain: Callable[[], None], token: str | None, describe: Callable[[], dict[str, Any]]
) -> Handler:
    """POST /admin/drain: start a drain; 202 with the state it leaves."""

    async def handle(request: web.Request) -> web.StreamResponse:
        check_admin(request, token)
        drain()
        return json_response(describe(), status=202)

    return handle


class OneLineBadRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (an HTTP/2 preface, garbage) as an ERROR
    with a traceback; it is the client's mistake, answered with 400: one WARNING line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            why = " ".join(str(exc.message).split())[:200]
            record.msg, record.args = f"{record.getMessage()}: {exc.code} {why}", ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


def quiet_bad_requests() -> None:
    """Install OneLineBadRequests on aiohttp's server logger (once)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLineBadRequests) for f in logger.filters):
        logger.addFilter(OneLineBadRequests())

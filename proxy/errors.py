"""The unitproxy error tree, and its one mapping to HTTP status and gRPC code.

    UnitProxyError                 500  INTERNAL
    ├── InvalidRequest             400  INVALID_ARGUMENT   malformed JSON, bad field (``param`` names it)
    ├── MethodNotAllowed           405  UNIMPLEMENTED      a known path with the wrong method (``allow``)
    ├── Unauthenticated            401  UNAUTHENTICATED    missing or bad API key
    ├── Forbidden                  403  PERMISSION_DENIED  a token that does not allow this
    ├── NotFound                   404  NOT_FOUND          unknown model or path
    ├── RequestTimeout             408  DEADLINE_EXCEEDED  the client took too long to send its request
    ├── PayloadTooLarge            413  INVALID_ARGUMENT   body or prompt over the limit
    ├── Overloaded                 429  RESOURCE_EXHAUSTED at capacity: retry elsewhere
    ├── Unavailable                503  UNAVAILABLE        not SERVING, draining, no unit can serve
    │   └── UnitFailed             503  UNAVAILABLE        the unit failed under a running request
    │                                                      (code ``unit_failed``: a gateway migrates it)
    ├── DeadlineExceeded           504  DEADLINE_EXCEEDED  the request's deadline passed
    ├── VersionNotSupported        505  UNIMPLEMENTED      an HTTP version other than 1.x
    └── EngineError                500  INTERNAL           the engine failed this request
        └── EngineDeadError        503  UNAVAILABLE        the engine is gone: nothing more will run

The base and the errors an engine raises (InvalidRequest, NotFound, Overloaded,
Unavailable, EngineError, EngineDeadError) are defined in ``engine/errors.py``, so an
engine needs nothing from the proxy; they are imported here, and the proxy's code takes
every error from this module. Lower-layer exceptions are turned into these once, at the
edge that sees them, with ``raise ... from exc``. The HTTP and gRPC front ends read
``http_status`` and ``grpc_code`` from the class and nothing else.
"""

from __future__ import annotations

import grpc

from engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequest,
    NotFound,
    Overloaded,
    Unavailable,
    UnitProxyError,
)

__all__ = [
    "GRPC_CODE_KEY",
    "DeadlineExceeded",
    "EngineDeadError",
    "EngineError",
    "Forbidden",
    "InvalidRequest",
    "MethodNotAllowed",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "RequestTimeout",
    "Unauthenticated",
    "Unavailable",
    "UnitFailed",
    "UnitProxyError",
    "VersionNotSupported",
    "write_timeout",
]

# gRPC trailing metadata key that carries an error's ``code`` (as ``error.code`` does in an
# HTTP error body), so a gateway can tell a unit's refusal from its failure.
GRPC_CODE_KEY = "x-unitproxy-code"


class MethodNotAllowed(UnitProxyError):
    http_status = 405
    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    error_type = "method_not_allowed"


class Unauthenticated(UnitProxyError):
    http_status = 401
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    error_type = "authentication_error"


class Forbidden(UnitProxyError):
    http_status = 403
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    error_type = "permission_error"


class RequestTimeout(UnitProxyError):
    http_status = 408
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    error_type = "request_timeout"


def write_timeout(limit_s: float) -> RequestTimeout:
    """A gRPC client that took no message for ``server.write_timeout_s`` (an HTTP one
    has its connection closed instead)."""
    return RequestTimeout(
        f"the client took no message for {limit_s:g} s (server.write_timeout_s)",
        code="write_timeout",
    )


class PayloadTooLarge(UnitProxyError):
    http_status = 413
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "request_too_large"


class UnitFailed(Unavailable):
    """The unit let go of a request in flight: a node failed, the engine died or hung,
    or the sidecar stopped at once. Type and code ``unit_failed`` on every wire, so a
    gateway can tell it from a failure of the request itself and resume it elsewhere."""

    error_type = "unit_failed"


class DeadlineExceeded(UnitProxyError):
    http_status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    error_type = "timeout_error"


class VersionNotSupported(UnitProxyError):
    """A request line of an HTTP version other than 1.0 and 1.1 (HTTP/2 is spoken on the
    gRPC port, never upgraded to on the HTTP one)."""

    http_status = 505
    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    error_type = "http_version_not_supported"

"""The errors an engine raises, each with what it means on every wire.

    UnitProxyError                 500  INTERNAL           the base: any answered failure
    ├── InvalidRequest             400  INVALID_ARGUMENT   malformed JSON, bad field (``param`` names it)
    ├── NotFound                   404  NOT_FOUND          unknown model or path
    ├── Overloaded                 429  RESOURCE_EXHAUSTED at capacity: retry elsewhere
    ├── Unavailable                503  UNAVAILABLE        cannot serve now
    └── EngineError                500  INTERNAL           the engine failed this request
        └── EngineDeadError        503  UNAVAILABLE        the engine is gone: nothing more will run

An engine raises these and nothing else per request; the server that embeds it answers
each one by reading ``http_status``, ``grpc_code`` and ``body()`` from it. The proxy adds
the errors only it raises (authentication, limits, deadlines, unit failure) under the
same base in ``proxy/errors.py``, which draws the whole tree.
"""

from __future__ import annotations

from typing import Any, ClassVar

import grpc
from pydantic import ValidationError


class UnitProxyError(Exception):
    http_status: ClassVar[int] = 500
    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    error_type: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.error_type

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(UnitProxyError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"


class NotFound(UnitProxyError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    error_type = "not_found_error"


class Overloaded(UnitProxyError):
    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    error_type = "overloaded_error"

    def __init__(self, message: str, *, retry_after_s: int = 1, code: str | None = None):
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class Unavailable(UnitProxyError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "unavailable_error"


class EngineError(UnitProxyError):
    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    error_type = "engine_error"


class EngineDeadError(EngineError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "engine_dead"


def invalid_fields(exc: ValidationError) -> InvalidRequest:
    """A request body that failed validation, as the 400 that names the field."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return InvalidRequest(f"request body is not valid JSON: {err['ctx']['error']}")
    if err["type"] in ("model_type", "model_attributes_type") and not err["loc"]:
        return InvalidRequest("request body must be a JSON object")
    loc = [str(p) for p in err["loc"] if not _is_union_tag(str(p))]
    field = ".".join(loc)
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "missing":
        return InvalidRequest(f"{field}: required field is missing", param=field or None)
    if not field:
        return InvalidRequest(msg)
    return InvalidRequest(f"{field}: {msg}", param=field)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _is_union_tag(part: str) -> bool:
    # pydantic names the union member that failed inside the location; users
    # want the field, not the member.
    return part in _TYPE_TAGS or part.startswith(("list[", "dict[", "function-", "nullable["))

"""The error tree maps each class to its documented HTTP status and gRPC code, once."""

from __future__ import annotations

import json

import grpc
import pytest

from proxy import errors
from proxy.errors import (
    DeadlineExceeded,
    EngineDeadError,
    EngineError,
    Forbidden,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    Unauthenticated,
    Unavailable,
    UnitFailed,
    UnitProxyError,
    VersionNotSupported,
)

pytestmark = pytest.mark.timeout(10)

# The table in proxy/errors.py's docstring and in docs/api.md (Errors).
MAPPING: list[tuple[type[UnitProxyError], int, grpc.StatusCode]] = [
    (UnitProxyError, 500, grpc.StatusCode.INTERNAL),
    (InvalidRequest, 400, grpc.StatusCode.INVALID_ARGUMENT),
    (MethodNotAllowed, 405, grpc.StatusCode.UNIMPLEMENTED),
    (Unauthenticated, 401, grpc.StatusCode.UNAUTHENTICATED),
    (Forbidden, 403, grpc.StatusCode.PERMISSION_DENIED),
    (NotFound, 404, grpc.StatusCode.NOT_FOUND),
    (RequestTimeout, 408, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PayloadTooLarge, 413, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, 429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, 503, grpc.StatusCode.UNAVAILABLE),
    (UnitFailed, 503, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, 504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (VersionNotSupported, 505, grpc.StatusCode.UNIMPLEMENTED),
    (EngineError, 500, grpc.StatusCode.INTERNAL),
    (EngineDeadError, 503, grpc.StatusCode.UNAVAILABLE),
]


@pytest.mark.parametrize(
    ("cls", "status", "code"), MAPPING, ids=lambda v: getattr(v, "__name__", None)
)
def test_status_and_code(cls: type[UnitProxyError], status: int, code: grpc.StatusCode) -> None:
    assert cls.http_status == status
    assert cls.grpc_code == code
    err = cls("boom")
    assert isinstance(err, UnitProxyError)
    assert err.http_status == status and err.grpc_code == code


def test_every_error_class_is_in_the_table() -> None:
    defined = {
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, UnitProxyError)
    }
    assert defined == {cls for cls, _, _ in MAPPING}


def test_engine_dead_is_an_engine_error() -> None:
    # Code that catches EngineError also sees the engine dying.
    assert issubclass(EngineDeadError, EngineError)
    with pytest.raises(EngineError):
        raise EngineDeadError("gone")


def test_error_types_are_distinct() -> None:
    types = [cls.error_type for cls, _, _ in MAPPING]
    assert len(set(types)) == len(types)


@pytest.mark.parametrize("cls", [cls for cls, _, _ in MAPPING], ids=lambda c: c.__name__)
def test_body_has_the_openai_shape(cls: type[UnitProxyError]) -> None:
    body = cls("something went wrong").body()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] == "something went wrong"
    assert body["error"]["type"] == cls.error_type
    assert body["error"]["param"] is None
    assert body["error"]["code"] == cls.error_type  # code defaults to the type
    assert json.loads(json.dumps(body)) == body


def test_body_carries_param_and_code() -> None:
    err = NotFound("model 'x' is not served here", param="model", code="model_not_found")
    assert err.body() == {
        "error": {
            "message": "model 'x' is not served here",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert str(err) == "model 'x' is not served here"


def test_overloaded_keeps_retry_after() -> None:
    err = Overloaded("unit-0 is at capacity", retry_after_s=3)
    assert err.retry_after_s == 3
    assert Overloaded("full").retry_after_s == 1
    assert err.body()["error"]["type"] == "overloaded_error"


def test_unit_failed_says_so_in_its_code() -> None:
    body = UnitFailed("unit u failed: NOT_SERVING").body()["error"]
    assert (body["code"], body["type"]) == ("unit_failed", "unit_failed")
    assert isinstance(UnitFailed("x"), Unavailable)

"""``multipart/form-data`` bodies (the audio routes), read from bytes already in memory.

The body is the one the server already read whole, within ``server.max_body_bytes``:
nothing here reads a socket, writes a temporary file or holds more than that body and,
for ``parse``, the parts' values. The parts are bounded in number (``MAX_PARTS``) and
each part's head in size (``MAX_PART_HEAD``) and in header lines (``MAX_PART_HEADERS``).
A body that does not parse is ``InvalidRequest`` (400) naming what is wrong; one that is
no well-formed form is ``MalformedForm``, which carries the ``detail`` vLLM's server
(starlette) answers it with.

The gateway calls ``model_of`` for the one field it routes by (``model``): it walks
the parts' heads and copies that field's value only, never the file's bytes. The sidecar
calls ``parse`` to hand every part to its engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import parse_qsl

from proxy.errors import InvalidRequest

FORM_TYPE = "multipart/form-data"
URLENCODED_TYPE = "application/x-www-form-urlencoded"
MAX_PARTS = 64
MAX_PART_HEAD = 8 * 1024  # bytes of one part's header lines
MAX_PART_HEADERS = 16
MAX_FIELD_CHARS = 64 * 1024  # a text field's value (a file's is bounded by the body)
# RFC 2046 section 5.1.1: 1 to 70 characters, of these (a space not last).
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
_PARAM = re.compile(r';\s*([A-Za-z0-9_*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')


# vLLM's server's (starlette's) 400 details for a multipart body that is no form.
INVALID = "Invalid multipart data."
NO_BOUNDARY = "Missing boundary in multipart."
NO_NAME = 'The Content-Disposition header field "name" must be provided.'


class MalformedForm(InvalidRequest):
    """A multipart body that is no well-formed form: vLLM's server answers it 400
    ``{"detail": detail}`` (the message says more, for logs and the gateway's own)."""

    def __init__(self, message: str, detail: str = INVALID):
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    data: bytes
    filename: str | None = None  # set: a file
    content_type: str | None = None


def kind_of(content_type: str | None) -> str:
    """A content type's media type, lower case, without its parameters."""
    return (content_type or "").partition(";")[0].strip().lower()


def boundary_of(content_type: str | None) -> bytes:
    """The boundary of a ``multipart/form-data`` content type; 400 for another type."""
    params = (content_type or "").partition(";")[2]
    if kind_of(content_type) != FORM_TYPE:
        raise InvalidRequest(
            f"content-type must be {FORM_TYPE} (the audio routes take a form with a file)"
        )
    found = _params(";" + params).get("boundary")
    if found is None or not _BOUNDARY.fullmatch(found):
        message = f"content-type {FORM_TYPE}: no valid boundary parameter"
        raise MalformedForm(message, NO_BOUNDARY if found is None else INVALID)
    return found.encode("ascii")


def field(body: bytes, content_type: str | None, name: str) -> str | None:
    """The value of text field ``name`` (its first), None when the form has none."""
    for head, start, end in _parts(body, boundary_of(content_type)):
        got, filename, _ = _disposition(head)
        if got == name and filename is None:
            return _text(name, body[start:end])
    return None


def model_of(body: bytes, content_type: str | None) -> str | None:
    """The model an audio request names, to route it by: a form's model field. A body
    or an url-encoded form's (its last, as FastAPI reads it). A body of another type is
    no form to vLLM's server (no field: it refuses the missing file, or has no such route
    for its model); routed by its JSON object's ``model``, it gets the answer of a unit
    that serves that model. None when it names none."""
    kind = kind_of(content_type)
    if kind == FORM_TYPE:
        return field(body, content_type, "model")
    if kind == URLENCODED_TYPE:
        model = None
        for name, value in urlencoded(body):
            if name == "model":
                model = value
        return model
    try:
        fields = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = fields.get("model") if isinstance(fields, dict) else None
    return model if isinstance(model, str) else None


def urlencoded(body: bytes) -> list[tuple[str, str]]:
    """An url-encoded form's fields, as vLLM's server (starlette) reads them, at most
    ``MAX_PARTS``."""
    try:
        return parse_qsl(body.decode("latin-1"), keep_blank_values=True, max_num_fields=MAX_PARTS)
    except ValueError:
        raise InvalidRequest(f"form body: more than {MAX_PARTS} fields") from None


def parse(body: bytes, content_type: str | None) -> list[Part]:
    """Every part of the form, in order."""
    parts = []
    for head, start, end in _parts(body, boundary_of(content_type)):
        name, filename, ctype = _disposition(head)
        data = body[start:end]
        if filename is None:
            _text(name, data)  # a text field must be UTF-8 and bounded
        parts.append(Part(name, data, filename, ctype))
    return parts


def _parts(body: bytes, boundary: bytes) -> Iterator[tuple[dict[str, str], int, int]]:
    """Each part's headers and where its value lies in ``body``."""
    delimiter = b"--" + boundary
    if not body:
        return  # no part: a form with no field, to vLLM's server too
    at = body.find(delimiter)
    if at < 0 or (at > 0 and body[at - 2 : at] != b"\r\n"):
        raise MalformedForm("multipart body: no opening boundary")
    at += len(delimiter)
    count = 0
    while True:
        if body.startswith(b"--", at):
            return  # the closing delimiter; the epilogue is ignored
        line_end = body.find(b"\r\n", at)
        if line_end < 0 or body[at:line_end].strip(b" \t"):
            raise MalformedForm("multipart body: a boundary line is malformed")
        count += 1
        if count > MAX_PARTS:
            raise InvalidRequest(f"multipart body: more than {MAX_PARTS} parts")
        head_start = line_end + 2
        head_end = body.find(b"\r\n\r\n", head_start - 2, head_start + MAX_PART_HEAD)
        if head_end < 0:
            raise InvalidRequest(
                f"multipart body: a part's headers do not end within {MAX_PART_HEAD} bytes"
            )
        head = _headers(body[head_start:head_end])
        start = head_end + 4
        end = body.find(b"\r\n" + delimiter, start - 2)
        if end < start:
            raise MalformedForm("multipart body: a part is not closed by the boundary")
        yield head, start, end
        at = end + 2 + len(delimiter)


def _headers(raw: bytes) -> dict[str, str]:
    lines = raw.split(b"\r\n") if raw else []
    if len(lines) > MAX_PART_HEADERS:
        raise InvalidRequest(f"multipart body: a part has more than {MAX_PART_HEADERS} headers")
    headers = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name.strip():
            raise MalformedForm("multipart body: a part header is malformed")
        try:
            headers[name.strip().decode("ascii").lower()] = value.strip().decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedForm("multipart body: a part header is not UTF-8") from None
    return headers


def _disposition(head: dict[str, str]) -> tuple[str, str | None, str | None]:
    """A part's field name, file name (None: a text field) and content type."""
    value = head.get("content-disposition", "")
    kind, _, params = value.partition(";")
    found = _params(";" + params)
    name = found.get("name")
    if kind.strip().lower() != "form-data" or name is None:
        raise MalformedForm(
            "multipart body: a part has no Content-Disposition: form-data; name=...", NO_NAME
        )
    return name, found.get("filename"), head.get("content-type")


def _params(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for key, value in _PARAM.findall(text):
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        found.setdefault(key.lower(), value)
    return found


def _text(name: str, data: bytes) -> str:
    if len(data) > MAX_FIELD_CHARS:
        raise InvalidRequest(
            f"multipart field {name!r}: longer than {MAX_FIELD_CHARS} bytes", param=name
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"multipart field {name!r}: not UTF-8 text", param=name) from None

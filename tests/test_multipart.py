"""proxy/multipart.py: forms as real clients encode them, and the bounds on what it reads."""

from __future__ import annotations

import aiohttp
import pytest

from proxy import multipart
from proxy.errors import InvalidRequest


async def encoded(form: aiohttp.FormData) -> tuple[bytes, str]:
    writer = form()
    return await writer.as_bytes(), writer.content_type


async def test_a_form_as_aiohttp_encodes_it() -> None:
    form = aiohttp.FormData()
    form.add_field("model", "whisper-ü")
    form.add_field("timestamp_granularities[]", "word")
    form.add_field("timestamp_granularities[]", "segment")
    form.add_field("prompt", "")
    audio = bytes(range(256)) + b"\r\n--not-the-boundary\r\n"
    form.add_field("file", audio, filename="clip-1.wav", content_type="audio/wav")
    body, ctype = await encoded(form)
    parts = multipart.parse(body, ctype)
    assert [p.name for p in parts] == ["model", "timestamp_granularities[]",
                                       "timestamp_granularities[]", "prompt", "file"]  # fmt: skip
    assert parts[0].data.decode() == "whisper-ü" and parts[0].filename is None
    assert parts[3].data == b""
    assert parts[4].data == audio, "a file's bytes, CRLFs and dashes included"
    assert (parts[4].filename, parts[4].content_type) == ("clip-1.wav", "audio/wav")
    assert multipart.field(body, ctype, "model") == "whisper-ü"
    assert multipart.field(body, ctype, "language") is None


def test_the_model_field_is_found_without_reading_past_it() -> None:
    head = b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--b\r\n'
    # what follows the model field is not read: a broken part there does not matter
    assert multipart.field(head + b"garbage", "multipart/form-data; boundary=b", "model") == "m"
    with pytest.raises(InvalidRequest, match="headers do not end"):
        multipart.parse(head + b"garbage", "multipart/form-data; boundary=b")


@pytest.mark.parametrize(
    ("ctype", "body", "message"),
    [
        ("text/plain", b"", "content-type must be multipart/form-data"),
        ("multipart/form-data; boundary=" + "x" * 71, b"", "no valid boundary"),
        ("multipart/form-data; boundary=b", b"preamble--b\r\n", "no opening boundary"),
        ("multipart/form-data; boundary=b", b"--b junk\r\n", "boundary line is malformed"),
        ("multipart/form-data; boundary=b",
         b"--b\r\nContent-Disposition: attachment\r\n\r\nv\r\n--b--", "no Content-Disposition"),
        ("multipart/form-data; boundary=b",
         b"--b\r\nContent-Disposition: form-data; name=x\r\n\r\n" + "é".encode("latin-1")
         + b"\r\n--b--", "not UTF-8 text"),
        ("multipart/form-data; boundary=b",
         b"--b\r\nX: " + b"v" * multipart.MAX_PART_HEAD + b"\r\n\r\nv\r\n--b--",
         "do not end within"),
        ("multipart/form-data; boundary=b",
         b"--b\r\nContent-Disposition: form-data; name=x\r\n\r\n"
         + b"v" * (multipart.MAX_FIELD_CHARS + 1) + b"\r\n--b--", "longer than"),
    ],
)  # fmt: skip
def test_what_does_not_parse_is_a_400_saying_why(ctype: str, body: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as refused:
        multipart.parse(body, ctype)
    assert refused.value.http_status == 400


@pytest.mark.parametrize(
    ("ctype", "body", "detail"),
    [
        ("multipart/form-data", b"--b\r\n", multipart.NO_BOUNDARY),
        ("multipart/form-data; boundary=b", b"garbage", multipart.INVALID),
        ("multipart/form-data; boundary=b", b"--bjunk\r\n", multipart.INVALID),
        ("multipart/form-data; boundary=b",
         b"--b\r\nnocolon\r\n\r\nv\r\n--b--\r\n", multipart.INVALID),
        ("multipart/form-data; boundary=b",
         b"--b\r\nContent-Disposition: form-data\r\n\r\nv\r\n--b--\r\n", multipart.NO_NAME),
    ],
)  # fmt: skip
def test_a_body_that_is_no_form_carries_vllms_detail(ctype: str, body: bytes, detail: str) -> None:
    """What vLLM's server (starlette) answers these with: 400 {"detail": ...}."""
    with pytest.raises(multipart.MalformedForm) as refused:
        multipart.parse(body, ctype)
    assert refused.value.detail == detail and refused.value.http_status == 400
    # a bound of unitproxy's own is no malformed form: its error body stays
    many = b"".join(
        b"--b\r\nContent-Disposition: form-data; name=f\r\n\r\nv\r\n" for _ in range(65)
    )
    with pytest.raises(InvalidRequest, match="more than 64 parts") as bound:
        multipart.parse(many + b"--b--", "multipart/form-data; boundary=b")
    assert not isinstance(bound.value, multipart.MalformedForm)


def test_an_empty_multipart_body_is_a_form_with_no_field() -> None:
    assert multipart.parse(b"", "multipart/form-data; boundary=b") == []
    assert multipart.model_of(b"", "multipart/form-data; boundary=b") is None


def test_an_urlencoded_forms_model_is_read_as_fastapi_reads_it() -> None:
    ctype = "application/x-www-form-urlencoded"
    assert multipart.model_of(b"language=en&model=speech+one&x=%C3%BC", ctype) == "speech one"
    assert multipart.model_of(b"model=a&model=b", ctype) == "b"  # the last, as FastAPI
    assert multipart.model_of(b"language=en", ctype) is None
    with pytest.raises(InvalidRequest, match="more than 64 fields"):
        multipart.model_of(b"&".join(b"f=v" for _ in range(65)), ctype)

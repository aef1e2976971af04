"""Inference.Generate over HTTP/1.1: the unit leg of a gateway's gRPC calls.

grpcio costs about a tenth of a millisecond of CPU per message read or written, in
the unit that writes it and again in the gateway that reads it, so the gateway calls
its units' Generate over their HTTP port instead, in the gRPC-Web framing: the body
of ``POST /unitproxy.v1.Inference/Generate`` (``application/grpc-web+proto``) is the
serialized GenerateRequest in one frame, and the response body is a stream of frames,
each a flag byte, a 4-byte big-endian length and that many bytes: flag 0 a serialized
GenerateChunk, flag 0x80 the trailers that end the call (``grpc-status``,
``grpc-message`` and the error's ``x-unitproxy-code``, HTTP/1 header lines). The
response head goes out with the first frame, so the gateway's response timeout reads
as it does on gRPC. The gateway reads the frames in the connection's callback and
passes them on as the bytes that came; the client still speaks real gRPC.

A token costs little next to a message (a socket write and read in the unit, the
gateway and the client, each about a tenth of a millisecond on gRPC), so the gateway
asks the unit (``INTERVAL_HEADER``; ``gateway.grpc_interval_ms`` and, with many
streams in flight, ``gateway.grpc_messages_per_s``) to send a stream's messages at
most that often: the first at once, and each later one with every token made
meanwhile.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

import grpc

from proxy.errors import GRPC_CODE_KEY

PATH = "/unitproxy.v1.Inference/Generate"
CONTENT_TYPE = "application/grpc-web+proto"
TRAILERS = 0x80
INTERVAL_HEADER = "x-unitproxy-interval-ms"
MAX_INTERVAL_MS = 1000.0
MAX_FRAME = 64 * 1024 * 1024  # a frame claiming more than this is not a stream of ours
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def interval_s(raw: str | None) -> float:
    """The spacing a gateway asked for, in s: 0 when absent or not a number, at most
    ``MAX_INTERVAL_MS``."""
    try:
        ms = float(raw) if raw else 0.0
    except ValueError:
        return 0.0
    return min(ms, MAX_INTERVAL_MS) / 1000 if ms > 0 else 0.0  # NaN is not > 0


def frame(message: bytes, flag: int = 0) -> bytes:
    return bytes((flag,)) + len(message).to_bytes(4, "big") + message


def trailers(code: grpc.StatusCode, message: str = "", error_code: str | None = None) -> bytes:
    """The frame that ends a call with ``code``."""
    lines = [f"grpc-status: {code.value[0]}\r\n"]
    if message:
        lines.append(f"grpc-message: {quote(message, safe=' ')}\r\n")
    if error_code:
        lines.append(f"{GRPC_CODE_KEY}: {quote(error_code, safe='')}\r\n")
    return frame("".join(lines).encode(), TRAILERS)


OK_TRAILERS = trailers(grpc.StatusCode.OK)


class Status:
    """How a call ended, from its trailers frame."""

    __slots__ = ("code", "error_code", "message")

    def __init__(self, raw: bytes):
        fields: dict[str, str] = {}
        for line in raw.decode("utf-8", "replace").split("\r\n"):
            name, colon, value = line.partition(":")
            if colon:
                fields[name.strip().lower()] = value.strip()
        try:
            self.code = _CODES[int(fields.get("grpc-status", ""))]
        except (ValueError, KeyError):
            self.code = grpc.StatusCode.UNKNOWN
        self.message = unquote(fields.get("grpc-message", ""))
        raw_code = fields.get(GRPC_CODE_KEY)
        self.error_code = None if raw_code is None else unquote(raw_code)


class FrameError(Exception):
    """The body is not a stream of frames."""


class Frames:
    """Splits the bytes of a response body, as they come, into messages and the end."""

    __slots__ = ("_buf", "status")

    def __init__(self) -> None:
        self._buf = b""
        self.status: Status | None = None  # set by the trailers frame: the call is over

    def feed(self, data: bytes) -> list[bytes]:
        """The whole messages in what came so far; raises FrameError on garbage."""
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        at, end = 0, len(buf)
        while end - at >= 5 and self.status is None:
            flag = buf[at]
            size = int.from_bytes(buf[at + 1 : at + 5], "big")
            if size > MAX_FRAME or flag not in (0, TRAILERS):
                raise FrameError(f"not a gRPC-Web frame (flag {flag}, {size} bytes)")
            if end - at - 5 < size:
                break
            body = buf[at + 5 : at + 5 + size]
            at += 5 + size
            if flag == TRAILERS:
                self.status = Status(body)
            else:
                out.append(body)
        if self.status is not None and at < end:
            raise FrameError("bytes after the trailers")
        self._buf = buf[at:] if at < end else b""
        return out


def one_message(body: bytes) -> bytes:
    """The message of a request body of exactly one data frame; raises FrameError."""
    if len(body) < 5 or body[0] != 0 or int.from_bytes(body[1:5], "big") != len(body) - 5:
        raise FrameError("the body is not one gRPC-Web message frame")
    return body[5:]

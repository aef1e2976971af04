"""What a stream delivered to its client, and the request that resumes it elsewhere.

A streamed response is kept as the bytes (SSE events or serialized GenerateChunks) that
went to the client and is read only when its unit fails: the happy path pays one list
append per read. Past ``FOLD_AT`` bytes what was kept is read into text and dropped, so
a stream of any length holds at most ``FOLD_AT`` bytes plus the text it delivered.

The resumed request is the original with the delivered output appended (a completion's
prompt, a chat's partial assistant message that the engine continues, or token ids) and
a hint header for the sidecar (``RESUME_HEADER``): the ``created`` the client saw and how
much of the input is delivered output, so that the unit reduces ``max_tokens``, drops
the chat role chunk and counts usage as for one request. The hint is signed with
``server.resume_secret`` (``proxy.resume.HintKey``): units take no hint without it. The response bytes of the new
unit then go to the client as they come.
"""

from __future__ import annotations

import json
from array import array
from types import FunctionType
from typing import Any, Final

from proxy.pb.unitproxy.v1.inference_pb2 import ChatMessage, GenerateChunk, GenerateRequest
from proxy.resume import HintKey, ResumeHint

FOLD_AT = 64 * 1024  # bytes kept raw before they are read into text
_CHAT_DELTA_KEYS = frozenset({"role", "content"})


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class SseTranscript:
    """The SSE events one client got, read into text on demand."""

    __slots__ = (
        "_parts", "_raw", "_size", "_text", "created", "done", "finished", "resumable", "usage",
    )  # fmt: skip

    def __init__(self) -> None:
        self._raw: list[bytes] = []
        self._size = 0
        self._parts: list[str] = []
        self._text = ""
        self.created: int | None = None
        self.finished = False  # a finish_reason or [DONE] went out
        self.done = False  # [DONE] went out
        self.resumable = True  # False: output that text cannot carry (tool calls, n > 1)
        self.usage: Any = None  # the last usage object a chunk carried

    def add(self, events: bytes) -> None:
        """Whole events, as written to the client."""
        self._raw.append(events)
        self._size += len(events)
        if self._size > FOLD_AT:
            self._fold()

    @property
    def kept_bytes(self) -> int:
        return self._size + len(self._text)

    def text(self) -> str:
        self._fold()
        return self._text

    def _fold(self) -> None:
        raw = b"".join(self._raw)
        self._raw, self._size = [], 0
        for event in raw.split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._read(line[5:].strip())
        self._text += "".join(self._parts)  # one string, not an object per token
        self._parts = []

    def _read(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            self.finished = self.done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.resumable = False
            return
        if not isinstance(chunk, dict):
            self.resumable = False
            return
        if self.created is None and isinstance(chunk.get("created"), int):
            self.created = chunk["created"]
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            self._read_choice(choice)

    def _read_choice(self, choice: Any) -> None:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            self.resumable = False  # n > 1: one text cannot resume several choices
            return
        if choice.get("finish_reason") is not None:
            self.finished = True
        delta = choice.get("delta")
        if isinstance(delta, dict):  # chat
            if any(v is not None for k, v in delta.items() if k not in _CHAT_DELTA_KEYS):
                self.resumable = False  # tool calls, reasoning: not plain text to continue
            text = delta.get("content")
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self._parts.append(text)


# GenerateChunk.usage and, in Usage, prompt_tokens and completion_tokens (inference.proto)
_USAGE_FIELD: Final = 5
_PROMPT_FIELD: Final = 1
_COMPLETION_FIELD: Final = 2
_UINT32: Final = 0xFFFFFFFF


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at ``at`` and where it ends; (-1, -1) where it does not end in 10
    bytes or in ``data``."""
    value = 0
    shift = 0
    end = len(data)
    while at < end and shift < 70:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    return -1, -1


def _skip(data: bytes, at: int, wire: int) -> int:
    """Where the field of wire type ``wire`` whose value starts at ``at`` ends (-1:
    a wire type this reader does not step over, or past the end)."""
    if wire == 0:
        return _varint(data, at)[1]
    if wire == 2:
        n, at = _varint(data, at)
        return -1 if at < 0 or at + n > len(data) else at + n
    if wire == 1:
        return at + 8 if at + 8 <= len(data) else -1
    if wire == 5:
        return at + 4 if at + 4 <= len(data) else -1
    return -1  # groups (3, 4): not in these messages


def chunk_usage(message: bytes) -> tuple[int, int] | None:
    """A serialized GenerateChunk's usage (prompt, completion), read from its wire
    format without the rest of it: of a well-formed message, what
    ``GenerateChunk.FromString(message)`` says (``usage`` where ``HasField("usage")``,
    its fields merged where it comes more than once), at a tenth of the cost when
    compiled (a message object and its attributes are some thousands of instructions
    each). None: no usage field, or a message this reader does not step through."""
    prompt = completion = 0
    seen = False
    at = 0
    end = len(message)
    while at < end:
        tag = message[at]  # a field number below 16: one byte
        if tag < 0x80:
            at += 1
        else:
            tag, at = _varint(message, at)
            if at < 0:
                return None
        field, wire = tag >> 3, tag & 7
        if field != _USAGE_FIELD or wire != 2:
            at = _skip(message, at, wire)
            if at < 0:
                return None
            continue
        n, at = _varint(message, at)
        if at < 0 or at + n > end:
            return None
        seen = True
        stop = at + n
        while at < stop:
            tag, at = _varint(message, at)
            if at < 0 or at > stop:
                return None
            field, wire = tag >> 3, tag & 7
            if wire != 0 or field > _COMPLETION_FIELD:  # total_tokens, or a field unknown
                at = _skip(message, at, wire)
                if at < 0 or at > stop:
                    return None
                continue
            value, at = _varint(message, at)
            if at < 0 or at > stop:
                return None
            if field == _PROMPT_FIELD:
                prompt = value & _UINT32
            elif field == _COMPLETION_FIELD:
                completion = value & _UINT32
    return (prompt, completion) if seen else None


# Compiled (mypyc: its functions are builtins, not Python functions), reading the wire
# costs about a tenth of a parse of the chunk; interpreted, about four parses.
_WIRE_READ = not isinstance(chunk_usage, FunctionType)


class GrpcTranscript:
    """The GenerateChunks one client got (serialized), read on demand."""

    __slots__ = ("_ids", "_raw", "_size", "_text", "finish_reason", "finished", "usage")

    def __init__(self) -> None:
        self._raw: list[bytes] = []
        self._size = 0
        self._text = ""
        self._ids = array("I")  # 4 bytes a token id
        self.finished = False
        self.finish_reason = ""  # the last chunk's that had one
        self.usage: tuple[int, int] | None = None  # prompt, completion: the last chunk's

    def add(self, message: bytes) -> None:
        self._raw.append(message)
        self._size += len(message)
        if self._size > FOLD_AT:
            self._fold()

    def text(self) -> str:
        self._fold()
        return self._text

    def token_ids(self) -> list[int]:
        self._fold()
        return list(self._ids)

    def output_tokens(self) -> int:
        self._fold()
        return len(self._ids)

    def last_usage(self) -> tuple[int, int] | None:
        """The usage of the last chunk that carried one (prompt, completion); reads
        only the last chunk's usage field when it has one (a finished stream's does)."""
        if self._raw:
            last = self._raw[-1]
            if _WIRE_READ:
                found = chunk_usage(last)
                if found is not None:
                    return found
            else:
                chunk = GenerateChunk.FromString(last)
                if chunk.HasField("usage"):
                    return chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            self._fold()
        return self.usage

    def ending(self) -> tuple[tuple[int, int] | None, str]:
        """``last_usage`` and the finish reason of the last chunk that had one ("":
        none); reads only the last chunk when it has both (a finished stream's does)."""
        if self._raw:
            last = GenerateChunk.FromString(self._raw[-1])
            if last.HasField("usage") and last.finish_reason:
                return (last.usage.prompt_tokens, last.usage.completion_tokens), (
                    last.finish_reason
                )
            self._fold()
        return self.usage, self.finish_reason

    def _fold(self) -> None:
        parts = [self._text]
        for message in self._raw:
            chunk = GenerateChunk.FromString(message)
            parts.append(chunk.text)
            self._ids.extend(chunk.token_ids)
            if chunk.finish_reason:
                self.finished = True
                self.finish_reason = chunk.finish_reason
            if chunk.HasField("usage"):
                self.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        self._text = "".join(parts)
        self._raw, self._size = [], 0


def resume_body(route: str, body: bytes, text: str) -> bytes | None:
    """The HTTP request that continues after ``text``; None if it cannot be resumed."""
    try:
        req = json.loads(body)
    except ValueError:
        return None
    if not isinstance(req, dict) or req.get("n", 1) != 1 or req.get("echo"):
        return None
    if req.get("best_of") not in (None, 1):
        return None
    if not text:
        return body  # nothing but the head (and a role chunk) went out
    if route == "chat":
        if not _continue_chat(req, text):
            return None
    else:
        prompt = req.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None  # token ids: SSE carries text only
        req["prompt"] = prompt + text
    return _dumps(req).encode()


def _continue_chat(req: dict[str, Any], text: str) -> bool:
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        return False
    last = messages[-1]
    if req.get("continue_final_message") and isinstance(last, dict):
        # The client itself asked to continue its assistant message: extend it.
        content = last.get("content")
        if last.get("role") != "assistant" or not isinstance(content, str):
            return False
        messages[-1] = {**last, "content": content + text}
    else:
        messages.append({"role": "assistant", "content": text})
    req["continue_final_message"] = True
    req["add_generation_prompt"] = False
    return True


def resume_hint(key: HintKey, created: int | None, text: str) -> str:
    """The signed hint of an HTTP request resumed after ``text``."""
    return key.sign(ResumeHint(created, len(text)), text)


def resume_generate(
    request: bytes, transcript: GrpcTranscript, key: HintKey
) -> tuple[bytes, str] | None:
    """The GenerateRequest (and signed hint) that continues after what ``transcript``
    holds."""
    msg = GenerateRequest.FromString(request)
    kind = msg.WhichOneof("input")
    text = transcript.text()
    if kind == "prompt_token_ids":
        ids = transcript.token_ids()
        msg.prompt_token_ids.ids.extend(ids)
        return msg.SerializeToString(), key.sign(ResumeHint(delivered_tokens=len(ids)), ids)
    if kind == "prompt":
        msg.prompt += text
    elif kind == "chat":
        chat = msg.chat
        if text:
            if chat.continue_final_message and chat.messages:
                if chat.messages[-1].role != "assistant":
                    return None
                chat.messages[-1].content += text
            else:
                chat.messages.append(ChatMessage(role="assistant", content=text))
            chat.continue_final_message = True
    else:
        return None
    return msg.SerializeToString(), key.sign(ResumeHint(delivered_chars=len(text)), text)

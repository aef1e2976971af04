"""An engine's own OpenAI layer: whole requests in, response bytes out.

Engines ``vllm`` and ``openai`` serve the OpenAI routes themselves (vLLM's serving
classes in process; the upstream server over HTTP), so every field those servers
accept works with their semantics: tools, structured outputs, logprobs, ``n``,
``echo``, batched prompts. The sidecar keeps what is its own around a ``serve`` call:
admission, the outstanding count, the deadline, cancellation, headers and metrics.

A reply is either a whole body (``body``) or a stream of SSE bytes (``chunks``), each
piece one or more complete ``data:`` events ending in a blank line. Closing ``chunks``
before its end aborts the request in the engine.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

FrontendRoute = Literal[
    "completions", "chat", "tokenize", "detokenize",
    # the Responses API: create, and retrieve and cancel by id (body ``{"response_id"}``)
    "responses", "responses_retrieve", "responses_cancel",
    # the pooling routes
    "embeddings", "pooling", "classify", "score", "rerank",
    # the audio routes: a multipart form (the body's fields, files as FormFile)
    "transcriptions", "translations",
]  # fmt: skip
FORM_ROUTES: frozenset[FrontendRoute] = frozenset({"transcriptions", "translations"})


@dataclass(frozen=True, slots=True)
class FormFile:
    """A file part of a multipart request (the audio routes), as the client sent it."""

    filename: str
    content_type: str | None
    data: bytes


@dataclass(slots=True)
class Tokens:
    """What one request generated, counted by the engine as it goes (for metrics)."""

    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class FrontendRequest:
    route: FrontendRoute
    # the request's JSON object, as the client sent it; for the audio routes the form's
    # fields (text as str, a name given more than once as a list) and files (FormFile)
    body: dict[str, Any]
    request_id: str
    headers: Mapping[str, str] = field(default_factory=dict)
    # the audio routes: the body's bytes as they came (its type in ``headers``), for an
    # engine that passes the form on (``forms_as_sent``; ``body`` is then empty)
    raw: bytes = b""


@dataclass(slots=True)
class FrontendReply:
    status: int
    body: bytes | None = None  # a whole answer, JSON unless ``content_type`` says other
    chunks: AsyncGenerator[bytes, None] | None = None  # an SSE stream, when streamed
    tokens: Tokens = field(default_factory=Tokens)
    content_type: str = "application/json"  # of ``body``


class OpenAIFrontend(abc.ABC):
    """The OpenAI routes, served by an engine's own layer."""

    #: the routes ``serve`` takes; /tokenize and /detokenize only where the engine has them
    routes: frozenset[FrontendRoute] = frozenset({"completions", "chat"})
    #: whether chat and completions, when not in ``routes``, go through the sidecar's own
    #: parser to the engine's ``generate`` (the simulator); False where the model cannot
    #: generate (a vLLM pooling model: 404, as vLLM's server answers)
    generates: bool = True
    #: whether the audio routes' forms go to the engine as they came (``raw``), unread
    forms_as_sent: bool = False

    @abc.abstractmethod
    async def serve(self, request: FrontendRequest) -> FrontendReply:
        """Serve one request; raise engine.errors' errors for what fails before a reply."""

    def steps(self) -> int | None:
        """A count that grows with each step the engine makes; None when it cannot tell.

        A whole (non-streamed) answer shows no progress until it is done: the sidecar's
        progress watchdog reads this instead while it waits for one.
        """
        return None

    @abc.abstractmethod
    async def models(self) -> list[dict[str, Any]]:
        """The model cards of /v1/models, as the engine's layer shows them."""

"""vLLM's own OpenAI serving layer over the embedded engine, in the sidecar's loop.

The serving objects are built the way ``vllm serve`` builds them: vLLM's own argument
parser reads the OpenAI-layer flags (``--chat-template``, ``--enable-auto-tool-choice``,
``--tool-call-parser``, ``--reasoning-parser``, ...) and vLLM's own ``init_app_state``
makes the serving objects of the model's tasks (chat, completions and the Responses API
for a generation model; embeddings, pooling, classify and scores for a pooling model;
models and tokenization for both) on the AsyncLLM that this process already runs. So
every route and field vLLM's server has works, with its semantics, its bytes and its
error bodies: tools and ``tool_choice``, ``response_format`` and structured outputs,
logprobs, ``n``, ``echo``, ``continuous_usage_stats``, stored responses, /tokenize and
/detokenize, the audio routes of a transcription model (multipart forms, whose files
reach vLLM as in-memory UploadFiles). A route whose serving object vLLM did not build for
the model is not served
(the sidecar answers 404, as vLLM's server has no such route then).

The engine client the serving layer sees is the AsyncLLM behind a thin wrapper whose
``generate`` (and ``encode``, a pooling request) counts each request's tokens (metrics), its requests in flight (load) and
the ids it started (so a stream closed early is aborted in vLLM at once, not when its
generators are collected).

Versions: the objects moved between vLLM 0.11 (``vllm.entrypoints.openai.api_server``,
``...openai.protocol``) and 0.32 (``vllm.entrypoints.launchers``, one package per
route); each is looked up at its known places, newest first. When the layer cannot be
built (an older or unknown layout), ``build`` raises FrontendUnavailable and the
engine serves HTTP through unitproxy's own parser, as before.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import importlib
import inspect
import json
import logging
import typing
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from pydantic import TypeAdapter, ValidationError

from engine.errors import InvalidRequest, UnitProxyError
from engine.frontend import (
    FORM_ROUTES,
    FormFile,
    FrontendReply,
    FrontendRequest,
    FrontendRoute,
    OpenAIFrontend,
    Tokens,
)
from engine.prefill import PrefillMeter, prompt_size

logger = logging.getLogger(__name__)


class FrontendUnavailable(Exception):
    """vLLM's serving layer cannot be built with the installed vLLM; the message says why."""


# Where each object lives, newest vLLM first.
_PLACES: dict[str, tuple[str, ...]] = {
    "parser": (
        "vllm.utils.argparse_utils:FlexibleArgumentParser",
        "vllm.utils:FlexibleArgumentParser",
    ),
    "make_arg_parser": (
        "vllm.entrypoints.launchers.cli_args:make_arg_parser",
        "vllm.entrypoints.openai.cli_args:make_arg_parser",
    ),
    "init_app_state": (
        "vllm.entrypoints.launchers.api_server.app_state:init_app_state",
        "vllm.entrypoints.openai.api_server:init_app_state",
    ),
    "chat": (
        "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
        "vllm.entrypoints.openai.protocol:ChatCompletionRequest",
    ),
    "completions": (
        "vllm.entrypoints.openai.completion.protocol:CompletionRequest",
        "vllm.entrypoints.openai.protocol:CompletionRequest",
    ),
    "tokenize": (
        "vllm.entrypoints.serve.tokenize.protocol:TokenizeRequest",
        "vllm.entrypoints.openai.protocol:TokenizeRequest",
    ),
    "detokenize": (
        "vllm.entrypoints.serve.tokenize.protocol:DetokenizeRequest",
        "vllm.entrypoints.openai.protocol:DetokenizeRequest",
    ),
    "responses": ("vllm.entrypoints.openai.responses.protocol:ResponsesRequest",),
    "embeddings": ("vllm.entrypoints.pooling.embed.protocol:EmbeddingRequest",),
    "pooling": ("vllm.entrypoints.pooling.pooling.protocol:PoolingRequest",),
    "classify": ("vllm.entrypoints.pooling.classify.protocol:ClassificationRequest",),
    "score": ("vllm.entrypoints.pooling.scoring.protocol:ScoreRequest",),
    "rerank": ("vllm.entrypoints.pooling.scoring.protocol:RerankRequest",),
    "transcriptions": (
        "vllm.entrypoints.speech_to_text.transcription.protocol:TranscriptionRequest",
    ),
    "translations": ("vllm.entrypoints.speech_to_text.translation.protocol:TranslationRequest",),
    "read_upload": ("vllm.entrypoints.speech_to_text.base.utils:read_upload_with_limit",),
    "error_response": (
        "vllm.entrypoints.serve.exception_handling.error_response:create_error_response",
    ),
    "validation_error": (
        "vllm.entrypoints.serve.exception_handling.handlers.validation:"
        "validation_exception_handler",
    ),
}
# The serving object and its method per route, by the state attribute names of each
# version; None: the object itself is called (the pooling routes, which answer a
# starlette Response). vLLM builds only the objects the model's tasks allow: a route
# whose object is missing is not served, as vLLM's server does not serve it.
_HANDLERS: dict[FrontendRoute, tuple[tuple[str, ...], str | None]] = {
    "chat": (("openai_serving_chat",), "create_chat_completion"),
    "completions": (("openai_serving_completion",), "create_completion"),
    "tokenize": (("serving_tokenization", "openai_serving_tokenization"), "create_tokenize"),
    "detokenize": (("serving_tokenization", "openai_serving_tokenization"), "create_detokenize"),
    "responses": (("openai_serving_responses",), "create_responses"),
    "responses_retrieve": (("openai_serving_responses",), "retrieve_responses"),
    "responses_cancel": (("openai_serving_responses",), "cancel_responses"),
    "embeddings": (("serving_embedding",), None),
    "pooling": (("serving_pooling",), None),
    "classify": (("serving_classification",), None),
    "score": (("serving_scores",), None),
    "rerank": (("serving_scores",), None),
    # a transcription model's (multipart forms: engine/frontend.py FormFile)
    "transcriptions": (("openai_serving_transcription",), "create_transcription"),
    "translations": (("openai_serving_translation",), "create_translation"),
}
# Routes that take the response id from the path, not a body.
_BY_ID: frozenset[FrontendRoute] = frozenset({"responses_retrieve", "responses_cancel"})
# Routes whose bodies vLLM's server dumps by alias in JSON mode (the Responses API).
_BY_ALIAS: frozenset[FrontendRoute] = frozenset({"responses", *_BY_ID})
_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "responses": "/v1/responses",
    "responses_retrieve": "/v1/responses",
    "responses_cancel": "/v1/responses",
    "embeddings": "/v1/embeddings",
    "pooling": "/pooling",
    "classify": "/classify",
    "score": "/score",
    "rerank": "/rerank",
    "transcriptions": "/v1/audio/transcriptions",
    "translations": "/v1/audio/translations",
}


def _find_optional(what: str) -> Any:
    try:
        return _find(what)
    except FrontendUnavailable:
        return None


def _find(what: str) -> Any:
    errors = []
    for place in _PLACES[what]:
        module, _, name = place.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{place}: {exc}")
    raise FrontendUnavailable(f"vLLM's {what} not found ({'; '.join(errors)})")


def serve_argv(model: str, served_model_name: str, flags: dict[str, Any]) -> list[str]:
    """vLLM serve's command line for the OpenAI layer: ``{"tool-call-parser": "hermes"}``
    becomes ``--tool-call-parser hermes``; true is a bare flag, false and None are left out."""
    argv = ["--model", model, "--served-model-name", served_model_name]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, value if isinstance(value, str) else _json(value)]
    return argv


def _json(value: Any) -> str:
    return json.dumps(value)


# -- the engine client the serving layer sees ---------------------------------------------


@dataclass(slots=True)
class _Request:
    """What one sidecar request started in vLLM (set in a context variable around it)."""

    tokens: Tokens = field(default_factory=Tokens)
    started: list[str] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)

    def unfinished(self) -> list[str]:
        return [rid for rid in self.started if rid not in self.finished]


_CURRENT: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
    "unitproxy_vllm_request", default=None
)


class CountingClient:
    """The AsyncLLM, with ``generate`` counting tokens and requests in flight."""

    def __init__(
        self, engine: Any, in_flight: set[str], prefill: PrefillMeter | None = None
    ) -> None:
        self._engine = engine
        self._in_flight = in_flight
        self._prefill = prefill  # the prefill queue and rate measured around vLLM
        self._seq = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        # The request is taken now: the generator's body runs at its first iteration,
        # after the serving call that made it has returned (a stream).
        return self._track(self._engine.generate, _CURRENT.get(), args, kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        """A pooling request (embeddings, score, ...): in flight and aborted as generate's."""
        return self._track(self._engine.encode, _CURRENT.get(), args, kwargs)

    async def _track(
        self,
        call: Callable[..., AsyncGenerator[Any, None]],
        request: _Request | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> AsyncGenerator[Any, None]:
        request_id = str(kwargs.get("request_id", args[2] if len(args) > 2 else ""))
        self._seq += 1
        key = f"{request_id}#{self._seq}"
        self._in_flight.add(key)
        prefill = self._prefill
        if prefill is not None:
            prefill.submitted(key, prompt_size(args[0] if args else kwargs.get("prompt")))
        if request is not None:
            request.started.append(request_id)
        try:
            async for output in call(*args, **kwargs):
                if prefill is not None:
                    ids = getattr(output, "prompt_token_ids", None)
                    cached = getattr(output, "num_cached_tokens", None) or 0
                    prefill.started(key, len(ids) if ids is not None else 0, cached)
                if request is not None:
                    request.tokens.completion_tokens += sum(
                        len(getattr(o, "token_ids", ())) for o in _outputs(output)
                    )
                    if output.finished:
                        request.finished.add(request_id)
                yield output
        finally:
            self._in_flight.discard(key)
            if prefill is not None:
                prefill.ended(key)


def _outputs(output: Any) -> list[Any]:
    # A generation's RequestOutput has a list of completions; a pooling output one result.
    outputs = getattr(output, "outputs", None)
    return outputs if isinstance(outputs, list) else []


# -- the frontend ---------------------------------------------------------------------------


class VllmFrontend(OpenAIFrontend):
    def __init__(
        self,
        state: Any,
        engine: Any,
        request_error: Callable[[Exception], Exception],
        view: Any = None,
    ):
        self._state = state
        self._view = view  # engine.vllm.SchedulerView: its step count
        self._engine = engine  # the AsyncLLM itself, for aborts
        self._request_error = request_error
        # vLLM's own error bodies (0.32); where they are not found, the sidecar's errors
        self._error_response = _find_optional("error_response")
        self._validation_error = _find_optional("validation_error")
        self._schemas: dict[FrontendRoute, TypeAdapter[Any]] = {}
        self._handlers: dict[FrontendRoute, Any] = {}
        self._forms: dict[FrontendRoute, Any] = {}  # a form route's request model
        for route, (attrs, method) in _HANDLERS.items():
            obj = next((getattr(state, a) for a in attrs if getattr(state, a, None)), None)
            if obj is None:
                continue  # not a task of this model (a pooling model has no chat)
            if route not in _BY_ID:
                try:
                    schema = _find(route)
                    self._schemas[route] = TypeAdapter(schema)
                    if route in FORM_ROUTES:
                        self._forms[route] = schema
                except FrontendUnavailable as exc:  # an older vLLM without this route
                    logger.info("engine vllm: %s is not served: %s", route, exc)
                    continue
            self._handlers[route] = obj if method is None else getattr(obj, method)
        if not self._handlers.keys() & {"chat", "completions", "embeddings", "pooling"}:
            raise FrontendUnavailable("vLLM built no serving object for generation or pooling")
        self.routes = frozenset(self._handlers)
        self.generates = "chat" in self.routes

    @classmethod
    async def build(
        cls,
        client: CountingClient,
        engine: Any,
        argv: list[str],
        request_error: Callable[[Exception], Exception],
        view: Any = None,
    ) -> VllmFrontend:
        """vLLM's serving objects on ``client``, as ``vllm serve`` makes them from ``argv``."""
        parser = _find("make_arg_parser")(_find("parser")())
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # argparse's way to refuse a flag
            raise FrontendUnavailable(f"vLLM refused the serving flags {argv}") from exc
        from starlette.datastructures import (  # type: ignore[import-not-found,unused-ignore]
            State,
        )

        state = State()
        init_app_state = _find("init_app_state")
        params = inspect.signature(init_app_state).parameters
        kwargs: dict[str, Any] = {"engine_client": client, "state": state, "args": args}
        if "vllm_config" in params:  # vLLM before 0.12
            kwargs["vllm_config"] = engine.vllm_config
        if "supported_tasks" in params:
            kwargs["supported_tasks"] = await engine.get_supported_tasks()
        await init_app_state(**kwargs)
        return cls(state, engine, request_error, view)

    def steps(self) -> int | None:
        return None if self._view is None else int(self._view.steps)

    async def models(self) -> list[dict[str, Any]]:
        listing = await self._state.openai_serving_models.show_available_models()
        return [card.model_dump() for card in listing.data]

    async def serve(self, request: FrontendRequest) -> FrontendReply:
        route = request.route
        if route in _BY_ID:
            call = self._by_id(route, request.body)
        else:
            fields = request.body
            if route in FORM_ROUTES:
                fields = _form_body(fields, self._forms[route])
            try:
                body = self._schemas[route].validate_python(fields)
            except ValidationError as exc:
                return await self._invalid(exc)
            if route in FORM_ROUTES:
                call = self._audio(route, body, _raw_request(request))
            else:
                call = self._handlers[route](body, _raw_request(request))
        context = _Request()
        # A background response runs on in vLLM after its request (and its stream) is
        # done: nothing of it is aborted when the stream closes.
        background = route == "responses" and request.body.get("background") is True
        token = _CURRENT.set(None if background else context)
        try:
            result = await call
            if background and hasattr(result, "__anext__"):
                # a streamed background response: its stream reads the events its task
                # keeps, and that task (just made) must run once first to keep them, as
                # it does in vLLM's server while the stream's head is sent
                await asyncio.sleep(0)
            if route == "responses_retrieve" and hasattr(result, "__anext__"):
                # vLLM's server starts the stream before the generator's first step,
                # where an id with no kept events raises: its 200 then breaks off. Here
                # the first event is awaited first, so that is vLLM's own 400.
                result = _prefixed(await anext(result), result)
        except UnitProxyError:
            raise
        except Exception as exc:
            await self._abort(context)
            if _is_dead(exc) or self._error_response is None:  # dead: the unit lets go
                raise self._request_error(exc) from exc
            return self._reply_error(self._error_response(exc))  # as vLLM's handlers answer
        except BaseException:
            await self._abort(context)
            raise
        finally:
            _CURRENT.reset(token)
        return self._reply(route, result, context)

    async def _audio(self, route: FrontendRoute, body: Any, raw: Any) -> Any:
        """As vLLM's audio routes: the file read within VLLM_MAX_AUDIO_CLIP_FILESIZE_MB."""
        audio = await _find("read_upload")(body.file)
        return await self._handlers[route](audio, body, raw)

    def _by_id(self, route: FrontendRoute, fields: dict[str, Any]) -> Any:
        response_id = str(fields.get("response_id", ""))
        if route == "responses_retrieve":
            return self._handlers[route](
                response_id,
                starting_after=fields.get("starting_after"),
                stream=fields.get("stream") is True,
            )
        return self._handlers[route](response_id)

    def _reply(self, route: FrontendRoute, result: Any, context: _Request) -> FrontendReply:
        if type(result).__name__ == "ErrorResponse":
            return self._reply_error(result)
        if hasattr(result, "status_code") and hasattr(result, "body"):
            # a starlette Response (the pooling routes): its status and bytes as they are
            return FrontendReply(
                int(result.status_code), body=bytes(result.body), tokens=context.tokens
            )
        if hasattr(result, "model_dump"):
            dumped = (
                result.model_dump(mode="json", by_alias=True)
                if route in _BY_ALIAS
                else result.model_dump()
            )
            return FrontendReply(200, body=_json_bytes(dumped), tokens=context.tokens)
        if route in ("responses", "responses_retrieve"):  # events, as vLLM's router writes them
            return FrontendReply(
                200, chunks=self._chunks(_events(result), context), tokens=context.tokens
            )
        return FrontendReply(200, chunks=self._chunks(result, context), tokens=context.tokens)

    def _reply_error(self, response: Any) -> FrontendReply:
        """vLLM's error body and status, as its server's handlers write them."""
        return FrontendReply(int(response.error.code), body=_json_bytes(response.model_dump()))

    async def _invalid(self, exc: ValidationError) -> FrontendReply:
        """A body the request's model refuses: vLLM's 400, as its validation handler makes it."""
        if self._validation_error is None:
            raise _invalid(exc) from exc
        from fastapi.exceptions import RequestValidationError  # type: ignore[import-not-found,unused-ignore]

        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        response = await self._validation_error(_APP_REQUEST, RequestValidationError(errors))
        return FrontendReply(int(response.status_code), body=bytes(response.body))

    async def _chunks(self, lines: Any, context: _Request) -> AsyncGenerator[bytes, None]:
        try:
            async for line in lines:
                yield line.encode() if isinstance(line, str) else bytes(line)
        finally:
            await lines.aclose()
            await self._abort(context)

    async def _abort(self, context: _Request) -> None:
        # A stream closed before its end: the serving layer's generators would abort
        # the request when collected; this does it now.
        for request_id in context.unfinished():
            try:
                await self._engine.abort(request_id)
            except Exception as exc:  # a dead engine cannot abort; nothing is left to free
                logger.debug("engine vllm: abort of %s failed: %s", request_id, exc)


def _raw_request(request: FrontendRequest) -> Any:
    """The request as the serving layer reads it: headers (the request id) and a state."""
    from starlette.requests import Request  # type: ignore[import-not-found,unused-ignore]

    headers = [
        (k.lower().encode("latin-1"), v.encode("latin-1"))
        for k, v in request.headers.items()
        if k.lower() != "x-request-id"
    ]
    headers.append((b"x-request-id", request.request_id.encode("latin-1")))
    scope = {
        "type": "http",
        "method": "POST",
        "path": _PATHS[request.route],
        "headers": headers,
        "query_string": b"",
    }
    return Request(scope)


def _form_body(fields: dict[str, Any], schema: Any) -> dict[str, Any]:
    """A form's fields as FastAPI hands them to vLLM's request model (its
    ``_extract_form_body``): files as starlette UploadFiles in memory, a list field's
    values as a list and another field's last value, a field left out as its default
    (unless that is None, or it has none), then the names the model does not know as
    they came. The same dict, so a refusal quotes the same input (``<dict of N items>``)."""
    body: dict[str, Any] = {}
    known = set()
    for name, info in getattr(schema, "model_fields", {}).items():
        alias = info.validation_alias if isinstance(info.validation_alias, str) else None
        alias = alias or info.alias or name
        known.add(alias)
        value = fields.get(alias)
        if typing.get_origin(info.annotation) is list:
            value = [] if value is None else value if isinstance(value, list) else [value]
        elif isinstance(value, list):
            value = value[-1]
        if value is None or value == []:
            if info.is_required():
                continue
            value = copy.deepcopy(info.get_default(call_default_factory=True))
            if value is None:
                continue
        body[alias] = _upload(value)
    for name, value in fields.items():
        if name not in known:
            body[name] = _upload(value)
    return body


def _upload(value: Any) -> Any:
    """A FormFile (or a list with some) as starlette's in-memory UploadFile."""
    if isinstance(value, list):
        return [_upload(v) for v in value]
    if not isinstance(value, FormFile):
        return value
    import io

    from starlette.datastructures import (  # type: ignore[import-not-found,unused-ignore]
        Headers,
        UploadFile,
    )

    headers = Headers({"content-type": value.content_type or "application/octet-stream"})
    return UploadFile(
        io.BytesIO(value.data), size=len(value.data), filename=value.filename, headers=headers
    )


# What vLLM's validation handler reads of a request: ``app.state.args.log_error_stack``.
_APP_REQUEST = SimpleNamespace(
    app=SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(log_error_stack=False)))
)


def _invalid(exc: ValidationError) -> InvalidRequest:
    """A refused body as the sidecar's 400, where vLLM's validation handler is not found."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "Tokenize"))]
    name = ".".join(loc)
    msg = str(err["msg"]).removeprefix("Value error, ")
    return InvalidRequest(f"{name}: {msg}" if name else msg, param=name or None)


def _json_bytes(content: Any) -> bytes:
    """A body as starlette's JSONResponse renders it (vLLM's server answers with one)."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


async def _events(events: Any) -> AsyncGenerator[str, None]:
    """Responses API events as vLLM's router writes them: ``event: TYPE`` then the data."""
    try:
        async for event in events:
            data = event.model_dump_json(indent=None, by_alias=True)
            yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {data}\n\n"
    finally:
        await events.aclose()


async def _prefixed(first: Any, rest: Any) -> AsyncGenerator[Any, None]:
    """``first``, then what ``rest`` yields (an async generator that gave ``first``)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


def _is_dead(exc: Exception) -> bool:
    # By class name: the classes moved between versions, and the import stays lazy.
    return any(cls.__name__ == "EngineDeadError" for cls in type(exc).__mro__)

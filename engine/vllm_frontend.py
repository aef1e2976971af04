"""vLLM's own OpenAI serving layer over the embedded engine, in the sidecar's loop.

The serving objects are built the way ``vllm serve`` builds them: vLLM's own argument
parser reads the OpenAI-layer flags (``--chat-template``, ``--enable-auto-tool-choice``,
``--tool-call-parser``, ``--reasoning-parser``, ...) and vLLM's own ``init_app_state``
makes OpenAIServingChat, OpenAIServingCompletion, OpenAIServingModels and the
tokenization handler on the AsyncLLM that this process already runs. So every field
vLLM's server accepts works, with its semantics and its chunk bytes: tools and
``tool_choice``, ``response_format`` and structured outputs, logprobs, ``n``, ``echo``,
``continuous_usage_stats``, /tokenize and /detokenize.

The engine client the serving layer sees is the AsyncLLM behind a thin wrapper whose
``generate`` counts each request's tokens (metrics), its requests in flight (load) and
the ids it started (so a stream closed early is aborted in vLLM at once, not when its
generators are collected).

Versions: the objects moved between vLLM 0.11 (``vllm.entrypoints.openai.api_server``,
``...openai.protocol``) and 0.32 (``vllm.entrypoints.launchers``, one package per
route); each is looked up at its known places, newest first. When the layer cannot be
built (an older or unknown layout), ``build`` raises FrontendUnavailable and the
engine serves HTTP through unitproxy's own parser, as before.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import json
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from engine.errors import (
    EngineError,
    InvalidRequest,
    NotFound,
    Overloaded,
    Unavailable,
    UnitProxyError,
)
from engine.frontend import FrontendReply, FrontendRequest, OpenAIFrontend, Tokens

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
}
# The serving object and its method per route, by the state attribute names of each version.
_HANDLERS: dict[str, tuple[tuple[str, ...], str]] = {
    "chat": (("openai_serving_chat",), "create_chat_completion"),
    "completions": (("openai_serving_completion",), "create_completion"),
    "tokenize": (("serving_tokenization", "openai_serving_tokenization"), "create_tokenize"),
    "detokenize": (("serving_tokenization", "openai_serving_tokenization"), "create_detokenize"),
}
_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
}


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

    def __init__(self, engine: Any, in_flight: set[str]) -> None:
        self._engine = engine
        self._in_flight = in_flight
        self._seq = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        # The request is taken now: the generator's body runs at its first iteration,
        # after the serving call that made it has returned (a stream).
        return self._generate(_CURRENT.get(), args, kwargs)

    async def _generate(
        self, request: _Request | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        request_id = str(kwargs.get("request_id", args[2] if len(args) > 2 else ""))
        self._seq += 1
        key = f"{request_id}#{self._seq}"
        self._in_flight.add(key)
        if request is not None:
            request.started.append(request_id)
        try:
            async for output in self._engine.generate(*args, **kwargs):
                if request is not None:
                    request.tokens.completion_tokens += sum(
                        len(o.token_ids) for o in output.outputs
                    )
                    if output.finished:
                        request.finished.add(request_id)
                yield output
        finally:
            self._in_flight.discard(key)


# -- the frontend ---------------------------------------------------------------------------


class VllmFrontend(OpenAIFrontend):
    routes = frozenset({"completions", "chat", "tokenize", "detokenize"})

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
        self._schemas = {route: TypeAdapter(_find(route)) for route in _HANDLERS}
        self._handlers: dict[str, Any] = {}
        for route, (attrs, method) in _HANDLERS.items():
            obj = next((getattr(state, a) for a in attrs if getattr(state, a, None)), None)
            if obj is None:
                raise FrontendUnavailable(f"vLLM built no handler for {route} ({attrs[0]})")
            self._handlers[route] = getattr(obj, method)

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
        try:
            body = self._schemas[request.route].validate_python(request.body)
        except ValidationError as exc:
            raise _invalid(exc) from exc
        context = _Request()
        token = _CURRENT.set(context)
        try:
            result = await self._handlers[request.route](body, _raw_request(request))
        except UnitProxyError:
            raise
        except Exception as exc:
            await self._abort(context)
            raise self._request_error(exc) from exc
        except BaseException:
            await self._abort(context)
            raise
        finally:
            _CURRENT.reset(token)
        if type(result).__name__ == "ErrorResponse":
            raise _error(result)
        if hasattr(result, "model_dump_json"):
            return FrontendReply(200, body=result.model_dump_json().encode(), tokens=context.tokens)
        return FrontendReply(200, chunks=self._chunks(result, context), tokens=context.tokens)

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


def _invalid(exc: ValidationError) -> InvalidRequest:
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "Tokenize"))]
    name = ".".join(loc)
    msg = str(err["msg"]).removeprefix("Value error, ")
    return InvalidRequest(f"{name}: {msg}" if name else msg, param=name or None)


def _error(response: Any) -> UnitProxyError:
    info = getattr(response, "error", response)  # 0.11+: {"error": {...}}; older: flat
    message = str(getattr(info, "message", info))
    status = int(getattr(info, "code", 400) or 400)
    param = getattr(info, "param", None)
    if status == 404:
        return NotFound(message, param=param or "model", code="model_not_found")
    if status == 429:
        return Overloaded(message)
    if status == 503:
        return Unavailable(message)
    if 400 <= status < 500:
        return InvalidRequest(message, param=param)
    return EngineError(message)

"""Engine kind ``openai``: forwards to an existing OpenAI-compatible server.

For a ``vllm serve`` (or Triton's OpenAI frontend, or another unitproxy sidecar) that
runs by itself. The HTTP routes pass the client's body through unchanged
(engine/upstream_frontend.py). A gRPC Generate is one streaming POST to ``/v1/completions`` (prompt or
prompt token ids) or ``/v1/chat/completions`` (messages), its SSE chunks become token
deltas, and closing the iterator closes the upstream connection, which is how an
OpenAI server learns that its client left (vLLM aborts the request then).

Load comes from the upstream's ``/metrics``, read in the background: vLLM's gauges
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before vLLM 0.10), summed
over its engines (the KV usage averaged). An upstream without them reports 0 running,
0 waiting and KV usage -1 (unknown); running and waiting are unsigned on the wire.

Errors: a refused connection is ``EngineDeadError`` (503: retry elsewhere); the
upstream's 400 ``InvalidRequest``, 404 ``NotFound``, 429 ``Overloaded``, 503
``Unavailable``, other statuses and errors inside the stream ``EngineError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineUnavailable, tokens
from engine.base import Engine, EngineRequest, EngineStats, SamplingParams, TokenDelta
from engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequest,
    NotFound,
    Overloaded,
    Unavailable,
    UnitProxyError,
)
from engine.settings import EngineSettings
from engine.upstream_frontend import UpstreamFrontend

logger = logging.getLogger(__name__)

# Most connections to the upstream; the sidecar's capacity bounds requests well below.
_CONNECTIONS = 512
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# vLLM's prefix-cache counters, in prompt tokens (by their samples' names: the parser
# does not always file a _total sample under its TYPE line's family)
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
UNKNOWN = EngineStats(running=0, waiting=0, kv_cache_usage=-1.0)


# -- load -------------------------------------------------------------------------------


def parse_metrics(text: str) -> EngineStats:
    """vLLM's load gauges (and prefix-cache counters) from Prometheus text; missing
    ones read as unknown."""
    values: dict[str, list[float]] = {}
    wanted = {RUNNING, WAITING, *KV_USAGE}
    counters = {PREFIX_QUERIES, PREFIX_HITS}
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            values[family.name] = [s.value for s in family.samples if s.name == family.name]
        for sample in family.samples:
            if sample.name in counters:
                values.setdefault(sample.name, []).append(sample.value)
    kv = next((values[name] for name in KV_USAGE if values.get(name)), [])
    queries, hits = int(sum(values.get(PREFIX_QUERIES, ()))), int(sum(values.get(PREFIX_HITS, ())))
    return EngineStats(
        running=int(sum(values.get(RUNNING, ()))),
        waiting=int(sum(values.get(WAITING, ()))),
        kv_cache_usage=sum(kv) / len(kv) if kv else -1.0,
        prefix_cache_hit_rate=hits / queries if PREFIX_QUERIES in values and queries else -1.0,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
    )


# -- requests ---------------------------------------------------------------------------


def request_body(request: EngineRequest, model: str, extras: bool) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of the streaming upstream call for ``request``."""
    body: dict[str, Any] = {"model": model, "stream": True, **_sampling_fields(request.sampling)}
    options: dict[str, Any] = {"include_usage": True}
    if extras:
        options["continuous_usage_stats"] = True  # exact completion count per chunk
        body["return_token_ids"] = True
    body["stream_options"] = options
    if request.messages is not None:
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
        # vLLM's chat fields, only when they differ from the default
        if request.continue_final_message:
            body["continue_final_message"] = True
        if request.continue_final_message or not request.add_generation_prompt:
            body["add_generation_prompt"] = False
        return "/v1/chat/completions", body
    if request.prompt_token_ids is not None:
        body["prompt"] = list(request.prompt_token_ids)
    else:
        body["prompt"] = request.prompt or ""
    return "/v1/completions", body


def _sampling_fields(s: SamplingParams) -> dict[str, Any]:
    # Only what differs from OpenAI's defaults: a field left out lets the upstream
    # apply its model's own generation defaults (vLLM does), and plain OpenAI servers
    # see plain requests.
    fields: dict[str, Any] = {}
    optional = {
        "temperature": s.temperature if s.temperature != 1.0 else None,
        "top_p": s.top_p if s.top_p != 1.0 else None,
        "max_tokens": s.max_tokens,
        "top_k": s.top_k if s.top_k > 0 else None,
        "min_tokens": s.min_tokens or None,
        "stop": list(s.stop) or None,
        "seed": s.seed,
        "ignore_eos": s.ignore_eos or None,
        "presence_penalty": s.presence_penalty or None,
        "frequency_penalty": s.frequency_penalty or None,
        "repetition_penalty": s.repetition_penalty if s.repetition_penalty != 1.0 else None,
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    return fields


async def sse_events(pieces: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream, one per event.

    Lines are split here rather than by the HTTP client's readline, which refuses
    lines over its buffer size (a first chunk with all prompt token ids can be one).
    """
    data: list[str] = []
    pending = b""
    async for piece in pieces:
        *lines, pending = (pending + piece).split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8").rstrip("\r")
            if not line:
                if data:
                    yield "\n".join(data)
                    data = []
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            # other fields (event:, id:, retry:) and comments (":") carry nothing for us
    if pending.startswith(b"data:"):
        data.append(pending[5:].decode("utf-8").strip())
    if data:
        yield "\n".join(data)


@dataclass(slots=True)
class _Stream:
    """Turns the chunks of one upstream stream into token deltas."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    final: TokenDelta | None = None  # held back until the usage chunk after it

    def feed(self, chunk: dict[str, Any]) -> TokenDelta | None:
        """The delta in ``chunk``, if it carries one that is not the last."""
        if "error" in chunk:
            raise EngineError(f"upstream error in the stream: {_error_message(chunk)}")
        usage = chunk.get("usage") or {}
        choices = chunk.get("choices") or []
        if not choices:
            self._usage(usage)
            return None
        choice = choices[0]
        text = _choice_text(choice)
        token_ids = tuple(choice.get("token_ids") or ())
        if usage:
            self._usage(usage)
        elif text or token_ids:
            self.completion_tokens += max(1, len(token_ids))
        finish = choice.get("finish_reason")
        delta = TokenDelta(text, token_ids, self.prompt_tokens, self.completion_tokens, finish)
        if finish is not None:
            self.final = delta
            return None
        if not text and not token_ids:
            return None  # the chat role chunk, or an empty keep-alive
        return delta

    def _usage(self, usage: dict[str, Any]) -> None:
        self.prompt_tokens = int(usage.get("prompt_tokens") or self.prompt_tokens)
        self.completion_tokens = int(usage.get("completion_tokens") or self.completion_tokens)

    def last(self) -> TokenDelta:
        if self.final is None:
            raise EngineError("the upstream ended the stream without a finish reason")
        f = self.final
        return TokenDelta(
            f.text, f.token_ids, self.prompt_tokens, self.completion_tokens, f.finish_reason
        )


def _choice_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return str((choice["delta"] or {}).get("content") or "")
    return str(choice.get("text") or "")


def _error_message(body: Any) -> str:
    # OpenAI: {"error": {"message": ...}}; older vLLM: {"message": ..., "object": "error"}
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return str(body)[:300]


def status_error(status: int, message: str) -> UnitProxyError:
    """An upstream HTTP error status as an error of our tree."""
    text = f"upstream answered {status}: {message}"
    if status in (400, 422):
        return InvalidRequest(text)
    if status == 404:
        return NotFound(text)
    if status == 429:
        return Overloaded(text)
    if status == 503:
        return Unavailable(text)
    return EngineError(text)


class OpenAIUpstreamEngine(Engine):
    def __init__(self, settings: EngineSettings) -> None:
        if not settings.upstream_url:
            raise EngineUnavailable("engine openai needs --upstream-url (the server's base URL)")
        self.base_url = settings.upstream_url.rstrip("/").removesuffix("/v1")
        self.model_name = settings.model or ""
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._stats = UNKNOWN
        self._metrics_ok: bool | None = None  # for logging transitions only
        self._models: tuple[str, ...] = ()  # the upstream's /v1/models, as last read
        self.frontend = UpstreamFrontend(
            self._post, self._get_json, lambda: self.model_name, self._post_raw
        )

    # -- lifetime ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._session is not None:
            return
        s = self._settings
        key = s.upstream_api_key
        headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(limit=_CONNECTIONS),
            # Streams last as long as generation does: only connecting is bounded.
            timeout=aiohttp.ClientTimeout(total=None, connect=s.upstream_timeout_s),
        )
        try:
            if not self.model_name:
                self.model_name = await self._served_model()
        except BaseException:
            await self._session.close()
            self._session = None
            raise
        self._poller = asyncio.create_task(self._poll_metrics(), name="upstream metrics")
        logger.info("engine openai: upstream %s, model %r", self.base_url, self.model_name)

    async def stop(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            await asyncio.wait([poller])
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        self._stats = UNKNOWN

    def served_models(self) -> tuple[str, ...]:
        """The configured model, then the upstream's other models (its LoRA adapters,
        say), as its /v1/models last listed them."""
        return (self.model_name, *(m for m in self._models if m != self.model_name))

    async def _read_models(self) -> None:
        # Keeps the last list when the upstream cannot say: a model does not vanish
        # because one poll failed.
        with contextlib.suppress(UnitProxyError, KeyError, TypeError, ValueError):
            body = await self._get_json("/v1/models")
            self._models = tuple(str(m["id"]) for m in body["data"])

    async def _served_model(self) -> str:
        """The upstream's first model, for when none was configured."""
        try:
            body = await self._get_json("/v1/models")
            return str(body["data"][0]["id"])
        except (UnitProxyError, KeyError, IndexError, TypeError) as exc:
            raise EngineError(
                f"engine openai: cannot learn the model from {self.base_url}/v1/models "
                f"({exc}); give --model"
            ) from exc

    # -- health and load --------------------------------------------------------------

    async def check_health(self) -> None:
        async with self._get("/health") as resp:
            if resp.status != 200:
                raise EngineError(f"upstream /health answered {resp.status}")

    def stats(self) -> EngineStats:
        return self._stats

    async def _poll_metrics(self) -> None:
        while True:
            try:
                await self._read_models()
                self._stats = await self._read_metrics()
                self._log_metrics(True, "")
            except asyncio.CancelledError:
                raise
            except (UnitProxyError, ValueError) as exc:
                self._stats = UNKNOWN  # stale numbers would mislead the router
                self._log_metrics(False, str(exc))
            except Exception:
                self._stats = UNKNOWN
                logger.exception("engine openai: reading %s/metrics failed", self.base_url)
            await asyncio.sleep(self._settings.upstream_metrics_interval_s)

    async def _read_metrics(self) -> EngineStats:
        async with self._get("/metrics") as resp:
            if resp.status != 200:
                raise EngineError(f"/metrics answered {resp.status}")
            text = await resp.text()
        if RUNNING not in text:
            raise ValueError(f"it has no {RUNNING} (not a vLLM server?)")
        return parse_metrics(text)

    def _log_metrics(self, ok: bool, reason: str) -> None:
        if ok is not self._metrics_ok:
            if ok:
                logger.info("engine openai: reading load from %s/metrics", self.base_url)
            else:
                logger.warning("engine openai: no load from %s/metrics: %s", self.base_url, reason)
            self._metrics_ok = ok

    def _get(self, path: str) -> _Get:
        return _Get(
            self._require_session(), self.base_url + path, self._settings.upstream_timeout_s
        )

    async def _get_json(self, path: str) -> Any:
        async with self._get(path) as resp:
            if resp.status != 200:
                raise status_error(resp.status, _error_message(await _json_or_text(resp)))
            return await resp.json(content_type=None)

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineDeadError("engine not started")
        return self._session

    # -- requests ---------------------------------------------------------------------

    async def count_tokens(self, text: str) -> int:
        """The upstream's count from vLLM's ``POST /tokenize``; where the upstream has
        none (or it fails), an estimate: ``engine.tokens.count``, within
        about ``engine.tokens.ACCURACY_PCT`` %."""
        body = {"model": self.model_name, "prompt": text, "add_special_tokens": False}
        try:
            async with asyncio.timeout(self._settings.upstream_timeout_s):
                resp = await self._require_session().post(self.base_url + "/tokenize", json=body)
                async with resp:
                    if resp.status == 200:
                        return int((await resp.json(content_type=None))["count"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            logger.debug("engine openai: /tokenize failed (%r): estimating", exc)
        return tokens.count(text)

    async def generate(self, request: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        if request.sampling.max_tokens == 0:
            # A resumed request with nothing left to generate (OpenAI servers refuse 0).
            text = request.prompt or "".join(m.content for m in request.messages or ())
            prompt_tokens = len(request.prompt_token_ids or ()) or await self.count_tokens(text)
            yield TokenDelta("", (), prompt_tokens, 0, "length")
            return
        model = request.model or self.model_name
        path, body = request_body(request, model, self._settings.upstream_vllm_extras)
        resp = await self._post(path, body)
        stream, done = _Stream(), False
        try:
            async for event in sse_events(resp.content.iter_any()):
                if event == "[DONE]":
                    break
                delta = stream.feed(_decode(event))
                if delta is not None:
                    yield delta
            done = True
        except aiohttp.ClientError as exc:
            raise EngineError(f"upstream stream broke: {exc!r}") from exc
        finally:
            if done:
                resp.release()
            else:
                # Closing the connection is how the upstream learns its client left.
                resp.close()
        yield stream.last()

    async def _post(self, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        return await self._send(path, json=body)

    async def _post_raw(
        self, path: str, data: bytes, content_type: str | None
    ) -> aiohttp.ClientResponse:
        """A body as the client sent it (an audio route's form), with its content type."""
        headers = {} if content_type is None else {"Content-Type": content_type}
        return await self._send(path, data=data, headers=headers)

    async def _send(self, path: str, **request: Any) -> aiohttp.ClientResponse:
        session = self._require_session()
        try:
            resp = await session.post(self.base_url + path, **request)
        except aiohttp.ClientConnectionError as exc:
            raise EngineDeadError(f"upstream {self.base_url} unreachable: {exc}") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"upstream {self.base_url} failed: {exc!r}") from exc
        if resp.status != 200:
            try:
                message = _error_message(await _json_or_text(resp))
            finally:
                resp.release()
            raise status_error(resp.status, message)
        return resp


class _Get:
    """``async with`` a bounded GET; connection failures become our errors."""

    def __init__(self, session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
        self._session, self._url = session, url
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._resp: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        try:
            self._resp = await self._session.get(self._url, timeout=self._timeout)
        except aiohttp.ClientConnectionError as exc:
            raise EngineDeadError(f"upstream unreachable: {self._url}: {exc}") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"upstream {self._url} failed: {exc!r}") from exc
        return self._resp

    async def __aexit__(self, *exc_info: object) -> None:
        if self._resp is not None:
            self._resp.release()


async def _json_or_text(resp: aiohttp.ClientResponse) -> Any:
    text = await resp.text()
    try:
        return json.loads(text)
    except ValueError:
        return text


def _decode(event: str) -> dict[str, Any]:
    try:
        chunk = json.loads(event)
    except ValueError as exc:
        raise EngineError(f"upstream sent a chunk that is not JSON: {event[:200]!r}") from exc
    if not isinstance(chunk, dict):
        raise EngineError(f"upstream sent a chunk that is not an object: {event[:200]!r}")
    return chunk

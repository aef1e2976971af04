"""The sidecar's gRPC services: Inference.Generate and LoadReporting.

Generate is also served on the HTTP port in the gRPC-Web framing (``proxy.grpcweb``,
``sidecar.http``): both wires go through ``InferenceService.serve``.

On the gRPC port a client that takes no message for ``server.write_timeout_s`` (a write
waits that long on flow control) is treated as gone (``WriteWatch``): its request ends,
its capacity slot is freed, and its status (DEADLINE_EXCEEDED, code write_timeout)
waits behind the messages it has yet to read. On the HTTP port the port's own write timer
does that (``proxy.ingress``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from engine.base import TokenDelta
from proxy import openai_api, resume
from proxy.auth import ApiKeys
from proxy.coalesce import Coalescer
from proxy.errors import GRPC_CODE_KEY, InvalidRequest, UnitProxyError, write_timeout
from proxy.httputil import REQUEST_ID_HEADER, RESUME_HEADER
from proxy.load import GATEWAY_HEADER, gateway_name
from proxy.metrics import ServingMetrics
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc, load_pb2, load_pb2_grpc
from proxy.sidecar.core import SidecarCore, with_priority
from proxy.sidecar.watch import ReportWatch
from proxy.tenants import PRIORITY_HEADER, PRIORITY_SIG_HEADER
from proxy.tracing import Trace, finish, from_metadata

log = logging.getLogger(__name__)

METHOD = "unitproxy.v1.Inference/Generate"  # the server span's name (RPC conventions)
ROUTE = "grpc_generate"
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_tokens",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def request_fields(msg: inference_pb2.GenerateRequest) -> tuple[openai_api.Route, dict[str, Any]]:
    """The GenerateRequest as OpenAI fields, so both wires share one validation."""
    fields: dict[str, Any] = {"model": msg.model or None}
    sampling = msg.sampling
    for name in _SAMPLING_FIELDS:
        if sampling.HasField(name):
            fields[name] = getattr(sampling, name)
    if sampling.stop:
        fields["stop"] = list(sampling.stop)
    kind = msg.WhichOneof("input")
    if kind == "prompt":
        return "completions", {**fields, "prompt": msg.prompt}
    if kind == "prompt_token_ids":
        return "completions", {**fields, "prompt": list(msg.prompt_token_ids.ids)}
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
        fields["messages"] = messages
        if msg.chat.continue_final_message:
            fields |= {"continue_final_message": True, "add_generation_prompt": False}
        return "chat", fields
    raise InvalidRequest(
        "input: one of prompt, chat or prompt_token_ids is required", param="input"
    )


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self,
        core: SidecarCore,
        metrics: ServingMetrics,
        max_prompt_chars: int,
        api_keys: ApiKeys | None = None,
        write_timeout_s: float | None = None,
    ):
        self._api_keys = api_keys or ApiKeys()
        self._write_timeout_s = write_timeout_s
        self._core = core
        self._metrics = metrics
        self._max_prompt_chars = max_prompt_chars

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            await self.serve(
                request,
                context.invocation_metadata(),
                _metadata(context, RESUME_HEADER),
                context.time_remaining(),
                context.write,
            )
        except UnitProxyError as exc:
            await context.abort(exc.grpc_code, exc.message, ((GRPC_CODE_KEY, exc.code),))

    async def serve(
        self,
        request: inference_pb2.GenerateRequest,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        resume_hint: str | None,
        time_remaining: float | None,
        write: Callable[[inference_pb2.GenerateChunk], Awaitable[object]],
        interval_s: float = 0.0,
    ) -> None:
        """One Generate call, whatever wire it came on (gRPC, or gRPC-Web from a
        gateway): ``write`` takes each chunk, at most one per ``interval_s`` after the
        first (``Coalescer``); errors raise UnitProxyError."""
        code = "OK"
        error: str | None = None
        trace = self._core.begin_trace(*from_metadata(metadata), METHOD)
        try:
            self._api_keys.check_metadata(metadata)
            meta = dict(metadata or ())
            priority = self._core.priority_of(
                meta.get(PRIORITY_HEADER),
                meta.get(PRIORITY_SIG_HEADER),
                meta.get(REQUEST_ID_HEADER),
            )
            gateway = gateway_name(meta.get(GATEWAY_HEADER))
            await self._generate(
                request, resume_hint, time_remaining, write, interval_s, priority, trace, gateway
            )
        except UnitProxyError as exc:
            code, error = exc.grpc_code.name, exc.message
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            code = "CANCELLED"  # the client went away
            raise
        finally:
            self._metrics.requests.labels(ROUTE, code).inc()
            if trace is not None:
                finish(trace.root, code, error)

    async def _generate(
        self,
        request: inference_pb2.GenerateRequest,
        resume_hint: str | None,
        remaining: float | None,
        write_chunk: Callable[[inference_pb2.GenerateChunk], Awaitable[object]],
        interval_s: float,
        priority: int,
        trace: Trace | None = None,
        gateway: str | None = None,
    ) -> None:
        core = self._core
        request_id = request.request_id or uuid.uuid4().hex
        route, fields = request_fields(request)
        parsed = openai_api.parse_fields(
            route,
            fields,
            request_id=request_id,
            served_model=core.engine.served_models(),
            max_prompt_chars=self._max_prompt_chars,
        )
        hint = resume.parse_hint(resume_hint)
        if hint is not None:
            parsed = await resume.resume(parsed, hint, core.engine.count_tokens, core.resume_key)
        delivered = parsed.delivered_tokens or 0
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        lease = core.admit(priority, trace, gateway)
        unit_id = core.unit_id

        async def write(delta: TokenDelta) -> None:
            chunk = inference_pb2.GenerateChunk(
                request_id=request_id,
                text=delta.text,
                token_ids=delta.token_ids,
                unit_id=unit_id,
            )
            if delta.finish_reason is not None:
                chunk.finish_reason = delta.finish_reason
                chunk.usage.prompt_tokens = delta.prompt_tokens
                chunk.usage.completion_tokens = delta.completion_tokens
                chunk.usage.total_tokens = delta.prompt_tokens + delta.completion_tokens
            await write_chunk(chunk)

        out = Coalescer(write, merge_deltas, interval_s=interval_s)
        limit = self._write_timeout_s
        watch = None if limit is None else WriteWatch(out, limit)

        async def send(delta: TokenDelta) -> None:
            await out.put(delta)
            if delta.finish_reason is not None:
                await out.close()  # the lease is held until the client has it all

        try:
            try:
                engine_request = with_priority(parsed.engine_request, priority)
                await core.run(lease, engine_request, ROUTE, send, deadline, delivered)
            except UnitProxyError:
                await out.close()  # what was generated before the error, then the status
                raise
        except asyncio.CancelledError:
            if watch is None or not watch.stalled:
                raise
            raise watch.error() from None
        finally:
            out.cancel()
            if watch is not None:
                watch.cancel()


class WriteWatch:
    """Cancels the running task once a write of ``out`` has waited ``limit_s``: a
    client that takes no message is treated as one that went away, except that it
    gets ``error()`` as its status should it ever read again."""

    def __init__(self, out: Coalescer[Any], limit_s: float):
        self._out = out
        self._limit = limit_s
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(limit_s, self._check)
        self.stalled = False

    def cancel(self) -> None:
        self._handle.cancel()

    def error(self) -> UnitProxyError:
        """The stalled call's error, with its task's cancellation taken back."""
        if self._task is not None:
            self._task.uncancel()
        log.info("a gRPC client took no message for %g s (server.write_timeout_s)", self._limit)
        return write_timeout(self._limit)

    def _check(self) -> None:
        since, now = self._out.writing_since, self._loop.time()
        if since and now - since >= self._limit and self._task is not None:
            self.stalled = True
            self._task.cancel()
            return
        self._handle = self._loop.call_at((since or now) + self._limit, self._check)


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def merge_deltas(deltas: Sequence[TokenDelta]) -> TokenDelta:
    """Consecutive deltas of one request as one."""
    last = deltas[-1]
    return TokenDelta(
        "".join(d.text for d in deltas),
        tuple(t for d in deltas for t in d.token_ids),
        last.prompt_tokens,
        last.completion_tokens,
        last.finish_reason,
    )


class LoadService(load_pb2_grpc.LoadReportingServicer):
    def __init__(self, core: SidecarCore, watch: ReportWatch):
        self._core = core
        self._watch = watch

    async def GetLoad(
        self, request: load_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> load_pb2.LoadReport:
        return self._core.report().to_pb()

    async def WatchLoad(
        self, request: load_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[load_pb2.LoadReport]:
        asked = request.min_interval_ms / 1000, request.heartbeat_ms / 1000
        async for report in self._watch.reports(*asked, watcher=gateway_name(request.watcher)):
            yield report.to_pb()

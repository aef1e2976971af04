"""Inference.Generate through the gateway: messages pass as bytes.

The gateway registers a generic handler for the method with no (de)serializers and
calls units the same way, so each chunk is forwarded as the bytes the unit sent;
messages that arrive while a write to the client is in flight are decoded only to be
merged into the next one (``proxy.coalesce``).
Retries happen only before the first message reaches the client, on UNAVAILABLE or
RESOURCE_EXHAUSTED from the unit (its refusal, or a connection failure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from proxy.auth import ApiKeys
from proxy.coalesce import Coalescer
from proxy.errors import UnitProxyError
from proxy.gateway.router import NoUnit, Outcome, Router
from proxy.gateway.units import Unit
from proxy.metrics import GatewayMetrics, ServingMetrics
from proxy.pb.unitproxy.v1.inference_pb2 import GenerateChunk
from proxy.serving import Gate

log = logging.getLogger(__name__)

SERVICE = "unitproxy.v1.Inference"
METHOD = f"/{SERVICE}/Generate"
ROUTE = "grpc_generate"
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

UnaryStream = Callable[..., Any]  # grpc.aio.UnaryStreamMultiCallable, bytes in and out


def merge_chunks(messages: Sequence[bytes]) -> bytes:
    """Consecutive serialized GenerateChunks of one stream as one."""
    chunks = [GenerateChunk.FromString(m) for m in messages]
    merged = GenerateChunk()
    for chunk in chunks:
        merged.MergeFrom(chunk)  # token_ids append; finish_reason, usage: the last set
    merged.text = "".join(c.text for c in chunks)
    data: bytes = merged.SerializeToString()
    return data


class GenerateProxy:
    def __init__(
        self,
        router: Router,
        call_for: Callable[[Unit], UnaryStream],
        metrics: ServingMetrics,
        gateway_metrics: GatewayMetrics,
        gate: Gate,
        api_keys: ApiKeys | None = None,
        unit_key: str | None = None,
    ):
        self._gate = gate
        self._api_keys = api_keys or ApiKeys()
        self._unit_auth = None if unit_key is None else f"Bearer {unit_key}"
        self._router = router
        self._call_for = call_for
        self._metrics = metrics
        self._gw = gateway_metrics

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.unary_stream_rpc_method_handler(
            self.generate, request_deserializer=None, response_serializer=None
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Generate": method})

    async def generate(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        started = time.monotonic()
        code = "OK"
        try:
            self._api_keys.check_metadata(context.invocation_metadata())
            self._gate.enter()
        except UnitProxyError as exc:
            self._metrics.requests.labels(ROUTE, exc.grpc_code.name).inc()
            await context.abort(exc.grpc_code, exc.message)
        try:
            await self._generate(request, context, started)
        except UnitProxyError as exc:
            code = exc.grpc_code.name
            await context.abort(exc.grpc_code, exc.message)
        except grpc.aio.AioRpcError as exc:  # the unit failed after the first message
            code = exc.code().name
            await context.abort(exc.code(), exc.details() or "")
        finally:
            self._gate.exit()
            self._metrics.requests.labels(ROUTE, code).inc()
            self._metrics.request_duration.labels(ROUTE).observe(time.monotonic() - started)

    async def _generate(
        self, request: bytes, context: grpc.aio.ServicerContext, started: float
    ) -> None:
        tried: set[str] = set()
        last: grpc.aio.AioRpcError | None = None
        for _ in range(self._router.settings.retries + 1):
            if last is not None:
                self._gw.retries.labels(last.code().name.lower()).inc()
            try:
                unit = await self._router.acquire(tried)
            except NoUnit:
                if last is not None:
                    raise last from None
                self._gw.no_unit_available.inc()
                raise
            tried.add(unit.id)
            self._gw.routed.labels(unit.id).inc()
            last = await self._attempt(unit, request, context, started)
            if last is None:
                return
        assert last is not None
        raise last

    def _metadata(self, context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
        """What the unit gets: this gateway's unit key, or the client's own authorization."""
        if self._unit_auth is not None:
            return (("authorization", self._unit_auth),)
        given = [(k, v) for k, v in context.invocation_metadata() or () if k == "authorization"]
        return tuple((k, v if isinstance(v, str) else v.decode()) for k, v in given)

    async def _attempt(
        self, unit: Unit, request: bytes, context: grpc.aio.ServicerContext, started: float
    ) -> grpc.aio.AioRpcError | None:
        """Stream from ``unit``; return its error if it refused before the first message."""
        call = self._call_for(unit)(
            request, timeout=context.time_remaining(), metadata=self._metadata(context)
        )
        outcome = Outcome.FAILED
        try:
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() in RETRYABLE:
                    outcome = (
                        Outcome.REFUSED
                        if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                        else outcome
                    )
                    return exc
                outcome = Outcome.FAILED if exc.code() in FAILURES else Outcome.OK
                raise
            if first is grpc.aio.EOF:
                outcome = Outcome.OK
                return None
            self._metrics.ttft.labels(ROUTE).observe(time.monotonic() - started)
            out = Coalescer(context.write, merge_chunks)
            try:
                message = first
                while message is not grpc.aio.EOF:
                    await out.put(message)
                    message = await call.read()
                await out.close()
            except grpc.aio.AioRpcError:
                await out.close()  # what the unit sent before it failed, then its status
                raise
            finally:
                out.cancel()
            outcome = Outcome.OK
            return None
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in FAILURES:
                outcome = Outcome.OK
            raise
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED  # the client went away: no failure of the unit
            raise
        finally:
            call.cancel()
            self._router.release(unit, outcome)

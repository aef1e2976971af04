"""The gateway's composition root: router, load source, forwarding, HTTP and gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from proxy import build, ingress, multipart, openai_api
from proxy.accesslog import AccessLog
from proxy.auth import ApiKeys, flat_keys
from proxy.broadcast import Broadcast
from proxy.errors import UnitProxyError
from proxy.gate import Gate
from proxy.gateway.core import GatewayCore
from proxy.gateway.discovery import Discovery
from proxy.gateway.forward import Forwarder
from proxy.gateway.grpc_proxy import METHOD, SERVICE, GenerateProxy
from proxy.gateway.http1 import front
from proxy.gateway.http1.pool import Pool
from proxy.gateway.loadsource import HttpWatchSource, PollSource, RedisSource, WatchSource
from proxy.gateway.models import ModelCards
from proxy.gateway.rates import scaled
from proxy.gateway.request import Context, end_to_end, http_context
from proxy.gateway.router import Router
from proxy.gateway.tenancy import Admission, TenantGate, error_headers
from proxy.gateway.traces import RequestTrace, span_name
from proxy.gateway.units import Unit
from proxy.httputil import (
    NO_UNIT,
    ClientClosed,
    ClientGone,
    admin_drain,
    describe_admin,
    error_middleware,
    error_parts,
    json_response,
    quiet_bad_requests,
)
from proxy.ingress import Limits
from proxy.metrics import (
    GatewayMetrics,
    IngressMetrics,
    LoopCount,
    TenantMetrics,
)
from proxy.otlp import open_tracer
from proxy.ratelimit import Limiter
from proxy.redis_reports import connect
from proxy.resume import HintKey
from proxy.serving import (
    Drain,
    ListenError,
    Service,
    advertised_host,
    cancel_tasks,
    os_error,
    start_grpc,
)
from proxy.settings import Settings, UnitTarget
from proxy.tenants import TenantSource
from proxy.timers import Wheel
from proxy.tls import ClientTLS, ServerTLS, server_tls
from proxy.tracing import Tracer

log = logging.getLogger(__name__)

# What only time changes (an ejection ending, the last report going stale) is looked at
# this often, in s.
TICK_S = 0.5
# How often requests on units the router stopped routing to are moved elsewhere: a
# stopped unit's streams resume within its detection time plus this and the migration.
MOVE_CHECK_S = 0.1
# Every POST route of vLLM's server that takes a JSON body, by the route label of the
# metrics; the lean front serves them all. The unit answers those its engine lacks (404).
ROUTES = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/pooling": "pooling",
    "/classify": "classify",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
# The routes whose body is a multipart form (an audio file and its fields): aiohttp
# serves them (the lean front takes JSON bodies), routed by the form's model field.
FORM_ROUTES = {
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
}
# Routes on a stored response named in the path: sent to the unit that stores it.
BY_ID_ROUTES = ("responses_retrieve", "responses_cancel")
FORM_LABELS = frozenset(FORM_ROUTES.values())
# Every route label the forwarder serves (its metrics' series are made for these).
ROUTE_LABELS = (*dict.fromkeys(ROUTES.values()), *FORM_ROUTES.values(), *BY_ID_ROUTES)
UNIT_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)


class Gateway(Service):
    """A running gateway: ``async with Gateway(settings) as gateway`` serves until exit."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.settings = settings
        # The clock reports age by: the router's, and the views of units (gauges, /units).
        self.clock = clock
        self.registry = CollectorRegistry()
        # One object for all it records, handed to the router, the core and the wires.
        self.gateway_metrics = GatewayMetrics(self.registry)
        self.metrics = self.gateway_metrics.serving
        self.ingress_metrics = IngressMetrics(self.registry)
        self.discovery = Discovery(settings.gateway, self.gateway_metrics.discovery_refused)
        # The router gets the staleness bound and poll interval the report budget needs.
        self.router = Router(
            scaled(settings.gateway), settings.gateway.units, clock=clock,
            on_change=self._unit_changed, metrics=self.gateway_metrics,
        )  # fmt: skip
        self.health_service = HealthServicer()
        self.http_url = ""
        self.grpc_target = ""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._pools: dict[str, Pool] = {}
        self.redis_source: RedisSource | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._served = False
        self.api_keys = ApiKeys()
        self.tenancy: TenantGate | None = None  # with gateway.tenants_file
        self._requests: dict[tuple[str, str], LoopCount] = {}
        self.tracer: Tracer | None = None  # with tracing.otlp_endpoint
        self._client_tls: ClientTLS | None = None  # set at start
        self._serving_changed = asyncio.Event()
        self.changes = Broadcast()
        self.gate = Gate("gateway", self.changes, self.metrics.outstanding)
        self.model_cards = ModelCards(self._pools.get)
        self.drain = Drain(
            lambda: self.gate.in_flight, self.changes, settings.server.drain_timeout_s
        )

    async def _start(self) -> None:
        s, stack = self.settings, self._stack
        # First in, last out: the spans of the requests a drain waits for go out too.
        self.tracer = await open_tracer(stack, s.tracing, self.registry, "unitproxy-gateway")
        if s.gateway.tenants_file is None:
            self.api_keys = await ApiKeys.load(s.server, NO_UNIT)
        else:
            self.tenancy = await self._start_tenants()
            self.api_keys = ApiKeys(identify=self.tenancy.authorize, unit_id=NO_UNIT)
        self._client_tls = await self._load_client_tls()
        tls = await server_tls(s.server)
        stack.push_async_callback(self._close_clients)
        for unit in self.router.units.values():
            self._connect(unit)
        self.wheel = Wheel(asyncio.get_running_loop())
        stack.callback(self.wheel.close)
        self.core = GatewayCore(self.router, self.gateway_metrics, s.gateway)
        resume_key = self._resume_key()
        # Units grant interactive only to a request signed with it (the allowance over
        # capacity counts on their doing so).
        self.router.signs_interactive = resume_key is not None
        generate = GenerateProxy(
            self.core, s.gateway, self._generate_call, self.gateway_metrics,
            self.gate, self.wheel, self.api_keys, self._unit_key(), lambda u: self._pools.get(u.id),
            self.tenancy, s.server.write_timeout_s, resume_key, self.tracer,
        )  # fmt: skip
        self.forwarder = Forwarder(
            self.core, s.gateway, self._pools, self.gateway_metrics, self.gate,
            self.wheel, self._unit_key(), ROUTE_LABELS,
            resume_key,
        )  # fmt: skip
        http_port, grpc_port = s.ports("gateway")

        def register(server: grpc.aio.Server) -> None:
            server.add_generic_rpc_handlers((generate.handler(),))
            health_pb2_grpc.add_HealthServicer_to_server(self.health_service, server)

        await self._publish_health()
        _, bound_grpc = await start_grpc(stack, s.server.host, grpc_port, register, tls=tls)
        bound_http = await self._start_http(http_port, tls)
        host = advertised_host(s.server.host, s.server.advertise_host)
        scheme = "http" if tls is None else "https"
        self.http_url, self.grpc_target = f"{scheme}://{host}:{bound_http}", f"{host}:{bound_grpc}"
        stack.push_async_callback(cancel_tasks, self._tasks)
        self._start_load_source()
        self._tasks.append(asyncio.create_task(self._wake_queue_loop(), name="gateway queue"))
        self._tasks.append(asyncio.create_task(self._move_loop(), name="gateway moves"))
        self._tasks.append(asyncio.create_task(self._health_watch(), name="gateway health"))
        source: str = s.gateway.load_source
        if source == "watch" and self.watches_over_http:
            source = f"watch over HTTP (more than {s.gateway.watch_grpc_max_units} units)"
        log.info("gateway: HTTP %s, gRPC %s, %d units, policy %s, load from %s",
                 self.http_url, self.grpc_target, len(self.router.units),
                 s.gateway.policy, source)  # fmt: skip
        log.info("gateway: %s", describe_admin(self._admin_token()))
        log.info("gateway: %s", build.describe())

    async def _start_tenants(self) -> TenantGate:
        """Tenants from the file (and Redis), their limits (shared through Redis when
        there is one), and their metrics. A bad first file stops the start."""
        s, stack = self.settings, self._stack
        redis = None if s.redis.url is None else connect(s.redis)
        if redis is not None:
            stack.push_async_callback(redis.aclose)
        source = TenantSource(
            s.gateway.tenants_file, await flat_keys(s.server), s.gateway.tenants_poll_s,
            redis if s.gateway.tenants_redis else None, s.redis.cluster,
        )  # fmt: skip
        await source.load()
        metrics = TenantMetrics(self.registry, s.gateway.max_tenant_labels)
        limiter = Limiter(redis, s.redis, s.gateway.replicas, shared_gauge=metrics.shared)
        stack.push_async_callback(limiter.close)
        if redis is None:
            log.info("gateway: tenant limits counted by this gateway alone (no Redis)")
        self._tasks.append(asyncio.create_task(source.run(), name="tenants"))
        self._tasks.append(asyncio.create_task(limiter.run(), name="tenant limits"))
        access = AccessLog(s.gateway.access_log)
        stack.callback(access.flush)  # what is gathered, written at the stop
        return TenantGate(source, limiter, metrics, s.gateway.tenant_estimate_max_tokens,
                          served=self.router.charge, access=access)  # fmt: skip

    # --- drain ----------------------------------------------------------------------

    def start_drain(self) -> None:
        """Readiness 503 and health NOT_SERVING at once; new requests get 503."""
        if self.drain.start():
            log.info("gateway: draining, %d requests in flight", self.gate.in_flight)
            self.gate.closed = True
            self._serving_changed.set()

    async def wait_drained(self) -> None:
        await self.drain.wait()

    def stop_now(self) -> None:
        """A second signal: every open response ends at once with an error (SSE error
        event, gRPC UNAVAILABLE) before the process exits."""
        self.core.interrupt_all()

    # --- clients to units ---------------------------------------------------------

    async def _load_client_tls(self) -> ClientTLS:
        """What units are verified by: the CA file, else the system's roots. Loaded even
        when no configured unit is https://, for those discovered through Redis."""
        return await ClientTLS.load(self.settings.gateway.tls_ca_file)

    def _resume_key(self) -> HintKey | None:
        secret = self.settings.server.resume_secret
        if secret is None:
            if self.settings.gateway.migrations:
                log.warning("server.resume_secret is not set: a stream whose unit fails "
                            "after its first byte ends with an error instead of going on "
                            "elsewhere (units take resume hints from gateways only)")  # fmt: skip
            return None
        return HintKey(secret.get_secret_value())

    def _unit_key(self) -> str | None:
        key = self.settings.gateway.unit_api_key
        return None if key is None else key.get_secret_value()

    def _connect(self, unit: Unit) -> None:
        limit = self.settings.gateway.connections_per_unit
        tls = self._client_tls
        assert tls is not None
        self._pools[unit.id] = Pool(unit.http_url, limit, tls.ssl_context)

    def _channel(self, unit: Unit) -> grpc.aio.Channel:
        """The unit's gRPC channel, made on first use: about 11 KB a unit before it
        connects, which a fleet of thousands read over HTTP or Redis need not pay. A unit
        is TLS or not as its URL says, for HTTP and gRPC alike: never plaintext gRPC
        (load reports, Generate, the client's key) beside an https:// URL."""
        channel = self._channels.get(unit.id)
        if channel is None:
            tls = self._client_tls
            assert tls is not None
            if unit.http_url.startswith("https://"):
                channel = grpc.aio.secure_channel(
                    unit.grpc_target, tls.grpc_credentials, options=UNIT_CHANNEL_OPTIONS
                )
            else:
                channel = grpc.aio.insecure_channel(unit.grpc_target, options=UNIT_CHANNEL_OPTIONS)
            self._channels[unit.id] = channel
        return channel

    def _generate_call(self, unit: Unit) -> Any:
        return self._channel(unit).unary_stream(
            METHOD, request_serializer=None, response_deserializer=None
        )

    async def _close_clients(self) -> None:
        for pool in self._pools.values():
            await pool.close()
        for channel in self._channels.values():
            await channel.close()

    def _start_load_source(self) -> None:
        s = self.settings.gateway
        if s.load_source == "redis":
            self.redis_source = RedisSource(self.router, self.settings.redis, self._discovered)
            self._tasks.append(asyncio.create_task(self.redis_source.run(), name="load redis"))
            return
        units = list(self.router.units.values())
        if self.watches_over_http:
            quiet_s = self.router.settings.stale_after_s
            http_watch = HttpWatchSource(self.router, lambda u: self._pools[u.id], quiet_s)
            runs = [http_watch.run(u) for u in units]
        elif s.load_source == "watch":
            watch = WatchSource(self.router, self._channel)
            runs = [watch.run(u) for u in units]
        else:
            poll = PollSource(self.router, self._poll_pool)
            runs = [poll.run(u) for u in units]
        for unit, run in zip(units, runs, strict=True):
            self._tasks.append(asyncio.create_task(run, name=f"load {unit.id}"))

    @property
    def watches_over_http(self) -> bool:
        """Whether the load reports come as server-sent events: watch-http, or watch for a
        fleet too large to hold a gRPC channel per unit (``watch_grpc_max_units``)."""
        s = self.settings.gateway
        return s.load_source == "watch-http" or (
            s.load_source == "watch" and len(self.router.units) > s.watch_grpc_max_units
        )

    def _poll_pool(self, unit: Unit) -> Pool:
        tls = self._client_tls
        assert tls is not None
        return Pool(unit.http_url, 1, tls.ssl_context)

    def _discovered(self, target: UnitTarget) -> Unit | None:
        """A unit registered in Redis but not configured here: route to it too, if the
        discovery rules allow it."""
        if not self.discovery.admit(target, len(self.router.units)):
            return None
        unit = self.router.add(target)
        if unit.id not in self._pools:
            self._connect(unit)
        return unit

    # --- health -------------------------------------------------------------------

    def _unit_changed(self, unit: Unit) -> None:
        serving = self.router.any_reported_serving
        if serving != self._served:
            self._served = serving
            self._serving_changed.set()

    async def _health_watch(self) -> None:
        """Keep grpc.health.v1 in step: SERVING while at least one unit serves."""
        while True:
            await self._serving_changed.wait()
            self._serving_changed.clear()
            await self._publish_health()

    async def _publish_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        draining = self.drain.started
        can_serve = self._served and not draining
        await self.health_service.set(SERVICE, serving if can_serve else not_serving)
        await self.health_service.set("", not_serving if draining else serving)

    async def _wake_queue_loop(self) -> None:
        """Twice a second, offer the queue's waiters a unit (an ejection that ends frees
        one with no event to say so), and tell those that no unit is left for (the last
        one's reports went stale, again with no event)."""
        while True:
            self.router.release_stranded()
            self.router.wake()
            await asyncio.sleep(TICK_S)

    async def _move_loop(self) -> None:
        """Move requests off units the router stopped routing to (ejected, NOT_SERVING,
        LOST): a unit that went silent is noticed by its reports (stale_after_s), not
        by each stream's idle timeout."""
        while True:
            try:
                self.core.move_off_stopped_units()  # each request logs its move
            except Exception:
                log.exception("moving requests off stopped units failed")
            await asyncio.sleep(MOVE_CHECK_S)

    # --- HTTP ---------------------------------------------------------------------

    async def _start_http(self, port: int, tls: ServerTLS | None) -> int:
        """The lean front serves inference requests; it hands anything else to aiohttp."""
        s, stack = self.settings.server, self._stack
        quiet_bad_requests()
        runner = web.AppRunner(
            self._http_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        assert runner.server is not None
        limits = Limits(s, self.wheel, self.ingress_metrics, "gateway", NO_UNIT)
        http_front = front.Front(
            ROUTES, self._serve_front, runner.server, s.max_body_bytes, limits,
            authorize=self._authorize_head,
        )  # fmt: skip
        try:
            server = await asyncio.get_running_loop().create_server(
                http_front.protocol,
                s.host,
                port,
                ssl=None if tls is None else tls.ssl_context,
                reuse_address=True,
                backlog=ingress.LISTEN_BACKLOG,
            )
        except OSError as exc:
            raise ListenError(f"cannot listen on {s.host}:{port} (HTTP): {os_error(exc)}") from exc

        async def stop() -> None:
            server.close()
            await http_front.shutdown(1.0)

        stack.push_async_callback(stop)
        # uvloop's sockets are a list, not the tuple the stubs say (compiled code checks)
        sockets: Any = getattr(server, "sockets")  # noqa: B009
        return int(sockets[0].getsockname()[1])

    def _authorize_head(self, head: front.Head) -> None:
        """The API key, from the head (the lean front's requests): with tenants, its
        tenant, kept for the admission."""
        ctx = head.ctx
        tenancy = self.tenancy
        if tenancy is None:
            self.api_keys.check(ctx.authorization)
        else:
            ctx.tenant = tenancy.authorize(ctx.authorization)

    def _serve_front(
        self, response: front.Response, head: front.Head, body: bytes
    ) -> Coroutine[Any, Any, None]:
        return self._inference(response, head.ctx, body)

    async def _inference(
        self, down: front.Response | AiohttpResponse, ctx: Context, body: bytes
    ) -> None:
        """One inference request, whichever HTTP path it came by; counted by status."""
        code = "500"
        tracer = self.tracer
        if tracer is not None:
            name = span_name(ctx.method, ctx.path, ctx.stored)
            ctx.trace = RequestTrace(tracer.start(ctx.traceparent, ctx.tracestate, name))
        try:  # the API key was checked from the head, before the body was read
            form = ctx.route in FORM_LABELS
            model = None
            if form:  # a form's model field, found without reading the file (multipart.py)
                # no form: to some unit, which answers it as vLLM's server does
                with contextlib.suppress(multipart.MalformedForm):
                    model = multipart.model_of(body, ctx.headers.get("content-type"))
            tenancy = self.tenancy
            if tenancy is not None:  # the tenant's limits, before a unit is chosen
                key, priority = ctx.authorization, ctx.priority
                if form:
                    ctx.admission = await tenancy.admit_form(model, key, priority)
                elif ctx.stored is not None:  # a GET has no body to read a model from
                    ctx.admission = await tenancy.admit_stored(key, priority)
                else:  # decided here, unless Redis has to say
                    got = tenancy.try_admit_http(body, key, priority, ctx.tenant)
                    ctx.admission = got if isinstance(got, Admission) else await got.admitted()
            if ctx.invalid is not None:
                raise ctx.invalid
            want = self.core.form_want(ctx, model) if form else None
            code = str(await self.forwarder.handle(down, ctx, body, want))
        except UnitProxyError as exc:
            code = str(exc.http_status)
            status, error_head, error_body = error_parts(exc, ctx.request_id, NO_UNIT)  # none tried
            if self.tenancy is not None:
                error_head.update(error_headers(exc, ctx.admission))
            down.respond(status, error_head, error_body)
        except (ClientClosed, asyncio.CancelledError):
            code = "499"
            raise
        finally:
            self._count(ctx.route, code)
            if ctx.admission is not None:
                ctx.admission.finish(code)  # settles its tokens, whatever ended it
            if ctx.trace is not None:
                ctx.trace.finish(code)

    def _count(self, route: str, code: str) -> None:
        counter = self._requests.get((route, code))
        if counter is None:
            counter = self._requests[route, code] = self.metrics.requests.labels(route, code)
        counter.inc()

    def _http_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.server.max_body_bytes,
            middlewares=[ingress.phase_middleware(), error_middleware(NO_UNIT)]
            + ([self.api_keys.middleware()] if self.api_keys.enabled else [])
            + [ingress.body_middleware()],
        )

        def inference(route: str) -> Any:
            async def handle(request: web.Request) -> web.StreamResponse:
                try:
                    body = await request.read()
                except web.RequestPayloadError:
                    self._count(route, "400")  # the error middleware answers
                    raise
                down = AiohttpResponse(request)
                headers = end_to_end(request.headers.items())
                stored = request.match_info.get("response_id")
                # a retrieve's query (stream, starting_after) goes to the unit as it came
                path = request.path if stored is None else request.raw_path
                ctx = http_context(headers, route, path, request.method.encode(), stored)
                try:
                    await self._inference(down, ctx, body)
                except ClientGone as gone:
                    return gone.response
                assert down.response is not None
                return down.response

            return handle

        for path, route in (*ROUTES.items(), *FORM_ROUTES.items()):
            app.router.add_post(path, inference(route), expect_handler=self.api_keys.expect_handler)
        # the API routes answer GET alone, as vLLM's server (FastAPI) does: HEAD is 405
        app.router.add_get(
            "/v1/responses/{response_id}", inference("responses_retrieve"), allow_head=False
        )
        app.router.add_post(
            "/v1/responses/{response_id}/cancel", inference("responses_cancel"),
            expect_handler=self.api_keys.expect_handler,
        )  # fmt: skip
        app.router.add_get("/v1/models", self._models, allow_head=False)
        app.router.add_get("/v1/models/{model:.+}", self._model, allow_head=False)
        app.router.add_get("/health", _health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/units", self._units)
        app.router.add_get("/metrics", self._metrics_page)
        drain = admin_drain(self.start_drain, self._admin_token(), self._ready_body)
        app.router.add_post("/admin/drain", drain)
        return app

    def _admin_token(self) -> str | None:
        token = self.settings.server.admin_token
        return None if token is None else token.get_secret_value()

    async def _models(self, request: web.Request) -> web.Response:
        """Every model some unit's last load report lists, whatever its state now: the
        answer needs no unit, so it comes even while none is SERVING."""
        served = served_models(self.router.units.values())
        return json_response({"object": "list", "data": await self._cards(request, served)})

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        units = served_models(self.router.units.values()).get(name)
        if units is None:
            raise openai_api.model_not_found(name)
        return json_response((await self._cards(request, {name: units}))[0])

    async def _cards(
        self, request: web.Request, served: dict[str, list[str]]
    ) -> list[dict[str, Any]]:
        serving = {u.id for u in self.router.serving()}
        key = self._unit_key()
        authorization = f"Bearer {key}" if key else request.headers.get("authorization")
        return await self.model_cards.cards(served, serving, authorization)

    async def _ready(self, request: web.Request) -> web.Response:
        body = self._ready_body()
        return json_response(body, status=200 if body["state"] == "SERVING" else 503)

    def _ready_body(self) -> dict[str, Any]:
        age_at, stale = self.router.age_at(self.clock()), self.router.settings.stale_after_s
        counts = Counter(u.view(age_at, stale)[0] for u in self.router.units.values())
        serving = len(self.router.serving())
        state = "DRAINING" if self.drain.started else "SERVING" if serving else "NOT_SERVING"
        return {"state": state, "serving_units": serving, "units": dict(counts),
                "in_flight": self.gate.in_flight}  # fmt: skip

    async def _units(self, request: web.Request) -> web.Response:
        now = self.clock()
        units = [self._unit_json(u, now) for u in self.router.units.values()]
        return json_response({"units": units, "waiting": self.router.waiting})

    def _unit_json(self, u: Unit, now: float) -> dict[str, Any]:
        age_at = self.router.age_at(now)
        state, why = u.view(age_at, self.router.settings.stale_after_s)
        age = u.report_age(age_at)
        return {
            "id": u.id,
            "http_url": u.http_url,
            "grpc_target": u.grpc_target,
            "state": state,
            "reason": why,
            "outstanding": self.router.view.estimate(u),
            "reported_outstanding": u.report.outstanding if u.report else None,
            "inflight_here": u.inflight,
            "capacity": u.capacity,
            "report_age_s": None if age < 0 else round(age, 3),
            "ejected_for_s": round(max(0.0, u.ejected_until - now), 3),
            "ejections": u.ejections,
            "probation": u.probation,
            "routed": u.routed,
            "named_metrics": u.report.named_metrics if u.report else {},
        }

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


class AiohttpResponse:
    """A forward.Downstream over aiohttp, for requests the lean front handed over."""

    def __init__(self, request: web.Request):
        self._request = request
        self.response: web.StreamResponse | None = None
        self.status = 0

    @property
    def started(self) -> bool:
        return self.response is not None and self.response.prepared

    def respond(self, status: int, headers: dict[str, str], body: bytes, lines: str = "") -> None:
        self.status = status
        self.response = web.Response(status=status, body=body, headers=_with(headers, lines))

    async def start(self, status: int, headers: dict[str, str], lines: str = "") -> None:
        self.status = status
        self.response = web.StreamResponse(status=status, headers=_with(headers, lines))

    async def write(self, data: bytes) -> None:
        response = self.response
        assert response is not None
        try:
            if not response.prepared:
                await response.prepare(self._request)
            await response.write(data)
        except aiohttp.ClientConnectionResetError as exc:
            raise ClientGone(response) from exc

    def splice_writer(self, producer: front.Producer) -> None:
        return None  # aiohttp's writes are awaited

    async def end(self) -> None:
        response = self.response
        assert response is not None
        try:
            if not response.prepared:
                await response.prepare(self._request)
            await response.write_eof()
        except aiohttp.ClientConnectionResetError as exc:
            raise ClientGone(response) from exc


def _with(headers: dict[str, str], lines: str) -> dict[str, str]:
    """``headers`` and those of head ``lines`` (``name: value\\r\\n`` each)."""
    for line in lines.split("\r\n"):
        if line:
            name, _, value = line.partition(": ")
            headers[name] = value
    return headers


async def _health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


def served_models(units: Iterable[Unit]) -> dict[str, list[str]]:
    """Model name -> the ids of the units whose last report lists it, in unit order."""
    found: dict[str, list[str]] = {}
    for unit in units:
        if unit.report is not None:
            for model in unit.report.models:
                found.setdefault(model, []).append(unit.id)
    return found

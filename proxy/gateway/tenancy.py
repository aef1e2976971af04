"""The gateway's tenants: who a request is from, whether its limits let it in, and what
it used. Only built when ``gateway.tenants_file`` is set; without it the request path
is the plain API-key check and none of this runs.

    admit (key -> tenant, model allow-list, priority, token estimate, limits)
      -> the wire serves the request, filling in its Usage
      -> Admission.finish: settle the tokens, count usage, one access-log line

``finish`` runs exactly once per admitted request, from the wire's ``finally``, whatever
ended the request (finished, cancelled, migrated, failed).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from json.scanner import make_scanner
from typing import Any, Final

from engine import tokens
from proxy.accesslog import AccessLog
from proxy.errors import InvalidRequest, UnitProxyError
from proxy.jsonio import loads
from proxy.metrics import TenantMetrics
from proxy.openai_api import DONE, USAGE_COMMENT
from proxy.pb.unitproxy.v1.inference_pb2 import GenerateRequest
from proxy.ratelimit import Limiter, RateLimited, Reservation
from proxy.tenants import Tenant, TenantSource

log = logging.getLogger(__name__)

# As the simulator counts a chat: each message's content plus its template tokens, and
# the opened assistant turn.
MESSAGE_TOKENS: Final = 4
ASSISTANT_TOKENS: Final = 3
# The simulator's count, with each piece's count kept (about twice as fast on text).
count_tokens = tokens.TokenCounter()


class PromptCounts:
    """``count_tokens`` for prompts, with the texts counted lately kept: a tenant's system
    prompt and a conversation's earlier turns come again and again, and counting costs
    about 40 ns a character (a 13 KB prompt: half a millisecond of the gateway's CPU)
    where finding a text kept costs its hash. At most ``max_chars`` characters and
    ``max_texts`` texts are kept, all forgotten at once when either is full."""

    __slots__ = ("_chars", "_counts", "max_chars", "max_texts")

    def __init__(self, max_chars: int = 1 << 21, max_texts: int = 1 << 15) -> None:
        self.max_chars = max_chars
        self.max_texts = max_texts
        self._counts: dict[str, int] = {}
        self._chars = 0

    def __call__(self, text: str) -> int:
        n = self._counts.get(text)
        if n is not None:
            return n
        n = count_tokens(text)
        size = len(text)
        if size <= self.max_chars:
            if self._chars + size > self.max_chars or len(self._counts) >= self.max_texts:
                self._counts.clear()
                self._chars = 0
            self._counts[text] = n
            self._chars += size
        return n

    def __len__(self) -> int:
        return len(self._counts)


prompt_count: Final = PromptCounts()
# A unit's usage comment and the [DONE] after it end its stream within this many bytes
# (the comment is about 100): a read is looked through for it here only.
COMMENT_TAIL: Final = 512
# A request that ended so (HTTP status, gRPC code) had a unit work on its prompt.
WORKED: Final = frozenset({"200", "499", "OK", "CANCELLED"})
_DECODER = json.JSONDecoder()  # one, not one a call (json.loads builds none either)
# Its scanner, called directly: what ``_DECODER.raw_decode`` calls, less that method's
# interpreted frame (raw_decode turns the scanner's StopIteration into a ValueError).
_SCAN: Callable[[str, int], tuple[Any, int]] = make_scanner(_DECODER)  # type: ignore[arg-type]


def parse_json(data: bytes) -> Any:
    """``json.loads(data)`` (``proxy.jsonio.loads``: orjson where it reads the body)."""
    return loads(data)


def _decimal(text: str, start: int, end: int) -> int:
    """The ASCII decimal number ``text[start:end]``, of 1 to 18 digits; -1 where it is
    not one. (A loop over a few digits: ``int()`` of a slice costs several times more.)"""
    if start < 0 or end - start < 1 or end - start > 18:
        return -1
    n = 0
    for i in range(start, end):
        digit = ord(text[i]) - 48
        if digit < 0 or digit > 9:
            return -1
        n = n * 10 + digit
    return n


def seconds_text(x: float) -> str:
    """``f"{x:.4f}"`` for a time ``x`` of 0 s or more (below 0: "0.0000"), rounded half
    up: two digits a lookup, where the format spec costs a ``str.format`` call (compiled)
    and a float's decimal conversion, about four times as much."""
    n = int(x * 10000.0 + 0.5) if x > 0.0 else 0
    whole = n // 10000
    rest = n - whole * 10000
    return f"{whole}.{_TWO_DIGITS[rest // 100]}{_TWO_DIGITS[rest % 100]}"


_TWO_DIGITS: Final = [f"{i:02d}" for i in range(100)]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_tokens_of(req: dict[str, Any]) -> int:
    """The prompt's tokens as the simulator counts them (an estimate for a real model)."""
    messages = req.get("messages")
    if isinstance(messages, list):
        n = sum(prompt_count(_text(m.get("content"))) + MESSAGE_TOKENS
                for m in messages if isinstance(m, dict))  # fmt: skip
        return n + ASSISTANT_TOKENS
    prompt = req.get("prompt")
    if isinstance(prompt, str):
        return max(1, prompt_count(prompt))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) for p in prompt):
            return len(prompt)
        return sum(prompt_count(p) if isinstance(p, str) else len(p) for p in prompt)
    return 1


def max_tokens_of(req: dict[str, Any]) -> int | None:
    """The output the request asks for at most (``type is int``: not a bool)."""
    value = req.get("max_completion_tokens")
    if type(value) is int and value > 0:
        return value
    value = req.get("max_tokens")
    if type(value) is int and value > 0:
        return value
    return None


class Usage:
    """What one request used, as the wire learns it: an Admission's (it is one), or a
    sampled trace's where there are no tenants. (A plain class: one per request.)"""

    __slots__ = ("attempted", "completion", "first_byte", "prompt", "reported", "unit")

    def __init__(self) -> None:
        self.prompt = 0
        self.completion = 0
        self.reported = False  # from the unit's own usage, not counted here
        self.unit = ""
        self.first_byte = 0.0  # time.monotonic() of the first byte to the client
        self.attempted = 0.0  # of the first attempt on a unit

    def read_usage(self, usage: Any) -> None:
        """A unit's ``usage`` object (the last one wins)."""
        if isinstance(usage, dict):
            p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(p, int) and isinstance(c, int):
                self.prompt, self.completion, self.reported = p, c, True

    def read_header(self, value: str) -> bool:
        """The unit's ``USAGE_HEADER`` on a whole answer ("PROMPT COMPLETION"); False
        where it is not that (``read_body`` then reads the answer)."""
        at = value.find(" ")
        prompt = _decimal(value, 0, at)
        completion = _decimal(value, at + 1, len(value))
        if prompt < 0 or completion < 0:
            return False
        self.prompt, self.completion, self.reported = prompt, completion, True
        return True

    def read_body(self, data: bytes) -> None:
        """A whole JSON answer: its usage, read without parsing the rest of it."""
        at = data.rfind(b'"usage":')
        if at < 0:
            return
        try:
            usage, _ = _SCAN(data[at + 8 :].decode().lstrip(), 0)
        except (ValueError, StopIteration):  # UnicodeDecodeError too; StopIteration: no value
            return
        self.read_usage(usage)

    def take_comment(self, events: bytes) -> bytes:
        """Whole SSE events of a unit asked for its usage (``USAGE_HEADER``): read the
        usage comment it ends its stream with and take it out (the client never gets
        it). A unit writes the comment as its stream's last event but ``data: [DONE]``,
        so it is looked for there alone, from the end (a comment starts an event; no
        data line can start one). Where it is not there, the events go on as they are
        (and the usage is counted from the transcript, as for a unit that sends none).
        The caller looks for ``USAGE_COMMENT`` in the last ``COMMENT_TAIL`` bytes first."""
        at = events.rfind(USAGE_COMMENT)
        if at < 0 or (at > 0 and events[at - 2 : at] != b"\n\n"):
            return events
        end = events.find(b"\n\n", at)
        end = len(events) if end < 0 else end + 2
        rest = events[end:]
        if rest and rest != DONE:
            return events
        try:
            usage, _ = _SCAN(events[at + len(USAGE_COMMENT) : end].decode(), 0)
        except (ValueError, StopIteration):  # UnicodeDecodeError too
            usage = None
        self.read_usage(usage)
        # One copy of the events before the comment (a slice then + would make two: a
        # stream's last read may hold all of it)
        return b"".join((memoryview(events)[:at], rest))

    def count_output(self, text: str) -> None:
        """Output delivered as text, where the unit reported no usage."""
        if not self.reported:
            self.completion = count_tokens(text)

    def attempt(self, unit: str) -> None:
        if not self.attempted:
            self.attempted = time.monotonic()
        self.unit = unit


class Admission(Usage):
    """One admitted request of a tenant, and (a Usage) what it used: one object a
    request, not two."""

    __slots__ = ("_gate", "cost", "estimated", "finished", "model", "priority", "request",
                 "reservation", "started", "tenant")  # fmt: skip

    def __init__(
        self,
        gate: TenantGate,
        tenant: Tenant,
        model: str,
        priority: str,
        prompt: int,
        cost: int,
        reservation: Reservation,
        started: float,
    ):
        super().__init__()
        self._gate = gate
        self.tenant = tenant
        self.model = model
        self.priority = priority
        self.estimated = prompt  # prompt tokens, estimated (``prompt``: as used)
        self.cost = cost  # estimated tokens in all (prompt and completion)
        self.reservation = reservation
        self.started = started
        self.finished = False
        # The request as admission parsed it (a JSON body's dict, a GenerateRequest), for
        # the wire's Want to take (``take_request``) rather than parse the body again.
        self.request: Any = None

    @property
    def usage(self) -> Usage:
        """What the request used: the admission itself."""
        return self

    @property
    def headers(self) -> dict[str, str]:
        """The x-ratelimit-* headers of a limited tenant's response (none: {})."""
        return self.reservation.headers

    def header_pairs(self) -> list[tuple[str, str]]:
        """``headers`` as (name, value) pairs, built once: what gRPC's metadata is
        written with."""
        return self.reservation.pairs()

    def header_block(self) -> str:
        """``headers`` as the lines of a response head (``name: value\\r\\n`` each; ""
        where none): what an HTTP response is written with."""
        return self.reservation.block()

    def take_request(self) -> Any:
        """The parsed request, once (None after, or where admission parsed none)."""
        request, self.request = self.request, None
        return request

    def finish(self, status: str) -> None:
        """Settle and account the request; only the first call counts."""
        if self.finished:
            return
        self.finished = True
        if not self.reported:
            # No usage from the unit: the prompt as estimated if a unit worked on it
            # (it answered, or streamed some output, or the client left), and the output
            # that reached the client.
            worked = status in WORKED or self.completion > 0
            self.prompt = self.estimated if self.attempted and worked else 0
        used = self.prompt + self.completion
        self.reservation.settle(used)
        served = self._gate.served
        # Charged its cost when a unit took it: the difference, where there is one.
        if served is not None and self.attempted and used != self.cost:
            served(self.tenant.name, used - self.cost)
        self._gate.account(self, status)


class Pending:
    """An admission only Redis can decide (the replica's allotment does not cover it):
    what ``try_admit_*`` read of the request, kept for ``await admitted()`` so that
    nothing is read or checked twice."""

    __slots__ = ("_gate", "estimate", "model", "priority", "prompt", "request", "started",
                 "tenant")  # fmt: skip

    def __init__(
        self,
        gate: TenantGate,
        tenant: Tenant,
        model: str,
        priority: str,
        prompt: int,
        estimate: int,
        started: float,
    ):
        self._gate = gate
        self.tenant = tenant
        self.model = model
        self.priority = priority
        self.prompt = prompt
        self.estimate = estimate
        self.started = started
        self.request: Any = None

    async def admitted(self) -> Admission:
        """Redis's answer: the admission, or RateLimited."""
        gate = self._gate
        try:
            reservation = await gate.limiter.admit(self.tenant, self.estimate)
        except RateLimited as limited:
            gate.refused(self.tenant, self.model, limited)
            raise
        admission = Admission(gate, self.tenant, self.model, self.priority, self.prompt,
                              self.estimate, reservation, self.started)  # fmt: skip
        admission.request = self.request
        return admission


class TenantGate:
    """Admission by tenant for both wires."""

    def __init__(
        self,
        source: TenantSource,
        limiter: Limiter,
        metrics: TenantMetrics,
        estimate_max_tokens: int,
        clock: Callable[[], float] = time.monotonic,
        served: Callable[[str, int], None] | None = None,
        access: AccessLog | None = None,
    ):
        self.source = source
        self.limiter = limiter
        self.metrics = metrics
        self.estimate_max_tokens = estimate_max_tokens
        self._clock = clock
        # Told what a request used against its estimate, once it ends: the wait queue's
        # count of tokens served per tenant (Router.charge).
        self.served = served
        # Where each request's line goes (None: through logging, a record a line).
        self.access = access if access is not None else AccessLog("logging")

    def authorize(self, authorization: str | None) -> Tenant:
        """From the request's head alone: the key's tenant; raises Unauthenticated for
        an unknown key."""
        return self.source.current.identify(authorization)

    def try_admit_http(
        self,
        body: bytes,
        authorization: str | None,
        priority: str | None,
        tenant: Tenant | None = None,
    ) -> Admission | Pending:
        """``admit_http`` where it is decided here, with no await (the tenant's
        allotment or this replica's own counts cover it, as nearly every request's
        do); a Pending where Redis has to say (``await pending.admitted()``). Raises
        as it does. ``tenant``: the key's, where the head's check found it already."""
        started = self._clock()
        if tenant is None:
            tenant = self.source.current.identify(authorization)
        req, model, prompt, max_tokens = _http_request(body)
        got = self._try(tenant, model, priority, prompt, max_tokens, started)
        got.request = req
        return got

    async def admit_http(
        self, body: bytes, authorization: str | None, priority: str | None
    ) -> Admission:
        got = self.try_admit_http(body, authorization, priority)
        return got if isinstance(got, Admission) else await got.admitted()

    async def admit_form(
        self, model: str | None, authorization: str | None, priority: str | None
    ) -> Admission:
        """A multipart request (the audio routes): by its form's model field, with the
        tenant's default estimate (its prompt is audio)."""
        started = self._clock()
        tenant = self.source.current.identify(authorization)
        got = self._try(tenant, model or "", priority, 0, None, started)
        return got if isinstance(got, Admission) else await got.admitted()

    async def admit_stored(self, authorization: str | None, priority: str | None) -> Admission:
        """A request on a stored response named in the path (retrieve, cancel): no body
        and no model; the tenant's limits hold, its allow list held when it was made."""
        started = self._clock()
        tenant = self.source.current.identify(authorization)
        got = self._try(tenant, "", priority, 0, None, started, check=False)
        return got if isinstance(got, Admission) else await got.admitted()

    def try_admit_grpc(
        self, request: bytes, authorization: str | None, priority: str | None
    ) -> Admission | Pending:
        """``admit_grpc`` where it is decided here, as ``try_admit_http``."""
        started = self._clock()
        tenant = self.source.current.identify(authorization)
        req, prompt, max_tokens = _grpc_request(request)
        got = self._try(tenant, req.model, priority, prompt, max_tokens, started)
        got.request = req
        return got

    async def admit_grpc(
        self, request: bytes, authorization: str | None, priority: str | None
    ) -> Admission:
        got = self.try_admit_grpc(request, authorization, priority)
        return got if isinstance(got, Admission) else await got.admitted()

    def _try(
        self,
        tenant: Tenant,
        model: str,
        asked: str | None,
        prompt: int,
        max_tokens: int | None,
        started: float,
        check: bool = True,  # the model against the tenant's allow list
    ) -> Admission | Pending:
        """The admission where it is decided here (no await); a Pending where Redis has
        to say."""
        if check:
            tenant.check_model(model)
        priority = tenant.priority_for(asked)  # (an unknown class is refused before counting)
        estimate = prompt + (max_tokens or self.estimate_max_tokens)
        try:
            reservation = self.limiter.try_admit(tenant, estimate)
        except RateLimited as limited:
            self.refused(tenant, model, limited)
            raise
        if reservation is None:
            return Pending(self, tenant, model, priority, prompt, estimate, started)
        return Admission(self, tenant, model, priority, prompt, estimate, reservation, started)

    def refused(self, tenant: Tenant, model: str, limited: RateLimited) -> None:
        """A request of ``tenant`` refused 429 ``rate_limited``: counted and logged."""
        self.metrics.limited.labels(self.metrics.tenant(tenant.name), limited.limit).inc()
        if self.access.enabled(self._clock()):
            self.access.write(f"tenant={tenant.name} model={_field(model)} unit=- status=429 "
                              f"prompt_tokens=0 completion_tokens=0 ttft_s=- duration_s=0 "
                              f"limit={limited.limit}")  # fmt: skip

    def account(self, a: Admission, status: str) -> None:
        series = self.metrics.series(a.tenant.name, a.model)
        series.requests.inc()
        if a.prompt:
            series.prompt.inc(a.prompt)
        if a.completion:
            series.completion.inc(a.completion)
        if a.attempted:
            series.wait.observe(max(0.0, a.attempted - a.started))
        now = self._clock()
        access = self.access
        if not access.enabled(now):
            return  # the line is not built where it would not be written
        ttft = seconds_text(a.first_byte - a.started) if a.first_byte else "-"
        access.write(
            f"tenant={a.tenant.name} model={_field(a.model)} unit={a.unit or '-'} "
            f"status={status} prompt_tokens={a.prompt} completion_tokens={a.completion} "
            f"ttft_s={ttft} duration_s={seconds_text(now - a.started)} priority={a.priority}"
        )


def _http_request(body: bytes) -> tuple[dict[str, Any], str, int, int | None]:
    """An HTTP request's body: the object, its model, its prompt's estimated tokens and
    its max_tokens (None where it sets none)."""
    try:
        req = parse_json(body)
    except ValueError:
        req = None
    if not isinstance(req, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = req.get("model")
    return req, model if isinstance(model, str) else "", prompt_tokens_of(req), max_tokens_of(req)


def _grpc_request(request: bytes) -> tuple[GenerateRequest, int, int | None]:
    """A gRPC call's GenerateRequest, its prompt's estimated tokens and its max_tokens."""
    try:
        req = GenerateRequest.FromString(request)
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidRequest("the request is not a GenerateRequest") from exc
    which = req.WhichOneof("input")
    if which == "chat":
        prompt = sum(prompt_count(m.content) + MESSAGE_TOKENS for m in req.chat.messages)
        prompt += ASSISTANT_TOKENS
    elif which == "prompt_token_ids":
        prompt = len(req.prompt_token_ids.ids)
    else:
        prompt = max(1, prompt_count(req.prompt))
    max_tokens = req.sampling.max_tokens  # 0 where unset (HasField: False)
    return req, prompt, max_tokens if max_tokens > 0 else None


def _field(value: str) -> str:
    """A client's value in a key=value log line: quoted where it could forge a field."""
    if not value:
        return "-"
    return (
        value
        if value.isprintable() and " " not in value and '"' not in value
        else json.dumps(value)
    )


def error_headers(exc: UnitProxyError, admission: Admission | None) -> dict[str, str]:
    """The x-ratelimit-* headers an error response of a limited tenant carries."""
    if isinstance(exc, RateLimited):
        return exc.headers
    return admission.headers if admission is not None else {}

"""A request as the gateway sees it: its ``Context``, built once at the front from the
head (``http_context``, ``grpc_context``: the one place where the fields the gateway
interprets are read), and the ``Want`` it holds, which is what choosing a unit sees:
read once from the body by the wire that received it (``json_want``, ``grpc_want``)
and handed to the policy at each choice (a retry or a wait chooses again with the
same one).

The context carries every request header (lower-case names, the hop-by-hop ones
removed), so a new header needs no allow-list anywhere: its field is read in the
builders, and an attempt on either wire sends the unit what is end to end by one rule
(``passed``) with the gateway's own fields (``unit_fields``; over gRPC as metadata,
less what gRPC reserves). With tenants configured, the wire's admission adds the tenant's fields
to the Want (``for_tenant``); without, every request is the same tenant ("") of class
standard.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from proxy.errors import InvalidRequest
from proxy.gateway.tenancy import Admission, parse_json
from proxy.gateway.traces import RequestTrace
from proxy.httputil import (
    DEADLINE_HEADER,
    MIGRATE_HEADER,
    REQUEST_ID_HEADER,
    bad_request_id,
    new_request_id,
    timeout_s,
)
from proxy.load import GATEWAY_HEADER
from proxy.openai_api import USAGE_HEADER
from proxy.pb.unitproxy.v1 import inference_pb2
from proxy.resume import HintKey
from proxy.tenants import PRIORITIES, PRIORITY_HEADER, PRIORITY_SIG_HEADER, RANK, Tenant
from proxy.tracing import TRACEPARENT, TRACESTATE, Parent, parse_traceparent, trace_state

STANDARD = RANK["standard"]

# What a policy that reads prompts makes of one (``Policy.prompt_blocks``): the chained
# hashes of its blocks.
Blocks = Callable[[str], list[int]]


class Want:
    """What the router needs of a request: its model (None: any unit), the blocks of
    its prompt (a policy that reads prompts, such as prefix; empty otherwise), and the
    unit it must go to, if one; its tenant, priority class and estimated tokens, which
    order the gateway's wait queue.

    Immutable (``Final``: compiled, a field cannot be set). A plain class, not a frozen
    dataclass: that one's ``__init__`` is interpreted even in the compiled tree, eight
    ``object.__setattr__`` calls, about 1.8 us a request with tenants (each request gets
    its own Want); this one is built natively."""

    __slots__ = ("blocks", "chars", "cost", "max_tokens", "model", "rank", "tenant", "unit")

    def __init__(
        self,
        model: str | None = None,
        blocks: list[int] | None = None,
        chars: int = 0,
        unit: str | None = None,
        tenant: str = "",
        rank: int = STANDARD,
        cost: int = 0,
        max_tokens: int = 0,
    ) -> None:
        self.model: Final = model
        self.blocks: Final[list[int]] = [] if blocks is None else blocks
        self.chars: Final = chars  # the prompt's length in characters (with blocks)
        # The one unit it may go to (a stored response lives there); None: any unit.
        self.unit: Final = unit
        self.tenant: Final = tenant  # "": no tenants configured
        self.rank: Final = rank  # its priority class's rank in PRIORITIES (lower goes first)
        # tokens it is estimated to take (prompt + max_tokens); 0 without tenants
        self.cost: Final = cost
        # The output it asks for at most (max_tokens; with blocks, a policy that reads
        # prompts); 0: not given.
        self.max_tokens: Final = max_tokens

    def _fields(self) -> tuple[object, ...]:
        return (self.model, self.blocks, self.chars, self.unit, self.tenant, self.rank,
                self.cost, self.max_tokens)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Want):
            return NotImplemented
        return self._fields() == other._fields()

    def __repr__(self) -> str:
        return (
            f"Want(model={self.model!r}, blocks={self.blocks!r}, chars={self.chars!r},"
            f" unit={self.unit!r}, tenant={self.tenant!r}, rank={self.rank!r},"
            f" cost={self.cost!r}, max_tokens={self.max_tokens!r})"
        )

    @property
    def priority(self) -> str:
        return PRIORITIES[self.rank]


NO_WANT = Want()

# Hop-by-hop fields (RFC 9110 section 7.6.1): they describe one connection, so the
# context does not keep them and no unit gets them; a Connection header names more.
HOP_BY_HOP = frozenset(
    {"connection", "proxy-connection", "keep-alive", "te", "transfer-encoding", "upgrade"}
)
# End-to-end fields the gateway does not pass on as they came: it frames the request to
# the unit itself (host, length; a body aiohttp decoded has no encoding left), answers
# with no content coding (so it asks the unit for none), and sets the unit's
# authorization and the request id itself.
NOT_PASSED = frozenset(
    {"host", "content-length", "content-encoding", "accept-encoding", "expect",
     "authorization", REQUEST_ID_HEADER}
)  # fmt: skip
# The prefix of unitproxy's own control headers (deadline, priority, migration, resume):
# the gateway reads the client's, and writes its own to the unit, never the client's.
OWN_PREFIX = "x-unitproxy-"
# A request the gateway traces goes to the unit with the gateway's W3C trace context
# (naming its attempt span) in place of the client's.
NOT_PASSED_TRACED = NOT_PASSED | {TRACEPARENT, TRACESTATE}
# What gRPC reserves or its transport sets: a gRPC attempt (metadata, or the gRPC-Web
# head) carries none of the client's. Names with one of GRPC_PREFIXES are gRPC's own
# (``grpc-timeout``, ``grpc-encoding``...; ``:path``...); a binary ``-bin`` value is
# bytes, which a context does not keep (``grpc_context``).
GRPC_NOT_PASSED = frozenset({"content-type", "user-agent", "host", "te"})
GRPC_PREFIXES = ("grpc-", ":")
BINARY_SUFFIX = "-bin"
POST = b"POST"


class Context:
    """One client request, from the front to each attempt (a plain class: see
    core.Tried). Built by ``http_context`` or ``grpc_context``; the wire fills in
    ``admission`` (with tenants) and ``want`` once the body is read."""

    __slots__ = ("admission", "headers", "invalid", "method", "migrate", "path", "priority",
                 "request_id", "route", "stored", "tenant", "timeout_s", "trace", "traceparent",
                 "tracestate", "want")  # fmt: skip

    def __init__(
        self,
        route: str,  # the route label of the metrics
        path: str,
        headers: dict[str, str],  # every request header: lower-case names, end to end only
        request_id: str,  # the client's x-request-id, or a new one
        method: bytes = POST,
        stored: str | None = None,  # the stored response named in the path
    ):
        self.route = route
        self.path = path
        self.headers = headers
        self.request_id = request_id
        self.method = method
        self.stored = stored
        self.timeout_s: float | None = None  # the client's time budget (None: none given)
        self.migrate = True  # False: the client opted out (x-unitproxy-migrate: 0)
        self.priority: str | None = None  # the class the client asked for, if any
        # The client's W3C trace context: its traceparent (None: none, or malformed) and
        # the tracestate that goes with it.
        self.traceparent: Parent | None = None
        self.tracestate: str | None = None
        self.trace: RequestTrace | None = None  # its spans, set when the gateway traces
        # A header the gateway cannot take (answered 400 once the key is checked, as
        # the body's own errors are).
        self.invalid: InvalidRequest | None = None
        self.admission: Admission | None = None  # its tenant's, with tenants configured
        # Its tenant, where the key was checked from the head with tenants configured (the
        # admission then takes it rather than look the key up again).
        self.tenant: Tenant | None = None
        self.want = NO_WANT

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")

    def deadline(self, start: float, default_s: float | None) -> float | None:
        """When the request's time is up, for a request served from ``start``: its own
        budget, else ``default_s``; None: never."""
        budget = default_s if self.timeout_s is None else self.timeout_s
        return None if budget is None else start + budget


def http_context(
    headers: dict[str, str],
    route: str,
    path: str,
    method: bytes = POST,
    stored: str | None = None,
) -> Context:
    """The context of an HTTP request whose ``headers`` are ``end_to_end``. Every header
    the gateway interprets is read here, once."""
    ctx = Context(route, path, headers, headers.get(REQUEST_ID_HEADER) or new_request_id(),
                  method, stored)  # fmt: skip
    _read_fields(ctx, headers)
    try:
        ctx.timeout_s = timeout_s(headers.get(DEADLINE_HEADER))
    except InvalidRequest as exc:
        ctx.invalid = exc
    return ctx


def grpc_context(
    metadata: Iterable[tuple[str, str | bytes]] | None,
    route: str,
    path: str,
    time_remaining: float | None,
) -> Context:
    """The context of a gRPC call: its metadata as headers (binary ``-bin`` values left
    out), its deadline as the time budget. A request id that could not go back in a
    header is replaced, as one that is missing."""
    headers = end_to_end((k, v) for k, v in metadata or () if isinstance(v, str))
    request_id = headers.get(REQUEST_ID_HEADER)
    if not request_id or bad_request_id(request_id) is not None:
        request_id = new_request_id()
    ctx = Context(route, path, headers, request_id)
    _read_fields(ctx, headers)
    ctx.timeout_s = time_remaining
    return ctx


def _read_fields(ctx: Context, headers: Mapping[str, str]) -> None:
    """The fields both wires read alike."""
    ctx.migrate = headers.get(MIGRATE_HEADER) != "0"
    ctx.priority = headers.get(PRIORITY_HEADER)
    parent = headers.get(TRACEPARENT)
    if parent is not None:
        ctx.traceparent = parse_traceparent(parent)
        if ctx.traceparent is not None:  # a tracestate means nothing without its parent
            ctx.tracestate = trace_state(headers.get(TRACESTATE))


def end_to_end(fields: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Request header ``fields`` as a context keeps them: names in lower case, the
    first value of a repeated name (as aiohttp's ``headers.get`` reads it; the lean
    path hands such a request to aiohttp), and without the hop-by-hop ones (RFC 9110
    section 7.6.1)."""
    headers: dict[str, str] = {}
    for name, value in fields:
        headers.setdefault(name.lower(), value)
    return drop_hop_by_hop(headers)


def drop_hop_by_hop(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` (lower-case names) without the hop-by-hop fields, changed in place."""
    connection = headers.get("connection")
    if connection is not None:
        for token in connection.split(","):
            headers.pop(token.strip().lower(), None)
    for name in HOP_BY_HOP:
        headers.pop(name, None)
    return headers


def passed(headers: Mapping[str, str], traced: bool = False, grpc: bool = False) -> dict[str, str]:
    """What of a request's ``headers`` goes to the unit as it came: every end-to-end
    field but unitproxy's own and those in NOT_PASSED; ``traced``: nor the client's
    trace context, which the gateway's replaces; ``grpc`` (an attempt of a gRPC call):
    nor what gRPC reserves (``grpc_reserved``)."""
    dropped = NOT_PASSED_TRACED if traced else NOT_PASSED
    return {name: value for name, value in headers.items()
            if name not in dropped and not name.startswith(OWN_PREFIX)
            and not (grpc and grpc_reserved(name))}  # fmt: skip


def grpc_reserved(name: str) -> bool:
    """Whether a gRPC call's metadata ``name`` is gRPC's or its transport's to set."""
    return (name in GRPC_NOT_PASSED or name.startswith(GRPC_PREFIXES)
            or name.endswith(BINARY_SUFFIX))  # fmt: skip


def unit_fields(
    ctx: Context,
    unit_auth: str | None,
    key: HintKey | None,
    gateway: str | None = None,
    grpc: bool = False,
    class_field: bool = True,
) -> dict[str, str]:
    """What an attempt sends the unit, the same on both wires (HTTP headers; gRPC
    metadata, ``grpc``): the client's end-to-end fields as they came (``passed``), and
    the gateway's own: the request id, the authorization (``unit_auth``, the unit key,
    else the client's), with tenants the class it settled on (interactive with the
    signature of ``key``: the unit grants interactive only to what a gateway signed),
    the gateway's name (``gateway``: the unit's reports to it count its requests
    apart), and when it traces, its trace context naming the attempt's span.
    ``class_field`` false: the class is left out (an HTTP attempt writes it as one of its
    ``own_lines``)."""
    fields = passed(ctx.headers, ctx.trace is not None, grpc)
    fields[REQUEST_ID_HEADER] = ctx.request_id
    if gateway is not None:
        fields[GATEWAY_HEADER] = gateway
    authorization = unit_auth or ctx.authorization
    if authorization:
        fields["authorization"] = authorization
    if ctx.admission is not None:  # the unit passes the class to its engine
        priority = ctx.admission.priority
        if class_field:
            fields[PRIORITY_HEADER] = priority
        if priority == "interactive" and key is not None:
            fields[PRIORITY_SIG_HEADER] = key.sign_priority(ctx.request_id, priority)
    if ctx.trace is not None:
        fields.update(ctx.trace.headers())
    return fields


# An HTTP attempt's own head lines that depend on the request's class alone (and on
# whether its usage is asked for: ``openai_api.USAGE_HEADER``), written once here rather
# than formatted as fields each request.
_OWN_LINES: Final = {
    (priority, usage): (
        (f"{PRIORITY_HEADER}: {priority}\r\n" if priority else "")
        + (f"{USAGE_HEADER}: 1\r\n" if usage else "")
    ).encode()
    for priority in (None, *PRIORITIES)
    for usage in (False, True)
}


def own_lines(ctx: Context, usage: bool) -> bytes:
    """The lines of an HTTP attempt's head that ``unit_fields(..., class_field=False)``
    leaves out: with tenants the class the request settled on, and ``usage``: the
    unit's usage asked for (``USAGE_HEADER``)."""
    admission = ctx.admission
    return _OWN_LINES[None if admission is None else admission.priority, usage]


def for_tenant(want: Want, tenant: str, priority: str, cost: int) -> Want:
    """``want`` of a request admitted for ``tenant`` in class ``priority``."""
    return Want(want.model, want.blocks, want.chars, want.unit, tenant, RANK[priority], cost,
                want.max_tokens)  # fmt: skip


def pinned(want: Want, unit: str) -> Want:
    """``want``, to go only to ``unit``."""
    return Want(want.model, want.blocks, want.chars, unit, want.tenant, want.rank, want.cost,
                want.max_tokens)  # fmt: skip


def json_want(body: bytes, blocks: Blocks | None) -> Want:
    """The Want of an OpenAI JSON body (one that does not parse wants nothing: the
    unit answers it with its 400). ``blocks``: the policy's, when it reads prompts."""
    try:
        data = parse_json(body)
    except (ValueError, RecursionError):  # nested deeper than the parser goes
        return Want()
    return body_want(data, blocks)


def body_want(data: Any, blocks: Blocks | None) -> Want:
    """The Want of a parsed JSON body (``json_want``'s, where it was parsed already)."""
    if not isinstance(data, dict):
        return Want()
    model = data.get("model")
    model = model if isinstance(model, str) and model else None
    if blocks is None:
        return Want(model)
    text = prompt_text(data)
    most = data.get("max_completion_tokens", data.get("max_tokens"))
    most = most if isinstance(most, int) and most > 0 else 0
    return Want(model, blocks(text), len(text), max_tokens=most)


def grpc_want(request: bytes, blocks: Blocks | None) -> Want:
    """The Want of a serialized GenerateRequest."""
    try:
        req = inference_pb2.GenerateRequest.FromString(request)
    except Exception:  # protobuf's DecodeError; the unit answers INVALID_ARGUMENT
        return Want()
    return message_want(req, blocks)


def message_want(req: inference_pb2.GenerateRequest, blocks: Blocks | None) -> Want:
    """The Want of a parsed GenerateRequest (``grpc_want``'s, where it was parsed)."""
    if blocks is None:
        return Want(req.model or None)
    which = req.WhichOneof("input")
    if which == "chat":
        messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        text = prompt_text({"messages": messages})
    elif which == "prompt_token_ids":
        text = prompt_text({"prompt": list(req.prompt_token_ids.ids)})
    else:
        text = req.prompt
    most = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else 0
    return Want(req.model or None, blocks(text), len(text), max_tokens=most)


def prompt_text(body: dict[str, Any]) -> str:
    """The part of an OpenAI request body that the engine prefills, as one string:
    the chat messages (role and text content, in order) or the completion prompt. The
    same conversation gives the same leading text whatever comes after it."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first  # a batch of prompts: the first one's prefix
        return json.dumps(prompt if isinstance(first, int) else first, separators=(",", ":"))
    return ""


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text, in order
        content = "".join(_part_text(p) for p in content)
    # Strings only: what is not (a part whose text is a number...) reads as no text
    # here, and the unit answers the request with its 400.
    return f"<|{_text(message.get('role'))}|>\n{_text(content)}\n"


def _part_text(part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        return ""
    return _text(part.get("text"))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""

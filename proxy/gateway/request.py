"""What choosing a unit sees of a request: ``Want``, read once from the request's body
by the wire that received it (``json_want``, ``grpc_want``) and handed to the policy
at each choice (a retry or a wait chooses again with the same one).

One object, so that what a policy may read of a request (its tenant, its priority
class; later: hints) is a field here rather than one more argument through every layer.
With tenants configured, the wire's admission adds the tenant's fields (``for_tenant``);
without, every request is the same tenant ("") of class standard.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.pb.unitproxy.v1 import inference_pb2
from proxy.tenants import PRIORITIES, RANK

STANDARD = RANK["standard"]

# What a policy that reads prompts makes of one (``Policy.prompt_blocks``): the chained
# hashes of its blocks.
Blocks = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class Want:
    """What the router needs of a request: its model (None: any unit), the blocks of
    its prompt (a policy that reads prompts, such as prefix; empty otherwise), and the
    unit it must go to, if one; its tenant, priority class and estimated tokens, which
    order the gateway's wait queue."""

    model: str | None = None
    blocks: list[int] = field(default_factory=list)
    chars: int = 0  # the prompt's length in characters (with blocks)
    # The one unit it may go to (a stored response lives there); None: any unit.
    unit: str | None = None
    tenant: str = ""  # "": no tenants configured
    rank: int = STANDARD  # its priority class's rank in PRIORITIES (lower goes first)
    cost: int = 0  # tokens it is estimated to take (prompt + max_tokens); 0 without tenants
    # The output it asks for at most (max_tokens; with blocks, a policy that reads
    # prompts); 0: not given.
    max_tokens: int = 0

    @property
    def priority(self) -> str:
        return PRIORITIES[self.rank]


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
        data = json.loads(body)
    except (ValueError, RecursionError):  # nested deeper than the parser goes
        return Want()
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

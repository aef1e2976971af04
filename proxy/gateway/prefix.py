"""Which unit likely holds a prompt's prefix in its KV cache: the gateway's own index.

The gateway has no tokenizer, so a prompt is cut into blocks of ``chunk_chars``
characters of its canonical text (``prompt_text``) and each full block is named by a
hash chained over every block before it: block k matches only when the first k + 1
blocks are the same, as an engine's KV blocks do. What a unit holds is estimated
from what this gateway sent it: every block of every prompt routed there, with the
time it was last sent. Per unit at most ``max_blocks`` blocks are kept (least
recently sent out first, like the engine's own LRU) and a block not sent for
``ttl_s`` is dropped (the engine has likely evicted it). A unit that restarted or was
removed is ``forget``-ed.

Lookup walks a request's blocks from the deepest one held anywhere back to the first
and yields, at each depth, the units whose longest match ends there: the caller takes
the first that it may route to (``select.prefix_affinity``). One dict lookup per block
finds the deepest held block (binary search on the chain: a unit that holds block k
was sent blocks 0..k too), so the cost grows with the units that hold the prefix, not
with the fleet.

Memory: a block costs one entry in its unit's LRU and one in the shared map (about
200 bytes together), so at most ``units * max_blocks`` entries.
Each gateway replica keeps its own index from its own traffic: a prefix that replica A
sent to unit 1 is unknown to replica B, which may send it to unit 2 (and cache it
there too), so with R replicas a prefix ends up on up to R units.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from proxy.pb.unitproxy.v1 import inference_pb2

NO_BLOCKS: list[int] = []


@dataclass(frozen=True, slots=True)
class Want:
    """What the router needs of a request: its model (None: any unit), and the blocks
    of its prompt (policy prefix; empty otherwise)."""

    model: str | None = None
    blocks: list[int] = field(default_factory=list)


def json_want(body: bytes, index: PrefixIndex | None) -> Want:
    """The Want of an OpenAI JSON body (one that does not parse wants nothing: the
    unit answers it with its 400)."""
    try:
        data = json.loads(body)
    except ValueError:
        return Want()
    if not isinstance(data, dict):
        return Want()
    model = data.get("model")
    blocks = NO_BLOCKS if index is None else index.hashes(prompt_text(data))
    return Want(model if isinstance(model, str) and model else None, blocks)


def grpc_want(request: bytes, index: PrefixIndex | None) -> Want:
    """The Want of a serialized GenerateRequest."""
    try:
        req = inference_pb2.GenerateRequest.FromString(request)
    except Exception:  # protobuf's DecodeError; the unit answers INVALID_ARGUMENT
        return Want()
    if index is None:
        return Want(req.model or None)
    which = req.WhichOneof("input")
    if which == "chat":
        messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        text = prompt_text({"messages": messages})
    elif which == "prompt_token_ids":
        text = prompt_text({"prompt": list(req.prompt_token_ids.ids)})
    else:
        text = req.prompt
    return Want(req.model or None, index.hashes(text))


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
        content = "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return f"<|{message.get('role', '')}|>\n{content if isinstance(content, str) else ''}\n"


class PrefixIndex:
    """Per unit, the prefix blocks this gateway sent there lately (bounded, aged)."""

    def __init__(
        self,
        chunk_chars: int = 256,
        max_blocks: int = 4096,
        ttl_s: float = 600.0,
        max_request_blocks: int = 512,
    ) -> None:
        self.chunk_chars = chunk_chars
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self.max_request_blocks = max_request_blocks
        self._units: dict[str, OrderedDict[int, float]] = {}  # block -> when last sent
        self._holders: dict[int, set[str]] = {}  # block -> the units that hold it

    def hashes(self, text: str) -> list[int]:
        """The chained hashes of ``text``'s full blocks (at most ``max_request_blocks``).
        hash() is salted per process, as the index is."""
        size = self.chunk_chars
        end = min(len(text), size * self.max_request_blocks)
        blocks: list[int] = []
        h = 0
        for start in range(0, end - size + 1, size):
            h = hash((h, text[start : start + size]))
            blocks.append(h)
        return blocks

    def record(self, unit_id: str, blocks: Iterable[int], now: float) -> None:
        """``blocks`` were sent to ``unit_id`` at ``now``: they are its most recent."""
        lru = self._units.get(unit_id)
        if lru is None:
            lru = self._units[unit_id] = OrderedDict()
        holders = self._holders
        for block in blocks:
            if block in lru:
                lru.move_to_end(block)
            else:
                held_by = holders.get(block)
                if held_by is None:
                    holders[block] = {unit_id}
                else:
                    held_by.add(unit_id)
            lru[block] = now
        self._trim(unit_id, lru, now)

    def _trim(self, unit_id: str, lru: OrderedDict[int, float], now: float) -> None:
        oldest = now - self.ttl_s
        while lru and (len(lru) > self.max_blocks or next(iter(lru.values())) < oldest):
            block, _ = lru.popitem(last=False)
            self._drop(block, unit_id)

    def _drop(self, block: int, unit_id: str) -> None:
        held_by = self._holders.get(block)
        if held_by is not None:
            held_by.discard(unit_id)
            if not held_by:
                del self._holders[block]

    def expire(self, now: float) -> None:
        """Drop every block not sent for ``ttl_s`` (each unit's oldest first)."""
        for unit_id, lru in list(self._units.items()):
            self._trim(unit_id, lru, now)

    def forget(self, unit_id: str) -> None:
        """The unit's cache is gone (it restarted, or left the fleet)."""
        for block in self._units.pop(unit_id, {}):
            self._drop(block, unit_id)

    def matches(self, blocks: list[int], now: float) -> Iterator[tuple[int, list[str]]]:
        """(depth, units) from the deepest match down: ``units`` hold the prompt's first
        ``depth`` blocks and no deeper one; each unit is yielded once."""
        depth = self._deepest(blocks)
        seen: set[str] = set()
        oldest = now - self.ttl_s
        while depth > 0:
            block = blocks[depth - 1]
            fresh = [
                u
                for u in self._holders.get(block, ())
                if u not in seen and self._units[u][block] >= oldest
            ]
            if fresh:
                seen.update(fresh)
                yield depth, fresh
            depth -= 1

    def _deepest(self, blocks: list[int]) -> int:
        """How many leading blocks some unit holds (binary search on the chain)."""
        holders = self._holders
        low, high = 0, len(blocks)  # blocks[:low] held (by assumption), beyond high not
        while low < high:
            mid = (low + high + 1) // 2
            if blocks[mid - 1] in holders:
                low = mid
            else:
                high = mid - 1
        return low

    def stats(self) -> tuple[int, int]:
        """(units indexed, blocks held over all units)."""
        return len(self._units), sum(len(lru) for lru in self._units.values())

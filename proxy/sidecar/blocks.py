"""The prefix blocks the unit's engine holds, as every gateway names them: the engine's
KV cache events translated into a change stream of text-chunk hashes.

The engine names a block by a hash of its tokens; a gateway has no tokenizer and names
a prompt by chunks of its text (``proxy.prefix_chunks``). The sidecar sees both: when a
request starts it asks the engine which blocks the prompt fills and where in the
engine's prompt text each ends (``Engine.prompt_blocks``), locates every chat message's
content in that text (template-agnostic: the content appears there verbatim) to carry
those ends over to the gateway's canonical text, and notes, for each engine block, the
chunks whose last character that block covers. When the engine then says it stored the
block (``BlockStored``) those chunks join the held set; when it says it removed it
(``BlockRemoved``, ``AllBlocksCleared``) they leave it. A chunk is held only while the
engine holds the block that covers its end, and so every block before it.

Each change (a chunk added or removed) gets the next sequence number; a report carries
the changes since the seq its reader holds (``delta``), at most MAX_DELTA_BLOCKS of
them, or the whole set (at most ``max_blocks`` chunks, the most recently stored kept)
when the reader holds nothing, another epoch, or a seq older than the kept log.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque

from engine.base import EngineRequest
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from proxy.load import MAX_DELTA_BLOCKS, PrefixBlocks
from proxy.prefix_chunks import chunk_hashes

MAX_PENDING = 65_536  # engine blocks named at a request's start, awaiting BlockStored
MAX_REQUEST_CHUNKS = 512  # as the gateway's index (PrefixIndex.max_request_blocks)


def gateway_text(request: EngineRequest) -> str:
    """The request's prompt as a gateway reads it (``proxy.gateway.request.prompt_text``)."""
    if request.messages is not None:
        return "".join(f"<|{m.role}|>\n{m.content}\n" for m in request.messages)
    return request.prompt or ""


def _offset_map(request: EngineRequest, engine_text: str) -> list[tuple[int, int, int]]:
    """(engine offset, gateway offset, length) of each run of text the two share."""
    if request.messages is None:
        return [(0, 0, len(engine_text))]
    runs: list[tuple[int, int, int]] = []
    at_engine = at_gateway = 0
    for m in request.messages:
        at_gateway += len(m.role) + 4  # "<|role|>\n"
        found = engine_text.find(m.content, at_engine)
        if found < 0:
            break  # the engine's text is not what this sidecar thinks: name nothing past it
        runs.append((found, at_gateway, len(m.content)))
        at_engine = found + len(m.content)
        at_gateway += len(m.content) + 1
    return runs


def _to_gateway(runs: list[tuple[int, int, int]], offset: int) -> int:
    """Where engine text ``offset`` falls in the gateway's text: inside a shared run,
    the same place; past one, its end (template text maps to nothing)."""
    mapped = 0
    for engine_at, gateway_at, length in runs:
        if offset < engine_at:
            break
        mapped = gateway_at + min(offset - engine_at, length)
    return mapped


class HeldChunks:
    """The chunk hashes the engine holds, with a numbered log of changes."""

    def __init__(self, chunk_chars: int, max_blocks: int, rng: random.Random | None = None):
        self.chunk_chars = chunk_chars
        self.max_blocks = max_blocks
        self.epoch = (rng or random.SystemRandom()).getrandbits(63) or 1
        self.seq = 0
        self._held: OrderedDict[int, None] = OrderedDict()  # chunk, oldest stored first
        self._log: deque[tuple[int, bool]] = deque(maxlen=4 * max_blocks)  # (chunk, added)
        self._pending: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # block -> chunks
        self._names: dict[int, tuple[int, ...]] = {}  # a held engine block -> its chunks

    def __len__(self) -> int:
        return len(self._held)

    def expect(
        self, request: EngineRequest, engine_text: str, spans: list[tuple[int, int]]
    ) -> None:
        """A request starts: note which chunks of its text each engine block covers."""
        if not spans:
            return
        chunks = chunk_hashes(gateway_text(request), self.chunk_chars, MAX_REQUEST_CHUNKS)
        if not chunks:
            return
        runs = _offset_map(request, engine_text)
        size, j = self.chunk_chars, 0
        for block, engine_end in spans:
            end = _to_gateway(runs, engine_end)
            first = j
            while j < len(chunks) and (j + 1) * size <= end:
                j += 1
            if j > first and block not in self._names:
                self._pending[block] = tuple(chunks[first:j])
                self._pending.move_to_end(block)
            if j == len(chunks):
                break
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def events(self, events: list[KVEvent]) -> None:
        """The engine's KV cache events, in order."""
        for event in events:
            if isinstance(event, BlockStored):
                for block in event.block_hashes:
                    chunks = self._pending.pop(block, None)
                    if chunks is not None:
                        self._names[block] = chunks
                        for chunk in chunks:
                            self._add(chunk)
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    for chunk in self._names.pop(block, ()):
                        self._remove(chunk)
            elif isinstance(event, AllBlocksCleared):
                self._names.clear()
                for chunk in list(self._held):
                    self._remove(chunk)

    def _add(self, chunk: int) -> None:
        if chunk in self._held:
            self._held.move_to_end(chunk)
            return
        self._held[chunk] = None
        self._change(chunk, True)
        while len(self._held) > self.max_blocks:
            self._remove(next(iter(self._held)))

    def _remove(self, chunk: int) -> None:
        if chunk in self._held:
            del self._held[chunk]
            self._change(chunk, False)

    def _change(self, chunk: int, added: bool) -> None:
        self.seq += 1
        self._log.append((chunk, added))

    def delta(self, epoch: int, since: int) -> PrefixBlocks:
        """What a reader holding ``since`` of ``epoch`` needs: the changes after it (at
        most MAX_DELTA_BLOCKS; the next report carries the rest), or the whole set."""
        behind = self.seq - since
        if epoch != self.epoch or since < 0 or behind < 0 or behind > len(self._log):
            return self.full()
        take = min(behind, MAX_DELTA_BLOCKS)
        start = len(self._log) - behind
        net: dict[int, bool] = {}
        for i in range(start, start + take):
            chunk, added = self._log[i]
            net[chunk] = added
        added_now = tuple(c for c, a in net.items() if a)
        removed_now = tuple(c for c, a in net.items() if not a)
        return PrefixBlocks(
            self.epoch, since, since + take, False, added_now, removed_now, self.chunk_chars
        )

    def full(self) -> PrefixBlocks:
        return PrefixBlocks(self.epoch, 0, self.seq, True, tuple(self._held), (), self.chunk_chars)

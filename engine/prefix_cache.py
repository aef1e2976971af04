"""The simulator's prefix cache: KV blocks of a fixed number of tokens, LRU, bounded.

A prompt is cut into full blocks of ``block_size`` tokens of the simulator's tokenizer
(``engine.tokens``; token-id prompts in blocks of ids) and each block is named by a
hash chained over every block before it, as vLLM names its KV blocks: a block hits
only when the whole prefix up to its end is the same. A request's leading run of
cached blocks needs no prefill; then every block of its prompt is the most recently
used, and the least recently used blocks go once there are more than ``capacity``.
A block is shared by every request whose prompt starts the same way. The last,
partial block of a prompt is never cached, and neither is the output (vLLM caches
full blocks of output too; a follow-up turn here hits up to its previous prompt).

Every change is told to a subscriber as vLLM's KV cache events tell it
(``engine.kv_events``): the blocks a prompt stored, with the block they follow; the
blocks evicted; the whole cache cleared.

Hit rate: cached prompt tokens over prompt tokens looked up, since start (vLLM's
``prefix_cache_hits`` over ``prefix_cache_queries``, both in tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEvents
from engine.tokens import TokenCounter


class PrefixCache:
    """At most ``capacity`` blocks of ``block_size`` tokens, least recently used out first."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._counter = TokenCounter()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which were cached
        self.resets = 0  # times the cache was emptied (``clear``)
        self.listener: KVEvents | None = None  # told of every change, as KV cache events

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def hit_rate(self) -> float:
        """Cached over looked-up prompt tokens since start; 0 before the first lookup."""
        return self.hits / self.queries if self.queries else 0.0

    def text_blocks(self, text: str) -> list[int]:
        """The chained hashes of ``text``'s full blocks (hash() is per process, as is
        the cache)."""
        return [block for block, _ in self.text_spans(text)]

    def text_spans(self, text: str) -> list[tuple[int, int]]:
        """Each full block of ``text``: its chained hash and where in ``text`` it ends."""
        spans: list[tuple[int, int]] = []
        h, start = 0, 0
        for end in self._counter.block_ends(text, self.block_size):
            h = hash((h, text[start:end]))
            spans.append((h, end))
            start = end
        return spans

    def id_blocks(self, ids: Sequence[int]) -> list[int]:
        size = self.block_size
        blocks: list[int] = []
        h = 0
        for start in range(0, len(ids) - size + 1, size):
            h = hash((h, tuple(ids[start : start + size])))
            blocks.append(h)
        return blocks

    def admit(self, blocks: Sequence[int], prompt_tokens: int) -> int:
        """The cached tokens of a prompt whose prefill begins now (its leading run of
        cached blocks, less one token: the last prompt token is always computed);
        every block of it becomes the most recently used."""
        cache = self._blocks
        hit = 0
        for block in blocks:
            if block not in cache:
                break
            hit += 1
        # The first block is touched last: a chain is evicted from its end, as vLLM
        # frees a sequence's blocks, so a shared prefix outlives what follows it.
        if self.listener is None:  # the planner's units: no bookkeeping for events
            for block in reversed(blocks):
                if block in cache:
                    cache.move_to_end(block)
                else:
                    cache[block] = None
            while len(cache) > self.capacity:
                cache.popitem(last=False)
        else:
            self._touch_telling(blocks, self.listener)
        cached = max(0, min(hit * self.block_size, prompt_tokens - 1))
        self.queries += prompt_tokens
        self.hits += cached
        return cached

    def _touch_telling(self, blocks: Sequence[int], listener: KVEvents) -> None:
        """``admit``'s touch and eviction, telling ``listener`` what was stored (from the
        first block not held, with the block it follows) and what was evicted."""
        cache = self._blocks
        first_new = len(blocks)
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
                first_new = i
        removed: list[int] = []
        while len(cache) > self.capacity:
            removed.append(cache.popitem(last=False)[0])
        events: list[KVEvent] = []
        if first_new < len(blocks):
            parent = blocks[first_new - 1] if first_new else None
            events.append(BlockStored(tuple(blocks[first_new:]), parent, self.block_size))
        if removed:
            events.append(BlockRemoved(tuple(removed)))
        if events:
            listener(events)

    def clear(self) -> None:
        """Empty the cache (vLLM's reset_prefix_cache)."""
        self._blocks.clear()
        self.resets += 1
        if self.listener is not None:
            self.listener([AllBlocksCleared()])

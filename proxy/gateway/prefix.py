"""Which unit likely holds a prompt's prefix in its KV cache: the gateway's own index,
kept by policy prefix (``policies/prefix.py``).

The gateway has no tokenizer, so a prompt is cut into blocks of ``chunk_chars``
characters of its canonical text (``request.prompt_text``) and each full block is named by a
hash chained over every block before it (``proxy.prefix_chunks``, the same in every process): block k matches only when the first k + 1
blocks are the same, as an engine's KV blocks do. What a unit holds is estimated
from what this gateway sent it: every block of every prompt routed there, with the
time it was last sent. Per unit at most ``max_blocks`` blocks are kept (least
recently sent out first, like the engine's own LRU) and a block not sent for
``ttl_s`` is dropped (the engine has likely evicted it). A unit that restarted or was
removed is ``forget``-ed.

Lookup walks a request's blocks from the deepest one held anywhere back to the first
and yields, at each depth, the units whose longest match ends there: the caller takes
the first that it may route to (``policies.prefix.prefix_affinity``). One dict lookup
per block finds the deepest held block (binary search on the chain: a unit that holds block k
was sent blocks 0..k too), so the cost grows with the units that hold the prefix, not
with the fleet.

Memory: a block costs one entry in its unit's LRU and one in the shared map (about
200 bytes together), so at most ``units * max_blocks`` entries.

What the engine says corrects the index (``EngineFeedback``): each load report carries
the engine's prefix-cache counters (prompt tokens looked up, and found cached), and
between two reports the share the unit found is compared with the share the index
expected of what this gateway sent there. Far below it, the unit holds less than the
index thinks (a smaller cache, other traffic): its block limit shrinks to what agrees,
so the index keeps only the unit's most recent blocks; at or above it, the limit grows
back towards ``max_blocks``. A report that says the cache was emptied (vLLM's
reset_prefix_cache) forgets the unit.
Each gateway replica keeps its own index from its own traffic: a prefix that replica A
sent to unit 1 is unknown to replica B. Where units report the blocks their engines
hold (``proxy.gateway.held``), the policy routes on those first, the same on every
replica, and this index only fills in between reports.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from proxy.prefix_chunks import chunk_hashes

log = logging.getLogger(__name__)

MIN_LIMIT = 64  # the fewest blocks the engine's hits may shrink a unit's index to


class PrefixIndex:
    """Per unit, the prefix blocks this gateway sent there lately (bounded, aged)."""

    def __init__(
        self,
        chunk_chars: int = 512,
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
        self._limits: dict[str, int] = {}  # blocks kept for a unit, when below max_blocks

    def hashes(self, text: str) -> list[int]:
        """The chained hashes of ``text``'s full blocks (at most ``max_request_blocks``),
        the same in every process (``proxy.prefix_chunks``): units name what their
        engines hold the same way."""
        return chunk_hashes(text, self.chunk_chars, self.max_request_blocks)

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

    def limit(self, unit_id: str) -> int:
        """The most blocks kept for the unit: ``max_blocks`` unless its engine's hits
        said it holds fewer (``resize``)."""
        return self._limits.get(unit_id, self.max_blocks)

    def resize(self, unit_id: str, blocks: int, now: float) -> None:
        """Keep at most ``blocks`` (within [MIN_LIMIT, max_blocks]) for the unit: its
        most recently sent."""
        blocks = max(MIN_LIMIT, min(self.max_blocks, blocks))
        if blocks >= self.max_blocks:
            self._limits.pop(unit_id, None)
        else:
            self._limits[unit_id] = blocks
        lru = self._units.get(unit_id)
        if lru is not None:
            self._trim(unit_id, lru, now)

    def drop_before(self, unit_id: str, when: float) -> None:
        """Drop the unit's blocks last sent before ``when`` (its engine has said what it
        holds since)."""
        lru = self._units.get(unit_id)
        while lru and next(iter(lru.values())) < when:
            block, _ = lru.popitem(last=False)
            self._drop(block, unit_id)

    def held(self, unit_id: str) -> int:
        """Blocks the index holds for the unit."""
        return len(self._units.get(unit_id, ()))

    def depth(self, unit_id: str, blocks: list[int]) -> int:
        """How many leading blocks of ``blocks`` the index says the unit holds."""
        lru = self._units.get(unit_id)
        if not lru:
            return 0
        low, high = 0, len(blocks)
        while low < high:
            mid = (low + high + 1) // 2
            if blocks[mid - 1] in lru:
                low = mid
            else:
                high = mid - 1
        return low

    def _trim(self, unit_id: str, lru: OrderedDict[int, float], now: float) -> None:
        oldest = now - self.ttl_s
        limit = self._limits.get(unit_id, self.max_blocks)
        while lru and (len(lru) > limit or next(iter(lru.values())) < oldest):
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
        self._limits.pop(unit_id, None)

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


# EngineFeedback: a window closes once the unit looked up this many prompt tokens; the
# index's share is too high when the unit found less than SHRINK_BELOW of it (and at
# least SHRINK_MARGIN less), right when it found GROW_ABOVE of it or more.
WINDOW_TOKENS = 20_000
SHRINK_BELOW = 0.7
SHRINK_MARGIN = 0.05
GROW_ABOVE = 0.9
GROW_FACTOR = 1.25


@dataclass(slots=True)
class _Window:
    queries: int  # the unit's counters when the window opened
    hits: int
    resets: int
    expected: float = 0.0  # characters of prompts sent there that the index said it held
    sent: float = 0.0  # characters of prompts sent there


@dataclass(slots=True)
class Verdict:
    """One closed window of one unit: what it found and what the index expected."""

    unit_id: str
    found: float  # share of prompt tokens the engine found cached
    expected: float  # share of prompt characters the index expected cached
    limit: int  # the unit's block limit after it


class EngineFeedback:
    """Corrects ``index`` from the prefix-cache counters in each unit's load reports
    (see the module docstring)."""

    def __init__(self, index: PrefixIndex, window_tokens: int = WINDOW_TOKENS) -> None:
        self.index = index
        self.window_tokens = window_tokens
        self._windows: dict[str, _Window] = {}
        self.verdicts: list[Verdict] = []  # the last few, for tests and logs
        self.shrunk = 0
        self.grown = 0
        self.resets = 0

    def sent(self, unit_id: str, blocks: list[int], chars: int) -> None:
        """A prompt of ``chars`` characters goes to the unit (before it is recorded)."""
        window = self._windows.get(unit_id)
        if window is None:
            return  # no counters from the unit yet
        held = self.index.depth(unit_id, blocks) * self.index.chunk_chars
        window.expected += min(held, chars)
        window.sent += chars

    def report(self, unit_id: str, queries: int, hits: int, resets: int, now: float) -> None:
        window = self._windows.get(unit_id)
        if window is not None and resets > window.resets:
            self.resets += 1
            self.index.forget(unit_id)  # the engine emptied its prefix cache
            window = None
        elif window is not None and queries < window.queries:
            window = None  # the engine started over (the router forgets a restarted unit)
        if window is None:
            if queries or hits or resets:  # an engine that counts (not -1/unknown)
                self._windows[unit_id] = _Window(queries, hits, resets)
            return
        looked_up = queries - window.queries
        if looked_up < self.window_tokens or window.sent <= 0:
            return
        found = (hits - window.hits) / looked_up
        expected = window.expected / window.sent
        held = self.index.held(unit_id)
        if found < SHRINK_BELOW * expected and found < expected - SHRINK_MARGIN:
            self.index.resize(unit_id, int(held * max(0.5, found / expected)), now)
            self.shrunk += 1
            log.info("unit %s found %.0f %% of its prompts cached against the %.0f %% its "
                     "prefix index expected: the index keeps %d blocks for it",
                     unit_id, 100 * found, 100 * expected, self.index.limit(unit_id))  # fmt: skip
        elif found >= GROW_ABOVE * expected and held >= self.index.limit(unit_id):
            self.index.resize(unit_id, int(self.index.limit(unit_id) * GROW_FACTOR) + 1, now)
            self.grown += 1
        self.verdicts = [
            *self.verdicts[-15:],
            Verdict(unit_id, found, expected, self.index.limit(unit_id)),
        ]
        self._windows[unit_id] = _Window(queries, hits, resets)

    def forget(self, unit_id: str) -> None:
        self._windows.pop(unit_id, None)

    def counts(self) -> dict[str, int]:
        """Corrections so far, by action (unitproxy_prefix_index_corrections_total)."""
        return {"shrunk": self.shrunk, "grown": self.grown, "forgotten": self.resets}

"""What every unit's engine says it holds in its prefix cache (its load reports'
``prefix_blocks``), as one map from block to units: the same on every gateway replica
that reads the same reports, whichever requests it routed itself.

Blocks are chunks of prompt text named as ``proxy.prefix_chunks`` names them. A unit's
set follows its change stream: a whole set replaces it; changes apply only on the seq
they follow (``apply`` says False otherwise: the reader missed some and its load source
fetches a whole set). Lookup is as ``PrefixIndex.matches``: the deepest block held
anywhere (binary search on the chain), then each shallower depth's new holders.

A block one unit holds maps to that unit's id, not a set of one (most blocks: a set
would be most of the memory, and making one per block most of a report's cost).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from proxy.build import compiled
from proxy.load import PrefixBlocks


class BlockMap(Protocol):
    """``EngineBlocks``, or ``blocktable.CompactBlocks`` (the same map, packed)."""

    chunk_chars: int
    gaps: int

    def knows(self, unit_id: str) -> bool: ...
    def at(self, unit_id: str) -> tuple[int, int] | None: ...
    def held(self, unit_id: str) -> set[int]: ...
    def apply(self, unit_id: str, blocks: PrefixBlocks) -> bool: ...
    def forget(self, unit_id: str) -> None: ...
    def matches(self, blocks: list[int]) -> Iterator[tuple[int, list[str]]]: ...


def engine_blocks(chunk_chars: int) -> BlockMap:
    """The packed map where it is compiled (a third of the memory, faster), else this
    module's (the packed one interpreted is several times slower)."""
    try:
        from proxy.gateway import blocktable
    except ImportError:  # no librt: a pure install without mypy's runtime
        return EngineBlocks(chunk_chars)
    if compiled(blocktable.__name__):
        return blocktable.CompactBlocks(chunk_chars)
    return EngineBlocks(chunk_chars)


class EngineBlocks:
    def __init__(self, chunk_chars: int) -> None:
        self.chunk_chars = chunk_chars
        self._units: dict[str, set[int]] = {}
        self._at: dict[str, tuple[int, int]] = {}  # unit -> (epoch, seq) of its set
        self._holders: dict[int, str | set[str]] = {}  # block -> its unit, or units
        self.gaps = 0  # changes that did not follow on (a whole set was needed)

    def knows(self, unit_id: str) -> bool:
        return unit_id in self._at

    def at(self, unit_id: str) -> tuple[int, int] | None:
        return self._at.get(unit_id)

    def held(self, unit_id: str) -> set[int]:
        return self._units.get(unit_id, set())

    def apply(self, unit_id: str, blocks: PrefixBlocks) -> bool:
        """Apply a report's blocks; False when they do not follow on what is held (or
        name blocks of another size): nothing changes."""
        if blocks.chunk_chars != self.chunk_chars:
            return False
        at = self._at.get(unit_id)
        if blocks.full:
            if at is not None and at[0] == blocks.epoch and blocks.seq < at[1]:
                return True  # an older whole set (a re-read that crossed newer changes)
            held = self._units.setdefault(unit_id, set())
            if held:  # the whole set again: only what it changes touches the map
                gone = held.difference(blocks.added)
                held.difference_update(gone)
                _let_go(self._holders, unit_id, gone)
            self._add_all(unit_id, held, blocks.added)
        else:
            if at is None or at != (blocks.epoch, blocks.from_seq):
                if at is None or at[0] != blocks.epoch or blocks.seq > at[1]:
                    self.gaps += 1
                    return False
                return True  # changes already applied (a late duplicate)
            held = self._units[unit_id]
            if blocks.removed:
                gone = held.intersection(blocks.removed)
                held.difference_update(gone)
                _let_go(self._holders, unit_id, gone)
            self._add_all(unit_id, held, blocks.added)
        self._at[unit_id] = (blocks.epoch, blocks.seq)
        return True

    def _add_all(self, unit_id: str, held: set[int], added: tuple[int, ...]) -> None:
        """One pass per report (a report carries up to a thousand changes); blocks no
        other unit holds (most) go into the map in one call."""
        new = set(added)
        new.difference_update(held)
        held.update(new)
        holders = self._holders
        shared = holders.keys() & new
        if shared:
            new.difference_update(shared)
            for block in shared:
                units = holders[block]
                if isinstance(units, str):
                    holders[block] = {units, unit_id}
                else:
                    units.add(unit_id)
        holders.update(dict.fromkeys(new, unit_id))

    def forget(self, unit_id: str) -> None:
        _let_go(self._holders, unit_id, self._units.pop(unit_id, set()))
        self._at.pop(unit_id, None)

    def matches(self, blocks: list[int]) -> Iterator[tuple[int, list[str]]]:
        """(depth, units) from the deepest match down, each unit once."""
        holders = self._holders
        low, high = 0, len(blocks)
        while low < high:
            mid = (low + high + 1) // 2
            if blocks[mid - 1] in holders:
                low = mid
            else:
                high = mid - 1
        seen: set[str] = set()
        depth = low
        while depth > 0:
            units = holders.get(blocks[depth - 1])
            if units is None:
                fresh = []
            elif isinstance(units, str):
                fresh = [] if units in seen else [units]
            else:
                fresh = [u for u in units if u not in seen]
            if fresh:
                seen.update(fresh)
                yield depth, fresh
            depth -= 1


def _let_go(holders: dict[int, str | set[str]], unit_id: str, blocks: set[int]) -> None:
    """Take unit_id off the holders of blocks, each of which it holds: all popped in one
    call, the few that other units also hold put back."""
    gone = list(blocks)
    was = list(map(holders.pop, gone))
    if set in set(map(type, was)):
        for block, units in zip(gone, was, strict=True):
            if isinstance(units, set):  # two units or more
                units.discard(unit_id)
                holders[block] = units if len(units) > 1 else next(iter(units))


def merged(
    first: Iterator[tuple[int, list[str]]], second: Iterator[tuple[int, list[str]]]
) -> Iterator[tuple[int, list[str]]]:
    """Two ``matches`` in one, deepest first, each unit once."""
    seen: set[str] = set()
    a, b = next(first, None), next(second, None)
    while a is not None or b is not None:
        if b is None or (a is not None and a[0] >= b[0]):
            assert a is not None
            depth, units = a
            a = next(first, None)
            if b is not None and b[0] == depth:
                units = [*units, *b[1]]
                b = next(second, None)
        else:
            depth, units = b
            b = next(second, None)
        fresh = [u for u in units if u not in seen]
        if fresh:
            seen.update(fresh)
            yield depth, fresh

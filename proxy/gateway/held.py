"""What every unit's engine says it holds in its prefix cache (its load reports'
``prefix_blocks``), as one map from block to units: the same on every gateway replica
that reads the same reports, whichever requests it routed itself.

Blocks are chunks of prompt text named as ``proxy.prefix_chunks`` names them. A unit's
set follows its change stream: a whole set replaces it; changes apply only on the seq
they follow (``apply`` says False otherwise: the reader missed some and its load source
fetches a whole set). Lookup is as ``PrefixIndex.matches``: the deepest block held
anywhere (binary search on the chain), then each shallower depth's new holders.
"""

from __future__ import annotations

from collections.abc import Iterator

from proxy.load import PrefixBlocks


class EngineBlocks:
    def __init__(self, chunk_chars: int) -> None:
        self.chunk_chars = chunk_chars
        self._units: dict[str, set[int]] = {}
        self._at: dict[str, tuple[int, int]] = {}  # unit -> (epoch, seq) of its set
        self._holders: dict[int, set[str]] = {}
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
            self.forget(unit_id)
            held = self._units[unit_id] = set()
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
                holders = self._holders
                for block in gone:  # each held here, so its holders name this unit
                    units = holders[block]
                    if len(units) == 1:
                        del holders[block]
                    else:
                        units.discard(unit_id)
            self._add_all(unit_id, held, blocks.added)
        self._at[unit_id] = (blocks.epoch, blocks.seq)
        return True

    def _add_all(self, unit_id: str, held: set[int], added: tuple[int, ...]) -> None:
        """One pass per report (a report carries up to a thousand changes)."""
        new = set(added)
        new.difference_update(held)
        held.update(new)
        holders = self._holders
        for block in new:
            units = holders.get(block)
            if units is None:
                holders[block] = {unit_id}
            else:
                units.add(unit_id)

    def _drop(self, unit_id: str, block: int) -> None:
        units = self._holders.get(block)
        if units is not None:
            units.discard(unit_id)
            if not units:
                del self._holders[block]

    def forget(self, unit_id: str) -> None:
        for block in self._units.pop(unit_id, ()):
            self._drop(unit_id, block)
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
            fresh = [u for u in holders.get(blocks[depth - 1], ()) if u not in seen]
            if fresh:
                seen.update(fresh)
                yield depth, fresh
            depth -= 1


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

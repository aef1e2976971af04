"""``held.EngineBlocks`` in a packed table, for the compiled build: the same map from
block to units, in about a sixth of the memory and less time a report.

The dict-and-set map costs about 110 bytes a block held (a dict entry with its share of
the table, a set entry in the unit's set, a Python int for the number); a fleet of
5,000 units of 512 blocks each is then 89 KB a unit. Here every block is one slot of an
open-addressing table (linear probing, deletion by backward shift) of native 64-bit
keys and 32-bit unit indexes, at most 70 % full (17-34 bytes a block), and nothing
else: whether a unit holds a block is the block's slot. A block two units or more hold
has a set of unit indexes beside the table (few: prefixes units share). A report's
blocks are read as it packed them (``PrefixBlocks.added_packed``), 8 bytes a key, with
no Python int made for one.

What a unit holds is not kept by unit, so a whole set that replaces one (a resync after
a gap, a sidecar's log overrun) or a unit forgotten cannot be let go of block by block:
the unit's index is retired instead (a whole set takes a new one), lookups pass over
the retired index's entries, and a sweep takes them out over the next reports, a
bounded number of slots a report, before they could make the table grow.

The table is two ``librt.vecs`` vectors, which mypyc compiles to plain C arrays; in
pure Python each access is a method call, many times slower than the dict map, so the
pure build keeps that one (``held.engine_blocks`` picks).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from librt.strings import read_i64_le
from librt.vecs import append, vec
from mypy_extensions import i32, i64

from proxy.load import PrefixBlocks

EMPTY: Final[i32] = -1  # a free slot of the map
SHARED: Final[i32] = -2  # two units or more: their ids in _shared
FIRST_SIZE: Final[i64] = 1024
# A report's keys are applied this many bytes (256 keys) at a time, each batch's slots
# read ahead first (CompactBlocks._touch): what they pull into the cache stays there
# until the batch is applied.
BATCH: Final[i64] = 2048
# The sweep of a retired index's entries visits this many slots a dead entry (at the
# next reports, SWEEP_LEAST to SWEEP_MOST slots a report): a pass over the whole map is
# owed once the dead are 1/24 of its slots (1/14 of its entries at 60 % full), well
# short of what would make it grow.
SWEEP_PER_DEAD: Final[i64] = 24
SWEEP_MOST: Final[i64] = 1 << 15
SWEEP_LEAST: Final[i64] = 1 << 10
_TOP: Final = 1 << 63
_WRAP: Final = 1 << 64


_SHORT: Final = 0x3FFFFFFFFFFFFFFF  # the largest int mypyc keeps unboxed (tagged)


def _key(block: int) -> i64:
    """A block number (unsigned 64 bits) as the tables' signed key."""
    if 0 <= block <= _SHORT:  # every chunk name of 60 bits: no boxed int compared
        return block
    return block if block < _TOP else block - _WRAP


def _block(key: i64) -> int:
    return key if key >= 0 else int(key) + _WRAP


def _home(key: i64, mask: i64) -> i64:
    return (key ^ (key >> 23) ^ (key >> 41)) & mask


def _filled(size: i64, value: i32) -> vec[i32]:
    out = vec[i32](capacity=size)
    for _ in range(size):
        out = append(out, value)
    return out


def _filled64(size: i64, value: i64) -> vec[i64]:
    out = vec[i64](capacity=size)
    for _ in range(size):
        out = append(out, value)
    return out


def _stays(free: i64, home: i64, at: i64) -> bool:
    """Backward-shift deletion: the entry at ``at``, whose home slot is ``home``, stays
    where it is when its home lies cyclically in (free, at]."""
    if free <= at:
        return free < home <= at
    return free < home or home <= at


class CompactBlocks:
    def __init__(self, chunk_chars: int) -> None:
        self.chunk_chars = chunk_chars
        self.gaps = 0  # changes that did not follow on (a whole set was needed)
        self._at: dict[str, tuple[int, int]] = {}  # unit -> (epoch, seq) of its set
        self._index: dict[str, i64] = {}  # unit -> its index
        self._ids: list[str] = []  # index -> unit ("" once retired)
        self._live: vec[i32] = vec[i32]()  # index -> 1 while a unit's, 0 once retired
        self._counts: vec[i64] = vec[i64]()  # index -> the map's entries that name it
        self._free: list[i64] = []  # retired indexes no entry names any more
        self._shared: dict[i64, set[int]] = {}  # key -> the indexes of its units
        self._mask: i64 = FIRST_SIZE - 1
        self._used: i64 = 0
        self._keys: vec[i64] = _filled64(FIRST_SIZE, 0)
        self._units: vec[i32] = _filled(FIRST_SIZE, EMPTY)
        self._dead: i64 = 0  # entries that name a retired index
        self._debt: i64 = 0  # slots the sweep owes
        self._cursor: i64 = 0  # where the sweep goes on
        self._seen: i64 = 0  # what _touch read (unused)

    def knows(self, unit_id: str) -> bool:
        return unit_id in self._at

    def at(self, unit_id: str) -> tuple[int, int] | None:
        return self._at.get(unit_id)

    def table(self) -> tuple[int, int, int]:
        """(slots, entries, of them a retired index's): the map's size, for tests."""
        return int(self._mask + 1), int(self._used), int(self._dead)

    def held(self, unit_id: str) -> set[int]:
        """A unit's blocks (a walk of the whole map: for tests and inspection)."""
        unit = self._index.get(unit_id, -1)
        out: set[int] = set()
        if unit < 0:
            return out
        keys, units = self._keys, self._units
        for slot in range(len(units)):
            held = units[slot]
            if held == unit or (held == SHARED and unit in self._shared[keys[slot]]):
                out.add(_block(keys[slot]))
        return out

    def apply(self, unit_id: str, blocks: PrefixBlocks) -> bool:
        """Apply a report's blocks; False when they do not follow on what is held (or
        name blocks of another size): nothing changes."""
        if blocks.chunk_chars != self.chunk_chars:
            return False
        at = self._at.get(unit_id)
        if blocks.full:
            if at is not None and at[0] == blocks.epoch and blocks.seq < at[1]:
                return True  # an older whole set (a re-read that crossed newer changes)
            unit = self._index.get(unit_id, -1)
            if unit >= 0 and self._counts[unit] > 0:
                # The whole set again: the unit takes a new index and what the old one
                # named is swept later (lookups pass it over meanwhile). No set of a
                # unit's own is kept to tell what the new set lacks.
                self._retire(unit_id, unit)
            unit = self._unit(unit_id)
            added = blocks.added_packed
            for start in range(0, len(added), BATCH):
                end = min(start + BATCH, len(added))
                self._touch(added, start, end)
                for i in range(start, end, 8):
                    self._add(unit, read_i64_le(added, i))
        else:
            if at is None or at != (blocks.epoch, blocks.from_seq):
                if at is None or at[0] != blocks.epoch or blocks.seq > at[1]:
                    self.gaps += 1
                    return False
                return True  # changes already applied (a late duplicate)
            unit = self._index[unit_id]
            removed = blocks.removed_packed
            for start in range(0, len(removed), BATCH):
                end = min(start + BATCH, len(removed))
                self._touch(removed, start, end)
                for i in range(start, end, 8):
                    self._remove(unit, read_i64_le(removed, i))
            added = blocks.added_packed
            for start in range(0, len(added), BATCH):
                end = min(start + BATCH, len(added))
                self._touch(added, start, end)
                for i in range(start, end, 8):
                    self._add(unit, read_i64_le(added, i))
        self._at[unit_id] = (blocks.epoch, blocks.seq)
        self._pay()
        return True

    def forget(self, unit_id: str) -> None:
        self._at.pop(unit_id, None)
        unit = self._index.get(unit_id, -1)
        if unit >= 0:
            self._retire(unit_id, unit)
            self._pay()

    def matches(self, blocks: list[int]) -> Iterator[tuple[int, list[str]]]:
        """(depth, units) from the deepest match down, each unit once."""
        low, high = 0, len(blocks)
        while low < high:
            mid = (low + high + 1) // 2
            if self._holds(_key(blocks[mid - 1])):
                low = mid
            else:
                high = mid - 1
        seen: set[str] = set()
        live = self._live
        depth = low
        while depth > 0:
            key = _key(blocks[depth - 1])
            slot = self._slot(key)
            fresh: list[str] = []
            if slot >= 0:
                unit = self._units[slot]
                if unit != SHARED:
                    if live[i64(unit)]:
                        unit_id = self._ids[unit]
                        if unit_id not in seen:
                            fresh.append(unit_id)
                else:
                    for each in self._shared[key]:
                        if live[each] and self._ids[each] not in seen:
                            fresh.append(self._ids[each])
            if fresh:
                seen.update(fresh)
                yield depth, fresh
            depth -= 1

    def _holds(self, key: i64) -> bool:
        """Whether a unit (not a retired index) holds key."""
        slot = self._slot(key)
        if slot < 0:
            return False
        unit = self._units[slot]
        if unit != SHARED:
            return self._live[i64(unit)] != 0
        live = self._live
        return any(live[each] for each in self._shared[key])

    def _touch(self, packed: bytes, start: i64, end: i64) -> None:
        """Read the map's home slots of the keys packed in ``packed[start:end]`` ahead
        of the probes. The probes take their cache misses one after another (each waits
        on its compare before the next); these loads depend on nothing read, so the CPU
        has many of them in flight at once. A hint only: what is read is not used (but
        kept, so the loads are not left out)."""
        keys, units, mask = self._keys, self._units, self._mask
        seen: i64 = 0
        for i in range(start, end, 8):
            home = _home(read_i64_le(packed, i), mask)
            seen ^= keys[home] ^ i64(units[home])
        self._seen = seen

    def _unit(self, unit_id: str) -> i64:
        unit = self._index.get(unit_id, -1)
        if unit >= 0:
            return unit
        if self._free:
            unit = self._free.pop()
            self._ids[unit] = unit_id
            self._live[unit] = 1
        else:
            unit = len(self._ids)
            self._ids.append(unit_id)
            self._live = append(self._live, 1)
            self._counts = append(self._counts, 0)
        self._index[unit_id] = unit
        return unit

    def _retire(self, unit_id: str, unit: i64) -> None:
        """The unit's index names it no more: its entries are dead, to be swept."""
        del self._index[unit_id]
        self._ids[unit] = ""
        self._live[unit] = 0
        count = self._counts[unit]
        if count == 0:
            self._free.append(unit)
            return
        self._dead += count
        self._debt += SWEEP_PER_DEAD * count

    def _let_go(self, unit: i64) -> None:
        """One entry that named unit names it no more."""
        count = self._counts[unit] - 1
        self._counts[unit] = count
        if not self._live[unit]:
            self._dead -= 1
            if count == 0:
                self._free.append(unit)

    def _slot(self, key: i64) -> i64:
        """The map's slot of key, or -1."""
        keys = self._keys
        units = self._units
        mask = self._mask
        slot = _home(key, mask)
        while True:
            if units[slot] == EMPTY:
                return -1
            if keys[slot] == key:
                return slot
            slot = (slot + 1) & mask

    def _add(self, unit: i64, key: i64) -> None:
        """Put unit among key's holders (nothing when it is one)."""
        keys = self._keys
        units = self._units
        mask = self._mask
        slot = _home(key, mask)
        while True:
            held = units[slot]
            if held == EMPTY:
                if (self._used + 1) * 10 > (mask + 1) * 7:
                    self._grow()
                    self._add(unit, key)
                    return
                keys[slot] = key
                units[slot] = i32(unit)
                self._used += 1
                self._counts[unit] += 1
                return
            if keys[slot] == key:
                break
            slot = (slot + 1) & mask
        if held == unit:
            return
        if held == SHARED:
            holders = self._shared[key]
            if unit in holders:
                return
            holders.add(unit)
        elif not self._live[i64(held)]:  # a retired index's entry: the unit's now
            self._let_go(i64(held))
            units[slot] = i32(unit)
        else:
            self._shared[key] = {int(held), int(unit)}
            units[slot] = SHARED
        self._counts[unit] += 1

    def _remove(self, unit: i64, key: i64) -> None:
        """Take unit off key's holders (nothing when it is not one)."""
        slot = self._slot(key)
        if slot < 0:
            return
        held = self._units[slot]
        if held == unit:
            self._free_slot(slot)
        elif held == SHARED:
            holders = self._shared[key]
            if unit not in holders:
                return
            holders.discard(unit)
            if len(holders) == 1:
                del self._shared[key]
                self._units[slot] = i32(holders.pop())
        else:
            return
        self._counts[unit] -= 1

    def _pay(self) -> None:
        """Sweep what is owed, a bounded part of it a report; while retired entries
        are left (moved behind the cursor by a deletion), a little a report even when
        nothing is owed."""
        if self._dead == 0:
            self._debt = 0
            return
        step = min(max(self._debt, SWEEP_LEAST), SWEEP_MOST)
        self._debt = max(self._debt - step, 0)
        self._sweep(step)

    def _sweep(self, count: i64) -> None:
        """Visit count slots from the cursor on, taking out the entries of retired
        indexes. A slot freed is looked at again (backward shift moves a later entry
        into it); an entry moved behind the cursor meanwhile waits for the next pass."""
        keys, units, live = self._keys, self._units, self._live
        mask = self._mask
        at = self._cursor & mask
        visited: i64 = 0
        while visited < count and self._dead > 0:
            visited += 1
            held = units[at]
            if held == EMPTY or (held != SHARED and live[i64(held)]):
                at = (at + 1) & mask
                continue
            if held != SHARED:
                self._let_go(i64(held))
                self._free_slot(at)
                continue
            key = keys[at]
            holders = self._shared[key]
            gone = [each for each in holders if not live[each]]
            if not gone:
                at = (at + 1) & mask
                continue
            for each in gone:
                holders.discard(each)
                self._let_go(each)
            if len(holders) > 1:
                at = (at + 1) & mask
                continue
            del self._shared[key]
            if holders:
                units[at] = i32(holders.pop())
                at = (at + 1) & mask
            else:
                self._free_slot(at)
        self._cursor = at

    def _free_slot(self, slot: i64) -> None:
        keys = self._keys
        units = self._units
        mask = self._mask
        at = slot
        while True:
            at = (at + 1) & mask
            if units[at] == EMPTY:
                break
            if not _stays(slot, _home(keys[at], mask), at):
                keys[slot] = keys[at]
                units[slot] = units[at]
                slot = at
        units[slot] = EMPTY
        self._used -= 1

    def _grow(self) -> None:
        """Sweep the whole map first when retired entries are in it (they may be what
        fills it); double it if it is still full."""
        if self._dead > 0:
            self._sweep(2 * (self._mask + 1))  # a slot freed is visited twice
            self._debt = 0
            if (self._used + 1) * 10 <= (self._mask + 1) * 7:
                return
        keys, units = self._keys, self._units
        size: i64 = (self._mask + 1) * 2
        mask = size - 1
        new_keys = _filled64(size, 0)
        new_units = _filled(size, EMPTY)
        for old in range(len(units)):
            held = units[old]
            if held == EMPTY:
                continue
            key = keys[old]
            slot = _home(key, mask)
            while new_units[slot] != EMPTY:
                slot = (slot + 1) & mask
            new_keys[slot] = key
            new_units[slot] = held
        self._keys, self._units, self._mask = new_keys, new_units, mask
        self._cursor = 0

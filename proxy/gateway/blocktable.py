"""``held.EngineBlocks`` in packed tables, for the compiled build: the same map from
block to units, in about a third of the memory and less time a report.

The dict-and-set map costs about 110 bytes a block held (a dict entry with its share of
the table, a set entry in the unit's set, a Python int for the number); a fleet of
5,000 units of 512 blocks each is then 89 KB a unit. Here every block is one slot of an
open-addressing table (linear probing, deletion by backward shift) of native 64-bit
keys and 32-bit unit indexes, at most 70 % full (17-34 bytes a block), and each unit's
own set of its blocks, a table of keys alone in the same way (11-23 bytes a block; a
report's changes probe it before the big table). A block two units or more hold has a
set of unit ids beside the table (few: prefixes units share). A report's blocks are
read as it packed them (``PrefixBlocks.added_packed``), 8 bytes a key, with no Python
int made for one.

The tables are ``librt.vecs`` vectors, which mypyc compiles to plain C arrays; in
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
# A free slot of a unit's set (that key itself: KeySet.zero). A small literal: one that
# is not (-2**63, say) is a boxed int in the compiled code, converted at every compare.
NO_KEY: Final[i64] = 0
FIRST_SIZE: Final[i64] = 1024
# A report's keys are applied this many bytes (256 keys) at a time, each batch's slots
# read ahead first (CompactBlocks._touch): what they pull into the cache stays there
# until the batch is applied.
BATCH: Final[i64] = 2048
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


def _size_for(count: i64) -> i64:
    """A table's size (a power of two, 16 at least) for count keys at most 70 % full."""
    size: i64 = 16
    while count * 10 > size * 7:
        size *= 2
    return size


def _stays(free: i64, home: i64, at: i64) -> bool:
    """Backward-shift deletion: the entry at ``at``, whose home slot is ``home``, stays
    where it is when its home lies cyclically in (free, at]."""
    if free <= at:
        return free < home <= at
    return free < home or home <= at


class KeySet:
    """A unit's blocks: a set of 64-bit keys in one vector."""

    def __init__(self, count: i64 = 0) -> None:
        size = _size_for(count)
        self.keys = _filled64(size, NO_KEY)
        self.mask = size - 1
        self.used: i64 = 0  # keys in the table (not counting zero)
        self.zero = False  # NO_KEY is held

    def size(self) -> i64:
        return self.used + 1 if self.zero else self.used

    def members(self) -> vec[i64]:
        out = vec[i64](capacity=self.size())
        for key in self.keys:
            if key != NO_KEY:
                out = append(out, key)
        if self.zero:
            out = append(out, NO_KEY)
        return out

    def contains(self, key: i64) -> bool:
        if key == NO_KEY:
            return self.zero
        keys = self.keys
        mask = self.mask
        slot = _home(key, mask)
        while True:
            held = keys[slot]
            if held == key:
                return True
            if held == NO_KEY:
                return False
            slot = (slot + 1) & mask

    def add(self, key: i64) -> bool:
        """False when key is in already."""
        if key == NO_KEY:
            had = self.zero
            self.zero = True
            return not had
        if (self.used + 1) * 10 > (self.mask + 1) * 7:
            self._resize(_size_for(self.used + 1))
        keys = self.keys
        mask = self.mask
        slot = _home(key, mask)
        while True:
            held = keys[slot]
            if held == key:
                return False
            if held == NO_KEY:
                keys[slot] = key
                self.used += 1
                return True
            slot = (slot + 1) & mask

    def discard(self, key: i64) -> bool:
        """False when key was not in."""
        if key == NO_KEY:
            had = self.zero
            self.zero = False
            return had
        keys = self.keys
        mask = self.mask
        slot = _home(key, mask)
        while True:
            held = keys[slot]
            if held == key:
                break
            if held == NO_KEY:
                return False
            slot = (slot + 1) & mask
        at = slot
        while True:
            at = (at + 1) & mask
            moved = keys[at]
            if moved == NO_KEY:
                break
            if not _stays(slot, _home(moved, mask), at):
                keys[slot] = moved
                slot = at
        keys[slot] = NO_KEY
        self.used -= 1
        return True

    def fit(self) -> None:
        """Shrink the table once it is an eighth full (after a report's changes: its
        removals come before its additions)."""
        if self.mask > 63 and self.used * 8 < self.mask:
            self._resize(_size_for(self.used))

    def _resize(self, size: i64) -> None:
        old = self.keys
        self.keys = _filled64(size, NO_KEY)
        self.mask = size - 1
        self.used = 0
        for key in old:
            if key != NO_KEY:
                self.add(key)


class CompactBlocks:
    def __init__(self, chunk_chars: int) -> None:
        self.chunk_chars = chunk_chars
        self.gaps = 0  # changes that did not follow on (a whole set was needed)
        self._at: dict[str, tuple[int, int]] = {}  # unit -> (epoch, seq) of its set
        self._index: dict[str, i64] = {}  # unit -> its index
        self._ids: list[str] = []  # index -> unit ("" when free)
        self._free: list[i64] = []
        self._sets: list[KeySet] = []  # index -> its blocks
        self._shared: dict[i64, set[str]] = {}
        self._mask: i64 = FIRST_SIZE - 1
        self._used: i64 = 0
        self._keys: vec[i64] = _filled64(FIRST_SIZE, 0)
        self._units: vec[i32] = _filled(FIRST_SIZE, EMPTY)
        self._seen: i64 = 0  # what _touch read (unused)

    def knows(self, unit_id: str) -> bool:
        return unit_id in self._at

    def at(self, unit_id: str) -> tuple[int, int] | None:
        return self._at.get(unit_id)

    def held(self, unit_id: str) -> set[int]:
        unit = self._index.get(unit_id, -1)
        if unit < 0:
            return set()
        return {_block(key) for key in self._sets[unit].members()}

    def apply(self, unit_id: str, blocks: PrefixBlocks) -> bool:
        """Apply a report's blocks; False when they do not follow on what is held (or
        name blocks of another size): nothing changes."""
        if blocks.chunk_chars != self.chunk_chars:
            return False
        at = self._at.get(unit_id)
        if blocks.full:
            if at is not None and at[0] == blocks.epoch and blocks.seq < at[1]:
                return True  # an older whole set (a re-read that crossed newer changes)
            unit = self._unit(unit_id)
            old = self._sets[unit]
            added = blocks.added_packed
            new = KeySet(len(added) // 8)
            for start in range(0, len(added), BATCH):
                end = min(start + BATCH, len(added))
                self._touch(added, start, end, old)
                for i in range(start, end, 8):
                    key = read_i64_le(added, i)
                    if new.add(key) and not old.contains(key):
                        self._insert(unit, key)
            if old.size():  # the whole set again: let go of what it lacks
                for key in old.members():
                    if not new.contains(key):
                        self._release(unit, key)
            self._sets[unit] = new
        else:
            if at is None or at != (blocks.epoch, blocks.from_seq):
                if at is None or at[0] != blocks.epoch or blocks.seq > at[1]:
                    self.gaps += 1
                    return False
                return True  # changes already applied (a late duplicate)
            unit = self._index[unit_id]
            held = self._sets[unit]
            removed = blocks.removed_packed
            for start in range(0, len(removed), BATCH):
                end = min(start + BATCH, len(removed))
                self._touch(removed, start, end, held)
                for i in range(start, end, 8):
                    key = read_i64_le(removed, i)
                    if held.discard(key):
                        self._release(unit, key)
            added = blocks.added_packed
            for start in range(0, len(added), BATCH):
                end = min(start + BATCH, len(added))
                self._touch(added, start, end, held)
                for i in range(start, end, 8):
                    key = read_i64_le(added, i)
                    if held.add(key):
                        self._insert(unit, key)
            held.fit()
        self._at[unit_id] = (blocks.epoch, blocks.seq)
        return True

    def forget(self, unit_id: str) -> None:
        self._at.pop(unit_id, None)
        unit = self._index.pop(unit_id, -1)
        if unit < 0:
            return
        for key in self._sets[unit].members():
            self._release(unit, key)
        self._sets[unit] = KeySet()
        self._ids[unit] = ""
        self._free.append(unit)

    def matches(self, blocks: list[int]) -> Iterator[tuple[int, list[str]]]:
        """(depth, units) from the deepest match down, each unit once."""
        low, high = 0, len(blocks)
        while low < high:
            mid = (low + high + 1) // 2
            if self._slot(_key(blocks[mid - 1])) >= 0:
                low = mid
            else:
                high = mid - 1
        seen: set[str] = set()
        depth = low
        while depth > 0:
            key = _key(blocks[depth - 1])
            slot = self._slot(key)
            fresh: list[str] = []
            if slot >= 0:
                unit = self._units[slot]
                if unit != SHARED:
                    unit_id = self._ids[unit]
                    if unit_id not in seen:
                        fresh.append(unit_id)
                else:
                    fresh = [u for u in self._shared[key] if u not in seen]
            if fresh:
                seen.update(fresh)
                yield depth, fresh
            depth -= 1

    def _touch(self, packed: bytes, start: i64, end: i64, held: KeySet) -> None:
        """Read the home slots of the keys packed in ``packed[start:end]``, in the map
        and in the unit's set, ahead of the probes. The probes take their cache misses
        one after another (each waits on its compare before the next); these loads
        depend on nothing read, so the CPU has many of them in flight at once. A hint
        only: what is read is not used (but kept, so the loads are not left out)."""
        keys, units, mask = self._keys, self._units, self._mask
        own, own_mask = held.keys, held.mask
        seen: i64 = 0
        for i in range(start, end, 8):
            key = read_i64_le(packed, i)
            home = _home(key, mask)
            seen ^= keys[home] ^ i64(units[home]) ^ own[_home(key, own_mask)]
        self._seen = seen

    def _unit(self, unit_id: str) -> i64:
        unit = self._index.get(unit_id, -1)
        if unit >= 0:
            return unit
        if self._free:
            unit = self._free.pop()
            self._ids[unit] = unit_id
        else:
            unit = len(self._ids)
            self._ids.append(unit_id)
            self._sets.append(KeySet())
        self._index[unit_id] = unit
        return unit

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

    def _insert(self, unit: i64, key: i64) -> None:
        """Put unit among key's holders (it is not one: its set says so)."""
        if (self._used + 1) * 10 > (self._mask + 1) * 7:
            self._grow()
        keys = self._keys
        units = self._units
        mask = self._mask
        slot = _home(key, mask)
        while True:
            held = units[slot]
            if held == EMPTY:
                keys[slot] = key
                units[slot] = i32(unit)
                self._used += 1
                return
            if keys[slot] == key:
                break
            slot = (slot + 1) & mask
        if held == SHARED:
            self._shared[key].add(self._ids[unit])
        else:
            self._shared[key] = {self._ids[held], self._ids[unit]}
            units[slot] = SHARED

    def _release(self, unit: i64, key: i64) -> None:
        """Take unit off key's holders (it is one: its set said so)."""
        slot = self._slot(key)
        if slot < 0:
            return
        if self._units[slot] != SHARED:
            self._free_slot(slot)
            return
        holders = self._shared[key]
        holders.discard(self._ids[unit])
        if len(holders) == 1:
            del self._shared[key]
            self._units[slot] = i32(self._index[next(iter(holders))])

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

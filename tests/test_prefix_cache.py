"""The simulator's prefix cache: blocks of its tokens, chained hashes, LRU, hit rate."""

from __future__ import annotations

from engine import tokens
from engine.prefix_cache import PrefixCache

SYSTEM = " ".join(f"rule{i} says what the assistant does" for i in range(40))


def test_blocks_follow_the_token_count() -> None:
    cache = PrefixCache(block_size=16, capacity=100)
    n = tokens.count(SYSTEM)
    blocks = cache.text_blocks(SYSTEM)
    assert len(blocks) == n // 16
    assert cache.text_blocks(SYSTEM) == blocks  # deterministic
    assert cache.text_blocks("short prompt") == []  # no full block


def test_a_shared_prefix_shares_its_leading_blocks_only() -> None:
    cache = PrefixCache(block_size=16, capacity=100)
    a = cache.text_blocks(SYSTEM + " and then the user asks about the weather today" * 4)
    b = cache.text_blocks(SYSTEM + " but the user wants a poem about the sea instead" * 4)
    c = cache.text_blocks("different " + SYSTEM)
    shared = len(cache.text_blocks(SYSTEM)) - 1  # the block holding the seam differs
    assert a[:shared] == b[:shared]
    assert a[-1] != b[-1]
    assert not set(a) & set(c)  # chained: one changed word changes every later block


def test_admit_counts_the_leading_cached_run() -> None:
    cache = PrefixCache(block_size=16, capacity=100)
    blocks = cache.text_blocks(SYSTEM)
    n = tokens.count(SYSTEM)
    assert cache.admit(blocks, n) == 0
    cached = min(len(blocks) * 16, n - 1)  # the last prompt token is always computed
    assert cache.admit(blocks, n) == cached
    assert (cache.queries, cache.hits) == (2 * n, cached)
    assert cache.hit_rate == cached / (2 * n)
    # a full hit still computes the last prompt token
    whole = cache.id_blocks(list(range(64)))
    cache.admit(whole, 64)
    assert cache.admit(whole, 64) == 63
    # a hole breaks the run: what follows it is not counted
    other = cache.id_blocks(list(range(1000, 1064)))
    assert cache.admit([whole[0], other[1], whole[2]], 48) == 16


def test_lru_evicts_the_least_recent_and_a_chain_from_its_end() -> None:
    cache = PrefixCache(block_size=4, capacity=6)
    a = cache.id_blocks(list(range(12)))  # 3 blocks
    b = cache.id_blocks(list(range(100, 112)))
    c = cache.id_blocks(list(range(200, 208)))  # 2 blocks
    cache.admit(a, 12)
    cache.admit(b, 12)
    assert len(cache) == 6
    cache.admit(a, 12)  # a is now the most recent
    cache.admit(c, 8)  # two of b's blocks go, from the end of its chain
    assert len(cache) == 6
    assert cache.admit(a, 12) == 11
    assert cache.admit(b[:1], 4) == 3  # b's first block stayed
    assert cache.admit(b, 12) == 4


def test_ids_and_text_blocks_have_a_fixed_size() -> None:
    cache = PrefixCache(block_size=8, capacity=10)
    assert len(cache.id_blocks(list(range(23)))) == 2
    assert cache.hit_rate == 0.0


def test_a_cache_telling_its_events_keeps_the_same_blocks_as_one_telling_none() -> None:
    """admit has two paths (the planner's caches tell no one); the same prompts must find
    the same cached tokens in both, under eviction, and the events replay to its blocks."""
    from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

    held: set[int] = set()

    def replay(events: list[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    quiet, telling = PrefixCache(block_size=4, capacity=30), PrefixCache(4, 30)
    telling.listener = replay
    prompts = [
        quiet.id_blocks([group] * 4 * (group % 3 + 2) + [turn] * 4 * (turn % 4 + 1))
        for turn in range(12)
        for group in range(5)
    ]
    for i, blocks in enumerate(prompts * 2):
        n = 4 * len(blocks) + 1
        assert quiet.admit(blocks, n) == telling.admit(blocks, n), f"prompt {i}"
        assert len(held) == len(telling) == len(quiet)
    assert 0 < quiet.hits == telling.hits < quiet.queries

"""The gateway's prefix index: chained blocks of prompt text, per-unit LRU, ageing."""

from __future__ import annotations

import random

from proxy.gateway.prefix import PrefixIndex
from proxy.gateway.request import prompt_text

SYSTEM = "You are a careful assistant. " * 40  # 1,160 characters: 4 blocks of 256


def best(index: PrefixIndex, text: str, now: float) -> list[tuple[int, list[str]]]:
    return [(depth, sorted(units)) for depth, units in index.matches(index.hashes(text), now)]


def test_prompt_text_is_the_prefilled_part_in_order() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
        ],
        "max_tokens": 5,
    }
    assert prompt_text(chat) == "<|system|>\nbe brief\n<|user|>\nhi\n"
    more = {"messages": [*chat["messages"], {"role": "assistant", "content": "hello"}]}
    assert prompt_text(more).startswith(prompt_text(chat))
    assert prompt_text({"prompt": "once upon"}) == "once upon"
    assert prompt_text({"prompt": ["a", "b"]}) == "a"
    assert prompt_text({"prompt": [1, 2, 3]}) == "[1,2,3]"
    assert prompt_text({"prompt": 7}) == prompt_text({}) == ""


def test_hashes_are_chained_full_chunks() -> None:
    index = PrefixIndex(chunk_chars=4)
    assert len(index.hashes("abcdefghij")) == 2  # the partial chunk "ij" is left out
    a, b = index.hashes("abcdefgh"), index.hashes("xbcdefgh")
    assert a[1] != b[1]  # "efgh" after a different first chunk is another block
    assert index.hashes("abcdefghXYZW")[:2] == a
    assert len(PrefixIndex(chunk_chars=4, max_request_blocks=3).hashes("a" * 100)) == 3


def test_the_unit_that_was_sent_the_longest_prefix_comes_first() -> None:
    index = PrefixIndex(chunk_chars=256)
    index.record("a", index.hashes(SYSTEM + "tenant one asks " * 40), now=0.0)
    index.record("b", index.hashes(SYSTEM), now=0.0)
    index.record("c", index.hashes("something else entirely " * 40), now=0.0)
    found = best(index, SYSTEM + "tenant one asks " * 40 + "and more", now=1.0)
    assert [units for _, units in found] == [["a"], ["b"]]
    assert found[0][0] > found[1][0] == 4
    assert best(index, "a prompt nobody sent " * 40, now=1.0) == []
    assert best(index, "short", now=1.0) == []


def test_blocks_age_out_after_the_ttl() -> None:
    index = PrefixIndex(chunk_chars=256, ttl_s=10.0)
    index.record("a", index.hashes(SYSTEM), now=0.0)
    index.record("b", index.hashes(SYSTEM), now=5.0)
    assert best(index, SYSTEM, now=9.0) == [(4, ["a", "b"])]
    assert best(index, SYSTEM, now=12.0) == [(4, ["b"])]  # a's blocks are too old
    index.expire(now=12.0)
    assert index.stats() == (2, 4)
    index.record("a", index.hashes(SYSTEM), now=13.0)  # sent again: fresh again
    assert best(index, SYSTEM, now=16.0) == [(4, ["a"])]


def test_each_unit_keeps_at_most_max_blocks_least_recent_out_first() -> None:
    index = PrefixIndex(chunk_chars=256, max_blocks=6)
    one, two = SYSTEM, "Another tenant's long prompt. " * 40
    index.record("a", index.hashes(one), now=0.0)
    index.record("a", index.hashes(two), now=1.0)  # 8 blocks: two of one's go
    assert index.stats() == (1, 6)
    assert best(index, two, now=2.0) == [(4, ["a"])]
    assert best(index, one, now=2.0) == []  # its first blocks went first


def test_forget_drops_a_unit_and_memory_is_bounded() -> None:
    index = PrefixIndex(chunk_chars=64, max_blocks=100)
    rng = random.Random(1)
    for i in range(2000):
        text = "".join(rng.choice("abcdefgh") for _ in range(64 * 8))
        index.record(f"u{i % 8}", index.hashes(text), now=float(i))
    assert index.stats() == (8, 800)
    assert len(index._holders) <= 800
    index.forget("u0")
    assert index.stats() == (7, 700)
    assert all("u0" not in units for units in index._holders.values())

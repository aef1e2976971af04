"""Prefix affinity from what the engines hold: the simulator's KV cache events, the
sidecar's change stream of text-chunk hashes, and every gateway replica routing on it."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from engine.base import ChatMessage, EngineRequest
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from engine.prefix_cache import PrefixCache
from engine.settings import SimSettings
from engine.sim import SimEngine
from proxy.build import compiled
from proxy.gateway.blocktable import CompactBlocks
from proxy.gateway.held import BlockMap, EngineBlocks, engine_blocks
from proxy.gateway.policies.prefix import PrefixAffinity
from proxy.gateway.request import prompt_text
from proxy.gateway.server import Gateway
from proxy.load import LoadReport, PrefixBlocks, UnitState, pack_blocks, unpack_blocks
from proxy.pb.unitproxy.v1 import load_pb2
from proxy.prefix_chunks import chunk_hashes
from proxy.settings import load
from proxy.sidecar.blocks import HeldChunks
from tests.conftest import SidecarFactory, wait_until
from tests.redisenv import REDIS_URL, redis_section

SOURCES = ["watch", "watch-http", "poll", "redis"]
# The gateway's map from block to units, both forms (held.engine_blocks picks one).
MAPS = [EngineBlocks, CompactBlocks]
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "bright",
    "owls",
    "watch",
]


def long_text(seed: int, words: int = 900) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words))


def test_the_sim_cache_tells_each_change_as_vllm_kv_events() -> None:
    cache = PrefixCache(block_size=4, capacity=3)
    told: list[KVEvent] = []
    cache.listener = told.extend
    cache.admit([1, 2], 8)
    assert told == [BlockStored((1, 2), None, 4)]
    told.clear()
    cache.admit([1, 2, 3, 4], 16)  # two new blocks after block 2; one over capacity
    assert told == [BlockStored((3, 4), 2, 4), BlockRemoved((4,))]
    told.clear()
    cache.admit([1, 2], 8)
    assert told == [], "nothing stored or removed: no event"
    cache.clear()
    assert told == [AllBlocksCleared()] and len(cache) == 0 and cache.resets == 1


def _engine_and_held(max_blocks: int = 4096) -> tuple[SimEngine, PrefixCache, HeldChunks]:
    engine = SimEngine(SimSettings(block_size=16, prefix_cache_blocks=10_000))
    held = HeldChunks(chunk_chars=256, max_blocks=max_blocks)
    assert engine.subscribe_kv_events(held.events)
    assert engine.prefix_cache is not None
    return engine, engine.prefix_cache, held


def _prefill(engine: SimEngine, cache: PrefixCache, held: HeldChunks, req: EngineRequest) -> None:
    text, spans = engine.prompt_blocks(req)
    held.expect(req, text, spans)
    cache.admit([block for block, _ in spans], 10_000)  # as the scheduler does at prefill


@pytest.mark.parametrize("chat", [False, True])
def test_the_sidecar_names_what_the_engine_stored_as_the_gateway_names_the_prompt(
    chat: bool,
) -> None:
    engine, cache, held = _engine_and_held()
    text = long_text(1)
    if chat:
        messages = (ChatMessage("system", text), ChatMessage("user", "and then?"))
        req = EngineRequest("r", messages=messages)
        body: dict[str, Any] = {
            "messages": [{"role": m.role, "content": m.content} for m in messages]
        }
    else:
        req = EngineRequest("r", prompt=text)
        body = {"prompt": text}
    gateway_chunks = chunk_hashes(prompt_text(body), 256, 512)
    _prefill(engine, cache, held, req)
    full = held.full()
    assert full.full and full.chunk_chars == 256
    # Every chunk whose text the engine's stored blocks cover, in order from the first;
    # at most the last chunk or two (ending in the engine's partial last block) not.
    assert full.added == tuple(gateway_chunks[: len(full.added)])
    assert len(full.added) >= len(gateway_chunks) - 2 > 0
    # A second request with the same text names nothing new.
    seq = held.seq
    _prefill(engine, cache, held, req)
    assert held.seq == seq


def test_the_change_stream_gives_deltas_since_a_seq_and_the_whole_set_after_a_gap() -> None:
    engine, cache, held = _engine_and_held(max_blocks=1000)
    _prefill(engine, cache, held, EngineRequest("a", prompt=long_text(1)))
    first = held.full()
    _prefill(engine, cache, held, EngineRequest("b", prompt=long_text(2)))
    delta = held.delta(first.epoch, first.seq)
    assert not delta.full and (delta.from_seq, delta.seq) == (first.seq, held.seq)
    assert set(delta.added) == set(held.full().added) - set(first.added) and delta.removed == ()
    assert held.delta(first.epoch + 1, first.seq).full, "another epoch: the whole set"
    assert held.delta(first.epoch, held.seq + 5).full, "a seq it never had: the whole set"
    empty = held.delta(first.epoch, held.seq)
    assert not empty.full and empty.added == empty.removed == ()
    # The engine evicts: the chunks its removed blocks covered leave the set.
    view = EngineBlocks(256)
    assert view.apply("u", first) and view.apply("u", delta)
    cache.clear()
    assert len(held) == 0
    cleared = held.delta(*view.at("u"))  # type: ignore[misc]
    assert set(cleared.removed) == set(first.added) | set(delta.added)
    assert view.apply("u", cleared) and view.held("u") == set()


def test_the_reported_set_is_bounded_the_most_recent_kept() -> None:
    engine, cache, held = _engine_and_held(max_blocks=5)
    for i in range(4):
        _prefill(engine, cache, held, EngineRequest(str(i), prompt=long_text(i)))
    last = chunk_hashes(long_text(3), 256, 512)
    assert len(held) == 5 and set(held.full().added) <= set(last)


@pytest.mark.parametrize("kind", MAPS)
def test_a_gateways_view_applies_only_changes_that_follow_on(kind: type[BlockMap]) -> None:
    view = kind(512)
    assert not view.apply("u", PrefixBlocks(1, 0, 2, False, (5, 6), (), 512)), "no set yet"
    assert view.apply("u", PrefixBlocks(1, 0, 2, True, (5, 6), (), 512))
    assert not view.apply("u", PrefixBlocks(1, 3, 4, False, (7,), (), 512)), "a gap"
    assert view.held("u") == {5, 6} and view.gaps == 2
    assert view.apply("u", PrefixBlocks(1, 2, 4, False, (7,), (5,), 512))
    assert view.held("u") == {6, 7}
    assert not view.apply("u", PrefixBlocks(1, 4, 5, False, (8,), (), 256)), "other chunks"
    assert view.apply("u", PrefixBlocks(1, 0, 3, True, (1,), (), 512)), "an older whole set"
    assert view.held("u") == {6, 7}, "... changes nothing"
    assert view.apply("u", PrefixBlocks(2, 0, 1, True, (1,), (), 512)), "a new epoch"
    assert view.held("u") == {1}
    assert [d for d, _ in view.matches([1, 2])] == [1]


@pytest.mark.parametrize("kind", MAPS)
def test_a_block_two_units_hold_stays_matched_when_one_lets_it_go(kind: type[BlockMap]) -> None:
    view = kind(512)
    assert view.apply("a", PrefixBlocks(1, 0, 3, True, (5, 6, 7), (), 512))
    assert view.apply("b", PrefixBlocks(2, 0, 2, True, (5, 6), (), 512))
    assert [(d, sorted(u)) for d, u in view.matches([5, 6, 7])] == [(3, ["a"]), (2, ["b"])]
    # a removes 6 and 7 (and names 9, which it never held), adds 8 and 5 again
    assert view.apply("a", PrefixBlocks(1, 3, 7, False, (8, 5), (6, 7, 9), 512))
    assert view.held("a") == {5, 8} and view.held("b") == {5, 6}
    assert [(d, sorted(u)) for d, u in view.matches([5, 6, 7])] == [(2, ["b"]), (1, ["a"])]
    assert view.apply("b", PrefixBlocks(2, 2, 4, False, (), (5, 6), 512))
    assert [(d, u) for d, u in view.matches([5, 6])] == [(1, ["a"])]
    view.forget("a")
    assert list(view.matches([5, 6, 8])) == []


@pytest.mark.parametrize("kind", MAPS)
def test_a_block_three_units_hold_loses_them_one_by_one_each_way(kind: type[BlockMap]) -> None:
    view = kind(512)
    for unit in ("a", "b", "c"):
        assert view.apply(unit, PrefixBlocks(1, 0, 2, True, (5, 6), (), 512))
    assert [(d, sorted(u)) for d, u in view.matches([5, 6])] == [(2, ["a", "b", "c"])]
    assert view.apply("b", PrefixBlocks(1, 2, 3, False, (), (6,), 512)), "a change"
    assert view.apply("c", PrefixBlocks(1, 0, 4, True, (5, 7), (), 512)), "a whole set"
    assert [(d, sorted(u)) for d, u in view.matches([5, 6])] == [(2, ["a"]), (1, ["b", "c"])]
    view.forget("a")
    assert [(d, sorted(u)) for d, u in view.matches([5, 6])] == [(1, ["b", "c"])]
    assert view.apply("b", PrefixBlocks(1, 3, 4, False, (6,), (5,), 512))
    assert [(d, sorted(u)) for d, u in view.matches([5, 6])] == [(2, ["b"]), (1, ["c"])]
    assert [(d, sorted(u)) for d, u in view.matches([5, 7])] == [(2, ["c"])]
    view.forget("c")
    view.forget("b")
    assert list(view.matches([5, 6])) == [] and list(view.matches([5, 7])) == []


def test_the_packed_map_answers_as_the_dict_map_under_random_reports() -> None:
    """Whole sets, changes (blocks named twice, removed ones never held), units that
    share blocks, forgotten units, numbers at both ends of 64 bits, and tables that
    grow, built as a sidecar builds them or read off the wire: every answer of the
    packed map is the dict map's."""
    rng = random.Random(5)
    want, got = EngineBlocks(512), CompactBlocks(512)
    pool = [rng.getrandbits(64) for _ in range(2000)] + [
        0,
        1,
        (1 << 63) - 1,
        1 << 63,
        (1 << 64) - 1,
    ]
    units = [f"u{i}" for i in range(8)]
    seqs: dict[str, int] = {}
    for step in range(800):
        unit = rng.choice(units)
        roll = rng.random()
        if roll < 0.03:
            want.forget(unit)
            got.forget(unit)
            seqs.pop(unit, None)
            continue
        seq = seqs.get(unit, 0)
        if roll < 0.2 or unit not in seqs:
            added = tuple(rng.sample(pool, rng.randrange(0, 800)))
            blocks = PrefixBlocks(1, 0, seq + 1, True, added, (), 512)
        else:
            added = tuple(rng.choices(pool, k=rng.randrange(0, 300)))
            removed = tuple(rng.choices(pool, k=rng.randrange(0, 300)))
            from_seq = seq if roll < 0.95 else seq + 1  # now and then a gap
            blocks = PrefixBlocks(1, from_seq, seq + 1, False, added, removed, 512)
        if step % 3:  # as a gateway reads them: packed, off JSON or protobuf
            blocks = (
                PrefixBlocks.from_dict(json.loads(json.dumps(blocks.to_dict())))
                if step % 3 == 1
                else PrefixBlocks.from_pb(load_pb2.PrefixBlocks.FromString(
                    blocks.to_pb().SerializeToString()))
            )  # fmt: skip
        assert want.apply(unit, blocks) == got.apply(unit, blocks)
        if want.at(unit) is not None:
            seqs[unit] = want.at(unit)[1]  # type: ignore[index]
        for each in units if step % 20 == 0 else [unit]:
            assert got.held(each) == want.held(each) and got.at(each) == want.at(each)
        chain = rng.sample(sorted(want.held(unit) | {0, 1, 2}), 3) + rng.sample(pool, 3)
        assert _sorted(got.matches(chain)) == _sorted(want.matches(chain))
    assert got.gaps == want.gaps > 0
    # A unit that lets go of nearly all it held (its set shrinks), then of the rest.
    for view in (want, got):
        assert view.apply("big", PrefixBlocks(3, 0, 1, True, tuple(pool[:900]), (), 512))
        assert view.apply("big", PrefixBlocks(3, 1, 2, False, (), tuple(pool[5:900]), 512))
    assert got.held("big") == want.held("big") == set(pool[:5])
    assert _sorted(got.matches(pool[:6])) == _sorted(want.matches(pool[:6]))
    for view in (want, got):
        assert view.apply("big", PrefixBlocks(3, 2, 3, False, (), tuple(pool[:5]), 512))
    assert got.held("big") == set()
    assert _sorted(got.matches(pool[:6])) == _sorted(want.matches(pool[:6]))
    assert type(engine_blocks(512)) is (
        CompactBlocks if compiled(CompactBlocks.__module__) else EngineBlocks
    )


def test_whole_sets_again_and_forgotten_units_do_not_grow_the_packed_map() -> None:
    """A whole set that replaces a unit's (a sidecar whose log a reader overran sends
    one a report) retires the unit's index: its old entries are swept over the next
    reports, before they fill the map, and every answer stays the dict map's."""
    rng = random.Random(7)
    want, got = EngineBlocks(512), CompactBlocks(512)
    units = [f"u{i}" for i in range(40)]
    shared = [rng.getrandbits(60) for _ in range(50)]  # held by many units at once
    seqs = dict.fromkeys(units, 0)
    sizes = set()
    for step in range(600):
        unit = units[step % len(units)]
        seqs[unit] += 1
        added = (*(rng.getrandbits(60) for _ in range(400)), *rng.sample(shared, 10))
        blocks = PrefixBlocks(1, 0, seqs[unit], True, added, (), 512)
        assert want.apply(unit, blocks) and got.apply(unit, blocks)
        slots, entries, dead = got.table()
        if step >= len(units):  # every unit's first set in
            sizes.add(slots)
        assert dead * 4 < entries, "the retired entries are swept as they come"
        if step % 97 == 0:
            chain = [*rng.sample(added, 3), *rng.sample(shared, 5), rng.getrandbits(60)]
            assert _sorted(got.matches(chain)) == _sorted(want.matches(chain))
            assert got.held(unit) == want.held(unit)
    live = len(set().union(*(want.held(u) for u in units)))
    assert sizes == {32768}, "40 units of 410 blocks fit 32,768 slots at 70 %, and stay"
    assert live <= got.table()[1] < live * 1.3
    for unit in units:
        want.forget(unit)
        got.forget(unit)
    assert list(got.matches(shared)) == [], "a forgotten unit's entries are passed over"
    assert got.apply("again", PrefixBlocks(2, 0, 1, True, tuple(shared), (), 512))
    for seq in range(1, 40):  # what is left is swept over the next reports
        assert got.apply("again", PrefixBlocks(2, seq, seq + 1, False, (), (), 512))
    assert _sorted(got.matches(shared)) == [(50, ["again"])]
    assert got.table() == (32768, 50, 0)


def _sorted(matches: Iterator[tuple[int, list[str]]]) -> list[tuple[int, list[str]]]:
    return [(depth, sorted(units)) for depth, units in matches]


def _views(gw: Gateway) -> dict[str, frozenset[int]]:
    policy = gw.router.policy
    assert isinstance(policy, PrefixAffinity)
    return {u: frozenset(policy.engine.held(u)) for u in gw.router.units}


@pytest.mark.parametrize("source", SOURCES)
async def test_two_gateway_replicas_hold_the_same_view_and_route_a_prefix_to_its_holder(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession, cluster: str, source: str
) -> None:
    """Requests go through replica A only; replica B, which routed none of them, holds
    the same block->unit view within a report interval and sends a request sharing a
    long prefix to the unit that holds it."""
    redis = redis_section(REDIS_URL, cluster)
    sidecars = [
        await start_sidecar(sidecar={"unit_id": f"u{i}", "report_interval_s": 0.2}, redis=redis)
        for i in range(4)
    ]
    gateway: dict[str, Any] = {"policy": "prefix", "load_source": source, "poll_interval_s": 0.1}
    if source == "redis":
        gateway["discover_allow"] = ["http://127.0.0.1:*"]
    else:
        gateway["units"] = [f"{s.core.unit_id}={s.http_url},{s.grpc_target}" for s in sidecars]
    settings = load(
        {
            "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
            "gateway": gateway,
            "redis": redis,
        }
    )
    async with Gateway(settings) as a, Gateway(settings) as b:
        for gw in (a, b):
            await wait_until(
                lambda gw=gw: (
                    len(gw.router.units) == 4  # type: ignore[misc]
                    and all(u.report is not None for u in gw.router.units.values())
                ),
                what="every unit's first report",
            )
        served: dict[int, str] = {}
        for i in range(3):
            body = {"model": "unitproxy-sim", "prompt": long_text(i) + " first", "max_tokens": 2}
            async with http.post(f"{a.http_url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                served[i] = resp.headers["x-unitproxy-unit"]
        # Each unit's engine holds what it prefilled, and both replicas see just that.
        truth = {
            s.core.unit_id: frozenset(s.core.held.full().added)
            for s in sidecars
            if s.core.held is not None
        }
        assert all(truth[served[i]] for i in served)
        await wait_until(lambda: _views(a) == truth and _views(b) == truth, timeout_s=5.0,
                         what=f"both replicas' views to equal the engines' ({source})")  # fmt: skip
        for i in range(3):
            body = {"model": "unitproxy-sim", "prompt": long_text(i) + " second", "max_tokens": 2}
            async with http.post(f"{b.http_url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-unitproxy-unit"] == served[i], f"prefix {i} via replica B"


async def test_a_redis_reader_that_missed_a_message_rereads_the_whole_set(
    start_sidecar: SidecarFactory, cluster: str
) -> None:
    redis = redis_section(REDIS_URL, cluster)
    sidecar = await start_sidecar(sidecar={"unit_id": "u0", "report_interval_s": 0.2}, redis=redis)
    settings = load(
        {
            "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
            "gateway": {
                "policy": "prefix",
                "load_source": "redis",
                "discover_allow": ["http://127.0.0.1:*"],
            },
            "redis": redis,
        }
    )
    async with Gateway(settings) as gw:
        await wait_until(lambda: "u0" in gw.router.units, what="the unit discovered")
        policy = gw.router.policy
        assert isinstance(policy, PrefixAffinity) and sidecar.core.held is not None
        # A message this reader never got: changes it does not hold.
        held = sidecar.core.held
        engine = sidecar.engine
        assert isinstance(engine, SimEngine) and engine.prefix_cache is not None
        req = EngineRequest("x", prompt=long_text(5))
        text, spans = engine.prompt_blocks(req)
        held.expect(req, text, spans)
        engine.prefix_cache.admit([block for block, _ in spans], 10_000)
        client = Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            later = held.delta(held.epoch, held.seq)  # nothing new, from a seq it lacks
            stale = LoadReport("u0", UnitState.SERVING, 0, 1, seq=1, prefix_blocks=later)
            await client.publish(f"unitproxy:{cluster}:load", stale.to_json())
        finally:
            await client.aclose()
        want = frozenset(held.full().added)
        await wait_until(lambda: frozenset(policy.engine.held("u0")) == want,
                         what="the whole set re-read")  # fmt: skip
        assert want and json.loads(stale.to_json())["prefix_blocks"]["full"] is False


@pytest.mark.parametrize("bad", [True, -1, 1 << 64, "1", 1.0])
def test_a_report_naming_a_block_that_is_not_a_64_bit_number_is_refused(bad: Any) -> None:
    good = PrefixBlocks(1, 0, 2, False, (5, 1 << 63), (7,), 512)
    report = LoadReport("u", UnitState.SERVING, 0, 1, seq=1, prefix_blocks=good)
    data = json.loads(report.to_json())
    assert LoadReport.from_dict(data) == report
    for side in ("added", "removed"):
        data["prefix_blocks"][side] = [5, bad]
        with pytest.raises(TypeError, match="not a 64-bit unsigned number"):
            LoadReport.from_dict(data)
        data["prefix_blocks"][side] = [5]


def test_block_numbers_travel_packed_and_come_back_the_same() -> None:
    blocks = PrefixBlocks(7, 3, 9, False, (0, 1, (1 << 64) - 1, 1 << 63), (5, 1 << 40), 512)
    report = LoadReport("u", UnitState.SERVING, 0, 1, seq=1, prefix_blocks=blocks)
    data = json.loads(report.to_json())
    side = data["prefix_blocks"]
    # 8 bytes a block, little-endian, in base64: not an array of numbers
    assert isinstance(side["added"], str) and base64.b64decode(side["added"]) == b"".join(
        n.to_bytes(8, "little") for n in blocks.added
    )
    assert LoadReport.from_dict(data) == report
    msg = report.to_pb()
    assert msg.prefix_blocks.added_packed == pack_blocks(blocks.added)
    assert not msg.prefix_blocks.added and not msg.prefix_blocks.removed
    wire = load_pb2.LoadReport.FromString(msg.SerializeToString())
    assert LoadReport.from_pb(wire) == report
    empty = PrefixBlocks(7, 0, 9, True, (), (), 512)
    data = json.loads(LoadReport("u", UnitState.SERVING, 0, 1, prefix_blocks=empty).to_json())
    assert (
        data["prefix_blocks"]["added"] == ""
        and PrefixBlocks.from_dict(data["prefix_blocks"]) == empty
    )
    assert PrefixBlocks.from_pb(empty.to_pb()) == empty
    data["prefix_blocks"]["added"] = base64.b64encode(b"\0" * 7).decode()
    with pytest.raises(TypeError, match="not a whole number of 8 bytes"):
        LoadReport.from_dict(data)  # refused as it is read, not when first used


def test_reports_of_a_sidecar_from_before_the_packed_form_are_still_read() -> None:
    blocks = PrefixBlocks(7, 3, 9, False, (1, (1 << 64) - 1), (5,), 512)
    old_json = {"epoch": 7, "from_seq": 3, "seq": 9, "full": False,
                "added": [1, (1 << 64) - 1], "removed": [5], "chunk_chars": 512}  # fmt: skip
    assert PrefixBlocks.from_dict(old_json) == blocks
    old_pb = load_pb2.PrefixBlocks(
        epoch=7, from_seq=3, seq=9, added=[1, (1 << 64) - 1], removed=[5], chunk_chars=512
    )
    assert PrefixBlocks.from_pb(load_pb2.PrefixBlocks.FromString(old_pb.SerializeToString())) == (
        blocks
    )


def test_packed_blocks_of_every_length_travel_in_base64_and_back() -> None:
    rng = random.Random(3)
    for n in range(0, 40):
        blocks = tuple(rng.getrandbits(64) for _ in range(n))
        side = PrefixBlocks(1, 0, 2, False, blocks, blocks[::-1], 512).to_dict()
        assert base64.b64decode(side["added"]) == pack_blocks(blocks)
        back = PrefixBlocks.from_dict(json.loads(json.dumps(side)))
        assert back.added == blocks and back.removed == blocks[::-1]


@pytest.mark.parametrize(
    ("added", "why"),
    [
        ("!!!!", "not base64"),
        ("AAAAAAAAAAA!", "not base64"),  # 8 bytes, one character not base64
        ("AAAAAAAAAAA", "not base64"),  # padding left out
        (" AAAAAAAAAAA=", "not base64"),
        ("AAAAAAAAAAA=AAAAAAAAAAA=", "not base64"),  # padding inside
        ("AAAA", "8 bytes"),
        (base64.b64encode(b"x" * 12).decode(), "8 bytes"),
        (7, "base64 text or lists"),
    ],
)
def test_packed_blocks_that_cannot_be_read_are_refused(added: Any, why: str) -> None:
    data = {"epoch": 7, "from_seq": 0, "seq": 9, "full": True, "added": added, "removed": ""}
    with pytest.raises(TypeError, match=why):
        PrefixBlocks.from_dict(data)
    with pytest.raises(TypeError, match="8 bytes"):
        unpack_blocks(b"x" * 9)
    with pytest.raises(OverflowError):
        pack_blocks([1 << 64])


def test_the_map_follows_every_units_set_through_random_changes() -> None:
    # Blocks drawn from a small pool so that units share many of them; deltas that name
    # blocks twice, remove what the unit never held, add what it holds; whole sets again.
    rng = random.Random(5)
    view = EngineBlocks(512)
    truth: dict[str, set[int]] = {}
    seqs: dict[str, int] = {}
    pool = [rng.getrandbits(64) for _ in range(60)]
    for step in range(600):
        unit = rng.choice("abcdef")
        seq = seqs.get(unit, 0)
        if unit not in truth or step % 17 == 0:
            whole = set(rng.sample(pool, rng.randrange(0, 20)))
            assert view.apply(unit, PrefixBlocks(1, 0, seq + 1, True, tuple(whole), (), 512))
            truth[unit] = whole
        else:
            added = tuple(rng.choice(pool) for _ in range(rng.randrange(0, 8)))
            removed = tuple(rng.choice(pool) for _ in range(rng.randrange(0, 8)))
            blocks = PrefixBlocks(1, seq, seq + 1, False, added, removed, 512)
            assert view.apply(unit, blocks)
            truth[unit] = (truth[unit] - set(removed)) | set(added)
        seqs[unit] = seq + 1
        if step % 50 == 49:
            gone = rng.choice(sorted(truth))
            view.forget(gone)
            del truth[gone], seqs[gone]
        for name, held in truth.items():
            assert view.held(name) == held
        for block in pool:
            want = sorted(u for u, held in truth.items() if block in held)
            assert sorted(u for _, us in view.matches([block]) for u in us) == want


def test_chunk_names_are_60_bits_chained_over_the_whole_digest() -> None:
    text = long_text(4)
    names = chunk_hashes(text, 256, 512)
    assert len(names) >= 4 and all(0 <= n < 1 << 60 for n in names)
    assert any(n >= 1 << 56 for n in names), "the top of the 60 bits is used"
    # chunk k's name follows the whole chain: change chunk 0, every name changes
    other = chunk_hashes("X" + text[1:], 256, 512)
    assert all(a != b for a, b in zip(names, other, strict=True))

"""The prefix index corrected by what the engines report: their prefix-cache counters
in the load reports (routing core on an injected clock; then a real sidecar and gateway)."""

from __future__ import annotations

import random
import re

import aiohttp
import pytest

from proxy.gateway.policies.prefix import PrefixAffinity
from proxy.gateway.prefix import EngineFeedback, PrefixIndex
from proxy.gateway.router import Router
from proxy.load import LoadReport, UnitState
from proxy.pb.unitproxy.v1 import load_pb2
from proxy.settings import GatewaySettings, UnitTarget
from tests.conftest import GatewayFactory, SidecarFactory, wait_until
from tests.test_router import Clock

pytestmark = pytest.mark.timeout(30)


def prompts(n: int) -> list[str]:
    return [f"tenant {i}: " + f"the rules of tenant {i} are long. " * 60 for i in range(n)]


def test_the_counters_travel_in_every_form_of_the_report() -> None:
    report = LoadReport("u", UnitState.SERVING, 1, 8, prefix_cache_queries=10**12,
                        prefix_cache_hits=7, prefix_cache_resets=2)  # fmt: skip
    assert LoadReport.from_pb(report.to_pb()) == report
    assert LoadReport.from_dict(report.to_dict()) == report
    # an older peer's report (no counters) reads as zeros: nothing to correct
    old = load_pb2.LoadReport(unit_id="u", state=load_pb2.SERVING, capacity=8)
    assert LoadReport.from_pb(old).prefix_cache_queries == 0


def test_a_unit_that_finds_far_less_than_expected_keeps_fewer_blocks() -> None:
    index = PrefixIndex(chunk_chars=64, max_blocks=4096)
    feedback = EngineFeedback(index, window_tokens=1000)
    feedback.report("u", queries=1, hits=0, resets=0, now=0.0)  # the window opens
    texts = prompts(40)
    for text in texts + texts:  # the second round: the index expects every prefix
        blocks = index.hashes(text)
        feedback.sent("u", blocks, len(text))
        index.record("u", blocks, 1.0)
    held = index.held("u")
    # the engine found 10 % of the prompt tokens cached where the index expected ~50 %
    feedback.report("u", queries=20_001, hits=2_000, resets=0, now=2.0)
    verdict = feedback.verdicts[-1]
    assert verdict.found == pytest.approx(0.1) and 0.4 < verdict.expected < 0.55
    assert feedback.shrunk == 1
    assert index.held("u") <= held // 2 and index.limit("u") < 4096
    # the most recent prompts are the ones kept
    assert index.depth("u", index.hashes(texts[-1])) == len(index.hashes(texts[-1]))
    assert index.depth("u", index.hashes(texts[0])) == 0
    # windows where the engine finds what the index expects grow the limit back
    limit = index.limit("u")
    for k in range(3):
        for text in texts[-5:]:
            blocks = index.hashes(text)
            feedback.sent("u", blocks, len(text))
            index.record("u", blocks, 3.0 + k)
        queries = 20_001 + (k + 1) * 2_000
        feedback.report("u", queries=queries, hits=2_000 + (k + 1) * 1_900, resets=0, now=4.0)
    assert feedback.grown >= 1 and index.limit("u") > limit


def test_a_unit_whose_cache_was_emptied_is_forgotten() -> None:
    index = PrefixIndex(chunk_chars=64)
    feedback = EngineFeedback(index)
    feedback.report("u", queries=5, hits=1, resets=0, now=0.0)
    index.record("u", index.hashes(prompts(1)[0]), 0.0)
    feedback.report("u", queries=6, hits=1, resets=0, now=1.0)
    assert index.held("u") > 0
    feedback.report("u", queries=7, hits=1, resets=1, now=2.0)  # reset_prefix_cache
    assert index.held("u") == 0 and feedback.resets == 1


def test_the_router_feeds_the_reports_counters_to_the_index() -> None:
    targets = [UnitTarget(id="u0", http_url="http://u0:1", grpc_target="u0:2")]
    r = Router(GatewaySettings(policy="prefix"), targets, rng=random.Random(1), clock=Clock())
    policy = r.policy
    assert isinstance(policy, PrefixAffinity) and policy.feedback is not None
    r.apply_report("u0", LoadReport("u0", UnitState.SERVING, 0, 64, seq=1,
                                    prefix_cache_queries=10, prefix_cache_hits=1))  # fmt: skip
    policy.index.record("u0", policy.index.hashes(prompts(1)[0]), 100.0)
    r.apply_report("u0", LoadReport("u0", UnitState.SERVING, 0, 64, seq=2,
                                    prefix_cache_queries=11, prefix_cache_hits=1,
                                    prefix_cache_resets=1))  # fmt: skip
    assert policy.index.held("u0") == 0
    off = Router(GatewaySettings(policy="prefix", prefix_engine_feedback=False), targets)
    assert isinstance(off.policy, PrefixAffinity) and off.policy.feedback is None


async def test_a_unit_with_a_small_cache_is_trusted_with_fewer_prefixes(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    # 24 blocks of 16 tokens: less than one of the prompts below, so a prompt sent
    # again finds next to nothing cached, while the index (as large as it is told)
    # expects all of it
    unit = await start_sidecar(
        sidecar={"unit_id": "a"}, engine={"sim": {"prefix_cache_blocks": 24}}
    )
    gw = await start_gateway([unit], policy="prefix", prefix_chunk_chars=64)
    policy = gw.router.policy
    assert isinstance(policy, PrefixAffinity)
    feedback, index = policy.feedback, policy.index
    assert feedback is not None
    feedback.window_tokens = 2_000
    texts = prompts(8)
    for text in texts * 4:
        body = {"model": "unitproxy-sim", "prompt": text, "max_tokens": 1}
        async with http.post(f"{gw.http_url}/v1/completions", json=body) as resp:
            assert resp.status == 200
    await wait_until(lambda: feedback.shrunk >= 1, what="the index shrunk for unit a")
    assert index.limit("a") < index.max_blocks
    assert any(v.found < v.expected for v in feedback.verdicts)
    before = feedback.shrunk  # load reports go on arriving: it may shrink again meanwhile
    async with http.get(f"{gw.http_url}/metrics") as resp:  # what an operator sees
        exported = await resp.text()
    shrunk = re.search(r'^unitproxy_prefix_index_corrections_total\{action="shrunk"\} (\S+)$',
                       exported, re.M)  # fmt: skip
    assert shrunk is not None and before <= float(shrunk[1]) <= feedback.shrunk
    assert 'unitproxy_prefix_index_corrections_total{action="forgotten"} 0.0' in exported
    async with http.get(f"{unit.http_url}/load") as resp:
        report = await resp.json()
    # the counters the gateway read: many tokens looked up, few found
    assert report["prefix_cache_queries"] > 4 * report["prefix_cache_hits"]

"""A unit's engine slots (the requests its engine runs at once: the simulator's and
vLLM's max_num_seqs) reach the gateway in its load report (named metric engine_slots)
and, where the operator set no capacity, are the unit's capacity: what exceeds them
waits in the gateway's fair queue, not in the engine's FIFO. Real sidecars and a real
gateway on loopback, the openai client."""

from __future__ import annotations

import asyncio

import openai
import pytest

from engine.base import ENGINE_SLOTS
from tests.conftest import GatewayFactory, SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(30)

SLOW = {"max_num_seqs": 2, "decode_step_ms": 5.0}


async def test_a_units_slots_reach_the_gateway_and_bound_what_it_sends(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    sidecar = await start_sidecar(sim=SLOW)
    assert sidecar.core.capacity == 2  # none configured: the engine's slots
    gw = await start_gateway([sidecar])
    unit = next(iter(gw.router.units.values()))
    await wait_until(lambda: unit.metric(ENGINE_SLOTS) == 2, what="engine_slots at the gateway")
    assert unit.report is not None and unit.report.capacity == 2
    peak = {"outstanding": 0, "engine_held": 0, "gateway_waiting": 0}
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            peak["outstanding"] = max(peak["outstanding"], sidecar.core.outstanding)
            stats = sidecar.engine.stats()
            peak["engine_held"] = max(peak["engine_held"], stats.running + stats.waiting)
            peak["gateway_waiting"] = max(peak["gateway_waiting"], gw.router.waiting)
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    async with openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="x", max_retries=0) as c:
        answers = await asyncio.gather(
            *(
                c.completions.create(model="unitproxy-sim", prompt=f"p{i}", max_tokens=20)
                for i in range(6)
            )
        )
    stop.set()
    await watcher
    assert all(a.usage is not None and a.usage.completion_tokens == 20 for a in answers)
    assert peak["outstanding"] == 2, "the unit had at most its engine's slots at once"
    # what the engine holds, it runs (a request waits in its queue only to be prefilled)
    assert peak["engine_held"] == 2, "nothing queued in the engine beyond its slots"
    assert peak["gateway_waiting"] >= 3, "the rest waited in the gateway"


async def test_a_configured_capacity_wins_over_the_slots(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    sidecar = await start_sidecar(sim=SLOW, sidecar={"capacity": 5})
    gw = await start_gateway([sidecar])
    unit = next(iter(gw.router.units.values()))
    await wait_until(lambda: unit.metric(ENGINE_SLOTS) == 2, what="engine_slots at the gateway")
    assert sidecar.core.capacity == 5
    assert unit.report is not None and unit.report.capacity == 5

"""Models: each unit reports what it serves; the gateway lists the union and routes by it."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import openai
import pytest

from proxy.gateway.models import ModelCards
from proxy.load import LoadReport, UnitState
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import GatewayFactory, SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(30)


async def test_a_unit_reports_its_models_and_serves_each(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, engine={"served_model_name": "llama-a"})
    async with http.get(f"{a.http_url}/load") as resp:
        report = await resp.json()
    assert report["models"] == ["llama-a"] and report["prefix_cache_hit_rate"] == 0.0
    assert LoadReport.from_pb(a.core.report().to_pb()).models == ("llama-a",)
    async with http.get(f"{a.http_url}/v1/models/llama-a") as resp:
        assert resp.status == 200 and (await resp.json())["simulator"] is True
    async with http.get(f"{a.http_url}/v1/models/other") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"
    body = {"model": "unitproxy-sim", "prompt": "hi", "max_tokens": 1}
    async with http.post(f"{a.http_url}/v1/completions", json=body) as resp:
        assert resp.status == 404  # no longer its name


async def test_the_gateway_lists_the_union_of_the_units_models(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, engine={"served_model_name": "llama-a"})
    b = await start_sidecar(sidecar={"unit_id": "b"}, engine={"served_model_name": "qwen-b"})
    c = await start_sidecar(sidecar={"unit_id": "c"}, engine={"served_model_name": "llama-a"})
    gw = await start_gateway([a, b, c])
    async with openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0) as oa:
        models = {m.id: m for m in (await oa.models.list()).data}
        assert set(models) == {"llama-a", "qwen-b"}
        card = models["llama-a"].model_dump(exclude_unset=True)
        assert card["unitproxy"] == {"units": ["a", "c"], "simulator": True}
        assert set(card) == {
            "id",
            "object",
            "created",
            "owned_by",
            "root",
            "parent",
            "max_model_len",
            "permission",
            "unitproxy",
        }, "vLLM's fields"
        assert card["root"] == "llama-a" and card["owned_by"] == "unitproxy-simulator"
        assert (await oa.models.retrieve("qwen-b")).id == "qwen-b"
        with pytest.raises(openai.NotFoundError) as caught:
            await oa.models.retrieve("mistral")
        assert caught.value.code == "model_not_found"
        # No unit SERVING: the list is still known from the reports.
        for sidecar in (a, b, c):
            sidecar.start_drain()
        await wait_until(lambda: not gw.router.serving(), what="every unit draining")
        assert all(u.state is UnitState.DRAINING for u in gw.router.units.values())
        assert {m.id for m in (await oa.models.list()).data} == {"llama-a", "qwen-b"}
        gw.model_cards = ModelCards(gw._pools.get)  # what a restarted gateway knows
        for shown in (await oa.models.list()).data:  # no unit asked: cards from the names
            assert shown.model_dump(exclude_unset=True)["unitproxy"]["simulator"] is False
            assert shown.model_dump(exclude_unset=True)["root"] == shown.id


async def test_the_gateway_routes_by_model_and_404s_an_unknown_one(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, engine={"served_model_name": "llama-a"})
    b = await start_sidecar(sidecar={"unit_id": "b"}, engine={"served_model_name": "qwen-b"})
    c = await start_sidecar(sidecar={"unit_id": "c"}, engine={"served_model_name": "llama-a"})
    gw = await start_gateway([a, b, c])
    await wait_until(lambda: gw.router.reads_requests, what="the gateway sees two models")

    async def unit_of(model: str) -> str:
        body = {"model": model, "prompt": "hi", "max_tokens": 20}
        async with http.post(f"{gw.http_url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            return resp.headers["x-unitproxy-unit"]

    for model, units in (("llama-a", {"a", "c"}), ("qwen-b", {"b"})):
        # at once: lor spreads them over every unit serving the model, and no other
        seen = set(await asyncio.gather(*(unit_of(model) for _ in range(6))))
        assert seen == units
    body = {"model": "mistral", "prompt": "hi", "max_tokens": 1}
    async with http.post(f"{gw.http_url}/v1/completions", json=body) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            model="qwen-b", prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=2)
        )
        chunks = [chunk async for chunk in stub.Generate(request, timeout=5)]
        assert chunks[0].unit_id == "b"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(
                inference_pb2.GenerateRequest(model="mistral", prompt="x"), timeout=5
            ).read()
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    assert a.core.outstanding == b.core.outstanding == c.core.outstanding == 0


async def test_policy_prefix_sends_a_conversation_back_to_its_unit(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    units = [await start_sidecar(sidecar={"unit_id": u}) for u in "abc"]
    gw = await start_gateway(units, policy="prefix")
    system = {"role": "system", "content": "You answer questions about the sea. " * 40}
    messages = [system, {"role": "user", "content": "why is it blue?"}]
    seen = []
    for _ in range(4):
        body = {"model": "unitproxy-sim", "messages": messages, "max_tokens": 8}
        async with http.post(f"{gw.http_url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            seen.append(resp.headers["x-unitproxy-unit"])
            answer = (await resp.json())["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and?"}]
    assert len(set(seen)) == 1, seen
    unit = next(u for u in units if u.core.unit_id == seen[0])
    assert unit.engine.stats().prefix_cache_hit_rate > 0.5

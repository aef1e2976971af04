"""Every route the engine serves, through the sidecar and the gateway, as vLLM answers it.

Real sidecars (engine sim) and gateways on loopback; the clients are real ones: aiohttp
decoding by the declared charset as ``requests`` does, and the openai SDK.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import struct
from typing import Any

import aiohttp
import langchain_openai
import openai
import pytest

from proxy.gateway.server import Gateway
from proxy.response_ids import new_response_id, unit_of
from tests.conftest import GatewayFactory, SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(30)

NON_ASCII = "café naïve"


def latin1_by_default(response: aiohttp.ClientResponse, body: bytes) -> str:
    """What ``requests`` assumes of a text/* body that declares no charset (RFC 2616)."""
    return "iso-8859-1"


async def test_streams_declare_utf8_so_clients_decode_them_intact(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    # The model name is in every chunk: a stream that carries non-ASCII text.
    sidecar = await start_sidecar(engine={"served_model_name": NON_ASCII})
    gw = await start_gateway([sidecar])
    body = {"model": NON_ASCII, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": True}  # fmt: skip
    async with aiohttp.ClientSession(fallback_charset_resolver=latin1_by_default) as http:
        for url in (sidecar.http_url, gw.http_url):
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
                text = await resp.text()
            assert f'"model":"{NON_ASCII}"' in text, (url, text[:200])
            assert text.endswith("data: [DONE]\n\n")


# --- the simulator's Responses API ------------------------------------------------------

STREAM_EVENTS = [
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done",
    "response.output_item.done", "response.completed",
]  # fmt: skip


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


async def test_responses_whole_stored_and_continued(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sidecar={"unit_id": "unit-7"})
    url = sidecar.http_url
    first = {"model": "unitproxy-sim", "input": "hello there", "max_output_tokens": 5,
             "instructions": "be brief"}  # fmt: skip
    async with http.post(f"{url}/v1/responses", json=first) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-unitproxy-unit"] == "unit-7"
        one = await resp.json()
    assert one["object"] == "response" and one["model"] == "unitproxy-sim"
    assert one["status"] == "incomplete", "5 tokens: the limit ended it"
    assert one["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = one["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    text = message["content"][0]["text"]
    assert message["content"][0]["type"] == "output_text" and len(text.split()) == 5
    usage = one["usage"]
    assert usage["output_tokens"] == 5 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + 5
    assert unit_of(one["id"]) == "unit-7", "the id names the unit that stores it"
    async with http.get(f"{url}/v1/responses/{one['id']}") as resp:
        assert resp.status == 200
        assert await resp.json() == one
    follow = {"input": "and then?", "previous_response_id": one["id"], "max_output_tokens": 3}
    async with http.post(f"{url}/v1/responses", json=follow) as resp:
        assert resp.status == 200, await resp.text()
        two = await resp.json()
    assert two["previous_response_id"] == one["id"]
    # its context: the first input and output (not the first's instructions), then its own
    assert two["usage"]["input_tokens"] > usage["input_tokens"] - 6 + usage["output_tokens"]
    lost = {"input": "x", "previous_response_id": "resp_nowhere"}
    async with http.post(f"{url}/v1/responses", json=lost) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["param"] == "previous_response_id"
    async with http.get(f"{url}/v1/responses/resp_nowhere") as resp:
        assert resp.status == 404
    unstored = {"input": "x", "store": False, "max_output_tokens": 2}
    async with http.post(f"{url}/v1/responses", json=unstored) as resp:
        rid = (await resp.json())["id"]
    async with http.get(f"{url}/v1/responses/{rid}") as resp:
        assert resp.status == 404, "store false keeps nothing"


async def test_responses_stream_with_openais_event_types(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar()
    items = [
        {"role": "developer", "content": "terse"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    ]
    body = {"input": items, "stream": True, "max_output_tokens": 4}
    async with http.post(f"{sidecar.http_url}/v1/responses", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
        events = sse_events(await resp.text())
    kinds = [kind for kind, _ in events]
    assert list(dict.fromkeys(kinds)) == STREAM_EVENTS
    assert kinds.count("response.output_text.delta") == 4
    assert [data["type"] for _, data in events] == kinds
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    done = dict(events)
    assert done["response.output_text.done"]["text"] == deltas
    final = done["response.completed"]["response"]
    assert final["output"][0]["content"][0]["text"] == deltas
    assert final["usage"]["output_tokens"] == 4
    assert done["response.created"]["response"]["id"] == final["id"]
    async with http.get(f"{sidecar.http_url}/v1/responses/{final['id']}") as resp:
        assert (await resp.json())["output"] == final["output"], "a streamed response is stored"


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("tools", [{"type": "function", "name": "f", "parameters": {}}], "tools"),
        ("tool_choice", "required", "tool_choice"),
        ("text", {"format": {"type": "json_object"}}, "text"),
        ("reasoning", {"effort": "high"}, "reasoning"),
        ("top_logprobs", 3, "top_logprobs"),
        ("input", [{"type": "function_call_output", "call_id": "c", "output": "1"}], "input"),
        ("input", [{"role": "user", "content": [{"type": "input_image"}]}], "input"),
        ("max_output_tokens", 0, "max_output_tokens"),
    ],
)
async def test_responses_refuse_what_the_simulator_cannot_honour(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession, field: str, value: Any, param: str
) -> None:
    sidecar = await start_sidecar()
    body = {"input": "hi", field: value}
    async with http.post(f"{sidecar.http_url}/v1/responses", json=body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == param


async def test_a_background_response_is_retrieved_and_cancelled(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sim={"decode_step_ms": 20.0})
    url = sidecar.http_url
    body = {"input": "hi", "background": True, "max_output_tokens": 100_000}
    async with http.post(f"{url}/v1/responses", json=body) as resp:
        assert resp.status == 200, await resp.text()
        queued = await resp.json()
    assert queued["status"] == "queued" and queued["background"] is True
    rid = queued["id"]
    async with http.get(f"{url}/v1/responses/{rid}") as resp:
        assert (await resp.json())["status"] == "in_progress"
    async with http.post(f"{url}/v1/responses/{rid}/cancel") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "cancelled"
    await wait_until(lambda: sidecar.core.engine.stats().running == 0, what="engine freed")
    async with http.post(f"{url}/v1/responses", json={"input": "x", "max_output_tokens": 1}) as r:
        done = await r.json()
    async with http.post(f"{url}/v1/responses/{done['id']}/cancel") as resp:
        assert resp.status == 400, "a synchronous response cannot be cancelled"
    no_store = {**body, "store": False}
    async with http.post(f"{url}/v1/responses", json=no_store) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "background"


async def test_the_store_of_responses_is_bounded(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sim={"responses_stored": 2})
    ids = []
    for _ in range(3):
        body = {"input": "x", "max_output_tokens": 1}
        async with http.post(f"{sidecar.http_url}/v1/responses", json=body) as resp:
            ids.append((await resp.json())["id"])
    found = []
    for rid in ids:
        async with http.get(f"{sidecar.http_url}/v1/responses/{rid}") as resp:
            found.append(resp.status)
    assert found == [404, 200, 200], "the oldest went first"


# --- the simulator's pooling routes -------------------------------------------------------


async def post_json(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], status: int = 200
) -> Any:
    async with http.post(url, json=body) as resp:
        assert resp.status == status, await resp.text()
        assert resp.headers["content-type"].startswith("application/json")
        return await resp.json()


async def test_embeddings_are_a_function_of_the_seed_and_the_input(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sim={"embedding_dim": 64})
    b = await start_sidecar(sim={"embedding_dim": 64})
    other_seed = await start_sidecar(sim={"embedding_dim": 64, "seed": 7})
    texts = ["the cat sat", "the cat sat", "a dog ran"]
    body = {"model": "unitproxy-sim", "input": texts}
    one = await post_json(http, f"{a.http_url}/v1/embeddings", body)
    assert one["object"] == "list" and one["id"].startswith("embd-")
    assert [d["object"] for d in one["data"]] == ["embedding"] * 3
    assert [d["index"] for d in one["data"]] == [0, 1, 2]
    vectors = [d["embedding"] for d in one["data"]]
    assert all(len(v) == 64 for v in vectors)
    assert math.isclose(sum(x * x for x in vectors[0]), 1.0), "normalized, as vLLM's"
    assert vectors[0] == vectors[1] and vectors[0] != vectors[2]
    assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] > 0
    assert one["usage"]["completion_tokens"] == 0
    again = await post_json(http, f"{b.http_url}/v1/embeddings", body)
    assert [d["embedding"] for d in again["data"]] == vectors, "another process, same vectors"
    seeded = await post_json(http, f"{other_seed.http_url}/v1/embeddings", body)
    assert seeded["data"][0]["embedding"] != vectors[0]
    small = await post_json(http, f"{a.http_url}/v1/embeddings",
                            {"input": "the cat sat", "dimensions": 8, "encoding_format": "base64"})  # fmt: skip
    raw = base64.b64decode(small["data"][0]["embedding"])
    floats = struct.unpack("<8f", raw)
    assert math.isclose(sum(x * x for x in floats), 1.0, rel_tol=1e-5)
    ids = await post_json(http, f"{a.http_url}/v1/embeddings", {"input": [[1, 2, 3], [4, 5]]})
    assert ids["usage"]["prompt_tokens"] == 5
    error = await post_json(http, f"{a.http_url}/v1/embeddings",
                            {"input": "x", "dimensions": 65}, status=400)  # fmt: skip
    assert error["error"]["param"] == "dimensions"
    error = await post_json(http, f"{a.http_url}/v1/embeddings", {"input": 3}, status=400)
    assert error["error"]["param"] == "input"
    pooled = await post_json(http, f"{a.http_url}/pooling", {"input": "the cat sat"})
    assert pooled["id"].startswith("pool-") and pooled["data"][0]["object"] == "pooling"
    assert pooled["data"][0]["data"] == vectors[0]


async def test_score_and_rerank_are_cosine_scores(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar()
    url = sidecar.http_url
    docs = ["stock prices fell today", "the weather in paris is sunny", "paris"]
    query = "what is the weather in paris"
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = await post_json(http, f"{url}{path}", {"query": query, "documents": docs})
        assert ranked["id"].startswith("rerank-") and ranked["model"] == "unitproxy-sim"
        results = ranked["results"]
        assert [r["index"] for r in results] == [1, 2, 0], "most shared words first"
        assert results[0]["document"] == {"text": docs[1], "multi_modal": None}
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True) and -1 <= scores[-1] <= scores[0] <= 1
        assert ranked["usage"]["total_tokens"] > 0
    top = await post_json(http, f"{url}/v1/rerank",
                          {"query": query, "documents": docs, "top_n": 1})  # fmt: skip
    assert [r["index"] for r in top["results"]] == [1]
    for path in ("/score", "/v1/score"):
        scored = await post_json(http, f"{url}{path}", {"text_1": query, "text_2": docs})
        assert scored["id"].startswith("score-") and scored["object"] == "list"
        assert [d["object"] for d in scored["data"]] == ["score"] * 3
        by_score = {d["index"]: d["score"] for d in scored["data"]}
        assert by_score[1] == results[0]["relevance_score"]
    same = await post_json(http, f"{url}/score", {"text_1": "a b", "text_2": "a b"})
    assert math.isclose(same["data"][0]["score"], 1.0)
    error = await post_json(http, f"{url}/score",
                            {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, status=400)  # fmt: skip
    assert error["error"]["param"] == "text_2"
    classified = await post_json(http, f"{url}/classify", {"input": ["good", "bad"]})
    assert classified["id"].startswith("classify-")
    for i, row in enumerate(classified["data"]):
        assert row["index"] == i and row["num_classes"] == 2
        assert math.isclose(sum(row["probs"]), 1.0) and row["label"] in ("LABEL_0", "LABEL_1")


async def test_pooling_requests_run_in_the_engine(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    """An embedding takes an engine slot and pays the prefill, as in vLLM."""
    sidecar = await start_sidecar(sim={"max_num_seqs": 1, "prefill_ms_per_token": 50.0,
                                       "prefix_cache_blocks": 0})  # fmt: skip
    url = sidecar.http_url
    task = asyncio.ensure_future(post_json(http, f"{url}/v1/embeddings", {"input": "a b c d e f"}))
    await wait_until(lambda: sidecar.core.engine.stats().running == 1, what="a slot taken")
    assert sidecar.core.outstanding == 1
    await task
    assert sidecar.core.engine.stats().running == 0


# --- through the gateway -----------------------------------------------------------------

# Every route with a body the simulator answers, and what in the answer is not the same
# from one request to the next (ids, timestamps).
ROUTE_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/responses", {"input": "hi", "max_output_tokens": 3}),
    ("/v1/embeddings", {"input": ["the cat", "a dog"]}),
    ("/pooling", {"input": "the cat"}),
    ("/classify", {"input": "the cat"}),
    ("/score", {"text_1": "the cat", "text_2": ["the cat", "a dog"]}),
    ("/v1/score", {"text_1": "the cat", "text_2": "a dog"}),
    ("/rerank", {"query": "the cat", "documents": ["a dog", "the cat"]}),
    ("/v1/rerank", {"query": "the cat", "documents": ["a dog", "the cat"]}),
    ("/v2/rerank", {"query": "the cat", "documents": ["a dog", "the cat"], "top_n": 1}),
]
VARYING = {"id", "created", "created_at"}


def steady(body: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in body.items() if k not in VARYING}
    if isinstance(body.get("output"), list):  # a response's message ids
        body["output"] = [{k: v for k, v in o.items() if k != "id"} for o in body["output"]]
    return body


def counter(gw: Gateway, name: str, **labels: str) -> float:
    return gw.registry.get_sample_value(name, labels) or 0.0


async def test_the_gateway_routes_every_route_by_model(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, engine={"served_model_name": "chat-model"})
    b = await start_sidecar(sidecar={"unit_id": "b"}, engine={"served_model_name": "embedder"})
    gw = await start_gateway([a, b])
    for path, body in ROUTE_BODIES:
        for model, unit in (("chat-model", a), ("embedder", b)):
            sent = {**body, "model": model}
            async with http.post(f"{gw.http_url}{path}", json=sent) as resp:
                assert resp.status == 200, (path, await resp.text())
                assert resp.headers["x-unitproxy-unit"] == unit.core.unit_id, path
                assert resp.headers["x-request-id"]
                through = await resp.json()
            direct = await post_json(http, f"{unit.http_url}{path}", sent)
            assert steady(through) == steady(direct), path
            assert through["model"] == model
    for route in ("responses", "embeddings", "pooling", "classify", "score", "rerank"):
        assert counter(gw, "unitproxy_requests_total", route=route, code="200") >= 2, route
        assert counter(gw, "unitproxy_request_duration_seconds_count", route=route) >= 2
    # a model no unit serves: 404 from the gateway, as for chat
    async with http.post(f"{gw.http_url}/v1/embeddings", json={"model": "x", "input": "a"}) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "model_not_found"
    # the simulator has no tokenizer routes: the unit's own 404 comes back, from the unit,
    # with the body vLLM's server gives for a route it has not for the model (FastAPI's)
    async with http.post(f"{gw.http_url}/tokenize",
                         json={"model": "embedder", "prompt": "a"}) as resp:  # fmt: skip
        assert resp.status == 404 and resp.headers["x-unitproxy-unit"] == "b"
        assert resp.headers["content-type"] == "application/json"
        assert await resp.json() == {"detail": "Not Found"}


async def test_a_responses_stream_through_the_gateway(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    gw = await start_gateway([await start_sidecar()])
    body = {"input": "hi", "stream": True, "max_output_tokens": 3, "instructions": NON_ASCII}
    async with (
        aiohttp.ClientSession(fallback_charset_resolver=latin1_by_default) as client,
        client.post(f"{gw.http_url}/v1/responses", json=body) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
        events = sse_events(await resp.text())
    assert list(dict.fromkeys(k for k, _ in events)) == STREAM_EVENTS
    assert dict(events)["response.completed"]["response"]["instructions"] == NON_ASCII
    assert counter(gw, "unitproxy_time_to_first_token_seconds_count", route="responses") == 1


async def test_stored_responses_go_back_to_the_unit_that_stores_them(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    units = [await start_sidecar(sidecar={"unit_id": f"u{i}"}, sim={"decode_step_ms": 20.0})
             for i in range(3)]  # fmt: skip
    gw = await start_gateway(units, policy="round_robin")
    url = gw.http_url
    first = await post_json(http, f"{url}/v1/responses", {"input": "hi", "max_output_tokens": 2})
    home = unit_of(first["id"])
    assert home in ("u0", "u1", "u2")
    for _ in range(6):  # round robin would spread them; the stored response pins them
        body = {"input": "more", "previous_response_id": first["id"], "max_output_tokens": 1}
        async with http.post(f"{url}/v1/responses", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-unitproxy-unit"] == home
        async with http.get(f"{url}/v1/responses/{first['id']}") as resp:
            assert resp.status == 200 and resp.headers["x-unitproxy-unit"] == home
            assert (await resp.json())["id"] == first["id"]
    background = {"input": "hi", "background": True, "max_output_tokens": 100_000}
    queued = await post_json(http, f"{url}/v1/responses", background)
    async with http.post(f"{url}/v1/responses/{queued['id']}/cancel") as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-unitproxy-unit"] == unit_of(queued["id"])
        assert (await resp.json())["status"] == "cancelled"
    # ids that name no unit this gateway knows, or no unit at all
    stranger = new_response_id("u9")
    async with http.get(f"{url}/v1/responses/{stranger}") as resp:
        assert resp.status == 404 and "u9" in (await resp.json())["error"]["message"]
    body = {"input": "x", "previous_response_id": stranger}
    async with http.post(f"{url}/v1/responses", json=body) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["param"] == "previous_response_id"
    async with http.get(f"{url}/v1/responses/resp_0123") as resp:
        assert resp.status == 404
    # the unit that stores it is gone: 503 at once, never another unit
    index = int(home.removeprefix("u"))
    await units[index].__aexit__(None, None, None)
    await wait_until(lambda: home not in {u.id for u in gw.router.serving()}, what="unit gone")
    async with http.get(f"{url}/v1/responses/{first['id']}") as resp:
        assert resp.status == 503
        assert home in (await resp.json())["error"]["message"]


async def test_pooling_requests_retry_on_another_unit_before_the_first_byte(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    # Polling once a minute: the gateway keeps believing a is SERVING.
    gw = await start_gateway([a, b], policy="round_robin", load_source="poll",
                             poll_interval_s=60, stale_after_s=120)  # fmt: skip
    await a.__aexit__(None, None, None)  # a's ports now refuse connections
    for path, body in ROUTE_BODIES:
        async with http.post(f"{gw.http_url}{path}", json=body) as resp:
            assert resp.status == 200, (path, await resp.text())
            assert resp.headers["x-unitproxy-unit"] == "b"
    assert counter(gw, "unitproxy_retries_total", reason="connect") >= 1


async def test_the_deadline_holds_for_pooling_requests(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    slow = await start_sidecar(sim={"prefill_ms_per_token": 1000.0, "prefix_cache_blocks": 0})
    gw = await start_gateway([slow])
    headers = {"x-unitproxy-timeout-ms": "200"}
    body = {"input": "a b c d e f g h"}
    async with http.post(f"{gw.http_url}/v1/embeddings", json=body, headers=headers) as resp:
        assert resp.status == 504, await resp.text()
    await wait_until(lambda: slow.core.outstanding == 0, what="the unit let it go")
    assert slow.core.engine.stats().running == 0, "aborted in the engine"


# --- the openai SDK through the gateway ----------------------------------------------------


async def test_the_openai_sdk_through_the_gateway(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    gw = await start_gateway([a, b], policy="round_robin")
    async with openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0) as oa:
        whole = await oa.responses.create(
            model="unitproxy-sim", input="hello", instructions="be brief", max_output_tokens=4
        )
        assert whole.object == "response" and whole.status == "incomplete"
        assert len(whole.output_text.split()) == 4
        assert whole.usage is not None and whole.usage.output_tokens == 4
        follow = await oa.responses.create(
            model="unitproxy-sim", input="go on", previous_response_id=whole.id,
            max_output_tokens=2,
        )  # fmt: skip
        assert follow.previous_response_id == whole.id
        kept = await oa.responses.retrieve(whole.id)
        assert kept.output_text == whole.output_text

        stream = await oa.responses.create(
            model="unitproxy-sim", input=[{"role": "user", "content": "hi"}],
            max_output_tokens=5, stream=True,
        )  # fmt: skip
        kinds, deltas, final = [], [], None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type == "response.completed":
                final = event.response
        assert list(dict.fromkeys(kinds)) == STREAM_EVENTS
        assert final is not None and final.output_text == "".join(deltas)

        async with oa.responses.stream(
            model="unitproxy-sim", input="hi", max_output_tokens=3
        ) as helper:
            texts = [e.delta async for e in helper if e.type == "response.output_text.delta"]
            done = await helper.get_final_response()
        assert done.output_text == "".join(texts) and len(texts) == 3

        embedded = await oa.embeddings.create(model="unitproxy-sim", input=["the cat", "a dog"])
        assert [d.index for d in embedded.data] == [0, 1]
        assert len(embedded.data[0].embedding) == 384
        assert embedded.usage.prompt_tokens > 0
        # the SDK asks for base64 unless told otherwise, and decodes it
        direct = await post_json_sdk(oa, "the cat")
        assert embedded.data[0].embedding == pytest.approx(direct, rel=1e-6)


async def post_json_sdk(oa: openai.AsyncOpenAI, text: str) -> list[float]:
    floats = await oa.embeddings.create(model="unitproxy-sim", input=text,
                                        encoding_format="float")  # fmt: skip
    return floats.data[0].embedding


# --- streamed retrieve of a streamed background response ------------------------------------


async def read_events(resp: aiohttp.ClientResponse) -> list[tuple[str, dict[str, Any]]]:
    assert resp.status == 200, await resp.text()
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    return sse_events(await resp.text())


async def test_a_streamed_background_response_is_retrieved_as_a_stream(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    units = [await start_sidecar(sidecar={"unit_id": f"u{i}"}, sim={"decode_step_ms": 5.0})
             for i in range(2)]  # fmt: skip
    gw = await start_gateway(units, policy="round_robin")
    body = {"input": "hi", "background": True, "stream": True, "max_output_tokens": 6}
    async with http.post(f"{gw.http_url}/v1/responses", json=body) as resp:
        made = await read_events(resp)
        home = resp.headers["x-unitproxy-unit"]
    assert list(dict.fromkeys(k for k, _ in made)) == STREAM_EVENTS
    assert [d["sequence_number"] for _, d in made] == list(range(len(made)))
    rid = made[0][1]["response"]["id"]
    assert unit_of(rid) == home
    for _ in range(2):  # round robin would alternate; the id names the unit
        async with http.get(f"{gw.http_url}/v1/responses/{rid}?stream=true") as resp:
            assert resp.headers["x-unitproxy-unit"] == home
            assert await read_events(resp) == made, "every event again, as it was"
    async with http.get(f"{gw.http_url}/v1/responses/{rid}?stream=true&starting_after=3") as r:
        assert await read_events(r) == made[4:]
    async with http.get(f"{gw.http_url}/v1/responses/{rid}") as resp:
        assert (await resp.json())["status"] == "incomplete"
    assert counter(gw, "unitproxy_requests_total", route="responses_retrieve", code="200") == 4


async def test_a_streamed_retrieve_follows_a_response_still_being_made(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sim={"decode_step_ms": 20.0})
    url = sidecar.http_url
    body = {"input": "hi", "background": True, "stream": True, "max_output_tokens": 30}
    async with http.post(f"{url}/v1/responses", json=body) as made:
        first = (await made.content.readuntil(b"\n\n")).decode()
        rid = sse_events(first)[0][1]["response"]["id"]
        # the creating stream closes early: the response goes on in the background
    async with http.get(f"{url}/v1/responses/{rid}?stream=1&starting_after=0") as resp:
        events = await read_events(resp)
    assert events[0][0] == "response.in_progress" and events[-1][0] == "response.completed"
    assert sum(k == "response.output_text.delta" for k, _ in events) == 30
    assert events[-1][1]["response"]["usage"]["output_tokens"] == 30


async def test_a_streamed_retrieve_of_what_kept_no_events_is_vllms_400(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar()
    url = sidecar.http_url
    whole = await post_json(http, f"{url}/v1/responses", {"input": "x", "max_output_tokens": 1})
    async with http.get(f"{url}/v1/responses/{whole['id']}?stream=true") as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == "response_id" and whole["id"] in error["message"]
    for query, param in (("stream=maybe", "stream"), ("stream=true&starting_after=x",
                                                      "starting_after")):  # fmt: skip
        async with http.get(f"{url}/v1/responses/{whole['id']}?{query}") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == param
    async with http.get(f"{url}/v1/responses/{whole['id']}?stream=false") as resp:
        assert resp.status == 200 and (await resp.json())["id"] == whole["id"]


# --- the audio routes (multipart forms) ----------------------------------------------------

WAV = b"RIFF" + bytes(range(256))  # the simulator reads none of it; not UTF-8


def audio_form(model: str | None, **fields: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    if model is not None:
        form.add_field("model", model)
    for name, value in fields.items():
        form.add_field(name, value)
    form.add_field("file", WAV, filename="a.wav", content_type="audio/wav")
    return form


async def test_audio_routes_are_routed_by_the_forms_model_field(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, engine={"served_model_name": "chat-model"})
    b = await start_sidecar(sidecar={"unit_id": "b"}, engine={"served_model_name": "speech"})
    gw = await start_gateway([a, b], policy="round_robin")
    for route in ("transcriptions", "translations"):
        for _ in range(3):
            form = audio_form("speech", language="en")
            async with http.post(f"{gw.http_url}/v1/audio/{route}", data=form) as resp:
                assert resp.status == 400, await resp.text()
                assert resp.headers["x-unitproxy-unit"] == "b"
                error = (await resp.json())["error"]
            assert "the simulator has no transcription model" in error["message"]
            assert error["param"] == "model"
        assert counter(gw, "unitproxy_requests_total", route=route, code="400") == 3
    # the model field comes after the file: still found
    form = aiohttp.FormData()
    form.add_field("file", WAV, filename="a.wav", content_type="audio/wav")
    form.add_field("model", "chat-model")
    async with http.post(f"{gw.http_url}/v1/audio/transcriptions", data=form) as resp:
        assert resp.status == 400 and resp.headers["x-unitproxy-unit"] == "a"
    # a model no unit serves: the gateway's 404, as for any route
    async with http.post(f"{gw.http_url}/v1/audio/transcriptions",
                         data=audio_form("nobody")) as resp:  # fmt: skip
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_an_audio_body_that_does_not_parse_is_answered_as_vllms_server_answers_it(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    """A multipart body that is no form: vLLM's server (starlette) answers 400
    {"detail": ...} on a route it has; the gateway routes it to a unit (by the model
    field when that comes before the fault) and passes the unit's answer on. A bound of
    unitproxy's own is the gateway's 400."""
    a = await start_sidecar(sidecar={"unit_id": "a"})
    gw = await start_gateway([a])
    url = f"{gw.http_url}/v1/audio/transcriptions"
    malformed = [
        ("multipart/form-data", b"--x\r\n", "Missing boundary in multipart."),
        ("multipart/form-data; boundary=x", b"no boundary here", "Invalid multipart data."),
        ("multipart/form-data; boundary=x",
         b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nunitproxy-sim',
         "Invalid multipart data."),
        ("multipart/form-data; boundary=x",
         b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nunitproxy-sim\r\n'
         b"--x\r\nContent-Disposition: form-data\r\n\r\nv\r\n--x--",
         'The Content-Disposition header field "name" must be provided.'),
    ]  # fmt: skip
    for ctype, body, detail in malformed:
        expected = json.dumps({"detail": detail}, separators=(",", ":")).encode()
        for base in (a.http_url, gw.http_url):
            async with http.post(f"{base}/v1/audio/transcriptions", data=body,
                                 headers={"Content-Type": ctype}) as resp:  # fmt: skip
                assert resp.status == 400, (ctype, await resp.text())
                assert resp.headers["content-type"] == "application/json"
                assert resp.headers["x-unitproxy-unit"] == "a", "the unit answered"
                assert await resp.read() == expected
    bounds = [
        ("multipart/form-data; boundary=x",
         b"--x\r\n" + b"X-Pad: 1\r\n" * 20 + b"\r\nv\r\n--x--", "more than 16 headers"),
        ("multipart/form-data; boundary=x",
         b"".join(b'--x\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nv\r\n' % i
                  for i in range(65)) + b"--x--", "more than 64 parts"),
    ]  # fmt: skip
    for ctype, body, message in bounds:
        async with http.post(url, data=body, headers={"Content-Type": ctype}) as resp:
            assert resp.status == 400, (ctype, await resp.text())
            assert resp.headers["x-unitproxy-unit"] == "none", "no unit was asked"
            error = (await resp.json())["error"]
        assert message in error["message"], (message, error)
        assert error["type"] == "invalid_request_error"
    # what a web page posts cross-site: refused, as the admin routes refuse it
    headers = {"Origin": "https://example.test"}
    async with http.post(url, data=audio_form("unitproxy-sim"), headers=headers) as resp:
        assert resp.status == 403
        assert (await resp.json())["error"]["code"] == "browser_request"
    # the body bound holds for forms as for JSON
    big = aiohttp.FormData()
    big.add_field("model", "unitproxy-sim")
    big.add_field("file", io.BytesIO(bytes(5 * 1024 * 1024)), filename="a.wav",
                  content_type="audio/wav")  # fmt: skip
    async with http.post(url, data=big) as resp:
        assert resp.status == 413


async def test_a_body_that_is_no_form_gets_the_units_answer_as_vllms_server_gives_it(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    """vLLM's server reads a JSON (or other) body on an audio route as a form with no
    field: its 400 for the missing file (a transcription model), its 404 (no such route
    for the model). The gateway routes it to a unit (by a JSON body's model) and passes
    the unit's answer on; the simulator answers what it answers to any audio request."""
    a = await start_sidecar(sidecar={"unit_id": "a"}, engine={"served_model_name": "chat-model"})
    b = await start_sidecar(sidecar={"unit_id": "b"}, engine={"served_model_name": "speech"})
    gw = await start_gateway([a, b], policy="round_robin")
    bodies = [
        ("application/json", json.dumps({"model": "speech", "file": "x"}).encode(), "b"),
        ("text/plain", b"hello", None),
        ("application/json", b"{not json", None),
    ]
    for route in ("transcriptions", "translations"):
        for ctype, body, unit in bodies:
            for base in (b.http_url, gw.http_url):
                headers = {"Content-Type": ctype}
                async with http.post(f"{base}/v1/audio/{route}", data=body,
                                     headers=headers) as resp:  # fmt: skip
                    assert resp.status == 400, (base, ctype, await resp.text())
                    assert resp.headers["content-type"] == "application/json"
                    served_by = resp.headers["x-unitproxy-unit"]
                    error = (await resp.json())["error"]
                assert served_by == unit or (unit is None and served_by in "ab"), served_by
                assert "the simulator has no transcription model" in error["message"]
                assert error["param"] == "model", error
    # the unit answered every one the gateway took: none was the gateway's own refusal
    assert counter(gw, "unitproxy_routed_requests_total", unit="b") >= 2


async def test_an_urlencoded_audio_body_is_routed_by_its_model_field(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, engine={"served_model_name": "chat-model"})
    b = await start_sidecar(sidecar={"unit_id": "b"}, engine={"served_model_name": "speech"})
    gw = await start_gateway([a, b], policy="round_robin")
    for _ in range(4):  # round robin would send half of them to a
        form = aiohttp.FormData({"language": "en", "model": "speech"})  # url-encoded
        async with http.post(f"{gw.http_url}/v1/audio/translations", data=form) as resp:
            assert resp.request_info.headers["Content-Type"].startswith(
                "application/x-www-form-urlencoded"
            )
            assert resp.status == 400 and resp.headers["x-unitproxy-unit"] == "b"
    async with http.post(f"{gw.http_url}/v1/audio/translations", data={"model": "nobody"}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_audio_requests_retry_on_another_unit_before_the_first_byte(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"})
    b = await start_sidecar(sidecar={"unit_id": "b"})
    gw = await start_gateway([a, b], policy="round_robin", load_source="poll",
                             poll_interval_s=60, stale_after_s=120)  # fmt: skip
    await a.__aexit__(None, None, None)
    for _ in range(2):
        async with http.post(f"{gw.http_url}/v1/audio/translations",
                             data=audio_form("unitproxy-sim")) as resp:  # fmt: skip
            assert resp.status == 400 and resp.headers["x-unitproxy-unit"] == "b"
            assert "no transcription model" in (await resp.json())["error"]["message"]
    assert counter(gw, "unitproxy_retries_total", reason="connect") >= 1


async def test_the_openai_sdks_audio_call_gets_the_simulators_400(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway([await start_sidecar()])
    async with openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key="k", max_retries=0) as oa:
        with pytest.raises(openai.BadRequestError) as refused:
            await oa.audio.transcriptions.create(
                model="unitproxy-sim", file=("a.wav", WAV, "audio/wav"), language="en"
            )
    assert "the simulator has no transcription model" in str(refused.value)


# --- langchain's Responses path ----------------------------------------------------------


async def test_langchain_openai_on_the_responses_api(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway([await start_sidecar()])
    async with openai.DefaultAsyncHttpxClient() as client:  # closed here, not at exit
        llm = langchain_openai.ChatOpenAI(
            model="unitproxy-sim", base_url=f"{gw.http_url}/v1", api_key="k",
            use_responses_api=True, max_tokens=4, max_retries=0, timeout=10,
            http_async_client=client,
        )  # fmt: skip
        whole = await llm.ainvoke("Say hello")
        assert len(whole.text.split()) == 4
        assert whole.response_metadata["model_name"] == "unitproxy-sim"
        assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] == 4
        pieces = [chunk async for chunk in llm.astream("Say hello")]
        assert len("".join(c.text for c in pieces).split()) == 4
    assert counter(gw, "unitproxy_requests_total", route="responses", code="200") == 2

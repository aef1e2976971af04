"""The sidecar's HTTP API against a real server on loopback, with the real openai client."""

from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import urlsplit

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SidecarFactory, wait_until

pytestmark = pytest.mark.timeout(20)


def client(url: str, **kwargs: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, **kwargs)  # type: ignore[arg-type]


async def test_openai_client_streams_chat_and_completion(start_sidecar: SidecarFactory) -> None:
    sidecar = await start_sidecar()
    async with client(sidecar.http_url) as oa:
        chat = await oa.chat.completions.create(
            model="unitproxy-sim",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage, finish = [], None, None
        async for chunk in chat:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 7
        assert "".join(pieces).strip()

        stream = await oa.completions.create(
            model="unitproxy-sim", prompt="once upon a time", max_tokens=5, stream=True
        )
        texts = [c.choices[0].text async for c in stream]
        assert len(texts) == 5

        whole = await oa.completions.create(
            prompt="once upon a time", model="unitproxy-sim", max_tokens=5
        )
        assert whole.choices[0].text == "".join(texts), "same prompt, same seed: same text"
        assert whole.usage is not None and whole.usage.total_tokens == whole.usage.prompt_tokens + 5

        reply = await oa.chat.completions.create(
            model="unitproxy-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].finish_reason == "length"
    assert sidecar.core.outstanding == 0


async def test_headers_models_and_readiness(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sidecar={"unit_id": "unit-a"})
    body = {"prompt": "x", "max_tokens": 2}
    async with http.post(f"{sidecar.http_url}/v1/completions", json=body,
                         headers={"x-request-id": "req-42"}) as resp:  # fmt: skip
        assert resp.status == 200
        assert resp.headers["x-unitproxy-unit"] == "unit-a"
        assert resp.headers["x-request-id"] == "req-42"
        assert (await resp.json())["id"] == "cmpl-req-42"
    async with http.post(f"{sidecar.http_url}/v1/completions", json=body) as resp:
        assert len(resp.headers["x-request-id"]) >= 16
    async with http.get(f"{sidecar.http_url}/v1/models") as resp:
        models = await resp.json()
        assert models["data"][0]["id"] == "unitproxy-sim"
        assert models["data"][0]["simulator"] is True
    async with http.get(f"{sidecar.http_url}/ready") as resp:
        ready = await resp.json()
        assert resp.status == 200
        assert ready["state"] == "SERVING" and ready["unit_id"] == "unit-a"
        assert ready["nodes"][0]["role"] == "leader" and ready["nodes"][0]["healthy"] is True
    async with http.get(f"{sidecar.http_url}/health") as resp:
        assert resp.status == 200
    async with http.get(f"{sidecar.http_url}/load") as resp:
        load = await resp.json()
        assert load["unit_id"] == "unit-a" and load["outstanding"] == 0
        assert load["capacity"] == 32 and load["http_url"] == sidecar.http_url  # sim slots


BAD_BODIES = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": -4}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": "5"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": 9}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"prompt": "x", "model": "gpt-5"}).encode(), 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "names"), BAD_BODIES)
async def test_bad_requests_get_4xx_naming_the_problem(
    start_sidecar: SidecarFactory,
    http: aiohttp.ClientSession,
    body: bytes,
    status: int,
    names: str,
) -> None:
    sidecar = await start_sidecar()
    async with http.post(f"{sidecar.http_url}/v1/completions", data=body) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
        assert names in error["message"]
        assert error["type"] and error["code"]
    async with http.get(f"{sidecar.http_url}/ready") as resp:
        assert resp.status == 200
    assert sidecar.core.outstanding == 0


async def test_oversize_body_unknown_path_and_wrong_method(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(server={"max_body_bytes": 1024})
    big = json.dumps({"prompt": "x" * 4096}).encode()
    async with http.post(f"{sidecar.http_url}/v1/completions", data=big) as resp:
        assert resp.status == 413
        assert "1024 bytes" in (await resp.json())["error"]["message"]
    async with http.get(f"{sidecar.http_url}/v2/nothing") as resp:
        assert resp.status == 404  # as vLLM's server (FastAPI) answers a path it has not
        assert await resp.json() == {"detail": "Not Found"}
    async with http.get(f"{sidecar.http_url}/load/nothing") as resp:  # a path of its own
        assert "/load/nothing" in (await resp.json())["error"]["message"]
    async with http.get(f"{sidecar.http_url}/v1/completions") as resp:
        assert resp.status == 405 and resp.headers["allow"] == "POST"
        assert await resp.json() == {"detail": "Method Not Allowed"}  # as vLLM's server
    async with http.post(f"{sidecar.http_url}/metrics") as resp:  # a path of its own
        assert resp.status == 405 and resp.headers["allow"] == "GET, HEAD"
        assert "POST" in (await resp.json())["error"]["message"]
    async with http.get(f"{sidecar.http_url}/ready") as resp:
        assert resp.status == 200


async def test_prompt_over_limit_is_413(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(server={"max_prompt_chars": 100})
    async with http.post(f"{sidecar.http_url}/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "y" * 101}]}) as resp:  # fmt: skip
        assert resp.status == 413
        assert "messages" in (await resp.json())["error"]["message"]


async def _open_stream(
    http: aiohttp.ClientSession, url: str, max_tokens: int = 10_000
) -> aiohttp.ClientResponse:
    """Start a long stream and read its first chunk, so it is surely admitted."""
    resp = await http.post(
        f"{url}/v1/completions", json={"prompt": "x", "max_tokens": max_tokens, "stream": True}
    )
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data: ")
    return resp


async def test_full_unit_answers_429_at_once(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sidecar={"capacity": 2, "retry_after_s": 3})
    held = [await _open_stream(http, sidecar.http_url) for _ in range(2)]
    assert sidecar.core.outstanding == 2
    running_before = sidecar.engine.stats().running
    async with http.post(f"{sidecar.http_url}/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 429
        assert resp.headers["retry-after"] == "3"
        assert "capacity" in (await resp.json())["error"]["message"]
    assert sidecar.engine.stats().running == running_before, "refused before any engine work"
    for resp in held:
        resp.close()
    await wait_until(lambda: sidecar.core.outstanding == 0, what="held streams released")
    async with http.post(
        f"{sidecar.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 1}
    ) as resp:
        assert resp.status == 200


async def test_client_disconnect_aborts_engine_request(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar()
    resp = await _open_stream(http, sidecar.http_url)
    assert sidecar.engine.stats().running == 1
    resp.close()  # drops the connection mid-stream
    await wait_until(lambda: sidecar.core.outstanding == 0, what="outstanding back to 0")
    await wait_until(lambda: sidecar.engine.stats().running == 0, what="engine request aborted")
    assert sidecar.engine.stats().waiting == 0


async def test_client_disconnect_of_non_streaming_request(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar()
    task = asyncio.create_task(
        http.post(f"{sidecar.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 10_000})
    )
    await wait_until(lambda: sidecar.engine.stats().running == 1, what="request running")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: sidecar.core.outstanding == 0, what="outstanding back to 0")
    await wait_until(lambda: sidecar.engine.stats().running == 0, what="engine request aborted")


async def test_deadline_before_and_during_stream(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sim={"prefill_ms_per_token": 500.0})
    headers = {"x-unitproxy-timeout-ms": "100"}
    async with http.post(f"{sidecar.http_url}/v1/completions", headers=headers,
                         json={"prompt": "x", "max_tokens": 5}) as resp:  # fmt: skip
        assert resp.status == 504
        assert (await resp.json())["error"]["type"] == "timeout_error"
    assert sidecar.core.outstanding == 0


async def test_deadline_mid_stream_ends_with_sse_error(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sim={"decode_step_ms": 20.0})
    headers = {"x-unitproxy-timeout-ms": "150"}
    async with http.post(f"{sidecar.http_url}/v1/completions", headers=headers,
                         json={"prompt": "x", "max_tokens": 1000, "stream": True}) as resp:  # fmt: skip
        assert resp.status == 200
        events = [line async for line in resp.content if line.startswith(b"data: ")]
    last = json.loads(events[-1][len(b"data: ") :])
    assert last["error"]["type"] == "timeout_error"
    assert 1 < len(events) < 1000
    assert sidecar.core.outstanding == 0


async def test_engine_error_mid_stream_is_an_sse_error_event(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sim={"error_after_tokens": 3})
    async with http.post(f"{sidecar.http_url}/v1/completions",
                         json={"prompt": "x", "max_tokens": 10, "stream": True}) as resp:  # fmt: skip
        events = [line async for line in resp.content if line.startswith(b"data: ")]
    assert len(events) == 4, "three tokens, then the error"
    assert json.loads(events[-1][6:])["error"]["type"] == "engine_error"
    assert b"[DONE]" not in b"".join(events)
    async with http.post(f"{sidecar.http_url}/v1/completions",
                         json={"prompt": "x", "max_tokens": 10}) as resp:  # fmt: skip
        assert resp.status == 500
        assert "simulated engine error" in (await resp.json())["error"]["message"]
    assert sidecar.core.outstanding == 0


async def test_crashed_engine_makes_unit_not_serving_and_503(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(
        sim={"crash_after_requests": 1}, health={"unhealthy_threshold": 1}
    )
    async with http.post(f"{sidecar.http_url}/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 503
    await wait_until(lambda: str(sidecar.health.state) == "NOT_SERVING", what="NOT_SERVING")
    async with http.post(f"{sidecar.http_url}/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 503
        assert resp.headers["retry-after"]
        assert "NOT_SERVING" in (await resp.json())["error"]["message"]
    async with http.get(f"{sidecar.http_url}/ready") as resp:
        assert resp.status == 503
        ready = await resp.json()
        assert ready["state"] == "NOT_SERVING"
        assert "engine" in ready["nodes"][0]["reason"]
    assert sidecar.core.outstanding == 0


async def test_metrics_parse_and_carry_the_named_metrics(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar()
    async with http.post(f"{sidecar.http_url}/v1/completions",
                         json={"prompt": "x", "max_tokens": 4, "stream": True}) as resp:  # fmt: skip
        await resp.read()
    async with http.post(f"{sidecar.http_url}/v1/completions", data=b"{") as resp:
        assert resp.status == 400
    async with http.get(f"{sidecar.http_url}/metrics") as resp:
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "unitproxy_requests",
        "unitproxy_outstanding_requests",
        "unitproxy_request_duration_seconds",
        "unitproxy_time_to_first_token_seconds",
        "unitproxy_inter_token_latency_seconds",
        "unitproxy_generated_tokens",
        "unitproxy_node_healthy",
        "unitproxy_unit_state",
        "unitproxy_health_probe_duration_seconds",
        "unitproxy_health_transitions",
        "unitproxy_engine_running",
        "unitproxy_engine_waiting",
        "unitproxy_engine_kv_cache_usage",
    ):
        assert name in families, name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[("unitproxy_requests_total", (("code", "200"), ("route", "completions")))] == 1
    assert samples[("unitproxy_requests_total", (("code", "400"), ("route", "completions")))] == 1
    assert samples[("unitproxy_generated_tokens_total", ())] == 4
    assert samples[("unitproxy_unit_state", (("state", "SERVING"),))] == 1
    assert samples[("unitproxy_node_healthy", (("node", "leader"), ("role", "leader")))] == 1
    assert samples[("unitproxy_outstanding_requests", ())] == 0


async def test_an_http2_preface_is_one_warning_line_not_a_traceback(
    start_sidecar: SidecarFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Some routers probe a worker's HTTP port with an HTTP/2 preface: a 400, logged once.
    sidecar = await start_sidecar()
    url = urlsplit(sidecar.http_url)
    caplog.set_level(logging.INFO, logger="aiohttp.server")
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert answer.split(b" ", 2)[1] == b"400", answer
    await wait_until(lambda: any(r.name == "aiohttp.server" for r in caplog.records), what="log")
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in records), records
    assert "400" in records[0].getMessage()


async def test_load_watch_streams_reports_as_server_sent_events(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sidecar={"report_interval_s": 0.2})
    async with http.get(f"{sidecar.http_url}/load/watch") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        reports = []
        async for line in resp.content:
            if line.startswith(b"data: "):
                reports.append(json.loads(line[6:]))
            if len(reports) == 3:
                break
    assert reports[0]["state"] == "SERVING" and reports[0]["capacity"] > 0
    seqs = [r["seq"] for r in reports]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3  # heartbeats come as new reports

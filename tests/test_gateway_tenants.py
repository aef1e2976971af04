"""Tenants at the gateway, on both wires: the key names the tenant, limits are checked
before a unit is chosen (429 rate_limited with retry-after and x-ratelimit-* headers),
tokens reserved at admission are settled to what the request used on every exit path
(finished, streamed, cancelled, migrated, failed), usage per tenant is counted and
logged. Real sidecars and gateways on loopback, the openai client, real gRPC channels."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest

from proxy.gateway.server import Gateway
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.resume import HintKey
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests.conftest import GatewayFactory, SidecarFactory, wait_until
from tests.procs import RESUME_SECRET
from tests.redisenv import NO_REDIS, REDIS_URL
from tests.test_migration import SLOW_SIM, read_events, sidecar_of

pytestmark = pytest.mark.timeout(30)

TENANTS = """
[[tenant]]
name = "alpha"
keys = ["sk-alpha"]
priority = "standard"
requests_per_minute = 3
tokens_per_minute = 100000

[[tenant]]
name = "beta"
keys = ["sk-beta"]
tokens_per_minute = 100000
max_concurrent = 1
models = ["unitproxy-sim"]

[[tenant]]
name = "open"
keys = ["sk-open"]
"""
CHAT = {"messages": [{"role": "user", "content": "tell me a story about the sea"}]}


def sample(gw: Gateway, name: str, **labels: str) -> float:
    return gw.registry.get_sample_value(name, labels) or 0.0


def tpm(gw: Gateway, tenant: str) -> float:
    """Tokens charged to ``tenant`` as the gateway counts them: this minute's window and
    the one before (a test that crosses a minute settles its requests into the window
    they were reserved in, the one before by then)."""
    assert gw.tenancy is not None
    before, now = gw.tenancy.limiter.local_counts(tenant).tpm
    return before + now


def in_flight(gw: Gateway, tenant: str) -> int:
    assert gw.tenancy is not None
    return gw.tenancy.limiter.local_counts(tenant).concurrent


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    return path


async def start(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tenants_file: Path, **kw: Any
) -> tuple[Sidecar, Gateway]:
    sidecar = await start_sidecar(sim=SLOW_SIM)
    gw = await start_gateway([sidecar], tenants_file=str(tenants_file), **kw)
    return sidecar, gw


Client = Callable[[Gateway, str], openai.AsyncOpenAI]


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    """openai clients for a gateway and a key, closed after the test."""
    made: list[openai.AsyncOpenAI] = []

    def make(gw: Gateway, key: str) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=f"{gw.http_url}/v1", api_key=key, max_retries=0)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


async def test_the_key_names_the_tenant_and_its_limit_answers_429(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    tenants_file: Path,
    caplog: pytest.LogCaptureFixture,
    client: Client,
) -> None:
    caplog.set_level(logging.INFO, logger="unitproxy.access")
    # each line a record of the unitproxy.access logger, for caplog to see
    _, gw = await start(start_sidecar, start_gateway, tenants_file, access_log="logging")
    alpha = client(gw, "sk-alpha")
    raw = await alpha.chat.completions.with_raw_response.create(
        model="unitproxy-sim", max_tokens=5, **CHAT
    )  # type: ignore[call-overload]
    assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert raw.headers["x-ratelimit-remaining-requests"] == "2"
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
    await alpha.completions.create(model="unitproxy-sim", prompt="hello", max_tokens=2)
    streamed = await alpha.completions.with_raw_response.create(
        model="unitproxy-sim", prompt="hello", max_tokens=2, stream=True
    )  # a stream's head carries them too
    assert [c async for c in streamed.parse()]
    assert streamed.headers["x-ratelimit-remaining-requests"] == "0"
    assert streamed.headers["x-ratelimit-limit-tokens"] == "100000"
    assert streamed.headers["content-type"].startswith("text/event-stream")
    with pytest.raises(openai.RateLimitError) as limited:
        await alpha.completions.create(model="unitproxy-sim", prompt="hello", max_tokens=2)
    error = limited.value
    assert error.code == "rate_limited" and "3 requests per minute" in error.message
    assert int(error.response.headers["retry-after"]) >= 1
    assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert sample(gw, "unitproxy_tenant_limited_total", tenant="alpha",
                  limit="requests_per_minute") == 1  # fmt: skip
    assert sample(gw, "unitproxy_tenant_requests_total", tenant="alpha", model="unitproxy-sim") == 3

    # a tenant without limits gets no x-ratelimit-* headers; an unknown key is 401
    raw = await client(gw, "sk-open").completions.with_raw_response.create(
        model="unitproxy-sim", prompt="hi", max_tokens=2
    )
    assert not [h for h in raw.headers if h.startswith("x-ratelimit")]
    with pytest.raises(openai.AuthenticationError):
        await client(gw, "sk-nobody").completions.create(
            model="unitproxy-sim", prompt="hi", max_tokens=2
        )

    lines = [r.getMessage() for r in caplog.records if r.name == "unitproxy.access"]
    assert any(line.startswith("tenant=alpha model=unitproxy-sim unit=") and "status=200" in line
               and "completion_tokens=5" in line for line in lines)  # fmt: skip
    assert any("tenant=alpha" in line and "status=429" in line for line in lines)
    assert not any("story" in line for line in lines), "no prompt text in the access log"


async def test_tokens_settle_to_the_units_usage_streamed_or_not(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tenants_file: Path, client: Client
) -> None:
    _, gw = await start(start_sidecar, start_gateway, tenants_file)
    beta = client(gw, "sk-beta")
    answer = await beta.chat.completions.create(model="unitproxy-sim", max_tokens=7, **CHAT)  # type: ignore[call-overload]
    assert answer.usage is not None
    assert tpm(gw, "beta") == answer.usage.total_tokens  # not the estimate
    assert sample(gw, "unitproxy_tenant_prompt_tokens_total", tenant="beta",
                  model="unitproxy-sim") == answer.usage.prompt_tokens  # fmt: skip

    # a stream without usage in it: the prompt as counted here, the output as delivered
    stream = await beta.chat.completions.create(
        model="unitproxy-sim", max_tokens=7, stream=True, **CHAT
    )  # type: ignore[call-overload]
    async for _ in stream:
        pass
    await wait_until(lambda: in_flight(gw, "beta") == 0)
    assert tpm(gw, "beta") == 2 * answer.usage.total_tokens
    assert (
        sample(gw, "unitproxy_tenant_completion_tokens_total", tenant="beta", model="unitproxy-sim")
        == 14
    )


async def test_a_stream_is_charged_the_units_usage_which_its_client_never_sees(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    tenants_file: Path,
    http: aiohttp.ClientSession,
) -> None:
    # add_generation_prompt false: the unit counts 3 prompt tokens fewer than the
    # gateway's estimate, so only the unit's own usage settles to its figure
    sidecar, gw = await start(start_sidecar, start_gateway, tenants_file)
    headers = {"Authorization": "Bearer sk-beta"}
    body = {**CHAT, "model": "unitproxy-sim", "max_tokens": 5, "add_generation_prompt": False}
    url = f"{gw.http_url}/v1/chat/completions"
    async with http.post(url, json=body, headers=headers) as resp:
        reference = (await resp.json())["usage"]
    charged = tpm(gw, "beta")
    assert charged == reference["total_tokens"]
    for options in (None, {"include_usage": True}):
        streamed = {**body, "stream": True}
        if options is not None:
            streamed["stream_options"] = options
        async with http.post(url, json=streamed, headers=headers) as resp:
            raw = await resp.read()
        async with http.post(f"{sidecar.http_url}/v1/chat/completions", json=streamed) as resp:
            direct = await resp.read()
        await wait_until(lambda: in_flight(gw, "beta") == 0)
        assert tpm(gw, "beta") == charged + reference["total_tokens"], "the unit's count"
        charged = tpm(gw, "beta")
        # what the client got is what the unit sends a client (no usage comment)
        assert b": usage" in (await _usage_stream(sidecar, streamed))
        assert b": usage" not in raw and raw.endswith(b"data: [DONE]\n\n")
        assert raw.count(b'"usage"') == direct.count(b'"usage"')
        assert (b'"usage":{' in raw) == (options is not None)
        assert raw.count(b"data:") == direct.count(b"data:")


async def test_a_whole_answer_carries_its_usage_in_a_header_for_the_gateway_alone(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    tenants_file: Path,
    http: aiohttp.ClientSession,
) -> None:
    """A unit asked for its usage puts a whole answer's in ``x-unitproxy-usage``, which
    the gateway settles to and keeps from its client; the answer's body is the same."""
    sidecar, gw = await start(start_sidecar, start_gateway, tenants_file)
    body = {**CHAT, "model": "unitproxy-sim", "max_tokens": 5, "add_generation_prompt": False}
    url = f"{sidecar.http_url}/v1/chat/completions"
    async with http.post(url, json=body, headers={"x-unitproxy-usage": "1"}) as resp:
        told, usage = resp.headers.get("x-unitproxy-usage"), (await resp.json())["usage"]
    assert told == f"{usage['prompt_tokens']} {usage['completion_tokens']}"
    async with http.post(url, json=body) as resp:
        assert "x-unitproxy-usage" not in resp.headers  # not asked: not sent
    async with http.post(f"{gw.http_url}/v1/chat/completions", json=body,
                         headers={"Authorization": "Bearer sk-beta"}) as resp:  # fmt: skip
        assert resp.status == 200 and "x-unitproxy-usage" not in resp.headers
        assert (await resp.json())["usage"] == usage
    await wait_until(lambda: in_flight(gw, "beta") == 0)
    assert tpm(gw, "beta") == usage["total_tokens"]  # the unit's count, not the estimate


async def _usage_stream(sidecar: Sidecar, body: dict[str, Any]) -> bytes:
    """A stream of ``sidecar``'s as a gateway that counts usage gets it."""
    url = f"{sidecar.http_url}/v1/chat/completions"
    headers = {"x-unitproxy-usage": "1"}
    async with aiohttp.ClientSession() as session, session.post(url, json=body,
                                                                headers=headers) as resp:  # fmt: skip
        raw = await resp.read()
    usage = [e for e in raw.split(b"\n\n") if e.startswith(b": usage ")]
    assert len(usage) == 1 and raw.endswith(usage[0] + b"\n\ndata: [DONE]\n\n")
    assert json.loads(usage[0][len(b": usage ") :])["completion_tokens"] == 5
    return raw


async def test_limits_and_allow_list_hold_before_a_unit_is_chosen(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    tenants_file: Path,
    http: aiohttp.ClientSession,
) -> None:
    sidecar, gw = await start(start_sidecar, start_gateway, tenants_file)
    headers = {"Authorization": "Bearer sk-beta"}
    body = {"model": "unitproxy-sim", "prompt": "x", "max_tokens": 2000, "stream": True}
    resp = await http.post(f"{gw.http_url}/v1/completions", json=body, headers=headers)
    await read_events(resp, 3)
    # max_concurrent 1: the second is refused while the first streams
    async with http.post(f"{gw.http_url}/v1/completions", json=body, headers=headers) as second:
        assert second.status == 429
        error = (await second.json())["error"]
        assert error["code"] == "rate_limited" and "1 requests at once" in error["message"]
        assert second.headers["retry-after"] == "1"
    async with http.post(f"{gw.http_url}/v1/completions", json={**body, "model": "other"},
                         headers=headers) as wrong:  # fmt: skip
        assert wrong.status == 403
    async with http.post(f"{gw.http_url}/v1/completions", json=body,
                         headers={**headers, "x-unitproxy-priority": "urgent"}) as bad:  # fmt: skip
        assert bad.status == 400
    assert sidecar.core.outstanding == 1, "no refused request reached the unit"

    # cancelled by its client: charged what it used, its slot freed
    resp.close()
    await wait_until(lambda: in_flight(gw, "beta") == 0, what="the slot freed")
    used = tpm(gw, "beta")
    assert 3 < used < 2000, "charged the prompt and the delivered tokens, not the estimate"


async def test_a_migrated_stream_is_charged_once_for_all_it_used(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    tenants_file: Path,
    http: aiohttp.ClientSession,
    client: Client,
) -> None:
    a = await start_sidecar(sidecar={"unit_id": "a"}, sim=SLOW_SIM)
    b = await start_sidecar(sidecar={"unit_id": "b"}, sim=SLOW_SIM)
    gw = await start_gateway([a, b], tenants_file=str(tenants_file))
    body = {**CHAT, "model": "unitproxy-sim", "max_tokens": 60, "stream": True}
    headers = {"Authorization": "Bearer sk-beta"}
    resp = await http.post(f"{gw.http_url}/v1/chat/completions", json=body, headers=headers)
    await read_events(resp, 10)
    await sidecar_of(resp, a, b).engine.stop()  # the unit fails under the request
    async for _ in resp.content:
        pass
    await wait_until(lambda: in_flight(gw, "beta") == 0)
    assert sample(gw, "unitproxy_migrations_total", reason="unit_failed") == 1
    plain = {k: v for k, v in body.items() if k != "stream"}
    reference = await client(gw, "sk-open").chat.completions.create(**plain)  # type: ignore[call-overload]
    assert reference.usage is not None
    assert tpm(gw, "beta") == reference.usage.total_tokens


async def test_a_request_no_unit_serves_is_charged_nothing(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tenants_file: Path, client: Client
) -> None:
    sidecar, gw = await start(start_sidecar, start_gateway, tenants_file)
    await sidecar.engine.stop()
    await wait_until(lambda: not gw.router.serving(), what="the unit out")
    with pytest.raises(openai.APIStatusError) as failed:
        await client(gw, "sk-beta").completions.create(
            model="unitproxy-sim", prompt="x", max_tokens=50
        )
    assert failed.value.status_code == 503
    assert failed.value.response.headers["x-ratelimit-limit-tokens"] == "100000"
    assert (tpm(gw, "beta"), in_flight(gw, "beta")) == (0, 0)


async def test_grpc_authorization_metadata_names_the_tenant(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tenants_file: Path
) -> None:
    _, gw = await start(start_sidecar, start_gateway, tenants_file)
    request = inference_pb2.GenerateRequest(
        prompt="hello there", sampling=inference_pb2.SamplingParams(max_tokens=4)
    )
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(request, metadata=(("authorization", "Bearer sk-alpha"),))
        chunks = [c async for c in call]
        trailing = dict(await call.trailing_metadata())  # with the status, as a load report
        assert trailing["x-ratelimit-limit-requests"] == "3"
        assert "x-ratelimit-limit-requests" not in dict(await call.initial_metadata())
        assert chunks[-1].usage.completion_tokens == 4
        assert tpm(gw, "alpha") == chunks[-1].usage.total_tokens
        # a call that fails after admission carries them with its error status
        unknown = inference_pb2.GenerateRequest(model="no-such-model", prompt="hi")
        failed = stub.Generate(unknown, metadata=(("authorization", "Bearer sk-alpha"),))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            _ = [c async for c in failed]
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        limits = dict(error.value.trailing_metadata() or ())
        assert limits["x-ratelimit-remaining-requests"] == "1"  # the third of 3 a minute

        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.Generate(request, metadata=(("authorization", "Bearer x"),)).read()
        assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED

        _ = [  # the third
            c
            async for c in stub.Generate(request, metadata=(("authorization", "Bearer sk-alpha"),))
        ]
        with pytest.raises(grpc.aio.AioRpcError) as limited:
            await stub.Generate(request, metadata=(("authorization", "Bearer sk-alpha"),)).read()
        assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(limited.value.trailing_metadata())
        assert trailing["x-unitproxy-code"] == "rate_limited"
        assert int(trailing["retry-after"]) >= 1
        assert trailing["x-ratelimit-remaining-requests"] == "0"
        assert trailing["x-unitproxy-unit"] == "none" and len(trailing["x-request-id"]) == 32


async def test_the_tenant_label_is_bounded(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tenants_file: Path, client: Client
) -> None:
    _, gw = await start(start_sidecar, start_gateway, tenants_file, max_tenant_labels=1)
    for key in ("sk-open", "sk-beta", "sk-alpha"):
        await client(gw, key).completions.create(model="unitproxy-sim", prompt="x", max_tokens=1)
    assert sample(gw, "unitproxy_tenant_requests_total", tenant="open", model="unitproxy-sim") == 1
    assert sample(gw, "unitproxy_tenant_requests_total", tenant="other", model="unitproxy-sim") == 2
    # every series of a tenant (kept across requests) counts under the same bounded label
    assert sample(gw, "unitproxy_tenant_wait_seconds_count", tenant="open") == 1
    assert sample(gw, "unitproxy_tenant_wait_seconds_count", tenant="other") == 2
    assert sample(gw, "unitproxy_tenant_completion_tokens_total", tenant="other",
                  model="unitproxy-sim") == 2  # fmt: skip
    assert sample(gw, "unitproxy_tenant_requests_created", tenant="other", model="unitproxy-sim")
    assert not sample(gw, "unitproxy_tenant_requests_total", tenant="beta", model="unitproxy-sim")


async def test_flat_api_keys_are_tenant_default_beside_the_file(
    start_sidecar: SidecarFactory, tenants_file: Path, client: Client
) -> None:
    sidecar = await start_sidecar()
    settings = load({
        "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "api_keys": ["sk-flat"]},
        "gateway": {"units": [f"u={sidecar.http_url},{sidecar.grpc_target}"],
                    "tenants_file": str(tenants_file)},
    })  # fmt: skip
    async with Gateway(settings) as gw:
        await wait_until(lambda: len(gw.router.serving()) == 1)
        await client(gw, "sk-flat").completions.create(
            model="unitproxy-sim", prompt="x", max_tokens=1
        )
        assert (
            sample(gw, "unitproxy_tenant_requests_total", tenant="default", model="unitproxy-sim")
            == 1
        )


async def test_two_gateways_share_a_tenants_limit_through_redis(
    start_sidecar: SidecarFactory, tmp_path: Path, client: Client
) -> None:
    from redis.asyncio import Redis

    probe = Redis.from_url(REDIS_URL)
    try:
        await probe.ping()
    except OSError:
        pytest.skip(NO_REDIS)
    cluster = f"t{uuid.uuid4().hex[:10]}"
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenant]]\nname = "shared"\nkeys = ["sk-s"]\nrequests_per_minute = 4\n')
    sidecar = await start_sidecar()
    settings = load({
        "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
        "gateway": {"units": [f"u={sidecar.http_url},{sidecar.grpc_target}"],
                    "tenants_file": str(path)},
        "redis": {"url": REDIS_URL, "cluster": cluster},
    })  # fmt: skip
    try:
        async with Gateway(settings) as one, Gateway(settings) as two:
            await wait_until(lambda: len(one.router.serving()) == len(two.router.serving()) == 1)
            for gw in (one, two, one, two):
                await client(gw, "sk-s").completions.create(
                    model="unitproxy-sim", prompt="x", max_tokens=1
                )
            with pytest.raises(openai.RateLimitError):
                await client(one, "sk-s").completions.create(
                    model="unitproxy-sim", prompt="x", max_tokens=1
                )
            assert sample(one, "unitproxy_tenant_limits_shared") == 1
    finally:
        keys = [k async for k in probe.scan_iter(match=f"unitproxy:{cluster}:*")]
        if keys:
            await probe.delete(*keys)
        await probe.aclose()


async def test_a_changed_file_takes_effect_without_a_restart(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tenants_file: Path,
    client: Client,
) -> None:  # fmt: skip
    _, gw = await start(start_sidecar, start_gateway, tenants_file, tenants_poll_s=0.05)
    assert gw.tenancy is not None
    changed = TENANTS.replace('keys = ["sk-open"]', 'keys = ["sk-new"]')
    await asyncio.to_thread(tenants_file.write_text, changed)
    source = gw.tenancy.source
    await wait_until(lambda: source.reloads == 1, what="the reload")
    await client(gw, "sk-new").completions.create(model="unitproxy-sim", prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        await client(gw, "sk-open").completions.create(
            model="unitproxy-sim", prompt="x", max_tokens=1
        )


async def test_requests_aiohttp_serves_pass_the_same_tenant_checks(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    tenants_file: Path,
    http: aiohttp.ClientSession,
) -> None:
    _, gw = await start(start_sidecar, start_gateway, tenants_file)
    url = f"{gw.http_url}/v1/completions"
    body = b'{"model": "unitproxy-sim", "prompt": "x", "max_tokens": 2}'

    async def chunked() -> AsyncIterator[bytes]:  # a chunked body: the lean path hands it on
        yield body

    headers = {"Authorization": "Bearer sk-alpha", "Content-Type": "application/json"}
    async with http.post(url, data=chunked(), headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["x-ratelimit-remaining-requests"] == "2"
    headers["Authorization"] = "Bearer sk-nobody"
    async with http.post(url, data=chunked(), headers=headers) as resp:
        assert resp.status == 401
    async with http.post(url, data=body, headers={**headers, "Expect": "100-continue"}) as resp:
        assert resp.status == 401  # refused from the head, before the body is invited
    assert sample(gw, "unitproxy_tenant_requests_total", tenant="alpha", model="unitproxy-sim") == 1


async def test_a_grpc_call_its_client_cancels_is_charged_what_it_got(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tenants_file: Path
) -> None:
    _, gw = await start(start_sidecar, start_gateway, tenants_file)
    request = inference_pb2.GenerateRequest(
        model="unitproxy-sim",
        prompt="hello there",
        sampling=inference_pb2.SamplingParams(max_tokens=5000),
    )
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(request, metadata=(("authorization", "Bearer sk-beta"),))
        got = 0
        async for chunk in call:
            got += len(chunk.token_ids)
            if got >= 5:
                break
        call.cancel()
        await wait_until(lambda: in_flight(gw, "beta") == 0, what="the slot freed")
    used = tpm(gw, "beta")
    assert got + 2 <= used < 1000, "the prompt and what was sent, not the 5,000 reserved"


PRIORITY_TENANTS = """
[[tenant]]
name = "bulk"
keys = ["sk-bulk"]
priority = "batch"

[[tenant]]
name = "chat"
keys = ["sk-chat"]
priority = "interactive"
"""


async def one_slot(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tmp_path: Path, **kw: Any
) -> Gateway:
    """A gateway with PRIORITY_TENANTS in front of one unit that takes one request at
    once, of any class (no allowance over capacity: what waits, waits in the gateway)."""
    path = tmp_path / "priority.toml"
    path.write_text(PRIORITY_TENANTS)
    sidecar = await start_sidecar(sim=SLOW_SIM, sidecar={"capacity": 1, "priority_headroom": 0})
    return await start_gateway([sidecar], tenants_file=str(path), **kw)


async def test_a_waiting_batch_request_is_shed_for_an_interactive_one(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tmp_path: Path, client: Client
) -> None:
    gw = await one_slot(start_sidecar, start_gateway, tmp_path, queue_size=1)
    bulk, chat = client(gw, "sk-bulk"), client(gw, "sk-chat")
    unit = next(iter(gw.router.units.values()))
    running = asyncio.create_task(
        bulk.completions.create(model="unitproxy-sim", prompt="a long one", max_tokens=40)
    )
    await wait_until(lambda: unit.inflight == 1, what="the unit busy")
    waiting = asyncio.create_task(
        bulk.completions.create(model="unitproxy-sim", prompt="next", max_tokens=2)
    )
    await wait_until(lambda: gw.router.waiting == 1, what="a batch request waiting")
    answer = await chat.completions.create(model="unitproxy-sim", prompt="hi", max_tokens=2)
    assert answer.usage is not None and answer.usage.completion_tokens == 2
    with pytest.raises(openai.RateLimitError) as shed:
        await waiting
    assert shed.value.code == "shed"
    finished = await running  # the request the unit had first is never cut
    assert finished.usage is not None and finished.usage.completion_tokens == 40
    assert gw.router.waiting == 0


async def test_grpc_and_http_requests_wait_in_their_tenants_class(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tmp_path: Path, client: Client
) -> None:
    gw = await one_slot(start_sidecar, start_gateway, tmp_path)
    unit = next(iter(gw.router.units.values()))
    done: list[str] = []

    async def http(key: str, name: str, max_tokens: int, lower: str | None = None) -> None:
        headers = {"x-unitproxy-priority": lower} if lower else {}
        await client(gw, key).completions.create(
            model="unitproxy-sim", prompt=name, max_tokens=max_tokens, extra_headers=headers
        )
        done.append(name)

    async def grpc_call(key: str, name: str) -> None:
        request = inference_pb2.GenerateRequest(
            model="unitproxy-sim", prompt=name, sampling=inference_pb2.SamplingParams(max_tokens=2)
        )
        async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            _ = [c async for c in stub.Generate(request, metadata=(("authorization", key),))]
        done.append(name)

    first = asyncio.create_task(http("sk-bulk", "first", 40))
    await wait_until(lambda: unit.inflight == 1, what="the unit busy")
    later = [asyncio.create_task(http("sk-bulk", "bulk", 2))]
    await wait_until(lambda: gw.router.waiting == 1, what="bulk waiting")
    later.append(asyncio.create_task(http("sk-chat", "chat lowered", 2, lower="batch")))
    await wait_until(lambda: gw.router.waiting == 2, what="the lowered one waiting")
    later.append(asyncio.create_task(grpc_call("Bearer sk-chat", "chat grpc")))
    await wait_until(lambda: gw.router.waiting == 3, what="the gRPC call waiting")
    await asyncio.gather(first, *later)
    # interactive first, whatever the wire; the lowered one is batch: after bulk, which
    # came first and has been served no more than it
    assert done == ["first", "chat grpc", "bulk", "chat lowered"]


async def test_the_class_reaches_the_engine_where_interactive_takes_a_batch_slot(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tmp_path: Path, client: Client
) -> None:
    # A unit sent more than its engine runs at once (capacity 2 over 1 slot): inside it,
    # the engine's priority decides, as the gateway's class says.
    path = tmp_path / "priority.toml"
    path.write_text(PRIORITY_TENANTS)
    sidecar = await start_sidecar(sim={**SLOW_SIM, "max_num_seqs": 1}, sidecar={"capacity": 2})
    gw = await start_gateway([sidecar], tenants_file=str(path))
    engine: Any = sidecar.engine
    stream = await client(gw, "sk-bulk").completions.create(
        model="unitproxy-sim", prompt="a long one", max_tokens=200, stream=True
    )
    text = [(await anext(aiter(stream))).choices[0].text]
    answer = await client(gw, "sk-chat").completions.create(
        model="unitproxy-sim", prompt="hi", max_tokens=3
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    assert engine.preemptions == 1, "the batch stream gave its slot to the interactive one"
    async for chunk in stream:
        text.append(chunk.choices[0].text if chunk.choices else "")
    alone = await client(gw, "sk-bulk").completions.create(
        model="unitproxy-sim", prompt="a long one", max_tokens=200
    )
    assert "".join(text) == alone.choices[0].text, "paused and resumed, never cut"


async def test_a_sidecar_trusts_a_priority_header_only_downwards(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(sim={**SLOW_SIM, "max_num_seqs": 1}, sidecar={"capacity": 2})
    engine: Any = sidecar.engine
    url = f"{sidecar.http_url}/v1/completions"

    async def send(priority: str | None, max_tokens: int) -> None:
        headers = {"x-unitproxy-priority": priority} if priority else {}
        body = {"model": "unitproxy-sim", "prompt": "p", "max_tokens": max_tokens}
        async with http.post(url, json=body, headers=headers) as resp:
            assert resp.status == 200

    standard = asyncio.create_task(send(None, 30))
    await wait_until(lambda: engine.stats().running == 1, what="the standard one running")
    await send("interactive", 2)  # a client's claim: no more than standard, so it waits
    assert engine.preemptions == 0
    await standard
    batch = asyncio.create_task(send("batch", 30))
    await wait_until(lambda: engine.stats().running == 1, what="the batch one running")
    await send(None, 2)
    assert engine.preemptions == 1, "standard goes before a request that said batch"
    await batch


async def test_a_sidecar_takes_interactive_over_capacity_only_signed_by_a_gateway(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    # One slot, capacity 1 (the slots), an allowance of 1 over it for a higher class.
    sidecar = await start_sidecar(sim={**SLOW_SIM, "max_num_seqs": 1})
    engine: Any = sidecar.engine
    key = HintKey(RESUME_SECRET)
    url = f"{sidecar.http_url}/v1/completions"

    async def send(headers: dict[str, str], max_tokens: int) -> tuple[int, Any]:
        body = {"model": "unitproxy-sim", "prompt": "p", "max_tokens": max_tokens}
        async with http.post(url, json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    standard = asyncio.create_task(send({}, 30))
    await wait_until(lambda: engine.stats().running == 1, what="the standard one running")
    status, body = await send({"x-unitproxy-priority": "interactive"}, 2)
    assert (status, body["error"]["code"]) == (429, "unit_at_capacity"), "a client's claim"
    forged = {"x-unitproxy-priority": "interactive", "x-request-id": "r1",
              "x-unitproxy-priority-sig": key.sign_priority("r2", "interactive")}  # fmt: skip
    assert (await send(forged, 2))[0] == 429, "a signature for another request"
    signed = {"x-unitproxy-priority": "interactive", "x-request-id": "r1",
              "x-unitproxy-priority-sig": key.sign_priority("r1", "interactive")}  # fmt: skip
    status, body = await send(signed, 2)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert engine.preemptions == 1, "it took the standard request's slot"
    status, body = await standard
    assert status == 200 and body["usage"]["completion_tokens"] == 30, "paused, not failed"

    # gRPC: the same metadata
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        def call(max_tokens: int, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
            request = inference_pb2.GenerateRequest(
                model="unitproxy-sim", prompt="p",
                sampling=inference_pb2.SamplingParams(max_tokens=max_tokens),
            )  # fmt: skip
            return stub.Generate(request, metadata=metadata)

        async def collect(stream: Any) -> int:
            return sum(len(c.token_ids) for c in [c async for c in stream])

        running = asyncio.create_task(collect(call(30)))  # standard
        await wait_until(lambda: engine.stats().running == 1, what="the standard one running")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(call(2, (("x-unitproxy-priority", "interactive"),)))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        sig = key.sign_priority("g1", "interactive")
        meta = (("x-unitproxy-priority", "interactive"), ("x-request-id", "g1"),
                ("x-unitproxy-priority-sig", sig))  # fmt: skip
        assert await collect(call(2, meta)) == 2
        assert engine.preemptions == 2
        assert await running == 30


async def test_interactive_goes_over_a_full_unit_and_the_batch_stream_resumes(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tmp_path: Path, client: Client
) -> None:
    # The unit runs one request at once and admits one (its capacity is its slot): the
    # gateway sends an interactive request over it, by the unit's allowance, on both
    # wires; the batch stream it preempts pauses and resumes, whole.
    path = tmp_path / "priority.toml"
    path.write_text(PRIORITY_TENANTS)
    sidecar = await start_sidecar(sim={**SLOW_SIM, "max_num_seqs": 1})
    gw = await start_gateway([sidecar], tenants_file=str(path))
    engine: Any = sidecar.engine
    unit = next(iter(gw.router.units.values()))
    await wait_until(lambda: unit.capacity == 1, what="the unit's report")
    stream = await client(gw, "sk-bulk").completions.create(
        model="unitproxy-sim", prompt="a long one", max_tokens=300, stream=True
    )
    text = [(await anext(aiter(stream))).choices[0].text]
    answer = await asyncio.wait_for(
        client(gw, "sk-chat").completions.create(model="unitproxy-sim", prompt="hi", max_tokens=3),
        1.0,  # the batch stream takes 1.5 s: the answer does not wait for it
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    assert engine.preemptions == 1
    request = inference_pb2.GenerateRequest(
        model="unitproxy-sim", prompt="hi", sampling=inference_pb2.SamplingParams(max_tokens=3)
    )
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(request, metadata=(("authorization", "Bearer sk-chat"),))
        chunks = await asyncio.wait_for(_all(call), 1.0)
    assert sum(len(c.token_ids) for c in chunks) == 3
    assert engine.preemptions == 2
    # a batch request meanwhile waits in the gateway: batch outranks nothing
    waiting = asyncio.create_task(
        client(gw, "sk-bulk").completions.create(model="unitproxy-sim", prompt="x", max_tokens=2)
    )
    await wait_until(lambda: gw.router.waiting == 1, what="the batch request waiting")
    async for chunk in stream:
        text.append(chunk.choices[0].text if chunk.choices else "")
    assert (await waiting).usage is not None
    alone = await client(gw, "sk-bulk").completions.create(
        model="unitproxy-sim", prompt="a long one", max_tokens=300
    )
    assert "".join(text) == alone.choices[0].text, "paused twice and resumed, never cut"


async def _all(call: Any) -> list[Any]:
    return [c async for c in call]


async def test_a_gateway_signs_interactive_so_that_it_outranks_standard_work(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tmp_path: Path, client: Client
) -> None:
    # Standard work fills the unit: only a class the unit grants as interactive, which
    # takes the gateway's signature, goes over it, on both wires.
    path = tmp_path / "priority.toml"
    path.write_text(PRIORITY_TENANTS + '\n[[tenant]]\nname = "std"\nkeys = ["sk-std"]\n')
    sidecar = await start_sidecar(sim={**SLOW_SIM, "max_num_seqs": 1})
    gw = await start_gateway([sidecar], tenants_file=str(path))
    engine: Any = sidecar.engine
    unit = next(iter(gw.router.units.values()))
    await wait_until(lambda: unit.capacity == 1, what="the unit's report")
    stream = await client(gw, "sk-std").completions.create(
        model="unitproxy-sim", prompt="a long one", max_tokens=300, stream=True
    )
    text = [(await anext(aiter(stream))).choices[0].text]
    answer = await asyncio.wait_for(
        client(gw, "sk-chat").completions.create(model="unitproxy-sim", prompt="hi", max_tokens=3),
        1.0,
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    request = inference_pb2.GenerateRequest(
        model="unitproxy-sim", prompt="hi", sampling=inference_pb2.SamplingParams(max_tokens=3)
    )
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(request, metadata=(("authorization", "Bearer sk-chat"),))
        assert sum(len(c.token_ids) for c in await asyncio.wait_for(_all(call), 1.0)) == 3
    assert engine.preemptions == 2, "each took the standard stream's slot"
    async for chunk in stream:
        text.append(chunk.choices[0].text if chunk.choices else "")
    assert len("".join(text)) > 0 and stream.response.status_code == 200


async def test_interactive_waits_in_the_gateway_for_a_unit_that_cannot_grant_it(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, tmp_path: Path, client: Client
) -> None:
    # The unit has no server.resume_secret: it grants interactive as standard, which
    # does not outrank the standard stream it runs, so the gateway keeps the request in
    # its queue (no 429 from the unit) until the slot frees.
    path = tmp_path / "priority.toml"
    path.write_text(PRIORITY_TENANTS + '\n[[tenant]]\nname = "std"\nkeys = ["sk-std"]\n')
    sidecar = await start_sidecar(
        sim={**SLOW_SIM, "max_num_seqs": 1}, server={"resume_secret": None}
    )
    gw = await start_gateway([sidecar], tenants_file=str(path))
    engine: Any = sidecar.engine
    unit = next(iter(gw.router.units.values()))
    await wait_until(lambda: unit.capacity == 1, what="the unit's report")
    running = asyncio.create_task(
        client(gw, "sk-std").completions.create(
            model="unitproxy-sim", prompt="a long one", max_tokens=60
        )
    )
    await wait_until(lambda: unit.inflight == 1, what="the unit busy")
    answer = await client(gw, "sk-chat").completions.create(
        model="unitproxy-sim", prompt="hi", max_tokens=3
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    assert running.done(), "it waited for the standard request's slot"
    assert engine.preemptions == 0
    assert sample(gw, "unitproxy_retries_total", reason="429") == 0


async def test_an_audio_form_is_admitted_by_its_model_field(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    tenants_file: Path,
    http: aiohttp.ClientSession,
) -> None:
    _, gw = await start(start_sidecar, start_gateway, tenants_file)
    url = f"{gw.http_url}/v1/audio/transcriptions"
    statuses = []
    for key, model in (("sk-beta", "unitproxy-sim"), ("sk-beta", "other"),
                       ("sk-alpha", "unitproxy-sim")):  # fmt: skip
        form = aiohttp.FormData()
        form.add_field("model", model)
        form.add_field("file", b"RIFF", filename="a.wav")
        headers = {"Authorization": f"Bearer {key}"}
        async with http.post(url, data=form, headers=headers) as resp:
            statuses.append(resp.status)
            if resp.status == 400:  # the unit's: the simulator has no transcription model
                assert resp.headers["x-unitproxy-unit"] != "none"
    # beta's allow list holds for a form's model as for a JSON body's
    assert statuses == [400, 403, 400]
    await wait_until(lambda: in_flight(gw, "beta") == 0, what="its slot freed")
    assert sample(gw, "unitproxy_tenant_requests_total", tenant="alpha", model="unitproxy-sim") == 1


async def test_a_stored_response_is_retrieved_by_its_tenant_streamed_or_not(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    tenants_file: Path,
    http: aiohttp.ClientSession,
) -> None:
    _, gw = await start(start_sidecar, start_gateway, tenants_file)
    headers = {"Authorization": "Bearer sk-beta"}  # a tenant with an allow list
    body = {"model": "unitproxy-sim", "input": "hi", "max_output_tokens": 3,
            "background": True, "stream": True}  # fmt: skip
    async with http.post(f"{gw.http_url}/v1/responses", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        made = await resp.text()
    rid = json.loads(made.split("data: ", 2)[1].split("\n")[0])["response"]["id"]
    for query in ("", "?stream=true"):
        async with http.get(f"{gw.http_url}/v1/responses/{rid}{query}", headers=headers) as r:
            assert r.status == 200, await r.text()
            got = await r.text()
        assert got == made if query else json.loads(got)["id"] == rid
    async with http.get(f"{gw.http_url}/v1/responses/{rid}") as resp:
        assert resp.status == 401, "the tenants' keys hold for it"

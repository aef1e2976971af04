"""Resume hints: a request continued on a unit with its delivered output appended gets
exactly the rest of the unfailed response, one id, one created, usage as one request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import openai
import pytest

from proxy.httputil import RESUME_HEADER
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.resume import HintKey, ResumeHint
from proxy.sidecar.server import Sidecar
from tests.conftest import SidecarFactory, signed_hint

pytestmark = pytest.mark.timeout(20)

N = 24  # tokens of the unfailed response
K = 10  # of which the first K were delivered before the unit failed
PROMPT = "Write about the history of the river town"
CREATED = 1_700_000_123  # what the client saw: the resumed response must say the same
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Tell me a story about the city."},
]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def hint(delivered: str, created: int | None = None) -> dict[str, str]:
    return {RESUME_HEADER: signed_hint(delivered, created)}


@dataclass
class Response:
    id: str
    created: int
    pieces: list[str]  # per chunk
    usage: dict[str, int]
    finish_reason: str | None
    role_chunks: int = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@pytest.fixture
async def sidecar(start_sidecar: SidecarFactory) -> Sidecar:
    return await start_sidecar(sim={"decode_step_ms": 0.2})


@pytest.fixture
async def client(sidecar: Sidecar) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{sidecar.http_url}/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


async def completion(
    client: openai.AsyncOpenAI, prompt: str, stream: bool, headers: dict[str, str]
) -> Response:
    headers = {"x-request-id": "req-7", **headers}
    args: dict[str, Any] = {"model": "unitproxy-sim", "prompt": prompt, "max_tokens": N, "seed": 5}
    if not stream:
        r = await client.completions.create(**args, extra_headers=headers)
        assert r.usage is not None
        usage = r.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
        return Response(r.id, r.created, [r.choices[0].text], usage, r.choices[0].finish_reason)
    chunks = await client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}, extra_headers=headers
    )
    out = Response("", 0, [], {}, None)
    async for c in chunks:
        out.id, out.created = c.id, c.created
        if c.usage is not None:
            out.usage = c.usage.model_dump(
                include={"prompt_tokens", "completion_tokens", "total_tokens"}
            )
        for choice in c.choices:
            out.pieces.append(choice.text)
            out.finish_reason = choice.finish_reason or out.finish_reason
    return out


async def chat(
    client: openai.AsyncOpenAI,
    messages: list[dict[str, Any]],
    stream: bool,
    headers: dict[str, str],
    body: dict[str, Any],
) -> Response:
    headers = {"x-request-id": "req-8", **headers}
    args: dict[str, Any] = {
        "model": "unitproxy-sim",
        "messages": messages,
        "max_completion_tokens": N,
        "extra_body": body,
        "extra_headers": headers,
    }
    if not stream:
        r = await client.chat.completions.create(**args)
        assert r.usage is not None
        usage = r.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
        text = r.choices[0].message.content or ""
        return Response(r.id, r.created, [text], usage, r.choices[0].finish_reason)
    chunks = await client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    out = Response("", 0, [], {}, None)
    async for c in chunks:
        out.id, out.created = c.id, c.created
        if c.usage is not None:
            out.usage = c.usage.model_dump(
                include={"prompt_tokens", "completion_tokens", "total_tokens"}
            )
        for choice in c.choices:
            out.role_chunks += choice.delta.role is not None
            if choice.delta.content:
                out.pieces.append(choice.delta.content)
            out.finish_reason = choice.finish_reason or out.finish_reason
    return out


def assert_rest(whole: Response, rest: Response, delivered: str) -> None:
    assert whole.text.startswith(delivered)
    assert rest.text == whole.text[len(delivered) :], "the rest, no seam"
    assert rest.usage == whole.usage, "usage as one request"
    assert rest.id == whole.id
    assert rest.created == CREATED
    assert rest.finish_reason == whole.finish_reason == "length"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_completion_resumes_where_it_stopped(
    client: openai.AsyncOpenAI, stream: bool
) -> None:
    whole = await completion(client, PROMPT, True, {})
    assert len(whole.pieces) == N and whole.usage["completion_tokens"] == N
    delivered = "".join(whole.pieces[:K])
    rest = await completion(
        client,
        PROMPT + delivered,
        stream,
        hint(delivered, CREATED),
    )
    assert_rest(whole, rest, delivered)
    if stream:
        assert rest.pieces == whole.pieces[K:], "token for token"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_chat_resumes_its_final_assistant_message(
    client: openai.AsyncOpenAI, stream: bool
) -> None:
    whole = await chat(client, MESSAGES, True, {}, {})
    assert whole.role_chunks == 1
    delivered = "".join(whole.pieces[:K])
    partial = [*MESSAGES, {"role": "assistant", "content": delivered}]
    headers = hint(delivered, CREATED)
    rest = await chat(client, partial, stream, headers, CONTINUE)
    assert_rest(whole, rest, delivered)
    if stream:
        assert rest.pieces == whole.pieces[K:], "token for token"
        assert rest.role_chunks == 0, "the client has the role chunk already"


async def test_output_used_up_ends_at_once(client: openai.AsyncOpenAI) -> None:
    whole = await completion(client, PROMPT, True, {})
    rest = await completion(client, PROMPT + whole.text, True, hint(whole.text, CREATED))
    assert rest.text == ""
    assert (rest.finish_reason, rest.usage) == ("length", whole.usage)


async def test_without_a_hint_the_same_body_is_a_new_request(client: openai.AsyncOpenAI) -> None:
    whole = await completion(client, PROMPT, True, {})
    delivered = "".join(whole.pieces[:K])
    fresh = await completion(client, PROMPT + delivered, True, {})
    # The text goes on the same way (it is a function of the context) but nothing is
    # counted as delivered: max_tokens and usage are this request's own.
    assert fresh.text.startswith(whole.text[len(delivered) :])
    assert fresh.usage["completion_tokens"] == N
    assert fresh.usage["prompt_tokens"] == whole.usage["prompt_tokens"] + K


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"delivered_chars": -1}', "whole number"),
        ('{"delivered_chars": true}', "whole number"),
        ('{"created": 1}', "exactly one"),
        ('{"delivered_chars": 100000}', "more than the input has"),
        ('{"delivered_tokens": 3}', "prompt of token ids"),
    ],
)
async def test_bad_hint_is_400_naming_the_header(
    sidecar: Sidecar, http: aiohttp.ClientSession, value: str, problem: str
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3}
    async with http.post(
        f"{sidecar.http_url}/v1/completions", json=body, headers={RESUME_HEADER: value}
    ) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == RESUME_HEADER
    assert RESUME_HEADER in error["message"] and problem in error["message"]
    assert sidecar.core.outstanding == 0


async def test_chat_hint_needs_a_continued_assistant_message(
    sidecar: Sidecar, http: aiohttp.ClientSession
) -> None:
    partial = [*MESSAGES, {"role": "assistant", "content": " the"}]
    url = f"{sidecar.http_url}/v1/chat/completions"
    for body in ({"messages": partial}, {"messages": MESSAGES, **CONTINUE}):
        async with http.post(url, json=body, headers=hint(" the")) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == RESUME_HEADER
    both = {"messages": partial, "continue_final_message": True}
    async with http.post(url, json=both) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "continue_final_message"


# -- gRPC ------------------------------------------------------------------------------


@dataclass
class Generated:
    text: str
    token_ids: list[int]
    usage: tuple[int, int, int]
    request_ids: set[str]


async def generate(
    stub: inference_pb2_grpc.InferenceStub,
    request: inference_pb2.GenerateRequest,
    metadata: tuple[tuple[str, str], ...] = (),
    max_tokens: int = N,
) -> Generated:
    request.request_id = "g-9"
    request.sampling.max_tokens = max_tokens
    chunks = [c async for c in stub.Generate(request, metadata=metadata, timeout=10)]
    usage = chunks[-1].usage
    return Generated(
        "".join(c.text for c in chunks),
        [t for c in chunks for t in c.token_ids],
        (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens),
        {c.request_id for c in chunks},
    )


def grpc_hint(delivered: str | list[int]) -> tuple[tuple[str, str], ...]:
    return ((RESUME_HEADER, signed_hint(delivered)),)


async def test_grpc_resumes_text_ids_and_chat(sidecar: Sidecar) -> None:
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        whole = await generate(stub, inference_pb2.GenerateRequest(prompt=PROMPT))
        delivered = await generate(stub, inference_pb2.GenerateRequest(prompt=PROMPT), max_tokens=K)
        assert whole.text.startswith(delivered.text)
        rest = await generate(
            stub,
            inference_pb2.GenerateRequest(prompt=PROMPT + delivered.text),
            grpc_hint(delivered.text),
        )
        assert rest.token_ids == whole.token_ids[K:]
        assert rest.text == whole.text[len(delivered.text) :]
        assert rest.usage == whole.usage and rest.request_ids == {"g-9"}

        ids = [17, 4, 99, 250, 3]
        whole = await generate(stub, prompt_ids(ids))
        rest = await generate(
            stub, prompt_ids(ids + whole.token_ids[:K]), grpc_hint(whole.token_ids[:K])
        )
        assert rest.token_ids == whole.token_ids[K:]
        assert rest.usage == whole.usage == (5, N, 5 + N)

        messages = [inference_pb2.ChatMessage(**m) for m in MESSAGES]
        whole = await generate(
            stub, inference_pb2.GenerateRequest(chat=inference_pb2.ChatMessages(messages=messages))
        )
        partial = "".join(" " + word for word in whole.text.split(" ")[1 : K + 1])
        continued = inference_pb2.ChatMessages(
            messages=[*messages, inference_pb2.ChatMessage(role="assistant", content=partial)],
            continue_final_message=True,
        )
        rest = await generate(
            stub,
            inference_pb2.GenerateRequest(chat=continued),
            grpc_hint(partial),
        )
        assert rest.token_ids == whole.token_ids[K:]
        assert rest.usage == whole.usage

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, prompt_ids(ids), grpc_hint([0] * 6))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert RESUME_HEADER in (info.value.details() or "")
    assert sidecar.core.outstanding == 0


def prompt_ids(ids: list[int]) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.PromptTokenIds(ids=ids))


# -- only a gateway gives hints --------------------------------------------------------


def forged(kind: str, delivered: str) -> str:
    """A hint a client could make, holding no resume secret."""
    if kind == "unsigned":
        return json.dumps({"created": CREATED, "delivered_chars": len(delivered)})
    if kind == "another secret":
        return HintKey("not-the-fleet-secret").sign(ResumeHint(CREATED, len(delivered)), delivered)
    if kind == "other output":  # a real signature, for other text of the same length
        return signed_hint(delivered[:-1] + "?", CREATED)
    # A real signature with its count raised: more of the prompt called output.
    raw = json.loads(signed_hint(delivered, CREATED))
    raw["delivered_chars"] += len(PROMPT)
    return json.dumps(raw)


@pytest.mark.parametrize("kind", ["unsigned", "another secret", "other output", "count raised"])
async def test_a_hint_not_signed_by_a_gateway_is_refused(
    sidecar: Sidecar, client: openai.AsyncOpenAI, http: aiohttp.ClientSession, kind: str
) -> None:
    whole = await completion(client, PROMPT, True, {})
    delivered = "".join(whole.pieces[:K])
    body = {"prompt": PROMPT + delivered, "max_tokens": N, "stream": True}
    headers = {RESUME_HEADER: forged(kind, delivered)}
    async with http.post(f"{sidecar.http_url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 403
        error = (await resp.json())["error"]
    assert error["code"] == "resume_forbidden" and RESUME_HEADER in error["message"]
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(prompt=PROMPT + delivered)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(stub, request, ((RESUME_HEADER, forged(kind, delivered)),))
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert sidecar.core.outstanding == 0
    # The gateway's own hint for the same request is taken: usage as one request.
    rest = await completion(client, PROMPT + delivered, True, hint(delivered, CREATED))
    assert_rest(whole, rest, delivered)


async def test_a_sidecar_without_a_resume_secret_takes_no_hint(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession
) -> None:
    lone = await start_sidecar(server={"resume_secret": None})
    body = {"prompt": PROMPT + " the", "max_tokens": N}
    headers = {RESUME_HEADER: signed_hint(" the", CREATED)}
    async with http.post(f"{lone.http_url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 403
        error = (await resp.json())["error"]
    assert error["code"] == "resume_forbidden" and "resume_secret" in error["message"]
    async with http.post(f"{lone.http_url}/v1/completions", json=body) as resp:
        assert resp.status == 200  # the same request without the hint: a new one
        usage = (await resp.json())["usage"]
    assert usage["completion_tokens"] == N

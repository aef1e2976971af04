"""Fields the simulator cannot honour answer 400 naming the field, never 200 without them.

With the real `openai` SDK against a sim sidecar, as a new user would try them.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.conftest import SidecarFactory

pytestmark = pytest.mark.timeout(30)

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
]
CHAT: list[tuple[str, dict[str, Any]]] = [
    ("tools", {"tools": TOOLS}),
    ("tools", {"tools": TOOLS, "tool_choice": "required"}),
    ("tool_choice", {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    (
        "response_format",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}},
    ),
    ("logprobs", {"logprobs": True}),
    ("top_logprobs", {"top_logprobs": 2}),
    ("n", {"n": 2}),
    ("structured_outputs", {"extra_body": {"structured_outputs": {"json": {}}}}),
    ("guided_json", {"extra_body": {"guided_json": {}}}),
]
COMPLETIONS: list[tuple[str, dict[str, Any]]] = [
    ("logprobs", {"logprobs": 2}),
    ("echo", {"echo": True}),
    ("best_of", {"best_of": 2}),
    ("n", {"n": 2}),
    ("response_format", {"extra_body": {"response_format": {"type": "json_object"}}}),
]


@pytest.fixture
async def client(start_sidecar: SidecarFactory) -> openai.AsyncOpenAI:
    sidecar = await start_sidecar()
    return openai.AsyncOpenAI(base_url=f"{sidecar.http_url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize(("field", "kwargs"), CHAT)
async def test_chat_fields_the_sim_cannot_honour(
    client: openai.AsyncOpenAI, field: str, kwargs: dict[str, Any]
) -> None:
    async with client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="unitproxy-sim", messages=[{"role": "user", "content": "hi"}], **kwargs
            )
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == field
    assert error["message"].startswith(f"{field}: ") and "supported" in error["message"]


@pytest.mark.parametrize(("field", "kwargs"), COMPLETIONS)
async def test_completion_fields_the_sim_cannot_honour(
    client: openai.AsyncOpenAI, field: str, kwargs: dict[str, Any]
) -> None:
    async with client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="unitproxy-sim", prompt="hi", **kwargs)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == field


async def test_off_values_are_served(client: openai.AsyncOpenAI) -> None:
    async with client:
        answer = await client.chat.completions.create(
            model="unitproxy-sim",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            logprobs=False,
            n=1,
            tool_choice="none",
            response_format={"type": "text"},
        )
    assert answer.choices[0].message.content


async def test_continuous_usage_stats_is_honoured(client: openai.AsyncOpenAI) -> None:
    async with client:
        stream = await client.chat.completions.create(
            model="unitproxy-sim",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
        chunks = [c async for c in stream]
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage]
    assert counts == [1, 2, 3], "usage in every token chunk"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3

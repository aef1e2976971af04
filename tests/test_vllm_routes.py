"""Every route of vLLM's server, through the gateway, as vLLM's own server answers it.

Differential: the tiny Llama served by ``python -m vllm.entrypoints.openai.api_server``
twice (as a generation model, and as a pooling model with ``--runner pooling --convert
embed``) and by two sidecars with the engine embedded (the same engine arguments),
both behind one gateway that routes by the request's model. The same requests at
temperature 0 go to vLLM and to the gateway; for every route the (status, content type,
body) must be the same but for ids and timestamps (and floats past 4 decimals). Needs a
vLLM build (marked ``vllm``); one model load per server.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import langchain_openai
import openai
import pytest
import pytest_asyncio

from proxy.gateway.server import Gateway
from proxy.load import UnitState
from proxy.response_ids import unit_of
from proxy.settings import load
from proxy.sidecar.server import Sidecar
from tests import test_engine_openai_vllm, test_engine_vllm
from tests.conftest import sidecar_settings, wait_until
from tests.test_engine_vllm import MODEL_NAME, VLLM_TEST_TIMEOUT_S, needs_vllm
from tests.test_engine_vllm import vllm_engine_settings as generation_settings

tiny_model = test_engine_vllm.tiny_model  # the fixtures, shared
vllm_env = test_engine_vllm.vllm_env
POOL_NAME = "tiny-llama-embed"
POOLING_ARGS = {"runner": "pooling", "convert": "embed"}
# What differs by nature between two servers: made fresh per request, or a clock.
VOLATILE = frozenset({"id", "created", "created_at", "completed_at", "response_id", "item_id"})

# The first test pays for four engines' start (two vLLM servers, two sidecars).
ROUTE_MARKS = [m for m in needs_vllm if m.name != "timeout"]
ROUTE_MARKS.append(pytest.mark.timeout(5 * VLLM_TEST_TIMEOUT_S))


def with_vllm(test: Any) -> Any:
    for mark in reversed(ROUTE_MARKS):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def responses_store() -> Iterator[None]:
    """vLLM stores responses only with VLLM_ENABLE_RESPONSES_API_STORE=1 (else retrieve
    and previous_response_id are 404): on for vLLM's server and the sidecars alike."""
    envs = importlib.import_module("vllm.envs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
        if getattr(envs, "_is_envs_cache_enabled", lambda: False)():
            envs.disable_envs_cache()  # cached by an engine started earlier in this process
        yield


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_generate(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, responses_store: None
) -> AsyncIterator[str]:
    async with test_engine_openai_vllm.started_vllm_serve(tiny_model, tmp_path_factory) as url:
        yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_pooling(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    extra = ["--served-model-name", POOL_NAME, "--runner", "pooling", "--convert", "embed"]
    async with test_engine_openai_vllm.started_vllm_serve(
        tiny_model, tmp_path_factory, *extra
    ) as url:
        yield url


def pooling_settings(model: Path) -> dict[str, Any]:
    settings = generation_settings(model)
    engine_args = {**settings["engine_args"], **POOLING_ARGS}
    return {**settings, "served_model_name": POOL_NAME, "engine_args": engine_args}


async def _sidecar(engine: dict[str, Any], unit_id: str) -> Sidecar:
    settings = sidecar_settings(
        engine=engine, sidecar={"unit_id": unit_id}, health={"stall_timeout_s": 30.0}
    )
    return Sidecar(settings)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sidecars(
    tiny_model: Path, vllm_env: None, responses_store: None
) -> AsyncIterator[tuple[Sidecar, Sidecar]]:
    """A generation unit and a pooling unit, each with its engine embedded."""
    gen = await _sidecar(generation_settings(tiny_model), "unit-gen")
    pool = await _sidecar(pooling_settings(tiny_model), "unit-pool")
    async with gen, pool:
        async with asyncio.timeout(2 * VLLM_TEST_TIMEOUT_S):
            while not all(s.health.state is UnitState.SERVING for s in (gen, pool)):
                await asyncio.sleep(0.05)
        yield gen, pool


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(sidecars: tuple[Sidecar, Sidecar]) -> AsyncIterator[str]:
    gen, pool = sidecars
    units = [f"unit-gen={gen.http_url},{gen.grpc_target}"]
    units.append(f"unit-pool={pool.http_url},{pool.grpc_target}")
    settings = load(
        {
            "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
            "gateway": {"units": units},
        }
    )
    async with Gateway(settings) as gw:
        await wait_until(lambda: len(gw.router.serving()) == 2, 10, "gateway sees both units")
        yield gw.http_url


# -- what is compared -------------------------------------------------------------------


def normal(value: Any) -> Any:
    """A body without what differs by nature: ids and times as a mark, floats rounded."""
    if isinstance(value, dict):
        return {k: ("<volatile>" if k in VOLATILE else normal(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [normal(v) for v in value]
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, str) and value.startswith(("resp_", "msg_", "rs_")):
        return "<volatile>"
    return value


def events(text: str) -> list[tuple[str | None, Any]]:
    """An SSE body as (event name, data) pairs, the data parsed where it is JSON."""
    out: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name = None
        data = ""
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
        out.append((name, data if data == "[DONE]" else normal(json.loads(data))))
    return out


def stream(text: str) -> dict[str, Any]:
    """A stream as what is the same at temperature 0 whatever its chunking: vLLM sends
    the tokens that are ready when the reader asks, one or several a chunk, so the two
    servers' boundaries differ; the text, the first and last events and the kinds of
    event in between do not."""
    got = events(text)
    texts: dict[Any, str] = {}
    kinds: list[Any] = []
    for name, data in got:
        kind = name or (data if data == "[DONE]" else data.get("object"))
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
        if name is not None:  # the Responses API's events
            if name.endswith(".delta"):
                texts[name] = texts.get(name, "") + str(data.get("delta", ""))
            continue
        for choice in data.get("choices", []) if isinstance(data, dict) else []:
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    last = got[-2] if got[-1][1] == "[DONE]" else got[-1]
    return {
        "kinds": kinds,
        "texts": texts,
        "first": _unsequenced(_untexted(got[0])),
        "last": _unsequenced(_untexted(last)),
    }


def _untexted(event: tuple[str | None, Any]) -> Any:
    # the last chunk of chat or completions holds the last piece of text: compared above
    name, data = event
    if name is None and isinstance(data, dict):
        choices = [
            {k: v for k, v in c.items() if k not in ("text", "delta")}
            for c in data.get("choices", [])
        ]
        return {**data, "choices": choices}
    return event


def _unsequenced(value: Any) -> Any:
    # sequence numbers count the deltas, as many as the chunking makes
    if isinstance(value, dict):
        return {k: _unsequenced(v) for k, v in value.items() if k != "sequence_number"}
    if isinstance(value, (list, tuple)):
        return [_unsequenced(v) for v in value]
    return value


async def answer(
    http: aiohttp.ClientSession, method: str, url: str, body: dict[str, Any] | None = None
) -> tuple[int, str, Any]:
    """(status, content type, the body made comparable)."""
    async with http.request(method, url, json=body) as resp:
        text = await resp.text()
        ctype = resp.headers.get("Content-Type", "")
    if ctype.startswith("text/event-stream"):
        return resp.status, ctype, stream(text)
    return resp.status, ctype, normal(json.loads(text))


async def same(
    http: aiohttp.ClientSession,
    method: str,
    path: str,
    ours: str,
    theirs: str,
    body: dict[str, Any] | None = None,
) -> tuple[int, str, Any]:
    """The answer of vLLM's own server and the gateway's, which must be the same."""
    expected = await answer(http, method, theirs + path, body)
    got = await answer(http, method, ours + path, body)
    assert got == expected, f"{method} {path}: gateway {got} vLLM {expected}"
    return got


# -- the generation model ---------------------------------------------------------------

CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Say hello"}],
    "max_tokens": 5,
    "temperature": 0,
}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 5, "temperature": 0}
RESPONSE = {"model": MODEL_NAME, "input": "Say hello", "max_output_tokens": 5, "temperature": 0}


@with_vllm
async def test_generation_routes(vllm_generate: str, gateway: str) -> None:
    async with aiohttp.ClientSession() as http:
        for path, body in (
            ("/v1/chat/completions", CHAT),
            ("/v1/chat/completions", {**CHAT, "stream": True}),
            ("/v1/completions", COMPLETION),
            ("/v1/completions", {**COMPLETION, "stream": True}),
            ("/v1/responses", {**RESPONSE, "stream": True}),
            ("/tokenize", {"model": MODEL_NAME, "prompt": "Hello there"}),
            ("/detokenize", {"model": MODEL_NAME, "tokens": [1, 15043, 727]}),
            # vLLM's 400 for a body its request model refuses: the same message and param
            ("/v1/chat/completions", {"model": MODEL_NAME}),
            ("/v1/completions", {**COMPLETION, "max_tokens": -1}),
            ("/v1/responses", {**RESPONSE, "max_output_tokens": "many"}),
        ):
            status, ctype, _ = await same(http, "POST", path, gateway, vllm_generate, body)
            assert (status, ctype.split(";")[0]) in (
                (200, "application/json"),
                (200, "text/event-stream"),
                (400, "application/json"),
            ), (path, status, ctype)


@with_vllm
async def test_responses_stored_retrieved_continued_and_cancel(
    vllm_generate: str, gateway: str
) -> None:
    async with aiohttp.ClientSession() as http:
        made = []
        for url in (vllm_generate, gateway):
            async with http.post(f"{url}/v1/responses", json=RESPONSE) as resp:
                assert resp.status == 200, await resp.text()
                made.append(await resp.json())
        assert normal(made[0]) == normal(made[1])
        # five tokens of a random model: the output is cut at max_output_tokens
        assert made[0]["status"] == "incomplete" and made[0]["output"]
        theirs, ours = made[0]["id"], made[1]["id"]
        assert unit_of(ours) == "unit-gen"  # a follow-up through any gateway comes back
        statuses = []
        pairs = [
            ("GET", "/v1/responses/{}", None),
            ("POST", "/v1/responses", {**RESPONSE, "previous_response_id": "{}"}),
            # cancel of a finished response: vLLM's 400
            ("POST", "/v1/responses/{}/cancel", None),
        ]
        for method, path, body in pairs:
            expected = await answer(
                http, method, vllm_generate + path.format(theirs), _fill(body, theirs)
            )
            got = await answer(http, method, gateway + path.format(ours), _fill(body, ours))
            assert _unnamed(got, ours) == _unnamed(expected, theirs), (method, path)
            statuses.append(got[0])
        assert statuses == [200, 200, 400]


def _unnamed(answer: Any, response_id: str) -> Any:
    # the id as messages quote it ("Response with id '...' not found.")
    return json.loads(json.dumps(answer).replace(response_id, "<id>"))


def _fill(body: dict[str, Any] | None, response_id: str) -> dict[str, Any] | None:
    if body is None:
        return None
    return {k: (response_id if v == "{}" else v) for k, v in body.items()}


@with_vllm
async def test_a_streamed_background_response_is_retrieved_as_a_stream(
    vllm_generate: str, gateway: str
) -> None:
    """GET /v1/responses/{id}?stream=true replays a streamed background response's events
    (after starting_after), as vLLM's server does; the gateway asks the unit in the id."""
    body = {**RESPONSE, "background": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        made = []
        for url in (vllm_generate, gateway):
            async with http.post(f"{url}/v1/responses", json=body) as resp:
                assert resp.status == 200, await resp.text()
                text = await resp.text()
            made.append((text, json.loads(text.split("data: ", 2)[1].split("\n")[0])))
        assert stream(made[0][0]) == stream(made[1][0])
        ids = [data["response"]["id"] for _, data in made]
        assert unit_of(ids[1]) == "unit-gen"
        for query in ("stream=true", "stream=true&starting_after=2"):
            got = [
                await answer(http, "GET", f"{url}/v1/responses/{rid}?{query}")
                for url, rid in zip((vllm_generate, gateway), ids, strict=True)
            ]
            assert got[0] == got[1], query
            assert got[1][0] == 200 and got[1][1].startswith("text/event-stream"), got[1]
        # the whole stream again, as it came: every event, in order
        async with http.get(f"{gateway}/v1/responses/{ids[1]}?stream=true") as resp:
            assert await resp.text() == made[1][0]


@with_vllm
async def test_openai_sdk_responses_create(gateway: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="-", max_retries=0) as oa:
        made = await oa.responses.create(
            model=MODEL_NAME, input="Say hello", max_output_tokens=5, temperature=0
        )
        assert made.status == "incomplete" and made.output_text  # cut at 5 tokens
        again = await oa.responses.retrieve(made.id)
        assert (again.id, again.output_text) == (made.id, made.output_text)
        kinds = []
        texts = []
        stream = await oa.responses.create(
            model=MODEL_NAME, input="Say hello", max_output_tokens=5, temperature=0, stream=True
        )
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                texts.append(event.delta)
        # vLLM ends every stream with response.completed, whatever the status
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        assert "".join(texts) == made.output_text
        # the SDK's stream helper: its events, then the response it assembles
        async with oa.responses.stream(
            model=MODEL_NAME, input="Say hello", max_output_tokens=5, temperature=0
        ) as helper:
            deltas = [e.delta async for e in helper if e.type == "response.output_text.delta"]
            final = await helper.get_final_response()
        assert final.output_text == "".join(deltas) == made.output_text


@with_vllm
async def test_langchain_openai_on_the_responses_api(gateway: str) -> None:
    async with openai.DefaultAsyncHttpxClient() as client:
        llm = langchain_openai.ChatOpenAI(
            model=MODEL_NAME, base_url=f"{gateway}/v1", api_key="-", use_responses_api=True,
            max_tokens=5, temperature=0, max_retries=0, http_async_client=client,
        )  # fmt: skip
        whole = await llm.ainvoke("Say hello")
        pieces = [chunk async for chunk in llm.astream("Say hello")]
    assert whole.text and whole.response_metadata["model_name"] == MODEL_NAME
    assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] == 5
    assert "".join(c.text for c in pieces) == whole.text, "temperature 0: the same text"


# -- the pooling model -------------------------------------------------------------------

TEXTS = ["The cat sat on the mat", "Dogs bark at night"]
RERANK = {"model": MODEL_NAME, "query": "q", "documents": ["d"]}


@with_vllm
async def test_pooling_routes(vllm_pooling: str, gateway: str) -> None:
    async with aiohttp.ClientSession() as http:
        for path, body in (
            ("/v1/embeddings", {"model": POOL_NAME, "input": TEXTS}),
            ("/v1/embeddings", {"model": POOL_NAME, "input": "one", "encoding_format": "base64"}),
            ("/pooling", {"model": POOL_NAME, "input": TEXTS[0]}),
            ("/score", {"model": POOL_NAME, "text_1": TEXTS[0], "text_2": TEXTS}),
            ("/v1/score", {"model": POOL_NAME, "text_1": TEXTS[0], "text_2": TEXTS[1]}),
            ("/rerank", {"model": POOL_NAME, "query": "cats", "documents": TEXTS}),
            ("/v1/rerank", {"model": POOL_NAME, "query": "cats", "documents": TEXTS, "top_n": 1}),
            ("/v2/rerank", {"model": POOL_NAME, "query": "dogs", "documents": TEXTS}),
            ("/tokenize", {"model": POOL_NAME, "prompt": TEXTS[0]}),
            # vLLM's 400 for a body its request model refuses
            ("/v1/embeddings", {"model": POOL_NAME}),
        ):
            status, ctype, _ = await same(http, "POST", path, gateway, vllm_pooling, body)
            assert ctype.startswith("application/json") and status in (200, 400), (path, status)


@with_vllm
async def test_openai_sdk_embeddings_create(vllm_pooling: str, gateway: str) -> None:
    got = []
    for url in (vllm_pooling, gateway):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as oa:
            made = await oa.embeddings.create(model=POOL_NAME, input=TEXTS)  # base64 by default
            got.append([[round(x, 4) for x in d.embedding] for d in made.data])
    assert got[0] == got[1] and len(got[1]) == 2 and len(got[1][0]) > 8


@with_vllm
async def test_a_route_the_model_has_no_task_for_is_404_on_both(
    vllm_pooling: str, vllm_generate: str, gateway: str, sidecars: tuple[Sidecar, Sidecar]
) -> None:
    gen, pool = sidecars
    async with aiohttp.ClientSession() as http:
        for url, unit, path, body in (
            (vllm_pooling, pool.http_url, "/v1/chat/completions", {**CHAT, "model": POOL_NAME}),
            (vllm_pooling, pool.http_url, "/v1/responses", {**RESPONSE, "model": POOL_NAME}),
            (vllm_generate, gen.http_url, "/v1/embeddings", {"model": MODEL_NAME, "input": "x"}),
            (vllm_generate, gen.http_url, "/rerank", RERANK),
        ):
            theirs = await answer(http, "POST", url + path, body)
            # the unit's answer and the gateway's (which routes by the model) are vLLM's:
            # status, content type and body
            for ours in (unit, gateway):
                assert await answer(http, "POST", ours + path, body) == theirs, (ours, path)
            assert theirs[0] == 404, theirs
        # the audio routes, on models with no transcription task
        for url, unit, model in ((vllm_generate, gen.http_url, MODEL_NAME),
                                 (vllm_pooling, pool.http_url, POOL_NAME)):  # fmt: skip
            got = []
            for base in (url, unit, gateway):
                form = aiohttp.FormData()
                form.add_field("model", model)
                form.add_field("file", b"RIFF" + bytes(40), filename="a.wav")
                async with http.post(f"{base}/v1/audio/transcriptions", data=form) as resp:
                    got.append((resp.status, resp.headers["Content-Type"], await resp.json()))
            assert got[0][0] == 404 and got[1:] == [got[0], got[0]], got
            # a body that is no form: the same 404 (the gateway routes a JSON body by its
            # model, any other to some unit: both have no such route)
            for ctype, body in (("application/json", json.dumps({"model": model}).encode()),
                                ("text/plain", b"hello")):  # fmt: skip
                answers = []
                for base in (url, unit, gateway):
                    async with http.post(f"{base}/v1/audio/translations", data=body,
                                         headers={"Content-Type": ctype}) as resp:  # fmt: skip
                        answers.append((resp.status, resp.headers["Content-Type"],
                                        await resp.json()))  # fmt: skip
                assert answers == [got[0]] * 3, (ctype, answers)
            # a multipart body that is no form: the same 404 (no route to parse it for)
            for ctype, body in MALFORMED_FORMS:
                answers = []
                for base in (url, unit, gateway):
                    async with http.post(f"{base}/v1/audio/transcriptions", data=body,
                                         headers={"Content-Type": ctype}) as resp:  # fmt: skip
                        answers.append((resp.status, resp.headers["Content-Type"],
                                        await resp.json()))  # fmt: skip
                assert answers == [got[0]] * 3, (ctype, answers)
        # a wrong method on an API route of the model: FastAPI's 405 with its allow header
        for url, unit, method, path in (
            (vllm_generate, gen.http_url, "GET", "/v1/chat/completions"),
            (vllm_generate, gen.http_url, "PUT", "/tokenize"),
            (vllm_generate, gen.http_url, "POST", "/v1/models"),
            (vllm_generate, gen.http_url, "HEAD", "/v1/models"),
            (vllm_pooling, pool.http_url, "DELETE", "/v1/embeddings"),
        ):
            answers_405 = []
            for base in (url, unit, gateway):
                async with http.request(method, base + path) as resp:
                    allow = set(resp.headers.get("allow", "").split(", "))  # vLLM's: a set's
                    answers_405.append(
                        (resp.status, resp.headers["Content-Type"], allow, await resp.read())
                    )
            assert answers_405 == [answers_405[0]] * 3, (path, answers_405)
            detail = b"" if method == "HEAD" else b'{"detail":"Method Not Allowed"}'
            assert answers_405[0][::3] == (405, detail), answers_405
        # a path vLLM's server has no route for: FastAPI's 404, from the unit and the gateway
        for method, path, body in (("GET", "/v1/nothing", None),
                                   ("POST", "/v1/chat/completion", CHAT),
                                   ("POST", "/v2/nothing", {})):  # fmt: skip
            theirs = await answer(http, method, vllm_generate + path, body)
            assert theirs == (404, "application/json", {"detail": "Not Found"}), theirs
            for ours in (gen.http_url, gateway):
                assert await answer(http, method, ours + path, body) == theirs, (ours, path)
        # a stored response the unit does not have: vLLM's 404, naming the id
        path = "/v1/responses/resp_none"
        theirs = await answer(http, "GET", vllm_generate + path)
        ours = await answer(http, "GET", gen.http_url + path)
        assert ours == theirs and ours[0] == 404, (ours, theirs)
        assert ours[2]["error"]["param"] == "response_id"
    assert gen.core.outstanding == pool.core.outstanding == 0


# -- the audio routes ---------------------------------------------------------------------
# Multipart bodies that are no form (content type, body).
MALFORMED_FORMS = [
    ("multipart/form-data", b"--x\r\n"),
    ("multipart/form-data; boundary=x", b"garbage"),
    ("multipart/form-data; boundary=x", b"--xjunk\r\nContent-Disposition: form-data\r\n\r\n"),
    ("multipart/form-data; boundary=x", b"--x\r\nnocolon\r\n\r\nv\r\n--x--\r\n"),
    ("multipart/form-data; boundary=x",
     b"--x\r\nContent-Disposition: form-data\r\n\r\nv\r\n--x--\r\n"),
]  # fmt: skip
# No transcription model can be made here (a Whisper needs its tokenizer and feature
# extractor files from a model hub): what is checked against vLLM is the form as vLLM's
# own request model and upload reader take it, and the 404 of a model without the task.


@with_vllm
async def test_a_form_reaches_vllms_transcription_request_as_fastapi_hands_it() -> None:
    from pydantic import TypeAdapter

    from engine import vllm_frontend
    from proxy.sidecar.frontend_http import form_fields

    audio = b"RIFF" + bytes(range(256)) * 4
    form = aiohttp.FormData()
    form.add_field("model", "whisper")
    form.add_field("language", "en")
    form.add_field("temperature", "0.2")
    form.add_field("response_format", "verbose_json")
    form.add_field("timestamp_granularities[]", "word")
    form.add_field("file", audio, filename="a.wav", content_type="audio/wav")
    writer = form()
    fields = form_fields(await writer.as_bytes(), writer.content_type)
    for route in ("transcriptions", "translations"):
        schema = vllm_frontend._find(route)
        body = vllm_frontend._form_body(fields, schema)
        if route == "translations":  # no language or granularities there: ignored
            body = {k: v for k, v in body.items() if k not in ("timestamp_granularities[]",)}
        request = TypeAdapter(schema).validate_python(body)
        assert (request.model, request.temperature) == ("whisper", 0.2)
        assert request.response_format == "verbose_json"
        if route == "transcriptions":
            assert (request.language, request.timestamp_granularities) == ("en", ["word"])
        assert request.file.filename == "a.wav"
        assert await vllm_frontend._find("read_upload")(request.file) == audio


@with_vllm
async def test_a_body_that_is_no_form_is_refused_as_vllms_server_refuses_it(
    sidecars: tuple[Sidecar, Sidecar],
) -> None:
    """vLLM's server with a transcription model reads a JSON (or other) body on an audio
    route as a form with no field, and its request model refuses it: a 400 in vLLM's
    shape naming ``body.file``. With no such model here, vLLM's own audio routers and
    exception handlers answer, mounted on a FastAPI app as its server mounts them (the
    refusal comes before the handler); the sidecar's path (its form reader, the form as
    FastAPI hands it to the request model, vLLM's validation handler) must answer the
    same bytes."""
    from types import SimpleNamespace

    import httpx
    from fastapi import FastAPI
    from pydantic import TypeAdapter, ValidationError

    from engine import vllm_frontend
    from proxy.httputil import detail_response
    from proxy.multipart import MalformedForm
    from proxy.sidecar.frontend_http import form_fields

    app = FastAPI()
    for route in ("transcription", "translation"):
        module = importlib.import_module(f"vllm.entrypoints.speech_to_text.{route}.api_router")
        app.include_router(module.router)
    handlers = importlib.import_module("vllm.entrypoints.serve.exception_handling.register")
    handlers.init_exception_handler(app)
    app.state.args = SimpleNamespace(log_error_stack=False)
    bodies = [
        ("application/json", json.dumps({"model": MODEL_NAME, "file": "x"}).encode()),
        ("text/plain", b"hello"),
        (None, b""),
    ]
    for multipart in (False, True):  # forms without their file: names repeated, one unknown
        form = aiohttp.FormData(default_to_multipart=multipart)
        for name, value in (("temperature", "0.1"), ("temperature", "hot"), ("n", "2"),
                            ("extra", "a b"), ("extra", "ü"), ("prompt", "")):  # fmt: skip
            form.add_field(name, value)
        writer = form()
        bodies.append((writer.content_type, await writer.as_bytes()))
    frontend = sidecars[0].core.engine.frontend
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
        for route in ("transcriptions", "translations"):
            schema = vllm_frontend._find(route)
            for ctype, body in bodies:
                headers = {} if ctype is None else {"Content-Type": ctype}
                resp = await client.post(f"/v1/audio/{route}", content=body, headers=headers)
                theirs = (resp.status_code, resp.headers["content-type"], resp.content)
                fields = form_fields(body, ctype)
                with pytest.raises(ValidationError) as refused:
                    TypeAdapter(schema).validate_python(vllm_frontend._form_body(fields, schema))
                reply = await frontend._invalid(refused.value)
                assert (reply.status, "application/json", reply.body) == theirs, (route, ctype)
                assert theirs[0] == 400 and json.loads(theirs[2])["error"]["param"] == "body.file"
            # a multipart body that is no form: starlette's 400 {"detail": ...}, before
            # the handler; the sidecar answers what its form reader finds
            for ctype, body in MALFORMED_FORMS:
                resp = await client.post(f"/v1/audio/{route}", content=body,
                                         headers={"Content-Type": ctype})  # fmt: skip
                theirs = (resp.status_code, resp.headers["content-type"], resp.content)
                with pytest.raises(MalformedForm) as malformed:
                    form_fields(body, ctype)
                mine = detail_response(400, malformed.value.detail, "r", "unit-gen")
                assert (mine.status, mine.content_type, mine.body) == theirs, (route, body)

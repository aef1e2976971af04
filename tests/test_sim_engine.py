"""The simulator engine: batching, timing, determinism, stop strings, aborts and faults."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import subprocess
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from engine import tokens
from engine.base import ChatMessage, EngineRequest, SamplingParams, TokenDelta
from engine.errors import EngineDeadError, EngineError
from engine.settings import SimSettings
from engine.sim import SimEngine
from proxy import cli

pytestmark = pytest.mark.timeout(10)

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 3.0  # every await on the engine is bounded by this

Factory = Callable[..., Awaitable[SimEngine]]


def settings(**knobs: Any) -> SimSettings:
    base: dict[str, Any] = {
        "decode_step_ms": 1.0,
        "decode_ms_per_seq": 0.0,
        "prefill_ms_per_token": 0.0,
    }
    return SimSettings(**(base | knobs))


def req(prompt: str = "hello there world", rid: str = "r", **sampling: Any) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt=prompt, sampling=SamplingParams(**sampling))


@pytest.fixture
async def make_engine() -> AsyncIterator[Factory]:
    engines: list[SimEngine] = []

    async def make(**knobs: Any) -> SimEngine:
        engine = SimEngine(settings(**knobs))
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


async def collect(engine: SimEngine, request: EngineRequest) -> list[TokenDelta]:
    async def run() -> list[TokenDelta]:
        return [delta async for delta in engine.generate(request)]

    return await asyncio.wait_for(run(), LIMIT_S)


def text_of(deltas: list[TokenDelta]) -> str:
    return "".join(d.text for d in deltas)


async def wait_until(predicate: Callable[[], bool]) -> None:
    async def poll() -> None:
        # stats have no change event to wait on: poll them
        while True:
            if predicate():
                return
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), LIMIT_S)


async def first_delta(gen: AsyncGenerator[TokenDelta, None]) -> TokenDelta:
    return await asyncio.wait_for(anext(gen), LIMIT_S)


# -- output ----------------------------------------------------------------------------


async def test_exact_token_count_and_length_finish(make_engine: Factory) -> None:
    engine = await make_engine()
    deltas = await collect(engine, req(max_tokens=7))
    assert len(deltas) == 7
    assert [d.completion_tokens for d in deltas] == list(range(1, 8))
    assert all(len(d.token_ids) == 1 and d.text.startswith(" ") for d in deltas)
    assert all(d.prompt_tokens == 3 for d in deltas)
    assert [d.finish_reason for d in deltas] == [None] * 6 + ["length"]


async def test_default_max_tokens(make_engine: Factory) -> None:
    engine = await make_engine(default_max_tokens=5)
    deltas = await collect(engine, req())
    assert len(deltas) == 5
    assert deltas[-1].finish_reason == "length"


async def test_max_tokens_zero_finishes_at_once(make_engine: Factory) -> None:
    engine = await make_engine()
    deltas = await collect(engine, req(max_tokens=0))
    assert deltas == [TokenDelta("", (), 3, 0, "length")]
    assert engine.stats().running == 0


async def test_prompt_token_counts(make_engine: Factory) -> None:
    engine = await make_engine()
    by_ids = EngineRequest(
        "a", prompt_token_ids=(1, 2, 3, 4, 5), sampling=SamplingParams(max_tokens=1)
    )
    chat = EngineRequest(
        "b",
        messages=(ChatMessage("system", "be brief"), ChatMessage("user", "hi there you")),
        sampling=SamplingParams(max_tokens=1),
    )
    assert (await collect(engine, by_ids))[0].prompt_tokens == 5
    assert (await collect(engine, chat))[0].prompt_tokens == (2 + 4) + (3 + 4) + 3
    assert (await collect(engine, req("", max_tokens=1)))[0].prompt_tokens == 1


# -- determinism -----------------------------------------------------------------------


async def test_same_seed_same_text_across_engines(make_engine: Factory) -> None:
    a, b = await make_engine(seed=7), await make_engine(seed=7)
    one = await collect(a, req(max_tokens=20))
    two = await collect(b, req(max_tokens=20))
    assert one == two
    assert len(set(d.token_ids for d in one)) > 5  # not one word repeated


async def test_different_seeds_or_prompts_give_different_text(make_engine: Factory) -> None:
    a, b = await make_engine(seed=1), await make_engine(seed=2)
    base = text_of(await collect(a, req(max_tokens=20)))
    assert text_of(await collect(b, req(max_tokens=20))) != base
    assert text_of(await collect(a, req(max_tokens=20, seed=99))) != base
    assert text_of(await collect(a, req("another prompt", max_tokens=20))) != base


def test_same_text_across_processes() -> None:
    script = (
        "import asyncio\n"
        "from engine.base import EngineRequest, SamplingParams\n"
        "from engine.sim import SimEngine\n"
        "from engine.settings import SimSettings\n"
        "async def main():\n"
        "    async with SimEngine(SimSettings(decode_step_ms=0, seed=3)) as e:\n"
        "        sampling = SamplingParams(max_tokens=12)\n"
        "        r = EngineRequest('x', prompt='same prompt', sampling=sampling)\n"
        "        print(''.join([d.text async for d in e.generate(r)]))\n"
        "asyncio.run(main())\n"
    )

    def run(hash_seed: str) -> str:
        env = os.environ | {"PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=8,
            check=True,
        )
        return done.stdout

    first = run("1")
    assert first.strip()
    assert run("2") == first


async def test_text_is_a_function_of_the_context(make_engine: Factory) -> None:
    # A request resumed elsewhere with its output so far continues exactly the same.
    a, b = await make_engine(seed=4), await make_engine(seed=4)
    whole = await collect(a, req("the story so far", max_tokens=30, seed=8))
    for k in (1, 13, 29):
        head = text_of(whole[:k])
        rest = await collect(b, req("the story so far" + head, max_tokens=30 - k, seed=8))
        assert [d.token_ids for d in rest] == [d.token_ids for d in whole[k:]]
        assert rest[0].prompt_tokens == whole[0].prompt_tokens + k, "k tokens more, exactly"
    ids = EngineRequest("i", prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=20))
    whole = await collect(a, ids)
    more = tuple(t for d in whole[:9] for t in d.token_ids)
    resumed = EngineRequest(
        "i", prompt_token_ids=(5, 6, 7, *more), sampling=SamplingParams(max_tokens=11)
    )
    assert [d.token_ids for d in await collect(b, resumed)] == [d.token_ids for d in whole[9:]]


async def test_continued_assistant_message_continues_the_chat(make_engine: Factory) -> None:
    engine = await make_engine()
    messages = (ChatMessage("system", "be brief"), ChatMessage("user", "a story, please"))
    whole = await collect(
        engine, EngineRequest("c", messages=messages, sampling=SamplingParams(max_tokens=20))
    )
    partial = ChatMessage("assistant", text_of(whole[:7]))
    continued = EngineRequest(
        "c",
        messages=(*messages, partial),
        sampling=SamplingParams(max_tokens=13),
        add_generation_prompt=False,
        continue_final_message=True,
    )
    rest = await collect(engine, continued)
    assert text_of(rest) == text_of(whole[7:])
    assert rest[0].prompt_tokens == whole[0].prompt_tokens + 7
    # Not continued, the same messages open a new turn: another context, other text.
    new_turn = EngineRequest(
        "c", messages=(*messages, partial), sampling=SamplingParams(max_tokens=13)
    )
    assert text_of(await collect(engine, new_turn)) != text_of(rest)


def test_token_counts_like_a_bpe_tokenizer() -> None:
    assert tokens.count("") == 0
    assert tokens.count("hello there world") == 3
    assert tokens.count(" the history of the city") == 5
    assert tokens.count("internationalization") == 4  # a rare long word: several pieces
    assert tokens.count(" 2024") == 2 and tokens.count("it's") == 2
    assert tokens.count("\n\n") == 1 and tokens.count("?!") == 1
    # Each simulator token counts one, and counts add up at its leading space.
    words = "".join(" " + w for w in tokens.WORDS)
    assert tokens.count(words) == len(tokens.WORDS)
    for head in ("x", "some prompt", "ends in space ", "ends in newline\n", "num 42", "what?"):
        assert tokens.count(head + " the city") == tokens.count(head) + 2, head


def train_tokenizer(path: Path) -> Any:
    """A small byte-level BPE, trained here (no hub): GPT-2's scheme on English-like text."""
    tk = pytest.importorskip("tokenizers")
    rng = random.Random(0)
    lines = [" ".join(rng.choices(tokens.WORDS, k=12)) + "." for _ in range(3000)]
    lines += (ROOT / "README.md").read_text().splitlines()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=3000,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok


async def test_a_real_tokenizer_counts_and_names_the_tokens(
    make_engine: Factory, tmp_path: Path
) -> None:
    tok = train_tokenizer(tmp_path)
    engine = await make_engine(tokenizer=tmp_path)
    prompt = "Tokenizers count 12,345 things; internationalization twice."
    whole = await collect(engine, req(prompt, max_tokens=40))
    assert whole[0].prompt_tokens == len(tok.encode(prompt).ids)
    assert tok.decode([t for d in whole for t in d.token_ids]) == text_of(whole), "its real ids"
    assert all(tok.encode(d.text).ids == list(d.token_ids) for d in whole), "one token each"
    assert await engine.count_tokens(prompt) == len(tok.encode(prompt).ids)
    head = text_of(whole[:15])
    rest = await collect(engine, req(prompt + head, max_tokens=25))
    assert [d.token_ids for d in rest] == [d.token_ids for d in whole[15:]]
    assert rest[0].prompt_tokens == whole[0].prompt_tokens + 15


def test_a_tokenizer_that_is_not_there_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"no tokenizer\.json"):
        SimSettings(tokenizer=tmp_path)


# -- stop strings ----------------------------------------------------------------------


async def test_stop_string_truncates_and_finishes_with_stop(make_engine: Factory) -> None:
    engine = await make_engine()
    full = await collect(engine, req(max_tokens=30))
    stop = full[5].text  # a whole word, " xyz"
    cut = text_of(full).find(stop)
    deltas = await collect(engine, req(max_tokens=30, stop=(stop,)))
    assert text_of(deltas) == text_of(full)[:cut]
    assert deltas[-1].finish_reason == "stop"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert [d.token_ids for d in deltas] == [d.token_ids for d in full[: len(deltas)]]


async def test_stop_string_spanning_tokens_is_never_emitted(make_engine: Factory) -> None:
    engine = await make_engine()
    full = await collect(engine, req(max_tokens=30))
    full_text = text_of(full)
    start = len(text_of(full[:4])) - 2  # the end of token 4 and the start of token 5
    stop = full_text[start : start + 5]
    cut = full_text.find(stop)
    deltas = await collect(engine, req(max_tokens=30, stop=("never-there", stop)))
    assert text_of(deltas) == full_text[:cut]
    assert deltas[-1].finish_reason == "stop"
    streamed = ""
    for delta in deltas:
        streamed += delta.text
        assert stop not in streamed


async def test_min_tokens_holds_off_stop_checks(make_engine: Factory) -> None:
    engine = await make_engine()
    full = await collect(engine, req(max_tokens=10))
    stop = full[0].text
    deltas = await collect(engine, req(max_tokens=10, min_tokens=10, stop=(stop,)))
    assert text_of(deltas) == text_of(full)
    assert deltas[-1].finish_reason == "length"


# -- batching and timing ---------------------------------------------------------------


async def test_continuous_batching_queues_beyond_max_num_seqs(make_engine: Factory) -> None:
    engine = await make_engine(max_num_seqs=2, decode_step_ms=2.0)
    tasks = [asyncio.create_task(collect(engine, req(rid=str(i), max_tokens=10))) for i in range(4)]
    await wait_until(lambda: engine.stats().running == 2 and engine.stats().waiting == 2)
    assert engine.stats().kv_cache_usage == 1.0
    results = await asyncio.gather(*tasks)
    assert [len(r) for r in results] == [10] * 4
    assert engine.stats().running == engine.stats().waiting == 0
    assert not engine.has_work


async def test_kv_cache_usage_is_running_over_slots(make_engine: Factory) -> None:
    engine = await make_engine(max_num_seqs=4, decode_step_ms=2.0)
    assert engine.stats().kv_cache_usage == 0.0
    gen = engine.generate(req(max_tokens=1000))
    await first_delta(gen)
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_cache_usage) == (1, 0, 0.25)
    await gen.aclose()


async def test_prefill_delays_first_token(make_engine: Factory) -> None:
    engine = await make_engine(prefill_ms_per_token=1.0, decode_step_ms=1.0)
    loop = asyncio.get_running_loop()

    async def ttft(prompt: str) -> float:
        began = loop.time()
        gen = engine.generate(req(prompt, max_tokens=2))
        await first_delta(gen)
        await gen.aclose()
        return loop.time() - began

    short = await ttft("hi")
    long = await ttft(" ".join(["word"] * 100))  # 100 ms of prefill
    assert long >= 0.09
    assert long > short + 0.05


async def test_decode_steps_take_their_time(make_engine: Factory) -> None:
    engine = await make_engine(decode_step_ms=5.0)
    began = asyncio.get_running_loop().time()
    await collect(engine, req(max_tokens=20))
    assert asyncio.get_running_loop().time() - began >= 0.09


async def test_zero_cost_is_fast_and_yields(make_engine: Factory) -> None:
    engine = await make_engine(decode_step_ms=0.0, max_num_seqs=64)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    tick_task = asyncio.create_task(ticker())
    began = asyncio.get_running_loop().time()
    requests = [req(rid=str(i), max_tokens=200) for i in range(50)]
    results = await asyncio.gather(*(collect(engine, r) for r in requests))
    elapsed = asyncio.get_running_loop().time() - began
    tick_task.cancel()
    assert all(len(r) == 200 for r in results)
    assert elapsed < 2.0
    assert ticks >= 100  # the scheduler let other tasks run between steps


# -- aborts ----------------------------------------------------------------------------


async def test_cancel_frees_the_slot(make_engine: Factory) -> None:
    engine = await make_engine(max_num_seqs=1, decode_step_ms=2.0)
    started = asyncio.Event()

    async def consume(request: EngineRequest) -> None:
        async for _ in engine.generate(request):
            started.set()

    running = asyncio.create_task(consume(req(rid="a", max_tokens=10_000)))
    waiting = asyncio.create_task(consume(req(rid="b", max_tokens=10_000)))
    await asyncio.wait_for(started.wait(), LIMIT_S)
    await wait_until(lambda: engine.stats().waiting == 1)
    assert engine.stats().running == 1
    waiting.cancel()
    running.cancel()
    await asyncio.gather(running, waiting, return_exceptions=True)
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_cache_usage) == (0, 0, 0.0)


async def test_aclose_frees_the_slot_and_engine_keeps_serving(make_engine: Factory) -> None:
    engine = await make_engine()
    gen = engine.generate(req(max_tokens=10_000))
    await first_delta(gen)
    assert engine.stats().running == 1
    await gen.aclose()
    assert engine.stats().running == 0
    assert len(await collect(engine, req(max_tokens=3))) == 3


# -- faults ----------------------------------------------------------------------------


async def test_error_after_tokens(make_engine: Factory) -> None:
    engine = await make_engine(error_after_tokens=3)
    got: list[TokenDelta] = []
    with pytest.raises(EngineError, match="after 3 tokens") as info:
        async for delta in engine.generate(req(max_tokens=10)):
            got.append(delta)
    assert not isinstance(info.value, EngineDeadError)
    assert len(got) == 3
    assert engine.stats().running == 0
    await engine.check_health()
    assert len(await collect(engine, req(max_tokens=2))) == 2  # shorter than N: fine


async def test_error_after_zero_tokens_fails_before_the_first(make_engine: Factory) -> None:
    engine = await make_engine(error_after_tokens=0)
    with pytest.raises(EngineError):
        await first_delta(engine.generate(req(max_tokens=10)))


async def test_hang_after_requests(make_engine: Factory) -> None:
    engine = await make_engine(hang_after_requests=2)
    assert len(await collect(engine, req(max_tokens=3))) == 3
    progress = engine.last_progress
    gen = engine.generate(req(max_tokens=3))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(gen), 0.1)
    # hung, not dead: health passes, the work is still reported
    await engine.check_health()
    hung = engine.generate(req(rid="h", max_tokens=3))
    task = asyncio.create_task(first_delta(hung))
    await wait_until(lambda: engine.stats().waiting + engine.stats().running == 1)
    assert engine.has_work
    assert engine.last_progress == progress
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not engine.has_work


async def test_crash_after_requests(make_engine: Factory) -> None:
    engine = await make_engine(crash_after_requests=2, decode_step_ms=2.0)
    in_flight = engine.generate(req(rid="a", max_tokens=10_000))
    await first_delta(in_flight)
    with pytest.raises(EngineDeadError, match="crash"):
        await first_delta(engine.generate(req(rid="b")))
    with pytest.raises(EngineDeadError):
        async for _ in in_flight:
            pass
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await first_delta(engine.generate(req(rid="c")))
    assert engine.stats().running == engine.stats().waiting == 0


async def test_crash_after_zero_requests_is_dead_from_start(make_engine: Factory) -> None:
    engine = await make_engine(crash_after_requests=0)
    with pytest.raises(EngineDeadError):
        await engine.check_health()


# -- lifecycle -------------------------------------------------------------------------


async def test_stop_ends_in_flight_requests(make_engine: Factory) -> None:
    engine = await make_engine(max_num_seqs=1, decode_step_ms=2.0)
    running = engine.generate(req(rid="a", max_tokens=10_000))
    await first_delta(running)
    waiting = asyncio.create_task(first_delta(engine.generate(req(rid="b"))))
    await wait_until(lambda: engine.stats().waiting == 1)
    await asyncio.wait_for(engine.stop(), LIMIT_S)
    with pytest.raises(EngineDeadError, match="stopped"):
        async for _ in running:
            pass
    with pytest.raises(EngineDeadError, match="stopped"):
        await waiting
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    await engine.stop()  # idempotent


async def test_not_started_is_dead() -> None:
    engine = SimEngine(settings())
    assert engine.is_simulator
    assert engine.model_name == "unitproxy-sim"
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await first_delta(engine.generate(req()))
    await engine.stop()


async def test_context_manager_and_model_name() -> None:
    async with SimEngine(settings(), model_name="my-sim") as engine:
        assert engine.model_name == "my-sim"
        await engine.check_health()
        assert len(await collect(engine, req(max_tokens=2))) == 2
    with pytest.raises(EngineDeadError):
        await engine.check_health()


# -- prefix cache ----------------------------------------------------------------------

SYSTEM_PROMPT = " ".join(["the assistant answers in plain words"] * 60)  # 360 tokens


async def test_a_cached_prefix_skips_its_prefill(make_engine: Factory) -> None:
    engine = await make_engine(prefill_ms_per_token=0.5, decode_step_ms=1.0)
    loop = asyncio.get_running_loop()

    async def ttft(prompt: str) -> float:
        began = loop.time()
        gen = engine.generate(req(prompt, max_tokens=2))
        await first_delta(gen)
        await gen.aclose()
        return loop.time() - began

    cold = await ttft(SYSTEM_PROMPT + " first question")  # about 180 ms of prefill
    warm = await ttft(SYSTEM_PROMPT + " second question")  # only the last block or so
    assert cold >= 0.17
    assert warm < 0.05
    assert 0.4 < engine.stats().prefix_cache_hit_rate < 0.5


def chat(messages: tuple[ChatMessage, ...], max_tokens: int) -> EngineRequest:
    return EngineRequest("c", messages=messages, sampling=SamplingParams(max_tokens=max_tokens))


async def test_chat_turns_share_the_history(make_engine: Factory) -> None:
    engine = await make_engine()
    cache = engine.prefix_cache
    assert cache is not None
    system = ChatMessage("system", SYSTEM_PROMPT)
    first = (system, ChatMessage("user", "tell me a story"))
    reply = text_of(await collect(engine, chat(first, max_tokens=40)))
    assert cache.hits == 0
    second = (*first, ChatMessage("assistant", reply), ChatMessage("user", "and then?"))
    await collect(engine, chat(second, max_tokens=4))
    # the whole first prompt but its last partial block was cached
    assert cache.hits >= tokens.count(SYSTEM_PROMPT) - 16
    assert engine.stats().prefix_cache_hit_rate > 0.3


async def test_no_prefix_cache_prefills_everything(make_engine: Factory) -> None:
    engine = await make_engine(prefix_cache_blocks=0, prefill_ms_per_token=0.5)
    loop = asyncio.get_running_loop()
    await collect(engine, req(SYSTEM_PROMPT, max_tokens=1))
    began = loop.time()
    await collect(engine, req(SYSTEM_PROMPT, max_tokens=1))
    assert loop.time() - began >= 0.17
    assert engine.prefix_cache is None
    assert engine.stats().prefix_cache_hit_rate == -1.0


async def test_a_small_cache_evicts_the_least_recent_chain_from_its_end(
    make_engine: Factory,
) -> None:
    engine = await make_engine(prefix_cache_blocks=30, block_size=16)  # one prompt's worth
    cache = engine.prefix_cache
    assert cache is not None
    blocks = len(cache.text_blocks(SYSTEM_PROMPT))
    assert 15 < blocks <= 30
    await collect(engine, req(SYSTEM_PROMPT, max_tokens=1))
    await collect(engine, req("other " + SYSTEM_PROMPT, max_tokens=1))
    assert len(cache) == 30
    await collect(engine, req(SYSTEM_PROMPT, max_tokens=1))
    # the first prompt lost the end of its chain; its leading blocks still hit
    assert cache.hits == (30 - blocks) * 16


# -- chunked prefill --------------------------------------------------------------------


async def tokens_before_first(engine: SimEngine, prompt: str) -> int:
    """Tokens a decoding request makes while ``prompt`` is prefilled (until its first
    token). Both are read by tasks that the engine wakes in the same step, so what one
    sees of the other is exact to a token."""
    made = 0

    async def decode() -> None:
        nonlocal made
        async for delta in engine.generate(req("go", rid="a", max_tokens=10_000)):
            made = delta.completion_tokens

    async def prefill() -> int:
        while made == 0:  # the decoding request is running
            await asyncio.sleep(0)
        before = made
        async for _ in engine.generate(req(prompt, rid="b", max_tokens=1)):
            break
        return made - before

    async with asyncio.timeout(LIMIT_S):
        decoding = asyncio.create_task(decode())
        try:
            return await prefill()
        finally:
            decoding.cancel()
            await asyncio.gather(decoding, return_exceptions=True)


async def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(
    make_engine: Factory,
) -> None:
    prompt = " ".join(["word"] * 2000)  # 2,000 tokens
    chunked = await make_engine(max_num_batched_tokens=101, decode_step_ms=0.0)
    # 100 prompt tokens a step beside the decoding request's token: 20 steps of prefill,
    # and the decoding request makes a token in each
    assert await tokens_before_first(chunked, prompt) >= 18
    whole = await make_engine(max_num_batched_tokens=0, decode_step_ms=0.0)
    # the whole prompt in the step after it arrived (and a token of reading lag)
    assert await tokens_before_first(whole, prompt) <= 3


def test_a_tokenizer_with_too_few_words_names_its_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(["the cat sat on the mat"] * 10, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    argv = ["sidecar", "--sim-tokenizer", str(tmp_path), "--host", "127.0.0.1",
            "--http-port", "0", "--grpc-port", "0"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("unitproxy: invalid configuration: engine.sim.tokenizer: "), err
    assert "the simulator needs 100" in err


# -- priority --------------------------------------------------------------------------


async def test_a_higher_priority_takes_a_lower_ones_slot_which_pauses_and_resumes(
    make_engine: Factory,
) -> None:
    engine = await make_engine(max_num_seqs=1)
    alone = text_of(await collect(engine, req("a long batch job", "alone", max_tokens=200)))
    batch_request = dataclasses.replace(req("a long batch job", "b", max_tokens=200), priority=2)
    batch = engine.generate(batch_request)
    got = [await first_delta(batch)]
    while len(got) < 5:
        got.append(await first_delta(batch))
    urgent = asyncio.create_task(
        collect(engine, dataclasses.replace(req("now", "i", max_tokens=5), priority=0))
    )
    done = await urgent  # runs to its end while the batch request holds no slot
    assert done[-1].finish_reason == "length" and done[-1].completion_tokens == 5
    assert engine.preemptions == 1
    stats = engine.stats()
    assert stats.running + stats.waiting == 1, "the batch request is still there, paused"
    async for delta in batch:
        got.append(delta)
    # the batch request never failed: all its tokens, the same text as when it ran alone
    assert got[-1].finish_reason == "length" and got[-1].completion_tokens == 200
    assert text_of(got) == alone
    assert engine.preemptions == 1


async def test_one_priority_never_preempts_and_the_queue_orders_by_priority(
    make_engine: Factory,
) -> None:
    engine = await make_engine(max_num_seqs=1)
    running = engine.generate(dataclasses.replace(req("x", "r", max_tokens=20), priority=1))
    await first_delta(running)
    order: list[str] = []

    async def run(rid: str, priority: int) -> None:
        await collect(engine, dataclasses.replace(req(rid, rid, max_tokens=2), priority=priority))
        order.append(rid)

    tasks = [asyncio.create_task(run(rid, p)) for rid, p in (("b1", 2), ("s1", 1), ("b2", 2))]
    await wait_until(lambda: engine.stats().waiting == 3)
    assert engine.preemptions == 0, "none waits above the running standard request"
    async for _ in running:
        pass
    await asyncio.wait_for(asyncio.gather(*tasks), LIMIT_S)
    assert order == ["s1", "b1", "b2"] and engine.preemptions == 0


async def test_the_sim_reports_its_queued_prefill_and_its_measured_prefill_rate() -> None:
    from engine.base import EngineRequest, SamplingParams
    from engine.settings import SimSettings
    from engine.sim import SimEngine

    settings = SimSettings(prefill_ms_per_token=0.01, decode_step_ms=1.0, decode_ms_per_seq=0.0)
    async with SimEngine(settings) as engine:
        assert engine.stats().named_metrics == {"prefill_queue_tokens": 0.0}, "no rate yet"
        request = EngineRequest("r", prompt="word " * 2000, sampling=SamplingParams(max_tokens=2))
        gen = engine.generate(request)
        first = await anext(gen)
        await gen.aclose()
        metrics = engine.stats().named_metrics
        assert first.prompt_tokens > 1000 and metrics["prefill_queue_tokens"] == 0.0
        # Prefilled in steps of 0.01 ms a token plus a 1 ms step: below 100,000 tokens/s
        rate = metrics["prefill_tokens_per_s"]
        assert 10_000 < rate < 100_000

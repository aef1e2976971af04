"""engine.prefill.PrefillMeter: the prefill queue and rate an engine that reports neither
(the embedded vLLM) is measured by, on injected time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.prefill import (
    PREFILL_QUEUE_TOKENS,
    PREFILL_TOKENS_PER_S,
    PrefillMeter,
    prompt_size,
    text_tokens,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_queue_holds_each_prompt_until_its_first_token() -> None:
    clock = Clock()
    meter = PrefillMeter(clock)
    assert meter.metrics() == {PREFILL_QUEUE_TOKENS: 0.0}, "no rate before any prefill"
    meter.submitted("a", 1000)
    meter.submitted("b", 500)
    assert meter.metrics()[PREFILL_QUEUE_TOKENS] == 1500
    clock.now += 0.25
    meter.started("a", 1000)
    assert meter.metrics()[PREFILL_QUEUE_TOKENS] == 500
    meter.started("a", 1000)  # later outputs of the same request: nothing more
    assert meter.metrics()[PREFILL_QUEUE_TOKENS] == 500
    clock.now += 0.25
    meter.ended("b")  # cancelled before its first token: out of the queue, not prefilled
    got = meter.metrics()
    assert got[PREFILL_QUEUE_TOKENS] == 0
    # 1,000 tokens prefilled over the 0.5 s some prompt was waiting
    assert got[PREFILL_TOKENS_PER_S] == pytest.approx(2000)


def test_the_rate_counts_only_time_with_a_prompt_waiting_and_tokens_the_cache_lacked() -> None:
    clock = Clock()
    meter = PrefillMeter(clock)
    meter.submitted("a", 4000)
    clock.now += 1.0
    meter.started("a", 4000, cached_tokens=3000)  # the engine prefilled 1,000 of them
    clock.now += 60.0  # idle: no time counted
    meter.submitted("b", 800)
    meter.submitted("c", 1200)
    clock.now += 0.5
    meter.started("b", 0)  # the engine did not count them: the estimate stands
    clock.now += 0.5
    meter.started("c", 1200)
    meter.ended("c")
    got = meter.metrics()
    assert got[PREFILL_QUEUE_TOKENS] == 0
    # 1,000 + 800 + 1,200 tokens over 1 + 1 s with a prompt waiting
    assert got[PREFILL_TOKENS_PER_S] == pytest.approx(1500)


def test_a_resubmitted_id_replaces_its_estimate_and_text_prompts_are_estimated() -> None:
    meter = PrefillMeter(Clock())
    meter.submitted("a", 100)
    meter.submitted("a", 300)
    assert meter.metrics()[PREFILL_QUEUE_TOKENS] == 300
    meter.ended("a")
    meter.ended("unknown")
    assert meter.metrics()[PREFILL_QUEUE_TOKENS] == 0
    assert text_tokens("x" * 400) == 100


def test_a_prompt_as_vllm_is_handed_it_is_sized_by_its_ids_or_its_text() -> None:
    assert prompt_size({"prompt_token_ids": [1, 2, 3]}) == 3
    assert prompt_size({"prompt": "x" * 40}) == 10
    assert prompt_size("x" * 8) == 2
    assert prompt_size(SimpleNamespace(prompt_token_ids=[7] * 5)) == 5
    assert prompt_size(object()) == 0, "unknown: the engine's own count stands"

"""The prefill an engine has queued and the rate it clears it, measured from outside,
for an engine that does not report them (the embedded vLLM): the named metrics
``prefill_queue_tokens`` and ``prefill_tokens_per_s`` that the gateways' policy
``prefix`` weighs a unit's queue by (the simulator reports its own, from its steps).

A request's prompt is queued from when it is handed to the engine until its first
token; the rate is the prompt tokens the engine prefilled (a prompt's tokens less those
its prefix cache held, as the engine says with the first output) over the time some
prompt was waiting. So the rate is what a queued prompt gets with the decode steps
around it, as the simulator's is; while nothing waits no time is counted, so an idle
engine's rate is not diluted.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

PREFILL_QUEUE_TOKENS = "prefill_queue_tokens"
PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"
# Characters of prompt text per token, for a prompt given as text (its tokens are known
# only once the engine answers): about 4 for English under a BPE tokenizer.
CHARS_PER_TOKEN = 4.0


class PrefillMeter:
    """Prompt tokens waiting for their first token, and the rate the engine clears them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._waiting: dict[str, float] = {}  # request id: its prompt tokens, until its first
        self._queued = 0.0
        self._at = 0.0  # the last change of the queue
        self._busy_s = 0.0  # time with a prompt waiting
        self._prefilled = 0.0  # prompt tokens that got their first token, less cached ones

    def _tick(self) -> None:
        now = self._clock()
        if self._waiting:
            self._busy_s += now - self._at
        self._at = now

    def submitted(self, request_id: str, tokens: float) -> None:
        """The request's prompt (``tokens``, estimated) is handed to the engine."""
        self._tick()
        tokens = max(0.0, tokens)
        self._queued += tokens - self._waiting.get(request_id, 0.0)
        self._waiting[request_id] = tokens

    def started(self, request_id: str, prompt_tokens: int, cached_tokens: int = 0) -> None:
        """The request's first output: ``prompt_tokens`` as the engine counted them (0:
        not said, the estimate stands), of which its prefix cache held
        ``cached_tokens``. Once a request; later calls and an unknown id do nothing."""
        if request_id not in self._waiting:
            return
        self._tick()
        queued = self._waiting.pop(request_id)
        self._queued -= queued
        tokens = prompt_tokens if prompt_tokens > 0 else queued
        self._prefilled += max(0.0, tokens - max(0, cached_tokens))
        if not self._waiting:
            self._queued = 0.0  # no drift from estimates left behind

    def ended(self, request_id: str) -> None:
        """The request is over; one that never got a first token leaves the queue."""
        if request_id in self._waiting:
            self._tick()
            self._queued -= self._waiting.pop(request_id)
            if not self._waiting:
                self._queued = 0.0

    def metrics(self) -> dict[str, float]:
        """``prefill_queue_tokens`` always; ``prefill_tokens_per_s`` once a prompt was
        prefilled with time counted for it."""
        self._tick()
        out = {PREFILL_QUEUE_TOKENS: max(0.0, self._queued)}
        if self._prefilled > 0 and self._busy_s > 0:
            out[PREFILL_TOKENS_PER_S] = self._prefilled / self._busy_s
        return out


def text_tokens(text: str) -> float:
    """A prompt's tokens from its text, before the engine has counted them."""
    return len(text) / CHARS_PER_TOKEN


def prompt_size(prompt: Any) -> float:
    """The tokens of a prompt as handed to vLLM's ``generate``: a dict or object with
    its ``prompt_token_ids``, or with its ``prompt`` text (estimated), or a string; 0
    where none of these is found (the engine's own count then stands, at its first
    output)."""
    if isinstance(prompt, str):
        return text_tokens(prompt)
    fields: dict[str, Any] = (
        prompt
        if isinstance(prompt, dict)
        else {name: getattr(prompt, name, None) for name in ("prompt_token_ids", "prompt")}
    )
    ids = fields.get("prompt_token_ids")
    if ids is not None:
        with contextlib.suppress(TypeError):
            return float(len(ids))
    text = fields.get("prompt")
    return text_tokens(text) if isinstance(text, str) else 0.0

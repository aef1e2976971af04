"""The simulator's scheduling and timing model, with no clock of its own.

One step of a vLLM-like engine: waiting requests move into free batch slots (each to
prefill what the prefix cache does not hold), every decoding sequence makes one token,
prompts are prefilled in chunks, oldest first, up to ``max_num_batched_tokens`` tokens
in all, and the step takes a prefill cost per prompt token plus a decode step growing
with the sequences that make a token in it.

Two clocks drive this one class: ``engine.sim.SimEngine`` sleeps each step's time on
the event loop and makes the tokens' text; the capacity planner (``proxy.plan``) adds
it to a virtual clock and only counts tokens. A sequence is whatever object has the
fields of ``Scheduled``; the model never makes a token itself.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Literal, Protocol, TypeVar

from engine.prefix_cache import PrefixCache
from engine.settings import SimSettings

State = Literal["waiting", "running", "done"]


class Scheduled(Protocol):
    prompt_tokens: int
    blocks: list[int]  # the prompt's KV blocks (chained hashes), for the prefix cache
    prefill_left: int  # running: prompt tokens still to prefill (0: decoding)
    state: State


S = TypeVar("S", bound=Scheduled)


class StepModel(Generic[S]):
    """Slots, a FIFO waiting queue and a prefix cache; ``plan_step`` plans the next step
    and says how long it takes. Running sequences are either prefilling or decoding,
    each kept in admission order."""

    __slots__ = ("cache", "decoding", "prefilling", "settings", "started", "waiting")

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.waiting: deque[S] = deque()
        self.prefilling: dict[S, None] = {}  # insertion-ordered sets with O(1) removal
        self.decoding: dict[S, None] = {}
        self.started: list[S] = []  # whose prefill ended in the step planned last
        self.cache: PrefixCache | None = None
        if settings.prefix_cache_blocks > 0:
            self.cache = PrefixCache(settings.block_size, settings.prefix_cache_blocks)

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def has_work(self) -> bool:
        return bool(self.prefilling or self.decoding or self.waiting)

    def add(self, seq: S) -> None:
        seq.state = "waiting"
        self.waiting.append(seq)

    def discard(self, seq: S) -> None:
        """Out of the engine wherever it is (an abort, or its last token)."""
        if seq.state == "running":
            del (self.prefilling if seq.prefill_left else self.decoding)[seq]
        elif seq.state == "waiting":
            self.waiting.remove(seq)
        seq.state = "done"

    def clear(self) -> list[S]:
        """Every sequence out (the engine died); returns them."""
        gone = [*self.prefilling, *self.decoding, *self.waiting]
        for seq in gone:
            seq.state = "done"
        self.prefilling.clear()
        self.decoding.clear()
        self.waiting.clear()
        return gone

    def plan_step(self) -> float:
        """Fill the slots and plan the next step; its time in seconds. Then every
        sequence in ``decoding`` makes a token in it (``started``: those whose prefill
        ends in it, their first token)."""
        return self.step_seconds(self.fill_slots())

    def steady(self) -> bool:
        """Whether every step from now on is the same until a sequence ends: nothing to
        prefill, and nothing waiting that a slot could take."""
        return not self.prefilling and (
            not self.waiting or self.running >= self.settings.max_num_seqs
        )

    def fill_slots(self) -> int:
        """Move waiting requests into free slots (each to prefill what the prefix cache
        does not hold), then plan the next step: every decoding sequence's token first,
        then prefill chunks, oldest sequence first, up to ``max_num_batched_tokens``
        tokens in all (chunked prefill, as vLLM schedules). Returns the prompt tokens
        prefilled in the step."""
        free = self.settings.max_num_seqs - self.running
        cache, started = self.cache, self.started
        started.clear()
        while free > 0 and self.waiting:
            seq = self.waiting.popleft()
            seq.state = "running"
            cached = 0 if cache is None else cache.admit(seq.blocks, seq.prompt_tokens)
            seq.prefill_left = seq.prompt_tokens - cached
            if seq.prefill_left:
                self.prefilling[seq] = None
            else:  # an empty prompt: nothing to prefill
                self.decoding[seq] = None
                started.append(seq)
            free -= 1
        budget = self.settings.max_num_batched_tokens or float("inf")
        budget -= len(self.decoding)
        prefill = 0
        for seq in self.prefilling:
            if budget <= 0:
                break
            chunk = int(min(seq.prefill_left, budget))
            seq.prefill_left -= chunk
            budget -= chunk
            prefill += chunk
            if not seq.prefill_left:
                started.append(seq)
        for seq in started:
            if seq not in self.decoding:  # else admitted with nothing to prefill
                del self.prefilling[seq]
                self.decoding[seq] = None
        return prefill

    def step_seconds(self, prefill_tokens: int) -> float:
        """Prefill per token plus a decode step growing with the sequences that make a
        token in it (those decoding, and those whose prefill ends in it)."""
        s = self.settings
        ms = (
            prefill_tokens * s.prefill_ms_per_token
            + s.decode_step_ms
            + s.decode_ms_per_seq * len(self.decoding)
        )
        return ms / 1000.0

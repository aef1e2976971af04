"""The simulator's scheduling and timing model, with no clock of its own.

One step of a vLLM-like engine: waiting requests move into free batch slots (each to
prefill what the prefix cache does not hold), every decoding sequence makes one token,
prompts are prefilled in chunks, oldest first, up to ``max_num_batched_tokens`` tokens
in all, and the step takes a prefill cost per prompt token plus a decode step growing
with the sequences that make a token in it.

The waiting queue is in order of priority (lower first, as vLLM's priority scheduling)
then arrival. As vLLM under ``--scheduling-policy priority``, a waiting request of a
higher priority takes the slot of the running sequence of the lowest priority (the
latest admitted of them) when every slot is taken: that one goes back to the head of
its class in the waiting queue and, once a slot takes it again, prefills its prompt and
its output so far again (vLLM's recompute), less what the prefix cache holds; it never
fails. Sequences of one priority never preempt each other, so with one priority the
queue is first come, first served and nothing is ever preempted.

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
    completion_tokens: int  # output so far: a preempted sequence prefills it again
    blocks: list[int]  # the prompt's KV blocks (chained hashes), for the prefix cache
    priority: int  # lower goes first
    arrival: int  # set by ``add``: its order of arrival
    preempted: int  # times it gave its slot to a sequence of a higher priority
    prefill_left: int  # running: prompt tokens still to prefill (0: decoding)
    state: State


S = TypeVar("S", bound=Scheduled)


class StepModel(Generic[S]):
    """Slots, a waiting queue by priority then arrival, and a prefix cache;
    ``plan_step`` plans the next step and says how long it takes. Running sequences are
    either prefilling or decoding, each kept in admission order."""

    __slots__ = ("_arrivals", "by_priority", "cache", "decoding", "preemptions",
                 "prefill_s", "prefilled", "prefilling", "settings", "started",
                 "waiting")  # fmt: skip

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.waiting: deque[S] = deque()  # by priority, then arrival
        self.prefilling: dict[S, None] = {}  # insertion-ordered sets with O(1) removal
        self.decoding: dict[S, None] = {}
        # priority -> its running sequences in admission order (no empty entries)
        self.by_priority: dict[int, dict[S, None]] = {}
        self.started: list[S] = []  # whose prefill ended in the step planned last
        self.preemptions = 0  # running sequences that gave their slot to a higher priority
        # Prompt tokens prefilled by ``plan_step``, and the seconds of the steps that
        # prefilled them (the whole step: decode included), for the measured prefill rate.
        self.prefilled = 0
        self.prefill_s = 0.0
        self._arrivals = 0
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
        self._arrivals += 1
        seq.arrival = self._arrivals
        self._queue(seq)

    def discard(self, seq: S) -> None:
        """Out of the engine wherever it is (an abort, or its last token)."""
        if seq.state == "running":
            self._stop_running(seq)
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
        self.by_priority.clear()
        self.waiting.clear()
        return gone

    def plan_step(self) -> float:
        """Fill the slots and plan the next step; its time in seconds. Then every
        sequence in ``decoding`` makes a token in it (``started``: those whose prefill
        ends in it, their first token). Counts the prompt tokens it prefills and the
        step's time in ``prefilled`` and ``prefill_s``."""
        prefill = self.fill_slots()
        step_s = self.step_seconds(prefill)
        if prefill and step_s > 0:
            self.prefilled += prefill
            self.prefill_s += step_s
        return step_s

    def prefill_queue_tokens(self) -> int:
        """Tokens not yet prefilled: what running sequences have left, and each waiting
        one's whole prompt (and output so far, for a preempted one): what the prefix
        cache holds of it is known only once a slot takes it."""
        queued = sum(seq.prefill_left for seq in self.prefilling)
        return queued + sum(seq.prompt_tokens + seq.completion_tokens for seq in self.waiting)

    def steady(self) -> bool:
        """Whether every step from now on is the same until a sequence ends: nothing to
        prefill, and nothing waiting that a slot could take (a free one, or one a
        waiting sequence of a higher priority would preempt)."""
        if self.prefilling:
            return False
        if not self.waiting:
            return True
        return self.running >= self.settings.max_num_seqs and not self._would_preempt(
            self.waiting[0].priority
        )

    def fill_slots(self) -> int:
        """Move waiting requests into free slots, or into the slots of running ones of a
        lower priority (``_preempt``), each to prefill what the prefix cache does not
        hold; then plan the next step: every decoding sequence's token first, then
        prefill chunks, oldest sequence first, up to ``max_num_batched_tokens`` tokens
        in all (chunked prefill, as vLLM schedules). Returns the prompt tokens
        prefilled in the step."""
        free = self.settings.max_num_seqs - self.running
        cache, started, waiting = self.cache, self.started, self.waiting
        started.clear()
        while waiting and (free > 0 or self._preempt(waiting[0].priority)):
            seq = waiting.popleft()
            seq.state = "running"
            cached = 0 if cache is None else cache.admit(seq.blocks, seq.prompt_tokens)
            # a preempted sequence prefills its output again too (vLLM's recompute)
            seq.prefill_left = max(0, seq.prompt_tokens + seq.completion_tokens - cached)
            if seq.prefill_left:
                self.prefilling[seq] = None
            else:  # an empty prompt: nothing to prefill
                self.decoding[seq] = None
                started.append(seq)
            self.by_priority.setdefault(seq.priority, {})[seq] = None
            free = max(0, free - 1)
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

    # -- priority ---------------------------------------------------------------------

    def _queue(self, seq: S) -> None:
        """Into the waiting queue, behind every sequence of its priority or a higher one
        that came before it (a preempted one came before those waiting in its class)."""
        seq.state = "waiting"
        waiting = self.waiting
        key = (seq.priority, seq.arrival)
        if not waiting or (waiting[-1].priority, waiting[-1].arrival) < key:
            waiting.append(seq)  # the common case: one priority, in arrival order
            return
        at = len(waiting)
        while at > 0 and (waiting[at - 1].priority, waiting[at - 1].arrival) > key:
            at -= 1
        waiting.insert(at, seq)

    def _stop_running(self, seq: S) -> None:
        del (self.prefilling if seq.prefill_left else self.decoding)[seq]
        of_priority = self.by_priority[seq.priority]
        del of_priority[seq]
        if not of_priority:
            del self.by_priority[seq.priority]

    def _would_preempt(self, priority: int) -> bool:
        return bool(self.by_priority) and max(self.by_priority) > priority

    def _preempt(self, priority: int) -> bool:
        """Every slot is taken and a request of ``priority`` waits: free the slot of the
        latest running sequence of the lowest priority, if that is lower; true if one
        was freed. That sequence waits again at the head of its class."""
        if not self._would_preempt(priority):
            return False
        victim = next(reversed(self.by_priority[max(self.by_priority)]))
        self._stop_running(victim)
        victim.preempted += 1
        self.preemptions += 1
        self._queue(victim)
        return True

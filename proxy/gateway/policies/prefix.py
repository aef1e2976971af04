"""Policy ``prefix``: the unit most likely to hold the prompt's prefix in its KV cache,
within a bound on its load; else ``lor``.

Where units report the prefix blocks their engines hold (``prefix_blocks`` in their
load reports, from the engines' KV cache events), it routes on that
(``proxy.gateway.held.EngineBlocks``): every replica reading the same reports holds
the same view. Its own index of the prompt blocks it sent to each unit
(``proxy.gateway.prefix.PrefixIndex``) fills in between reports: at each report that
carries blocks, what this gateway sent the unit more than GUESS_KEEP_S before is
dropped from it (the engine's own word covers it). For units that report no blocks the
index is all it has, corrected by the engines' prefix-cache counters in the load
reports (``EngineFeedback``). It keeps a heap by load with the fleet's sums
(``index.LeastLoaded``) for the least loaded unit and the fleet's mean load. A choice
looks only at the units that hold a prefix of the prompt, not at the whole fleet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from proxy.gateway.held import engine_blocks, merged
from proxy.gateway.index import LeastLoaded
from proxy.gateway.policies.base import Candidates, Policy, Shared
from proxy.gateway.policies.lor import least_outstanding
from proxy.gateway.prefix import EngineFeedback, PrefixIndex
from proxy.gateway.request import Want
from proxy.gateway.units import LoadView, Unit
from proxy.load import LoadReport, PrefixBlocks, UnitState

if TYPE_CHECKING:
    from proxy.metrics import GatewayMetrics

# At a report with blocks, this gateway's guesses for the unit older than this are
# dropped: a request sent that long ago has been admitted and its blocks reported.
GUESS_KEEP_S = 1.0
# The named metric of a unit's engine slots, the requests it runs at once (engine.base's).
ENGINE_SLOTS = "engine_slots"


def prefix_affinity(
    least: Unit,
    holders: Iterable[Sequence[Unit]],
    view: LoadView,
    mean: float,
    balance: float,
    slack: int,
    fits: Callable[[Unit], int] | None = None,
    free_slots: bool = False,
) -> Unit:
    """Policy ``prefix``: of the units that hold the longest prefix of the prompt
    (``holders``, longest match first), the least loaded one that stays within the
    bound with this request on it: estimated outstanding + 1 at most ``(1 + balance)``
    x the fleet's mean load (``mean``, outstanding over capacity, this request
    counted) x its capacity, plus ``slack`` requests; if none does, the next shorter
    match; if no holder does, ``least`` (lor).

    Bounded load (consistent hashing with bounded loads): no choice puts a unit above
    ``(1 + balance)`` x the mean plus ``slack``; a popular prefix spreads over more
    units as its first ones reach the bound, because the unit that takes the overflow
    holds it from then on.

    ``fits`` (calibration, ``Budget.fits``): whether a unit above the bound over the
    mean clears its queued prefill, this request's counted, within the tolerated TTFT,
    or, weighed, starts the request no later than ``least`` would (1 yes, 0 no, -1
    unknown); where it knows, it decides instead of ``slack``.

    ``free_slots``: a holder also takes the request while it has an engine slot free
    for it (estimated outstanding + 1 at most the ``engine_slots`` it reports), above
    the bound or not: the request starts at once there, queued behind none, so
    affinity costs it nothing, while a unit without the prefix would prefill it
    again. Where ``fits`` says no, it does not. A unit that reports no slots has none
    free.
    """
    ceiling = (1.0 + balance) * mean
    for units in holders:
        best: Unit | None = None
        best_load = 0.0
        for unit in units:
            estimate = view.estimate(unit)
            bound = ceiling * unit.capacity
            if estimate + 1 > bound:
                verdict = -1 if fits is None else fits(unit)
                if verdict == 0:
                    continue
                # a free engine slot: it starts at once there, whatever the bound says
                slot = free_slots and estimate + 1 <= unit.metric(ENGINE_SLOTS, 0.0)
                if verdict < 0 and estimate + 1 > bound + slack and not slot:
                    continue
            load = estimate / unit.capacity
            if best is None or load < best_load:
                best, best_load = unit, load
        if best is not None:
            return best
    return least


# Characters of prompt text per token, to count a prompt's tokens without a tokenizer
# (about 4 for English under a BPE tokenizer).
CHARS_PER_TOKEN = 4.0


class Budget:
    """The bound on affinity from calibration, above the bound over the mean load.

    With a tolerated TTFT (``ttft_s`` > 0): a unit clears ``rate x ttft_s`` prompt
    tokens of prefill within it; ``rate`` is given (``prefix_prefill_tokens_per_s``)
    or the unit's own, measured by its engine (named metric ``prefill_tokens_per_s``),
    and what waits for prefill there is its named metric ``prefill_queue_tokens``.

    Without one, with ``weigh`` (``prefix_weigh_prefill``): the holder against the
    least loaded unit, the fallback. A holder takes the request while the prefill
    before its first token there (its queue and the prompt's tokens it does not hold,
    at its rate) is no longer than at the least loaded unit (its queue and the prompt's
    tokens that one does not hold, at its own rate): the prefill affinity saves
    against the queue it adds, in seconds on both sides. A long shared prefix keeps its
    unit through a deep queue; a short one moves as soon as its holder's queue costs
    more than prefilling it again elsewhere. Not while the holder has no engine slot
    free for the request and the least loaded unit has one: there it would wait for a
    running request to end, which its prefill queue does not show. A holder with
    nothing queued and a slot free (or slots unknown) keeps it whatever the rates. A
    unit's queue is its last report's and the prompt tokens this gateway sent it since
    (``sent``), and none while it is estimated to hold no request (this gateway's all
    ended since)."""

    __slots__ = ("least_free", "least_s", "new_tokens", "rate", "sent", "ttft_s", "view", "weigh")

    def __init__(
        self, ttft_s: float, rate: float, weigh: bool = False, view: LoadView | None = None
    ):
        self.ttft_s = ttft_s
        self.rate = rate
        self.weigh = weigh
        self.view = view  # the units' estimated outstanding, for their free engine slots
        self.new_tokens = 0.0  # this request's prompt tokens not held at the unit
        self.least_s = -1.0  # the prefill before its first token at the least loaded unit
        self.least_free = -1  # whether the least loaded unit has an engine slot free for it
        # Per unit, the prompt tokens this gateway sent it since its last report (that
        # it was not known to hold): queued there, and not in the report's queue yet.
        self.sent: dict[str, float] = {}

    def queued(self, unit: Unit) -> float:
        """The prompt tokens queued for prefill at the unit: its last report's, and
        this gateway's sent since; -1 where it reports none. 0 where the unit is
        estimated to hold no request: a report taken while a request of this gateway
        waited there, read after it ended, no longer says what waits."""
        queued = unit.metric("prefill_queue_tokens")
        if queued < 0:
            return queued
        if self.view is not None and self.view.estimate(unit) <= 0:
            return 0.0
        return queued + self.sent.get(unit.id, 0.0)

    def prefill_s(self, unit: Unit, new_tokens: float) -> float:
        """The prefill before a request's first token at the unit: its queue and the
        request's ``new_tokens``, at its rate, in s; -1 where it reports no queue or
        no rate is known."""
        queued = self.queued(unit)
        rate = self.rate if self.rate > 0 else unit.metric("prefill_tokens_per_s")
        if queued < 0 or rate <= 0:
            return -1.0
        return (queued + new_tokens) / rate

    def chose(self, unit: Unit, new_tokens: float) -> None:
        """A request went to the unit, ``new_tokens`` of its prompt not held there."""
        self.sent[unit.id] = self.sent.get(unit.id, 0.0) + new_tokens

    def reported(self, unit: Unit) -> None:
        """The unit's report counts what was sent it before (its queue)."""
        self.sent.pop(unit.id, None)

    def moved(self, unit: Unit) -> None:
        """Once none of this gateway's requests is in flight at the unit, none of what
        it sent there waits for prefill."""
        if unit.inflight <= 0 and self.sent:
            self.sent.pop(unit.id, None)

    def free_slot(self, unit: Unit) -> int:
        """1: the unit has an engine slot free for one more request (its estimated
        outstanding, that one counted, at most the ``engine_slots`` it reports); 0: it
        has not; -1: unknown (no slots reported)."""
        slots = unit.metric(ENGINE_SLOTS, 0.0)
        if slots <= 0 or self.view is None:
            return -1
        return 1 if self.view.estimate(unit) + 1 <= slots else 0

    def against(self, least: Unit, new_tokens: float) -> None:
        """Sets the least loaded unit's side of ``weigh`` for this request."""
        self.least_s = self.prefill_s(least, new_tokens) if self.weigh else -1.0
        self.least_free = self.free_slot(least) if self.weigh else -1

    def fits(self, unit: Unit) -> int:
        """1: the unit's queued prefill and this request's fit in the tolerated TTFT
        (or, weighed, start no later than at the least loaded unit); 0: they do not;
        -1: unknown (neither set, no rate, or no queue reported)."""
        if self.ttft_s > 0:
            queued = self.queued(unit)
            rate = self.rate if self.rate > 0 else unit.metric("prefill_tokens_per_s")
            if queued < 0 or rate <= 0:
                return -1
            return 1 if queued + self.new_tokens <= rate * self.ttft_s else 0
        if self.least_s < 0:
            return -1
        here = self.prefill_s(unit, self.new_tokens)
        if here < 0:
            return -1
        free = self.free_slot(unit)
        if self.least_free == 1 and free == 0:
            # it would wait there for a running request to end, not for prefill alone,
            # where the least loaded unit starts it at once
            return 0
        if free != 0 and self.queued(unit) <= 0:
            # nothing waits there: it starts at once, and prefills only what it lacks
            # (measured rates, which differ by unit and are rough while few prompts were
            # prefilled, are not weighed against that)
            return 1
        return 1 if here <= self.least_s else 0


class PrefixAffinity(Policy):
    def __init__(self, shared: Shared):
        super().__init__(shared)
        s = shared.settings
        self.reads_prompt = True
        self.index = PrefixIndex(s.prefix_chunk_chars, s.prefix_max_blocks, s.prefix_ttl_s)
        self.feedback = EngineFeedback(self.index) if s.prefix_engine_feedback else None
        self.engine = engine_blocks(s.prefix_chunk_chars)  # what units report they hold
        self.budget = Budget(
            s.prefix_ttft_s, s.prefix_prefill_tokens_per_s, s.prefix_weigh_prefill, shared.view
        )
        # The least loaded bounds a choice, and the fleet's mean load bounds that.
        self.heap = LeastLoaded(shared.rng, shared.view, sums=True)

    def prompt_blocks(self, text: str) -> list[int]:
        return self.index.hashes(text)

    def choose(self, want: Want, candidates: Candidates) -> Unit | None:
        shared, c = self.shared, candidates
        if c.model is not None:
            listed = c.listed()
            mean = _mean_load(listed, shared.view)
            least = least_outstanding(listed, shared.rng, 0, shared.view)
        else:
            mean = self.heap.mean_load()
            least = self.heap.least(c.now, c.stale_after_s, c.age_at, c.exclude)
        if least is None or not want.blocks:
            return least
        return self._by_prefix(least, want, c, mean)

    def _by_prefix(self, least: Unit, want: Want, c: Candidates, mean: float) -> Unit:
        """Given the least loaded candidate: looks only at the units that hold a prefix
        of the prompt, not at the whole fleet."""
        s, by_id = self.shared.settings, c.by_id

        def can_take(unit_id: str) -> bool:
            unit = by_id.get(unit_id)
            return unit is not None and c.can_take(unit) and unit.serves(want.model)

        engine, guess = self.engine.matches(want.blocks), self.index.matches(want.blocks, c.now)
        held = list(merged(engine, guess))
        budget, chunk = self.budget, s.prefix_chunk_chars

        def holders() -> Iterator[list[Unit]]:
            for depth, ids in held:
                budget.new_tokens = max(0, want.chars - depth * chunk) / CHARS_PER_TOKEN
                yield [by_id[i] for i in ids if can_take(i)]

        def new_tokens(unit: Unit) -> float:
            """The prompt's tokens the unit is not known to hold."""
            depth = next((d for d, ids in held if unit.id in ids), 0)
            return max(0, want.chars - depth * chunk) / CHARS_PER_TOKEN

        balance = s.prefix_balance
        if s.prefix_saturated_balance > balance and budget.free_slot(least) == 0:
            balance = s.prefix_saturated_balance  # saturated: every unit's request waits
        fits = None
        if s.prefix_ttft_s > 0:
            fits = budget.fits
        elif budget.weigh:
            budget.against(least, new_tokens(least))
            fits = budget.fits
        unit = prefix_affinity(
            least,
            holders(),
            self.shared.view,
            mean,
            balance,
            s.prefix_slack,
            fits,
            s.prefix_free_slots,
        )
        if fits is not None:
            budget.chose(unit, new_tokens(unit))
        if self.feedback is not None:
            self.feedback.sent(unit.id, want.blocks, want.chars)
        self.index.record(unit.id, want.blocks, c.now)
        return unit

    def reported(self, unit: Unit, report: LoadReport, blocks: PrefixBlocks | None) -> None:
        self.budget.reported(unit)
        if _cache_lost(unit.report, report):
            self.index.forget(unit.id)
            self.engine.forget(unit.id)
            if self.feedback is not None:
                self.feedback.forget(unit.id)
        if not self.shared.settings.prefix_engine_blocks:
            blocks = None
        if blocks is not None and self.engine.apply(unit.id, blocks):
            self.index.drop_before(unit.id, self.shared.clock() - GUESS_KEEP_S)
        if self.feedback is not None:
            self.feedback.report(
                unit.id,
                report.prefix_cache_queries,
                report.prefix_cache_hits,
                report.prefix_cache_resets,
                self.shared.clock(),
            )

    def moved(self, unit: Unit) -> None:
        self.heap.update(unit)
        self.budget.moved(unit)

    def count_to(self, metrics: GatewayMetrics) -> None:
        if self.feedback is not None:
            metrics.count_prefix_corrections(self.feedback.counts)


def _mean_load(units: Iterable[Unit], view: LoadView) -> float:
    """The units' estimated outstanding, plus one request, over their capacity."""
    outstanding, capacity = 1, 0
    for unit in units:
        outstanding += view.estimate(unit)
        capacity += unit.capacity
    return outstanding / capacity if capacity else float("inf")


def _cache_lost(before: LoadReport | None, after: LoadReport) -> bool:
    """The unit's KV cache is likely gone: its sidecar restarted (seq went back) or it
    left SERVING for NOT_SERVING (a failed node; the engine may be restarted)."""
    if before is None:
        return False
    restarted = after.seq < before.seq and after.timestamp_ms > before.timestamp_ms
    failed = before.state is UnitState.SERVING and after.state is UnitState.NOT_SERVING
    return restarted or failed


POLICY = PrefixAffinity

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
from proxy.load import LoadReport, UnitState

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
    mean clears its queued prefill, this request's counted, within the tolerated TTFT
    (1 yes, 0 no, -1 unknown); where it knows, it decides instead of ``slack``.

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
    """The bound on affinity from calibration: a unit clears ``rate x ttft_s`` prompt
    tokens of prefill within the tolerated TTFT; ``rate`` is given
    (``prefix_prefill_tokens_per_s``) or the unit's own, measured by its engine
    (named metric ``prefill_tokens_per_s``), and what waits for prefill there is its
    named metric ``prefill_queue_tokens``."""

    __slots__ = ("new_tokens", "rate", "ttft_s")

    def __init__(self, ttft_s: float, rate: float):
        self.ttft_s = ttft_s
        self.rate = rate
        self.new_tokens = 0.0  # this request's prompt tokens not held at the unit

    def fits(self, unit: Unit) -> int:
        """1: the unit's queued prefill and this request's fit in the tolerated TTFT;
        0: they do not; -1: unknown (no TTFT set, no rate, or no queue reported)."""
        if self.ttft_s <= 0:
            return -1
        queued = unit.metric("prefill_queue_tokens")
        rate = self.rate if self.rate > 0 else unit.metric("prefill_tokens_per_s")
        if queued < 0 or rate <= 0:
            return -1
        return 1 if queued + self.new_tokens <= rate * self.ttft_s else 0


class PrefixAffinity(Policy):
    def __init__(self, shared: Shared):
        super().__init__(shared)
        s = shared.settings
        self.reads_prompt = True
        self.index = PrefixIndex(s.prefix_chunk_chars, s.prefix_max_blocks, s.prefix_ttl_s)
        self.feedback = EngineFeedback(self.index) if s.prefix_engine_feedback else None
        self.engine = engine_blocks(s.prefix_chunk_chars)  # what units report they hold
        self.budget = Budget(s.prefix_ttft_s, s.prefix_prefill_tokens_per_s)
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

        held = merged(self.engine.matches(want.blocks), self.index.matches(want.blocks, c.now))
        budget, chunk = self.budget, s.prefix_chunk_chars

        def holders() -> Iterator[list[Unit]]:
            for depth, ids in held:
                budget.new_tokens = max(0, want.chars - depth * chunk) / CHARS_PER_TOKEN
                yield [by_id[i] for i in ids if can_take(i)]

        fits = budget.fits if s.prefix_ttft_s > 0 else None
        unit = prefix_affinity(
            least,
            holders(),
            self.shared.view,
            mean,
            s.prefix_balance,
            s.prefix_slack,
            fits,
            s.prefix_free_slots,
        )
        if self.feedback is not None:
            self.feedback.sent(unit.id, want.blocks, want.chars)
        self.index.record(unit.id, want.blocks, c.now)
        return unit

    def reported(self, unit: Unit, report: LoadReport) -> None:
        if _cache_lost(unit.report, report):
            self.index.forget(unit.id)
            self.engine.forget(unit.id)
            if self.feedback is not None:
                self.feedback.forget(unit.id)
        blocks = report.prefix_blocks if self.shared.settings.prefix_engine_blocks else None
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

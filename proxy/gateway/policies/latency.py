"""Policy ``latency``: the candidate with the least predicted time to first token.

Each unit's TTFT is learnt online (``proxy.gateway.latency``) from the attempts the
gateway sent there. The core hands each attempt to ``sent`` as it starts (the policy
notes what it found on the unit: the requests there, and the prefill work before its
first token, the wait for a slot) and to ``answered`` when it ends. Each unit keeps a
ledger of the attempts this gateway has there (``scan``): the prompts of those with no
first token yet (the part the unit is not known to hold) are prefill the engine does
before a request sent now; the others, by the output each asked for (``max_tokens``)
and the time since its first token at the unit's time per token, say when each batch
slot frees (``slot_wait``), which is what a request waits once the engine's slots
(its reported ``engine_slots``) are taken. So a burst sent to one unit raises its
prediction at once, before any of it is answered. An attempt's TTFT
goes to the fit as soon as a choice sees its first token (or when it ends), not once
its stream is over. A choice predicts every candidate's TTFT for this request and takes
the least (ties: the lower load); ``Sent.predicted_s`` keeps the prediction for the
unit the attempt went to.

Prefix affinity: the policy keeps the prompt blocks each unit has answered
(``PrefixIndex``, recorded once a unit answered, when its engine holds them) and
predicts with the prompt's uncached part only: a unit that holds the first half of a
long prompt is predicted to prefill the other half. So a cached prefix counts for what
it saves (c x the characters it spares), against what the unit's queue costs (b x its
requests ahead, c x the prefill queued there, q x the wait for a slot), in seconds
on both sides: affinity is not a separate rule, it is the prefill the prediction
leaves out.

Bounded load (``gateway.latency_balance``, ``gateway.prefix_slack``): a unit whose
load would pass (1 + balance) x the fleet's mean plus slack requests is not a
candidate, however fast it is predicted. The ledger makes a prediction rise with each
request sent, so a right fit does not herd a burst onto one unit; the bound is the
guard against a wrong one (the fit learns a mistake only a TTFT after the choice). It
is looser than policy prefix's (1 against 0.1): a fast unit should take more than its
share of slots, which a bound of 0.1 forbade.

Goodput (``gateway.latency_goodput``): a request that no unit is predicted to start
within its class's objective misses it wherever it goes; it then goes to the unit
predicted slowest (within the bound) rather than the fastest, so that the queues of
the others stay short enough for the requests that can still meet it. Under overload
more requests meet the objective and those past it wait longer (a longer tail): off
by default.

A unit not learnt yet (fewer than ``latency.WARM`` answers: a new unit, or every unit
at start) is chosen first, the least loaded of them (as lor), so that each is learnt
before predictions choose; nothing is shed meanwhile.

Objectives (``gateway.slo_ttft_s``, per class): a ``batch`` request whose best
prediction misses its class's objective is refused (``Overloaded``, 429 code ``shed``)
rather than sent to slow everyone down; ``standard`` and ``interactive`` requests are
never shed for a prediction, they take the fastest unit. With ``gateway.slo_tpot_s``
the units predicted to stream within it (time per output token, learnt against the
batch a request joins) come first, and a batch request is shed when none is. The units' load against the
load they can hold within the objective is ``limit`` (``unitproxy_fleet_saturation``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from proxy.errors import Overloaded
from proxy.gateway.latency import Latencies, Sent, Timed, slot_wait
from proxy.gateway.policies.base import Candidates, Policy, Shared
from proxy.gateway.policies.lor import least_outstanding
from proxy.gateway.prefix import PrefixIndex
from proxy.gateway.request import Want
from proxy.gateway.units import Unit
from proxy.load import LoadReport, PrefixBlocks
from proxy.settings import GatewaySettings

if TYPE_CHECKING:
    from proxy.metrics import GatewayMetrics

ENGINE_SLOTS = "engine_slots"  # the named metric of a unit's slots (engine.base's)
DEFAULT_TOKENS = 128.0  # the output of a request that gives no max_tokens, until one does
DEFAULT_PER_TOKEN_S = 0.03  # until a stream's time per token is seen
MEAN_WEIGHT = 0.02  # of each new value in the moving means
SHED = "batch"  # the class refused first (and only) when no unit meets its objective


def objective(settings: GatewaySettings, priority: str) -> float:
    """The TTFT objective of a priority class in s (0: none)."""
    if priority == "interactive" and settings.slo_ttft_interactive_s > 0:
        return settings.slo_ttft_interactive_s
    if priority == "batch" and settings.slo_ttft_batch_s > 0:
        return settings.slo_ttft_batch_s
    return settings.slo_ttft_s


class LeastPredictedTtft(Policy):
    def __init__(self, shared: Shared):
        super().__init__(shared)
        s = shared.settings
        self.reads_prompt = True  # the prompt's length and blocks
        self.learns = True
        self.latencies = Latencies(shared.clock, s.latency_half_life_s)
        self.index = PrefixIndex(s.prefix_chunk_chars, s.prefix_max_blocks, s.prefix_ttl_s)
        self.chunk = s.prefix_chunk_chars
        # Each unit's engine slots: as its reports name them (engine_slots), else the
        # most requests they showed running.
        self.slots: dict[str, int] = {}
        # Per unit, the attempts this gateway has there (until each ends).
        self.ledgers: dict[str, list[Sent]] = {}
        # The output a request asks for (max_tokens), and the time per output token,
        # as moving means over the fleet: for a request that gives none, a unit not
        # learnt yet.
        self.mean_tokens = DEFAULT_TOKENS
        self.mean_per_token_s = DEFAULT_PER_TOKEN_S

    def prompt_blocks(self, text: str) -> list[int]:
        return self.index.hashes(text)

    def uncached(self, unit: Unit, want: Want) -> float:
        """The prompt's characters the unit is not known to hold."""
        if not want.blocks:
            return float(want.chars)
        held = self.index.depth(unit.id, want.blocks) * self.chunk
        return float(max(0, want.chars - held))

    def scan(self, unit_id: str) -> tuple[float, float]:
        """What the attempts this gateway has on the unit (its ledger) put before a
        request sent now: the prompt characters still to prefill (those with no first
        token yet), and the wait for a batch slot (``slot_wait``, from the output each
        running one has left). A first token that came since the last scan goes to the
        fit now."""
        ledger = self.ledgers.get(unit_id)
        if not ledger:
            return 0.0, 0.0
        now = self.shared.clock()
        per_token = self.per_token_s(unit_id, len(ledger))
        chars, unstarted = 0.0, 0
        left: list[float] = []
        for sent in ledger:
            if sent.started_at < 0.0:
                ttft = sent.attempt.first_token_s()
                if ttft < 0.0:
                    chars += sent.own_chars
                    unstarted += 1
                    continue
                sent.started_at = now
                self._observe(sent, ttft)
            left.append(max(0.0, sent.tokens * per_token - (now - sent.started_at)))
        slots = self.slots.get(unit_id, 0)
        turnover = self.mean_tokens * per_token / max(slots, 1)
        return chars, slot_wait(left, unstarted, slots, turnover)

    def per_token_s(self, unit_id: str, batch: int) -> float:
        """The unit's time per output token with ``batch`` requests there: as learnt,
        else the fleet's mean."""
        learnt = self.latencies.predict_tpot(unit_id, float(max(0, batch - 1)))
        return learnt if learnt > 0.0 else self.mean_per_token_s

    def _observe(self, sent: Sent, ttft_s: float) -> None:
        if sent.observed or ttft_s <= 0.0:
            return
        sent.observed = True
        self.latencies.observe(
            sent.unit_id, sent.ahead, sent.prefill_chars, ttft_s, sent.wait, sent.own_chars
        )

    def predict(self, unit: Unit, want: Want, ahead: float) -> float:
        """The unit's predicted TTFT for this request with ``ahead`` requests there (-1:
        not warm)."""
        chars, wait = self.scan(unit.id)
        return self.latencies.predict(unit.id, ahead, chars + self.uncached(unit, want), wait)

    def choose(self, want: Want, candidates: Candidates) -> Unit | None:
        shared = self.shared
        listed = candidates.listed()
        if not listed:
            return None
        latencies, estimate = self.latencies, shared.view.estimate
        cold = [u for u in listed if not latencies.warm(u.id)]
        if cold:  # learn every unit first: the least loaded of those not learnt yet
            return least_outstanding(cold, shared.rng, 0, shared.view)
        s = shared.settings
        slo_tpot = s.slo_tpot_s
        # Bounded load: a unit whose load, this request counted, is past (1 +
        # latency_balance) x the fleet's mean plus prefix_slack requests is not taken,
        # whatever its prediction (a guard against a fit gone wrong: the ledger makes
        # each prediction rise with every request sent, so a right one does not herd).
        outstanding, capacity = 1, 0
        for unit in listed:
            outstanding += estimate(unit)
            capacity += unit.capacity
        ceiling = (1.0 + s.latency_balance) * outstanding / max(capacity, 1)
        slack = s.prefix_slack
        best: Unit | None = None
        best_s = math.inf
        best_load = 0.0
        best_streams = False
        worst: Unit | None = None  # the unit predicted slowest (latency_goodput)
        worst_s = -1.0
        for unit in listed:
            held = estimate(unit)
            if held + 1 > ceiling * unit.capacity + slack:
                continue
            ahead = float(held)
            seconds = self.predict(unit, want, ahead)
            # Within the TPOT objective with this request in its batch (or not learnt).
            streams = slo_tpot <= 0 or latencies.predict_tpot(unit.id, ahead) <= slo_tpot
            load = shared.view.load(unit)
            if seconds > worst_s:
                worst, worst_s = unit, seconds
            if (
                best is None
                or (streams and not best_streams)
                or (
                    streams == best_streams
                    and (seconds < best_s or (seconds == best_s and load < best_load))
                )
            ):
                best, best_s, best_load, best_streams = unit, seconds, load, streams
        if best is None:  # every unit past the bound: the least loaded
            return least_outstanding(listed, shared.rng, 0, shared.view)
        if s.latency_goodput and want.priority != SHED and worst is not None:
            slo = objective(s, want.priority)
            if 0 < slo < best_s:  # it misses anyway: where it delays the fewest that could
                return worst
        if want.priority == SHED:
            slo = objective(shared.settings, SHED)
            if 0 < slo < best_s:
                raise Overloaded(
                    f"no unit is predicted to start a batch request within its "
                    f"{slo:g} s objective (the fastest: {best_s:.3g} s)",
                    code="shed",
                )
            if not best_streams:
                raise Overloaded(
                    f"no unit is predicted to stream a batch request within the "
                    f"{slo_tpot:g} s per token objective",
                    code="shed",
                )
        return best

    def sent(self, unit: Unit, want: Want, attempt: Timed) -> Sent | None:
        ahead = float(max(0, self.shared.view.estimate(unit) - 1))  # counted there already
        own = self.uncached(unit, want)
        chars, wait = self.scan(unit.id)
        chars += own
        predicted = self.latencies.predict(unit.id, ahead, chars, wait)
        tokens = float(want.max_tokens)
        if tokens > 0.0:
            self.mean_tokens += MEAN_WEIGHT * (tokens - self.mean_tokens)
        else:
            tokens = self.mean_tokens
        sent = Sent(unit.id, attempt, ahead, chars, own, wait, predicted, tokens)
        self.ledgers.setdefault(unit.id, []).append(sent)
        return sent

    def answered(self, unit: Unit, want: Want, sent: Sent, ok: bool, per_token_s: float) -> None:
        ledger = self.ledgers.get(unit.id)
        if ledger is not None and sent in ledger:
            ledger.remove(sent)
            if not ledger:
                del self.ledgers[unit.id]
        if not ok:
            return
        self._observe(sent, sent.attempt.first_token_s())
        if per_token_s > 0.0:
            self.latencies.observe_tpot(unit.id, sent.ahead, per_token_s)
            self.mean_per_token_s += MEAN_WEIGHT * (per_token_s - self.mean_per_token_s)
        if want.blocks:
            self.index.record(unit.id, want.blocks, self.shared.clock())

    def predicted_ttft(self, unit: Unit, want: Want, ahead: int) -> float:
        if not self.latencies.warm(unit.id):
            return -1.0
        slots = self.slots.get(unit.id, 0)
        return self.latencies.predict(unit.id, float(ahead), self.uncached(unit, want), slots)

    def limit(self, unit: Unit) -> float:
        s = self.shared.settings
        slots = self.slots.get(unit.id, 0)
        # past the slots, each waiting request adds a slot's turnover to the wait
        turnover = self.mean_tokens * self.per_token_s(unit.id, slots) / max(slots, 1)
        return self.latencies.holds(
            unit.id, s.slo_ttft_s, s.slo_tpot_s, unit.capacity, slots, turnover
        )

    def reported(self, unit: Unit, report: LoadReport, blocks: PrefixBlocks | None) -> None:
        slots = report.named_metrics.get(ENGINE_SLOTS, 0.0)  # as the unit says
        if slots >= 1.0:
            self.slots[unit.id] = int(slots)
        elif report.running > self.slots.get(unit.id, 0):  # else the most seen running
            self.slots[unit.id] = report.running

    def count_to(self, metrics: GatewayMetrics) -> None:
        self.latencies.on_error = metrics.prediction_error.observe


POLICY = LeastPredictedTtft

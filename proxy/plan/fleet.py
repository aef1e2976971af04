"""A fleet of simulated units on a virtual clock, routed by least outstanding requests.

Each unit is the simulator's own model (``engine.sim_model.StepModel``: slots, waiting
queue, chunked prefill, prefix cache, step time), stepped as ``SimEngine`` steps it,
but the step's time is added to a virtual clock instead of slept. A request is routed
when it arrives to the unit with the fewest outstanding requests (ties at random), as
the gateway's default policy ``lor`` does; when every unit holds ``capacity``, it waits
in the gateway's queue (first come, first served) for the first unit that has room.
An idle unit starts a step at once; a busy one takes new requests into free slots at
its next step, as the simulator's scheduler does.

Speed: while a unit has nothing to prefill and nothing waiting that a slot could take,
every step is the same until a sequence ends, so such a run of steps is one event
(cut short when a request arrives that a free slot could take). An hour of traffic
is a few events per request, not one per step.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.settings import SimSettings
from engine.sim_model import State, StepModel
from proxy.plan.workload import Request

_UNIQUE = 1 << 40  # block ids of a request's own (never shared) prompt blocks start here


class _Seq:
    """One request inside a unit, as the step model sees it."""

    __slots__ = ("arrival", "blocks", "completion_tokens", "finish_step", "first_s",
                 "preempted", "prefill_left", "priority", "prompt_tokens", "req",
                 "state")  # fmt: skip

    def __init__(self, req: Request, blocks: list[int]) -> None:
        self.req = req
        self.prompt_tokens = req.prompt_tokens
        # The planner's traffic is one priority class: the model never preempts here,
        # so a sequence's output is never prefilled again.
        self.priority = 1
        self.completion_tokens = 0
        self.arrival = 0  # set by the model
        self.preempted = 0
        self.blocks = blocks
        self.prefill_left = 0
        self.state: State = "waiting"
        self.first_s = -1.0
        self.finish_step = 0


class _Unit:
    __slots__ = ("busy", "ending", "index", "model", "outstanding", "run_start", "run_steps",
                 "started", "step_s", "steps", "version")  # fmt: skip

    def __init__(self, index: int, settings: SimSettings) -> None:
        self.index = index
        self.model: StepModel[_Seq] = StepModel(settings)
        self.outstanding = 0
        self.busy = False
        self.steps = 0  # decode steps done
        self.run_start = 0.0  # the current run of identical steps: when it began,
        self.run_steps = 0  # how many steps it has,
        self.step_s = 0.0  # and how long each takes
        self.started: list[_Seq] = []  # whose first token comes at the end of the run's first step
        self.ending: list[tuple[int, int, _Seq]] = []  # heap: (finish step, order, seq)
        self.version = 0  # of its pending event; older ones in the heap are void


@dataclass(frozen=True)
class Outcome:
    """What the fleet did with the traffic: per finished request, TTFT and TPOT (s)."""

    units: int
    requests: int  # in the traffic
    ttft_s: list[float]
    tpot_s: list[float]  # requests of at least 2 output tokens
    good: int  # requests that met every objective
    duration_s: float  # of the traffic
    end_s: float  # when the last request finished (or the run stopped)
    stopped: bool  # stopped early: enough requests missed the objective that it fails
    prefix_hit_rate: float | None  # over the fleet, None without a prefix cache or sharing
    events: int


class FleetSim:
    """``units`` identical units of ``settings``; ``run`` plays the traffic once."""

    def __init__(
        self,
        settings: SimSettings,
        units: int,
        capacity: int,
        *,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        percentile: float = 99.0,
        seed: int = 0,
        stop_early: bool = True,
        runs: bool = True,
    ) -> None:
        self.settings = settings
        self.capacity = capacity
        self.slo_ttft_s = math.inf if slo_ttft_s is None else slo_ttft_s
        self.slo_tpot_s = math.inf if slo_tpot_s is None else slo_tpot_s
        self.percentile = percentile
        self.stop_early = stop_early
        self.runs = runs  # false: every step its own event (slow; the runs' check)
        self._units = [_Unit(i, settings) for i in range(units)]
        self._rng = random.Random(seed)
        self._events: list[tuple[float, int, int, int]] = []  # (time, order, unit, version)
        self._order = 0
        self._queue: deque[_Seq] = deque()  # the gateway's, when every unit is full
        self._ttft: list[float] = []
        self._tpot: list[float] = []
        self._good = 0
        self._late_ttft = self._late_tpot = 0
        self._allowed_late = 0
        self._events_done = 0
        self._shared = False  # some request has a prefix to share

    def run(self, traffic: Sequence[Request], duration_s: float | None = None) -> Outcome:
        n = len(traffic)
        # p-th percentile above the objective once more than this many requests are late
        self._allowed_late = n - math.ceil(self.percentile / 100.0 * n)
        events = self._events
        now = 0.0
        stopped = False
        i = 0
        while i < n or events:
            if self._failed():
                stopped = True
                break
            if i < n and (not events or traffic[i].at_s <= events[0][0]):
                req = traffic[i]
                now = req.at_s
                self._arrive(self._seq(req, i), now)
                i += 1
                continue
            now, _, index, version = heapq.heappop(events)
            unit = self._units[index]
            if version == unit.version:
                self._events_done += 1
                self._end_run(unit, now)
        return self._outcome(n, traffic, duration_s, now, stopped)

    def _failed(self) -> bool:
        if not self.stop_early:
            return False
        return self._late_ttft > self._allowed_late or self._late_tpot > self._allowed_late

    # -- requests in -------------------------------------------------------------------

    def _seq(self, req: Request, index: int) -> _Seq:
        if self.settings.prefix_cache_blocks <= 0 or req.group < 0:
            # Without a shared prefix no block can ever hit: the cache is left out (its
            # blocks would only evict other requests' blocks that would not hit either).
            return _Seq(req, [])
        self._shared = True
        size = self.settings.block_size
        shared = req.prefix_tokens // size
        own = req.prompt_tokens // size - shared
        base = req.group * _UNIQUE
        mine = _UNIQUE * (1 << 20) + index * _UNIQUE
        blocks = [base + k for k in range(shared)]
        blocks += [mine + k for k in range(own)]
        return _Seq(req, blocks)

    def _arrive(self, seq: _Seq, now: float) -> None:
        units, capacity = self._units, self.capacity
        lowest = min(u.outstanding for u in units)
        if lowest >= capacity:
            self._queue.append(seq)
            return
        tied = [u for u in units if u.outstanding == lowest]
        unit = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        self._dispatch(unit, seq, now)

    def _dispatch(self, unit: _Unit, seq: _Seq, now: float) -> None:
        unit.outstanding += 1
        model = unit.model
        model.add(seq)
        if not unit.busy:
            unit.busy = True
            self._plan_run(unit, now)
        elif unit.run_steps > 1 and model.running < model.settings.max_num_seqs:
            # A free slot takes it at the next step: end the run of same steps there.
            step_s = unit.step_s
            done = 1 if step_s <= 0 else math.floor((now - unit.run_start) / step_s) + 1
            if done < unit.run_steps:
                unit.run_steps = done
                self._schedule(unit, unit.run_start + done * unit.step_s)

    # -- steps -------------------------------------------------------------------------

    def _plan_run(self, unit: _Unit, now: float) -> None:
        model = unit.model
        prefill = model.fill_slots()
        step_s = model.step_seconds(prefill)
        unit.started = list(model.started)
        for seq in unit.started:
            seq.finish_step = unit.steps + seq.req.output_tokens
            heapq.heappush(unit.ending, (seq.finish_step, self._next_order(), seq))
        steps = 1
        if self.runs and not prefill and model.steady() and unit.ending:
            steps = max(1, unit.ending[0][0] - unit.steps)
        unit.run_start, unit.run_steps, unit.step_s = now, steps, step_s
        self._schedule(unit, now + steps * step_s)

    def _schedule(self, unit: _Unit, at: float) -> None:
        unit.version += 1
        heapq.heappush(self._events, (at, self._next_order(), unit.index, unit.version))

    def _next_order(self) -> int:
        self._order += 1
        return self._order

    def _end_run(self, unit: _Unit, now: float) -> None:
        first = unit.run_start + unit.step_s
        for seq in unit.started:
            seq.first_s = first
            self._first_token(seq)
        unit.started = []
        unit.steps += unit.run_steps
        ending = unit.ending
        while ending and ending[0][0] <= unit.steps:
            _, _, seq = heapq.heappop(ending)
            unit.model.discard(seq)
            unit.outstanding -= 1
            self._finished(seq, now)
            if self._queue:
                self._dispatch(unit, self._queue.popleft(), now)
        if unit.model.has_work:
            self._plan_run(unit, now)
        else:
            unit.busy = False

    # -- what each request saw ------------------------------------------------------------

    def _first_token(self, seq: _Seq) -> None:
        ttft = seq.first_s - seq.req.at_s
        self._ttft.append(ttft)
        if ttft > self.slo_ttft_s:
            self._late_ttft += 1

    def _finished(self, seq: _Seq, now: float) -> None:
        seq.blocks = []
        out = seq.req.output_tokens
        tpot = (now - seq.first_s) / (out - 1) if out > 1 else 0.0
        if out > 1:
            self._tpot.append(tpot)
            if tpot > self.slo_tpot_s:
                self._late_tpot += 1
        if seq.first_s - seq.req.at_s <= self.slo_ttft_s and tpot <= self.slo_tpot_s:
            self._good += 1

    def _outcome(
        self,
        n: int,
        traffic: Sequence[Request],
        duration_s: float | None,
        end_s: float,
        stopped: bool,
    ) -> Outcome:
        span = duration_s if duration_s is not None else (traffic[-1].at_s if traffic else 0.0)
        queries = hits = 0
        for unit in self._units:
            cache = unit.model.cache
            if cache is not None:
                queries, hits = queries + cache.queries, hits + cache.hits
        return Outcome(
            units=len(self._units),
            requests=n,
            ttft_s=self._ttft,
            tpot_s=self._tpot,
            good=self._good,
            duration_s=span,
            end_s=end_s,
            stopped=stopped,
            prefix_hit_rate=hits / queries if queries and self._shared else None,
            events=self._events_done,
        )

"""Policy ``round_robin``: the units in turn, each that can take a request (a baseline).

It walks on from the unit after the last one it chose, so a choice looks at the units
up to the next that can take a request, not at each; when the units serve different
models, the turn's place among the candidates.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from proxy.gateway.policies.base import Candidates, Policy, Shared
from proxy.gateway.request import Want
from proxy.gateway.units import LoadView, Unit


def round_robin(
    candidates: Sequence[Unit], rng: random.Random, turn: int, view: LoadView
) -> Unit | None:
    return candidates[turn % len(candidates)] if candidates else None


class RoundRobin(Policy):
    def __init__(self, shared: Shared):
        super().__init__(shared)
        self.turn = 0  # choices made
        self.cursor = 0  # where the next turn starts in the units

    def choose(self, want: Want, candidates: Candidates) -> Unit | None:
        unit = (
            self._next_in_turn(candidates)
            if candidates.model is None
            else round_robin(candidates.listed(), self.shared.rng, self.turn, self.shared.view)
        )
        if unit is not None:
            self.turn += 1
        return unit

    def _next_in_turn(self, candidates: Candidates) -> Unit | None:
        """The next unit after the last one chosen that can take a request."""
        units = candidates.units
        for k in range(len(units)):
            unit = units[(self.cursor + k) % len(units)]
            if candidates.can_take(unit):
                self.cursor = (self.cursor + k + 1) % len(units)
                return unit
        return None


POLICY = RoundRobin

"""What every policy is, and what it is given.

``Shared``: what the router hands each policy once, when it builds it (settings, the
random generator, the clock, how load is read, the units). ``Candidates``: the units
one choice may take, as the router sees them at that choice. ``Policy``: the class a
policy module defines; the router calls ``choose`` once per choice and tells it of the
unit set's events, so that it may keep its own state (lor its heap, prefix its index).

Every policy takes only units that can take a request (``LoadView.available``), so
"can take a request" has one definition; it reads load through the router's
``LoadView``.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from proxy.gateway.latency import Sent, Timed
from proxy.gateway.request import Want
from proxy.gateway.units import LoadView, Unit
from proxy.load import LoadReport, PrefixBlocks
from proxy.registry import POLICIES
from proxy.settings import GatewaySettings

if TYPE_CHECKING:
    from proxy.metrics import GatewayMetrics

# A choice as a pure function of a snapshot: candidates, the random generator, a count
# of choices made (round_robin's turn), the view.
Select = Callable[[Sequence[Unit], random.Random, int, LoadView], Unit | None]


class Shared:
    """The router's objects that a policy is built with (and may keep)."""

    __slots__ = ("by_id", "clock", "rng", "settings", "units", "view")

    def __init__(
        self,
        settings: GatewaySettings,
        rng: random.Random,
        clock: Callable[[], float],
        view: LoadView,
        units: list[Unit],
        by_id: dict[str, Unit],
    ):
        self.settings = settings
        self.rng = rng  # the router's: one seed makes every choice
        self.clock = clock
        self.view = view  # how every choice reads a unit's load
        self.units = units  # every unit, in the order they were added (the router's list)
        self.by_id = by_id  # the same units by id (the router's map)


class Candidates:
    """The units one choice may take: not in ``exclude`` (tried already), able to take a
    request now (``LoadView.available`` at ``now``, reports aged to ``age_at``), and,
    when ``model`` is set, serving it.

    ``model`` is set only when the units do not all serve the same models: then a
    policy passes over the units that serve it (``listed``), as an index over every
    unit knows nothing of models. Otherwise every unit serves the request (or none
    does, and the front answered 404).

    The router keeps one and sets it afresh before each choice (no object per request):
    it is valid only during ``Policy.choose``.
    """

    __slots__ = ("age_at", "by_id", "exclude", "model", "now", "stale_after_s", "units", "view")

    def __init__(self, shared: Shared):
        self.units = shared.units
        self.by_id = shared.by_id
        self.view = shared.view
        self.stale_after_s = shared.settings.stale_after_s
        self.exclude: Collection[str] = ()
        self.model: str | None = None
        self.now = 0.0
        self.age_at = 0.0

    def can_take(self, unit: Unit) -> bool:
        """Not excluded and able to take a request (whatever models it serves)."""
        return unit.id not in self.exclude and self.view.available(
            unit, self.now, self.stale_after_s, self.age_at
        )

    def listed(self) -> list[Unit]:
        """Every candidate: a pass over every unit."""
        now, stale_after_s, age_at = self.now, self.stale_after_s, self.age_at
        exclude, model, view = self.exclude, self.model, self.view
        return [
            u
            for u in self.by_id.values()
            if u.id not in exclude
            and view.available(u, now, stale_after_s, age_at)
            and u.serves(model)
        ]


class Policy:
    """One policy: built once from ``Shared``; ``choose`` is called per choice."""

    def __init__(self, shared: Shared):
        self.shared = shared
        # Whether choose reads the request's prompt (Want.blocks, from prompt_blocks):
        # the front then reads every request's body.
        self.reads_prompt = False
        # Whether it learns from answers (``answered``): the core then reports each
        # answered attempt's time to first token. False costs the default path nothing.
        self.learns = False

    def choose(self, want: Want, candidates: Candidates) -> Unit | None:
        """The unit for this request, or None when no candidate can take it. The router
        then counts the request started there (and calls ``moved``)."""
        raise NotImplementedError

    def prompt_blocks(self, text: str) -> list[int]:
        """What ``Want.blocks`` holds for a prompt of ``text`` (with ``reads_prompt``)."""
        return []

    def added(self, unit: Unit) -> None:
        """A unit joined the fleet (it takes requests once it reports)."""

    def reported(self, unit: Unit, report: LoadReport, blocks: PrefixBlocks | None) -> None:
        """A report about to apply (``unit.report`` is still the one before it), and the
        prefix blocks it carried (they are not kept in ``unit.report``)."""

    def moved(self, unit: Unit) -> None:
        """The unit's estimated load changed: a request started or finished there, or a
        report applied."""

    def sent(self, unit: Unit, want: Want, attempt: Timed) -> Sent | None:
        """(With ``learns``.) An attempt of the request is sent to ``unit`` now (counted
        there): what the policy noted of it, handed back to ``answered``."""
        return None

    def answered(self, unit: Unit, want: Want, sent: Sent, ok: bool, per_token_s: float) -> None:
        """(With ``learns``.) The attempt ``sent`` on ``unit`` ended (``ok``: answered;
        its first token's time is the attempt's), its tokens after the first
        ``per_token_s`` apart (-1: not known)."""

    def predicted_ttft(self, unit: Unit, want: Want, ahead: int) -> float:
        """The TTFT in s the policy predicts for ``want`` on ``unit`` with ``ahead``
        requests there before it (a trace's routing span shows it); -1: none."""
        return -1.0

    def limit(self, unit: Unit) -> float:
        """The requests ``unit`` can hold within the latency objective (the fleet's
        saturation is its load over the sum): its capacity, unless the policy learnt
        less."""
        return float(unit.capacity)

    def count_to(self, metrics: GatewayMetrics) -> None:
        """Hand the policy the gateway's metrics, for what it counts itself."""


def create(name: str, shared: Shared) -> Policy:
    """The policy registered under ``name`` (``proxy.registry.POLICIES``)."""
    policy: type[Policy] = importlib.import_module(POLICIES[name].module).POLICY
    return policy(shared)

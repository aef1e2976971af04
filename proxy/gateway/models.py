"""The gateway's ``/v1/models``: vLLM's cards, the union over units, unitproxy's additions
under one key.

Which models there are comes from the units' load reports, so the list answers even
while no unit is SERVING. A card's other fields, as vLLM's server shows them
(``created``, ``owned_by``, ``root``, ``parent``, ``max_model_len``, ``permission``),
come from the ``/v1/models`` of one unit that serves the model, asked when the list is
asked for and kept ``CARD_TTL_S``; a model whose units cannot be asked gets a card made
from its name (``root`` the name, ``max_model_len`` null). What unitproxy adds is under
``unitproxy``: the units that serve the model and whether it is the simulator.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from proxy.gateway.http1.pool import Pool

log = logging.getLogger(__name__)

CARD_TTL_S = 60.0
ASK_TIMEOUT_S = 2.0
VLLM_FIELDS = ("created", "owned_by", "root", "parent", "max_model_len", "permission")


class ModelCards:
    """The cards units showed lately, by model."""

    def __init__(
        self, pool: Callable[[str], Pool | None], clock: Callable[[], float] = time.monotonic
    ):
        self._pool = pool
        self._clock = clock
        self._cards: dict[str, tuple[float, dict[str, Any]]] = {}  # model -> (when, card)

    async def cards(
        self,
        served: dict[str, list[str]],  # model -> the units whose reports list it
        serving: Collection[str],  # the units SERVING now: asked first
        authorization: str | None,
    ) -> list[dict[str, Any]]:
        now = self._clock()
        missing = [
            m for m in served if now - self._cards.get(m, (-CARD_TTL_S, {}))[0] >= CARD_TTL_S
        ]
        asks: dict[str, list[str]] = {}  # unit -> the models it is asked for
        for model in missing:
            units = served[model]
            unit = next((u for u in units if u in serving), None)
            if unit is not None:
                asks.setdefault(unit, []).append(model)
        answers = await asyncio.gather(*(self._ask(u, authorization) for u in asks))
        for models, found in zip(asks.values(), answers, strict=True):
            for model in models:
                if model in found:
                    self._cards[model] = (now, found[model])
        return [self.card(model, units) for model, units in served.items()]

    def card(self, model: str, units: list[str]) -> dict[str, Any]:
        found = self._cards.get(model, (0.0, {}))[1]
        card: dict[str, Any] = {"id": model, "object": "model", "created": int(time.time()),
                                "owned_by": "vllm", "root": model, "parent": None,
                                "max_model_len": None, "permission": []}  # fmt: skip
        card.update((k, found[k]) for k in VLLM_FIELDS if k in found)
        card["unitproxy"] = {"units": units, "simulator": found.get("simulator") is True}
        return card

    async def _ask(self, unit: str, authorization: str | None) -> dict[str, dict[str, Any]]:
        """The cards of ``unit``'s /v1/models by id; none when it does not answer them."""
        pool = self._pool(unit)
        if pool is None:
            return {}
        headers = {"Authorization": authorization} if authorization else {}
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                conn = await pool.request(b"GET", "/v1/models", headers)
                try:
                    status, body = conn.status, await conn.read()
                finally:
                    conn.done()
            data = json.loads(body)["data"] if status == 200 else []
        except Exception as exc:  # unreachable, slow, or an answer not a list of models
            log.info("unit %s: no model cards from its /v1/models: %r", unit, exc)
            return {}
        return {c["id"]: c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)}

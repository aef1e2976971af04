"""Engines the sidecar can embed; ``create_engine`` picks one by its settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.base import Engine
    from proxy.settings import EngineSettings


class EngineUnavailable(Exception):
    """The configured engine kind cannot run in this installation; the message says why."""


def create_engine(settings: EngineSettings) -> Engine:
    if settings.kind == "sim":
        from engine.sim import SimEngine

        return SimEngine(settings.sim, model_name=settings.model)
    raise EngineUnavailable(
        f"engine {settings.kind!r} is not part of this build yet; use --engine sim"
    )

"""Engines the sidecar can embed; ``create_engine`` picks one by its settings.

Each kind lives in its own module, imported only when picked: engine ``vllm`` pulls in
vLLM (and torch) at start, which no other kind, and no test of another kind, pays for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.base import Engine
    from engine.settings import EngineSettings


class EngineUnavailable(Exception):
    """The configured engine cannot run in this installation; the message says why, and
    ``setting`` names the setting to change (``engine.kind`` unless a narrower one)."""

    def __init__(self, message: str, setting: str = "engine.kind"):
        super().__init__(message)
        self.setting = setting


def create_engine(settings: EngineSettings) -> Engine:
    if settings.kind == "sim":
        from engine.sim import SimEngine

        return SimEngine(settings.sim, model_name=settings.served_model_name or settings.model)
    if settings.kind == "vllm":
        from engine.vllm import VllmEngine

        return VllmEngine(settings)
    if settings.kind == "openai":
        from engine.openai_upstream import OpenAIUpstreamEngine

        return OpenAIUpstreamEngine(settings)
    raise EngineUnavailable(f"unknown engine kind {settings.kind!r}; use sim, vllm or openai")

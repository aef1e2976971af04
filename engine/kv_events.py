"""KV cache events, as vLLM's engine publishes them (``vllm.distributed.kv_events``):
a block of the prefix cache stored, blocks removed, the whole cache cleared.

``BlockStored`` names each new block by its hash, chained over every block before it,
with the hash of the block it follows (``parent_block_hash``, None for a prompt's
first block). A subscriber (``Engine.subscribe_kv_events``) gets each batch as it
happens, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    block_size: int  # tokens per block


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEvents = Callable[[list[KVEvent]], None]

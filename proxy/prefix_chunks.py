"""How a prompt's text is named in blocks, the same in every process: by the sidecar
that reports what its engine holds and by every gateway replica that matches a request
against those reports (policy prefix).

The text is the request's canonical prompt text (``proxy.gateway.request.prompt_text``:
every chat message as ``<|role|>\\ncontent\\n``, or the completion prompt), cut into
chunks of ``chunk_chars`` characters; each full chunk is named by a hash chained over
every chunk before it (blake2b, unsalted: hash() differs between processes), so chunk k
matches only when the first k + 1 chunks are the same, as an engine's KV blocks do.

A name is the low 60 bits of the chunk's 8-byte digest (the chain goes on over all 8): a
Python int of 60 bits takes 32 bytes, one of 64 bits 48 (36 rounded up by the
allocator), and a gateway keeps one for every chunk any unit holds (at 5,000 units of
512 chunks, 2.5 M of them). Collisions stay negligible (about 1 in 370,000 that any two
of 2.5 M names meet). Names of sidecars from before (all 64 bits) match no gateway of
since: affinity from the engines' word waits for both to be upgraded.
"""

from __future__ import annotations

from hashlib import blake2b

NAME_MASK = (1 << 60) - 1


def chunk_hashes(text: str, chunk_chars: int, max_chunks: int) -> list[int]:
    """The chained hashes of ``text``'s full chunks (at most ``max_chunks``)."""
    end = min(len(text), chunk_chars * max_chunks)
    hashes: list[int] = []
    previous = b""
    for start in range(0, end - chunk_chars + 1, chunk_chars):
        chunk = text[start : start + chunk_chars].encode("utf-8", "surrogatepass")
        previous = blake2b(previous + chunk, digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "little") & NAME_MASK)
    return hashes

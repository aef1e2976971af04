"""Ids of stored responses (the Responses API) that name the unit that stores them.

A response stored on a unit (``store``, the default) lives only there: a follow-up
that names it (``previous_response_id``, ``GET /v1/responses/{id}``, cancel) must go
back to that unit. The sidecar makes the id (vLLM's ``request_id`` field, which its
server takes as the response's id) as ``resp_<32 hex>_u<unit id in hex>``, so any
gateway replica, restarted or not, reads the unit from the id alone: no map to keep,
share between replicas or lose; the client sees an opaque id as OpenAI's are.
"""

from __future__ import annotations

import uuid

PREFIX = "resp_"
UNIT_MARK = "_u"  # hex has no "_": the last one starts the unit


def new_response_id(unit_id: str) -> str:
    return f"{PREFIX}{uuid.uuid4().hex}{UNIT_MARK}{unit_id.encode().hex()}"


def unit_of(response_id: str) -> str | None:
    """The unit id a response id names; None for an id not made by ``new_response_id``."""
    if not response_id.startswith(PREFIX):
        return None
    at = response_id.rfind(UNIT_MARK)
    if at < 0:
        return None
    try:
        unit = bytes.fromhex(response_id[at + len(UNIT_MARK) :]).decode()
    except ValueError:  # not hex, or not UTF-8
        return None
    return unit or None

"""Resume hints: a unit continues a request that another unit started and failed.

A gateway that moves a request after its first byte sends it again with the output
already delivered to the client appended to its input (to the prompt text, to the
prompt token ids, or as a final assistant message with ``continue_final_message``)
and the header (gRPC: metadata key) ``x-unitproxy-resume`` holding compact JSON::

    {"created": 1718000000, "delivered_chars": 412}   text prompt or chat
    {"delivered_tokens": 96}                          prompt token ids (gRPC)

The unit then answers with the rest of the first attempt's response, so the client
sees one response: ``max_tokens`` (``max_completion_tokens``) and ``min_tokens`` are
reduced by the delivered tokens, the usage counts them as completion tokens (not
prompt tokens), every chunk carries the hint's ``created``, and a resumed chat stream
has no role chunk. A hint that does not fit its request is 400 naming the header.

Only a gateway may give one: the hint carries ``"sig"``, an HMAC-SHA256 (``HintKey``)
under ``server.resume_secret``, a secret the fleet's gateways and sidecars share and
clients never hold, over the hint's counts, its ``created`` and the delivered output
itself (the text, or the token ids). A unit checks it before the hint changes anything:
a hint with no signature, a wrong one, or one for other output is 403 (code
``resume_forbidden``), and so is every hint at a unit without the secret: it cannot
tell a gateway from a client, and a hint it ignored would be served as a new request
whose output does not continue the client's stream. So a client cannot move its prompt
tokens into completion tokens, set ``created`` or skip engine work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.errors import Forbidden, InvalidRequest
from proxy.httputil import RESUME_HEADER
from proxy.openai_api import MAX_INT64, ParsedRequest


@dataclass(frozen=True, slots=True)
class ResumeHint:
    """One ``x-unitproxy-resume`` value; exactly one of the two counts is set.

    ``created``: the ``created`` the client already has (HTTP); None: the unit's clock.
    ``delivered_chars``: how many characters at the end of the prompt (completions) or
    of the final assistant message (chat) are output already delivered.
    ``delivered_tokens``: how many ids at the end of ``prompt_token_ids`` are.
    ``sig``: the gateway's signature (``HintKey``); None: unsigned.
    """

    created: int | None = None
    delivered_chars: int | None = None
    delivered_tokens: int | None = None
    sig: str | None = None


class HintKey:
    """``server.resume_secret``: signs hints (and a request's ``interactive`` class) at a
    gateway and checks them at a unit."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str):
        self._secret = secret.encode()

    def sign(self, hint: ResumeHint, delivered: str | Sequence[int]) -> str:
        """The header value of ``hint`` (its ``sig`` ignored) for ``delivered``, the
        output it says was delivered: text, or token ids."""
        raw: dict[str, Any] = {"sig": self._mac(hint, delivered)}
        for key in ("created", "delivered_chars", "delivered_tokens"):
            value = getattr(hint, key)
            if value is not None:
                raw[key] = value
        return json.dumps(raw, separators=(",", ":"))

    def valid(self, hint: ResumeHint, delivered: str | Sequence[int]) -> bool:
        return hint.sig is not None and hmac.compare_digest(hint.sig, self._mac(hint, delivered))

    def sign_priority(self, request_id: str, priority: str) -> str:
        """The ``x-unitproxy-priority-sig`` of a request a gateway sends a unit in class
        ``priority`` (``x-unitproxy-priority``) under ``request_id`` (``x-request-id``):
        a unit grants ``interactive`` only with it."""
        message = f"unitproxy-priority-v1\n{request_id}\n{priority}".encode(errors="surrogatepass")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def valid_priority(self, request_id: str, priority: str, sig: str) -> bool:
        # compare_digest takes str of ASCII only: a client's header may be anything
        return sig.isascii() and hmac.compare_digest(sig, self.sign_priority(request_id, priority))

    def _mac(self, hint: ResumeHint, delivered: str | Sequence[int]) -> str:
        counts = (hint.created, hint.delivered_chars, hint.delivered_tokens)
        head = "unitproxy-resume-v1\n" + " ".join("" if c is None else str(c) for c in counts)
        body = delivered if isinstance(delivered, str) else ",".join(map(str, delivered))
        message = f"{head}\n{body}".encode(errors="surrogatepass")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()


def check_signed(key: HintKey | None, hint: ResumeHint, delivered: str | Sequence[int]) -> None:
    """Raises Forbidden unless ``hint`` is signed by ``key`` for ``delivered``."""
    if key is None:
        raise Forbidden(
            f"header {RESUME_HEADER}: this unit has no server.resume_secret, so it takes "
            "no resume hint",
            code="resume_forbidden",
        )
    if not key.valid(hint, delivered):
        raise Forbidden(
            f"header {RESUME_HEADER}: not signed by a gateway of this fleet",
            code="resume_forbidden",
        )


def _invalid(problem: str) -> InvalidRequest:
    return InvalidRequest(f"header {RESUME_HEADER}: {problem}", param=RESUME_HEADER)


def _count(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT64:
        raise _invalid(f"{key} must be a whole number from 0")
    return value


def parse_hint(value: str | None) -> ResumeHint | None:
    """The hint in a header value; None when there is none. Raises InvalidRequest."""
    if value is None:
        return None
    try:
        raw = json.loads(value)
    except ValueError:
        raise _invalid("not valid JSON") from None
    if not isinstance(raw, dict):
        raise _invalid("must be a JSON object")
    sig = raw.get("sig")
    if sig is not None and not isinstance(sig, str):
        raise _invalid("sig must be a string")
    hint = ResumeHint(
        _count(raw, "created"), _count(raw, "delivered_chars"), _count(raw, "delivered_tokens"), sig
    )
    if (hint.delivered_chars is None) == (hint.delivered_tokens is None):
        raise _invalid("exactly one of delivered_chars and delivered_tokens is required")
    return hint


def _delivered_text(parsed: ParsedRequest, chars: int) -> str:
    """The last ``chars`` characters of the input, checked against the request."""
    request = parsed.engine_request
    if request.prompt_token_ids is not None:
        raise _invalid("a prompt of token ids resumes with delivered_tokens")
    if request.messages is not None:
        if not request.continue_final_message or request.messages[-1].role != "assistant":
            raise _invalid("a chat request resumes a final assistant message that it continues")
        text = request.messages[-1].content
    else:
        text = request.prompt or ""
    if chars > len(text):
        raise _invalid(f"delivered_chars ({chars}) is more than the input has ({len(text)})")
    return text[len(text) - chars :]


async def _delivered_tokens(
    parsed: ParsedRequest,
    hint: ResumeHint,
    count_tokens: Callable[[str], Awaitable[int]],
    key: HintKey | None,
) -> int:
    if hint.delivered_tokens is None:
        text = _delivered_text(parsed, hint.delivered_chars or 0)
        check_signed(key, hint, text)
        return await count_tokens(text) if text else 0
    ids = parsed.engine_request.prompt_token_ids
    if ids is None:
        raise _invalid("delivered_tokens is for a prompt of token ids; text resumes by chars")
    if hint.delivered_tokens > len(ids):
        raise _invalid(
            f"delivered_tokens ({hint.delivered_tokens}) is more than the prompt has ({len(ids)})"
        )
    check_signed(key, hint, ids[len(ids) - hint.delivered_tokens :])
    return hint.delivered_tokens


async def resume(
    parsed: ParsedRequest,
    hint: ResumeHint,
    count_tokens: Callable[[str], Awaitable[int]],
    key: HintKey | None,
) -> ParsedRequest:
    """``parsed`` as the rest of the request that ``hint`` continues; Forbidden unless
    ``key`` signed the hint for the output it names.

    ``count_tokens`` is the engine's: the delivered text counts as the tokens the
    engine makes of it. A ``max_tokens`` the delivered output used up becomes 0 (the
    engine then ends at once with finish_reason "length"); no ``max_tokens`` stays
    none: the engine's own limit applies to the rest.
    """
    delivered = await _delivered_tokens(parsed, hint, count_tokens, key)
    request = parsed.engine_request
    sampling = request.sampling
    max_tokens = sampling.max_tokens
    sampling = dataclasses.replace(
        sampling,
        max_tokens=None if max_tokens is None else max(0, max_tokens - delivered),
        min_tokens=max(0, sampling.min_tokens - delivered),
    )
    return dataclasses.replace(
        parsed,
        engine_request=dataclasses.replace(request, sampling=sampling),
        created=hint.created,
        delivered_tokens=delivered,
    )

"""API keys for inference routes: 'Authorization: Bearer KEY' on HTTP, the same in gRPC metadata.

Keys are compared in constant time and never logged; with no key configured the
routes are open.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Iterable, Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.errors import Unauthenticated
from proxy.httputil import REQUEST_ID_HEADER, Handler, error_response, id_to_answer
from proxy.ingress import guard_of
from proxy.settings import ServerSettings

BEARER = "Bearer "


class ApiKeys:
    def __init__(
        self,
        keys: Iterable[str] = (),
        identify: Callable[[str | None], object] | None = None,
        unit_id: str | None = None,
    ):
        self._keys = tuple(k.encode() for k in keys if k)
        # With tenants (proxy/tenants.py): their lookup decides instead of the flat list.
        self._identify = identify
        self.unit_id = unit_id  # the x-unitproxy-unit of a refusal from the head

    @classmethod
    async def load(cls, server: ServerSettings, unit_id: str | None = None) -> ApiKeys:
        return cls(await flat_keys(server), unit_id=unit_id)

    @property
    def enabled(self) -> bool:
        return bool(self._keys) or self._identify is not None

    def check(self, authorization: str | None) -> None:
        """Raise Unauthenticated unless ``authorization`` carries a known key."""
        if self._identify is not None:
            self._identify(authorization)
            return
        if not self._keys:
            return
        if not authorization or not authorization.startswith(BEARER):
            raise Unauthenticated(
                "an API key is required: 'Authorization: Bearer KEY'", code="missing_api_key"
            )
        given = authorization.removeprefix(BEARER).encode()
        # Compare against every key, so timing says nothing about which one matched.
        if not any([hmac.compare_digest(given, key) for key in self._keys]):
            raise Unauthenticated("the API key is not valid", code="invalid_api_key")

    def check_metadata(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> None:
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        self.check(value.decode(errors="replace") if isinstance(value, bytes) else value)

    async def expect_handler(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: check the key from the head before inviting the body."""
        try:
            self.check(request.headers.get("Authorization"))
        except Unauthenticated as exc:
            guard = guard_of(request)
            if guard is not None:
                guard.refused()
            request_id = id_to_answer(request.headers.get(REQUEST_ID_HEADER))
            response = error_response(exc, request_id, self.unit_id)
            response.force_close()
            return response
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # as aiohttp's own handler does
        return None

    def middleware(self, prefix: str = "/v1/") -> Middleware:
        """Require a key on paths under ``prefix``; health, readiness and metrics stay open."""

        @web.middleware
        async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path.startswith(prefix):
                self.check(request.headers.get("Authorization"))
            return await handler(request)

        return require_key


async def flat_keys(server: ServerSettings) -> list[str]:
    """server.api_keys and the keys of server.api_keys_file."""
    keys = [k.get_secret_value() for k in server.api_keys]
    if server.api_keys_file is not None:
        keys += _read_keys(await asyncio.to_thread(server.api_keys_file.read_text))
    return keys


def _read_keys(text: str) -> list[str]:
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]

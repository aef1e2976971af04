"""TLS material, read once at startup (off the event loop), for servers and clients."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from proxy.settings import ServerSettings


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """A server's certificate chain and key, for the HTTP and the gRPC server."""

    ssl_context: ssl.SSLContext
    grpc_credentials: grpc.ServerCredentials

    @classmethod
    async def load(cls, cert_file: Path, key_file: Path) -> ServerTLS:
        return await asyncio.to_thread(cls._load, cert_file, key_file)

    @classmethod
    def _load(cls, cert_file: Path, key_file: Path) -> ServerTLS:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(cert_file, key_file)
        credentials = grpc.ssl_server_credentials([(key_file.read_bytes(), cert_file.read_bytes())])
        return cls(context, credentials)


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """What a client trusts to reach units over TLS: a CA bundle, or the system's."""

    ssl_context: ssl.SSLContext
    grpc_credentials: grpc.ChannelCredentials

    @classmethod
    async def load(cls, ca_file: Path | None) -> ClientTLS:
        return await asyncio.to_thread(cls._load, ca_file)

    @classmethod
    def _load(cls, ca_file: Path | None) -> ClientTLS:
        context = ssl.create_default_context(cafile=ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        ca = ca_file.read_bytes() if ca_file else None
        return cls(context, grpc.ssl_channel_credentials(root_certificates=ca))


async def server_tls(server: ServerSettings) -> ServerTLS | None:
    """The server's TLS material when configured, else None (plain)."""
    if server.tls_cert_file is None or server.tls_key_file is None:
        return None
    return await ServerTLS.load(server.tls_cert_file, server.tls_key_file)

"""Real unitproxy processes for tests: started on loopback with free ports, always stopped."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from pathlib import Path

from proxy import procutil
from proxy.procutil import Child as Proc

__all__ = ["HOST", "Proc", "Procs", "free_ports"]

ADDRESS = re.compile(rb"gRPC health (\S+), HTTP (\S+),")
HOST = "127.0.0.1"
START_TIMEOUT_S = 15.0  # a follower logs its addresses within this
READY_TIMEOUT_S = 20.0  # a sidecar or gateway answers GET /ready with 200 within this
STOP_TIMEOUT_S = 5.0  # SIGTERM, then SIGKILL after this
# The test fleet's server.resume_secret: its gateways move streams, its sidecars take
# their hints (tests/conftest.py gives in-process servers the same).
RESUME_SECRET = "test-fleet-resume-secret"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago, below the ephemeral range (so no
    outgoing connection nor another process's bind(0) takes one before it is used)."""
    return procutil.free_ports(n, HOST)


class Procs:
    """Starts processes for one test; ``stop_all`` ends every one of them."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.started: list[Proc] = []

    async def start(self, *args: str, name: str = "proc") -> Proc:
        """``python -m proxy ARGS``, its output in the test's directory."""
        log = self.workdir / f"{name}-{len(self.started)}.log"
        env = {"UNITPROXY_SERVER__RESUME_SECRET": RESUME_SECRET}
        proc = await procutil.start(name, procutil.python_m(*args), log, env=env)
        self.started.append(proc)
        return proc

    async def follower(self, *args: str, worker: list[str] | None = None) -> Proc:
        """A follower agent on free loopback ports; returns once its addresses are known."""
        argv = ["follower", "--host", HOST, "--http-port", "0", "--grpc-port", "0", *args]
        if worker:
            argv += ["--", *worker]
        proc = await self.start(*argv, name="follower")
        match = await proc.wait_for_line(ADDRESS, START_TIMEOUT_S)
        proc.grpc_target, proc.http_url = match[1].decode(), match[2].decode()
        return proc

    async def sidecar(self, http_port: int, grpc_port: int, *args: str) -> Proc:
        """A sidecar process on fixed loopback ports; returns once /ready says 200."""
        return await self._serving("sidecar", http_port, grpc_port, args)

    async def gateway(self, http_port: int, grpc_port: int, *args: str) -> Proc:
        return await self._serving("gateway", http_port, grpc_port, args)

    async def _serving(
        self, role: str, http_port: int, grpc_port: int, args: tuple[str, ...]
    ) -> Proc:
        ports = ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
        proc = await self.start(role, "--host", HOST, *ports, *args, name=role)
        proc.http_url, proc.grpc_target = f"http://{HOST}:{http_port}", f"{HOST}:{grpc_port}"
        await proc.until_ready(READY_TIMEOUT_S)
        return proc

    async def stop_all(self) -> None:
        for proc in reversed(self.started):
            await proc.stop(STOP_TIMEOUT_S)


class BlackHole:
    """A TCP server that accepts connections and reads them, and never writes a byte.

    Its own accept loop on a plain socket, not ``asyncio.start_server``: there, a
    connection the loop accepted just before ``Server.close()`` gets its handler (and
    its writer) only a few loop turns later, and Python 3.11's ``wait_closed`` does not
    wait for it, so such a connection outlived the test and its loop. Here every
    accepted socket is in ``_conns`` the moment the accept returns, and ``close``
    ends the accept loop itself before closing the listener."""

    def __init__(self) -> None:
        self.accepted = 0
        self._listener = socket.socket()
        self._conns: list[socket.socket] = []
        self._readers: list[asyncio.Task[None]] = []
        self._accepting: asyncio.Task[None] | None = None
        self._closing = False

    async def start(self) -> str:
        self._listener.bind((HOST, 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._accepting = asyncio.create_task(self._accept())
        return f"{HOST}:{self.port}"

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    async def _accept(self) -> None:
        # Never cancelled: a cancelled sock_accept may drop a socket it had accepted.
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            self._conns.append(conn)
            if self._closing:
                return
            self.accepted += 1
            self._readers.append(asyncio.create_task(self._swallow(conn)))

    async def _swallow(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ConnectionError):
            while await loop.sock_recv(conn, 65536):
                pass

    async def close(self) -> None:
        if self._accepting is None:  # never started
            self._listener.close()
            return
        self._closing = True
        # Wake the accept loop with one more connection; it sees _closing and ends.
        loop = asyncio.get_running_loop()
        with socket.socket() as poke:
            poke.setblocking(False)
            await loop.sock_connect(poke, self._listener.getsockname())
            await self._accepting
        # Connections still in the backlog go with the listener, never seen by Python.
        self._listener.close()
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        for conn in self._conns:
            conn.close()

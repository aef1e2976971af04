"""Real unitproxy processes for tests: started on loopback with free ports, always stopped."""

from __future__ import annotations

import re
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

"""Real unitproxy processes for tests: started on loopback with free ports, always stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp

from proxy import procutil

ADDRESS = re.compile(rb"gRPC health (\S+), HTTP (\S+),")
HOST = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago, below the ephemeral range (so no
    outgoing connection nor another process's bind(0) takes one before it is used)."""
    return procutil.free_ports(n, HOST)


class Proc:
    """One child process whose output goes to a log file the test can read."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path):
        self.proc = proc
        self.log = log
        self.grpc_target = ""
        self.http_url = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    async def wait(self, timeout_s: float = 10.0) -> int:
        async with asyncio.timeout(timeout_s):
            return await self.proc.wait()

    async def stop(self) -> None:
        if self.proc.returncode is not None:
            return
        self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.signal(signal.SIGTERM)
        try:
            await self.wait(5.0)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.proc.wait()


class Procs:
    """Starts processes for one test; ``stop_all`` ends every one of them."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.started: list[Proc] = []

    async def start(self, *args: str, name: str = "proc") -> Proc:
        log = self.workdir / f"{name}-{len(self.started)}.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy", *args,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
            )  # fmt: skip
        started = Proc(proc, log)
        self.started.append(started)
        return started

    async def follower(self, *args: str, worker: list[str] | None = None) -> Proc:
        """A follower agent on free loopback ports; returns once its addresses are known."""
        argv = ["follower", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", *args]
        if worker:
            argv += ["--", *worker]
        proc = await self.start(*argv, name="follower")
        async with asyncio.timeout(15):
            while not (match := ADDRESS.search(proc.log.read_bytes())):
                if proc.proc.returncode is not None:
                    raise AssertionError(f"follower exited early:\n{proc.output()}")
                await asyncio.sleep(0.02)
        proc.grpc_target, proc.http_url = match[1].decode(), match[2].decode()
        return proc

    async def sidecar(self, http_port: int, grpc_port: int, *args: str) -> Proc:
        """A sidecar process on fixed loopback ports; returns once /ready says 200."""
        proc = await self.start("sidecar", "--host", HOST, "--http-port", str(http_port),
                                "--grpc-port", str(grpc_port), *args, name="sidecar")  # fmt: skip
        proc.http_url, proc.grpc_target = f"http://{HOST}:{http_port}", f"{HOST}:{grpc_port}"
        await self.until_ready(proc)
        return proc

    async def gateway(self, http_port: int, grpc_port: int, *args: str) -> Proc:
        proc = await self.start("gateway", "--host", HOST, "--http-port", str(http_port),
                                "--grpc-port", str(grpc_port), *args, name="gateway")  # fmt: skip
        proc.http_url, proc.grpc_target = f"http://{HOST}:{http_port}", f"{HOST}:{grpc_port}"
        await self.until_ready(proc)
        return proc

    async def until_ready(self, proc: Proc, timeout_s: float = 20.0) -> None:
        async with aiohttp.ClientSession() as http, asyncio.timeout(timeout_s):
            while True:
                if proc.proc.returncode is not None:
                    raise AssertionError(f"process exited early:\n{proc.output()}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{proc.http_url}/ready") as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.05)

    async def stop_all(self) -> None:
        for proc in reversed(self.started):
            await proc.stop()

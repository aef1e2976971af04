"""Requests/s and streamed chunks/s of ONE sidecar on a zero-delay simulated engine.

Starts ``python -m proxy sidecar --engine sim`` on 127.0.0.1 with every simulated cost
at 0 ms, so what is measured is the sidecar itself: parsing, admission, the engine
loop, encoding and the wire. This process drives it with a closed loop of C workers
(asyncio + aiohttp / grpc.aio, on uvloop when installed) in three scenarios:

    completions  POST /v1/completions, max_tokens=16               -> requests/s
    stream       POST /v1/completions, stream, max_tokens=64       -> requests/s, chunks/s
    grpc         unitproxy.v1.Inference/Generate, max_tokens=64    -> streams/s, messages/s
                 (tokens that waited on a write are merged into one message)

Each run (scenario x concurrency) warms up, then measures a fixed window. Only
requests that finish successfully inside the window count (with all their chunks);
errors count over the whole run. TTFT is client-side: send to first SSE event or gRPC
message (for non-streaming requests, to the whole response). Sidecar CPU is the
child's utime+stime from /proc/<pid>/stat across the window. Every response is
checked (status, chunk count, finish reason, [DONE]); a run with errors says so.

Client and sidecar share this machine's cores: the client CPU column shows how much
the load generator itself took.

    .venv/bin/python bench/sidecar_throughput.py            # about a minute on 2 cores
    .venv/bin/python bench/sidecar_throughput.py --quick    # smoke run
    .venv/bin/python bench/sidecar_throughput.py --scenarios grpc --concurrency 1,64 \\
        --sidecar-arg=--log-level=warning
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a file: make the bench package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import grpc

from bench.common import (
    Interrupted,
    cpu_model,
    free_ports,
    interrupt,
    loop_name,
    run_loop,
    until_signal,
)
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "sidecar_throughput.json"
QUICK_OUT = DEFAULT_OUT.with_suffix(".quick.json")  # a smoke run keeps the full results
HOST = "127.0.0.1"
PROMPT = "Benchmark the sidecar with this short prompt"
READY_TIMEOUT_S = 30.0  # the sidecar must report SERVING within this
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this
REQUEST_TIMEOUT_S = 10.0  # one request, end to end; also the drain grace after a window
IDLE_TIMEOUT_S = 2.0  # after a run, the sidecar must show 0 outstanding within this
MAX_LOG_LINES = 100  # sidecar warnings kept in the JSON
PRINTED_LOG_LINES = 10  # and printed
BUSY_LOADAVG = 0.5  # a 1-min load average above this before the run gets a warning

T = TypeVar("T")
# Every timestamp: uvloop's loop.time() has only millisecond resolution.
now = time.perf_counter


# -- one request ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request: time to first chunk, chunks seen, or what was wrong."""

    ttft_s: float = 0.0
    chunks: int = 0
    error: str | None = None


RequestFn = Callable[[], Awaitable[Outcome]]
ClientFactory = Callable[[str, str, int], AbstractAsyncContextManager[RequestFn]]


def _completion_body(max_tokens: int, stream: bool) -> bytes:
    # No "model": the sidecar's served model.
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}
    return json.dumps(body).encode()


async def _http_error(resp: aiohttp.ClientResponse) -> Outcome:
    try:
        code = (await resp.json(content_type=None))["error"]["code"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        code = "?"
    return Outcome(error=f"http {resp.status} {code}")


async def complete(
    session: aiohttp.ClientSession, url: str, body: bytes, max_tokens: int
) -> Outcome:
    """A non-streaming completion; TTFT is the time to the whole response."""
    sent = now()
    headers = {"Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            return await _http_error(resp)
        data = json.loads(await resp.read())
        ttft = now() - sent
    choice = data["choices"][0]
    got = data["usage"]["completion_tokens"]
    if got != max_tokens or choice["finish_reason"] != "length" or not choice["text"]:
        return Outcome(error=f"completion: {got} tokens, finish {choice['finish_reason']!r}")
    return Outcome(ttft, 0)


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: bytes, max_tokens: int
) -> Outcome:
    """A streamed completion: counts SSE data events other than [DONE]."""
    sent = now()
    ttft, chunks, done, last = 0.0, 0, False, b""
    headers = {"Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            return await _http_error(resp)
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if done:
                return Outcome(error="stream: data after [DONE]")
            if line.startswith(b"data: [DONE]"):
                done = True
                continue
            if chunks == 0:
                ttft = now() - sent
            chunks += 1
            last = line
    return _check_stream(ttft, chunks, done, last, max_tokens)


def _check_stream(ttft: float, chunks: int, done: bool, last: bytes, want: int) -> Outcome:
    if not done:
        return Outcome(error=f"stream: no [DONE] after {chunks} chunks")
    if chunks != want:
        return Outcome(error=f"stream: {chunks} chunks, want {want}")
    reason = json.loads(last[len(b"data: ") :])["choices"][0]["finish_reason"]
    if reason != "length":
        return Outcome(error=f"stream: last finish_reason {reason!r}")
    return Outcome(ttft, chunks)


async def generate(
    stub: inference_pb2_grpc.InferenceStub, request: inference_pb2.GenerateRequest, want: int
) -> Outcome:
    """One gRPC Generate stream: counts messages and tokens, checks the last message and
    the status. Token deltas that waited on a write go out merged in one message, so a
    stream has up to ``want`` messages and exactly ``want`` tokens."""
    sent = now()
    ttft, chunks, tokens = 0.0, 0, 0
    last: inference_pb2.GenerateChunk | None = None
    try:
        async for chunk in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            if chunks == 0:
                ttft = now() - sent
            chunks += 1
            tokens += len(chunk.token_ids)
            last = chunk
    except grpc.aio.AioRpcError as exc:
        return Outcome(error=f"grpc {exc.code().name}: {exc.details()}"[:120])
    if tokens != want or last is None or not 1 <= chunks <= want:
        return Outcome(error=f"grpc: {tokens} tokens in {chunks} messages, want {want} tokens")
    if last.finish_reason != "length" or last.usage.completion_tokens != want:
        return Outcome(error=f"grpc: last finish_reason {last.finish_reason!r}")
    return Outcome(ttft, chunks)


# -- clients, one per run -------------------------------------------------------------


def _http_client(stream: bool, max_tokens: int) -> ClientFactory:
    send = stream_completion if stream else complete

    @asynccontextmanager
    async def open_client(http_url: str, _: str, concurrency: int) -> AsyncIterator[RequestFn]:
        connector = aiohttp.TCPConnector(limit=concurrency)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            url, body = f"{http_url}/v1/completions", _completion_body(max_tokens, stream)
            yield lambda: send(session, url, body, max_tokens)

    return open_client


def _grpc_client(max_tokens: int) -> ClientFactory:
    @asynccontextmanager
    async def open_client(_: str, grpc_target: str, concurrency: int) -> AsyncIterator[RequestFn]:
        # One channel (one HTTP/2 connection) carries all workers' streams.
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.GenerateRequest(
                prompt=PROMPT, sampling=inference_pb2.SamplingParams(max_tokens=max_tokens)
            )
            yield lambda: generate(stub, request, max_tokens)

    return open_client


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    open_client: ClientFactory


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("completions", "POST /v1/completions max_tokens=16", _http_client(False, 16)),
        Scenario("stream", "POST /v1/completions stream max_tokens=64", _http_client(True, 64)),
        Scenario("grpc", "gRPC Inference/Generate max_tokens=64", _grpc_client(64)),
    )
}  # fmt: skip


# -- one run: closed loop, warm-up, measured window -----------------------------------


@dataclass(slots=True)
class Tally:
    """What one run saw. Successes count only when they finish inside the window."""

    window_start: float
    window_end: float
    max_requests: int
    started: int = 0
    requests: int = 0
    chunks: int = 0
    ttfts: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    def record(self, outcome: Outcome, finished_at: float) -> None:
        if outcome.error is not None:
            self.errors[outcome.error] += 1
        elif self.window_start <= finished_at <= self.window_end:
            self.requests += 1
            self.chunks += outcome.chunks
            self.ttfts.append(outcome.ttft_s)


async def worker(request: RequestFn, tally: Tally) -> None:
    while now() < tally.window_end and tally.started < tally.max_requests:
        tally.started += 1
        try:
            outcome = await request()
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError) as exc:
            outcome = Outcome(error=f"{type(exc).__name__}: {exc}"[:120])
        tally.record(outcome, now())


@dataclass(frozen=True)
class Usage:
    """CPU seconds used so far by the sidecar and by this process, at a ``now()`` time."""

    at: float
    sidecar_s: float
    client_s: float

    @classmethod
    def take(cls, sidecar_pid: int) -> Usage:
        return cls(now(), proc_cpu_s(sidecar_pid), time.process_time())


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    # Fields after "comm)": state is field 3, so utime (14) and stime (15) sit at 11, 12.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class RunResult:
    scenario: str
    concurrency: int
    window_s: float
    requests: int
    chunks: int
    ttft_ms: dict[str, float | None]
    sidecar_cpu_s: float
    client_cpu_s: float
    errors: dict[str, int]
    outstanding_after: int | None  # the sidecar's count once idle; anything but 0 leaked

    @property
    def error_count(self) -> int:
        return sum(self.errors.values()) + (self.outstanding_after != 0)

    def rate(self, count: float) -> float:
        return count / self.window_s if self.window_s > 0 else 0.0

    def per(self, cpu_s: float, count: int, scale: int = 1) -> float | None:
        return cpu_s * 1000 * scale / count if count else None

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "requests_per_s": self.rate(self.requests),
            "chunks_per_s": self.rate(self.chunks),
            "sidecar_cpu_pct": 100 * self.rate(self.sidecar_cpu_s),
            "client_cpu_pct": 100 * self.rate(self.client_cpu_s),
            "sidecar_cpu_ms_per_request": self.per(self.sidecar_cpu_s, self.requests),
            "sidecar_cpu_ms_per_1k_chunks": self.per(self.sidecar_cpu_s, self.chunks, 1000),
            "error_count": self.error_count,
        }


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


async def measure(
    scenario: Scenario, concurrency: int, sidecar: RunningSidecar, settings: BenchSettings
) -> RunResult:
    async with scenario.open_client(sidecar.http_url, sidecar.grpc_target, concurrency) as request:
        start = now() + settings.warmup_s
        tally = Tally(start, start + settings.duration_s, settings.max_requests)
        workers = [asyncio.create_task(worker(request, tally)) for _ in range(concurrency)]
        try:
            await asyncio.sleep(start - now())
            before = Usage.take(sidecar.pid)
            # Returns early only when the request cap stopped every worker.
            await asyncio.wait(workers, timeout=tally.window_end - now())
            after = Usage.take(sidecar.pid)
            await drain(workers, REQUEST_TIMEOUT_S)
        finally:
            await cancel(workers)
    return RunResult(
        scenario=scenario.name,
        concurrency=concurrency,
        window_s=after.at - before.at,
        requests=tally.requests,
        chunks=tally.chunks,
        ttft_ms={f"p{p}": _ms(percentile(tally.ttfts, p)) for p in (50, 99)},
        sidecar_cpu_s=after.sidecar_s - before.sidecar_s,
        client_cpu_s=after.client_s - before.client_s,
        errors=dict(tally.errors),
        outstanding_after=await outstanding_when_idle(sidecar.http_url),
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


async def drain(workers: list[asyncio.Task[None]], grace_s: float) -> None:
    """Let requests in flight at the window's end finish (uncounted), within a bound."""
    await asyncio.wait(workers, timeout=grace_s)
    for task in workers:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]  # a bug in this benchmark


async def cancel(workers: list[asyncio.Task[None]]) -> None:
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)


async def outstanding_when_idle(http_url: str) -> int | None:
    """The sidecar's outstanding count, polled until 0 or IDLE_TIMEOUT_S; None if unreadable."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + IDLE_TIMEOUT_S
    timeout = aiohttp.ClientTimeout(total=IDLE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            try:
                async with session.get(f"{http_url}/load") as resp:
                    outstanding = int((await resp.json())["outstanding"])
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                return None
            if outstanding == 0 or loop.time() > deadline:
                return outstanding
            await asyncio.sleep(0.05)


async def run_all(sidecar: RunningSidecar, settings: BenchSettings) -> list[RunResult]:
    results = []
    for name in settings.scenarios:
        for concurrency in settings.concurrency:
            sidecar.check_alive()
            print(f"  {name} c={concurrency} ...", file=sys.stderr, flush=True)
            results.append(await measure(SCENARIOS[name], concurrency, sidecar, settings))
    sidecar.check_alive()
    return results


# -- the sidecar, a child process -----------------------------------------------------


class SidecarFailed(Exception):
    pass


@dataclass
class RunningSidecar:
    process: subprocess.Popen[bytes]
    argv: list[str]
    http_url: str
    grpc_target: str
    log_path: Path
    exit_code: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise SidecarFailed(f"the sidecar exited with {code}; see {self.log_path}")

    def log_problems(self) -> list[str]:
        """Log lines at WARNING or above, and tracebacks, from the sidecar's log."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        marks = (" WARNING ", " ERROR ", " CRITICAL ", "Traceback")
        return [line for line in lines if any(m in line for m in marks)]


def sidecar_argv(http_port: int, grpc_port: int, slots: int, extra: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-m", "proxy", "sidecar",
        "--host", HOST, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--engine", "sim",
        "--sim-decode-step-ms", "0", "--sim-prefill-ms-per-token", "0",
        "--sim-decode-ms-per-seq", "0",
        "--capacity", str(slots), "--sim-max-num-seqs", str(slots),
        *extra,
    ]  # fmt: skip


@contextmanager
def running_sidecar(slots: int, extra: Sequence[str], log_path: Path) -> Iterator[RunningSidecar]:
    """Start the sidecar, wait until it is ready, and always stop it."""
    http_port, grpc_port = free_ports(2)
    argv = sidecar_argv(http_port, grpc_port, slots, extra)
    with log_path.open("wb") as log:
        # Its own session: Ctrl-C reaches only us, and we stop it the one way below.
        process = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        sidecar = RunningSidecar(
            process, argv, f"http://{HOST}:{http_port}", f"{HOST}:{grpc_port}", log_path
        )
        try:
            wait_ready(sidecar, READY_TIMEOUT_S)
            yield sidecar
        finally:
            sidecar.exit_code = stop(process, STOP_TIMEOUT_S)


def wait_ready(sidecar: RunningSidecar, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sidecar.check_alive()
        try:
            with urllib.request.urlopen(f"{sidecar.http_url}/ready", timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 until SERVING
        time.sleep(0.1)
    raise SidecarFailed(f"the sidecar was not ready within {timeout_s:g} s; see {sidecar.log_path}")


def stop(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
    try:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            return process.wait(timeout=timeout_s)
        return process.returncode
    except subprocess.TimeoutExpired:
        print(f"sidecar ignored SIGTERM for {timeout_s:g} s; killing it", file=sys.stderr)
        return _kill(process)
    except BaseException:  # Ctrl-C or SIGTERM while waiting: do not leave it behind
        _kill(process)
        raise


def _kill(process: subprocess.Popen[bytes]) -> int:
    process.kill()
    return process.wait()


# -- settings, machine, report --------------------------------------------------------


@dataclass(frozen=True)
class BenchSettings:
    duration_s: float
    warmup_s: float
    concurrency: tuple[int, ...]
    scenarios: tuple[str, ...]
    max_requests: int
    out: Path
    sidecar_args: tuple[str, ...]


def _names(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def _ints(text: str) -> list[int]:
    values = [int(part) for part in _names(text)]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrency must be at least 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Requests/s and chunks/s of one sidecar on a zero-delay sim engine.",
        epilog="Pass sidecar flags with '=', e.g. --sidecar-arg=--log-level=warning.",
    )
    add = parser.add_argument
    add("--duration", type=float, help="measured window per run, in s. Default 5 (--quick: 1).")
    add("--warmup", type=float, help="uncounted warm-up per run, in s. Default 1 (--quick: 0.5).")
    add(
        "--concurrency",
        type=_ints,
        action="extend",
        metavar="N[,N...]",
        help="closed-loop workers; several allowed. Default 1,16,64 (--quick: 1,16).",
    )
    add(
        "--scenarios",
        type=_names,
        action="extend",
        metavar="NAME[,NAME...]",
        help=f"of {', '.join(SCENARIOS)}. Default all.",
    )
    add(
        "--max-requests",
        type=int,
        default=1_000_000,
        help="most requests started per run (a safety bound). Default 1,000,000.",
    )
    add(
        "--out",
        type=Path,
        help=f"JSON results. Default {DEFAULT_OUT.relative_to(REPO)} (--quick: {QUICK_OUT.name}).",
    )
    add(
        "--sidecar-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the sidecar command line (repeatable; later flags win).",
    )
    add("--quick", action="store_true", help="smoke run: 1 s windows, concurrency 1 and 16.")
    return parser


def parse_settings(argv: Sequence[str] | None) -> BenchSettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    scenarios = tuple(dict.fromkeys(args.scenarios or SCENARIOS))
    unknown = [name for name in scenarios if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    if (args.duration is not None and args.duration <= 0) or (args.warmup or 0) < 0:
        parser.error("--duration must be above 0 and --warmup at least 0")
    # --quick changes only the defaults; flags given explicitly still win.
    duration, warmup, concurrency = (1.0, 0.5, (1, 16)) if args.quick else (5.0, 1.0, (1, 16, 64))
    return BenchSettings(
        duration_s=duration if args.duration is None else args.duration,
        warmup_s=warmup if args.warmup is None else args.warmup,
        concurrency=tuple(dict.fromkeys(args.concurrency or concurrency)),
        scenarios=scenarios,
        max_requests=args.max_requests,
        out=args.out or (QUICK_OUT if args.quick else DEFAULT_OUT),
        sidecar_args=tuple(args.sidecar_arg),
    )


def machine_info() -> dict[str, Any]:
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cgroup_cpu_max": _read("/sys/fs/cgroup/cpu.max"),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "client_loop": loop_name(),
        "aiohttp": aiohttp.__version__,
        "grpcio": grpc.__version__,
    }


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


Row = dict[str, Any]  # one RunResult.to_json()
COLUMNS: tuple[tuple[str, Callable[[Row], str]], ...] = (
    ("scenario", lambda r: r["scenario"]),
    ("conc", lambda r: str(r["concurrency"])),
    ("req/s", lambda r: _fmt(r["requests_per_s"])),
    ("chunks/s", lambda r: _fmt(r["chunks_per_s"] or None)),
    ("TTFT p50 ms", lambda r: _fmt(r["ttft_ms"]["p50"], 2)),
    ("TTFT p99 ms", lambda r: _fmt(r["ttft_ms"]["p99"], 2)),
    ("sidecar CPU %", lambda r: _fmt(r["sidecar_cpu_pct"])),
    ("CPU ms/req", lambda r: _fmt(r["sidecar_cpu_ms_per_request"], 3)),
    ("CPU ms/1k chunks", lambda r: _fmt(r["sidecar_cpu_ms_per_1k_chunks"], 1)),
    ("client CPU %", lambda r: _fmt(r["client_cpu_pct"])),
    ("errors", lambda r: str(r["error_count"])),
)


def table(rows: Sequence[Row]) -> str:
    cells = [[name for name, _ in COLUMNS]]
    cells += [[cell(row) for _, cell in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]

    def line(values: list[str]) -> str:
        first, *rest = zip(values, widths, strict=True)
        return "  ".join([first[0].ljust(first[1]), *(v.rjust(w) for v, w in rest)])

    lines = [line(values) for values in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def error_lines(results: Sequence[RunResult]) -> list[str]:
    lines = []
    for r in results:
        for kind, count in sorted(r.errors.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {r.scenario} c={r.concurrency}: {count} x {kind}")
        if r.outstanding_after != 0:
            lines.append(
                f"  {r.scenario} c={r.concurrency}: sidecar shows "
                f"{r.outstanding_after} outstanding requests after the run (want 0)"
            )
    return lines


def print_report(report: dict[str, Any], results: Sequence[RunResult]) -> None:
    s = report["settings"]
    m = report["machine"]
    print(f"command: {report['command']}")
    print(f"sidecar: {report['sidecar']['command']}")
    print(
        f"machine: nproc {m['nproc']}, {m['cpu_model']}, {m['python']}, client loop "
        f"{m['client_loop']}, cgroup cpu.max {m['cgroup_cpu_max']}"
    )
    busy = m["loadavg_1min_before"] > BUSY_LOADAVG
    note = " (the machine was busy before the run: numbers may be noisy)" if busy else ""
    print(f"load average (1 min) before the run: {m['loadavg_1min_before']:.2f}{note}")
    print(f"window {s['duration_s']:g} s after {s['warmup_s']:g} s warm-up per run")
    for name in s["scenarios"]:
        print(f"  {name}: {SCENARIOS[name].description}")
    print()
    print(table(report["results"]))
    print("TTFT of 'completions' is the time to the whole (non-streamed) response.")
    _print_problems(report, results)
    print(f"\nJSON: {report['out']}")


def _print_problems(report: dict[str, Any], results: Sequence[RunResult]) -> None:
    sidecar = report["sidecar"]
    errors = error_lines(results)
    if errors:
        print(f"\n!!! {report['errors_total']} ERRORS: these numbers are not trustworthy !!!")
        print("\n".join(errors))
    else:
        print("\nno errors: every response had status 200/OK and the expected chunks")
    if sidecar["exit_code"] != 0:
        print(f"!!! the sidecar exited with {sidecar['exit_code']} after SIGTERM (want 0)")
    if sidecar["log_problem_count"]:
        print(f"sidecar log ({sidecar['log']}): {sidecar['log_problem_count']} warnings and errors")
        print("\n".join(f"  {line}" for line in sidecar["log_problems"][:PRINTED_LOG_LINES]))


def build_report(
    settings: BenchSettings,
    sidecar: RunningSidecar,
    results: Sequence[RunResult],
    load_before: float,
) -> dict[str, Any]:
    settings_json = {**asdict(settings), "out": str(settings.out)}
    problems = sidecar.log_problems()
    return {
        "benchmark": "sidecar_throughput",
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "settings": settings_json,
        "machine": {**machine_info(), "loadavg_1min_before": load_before},
        "sidecar": {
            "command": shlex.join(sidecar.argv),
            "exit_code": sidecar.exit_code,
            "log": str(sidecar.log_path),
            "log_problem_count": len(problems),
            "log_problems": problems[:MAX_LOG_LINES],
        },
        "errors_total": sum(r.error_count for r in results),
        "results": [r.to_json() for r in results],
        "out": str(settings.out),
    }


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]  # other work on the machine makes the numbers noisy
    log_path = settings.out.with_suffix(".sidecar.log")
    signal.signal(signal.SIGTERM, interrupt)  # outside the loop; until_signal inside it
    try:
        with running_sidecar(max(settings.concurrency), settings.sidecar_args, log_path) as sidecar:
            results = run_loop(until_signal(run_all(sidecar, settings)))
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"interrupted ({str(exc) or 'SIGINT'}); the sidecar was stopped", file=sys.stderr)
        return 130
    except SidecarFailed as exc:
        print(f"!!! {exc}", file=sys.stderr)
        return 1
    report = build_report(settings, sidecar, results, load_before)
    settings.out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report, results)
    failed = report["errors_total"] or report["sidecar"]["exit_code"] != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

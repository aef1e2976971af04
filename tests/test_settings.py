"""Settings: CLI beats env beats the TOML file beats defaults; bad values exit 2, one line each."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy import settings as config
from proxy.cli import build_parser, cli_values

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
SUBPROCESS_TIMEOUT_S = 30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings read the environment: start each test from none of our variables.
    for name in list(os.environ):
        if name.upper().startswith("UNITPROXY_"):
            monkeypatch.delenv(name)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "unitproxy.toml"
    path.write_text(text)
    return path


def _cli(*argv: str) -> tuple[dict[str, Any], Path | None]:
    args = build_parser().parse_args(["sidecar", *argv])
    return cli_values(args), args.config


def _problems(exc: pytest.ExceptionInfo[config.ConfigError]) -> list[str]:
    problems = exc.value.problems
    assert str(exc.value).splitlines() == problems
    return problems


def _one_problem(problems: list[str], key: str) -> str:
    lines = [p for p in problems if p.startswith(f"{key}:")]
    assert len(lines) == 1, f"want one line about {key} in {problems}"
    return lines[0]


# --- precedence ------------------------------------------------------------------


def test_defaults() -> None:
    s = config.load({})
    assert s.sidecar.capacity is None  # the engine's slots
    assert s.sidecar.unit_id == "unit-0"
    assert s.engine.kind == "sim"
    assert s.engine.sim.max_num_seqs == 32
    assert s.engine.sim.seed == 0
    assert s.server.host == "0.0.0.0"
    assert s.ports("sidecar") == (8080, 50051)
    assert s.ports("gateway") == (8000, 50050)
    assert s.ports("follower") == (8081, 50052)


def test_file_beats_default(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        '[sidecar]\ncapacity = 7\nunit_id = "from-file"\n'
        "[engine.sim]\nmax_num_seqs = 3\nseed = 11\n"
        '[server]\nlog_level = "WARNING"\nhttp_port = 0\n',
    )
    s = config.load({}, path)
    assert s.sidecar.capacity == 7
    assert s.sidecar.unit_id == "from-file"
    assert s.engine.sim.max_num_seqs == 3
    assert s.engine.sim.seed == 11
    assert s.engine.sim.decode_step_ms == 10.0  # untouched keys keep their default
    assert s.server.log_level == "warning"
    assert s.ports("sidecar") == (0, 50051)


def test_env_beats_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _toml(
        tmp_path, '[sidecar]\ncapacity = 7\nunit_id = "from-file"\n[engine.sim]\nseed = 11\n'
    )
    monkeypatch.setenv("UNITPROXY_SIDECAR__CAPACITY", "9")
    monkeypatch.setenv("UNITPROXY_ENGINE__SIM__SEED", "22")
    s = config.load({}, path)
    assert s.sidecar.capacity == 9
    assert s.sidecar.unit_id == "from-file"  # same section, key set only in the file
    assert s.engine.sim.seed == 22


def test_env_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNITPROXY_SIDECAR__CAPACITY", "5")
    monkeypatch.setenv("UNITPROXY_ENGINE__SIM__MAX_NUM_SEQS", "4")
    monkeypatch.setenv("UNITPROXY_SERVER__LOG_LEVEL", "DEBUG")
    s = config.load({})
    assert s.sidecar.capacity == 5
    assert s.engine.sim.max_num_seqs == 4
    assert s.server.log_level == "debug"


def test_cli_beats_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _toml(
        tmp_path,
        '[sidecar]\ncapacity = 7\nunit_id = "from-file"\n[engine.sim]\nseed = 11\nmax_num_seqs = 3\n',
    )
    monkeypatch.setenv("UNITPROXY_SIDECAR__CAPACITY", "9")
    monkeypatch.setenv("UNITPROXY_ENGINE__SIM__SEED", "22")
    monkeypatch.setenv("UNITPROXY_ENGINE__SIM__MAX_NUM_SEQS", "4")
    cli, config_file = _cli(
        "--config", str(path), "--capacity", "1", "--sim-seed", "33", "--unit-id", "from-cli"
    )
    assert config_file == path
    s = config.load(cli, config_file)
    assert s.sidecar.capacity == 1
    assert s.sidecar.unit_id == "from-cli"
    assert s.engine.sim.seed == 33
    assert s.engine.sim.max_num_seqs == 4  # not on the command line: env still wins over file


def test_flags_not_given_leave_keys_alone() -> None:
    cli, config_file = _cli("--sim-decode-step-ms", "2.5")
    assert cli == {"engine": {"sim": {"decode_step_ms": "2.5"}}}
    assert config_file is None
    assert config.load(cli).engine.sim.decode_step_ms == 2.5


# --- invalid values --------------------------------------------------------------


def test_two_bad_values_give_two_lines() -> None:
    with pytest.raises(config.ConfigError) as exc:
        config.load({"sidecar": {"capacity": "-3"}, "engine": {"sim": {"max_num_seqs": "0"}}})
    problems = _problems(exc)
    assert len(problems) == 2
    assert "-3" in _one_problem(problems, "sidecar.capacity")
    assert "0" in _one_problem(problems, "engine.sim.max_num_seqs")


def test_bad_values_from_env_and_file_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, '[server]\nlog_level = "loud"\n')
    monkeypatch.setenv("UNITPROXY_SIDECAR__CAPACITY", "lots")
    with pytest.raises(config.ConfigError) as exc:
        config.load({}, path)
    problems = _problems(exc)
    assert len(problems) == 2
    assert "lots" in _one_problem(problems, "sidecar.capacity")
    level = _one_problem(problems, "server.log_level")
    assert "loud" in level
    assert "info" in level  # says what is allowed


def test_unknown_toml_keys_are_reported(tmp_path: Path) -> None:
    path = _toml(tmp_path, "bogus = 1\n[sidecar]\ncapacityx = 7\n[engine.sim]\nnope = 1\n")
    with pytest.raises(config.ConfigError) as exc:
        config.load({}, path)
    problems = _problems(exc)
    assert len(problems) == 3
    for key in ("bogus", "sidecar.capacityx", "engine.sim.nope"):
        assert "unknown" in _one_problem(problems, key)


def test_invalid_toml_is_reported(tmp_path: Path) -> None:
    path = _toml(tmp_path, "capacity = [\n")
    with pytest.raises(config.ConfigError) as exc:
        config.load({}, path)
    (problem,) = _problems(exc)
    assert "--config" in problem and str(path) in problem and "TOML" in problem


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_unreadable_toml_is_reported(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "nope.toml" if kind == "missing" else tmp_path
    with pytest.raises(config.ConfigError) as exc:
        config.load({}, path)
    (problem,) = _problems(exc)
    assert "--config" in problem and str(path) in problem and "cannot read" in problem


# --- the real command line -------------------------------------------------------


def _unitproxy(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("UNITPROXY_")}
    return subprocess.run(
        [sys.executable, "-m", "proxy", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


def test_cli_invalid_values_exit_2_with_one_line_each() -> None:
    run = _unitproxy(
        "sidecar", "--capacity", "-3", "--engine", "sim", "--sim-max-num-seqs", "0",
        "--http-port", "0", "--grpc-port", "0",
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    # Each line: "unitproxy: invalid configuration: KEY: what was wrong (got VALUE)".
    problems = [ln.split("invalid configuration: ", 1)[-1] for ln in run.stderr.splitlines()]
    assert len(problems) == 2, run.stderr
    assert "-3" in _one_problem(problems, "sidecar.capacity")
    assert "0" in _one_problem(problems, "engine.sim.max_num_seqs")


def test_cli_unknown_engine_is_an_argparse_error() -> None:
    run = _unitproxy("sidecar", "--engine", "bogus")
    assert run.returncode == 2
    assert "--engine" in run.stderr and "invalid choice" in run.stderr and "bogus" in run.stderr


def test_cli_engine_not_in_this_build_exits_2() -> None:
    run = _unitproxy("sidecar", "--engine", "vllm", "--http-port", "0", "--grpc-port", "0")
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "engine" in lines[0] and "vllm" in lines[0]


SIDECAR_FLAGS = (
    "--config", "--host", "--http-port", "--grpc-port", "--log-level", "--unit-id", "--engine",
    "--capacity", "--model", "--device", "--upstream-url", "--sim-max-num-seqs",
    "--sim-prefill-ms-per-token", "--sim-decode-step-ms", "--sim-seed",
)  # fmt: skip


def test_cli_sidecar_help_lists_the_contract_flags() -> None:
    run = _unitproxy("sidecar", "--help")
    assert run.returncode == 0, run.stderr
    for flag in SIDECAR_FLAGS:
        assert f"{flag} " in run.stdout or f"{flag}\n" in run.stdout, f"{flag} not in --help"
    for choice in ("{sim,vllm,openai}", "{neuron,cuda,cpu}"):
        assert choice in run.stdout


def test_flags_with_a_literal_setting_take_exactly_its_values() -> None:
    # The flag tables name no values: each comes from its setting's Literal, so a policy
    # or engine kind added to the settings is a valid flag value with nothing else edited.
    import types
    import typing

    from proxy.flags import COMMON, ENGINE, GATEWAY, SIDECAR, choices_of, field_of
    from proxy.registry import POLICIES

    for flag in COMMON + ENGINE + SIDECAR + GATEWAY:
        annotation = field_of(flag.key).annotation
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) is typing.Literal:
            assert choices_of(flag) == typing.get_args(annotation), flag.flag
        elif (
            typing.get_origin(annotation) in (typing.Union, types.UnionType)
            and typing.get_origin(args[0]) is typing.Literal
        ):  # Literal[...] | None (not a dict keyed by one)
            assert choices_of(flag) == typing.get_args(args[0]), flag.flag
    by_flag = {f.flag: f for f in GATEWAY + ENGINE}
    assert choices_of(by_flag["--policy"]) == tuple(POLICIES)  # the registered policies
    assert choices_of(by_flag["--device"]) == ("neuron", "cuda", "cpu")
    assert choices_of(by_flag["--correct-load"]) == ("true", "false")  # a bool: its own list
    assert choices_of(by_flag["--model"]) is None


def test_gateway_role_needs_units_or_redis() -> None:
    with pytest.raises(config.ConfigError) as info:
        config.check_role("gateway", config.load({}))
    assert len(info.value.problems) == 1 and "gateway.units" in info.value.problems[0]
    allow = {"load_source": "redis", "discover_allow": ["http://10.0.*"]}
    with pytest.raises(config.ConfigError) as info:
        config.check_role("gateway", config.load({"gateway": allow}))
    assert len(info.value.problems) == 1 and "redis.url" in info.value.problems[0]
    # With Redis, units register themselves: none need be configured, but which are
    # accepted must be.
    redis = {"url": "redis://127.0.0.1:6379/0"}
    config.check_role("gateway", config.load({"gateway": allow, "redis": redis}))
    with pytest.raises(config.ConfigError) as info:
        config.check_role("gateway", config.load({"gateway": {"load_source": "redis"},
                                                  "redis": redis}))  # fmt: skip
    assert len(info.value.problems) == 1 and "discover_allow" in info.value.problems[0]
    config.check_role("sidecar", config.load({}))  # a sidecar needs no units
    units = {"units": ["a=http://127.0.0.1:1,127.0.0.1:2"]}
    config.check_role("gateway", config.load({"gateway": units}))


def test_a_list_in_the_environment_must_be_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNITPROXY_SIDECAR__FOLLOWERS", "f1=127.0.0.1:1")
    with pytest.raises(config.ConfigError) as info:
        config.load({})
    assert "JSON" in info.value.problems[0] and "sidecar" in info.value.problems[0]
    monkeypatch.setenv("UNITPROXY_SIDECAR__FOLLOWERS", '["f1=127.0.0.1:1"]')
    assert config.load({}).sidecar.followers[0].name == "f1"


def test_advertised_address() -> None:
    from proxy.serving import advertised_host

    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("::", "fd00::1") == "[fd00::1]"
    assert advertised_host("0.0.0.0")  # the host name, whatever it is here


def test_help_writes_placeholders_as_the_configuration_reference_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sidecar", "--help"])
    out = capsys.readouterr().out
    assert "--host HOST" in out and "--model MODEL" in out and "--unit-id ID" in out
    assert "SERVER.HOST" not in out and "ENGINE.MODEL" not in out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    assert re.search(r"^  --restart  ", capsys.readouterr().out, flags=re.M), "a switch: no value"


def test_an_unknown_flag_shows_its_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["gateway", "--unit", "a=http://h:1,h:2", "--bogus", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: unitproxy gateway ")
    assert "unitproxy gateway: error: unrecognized arguments: --bogus 1" in err


def test_the_follower_refuses_a_redis_url() -> None:
    redis = {"url": "redis://127.0.0.1:6379/0"}
    with pytest.raises(config.ConfigError) as info:
        config.check_role("follower", config.load({"redis": redis}))
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith("redis.url:")
    config.check_role("follower", config.load({}))


@pytest.mark.parametrize(
    ("parse", "spec"),
    [
        (config.UnitTarget.parse, "u1=http://h:1,h:\u00b2"),
        (config.FollowerTarget.parse, "f1=h:\u00b2"),
        (config.CheckSpec.parse, "process:\u00b2"),
        (config.CheckSpec.parse, "tcp:h:\u00b9\u00b2"),
    ],
)
def test_a_port_or_pid_of_unicode_digits_is_refused_by_name(parse: Any, spec: str) -> None:
    # "²".isdigit() is true but int("²") fails: the message must name the field.
    with pytest.raises(ValueError) as refused:
        parse(spec)
    assert "invalid literal" not in str(refused.value)
    assert spec in str(refused.value)


def test_queue_bounds_by_priority_class_from_a_flag_a_table_or_json() -> None:
    argv = ["--queue-class-size", "batch=256, interactive=64", "--queue-class-timeout", "batch=60"]
    args = build_parser().parse_args(["gateway", *argv])
    g = config.load(cli_values(args)).gateway
    assert g.queue_class_size == {"batch": 256, "interactive": 64}
    assert g.queue_class_timeout_s == {"batch": 60.0}
    assert config.load(
        {"gateway": {"queue_class_size": {"standard": 8}}}
    ).gateway.queue_class_size == {"standard": 8}
    assert config.GatewaySettings(
        queue_class_timeout_s='{"interactive": 1.5}'
    ).queue_class_timeout_s == {"interactive": 1.5}
    for bad in ("bulk=3", "batch=-1", "batch"):
        with pytest.raises(config.ValidationError):
            config.GatewaySettings(queue_class_size=bad)

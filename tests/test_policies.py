"""The policy registry: every registered policy is a module that the router builds by
name, chooses only among the candidates, and is named wherever policies are listed
(the setting, the flag, the docs); the router itself names none."""

from __future__ import annotations

import ast
import importlib
import random
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from proxy.cli import build_parser, cli_values
from proxy.flags import GATEWAY, choices_of
from proxy.gateway.policies.base import Policy
from proxy.gateway.request import Want
from proxy.gateway.router import Outcome, Router
from proxy.gateway.units import Unit
from proxy.load import LoadReport, UnitState
from proxy.registry import DEFAULT_POLICY, POLICIES, POLICY_NAMES
from proxy.settings import GatewaySettings, UnitTarget
from tests.test_build import COMPILED
from tests.test_router import Clock

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
# Where a reader looks for the policies: each names every one, in backquotes.
LISTED_IN = ["README.md", "docs/api.md", "docs/architecture.md"]


def test_the_registry_has_policies_and_its_default() -> None:
    assert len(POLICIES) >= 2 and DEFAULT_POLICY in POLICIES and tuple(POLICIES) == POLICY_NAMES


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_each_registered_name_is_a_module_with_its_policy_class(name: str) -> None:
    module = importlib.import_module(POLICIES[name].module)
    assert module.__name__.rsplit(".", 1)[-1] == name  # one module under its name
    assert issubclass(module.POLICY, Policy) and module.POLICY is not Policy
    router = Router(GatewaySettings(policy=name))
    assert type(router.policy) is module.POLICY


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_each_registered_name_is_taken_by_the_setting_and_the_flag(name: str) -> None:
    assert GatewaySettings(policy=name).policy == name
    args = build_parser().parse_args(["gateway", "--policy", name])
    assert cli_values(args)["gateway"]["policy"] == name
    described = GatewaySettings.model_fields["policy"].description or ""
    assert name in described


def test_the_setting_and_the_flag_take_only_registered_names() -> None:
    annotation = GatewaySettings.model_fields["policy"].annotation
    assert typing.get_args(annotation) == POLICY_NAMES
    assert choices_of(next(f for f in GATEWAY if f.flag == "--policy")) == POLICY_NAMES
    with pytest.raises(ValidationError):
        GatewaySettings(policy="no_such_policy")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--policy", "no_such_policy"])


@pytest.mark.parametrize("path", LISTED_IN)
def test_every_registered_policy_is_documented(path: str) -> None:
    text = (ROOT / path).read_text()
    missing = [name for name in POLICY_NAMES if f"`{name}`" not in text]
    assert not missing, f"{path} does not name the policies {missing}"


def test_configuration_reference_lists_every_policy() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert f"--policy {{{','.join(POLICY_NAMES)}}}" in text


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_each_registered_policy_is_compiled_with_the_router(name: str) -> None:
    """In the compiled build a policy's class derives from a compiled one: its module
    must be compiled too, or the gateway cannot import it there."""
    path = POLICIES[name].module.replace(".", "/") + ".py"
    assert path in COMPILED, f"setup.py's COMPILED lacks {path}"


def test_the_router_names_no_policy() -> None:
    """No string in router.py is a policy's name: choosing is the policy's."""
    tree = ast.parse((ROOT / "proxy" / "gateway" / "router.py").read_text())
    strings = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert not strings & set(POLICY_NAMES)


def _report(router: Router, unit_id: str, rng: random.Random, seq: int) -> None:
    state = rng.choice([UnitState.SERVING] * 4 + [UnitState.NOT_SERVING, UnitState.DRAINING])
    # the even units serve a (some b too), the odd ones b: never all the same models
    models = rng.choice([("a",), ("a", "b")]) if int(unit_id[1:]) % 2 == 0 else ("b",)
    capacity = rng.choice([1, 2, 4])
    outstanding = rng.randrange(capacity + 1)
    router.apply_report(
        unit_id, LoadReport(unit_id, state, outstanding, capacity, seq=seq, models=models)
    )


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_each_policy_chooses_only_candidates_and_one_whenever_there_is_one(name: str) -> None:
    """Through reports, staleness, ejections, retries' exclusions and units of different
    models: the unit chosen is one the router counts a candidate for that request, and
    a unit is chosen whenever there is a candidate."""
    clock, rng = Clock(), random.Random(11)
    ids = [f"u{i}" for i in range(12)]
    targets = [UnitTarget(id=i, http_url=f"http://{i}:1", grpc_target=f"{i}:2") for i in ids]
    settings = GatewaySettings(policy=name, stale_after_s=5, eject_after=1, eject_s=2)
    router = Router(settings, targets, rng=random.Random(3), clock=clock)
    for i in ids:
        _report(router, i, rng, seq=1)
    held: list[Unit] = []
    chosen = 0
    for step in range(1500):
        op = rng.random()
        if op < 0.25:
            _report(router, rng.choice(ids), rng, seq=step + 1)
        elif op < 0.65:
            exclude = set(rng.sample(ids, rng.randrange(3)))
            model = rng.choice([None, "a", "b"])
            expected = {u.id for u in router.candidates(exclude, model)}
            blocks = [rng.randrange(4) for _ in range(rng.randrange(3))]
            unit = router.pick(exclude, Want(model, blocks, 10 * len(blocks)))
            if unit is None:
                assert not expected, (step, expected)
            else:
                assert unit.id in expected, (step, unit.id, expected)
                held.append(unit)
                chosen += 1
        elif op < 0.9 and held:
            unit = held.pop(rng.randrange(len(held)))
            router.release(unit, rng.choice([Outcome.OK] * 5 + [Outcome.FAILED]))
        else:
            clock.now += rng.choice([0.1, 1.0, 3.0])
    assert chosen > 100

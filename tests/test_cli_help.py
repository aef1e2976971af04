"""``unitproxy COMMAND --help``: the flags in one group per settings section, the
command's own section first, and an example at the end that is a valid command line.
(``unitproxy sidecar --help`` was 303 lines in one list, the unit's own flags at line
254.)"""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from proxy import settings as config
from proxy.cli import SECTIONS, build_parser, cli_values

pytestmark = pytest.mark.timeout(30)

OWN = {  # each command's own sections, which its help shows first
    "sidecar": ["sidecar", "sidecar.recovery", "health"],
    "follower": ["follower", "health"],
    "gateway": ["gateway"],
    "up": ["up"],
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _groups(help_text: str) -> list[str]:
    """The group titles, in the order the help shows them."""
    return re.findall(r"^(\S[^\n]*):$", help_text, flags=re.M)


@pytest.mark.parametrize("name", sorted(OWN))
def test_help_groups_flags_by_section_the_commands_own_first(name: str) -> None:
    parser = _commands()[name]
    text = parser.format_help()
    titles = _groups(text)
    assert titles[0] == "options", titles  # -h and --config
    assert titles[1 : 1 + len(OWN[name])] == [SECTIONS[s] for s in OWN[name]], titles
    assert len(titles) == len(set(titles)), "one group per section"
    for group in parser._action_groups[2:]:  # positionals, options, then the sections
        sections = {a.dest.rsplit(".", 1)[0] for a in group._group_actions}
        assert len(sections) == 1 and group.title == SECTIONS[sections.pop()], group.title
    flagged = {a.dest for a in parser._actions if "." in a.dest}
    grouped = {a.dest for g in parser._action_groups[2:] for a in g._group_actions}
    assert flagged == grouped, f"flags outside a section's group: {flagged - grouped}"


def test_the_sidecars_own_flags_come_first() -> None:
    lines = _commands()["sidecar"].format_help().splitlines()
    first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("--unit-id"))
    assert first < 20, f"--unit-id at line {first + 1}"


@pytest.mark.parametrize("name", sorted(OWN))
def test_help_ends_with_an_example_that_is_a_valid_command_line(name: str) -> None:
    parser = build_parser()
    epilog = _commands()[name].epilog or ""
    assert "example:" in epilog
    example = epilog.split("example:", 1)[1].split("\n", 1)[1]
    argv = shlex.split(example.replace("\\\n", " "))
    assert argv[:2] == ["unitproxy", name], argv
    options = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    args = parser.parse_args(options)
    settings = config.load(cli_values(args))
    config.check_role(name, settings)
    assert _commands()[name].format_help().rstrip().endswith(example.rstrip())

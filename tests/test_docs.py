"""docs/ against the code: the configuration reference is what its generator makes now,
and every setting, flag, environment variable, metric and link the docs name exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from proxy.cli import build_parser
from tests.test_deploy import _gen_config_reference, exported_metric_names

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
FILE_SUFFIXES = {"yaml", "json", "md", "py", "toml", "txt"}
REGENERATE = "docs/configuration.md is stale: run `python scripts/gen_config_reference.py`"


def _text(path: Path) -> str:
    return path.read_text()


def _code_spans(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return [line for block in blocks for line in block.splitlines()] + inline


def test_configuration_reference_is_fresh() -> None:
    made = _gen_config_reference().render()
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == made, REGENERATE


def test_configuration_reference_lists_every_setting() -> None:
    gen = _gen_config_reference()
    text = (ROOT / "docs" / "configuration.md").read_text()
    for section in gen.sections():
        for name, _ in gen.leaf_fields(section):
            key = ".".join((*section.path, name))
            assert f"### `{key}`" in text, f"{key} is missing: {REGENERATE}"
            assert f"`{gen.env_name((*section.path, name))}`" in text


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_environment_variables_named_in_docs_exist(path: Path) -> None:
    gen = _gen_config_reference()
    known = {gen.env_name((*s.path, n)) for s in gen.sections() for n, _ in gen.leaf_fields(s)}
    named = set(re.findall(r"\bUNITPROXY_[A-Z0-9_]*__[A-Z0-9_]+\b", _text(path)))
    assert named <= known, f"{path.name} names settings that do not exist: {named - known}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_setting_keys_named_in_docs_exist(path: Path) -> None:
    gen = _gen_config_reference()
    sections = {".".join(s.path) for s in gen.sections()}
    keys = {".".join((*s.path, n)) for s in gen.sections() for n, _ in gen.leaf_fields(s)}
    for span in _code_spans(_text(path)):
        for key in re.findall(r"^([a-z_]+(?:\.[a-z_]+)+)$", span.strip()):
            if key.rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue
            if key.split(".")[0] in sections:
                assert key in keys | sections, f"{path.name}: `{key}` is no setting"


def _subcommand_flags() -> dict[str, set[str]]:
    gen = _gen_config_reference()
    return {
        name: {opt for action in parser._actions for opt in action.option_strings}
        for name, parser in gen._subcommands(build_parser()).items()
    }


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_unitproxy_command_lines_in_docs_use_real_flags(path: Path) -> None:
    flags = _subcommand_flags()
    every = set().union(*flags.values())
    for span in _code_spans(_text(path)):
        for command, rest in re.findall(
            r"\bunitproxy (sidecar|follower|gateway|up|plan)\b(.*)", span
        ):
            options = rest.split(" -- ")[0]  # after --: the worker's own command
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", options):
                assert flag in flags[command], f"{path.name}: `unitproxy {command}` has no {flag}"
        lone = re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[ =].*)?", span.strip())
        if lone:
            assert lone[1] in every, f"{path.name}: `{span}`: no unitproxy command has {lone[1]}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_metrics_named_in_docs_exist(path: Path) -> None:
    known = exported_metric_names() | _families()
    named = set(re.findall(r"\bunitproxy_[a-z0-9_]+", _text(path)))
    assert named <= known, f"{path.name} names metrics that do not exist: {named - known}"


def _families() -> set[str]:
    """Names as the docs write them: histograms without _bucket/_sum/_count."""
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported_metric_names()}


def test_operations_guide_explains_every_metric() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    rows = set(re.findall(r"^\| `(unitproxy_[a-z0-9_]+)` \|", text, flags=re.M))
    missing = _families() - rows
    assert not missing, f"docs/operations.md: add a row to the metrics table for {sorted(missing)}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _text(path)):
        if re.match(r"[a-z]+://", target):
            continue
        assert (path.parent / target).exists(), f"{path.name}: link to {target} is broken"


def test_the_repository_stands_alone() -> None:
    # Users get the repository alone: no doc, test or comment may point at a file
    # outside it (a contract kept elsewhere, a shared folder).
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()  # fmt: skip
    outside = re.compile(
        "|".join(
            re.escape(p)
            for p in ("DESIGN" + ".md", "DESIGN" + " §", "../" + "shared", "shared " + "project")
        )
    )
    found = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (
            ".py",
            ".md",
            ".yaml",
            ".yml",
            ".json",
            ".toml",
            ".sh",
            ".proto",
            "",
        ):
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        found += [f"{name}: {m.group(0)}" for m in outside.finditer(text)]
    assert found == []


# --- what the docs say happens when a unit fails under a request ------------------------

PROSE = [ROOT / "README.md", *DOCS]
AFTER_FIRST_BYTE = re.compile(
    r"after (the|its) first (response )?(byte|message)|after the response started"
    r"|once the response started|mid-stream",
    flags=re.I,
)
A_FAILURE = re.compile(r"\bfail|\berror|\bbroke|\blost\b", flags=re.I)
CONTINUED = re.compile(r"migrat|continue", flags=re.I)


def _sentences(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    flat = re.sub(r"\s+", " ", prose)
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+(?=[A-Z`(*-])|\|", flat) if s.strip()]


def test_the_product_migrates_after_the_first_byte() -> None:
    """The one source of truth the sentences below are held to: by default a unit that
    fails after the first byte has its request continued elsewhere (tests/test_migration.py
    shows it happening), so no doc may say the client gets an error then."""
    from proxy.gateway.core import Next
    from proxy.settings import GatewaySettings

    assert Next.MIGRATE in Next
    assert GatewaySettings().migrations > 0, "the docs below say failures migrate by default"


@pytest.mark.parametrize("path", PROSE, ids=lambda p: p.name)
def test_docs_say_a_failure_after_the_first_byte_migrates(path: Path) -> None:
    # docs/api.md and docs/architecture.md once said a failure after the first byte
    # reached the client as an error event, while the product continued the stream.
    wrong = [
        s
        for s in _sentences(_text(path))
        if AFTER_FIRST_BYTE.search(s) and A_FAILURE.search(s) and not CONTINUED.search(s)
    ]
    assert not wrong, f"{path.name} says a failure after the first byte is not migrated: {wrong}"


def test_the_sims_token_accuracy_is_one_measured_figure_everywhere() -> None:
    # The README said about 10 %, --help about 15 %: one figure, engine.tokens's,
    # which bench/sim_tokens.py measures.
    from engine.tokens import ACCURACY_PCT

    help_text = _help("sidecar")
    claims = {
        name: re.findall(r"within\s+about\s+(\d+)\s+%\s+of\s+a\s+(?:real\s+)?(?:byte-level\s+)?BPE", text)
        for name, text in (("--help", help_text),
                           *((str(p.relative_to(ROOT)), _text(p)) for p in PROSE))
    }  # fmt: skip
    assert claims["README.md"] and claims["--help"], claims
    for name, found in claims.items():
        assert set(found) <= {str(ACCURACY_PCT)}, f"{name} gives the sim's accuracy as {found}"


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and command in a.choices)
    return " ".join(sub.choices[command].format_help().split())


def test_the_readme_says_where_a_lone_sidecar_listens() -> None:
    from proxy.settings import ServerSettings

    text = " ".join(_text(ROOT / "README.md").split())
    assert f"`--host` defaults to `{ServerSettings().host}`" in text
    assert "`--host 127.0.0.1`" in text and "`--api-keys-file PATH`" in text

"""Which way the imports run: engine/ needs nothing from proxy/.

Read from the source with ast, so an import inside a function or under
``TYPE_CHECKING`` counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(10)

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in the file, wherever it stands."""
    package = module_name(path if path.name == "__init__.py" else path.parent, root)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base)
                name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                name = node.module or ""
            yield node.lineno, name
            for alias in node.names:  # ``from proxy import errors`` imports proxy.errors
                yield node.lineno, f"{name}.{alias.name}"


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_the_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    # The check below is only as good as ``imported``: lazy, guarded and relative imports.
    pkg = tmp_path / "engine"
    pkg.mkdir()
    src = pkg / "x.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from proxy.settings import Settings\n"
        "def f():\n    import proxy.errors\n    from . import y\n"
    )
    names = {name for _, name in imported(src, tmp_path)}
    assert {"proxy.settings", "proxy.errors", "engine", "engine.y"} <= names


def test_engine_imports_nothing_from_proxy() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sources("engine")
        for line, name in imported(path)
        if name == "proxy" or name.startswith("proxy.")
    ]
    assert found == []


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (a package counts as its __init__)."""
    modules = {module_name(path): path for path in sources(package)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {
            target for _, target in imported(path) if target in modules and target != name
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk, each as the path that closes it."""
    found: list[list[str]] = []
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> None:
        if node in path:
            found.append([*path[path.index(node) :], node])
            return
        if node in done:
            return
        for target in sorted(graph[node]):
            walk(target, [*path, node])
        done.add(node)

    for node in sorted(graph):
        walk(node, [])
    return found


def test_the_cycle_finder_finds_a_lazy_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_proxy_modules() -> None:
    assert cycles(import_graph("proxy")) == []


ROLES = ("proxy.sidecar", "proxy.gateway", "proxy.follower")


def role_of(module: str) -> str | None:
    return next((r for r in ROLES if module == r or module.startswith(r + ".")), None)


def test_the_roles_import_only_shared_modules_and_no_shared_module_imports_a_role() -> None:
    # The sidecar, the gateway and the follower stand on the shared modules of proxy/;
    # only the command (cli.py) knows the roles.
    wrong = [
        f"{module} -> {target}"
        for module, targets in import_graph("proxy").items()
        for target in targets
        if role_of(target) is not None
        and role_of(target) != role_of(module)
        and module != "proxy.cli"
    ]
    assert wrong == []

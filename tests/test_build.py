"""The compiled build (setup.py, UNITPROXY_COMPILE=1): what it compiles, and the one
pattern known to break mypyc's semantics in this code.

In a tree made by scripts/compiled_tree.sh, .ci/run sets UNITPROXY_EXPECT_COMPILED=1 and
runs every test there: the check below then proves those tests ran compiled code.
"""

from __future__ import annotations

import ast
import importlib
import os
import runpy
from pathlib import Path
from unittest import mock

import pytest

from proxy import build

ROOT = Path(__file__).resolve().parent.parent


def _compiled_list() -> list[str]:
    # Run setup.py with setup() stubbed out (it would build): its COMPILED list is
    # partly computed (every policy module), so it is read from the module's globals.
    with mock.patch("setuptools.setup"):
        compiled = runpy.run_path(str(ROOT / "setup.py"))["COMPILED"]
    assert isinstance(compiled, list)
    return [str(path) for path in compiled]


COMPILED = _compiled_list()


def _module(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def test_the_compiled_list_names_modules_of_this_package() -> None:
    assert COMPILED, "nothing to compile"
    assert build.PROBE in {_module(p) for p in COMPILED}
    for path in COMPILED:
        assert (ROOT / path).is_file(), path
    assert len(set(COMPILED)) == len(COMPILED)


def test_setup_adds_nothing_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    captured: dict[str, object] = {}
    monkeypatch.delenv("UNITPROXY_COMPILE", raising=False)
    monkeypatch.setattr("setuptools.setup", lambda **kw: captured.update(kw))
    runpy.run_path(str(ROOT / "setup.py"))
    assert captured == {"setup_requires": [], "ext_modules": []}


def test_no_except_name_is_reused_for_other_types() -> None:
    """mypyc gives a name one type per function: ``except A as exc`` then ``except B as
    exc`` makes the compiled code refuse a B (a TypeError where the handler should run)."""
    reused = []
    for path in COMPILED:
        tree = ast.parse((ROOT / path).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            types: dict[str, set[str]] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler) and node.name:
                    kind = ast.unparse(node.type) if node.type else "BaseException"
                    types.setdefault(node.name, set()).add(kind)
            reused += [
                f"{path}:{fn.lineno} {fn.name}: {n} {sorted(t)}"
                for n, t in types.items()
                if len(t) > 1
            ]
    assert not reused, reused


@pytest.mark.skipif(
    os.environ.get("UNITPROXY_EXPECT_COMPILED") != "1",
    reason="runs in the compiled tree only (UNITPROXY_EXPECT_COMPILED=1, as .ci/run sets)",
)
def test_every_listed_module_runs_compiled_here() -> None:
    pure = [
        m for m in map(_module, COMPILED) if not build.compiled(importlib.import_module(m).__name__)
    ]
    assert not pure, f"loaded from .py, not compiled: {pure}"
    assert build.describe().startswith("request path compiled")


def test_the_build_is_told_by_what_was_loaded() -> None:
    core = importlib.import_module(build.PROBE)
    loaded_from = Path(core.__file__ or "")
    assert build.compiled() is (loaded_from.suffix == ".so")
    if build.compiled():
        assert build.describe() == "request path compiled (mypyc)"
    else:
        assert loaded_from.suffix == ".py"
        assert build.describe().startswith("pure Python")

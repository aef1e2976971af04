"""Which build of unitproxy runs: pure Python, or the gateway's request path compiled.

``UNITPROXY_COMPILE=1 pip install .`` compiles the modules listed in setup.py with mypyc
(C extensions beside their sources, imported in their place). The gateway says at start
which it runs, so a benchmark or an operator never has to guess.
"""

from __future__ import annotations

import importlib.machinery
import sys

# A module the compiled build always compiles: the gateway's attempt loop.
PROBE = "proxy.gateway.core"


def compiled(module: str = PROBE) -> bool:
    """True when ``module`` (imported) was loaded from a C extension."""
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None) or ""
    return path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def describe() -> str:
    if compiled():
        return "request path compiled (mypyc)"
    return "pure Python (UNITPROXY_COMPILE=1 pip install . compiles the request path)"

"""The compiled build: UNITPROXY_COMPILE=1 compiles the gateway's request path with mypyc.

Everything else about the package is in pyproject.toml. Without the variable this file
adds nothing and unitproxy is pure Python. With it, the modules below become C
extensions (the same code, typed as mypy checks it): in bench/overhead's callgrind count
the gateway then runs about 45 % fewer instructions a request. It needs a C compiler
and the Python headers; mypy and the dependencies (mypyc checks their types) come into
the build environment by themselves.

    UNITPROXY_COMPILE=1 pip install .                      # a compiled install
    UNITPROXY_COMPILE=1 python setup.py build_ext --inplace  # a compiled tree, for tests

Not for an editable install: the .so files built beside the sources would shadow any
later edit of them. The gateway logs which build it runs when it starts.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

from setuptools import setup

# The gateway's process: its request path and what that path calls per request.
# proxy.serving is left out: mypyc cannot compile a class deriving from OSError.
COMPILED = [
    "proxy/gateway/core.py",
    "proxy/gateway/discovery.py",
    "proxy/gateway/fairqueue.py",
    "proxy/gateway/held.py",
    "proxy/gateway/blocktable.py",
    "proxy/gateway/forward.py",
    "proxy/gateway/grpc_proxy.py",
    "proxy/gateway/index.py",
    "proxy/gateway/latency.py",
    "proxy/gateway/loadsource.py",
    "proxy/gateway/prefix.py",
    "proxy/gateway/rates.py",
    "proxy/gateway/request.py",
    "proxy/gateway/resume.py",
    "proxy/gateway/router.py",
    "proxy/gateway/server.py",
    "proxy/gateway/tenancy.py",
    "proxy/gateway/units.py",
    "proxy/gateway/http1/front.py",
    "proxy/gateway/http1/pool.py",
    "proxy/accesslog.py",
    "proxy/auth.py",
    "proxy/broadcast.py",
    "proxy/coalesce.py",
    "proxy/errors.py",
    "proxy/gate.py",
    "proxy/httputil.py",
    "proxy/ingress.py",
    "proxy/jsonio.py",
    "proxy/load.py",
    "proxy/metrics.py",
    "proxy/prefix_chunks.py",
    "proxy/ratelimit.py",
    "proxy/tenants.py",
    "proxy/timers.py",
    # Every policy's module (a new policy is compiled with no line here), not
    # __init__.py: it is read by the settings as well.
    *sorted(
        f"proxy/gateway/policies/{p.name}"
        for p in Path(__file__).parent.joinpath("proxy/gateway/policies").glob("*.py")
        if p.name != "__init__.py"
    ),
]

COMPILE = os.environ.get("UNITPROXY_COMPILE", "") == "1"
# mypyc type-checks what it compiles, so the build needs the dependencies' types too.
_PROJECT = tomllib.loads((Path(__file__).parent / "pyproject.toml").read_text())["project"]
# 2.4: librt.vecs (proxy.gateway.blocktable).
BUILD_REQUIRES = ["mypy>=2.4", *_PROJECT["dependencies"]]


def _extensions() -> list[object]:
    if not COMPILE or {"egg_info", "dist_info"} & set(sys.argv):
        return []  # the metadata (and setup_requires) first; mypy comes after
    try:
        from mypyc.build import mypycify
    except ImportError:
        raise SystemExit(
            "UNITPROXY_COMPILE=1 needs mypy (it has mypyc) and unitproxy's dependencies "
            "where the build runs: pip install 'mypy>=2.4' . first, "
            "or build without --no-build-isolation"
        ) from None
    return list(mypycify(COMPILED, opt_level="3"))


setup(
    setup_requires=BUILD_REQUIRES if COMPILE else [],
    ext_modules=_extensions(),
)

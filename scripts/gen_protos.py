"""Regenerate the Python stubs in proxy/pb from protos/ (run after editing a .proto).

    python scripts/gen_protos.py [OUT_DIR]

OUT_DIR defaults to the repository root; the stubs land in OUT_DIR/proxy/pb/...
The test suite runs this into a temporary directory and fails when the committed
stubs differ.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    files = sorted(PROTOS.rglob("*.proto"))
    include = str(resources.files("grpc_tools") / "_proto")
    # Mapping protos/ onto the import path proxy/pb makes the generated modules
    # import each other as proxy.pb.unitproxy.v1.*, inside our own package.
    args = [
        "grpc_tools.protoc",
        f"-Iproxy/pb={PROTOS}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
    ] + [f"proxy/pb/{f.relative_to(PROTOS)}" for f in files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    made = sorted((out / "proxy" / "pb").rglob("*.py*"))
    for package in {p.parent for p in made}:
        walk = package
        while walk != out / "proxy":
            (walk / "__init__.py").touch()
            walk = walk.parent
    return made


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(target):
        print(path.relative_to(target))

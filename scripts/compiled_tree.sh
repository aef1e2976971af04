#!/usr/bin/env bash
# A copy of this tree with the gateway's request path compiled by mypyc (setup.py), for
# running the tests or a benchmark against the compiled build without touching the
# sources here (.so files beside them would shadow every later edit).
#
#   bash scripts/compiled_tree.sh DEST [PYTHON]
#
# DEST gets the tracked and untracked, not ignored files of this tree, then the C
# extensions beside them. PYTHON (default: .venv/bin/python, else python3) needs mypy and
# unitproxy's dependencies: pip install -e '.[test]' has both. In DEST, `python -m proxy`
# and pytest import the compiled modules; `python -c 'import proxy.build as b;
# print(b.describe())'` says so. About 2-3 minutes on 2 cores; none when DEST was
# built from the same sources (.compiled-from).
set -euo pipefail
dest=$(realpath -m "${1:?usage: compiled_tree.sh DEST [PYTHON]}")
python=${2:-}
# Absolute, links kept (a venv's python is a link that must stay one): the build runs in DEST.
[ -z "$python" ] || python=$(realpath -s "$(command -v "$python")")
cd "$(dirname "$0")/.."
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=$PWD/.venv/bin/python; else python=python3; fi
fi
# The same sources as the last build there: nothing to do.
stamp=$(git ls-files -co --exclude-standard -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
if [ "$(cat "$dest/.compiled-from" 2>/dev/null)" = "$stamp" ]; then
    echo "compiled_tree: $dest is up to date"
    exit 0
fi
rm -rf "$dest"
mkdir -p "$dest"
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$dest"
head=$(git rev-parse --short HEAD)
cd "$dest"
# A repository of its own, the sources committed: tests that ask git about the tree
# (tests/test_docs.py) see these files, not the tree this copy sits in.
git init -q
git add -A
git -c user.name=compiled_tree -c user.email=compiled-tree@localhost \
    commit -qm "the sources of $head as built by scripts/compiled_tree.sh"
UNITPROXY_COMPILE=1 "$python" setup.py -q build_ext --inplace >build.log 2>&1 \
    || { tail -40 build.log >&2; echo "compiled_tree: the build failed (log: $dest/build.log)" >&2; exit 1; }
"$python" -c 'import proxy.gateway.server, proxy.build as b; assert b.compiled(), b.describe(); print("compiled_tree:", b.describe())'
echo "$stamp" >.compiled-from

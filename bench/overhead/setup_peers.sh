#!/usr/bin/env bash
# Install the peer routers for bench/overhead into the bench's own virtual
# environments, one each, from PyPI:
#
#   bench/.venvs/vllm-router    pip install vllm-router     -> bin/vllm-router
#   bench/.venvs/sglang-router  pip install sglang-router   -> python -m sglang_router.launch_router
#   bench/.venvs/nodelay.so     cc nodelay.c (LD_PRELOAD: TCP_NODELAY on accepted sockets,
#                               for the 'sglang-router+nodelay' target; skipped without cc)
#
# and, asked for by name, the reference for bench/tenants's limits scenario:
#
#   bench/.venvs/litellm        pip install 'litellm[proxy]==1.108.7' -> bin/litellm
#
# None touches the project's .venv. A peer that does not install is reported and
# skipped; the bench runs without it. Re-running is cheap (pip finds it installed).
#
#   bash bench/overhead/setup_peers.sh              # both routers
#   bash bench/overhead/setup_peers.sh vllm-router  # one
#   bash bench/overhead/setup_peers.sh litellm      # LiteLLM's proxy (a few minutes)
#   VLLM_ROUTER_VERSION=0.1.17 SGLANG_ROUTER_VERSION=0.3.2 bash bench/overhead/setup_peers.sh
#   LITELLM_VERSION=1.108.7 bash bench/overhead/setup_peers.sh litellm
set -u

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venvs="$(cd "$here/.." && pwd)/.venvs"
python="${PYTHON:-python3}"
peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(vllm-router sglang-router)

spec() {  # the pip requirement for a peer, pinned when a version is given
    case "$1" in
        vllm-router) echo "vllm-router${VLLM_ROUTER_VERSION:+==$VLLM_ROUTER_VERSION}" ;;
        sglang-router) echo "sglang-router${SGLANG_ROUTER_VERSION:+==$SGLANG_ROUTER_VERSION}" ;;
        # pinned: its config keys and custom auth hook change between releases
        litellm) echo "litellm[proxy]==${LITELLM_VERSION:-1.108.7}" ;;
        *) return 1 ;;
    esac
}

failed=0
for peer in "${peers[@]}"; do
    if ! req="$(spec "$peer")"; then
        echo "setup_peers: unknown peer '$peer' (choose vllm-router, sglang-router, litellm)" >&2
        failed=1
        continue
    fi
    venv="$venvs/$peer"
    log="$venvs/$peer.install.log"
    mkdir -p "$venvs"
    echo "setup_peers: $peer -> $venv"
    if { [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"; } >"$log" 2>&1 \
        && "$venv/bin/python" -m pip install -q --upgrade pip >>"$log" 2>&1 \
        && "$venv/bin/python" -m pip install -q "$req" >>"$log" 2>&1; then
        version="$("$venv/bin/python" -m pip show "$peer" 2>/dev/null | sed -n 's/^Version: //p')"
        echo "setup_peers: $peer $version installed"
    else
        echo "setup_peers: $peer is NOT installable here; the bench goes on without it." >&2
        echo "setup_peers: last lines of $log:" >&2
        tail -n 5 "$log" | sed 's/^/    /' >&2
        failed=1
    fi
done

# The shim for sglang-router+nodelay: only when sglang-router was asked for.
if printf '%s\n' "${peers[@]}" | grep -qx sglang-router; then
    cc_bin="${CC:-cc}"
    if command -v "$cc_bin" >/dev/null 2>&1 \
        && "$cc_bin" -O2 -shared -fPIC -o "$venvs/nodelay.so" "$here/nodelay.c" -ldl; then
        echo "setup_peers: $venvs/nodelay.so built (target sglang-router+nodelay)"
    else
        echo "setup_peers: no C compiler or the build failed: target sglang-router+nodelay is skipped" >&2
    fi
fi
exit "$failed"

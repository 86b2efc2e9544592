#!/usr/bin/env bash
# The vLLM engine's tests (tests/engines_vllm) against each tested release of vLLM's CPU build, each from its own venv
# (installed once and kept: scripts/install-vllm.sh skips a venv whose stamp matches), then the matrix of
# docs/SUPPORT.md (bench/vllm_matrix.py, bench/out/vllm-matrix.json). CI runs the pinned release only (make test).
#   make test-vllm-matrix                                  # every release in service/vllm/compat.py's TESTED
#   VLLM_VERSIONS="0.31.0" SKIP_MATRIX_BENCH=1 make test-vllm-matrix
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PY:-.venv/bin/python}"
tested="$($py -c 'from service.vllm.compat import TESTED; print(*TESTED)')"
pinned="${tested##* }"
versions="${VLLM_VERSIONS:-$tested}"
mkdir -p bench/out
failed=()
for v in $versions; do
  venv=".venv-vllm-$v"
  [ "$v" = "$pinned" ] && venv=".venv-vllm"
  if ! VLLM_VERSION="$v" scripts/install-vllm.sh "$venv"; then failed+=("$v: install"); continue; fi
  echo "== vLLM $v ($venv): tests/engines_vllm"
  if ! SKILLCACHE_VLLM_VENV="$venv" SKILLCACHE_REQUIRE_VLLM=1 $py -m pytest -q -p no:cacheprovider tests/engines_vllm \
      ${PYTEST_ARGS:-} 2>&1 | tee "bench/out/vllm-matrix-tests-$v.log"; then
    failed+=("$v: tests")
  fi
done
if [ -z "${SKIP_MATRIX_BENCH:-}" ]; then
  # shellcheck disable=SC2086  # one word per version
  $py bench/vllm_matrix.py --versions $versions --json bench/out/vllm-matrix.json || failed+=("matrix bench")
fi
if [ ${#failed[@]} -gt 0 ]; then
  printf 'test-vllm-matrix: failed: %s\n' "${failed[@]}"
  exit 1
fi
echo "test-vllm-matrix: $versions passed"

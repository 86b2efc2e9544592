#!/usr/bin/env bash
# Issue 49's GPU item as one prepared script (well under 5 minutes of device time): bench/gpu/assemble_head.py
# assembles a 32k-token composed head of Llama-3.1-8B shapes (bf16) into FlashAttention's paged layout through the
# connector's own write path (service/vllm/paged.py, write_piece), checks it against RoPE applied at the target
# positions, and times it from device memory and from pinned host memory. vLLM's CUDA build cannot be installed on
# the lent machine: the cache write is FlashAttention's placement as torch indexing (the script says which it used).
# Results (assemble.json, assemble.log) go to $OUT (the device tool brings them back), else bench/out.
#   bash bench/gpu/prepare.sh (here), then run(command="bash bench/gpu/assemble.sh", carry=[".gpu"], timeout_s=300)
#   bash bench/gpu/assemble.sh --dry-run   here, on CPU: the llama-smoke shape, 1k tokens
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
LOG="$OUT/assemble.log"
: >"$LOG"
export PYTHONUNBUFFERED=1 SKILLCACHE_HOME=/tmp/skillcache-gpu
if [[ "${1:-}" == "--dry-run" ]]; then
  PY=${PY:-.venv/bin/python}
  args=(--model llama-smoke --tokens 1024 --device cpu --repeats 2)
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl 2>&1 | tee -a "$LOG" || exit 1
  export PYTHONPATH=/tmp/site
  PY=python3
  args=(--model llama-3.1-8b --tokens 32768 --device cuda --repeats 5)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
fi
timeout 240 $PY bench/gpu/assemble_head.py "${args[@]}" --json "$OUT/assemble.json" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"

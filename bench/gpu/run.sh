#!/usr/bin/env bash
# The GPU benchmark as one script, on a lent GPU machine (after bench/gpu/prepare.sh here, carrying .gpu):
# bench/ttft.py with random-weight models shaped like Llama-3.1-8B and Qwen3-8B, bf16, 2k to 32k tokens, and
# bench/decode.py: the serving engine's batched decode at 1, 8 and 32 streams (Llama-3.1-8B shape).
# Results (JSON, PNG; one log, run.log, with the GPU's name) go to $OUT (the device tool brings them back), else
# bench/out. Six files: the device tool returns at most eight. Each stage is capped (timeout) so that one slow stage
# cannot starve the others of the call's 600 s; a failed or capped stage is reported and the next one runs.
#   bash bench/gpu/run.sh            on the GPU
#   bash bench/gpu/run.sh --dry-run  here, on CPU: the same path with a two-layer model and short skills
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
: >"$LOG"
export PYTHONUNBUFFERED=1 SKILLCACHE_BENCH_TOKENIZER=.gpu/tokenizer SKILLCACHE_HOME=/tmp/skillcache-gpu
if [[ "${1:-}" == "--dry-run" ]]; then
  PY=${PY:-.venv/bin/python}
  models="llama-smoke"; device=cpu; lengths="256 512"; repeats=1; contexts="128"; batch="1 2"
  caps="600 600 600"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl 2>&1 | tee -a "$LOG" || exit 1
  export PYTHONPATH=/tmp/site
  PY=python3
  models="llama-3.1-8b qwen3-8b"; device=cuda; lengths="2048 8192 16384 32768"; repeats=3; contexts="2048 8192"
  batch="1 8 32"
  caps=${GPU_STAGE_CAPS:-"180 120 150"}  # seconds: ttft first model, decode, ttft second model
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
fi
read -r cap_ttft1 cap_decode cap_ttft2 <<<"$caps"
failed=0
stage() {  # stage CAP_S NAME CMD...: run CMD under a time cap, its output into the log
  local cap=$1 name=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name (cap ${cap}s)" | tee -a "$LOG"
  timeout "$cap" "$@" 2>&1 | tee -a "$LOG"
  rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s$([[ $rc == 124 ]] && echo ' (capped)')" | tee -a "$LOG"
  [[ $rc == 0 ]] || failed=1
}
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  2>&1 | tee -a "$LOG"
ttft() { stage "$1" "ttft $2" $PY bench/ttft.py --model "$2" --device "$device" --lengths $lengths --seams 4 0 16 \
  --repeats "$repeats" --json "$OUT/ttft-$2.json" --png "$OUT/ttft-$2.png"; }
set -- $models
ttft "$cap_ttft1" "$1"
stage "$cap_decode" "decode $1" $PY bench/decode.py --model "$1" --device "$device" --contexts $contexts \
  --batch $batch --json "$OUT/decode-$1.json"
[[ -n "${2:-}" ]] && ttft "$cap_ttft2" "$2"
exit $failed

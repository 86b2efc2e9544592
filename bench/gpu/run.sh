#!/usr/bin/env bash
# The GPU benchmark as one script, on a lent GPU machine (after bench/gpu/prepare.sh here, carrying .gpu):
# bench/ttft.py with random-weight models shaped like Llama-3.1-8B and Qwen3-8B, bf16, 2k to 32k tokens, and
# bench/decode.py: the serving engine's batched decode at 1, 8 and 32 streams (Llama-3.1-8B shape).
# Results (JSON, PNG, the GPU's name) go to $OUT (the device tool brings them back), else bench/out.
#   bash bench/gpu/run.sh            on the GPU
#   bash bench/gpu/run.sh --dry-run  here, on CPU: the same path with a two-layer model and short skills
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SKILLCACHE_BENCH_TOKENIZER=.gpu/tokenizer SKILLCACHE_HOME=/tmp/skillcache-gpu
if [[ "${1:-}" == "--dry-run" ]]; then
  PY=${PY:-.venv/bin/python}
  models="llama-smoke"; device=cpu; lengths="256 512"; repeats=1; contexts="128"; batch="1 2"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
  export PYTHONPATH=/tmp/site
  PY=python3
  models="llama-3.1-8b qwen3-8b"; device=cuda; lengths="2048 8192 16384 32768"; repeats=3; contexts="2048 8192"
  batch="1 8 32"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
for m in $models; do
  $PY bench/ttft.py --model "$m" --device "$device" --lengths $lengths --seams 4 0 16 --repeats "$repeats" \
    --json "$OUT/ttft-$m.json" --png "$OUT/ttft-$m.png" 2>&1 | tee "$OUT/ttft-$m.log"
done
m=${models%% *}
$PY bench/decode.py --model "$m" --device "$device" --contexts $contexts --batch $batch \
  --json "$OUT/decode-$m.json" 2>&1 | tee "$OUT/decode-$m.log"

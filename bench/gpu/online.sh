#!/usr/bin/env bash
# bench/vllm_online.py (issue 42: errata keep vLLM's prefix cache aligned under Poisson load) shaped for a lent GPU:
# vLLM's CUDA build serving a random-weight model of Qwen3-8B's shape (bench/common.CONFIGS["qwen3-8b"], bf16, the
# embedded tokenizer from .gpu/tokenizer: bench/gpu/prepare.sh), the policy of all six shipped skills (~4.6k tokens;
# the paper's is ~8k), vLLM alone and skillcache on vLLM, erratum against in-place, at 1, 3 and 8 times the in-place
# capacity the script's probe measures. Not run yet: this task had no GPU.
# Results (vllm-online.json, vllm-online.png, online.log) go to $OUT (the device tool brings them back), else bench/out.
#   bash bench/gpu/online.sh            on the GPU: needs a python with vLLM's CUDA build (VLLM_PYTHON, default
#                                       python3) and the carried .gpu (wheels, tokenizer)
#   bash bench/gpu/online.sh --dry-run  here, on CPU: the same path at a tiny load (the embedded model, vLLM's CPU
#                                       build, a one-skill policy, two rates, 4 s each; about 4 minutes)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
LOG="$OUT/online.log"
: >"$LOG"
export PYTHONUNBUFFERED=1
arms=(vllm/erratum vllm/in-place sc-vllm/erratum sc-vllm/in-place)
if [[ "${1:-}" == "--dry-run" ]]; then
  PY=${PY:-.venv/bin/python}
  args=(--model embedded --policy-skills refund-policy --rates 0.3 1.5 --duration-s 4 --min-arrivals 0 --drain-s 10
        --warmup 1 --settle-s 20 --arms "${arms[@]}")
  cap=900
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl 2>&1 | tee -a "$LOG" || exit 1
  export PYTHONPATH=/tmp/site SKILLCACHE_HOME=/tmp/skillcache-gpu
  PY=python3
  VLLM_PY=${VLLM_PYTHON:-python3}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
  if ! "$VLLM_PY" -c "import vllm, torch; assert torch.cuda.is_available(); print('vllm', vllm.__version__)" \
      2>&1 | tee -a "$LOG"; then
    echo "no vLLM CUDA build in $VLLM_PY (set VLLM_PYTHON)" | tee -a "$LOG"
    exit 2
  fi
  MODEL=${ONLINE_MODEL:-/tmp/qwen3-8b-random}
  if [[ ! -f "$MODEL/config.json" ]]; then  # random weights of the Qwen3-8B shape, saved once (~16 GB)
    $PY - "$MODEL" <<'PYEOF' 2>&1 | tee -a "$LOG" || exit 1
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
sys.path.insert(0, "bench")
from common import CONFIGS
out = Path(sys.argv[1])
kind, kw = CONFIGS["qwen3-8b"]
cfg = AutoConfig.for_model(kind, **kw, torch_dtype="bfloat16", architectures=["Qwen3ForCausalLM"])
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
for f in Path(".gpu/tokenizer").iterdir():
    if f.name not in ("config.json", "generation_config.json"):
        shutil.copy(f, out)
print("random-weight qwen3-8b in", out)
PYEOF
  fi
  args=(--model "$MODEL" --dtype bfloat16 --vllm-python "$VLLM_PY" --policy-skills refund-policy tool-specs
        style-guide shipping-faq account-security escalation-playbook --factors 1 3 8 --duration-s 20 --drain-s 10
        --threads 8 --sc-vllm-threads 8 --arms "${arms[@]}"
        --vllm-extra "--gpu-memory-utilization 0.45 --max-model-len 16384")
  cap=${ONLINE_CAP:-560}
fi
timeout "$cap" $PY bench/vllm_online.py "${args[@]}" --json "$OUT/vllm-online.json" --png "$OUT/vllm-online.png" \
  2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "=== vllm_online: rc=$rc$([[ $rc == 124 ]] && echo ' (capped)')" | tee -a "$LOG"
exit "$rc"

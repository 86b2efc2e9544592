#!/usr/bin/env bash
# make run-vllm: vLLM's CPU build (with skillcache's KV connector) on a free loopback port, and skillcache in front of
# it on HOST:PORT with SKILLCACHE_ENGINE=vllm. Installs vLLM into .venv-vllm on first use (scripts/install-vllm.sh).
#   HOST=127.0.0.1 PORT=8000 VLLM_PORT=<free> scripts/run-vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
VENV=${VENV:-.venv}
scripts/install.sh "$VENV"
scripts/install-vllm.sh .venv-vllm
PY="$VENV/bin/python"
VLLM_PORT=${VLLM_PORT:-$("$PY" -c 'from service.devserver import free_port; print(free_port())')}
# where vLLM's connector keeps the K/V it saves (compiled blocks, composition steps): a tmpfs. service.vllm.launch
# hands it to the connector (its --spans-dir default is this setting); skillcache's side holds no K/V
export SKILLCACHE_VLLM_SPANS_DIR=${SKILLCACHE_VLLM_SPANS_DIR:-/dev/shm/skillcache-spans}
home=${SKILLCACHE_HOME:-$HOME/.cache/skillcache}
mkdir -p "$home"
log="$home/vllm.log"
"$PY" -m service.vllm.launch --print-model-dir >/dev/null  # convert the model once, before vLLM reads it
setsid "$PY" -m service.vllm.launch --port "$VLLM_PORT" >"$log" 2>&1 &
vllm_pid=$!
trap 'kill -TERM -- -$vllm_pid 2>/dev/null || true; wait $vllm_pid 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
echo "run-vllm: vLLM with the skillcache connector on http://127.0.0.1:$VLLM_PORT (log: $log; 1-3 min to start)"
echo "run-vllm: skillcache on http://$HOST:$PORT, SKILLCACHE_ENGINE=vllm; /readyz says ready once both are up"
# skillcache runs no forward pass per request in vLLM mode (vLLM compiles the blocks and computes the seams and the
# turn); its model only tokenizes, fingerprints and runs the start-up self-check. One torch thread is enough for that
# and leaves every core to vLLM, whose worker also busy-polls a core for a second after each request (its shm queue)
SKILLCACHE_ENGINE=vllm SKILLCACHE_VLLM_URL="http://127.0.0.1:$VLLM_PORT" \
  SKILLCACHE_TORCH_THREADS=${SKILLCACHE_TORCH_THREADS:-1} "$PY" -m service --host "$HOST" --port "$PORT"

#!/usr/bin/env bash
# make run-vllm: vLLM's CPU build (with skillcache's KV connector) on free loopback ports, and skillcache in front of
# it on HOST:PORT with SKILLCACHE_ENGINE=vllm. Installs vLLM into .venv-vllm on first use (scripts/install-vllm.sh).
#   HOST=127.0.0.1 PORT=8000 VLLM_PORT=<free> VLLM_REPLICAS=1 scripts/run-vllm.sh
# VLLM_REPLICAS=N (default 1): N vLLM servers (VLLM_PORT is the first one's port; the others on free ports), the
# machine's cores split between them, each with its own spans dir (<spans dir>/replica-<i>, as if on N hosts) and
# skillcache routing each composition to one of them (SKILLCACHE_VLLM_URL lists them all). With N > 1 their records
# are shared through Redis (SKILLCACHE_VLLM_SHARED_SPANS=true): SKILLCACHE_REDIS_URL when it is set, else a
# redis-server started here on a free port (no persistence) and stopped on exit. Every process started here is
# stopped on exit. docs/OPERATIONS.md, "Replicas".
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
VENV=${VENV:-.venv}
REPLICAS=${VLLM_REPLICAS:-1}
[[ "$REPLICAS" =~ ^[1-9][0-9]*$ ]] || { echo "run-vllm: VLLM_REPLICAS must be a positive integer" >&2; exit 2; }
scripts/install.sh "$VENV"
scripts/install-vllm.sh .venv-vllm
PY="$VENV/bin/python"
free_port() { "$PY" -c 'from service.devserver import free_port; print(free_port())'; }
# where vLLM's connector keeps the K/V it saves (compiled blocks, composition steps): a tmpfs. service.vllm.launch
# hands it to the connector (its --spans-dir default is this setting); skillcache's side holds no K/V
export SKILLCACHE_VLLM_SPANS_DIR=${SKILLCACHE_VLLM_SPANS_DIR:-/dev/shm/skillcache-spans}
home=${SKILLCACHE_HOME:-$HOME/.cache/skillcache}
mkdir -p "$home"
pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_all EXIT
trap 'exit 130' INT TERM
if [ "$REPLICAS" -gt 1 ] && [ "${SKILLCACHE_VLLM_SHARED_SPANS:-true}" != "false" ]; then
  export SKILLCACHE_VLLM_SHARED_SPANS=true
  if [ -z "${SKILLCACHE_REDIS_URL:-}" ]; then
    command -v redis-server >/dev/null || { echo "run-vllm: VLLM_REPLICAS>1 shares blocks through Redis: set" \
      "SKILLCACHE_REDIS_URL or install redis-server (scripts/ensure-redis.sh)" >&2; exit 2; }
    redis_port=$(free_port)
    mkdir -p "$home/redis-$redis_port"
    setsid redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
      --dir "$home/redis-$redis_port" --logfile "$home/redis-$redis_port/redis.log" &
    pids+=($!)
    export SKILLCACHE_REDIS_URL="redis://127.0.0.1:$redis_port/0"
    echo "run-vllm: a redis-server for the shared blocks on $SKILLCACHE_REDIS_URL (stopped on exit)"
  fi
fi
"$PY" -m service.vllm.launch --print-model-dir >/dev/null  # convert the model once, before vLLM reads it
ncpu=$(nproc)
per=$(( ncpu / REPLICAS > 0 ? ncpu / REPLICAS : 1 ))
urls=()
for ((i = 0; i < REPLICAS; i++)); do
  if [ "$i" -eq 0 ]; then port=${VLLM_PORT:-$(free_port)}; else port=$(free_port); fi
  if [ "$REPLICAS" -eq 1 ]; then
    log="$home/vllm.log"; spans="$SKILLCACHE_VLLM_SPANS_DIR"
  else
    log="$home/vllm-$i.log"; spans="$SKILLCACHE_VLLM_SPANS_DIR/replica-$i"
    first=$(( (i * per) % ncpu )); last=$(( first + per - 1 ))
    export VLLM_CPU_OMP_THREADS_BIND="$first-$last"  # this replica's cores (service.vllm.launch's default: all)
  fi
  setsid "$PY" -m service.vllm.launch --port "$port" --spans-dir "$spans" >"$log" 2>&1 &
  pids+=($!)
  urls+=("http://127.0.0.1:$port")
  echo "run-vllm: vLLM replica $i with the skillcache connector on http://127.0.0.1:$port (log: $log; 1-3 min to start)"
done
[ "$REPLICAS" -eq 1 ] || unset VLLM_CPU_OMP_THREADS_BIND
vllm_url=$(IFS=,; echo "${urls[*]}")
echo "run-vllm: skillcache on http://$HOST:$PORT, SKILLCACHE_ENGINE=vllm over $vllm_url; /readyz says ready once" \
  "skillcache and a vLLM replica are up"
# skillcache holds no model in vLLM mode (vLLM compiles the blocks and computes the seams and the turn; skillcache
# tokenizes, plans and fingerprints from the tokenizer and config). One torch thread is enough for that and leaves
# every core to vLLM, whose worker also busy-polls a core for a second after each request (its shm queue)
SKILLCACHE_ENGINE=vllm SKILLCACHE_VLLM_URL="$vllm_url" \
  SKILLCACHE_TORCH_THREADS=${SKILLCACHE_TORCH_THREADS:-1} "$PY" -m service --host "$HOST" --port "$PORT"

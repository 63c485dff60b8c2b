#!/bin/bash
# The CPU engine's A/B (issue 40): an old build against this one, servers one after another and
# interleaved, each fresh, on the load of the issue's table: `pdserve bench serve`, 32 requests of
# 256 random prompt token ids and 64 output tokens at concurrency 8, SmolLM2-135M-Instruct.
#   benchmarks/cpu_engine_ab.sh OLD_TREE [OUT_DIR] [ROUNDS]
#   e.g. git worktree add /tmp/old 1df4e94 && benchmarks/cpu_engine_ab.sh /tmp/old benchmarks/results 2
# Each round runs every build colocated, then 1P1D (the order flips every round). The builds:
# `old`, `new` (this tree, its defaults) and `newx` (this tree with NEWX_FLAGS, e.g. '--cpu-gemm
# bf16'; left out when NEWX_FLAGS is empty).
# Each server starts only once the one-minute load is under 0.5 (or after 2 min). Writes, per
# server, the bench's JSON and the worker step log; then `cpu-engine-ab.json` (the summary,
# with provenance) under OUT_DIR, and prints one table.
set -u
cd "$(dirname "$0")/.."
OLD=$(cd "${1:?old tree}" && pwd)
mkdir -p "${2:-benchmarks/results/local}"
OUT=$(cd "${2:-benchmarks/results/local}" && pwd)
ROUNDS=${3:-2}
NEW=$PWD
PY=${PY:-$NEW/.venv/bin/python}
MODEL=${MODEL:-smollm2-135m-instruct}
PORT=${PORT:-8123}
RUNS="$OUT/cpu-engine-ab"
mkdir -p "$RUNS"
run() {  # label tree serve-flags...
  local label=$1 tree=$2; shift 2
  for _ in $(seq 40); do awk '{exit !($1>0.5)}' /proc/loadavg || break; sleep 3; done
  local load; load=$(cut -d' ' -f1 /proc/loadavg)
  local t0; t0=$(date +%s.%N)
  (cd "$tree" && PYTHONPATH="$tree" exec "$PY" -m cli serve --model "$MODEL" --port "$PORT" "$@" \
    > "$RUNS/$label.serve.log" 2>&1) &
  local spid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1; do
    sleep 0.5
    kill -0 $spid 2> /dev/null || { echo "$label: server died" >&2; return; }
  done
  local ready; ready=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
  echo "== $label: ready in $ready s, load at start $load" >&2
  "$PY" -m cli bench serve --base-url "http://127.0.0.1:$PORT" --num-requests 32 --random-input-len 256 \
    --random-output-len 64 --max-concurrency 8 --prompt-token-ids --request-rate inf --seed 7 --no-progress \
    --json --out-dir "$RUNS/serve" > "$RUNS/$label.json" 2> "$RUNS/$label.bench.err"
  curl -sf "http://127.0.0.1:$PORT/v1/workers/steps" > "$RUNS/$label.steps.json"
  echo "{\"ready_s\": $ready, \"load_at_start\": $load}" > "$RUNS/$label.start.json"
  kill -INT $spid; wait $spid 2> /dev/null
}
BUILDS="old new"
[ -n "${NEWX_FLAGS:-}" ] && BUILDS="old new newx"
for r in $(seq "$ROUNDS"); do
  order=$BUILDS
  [ $((r % 2)) -eq 0 ] && order=$(echo "$BUILDS" | tr ' ' '\n' | tac | tr '\n' ' ')
  for mode in colocated disagg; do
    for build in $order; do
      case $build in
        old) run "$build-$mode-$r" "$OLD" --mode "$mode" ;;
        new) run "$build-$mode-$r" "$NEW" --mode "$mode" ;;
        newx) run "$build-$mode-$r" "$NEW" --mode "$mode" $NEWX_FLAGS ;;
      esac
    done
  done
done
"$PY" -m benchmarks.cpu_engine_ab_summary "$RUNS" "$OLD" --out "$OUT/cpu-engine-ab.json"

#!/bin/bash
# The CPU engine's A/B (issue 40): an old build against this one, servers one after another and
# interleaved, each fresh, on the load of the issue's table: `pdserve bench serve`, 32 requests of
# 256 random prompt token ids and 64 output tokens at concurrency 8, SmolLM2-135M-Instruct.
#   benchmarks/cpu_engine_ab.sh OLD_TREE [OUT_DIR] [ROUNDS]
#   e.g. git worktree add /tmp/old 1df4e94 && benchmarks/cpu_engine_ab.sh /tmp/old benchmarks/results 2
# Each round runs old and new colocated, then old and new 1P1D (the order flips every round).
# Each server starts only once the one-minute load is under 0.5 (or after 2 min). Writes, per
# server, the bench's JSON and the worker step log; then `cpu-engine-ab.json` (the summary,
# with provenance) under OUT_DIR, and prints one table.
set -u
cd "$(dirname "$0")/.."
OLD=$(cd "${1:?old tree}" && pwd)
OUT=${2:-benchmarks/results/local}
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
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then first=old; second=new; else first=new; second=old; fi
  for mode in colocated disagg; do
    for build in $first $second; do
      tree=$OLD; [ "$build" = new ] && tree=$NEW
      run "$build-$mode-$r" "$tree" --mode "$mode"
    done
  done
done
"$PY" -m benchmarks.cpu_engine_ab_summary "$RUNS" "$OLD" --out "$OUT/cpu-engine-ab.json"

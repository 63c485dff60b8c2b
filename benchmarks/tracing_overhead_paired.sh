#!/bin/bash
# Decode ITL with request tracing off vs on, in pairs: two identical `pdserve serve` (tiny model,
# disagg 1P1D), one with --otlp-endpoint to a loopback OTLP/HTTP receiver, each driven by its own
# `pdserve bench serve`, both started together so that whatever else the machine runs hits both.
#   benchmarks/tracing_overhead_paired.sh [PAIRS] [OUT_DIR]     (docs/results.md, issue 24)
set -u
cd "$(dirname "$0")/.."
PAIRS=${1:-3}
OUT=${2:-benchmarks/results/local}
PY=${PY:-python}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
$PY -c "
import time, sys
sys.path.insert(0, '.')
from tests.test_observability import OTLPReceiver
r = OTLPReceiver()
open('$LOGS/receiver.url', 'w').write(r.url)
while True:
    time.sleep(5)
    print('spans', len(r.spans), flush=True)
" > "$LOGS/receiver.log" 2>&1 &
RPID=$!
for _ in $(seq 50); do [ -s "$LOGS/receiver.url" ] && break; sleep 0.2; done
URL=$(cat "$LOGS/receiver.url")
for pair in $(seq "$PAIRS"); do
  $PY -m cli serve --model tiny --mode disagg --port 8741 > "$LOGS/serve-off-$pair.log" 2>&1 &
  S1=$!
  $PY -m cli serve --model tiny --mode disagg --port 8742 --otlp-endpoint "$URL" > "$LOGS/serve-on-$pair.log" 2>&1 &
  S2=$!
  for _ in $(seq 240); do
    grep -q "at http://127.0.0.1:8741/v1" "$LOGS/serve-off-$pair.log" && grep -q "at http://127.0.0.1:8742/v1" "$LOGS/serve-on-$pair.log" && break
    sleep 1
  done
  B=""
  for mode in off on; do
    port=8741; [ $mode = on ] && port=8742
    $PY -m cli bench serve --base-url http://127.0.0.1:$port --num-requests 64 --max-concurrency 8 \
      --random-input-len 64 --random-output-len 64 --prompt-token-ids --seed "$pair" --no-progress \
      --out "paired-$mode-$pair" --out-dir "$OUT" > "$LOGS/bench-$mode-$pair.log" 2>&1 &
    B="$B $!"
  done
  wait $B
  kill -INT $S1 $S2 2>/dev/null; wait $S1 $S2
  echo "pair $pair done $(date -u +%T); results: $OUT/paired-{off,on}-$pair.json; logs: $LOGS"
done
kill $RPID

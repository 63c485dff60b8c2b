#!/bin/bash
# Layer-wise vs bulk KV transfer on the cluster rehearsal (docs/cluster.md), one rate at a time:
# a 3-node cluster whose links `tc tbf` shapes to G Gbit/s, `pdserve serve` on node 0 with the
# prefill pool on node 1 and the decode pool on node 2 (the KV crosses the shaped link over TCP),
# then `pdserve bench layerwise` from the host, A/B on that one server (issue 39's targets).
#   sudo benchmarks/layerwise_cluster.sh [RATES] [OUT_DIR] [EXTRA BENCH FLAGS...]
#   e.g. benchmarks/layerwise_cluster.sh "0.1 1 10" benchmarks/results --docs 6
# AUTO_WORDS=N also checks `--kv-transfer auto` on short prompts (bulk vs auto, N-word documents)
# on the same server (ONLY_AUTO=1: that check alone); SERVE_FLAGS adds `pdserve serve` flags.
set -u
cd "$(dirname "$0")/.."
RATES=${1:-"0.1 1 10"}
OUT=${2:-benchmarks/results/local}
shift 2 2>/dev/null || shift $#
export PATH="$PWD/.venv/bin:$PATH"  # `cluster exec` runs `pdserve` inside the node's namespace
PDS=${PDS:-pdserve}
MODEL=${MODEL:-smollm2-135m-instruct}
NAME=${NAME:-lw}
PORT=8000
mkdir -p "$OUT"
for rate in $RATES; do
  $PDS cluster down --name "$NAME" > /dev/null 2>&1
  head=$($PDS cluster up --name "$NAME" --nodes 3 --link-gbps "$rate" --json | python3 -c "import json,sys; print(json.load(sys.stdin)['head_address'])")
  host=${head%%:*}  # head_address is HOST:PORT
  echo "== $rate Gbit/s: head $head" >&2
  $PDS cluster exec 0 --name "$NAME" -- pdserve serve --model "$MODEL" --ray-address "$head" --host "$host" \
    --port $PORT --prefill-resources '{"node1": 1}' --decode-resources '{"node2": 1}' --link-gbps "$rate" \
    --no-prefix-cache ${SERVE_FLAGS:-} > "$OUT/layerwise-$rate-serve.log" 2>&1 &
  for _ in $(seq 150); do curl -sf "http://$host:$PORT/health" > /dev/null && break; sleep 2; done
  echo "load at start: $(cut -d' ' -f1 /proc/loadavg)" >&2
  # the rehearsal's tbf burst (cluster/netns.py tbf_args): the predictions' token bucket
  burst_kib=$(python3 -c "print(max(256, $rate * 1e9 / 8 * 1e-3 / 1024))")
  if [ -z "${ONLY_AUTO:-}" ]; then
    $PDS bench layerwise --base-url "http://$host:$PORT" --link-gbps "$rate" --link-burst-kib "$burst_kib" \
      --out "layerwise-${rate}g" --out-dir "$OUT" "$@"
  fi
  if [ -n "${AUTO_WORDS:-}" ]; then
    $PDS bench layerwise --base-url "http://$host:$PORT" --link-gbps "$rate" --link-burst-kib "$burst_kib" \
      --modes bulk,auto \
      --doc-words "$AUTO_WORDS" --out "layerwise-auto-${AUTO_WORDS}w-${rate}g" --out-dir "$OUT" "$@"
  fi
  $PDS cluster down --name "$NAME" > /dev/null 2>&1
  wait
done

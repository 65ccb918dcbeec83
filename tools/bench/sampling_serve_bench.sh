#!/bin/bash
# Greedy against top_p 0.9 (temperature 0.8) served on the CPU to 16 concurrent requests, for one or
# more relgen-server binaries (e.g. two commits' builds), interleaved: for each repetition, each
# server, each sampling mode, a fresh server and one closed-loop run of relgen-bench serve. Prints
# the output tokens/s of every run and the medians with ranges.
#
#   bash tools/bench/sampling_serve_bench.sh MODEL_DIR [REPS] SERVER_BINARY...
#   (defaults: REPS 3; the load is --concurrency 16 --num_requests 32 --prompt_len 32 --output_len 32)
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$1
reps=${2:-3}
shift 2
bench=build/tools/relgen-bench
[ -x "$bench" ] || { echo "sampling_serve_bench: build first (tools/bootstrap.sh build)" >&2; exit 2; }
results=$(mktemp)
for rep in $(seq "$reps"); do
  for server in "$@"; do
    for mode in greedy top_p; do
      log=$(mktemp)
      "$server" --model "$model" --listen 127.0.0.1:0 --metrics_listen 127.0.0.1:0 --http_listen 127.0.0.1:0 --max_num_seqs 16 >"$log" 2>&1 &
      pid=$!
      until grep -q "gRPC on" "$log"; do
        kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
        sleep 0.2
      done
      addr=$(grep -o "gRPC on [^ ;]*" "$log" | head -1 | cut -d' ' -f3)
      if [ "$mode" = greedy ]; then flags="--temperature 0"; else flags="--temperature 0.8 --top_p 0.9"; fi
      line=$("$bench" serve --server "$addr" --concurrency 16 --num_requests 32 --prompt_len 32 --output_len 32 \
               --spread 0 $flags 2>/dev/null | awk '/^c=/ {print $4}')
      kill $pid; wait $pid 2>/dev/null || true
      rm -f "$log"
      echo "rep $rep  $server  $mode  $line tok/s"
      echo "$server $mode $line" >>"$results"
    done
  done
done
echo "== medians [min-max] of output tokens/s over $reps repetitions"
python3 - "$results" <<'PY'
import sys, collections, statistics
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    server, mode, tps = line.split()
    runs[(server, mode)].append(float(tps))
for server in dict.fromkeys(k[0] for k in runs):
    g, p = runs[(server, "greedy")], runs[(server, "top_p")]
    print(f"{server}: greedy {statistics.median(g):.1f} [{min(g):.1f}-{max(g):.1f}]  "
          f"top_p 0.9 {statistics.median(p):.1f} [{min(p):.1f}-{max(p):.1f}]  "
          f"ratio {statistics.median(p) / statistics.median(g):.2f}")
PY
rm -f "$results"

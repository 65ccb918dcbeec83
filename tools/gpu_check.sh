#!/bin/bash
# The CUDA suite and the GPU engine bench on a machine that has a GPU and PyTorch but none of
# relgen's build dependencies: the binaries, their shared libraries and the test data are packed
# here and unpacked there.
#
#   bash tools/gpu_check.sh pack [BUILD_DIR] [PACK]   (here: a built tree with RELGEN_CUDA=ON)
#   bash tools/gpu_check.sh run PACK OUT_DIR          (there: logs, JSON and a summary in OUT_DIR)
#
# `run` keeps going past a failing stage, so one call yields every figure it can; each stage has
# its own time limit. The data's manifests hold absolute paths from the build tree, so `run` makes
# the same paths there (symbolic links); the torch peer is found the same way.
set -u

pack() {
  local build=${1:-build} out=${2:-.gpu/relgen-gpu.tar.xz}
  local src
  src=$(cd "$(dirname "$0")/.." && pwd)
  local bins=("$build/tests/cuda_backend_test" "$build/tools/relgen-bench" "$build/server/relgen-server")
  for b in "${bins[@]}"; do
    [ -x "$b" ] || { echo "gpu_check: $b is missing (build with -DRELGEN_CUDA=ON)" >&2; exit 2; }
  done
  local stage
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/lib" "$stage/lib-fallback" "$stage/data"
  for b in "${bins[@]}"; do strip -o "$stage/bin/$(basename "$b")" "$b"; done
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
  for d in golden hf_checkpoints t5_checkpoints; do
    [ -d "$build/$d" ] || { echo "gpu_check: $build/$d is missing (run ctest once to make it)" >&2; exit 2; }
  done
  tar -C "$build" --exclude="$build/*/bad" --exclude='bad' --exclude='*-sharded' -cf - golden hf_checkpoints \
    t5_checkpoints | tar -C "$stage/data" -xf - || exit 2
  (cd "$build" && pwd) >"$stage/build_dir"
  echo "$src" >"$stage/source_dir"
  mkdir -p "$(dirname "$out")"
  tar -C "$stage" -cf - . | xz -T0 -6 >"$out"
  rm -rf "$stage"
  echo "gpu_check: packed $(du -h "$out" | cut -f1) into $out"
}

# stage NAME LIMIT_S COMMAND...: runs with a time limit, logs to OUT/NAME.log, records the status.
# GPU_CHECK_STAGES picks among test, sanitize, bench, profile, shapes, serve (default: all; serve runs
# inside shapes, for the bloom shape).
want() { [[ ",${GPU_CHECK_STAGES:-test,sanitize,bench,profile,shapes,serve}," == *",$1,"* ]]; }

# Stages run in order of importance; one whose limit would pass GPU_CHECK_BUDGET (seconds since
# the start, default 420) gets what is left, and none starts with under 20 s left.
stage() {
  local name=$1 limit=$2
  shift 2
  local left=$((${GPU_CHECK_BUDGET:-420} - SECONDS))
  if [ "$left" -lt 20 ]; then
    printf '%-28s skipped (budget spent)\n' "$name" | tee -a "$OUT/summary.txt"
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-28s rc=%-4s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$name.log"
  return $rc
}

run() {
  local packfile=$1
  OUT=$2
  mkdir -p "$OUT"
  : >"$OUT/summary.txt"
  local root=/tmp/relgen-gpu src
  src=$(cd "$(dirname "$0")/.." && pwd)
  rm -rf "$root" && mkdir -p "$root"
  xz -dc "$packfile" | tar -C "$root" -xf - || { echo "gpu_check: cannot unpack $packfile"; exit 2; }
  local build srcdir
  build=$(cat "$root/build_dir")
  srcdir=$(cat "$root/source_dir")
  if [ "$srcdir" != "$src" ]; then
    mkdir -p "$(dirname "$srcdir")" && ln -sfn "$src" "$srcdir"
  fi
  mkdir -p "$build"
  for d in golden hf_checkpoints t5_checkpoints; do [ -e "$build/$d" ] || ln -s "$root/data/$d" "$build/$d"; done
  export LD_LIBRARY_PATH="$root/lib"
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH+=":$d"
  done
  if ! ldd "$root/bin/cuda_backend_test" | grep -q 'libcublas.so.13 => /'; then
    local py_cublas
    py_cublas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -n 1)
    [ -n "$py_cublas" ] && LD_LIBRARY_PATH+=":$(dirname "$py_cublas")"
  fi
  if ldd "$root/bin/relgen-bench" | grep -q 'GLIBCXX.*not found'; then LD_LIBRARY_PATH+=":$root/lib-fallback"; fi
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    nvidia-smi -L
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldd "$root/bin/cuda_backend_test" "$root/bin/relgen-bench" | grep -E 'not found|cublas|cudart|stdc'
  } >"$OUT/device.txt" 2>&1
  cat "$OUT/device.txt"
  local name gbps
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
  # The card's nominal HBM bandwidth (datasheet): the floor's divisor, not a figure of this run.
  case "$name" in
    *H200*) gbps=4800 ;;
    *H100*PCIe*) gbps=2000 ;;
    *H100*) gbps=3350 ;;
    *A100*80GB*) gbps=2039 ;;
    *A100*) gbps=1555 ;;
    *) gbps=0 ;;
  esac
  echo "device: $name; nominal ${gbps} GB/s"
  local gb=()
  [ "$gbps" != 0 ] && gb=(--device_GBps "$gbps")

  export RELGEN_GOLDEN_DIR=$build/golden RELGEN_HF_CASES_DIR=$build/hf_checkpoints \
    RELGEN_T5_CASES_DIR=$build/t5_checkpoints
  local test=("$root/bin/cuda_backend_test" --gtest_brief=1)
  if want test; then
    stage cuda_backend_test "${GPU_CHECK_TEST_LIMIT:-240}" "${test[@]}" --gtest_output="json:$OUT/cuda_backend_test.json"
    grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/cuda_backend_test.log" | head -n 40
  fi
  local sanitizer
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -n 1)
  if want sanitize && [ -n "$sanitizer" ]; then
    # The kernels' own tests under the memory checker; the tiled kernel's shared memory under the
    # race checker.
    stage memcheck 150 "$sanitizer" --tool memcheck --error-exitcode 9 "${test[@]}" \
      --gtest_filter='*CudaAttention*:*CudaKernels*:*CudaRelpos*'
    stage racecheck 120 "$sanitizer" --tool racecheck --error-exitcode 9 "${test[@]}" \
      --gtest_filter='*CudaAttention*:*CudaKernels*'
  fi

  local model=/tmp/bench-model
  local py=${GPU_CHECK_PYTHON:-python3}
  local bench=("$root/bin/relgen-bench" engine --device cuda --model "$model" "${gb[@]}")
  if want bench || want profile; then
    stage make_model 120 "$py" "$src/tools/make_random_model.py" --out "$model" --name bench-skew \
      --d-model 512 --n-layers 6 --n-heads 8 --ffn-dim 2048 --max-seq-len 4096 --max-relative-position 512
  fi
  if want bench; then
    stage bench_f32_torch "${GPU_CHECK_BENCH_LIMIT:-200}" "${bench[@]}" --batches 1,8,64 --contexts 512,2048 \
      --reps 3 --peer torch --peer_python "$py" --json "$OUT/bench_f32_torch.json"
    stage bench_bf16 "${GPU_CHECK_BENCH_LIMIT:-120}" "${bench[@]}" --batches 1,8,64 --contexts 512,2048 --reps 3 \
      --peer none --weights_dtype bf16 --kv_cache_dtype bf16 --json "$OUT/bench_bf16.json"
    stage bench_cublas "${GPU_CHECK_BENCH_LIMIT:-120}" "${bench[@]}" --batches 1,64 --contexts 512 --reps 3 \
      --peer none --cuda_gemm cublas --json "$OUT/bench_cublas.json"
    stage bench_mma "${GPU_CHECK_BENCH_LIMIT:-120}" "${bench[@]}" --batches 1,8,64 --contexts 512 --reps 3 \
      --peer none --weights_dtype bf16 --kv_cache_dtype bf16 --cuda_gemm mma --json "$OUT/bench_mma.json"
  fi
  # Per-kernel device time of a few decode steps (the last launches of each run): the performance
  # model's terms one by one, each kernel alone (Nsight Compute serialises them).
  local ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
  if want profile && [ -n "$ncu" ]; then
    for b in 1 64; do
      stage "ncu_batch$b" 90 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
        --log-file "$OUT/ncu_batch$b.csv" "${bench[@]}" --batches "$b" --contexts 512 --steps 3 --reps 1 --peer none
    done
  fi
  # The sizes users serve: bloom-560m, flan-t5-base and mpt-7b shapes made here by transformers from
  # their configs (random bf16 weights), relgen's bf16 weights and K/V beside transformers' generate
  # on the same GPU. GPU_CHECK_SHAPES picks some; a shape's batches come from GPU_CHECK_BATCHES_<name>.
  if want shapes; then
    local shape dir batches
    for shape in ${GPU_CHECK_SHAPES:-bloom-560m flan-t5-base mpt-7b}; do
      dir=/tmp/shapes/$shape
      stage "make_$shape" 200 "$py" "$src/tools/bench/hf_peer.py" make --config "$src/tools/bench/shapes/$shape.json" \
        --out "$dir" --dtype bf16 || continue
      # relgen loads a checkpoint with its tokenizer; the bench feeds ids, so a test fixture's will do.
      case "$shape" in
        bloom*) cp "$build/hf_checkpoints/bloom-h3/tokenizer.json" "$dir/" ;;
        mpt*) cp "$build/hf_checkpoints/mpt-h3/tokenizer.json" "$dir/" ;;
        *t5*) cp "$build/t5_checkpoints/t5-v1_1/spiece.model" "$dir/" ;;
      esac
      batches=1,8,64
      stage "relgen_$shape" 240 "$root/bin/relgen-bench" engine --device cuda --model "$dir" "${gb[@]}" \
        --batches "$batches" --contexts 512 --steps 8 --reps 1 --peer none --weights_dtype bf16 --kv_cache_dtype bf16 \
        --batch_prefill 0 --json "$OUT/relgen_$shape.json"
      stage "relgen_mma_$shape" 240 "$root/bin/relgen-bench" engine --device cuda --model "$dir" "${gb[@]}" \
        --batches "$batches" --contexts 512 --steps 8 --reps 1 --peer none --weights_dtype bf16 --kv_cache_dtype bf16 \
        --cuda_gemm mma --batch_prefill 0 --json "$OUT/relgen_mma_$shape.json"
      stage "hf_$shape" 200 "$py" "$src/tools/bench/hf_peer.py" bench --model "$dir" --batches "$batches" \
        --context 512 --steps 16 --reps 2 --json "$OUT/hf_$shape.json"
      # The host's share of a step (issue 32): 64 clients served with and without overlapped steps,
      # top_p 0.9, interleaved; the difference in tokens/s is the host time the overlap hides.
      if [[ "$shape" == bloom* ]] && want serve; then
        local rep mode log pid addr
        for rep in 1 2; do
          for mode in overlap_steps nooverlap_steps; do
            log=$OUT/serve_${shape}_${mode}_$rep.server.log
            "$root/bin/relgen-server" --model "$dir" --device cuda --weights_dtype bf16 --kv_cache_dtype bf16 \
              --listen 127.0.0.1:0 --metrics_listen 127.0.0.1:0 --http_listen 127.0.0.1:0 --max_num_seqs 64 --"$mode" >"$log" 2>&1 &
            pid=$!
            for _ in $(seq 600); do grep -q "gRPC on" "$log" && break; kill -0 $pid 2>/dev/null || break; sleep 0.2; done
            addr=$(grep -o "gRPC on [^ ;]*" "$log" | head -n 1 | cut -d' ' -f3)
            [ -n "$addr" ] && stage "serve_${shape}_${mode}_$rep" 90 "$root/bin/relgen-bench" serve --server "$addr" \
              --concurrency 64 --num_requests 192 --prompt_len 128 --output_len 128 --spread 0 --temperature 0.8 --top_p 0.9
            kill $pid 2>/dev/null; wait $pid 2>/dev/null
          done
        done
      fi
      rm -rf "$dir"
    done
  fi
  for f in bench_f32_torch bench_bf16 bench_cublas bench_mma; do
    [ -f "$OUT/$f.log" ] || continue
    echo "---- $f"
    sed -n '/^tokens\/s/,/^$/p' "$OUT/$f.log"
  done
  for f in "$OUT"/relgen_*.log; do
    [ -f "$f" ] || continue
    echo "---- $(basename "$f" .log)"
    sed -n '/^model /p;/^tokens\/s/,/^$/p' "$f"
  done
  for f in "$OUT"/hf_*.log; do [ -f "$f" ] && { echo "---- $(basename "$f" .log)"; cat "$f"; }; done
  for f in "$OUT"/serve_*[0-9].log; do [ -f "$f" ] && { echo "---- $(basename "$f" .log)"; grep -E '^c=' "$f"; }; done
  echo "---- summary"
  cat "$OUT/summary.txt"
  # Everything in one archive beside the summary (some harnesses fetch only a few files).
  tar -C "$OUT" -czf /tmp/relgen-gpu-results.tar.gz . && find "$OUT" -mindepth 1 ! -name summary.txt -delete &&
    mv /tmp/relgen-gpu-results.tar.gz "$OUT/results.tar.gz"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; [ $# -eq 2 ] || { echo "usage: gpu_check.sh run PACK OUT_DIR" >&2; exit 64; }; run "$@" ;;
  *) echo "usage: gpu_check.sh pack [BUILD_DIR] [PACK] | run PACK OUT_DIR" >&2; exit 64 ;;
esac

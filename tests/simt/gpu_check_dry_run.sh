#!/bin/bash
# tools/gpu_check.sh's two calls end to end on the SIMT emulator: `pack --emulator` carries the
# emulated binaries, and `run` then makes the tiny shapes (tools/bench/shapes/tiny) with
# transformers on the CPU and goes through every stage of a lent GPU's calls in their order. No
# figure is judged (the emulator's mean nothing); what is checked is what a GPU's two calls rely on:
# both exit 0, each printed its stage table within its budget, every stage ran (rc=0) or was skipped
# with its reason, and the files the report is read from are in the archive.
#
#   gpu_check_dry_run.sh BUILD_DIR HF_PYTHON
set -u
build=$(cd "$1" && pwd)
py=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
work=$build/gpu_check_dry_run
rm -rf "$work" && mkdir -p "$work"
errors=0
fail() { echo "gpu_check_dry_run: FAIL: $*" >&2; errors=$((errors + 1)); }
# Compression is not what is tried here (xz -6 takes a minute on two cores; -0 makes a larger pack
# than a lent GPU is sent).
export GPU_CHECK_WORK=$work GPU_CHECK_PYTHON=$py GPU_CHECK_XZ_LEVEL=0 GPU_CHECK_PACK_LIMIT_MIB=200
# The budgets are a GPU machine's seconds; what is checked here is the stages, not their speed. A
# busy 2-CPU CI machine (a 60 MiB unpack took over 15 s beside a CPU hog) gets each limit and the
# budget 10 times over in real seconds (ctest's timeout still ends a hang).
export GPU_CHECK_SLOWDOWN=${GPU_CHECK_SLOWDOWN:-10}
unset GPU_CHECK_SHAPES GPU_CHECK_HF GPU_CHECK_SKIP

bash "$src/tools/gpu_check.sh" pack --emulator "$build" "$work/pack.tar.xz" || { echo "pack exited $?"; exit 1; }

# check_call CALL BUDGET STAGE[=skip]...: the stages in this order; =skip: skipped with a reason,
# =any: ran with any status or was skipped with a reason.
check_call() {
  local call=$1 budget=$2
  shift 2
  local out=$work/$call
  bash "$src/tools/gpu_check.sh" run "$work/pack.tar.xz" "$out" "$call" >"$work/$call.out" 2>&1
  local rc=$?
  cat "$work/$call.out"
  [ "$rc" = 0 ] || fail "$call exited $rc"
  grep -q "^gpu_check $call: .*budget $budget s" "$work/$call.out" || fail "$call printed no stage table"
  local total
  total=$(awk '$1 == "total" && $3 == "of" {print $2}' "$out/stages.txt" 2>/dev/null)
  [ -n "$total" ] && [ "$total" -le "$budget" ] || fail "$call: stage table's total '$total' is not within $budget s"
  local names=() want line i=0 stage
  for want in "$@"; do names+=("${want%%=*}"); done
  mapfile -t lines < <(grep -v '^total ' "$out/summary.txt")
  [ "${#lines[@]}" = "$#" ] || fail "$call: ${#lines[@]} stages in summary.txt, expected $#"
  for want in "$@"; do
    stage=${want%%=*}
    line=${lines[$i]:-}
    i=$((i + 1))
    [ "$(echo "$line" | awk '{print $1}')" = "$stage" ] || { fail "$call: stage $i is '$line', expected $stage"; continue; }
    case "$want" in
      *=skip) echo "$line" | grep -Eq "^$stage +skipped: .+" || fail "$call: $stage not skipped with a reason: $line" ;;
      *=any) echo "$line" | grep -Eq "^$stage +(rc=[0-9]+ |skipped: .+)" || fail "$call: $stage: $line" ;;
      *) echo "$line" | grep -Eq "^$stage +rc=0 " || fail "$call: $stage did not pass: $line" ;;
    esac
  done
  local left
  left=$(cd "$out" && ls | sort | tr '\n' ' ')
  [ "$left" = "results.tar.gz stages.txt summary.txt " ] || fail "$call: OUT_DIR holds '$left'"
  mkdir -p "$work/$call-results" && tar -C "$work/$call-results" -xzf "$out/results.tar.gz" || fail "$call: no archive"
}

check_call call1 480 unpack device=skip cuda_backend_test \
  make_mpt-7b relgen_mpt-7b_mma relgen_mpt-7b_invariant relgen_mpt-7b_cublas \
  make_bloom-560m relgen_bloom-560m_mma relgen_bloom-560m_invariant relgen_bloom-560m_cublas \
  serve_bloom-560m_overlap serve_bloom-560m_nooverlap make_flan-t5-base relgen_flan-t5-base_mma \
  hf_mpt-7b hf_bloom-560m hf_flan-t5-base
check_call call2 240 unpack ncu_mpt-7b_b64=skip memcheck_tensor_cores=skip \
  relgen_mpt-7b_ctx64_mma relgen_mpt-7b_ctx64_invariant racecheck_tensor_cores=skip

# Limits past a budget: refused before any stage runs.
for call in call1 call2; do
  GPU_CHECK_LIMIT_unpack=300 bash "$src/tools/gpu_check.sh" run "$work/pack.tar.xz" "$work/over-$call" "$call" \
    >"$work/over-$call.out" 2>&1
  rc=$?
  [ "$rc" = 2 ] && grep -q "add up to .* s, over its" "$work/over-$call.out" ||
    fail "$call with limits over its budget exited $rc: $(tail -n 2 "$work/over-$call.out")"
  [ -f "$work/over-$call/summary.txt" ] && fail "$call over its budget ran stages"
done

grep -q '^reusing ' "$work/call2-results/unpack.log" || fail "call2 did not reuse call1's unpacked files"
for f in call1-results/device.txt call1-results/cuda_backend_test.json \
  call1-results/relgen_{mpt-7b_mma,mpt-7b_invariant,mpt-7b_cublas,bloom-560m_mma,bloom-560m_invariant}.json \
  call1-results/relgen_{bloom-560m_cublas,flan-t5-base_mma}.json \
  call1-results/serve_bloom-560m_{overlap,nooverlap}.json call1-results/hf_{mpt-7b,bloom-560m,flan-t5-base}.json \
  call2-results/relgen_mpt-7b_ctx64_{mma,invariant}.json; do
  [ -s "$work/$f" ] || fail "no $f"
done
for f in "$work"/call*-results/relgen_*.json; do
  grep -q '"relgen_decode_tps"' "$f" || fail "$f holds no decode figure"
done
# The host's share of a step, read from the server's metrics around each load.
for mode in overlap nooverlap; do
  grep -Eq '^host per step: plan\+build [0-9.]+ ms, wait [0-9.]+ ms, .*host share [0-9.]+%' \
    "$work/call1-results/serve_bloom-560m_$mode.log" || fail "serve_bloom-560m_$mode printed no host share"
done
if [ "$errors" = 0 ]; then
  echo "gpu_check_dry_run: both calls as planned"
  rm -rf "$work"
fi
[ "$errors" = 0 ]

#!/usr/bin/env bash
# The two commands of the README, for a fresh Debian 12 machine (as root):
#   bash tools/bootstrap.sh serve   install what is missing, build, serve the default model
#   bash tools/bootstrap.sh test    install what is missing, build, run every test
# Both are idempotent: installed packages and an existing build are reused.
#
# `test` runs three build trees (docs/reliability.md): build/ (every suite), build-asan/ (clang,
# ASan+UBSan: every C++ suite and the libFuzzer targets) and build-tsan/ (clang, TSan: the
# concurrency suites). RELGEN_TEST_STAGES picks some, e.g. RELGEN_TEST_STAGES=main.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode="${1:-}"
case "$mode" in
  serve|test|build) ;;
  *) echo "usage: bash tools/bootstrap.sh serve|test|build" >&2; exit 2 ;;
esac
shift

packages=(
  build-essential cmake ninja-build pkg-config git ccache
  libgrpc++-dev protobuf-compiler-grpc protobuf-compiler libprotobuf-dev libabsl-dev
  prometheus-cpp-dev libgtest-dev libgmock-dev libopenblas-dev libopenblas0-pthread
  nlohmann-json3-dev libsentencepiece-dev libcpp-httplib-dev
  python3 python3-torch python3-numpy openssl curl clang libclang-rt-14-dev llvm
  fortunes prometheus python3-brotli python3-yaml python3-grpcio python3-grpc-tools python3-protobuf python3-venv python3-setuptools python3-pip python3-matplotlib python3-mido
  podman runc debootstrap
)
# Listening to what models/chorales writes (tools/render_chorale.py): FluidSynth and a General MIDI
# soundfont (145 MB), for the server's machine only; the tests do not render audio.
if [ "$mode" = serve ]; then
  packages+=(fluidsynth fluid-soundfont-gm)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The test references for Hugging Face checkpoints and tokenizers (transformers and tokenizers), the
# official OpenAI client that tests the HTTP API (tests/openai_api_test.py) and lm-eval, which
# tests/lm_eval_test.py runs against the server, from PyPI in a venv over Debian's torch
# (tests/CMakeLists.txt: RELGEN_HF_PYTHON). Test tools only. lm-eval's own requirements resolve
# against Debian's numpy 1.24 with accelerate 0.34 (its hf backend), pyarrow <= 21 and pandas < 2.3;
# its hf extra is not installed (Debian's torch calls itself 1.13.0a0, which peft's pin refuses;
# peft itself is installed without its pins, below).
if [ "$mode" = test ]; then
  venv=build-hf-venv
  if ! "$venv/bin/python" -c 'import transformers, tokenizers, sentencepiece, openai, lm_eval, accelerate, peft' 2>/dev/null; then
    echo "== making $venv (transformers 4.46.3, tokenizers 0.20.3, openai 1.58.1, lm-eval 0.4.13, peft 0.13.2 from PyPI, over Debian's torch)"
    rm -rf "$venv"
    /usr/bin/python3 -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
      "transformers==4.46.3" "tokenizers==0.20.3" "sentencepiece==0.2.0" \
      "openai==1.58.1" "httpx==0.28.1" \
      "lm-eval[api]==0.4.13" "accelerate==0.34.2" "pyarrow<=21" "numpy==1.24.2" "pandas<2.3"
    # PEFT, the LoRA adapters' reference (tools/make_lora_adapters.py): its torch>=1.13 pin refuses
    # Debian's 1.13.0a0, and everything else it needs is above.
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "peft==0.13.2"
  fi
fi
# music21 (Bach's chorales, tools/chorales.py), mido (MIDI) and matplotlib (piano rolls) for the
# chorale model's tools and tests; a venv of its own, since music21 10 needs numpy >= 1.26 and
# Debian's torch is built on 1.24.
if [ "$mode" = test ] || [ "$mode" = serve ]; then
  venv=build-music-venv
  if ! "$venv/bin/python" -c 'import music21, mido, matplotlib' 2>/dev/null; then
    echo "== making $venv (music21 10.5.1, mido 1.3.3, matplotlib 3.11.2 from PyPI)"
    rm -rf "$venv"
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "music21==10.5.1" "mido==1.3.3" "matplotlib==3.11.2"
  fi
fi

jobs=$(nproc)
# Compiler outputs cached across builds and clones (ccache; ~/.cache/ccache): a clone in another
# folder reuses them (paths under the checkout are hashed relative to it), so a rerun on the same
# machine rebuilds only what changed. RELGEN_CCACHE=0 builds without it.
launcher=()
if [ "${RELGEN_CCACHE:-1}" != 0 ] && command -v ccache > /dev/null; then
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
echo "== configuring and building (build/, $jobs jobs)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" ${RELGEN_CMAKE_ARGS:-} > build.log 2>&1 \
  || { cat build.log; exit 1; }
cmake --build build -j "$jobs"

case "$mode" in
  build) ;;
  test)
    stages="${RELGEN_TEST_STAGES:-main asan tsan}"
    logs=$(mktemp -d)
    run_stage() {  # name, ctest arguments...
      local name=$1
      shift
      echo "== [$name] running tests"
      set +e
      ctest "$@" 2>&1 | tee "$logs/$name.log"
      set -e
    }
    # Each stage's wall time (its build and its tests) goes in the summary: CI's budget is a sum of them.
    declare -A took
    echo "== installed and built in $SECONDS s"
    for stage in $stages; do
      t0=$SECONDS
      case "$stage" in
        main)
          run_stage main --test-dir build --output-on-failure -j "$jobs" "$@"
          ;;
        asan)
          echo "== [asan] configuring and building build-asan/ (clang, ASan+UBSan, libFuzzer targets)"
          cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" -DCMAKE_CXX_COMPILER=clang++ \
            -DCMAKE_C_COMPILER=clang -DRELGEN_CUDA=OFF -DRELGEN_SANITIZE=address -DRELGEN_FUZZ=ON \
            > build-asan.log 2>&1 || { cat build-asan.log; exit 1; }
          cmake --build build-asan -j "$jobs"
          export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
          run_stage asan --test-dir build-asan --output-on-failure -j "$jobs"
          unset ASAN_OPTIONS UBSAN_OPTIONS
          ;;
        tsan)
          echo "== [tsan] configuring and building build-tsan/ (clang, TSan, concurrency suites)"
          cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" -DCMAKE_CXX_COMPILER=clang++ \
            -DCMAKE_C_COMPILER=clang -DRELGEN_CUDA=OFF -DRELGEN_SANITIZE=thread \
            > build-tsan.log 2>&1 || { cat build-tsan.log; exit 1; }
          cmake --build build-tsan -j "$jobs" --target relgen-server engine_test server_test soak_test reliability_test sampler_test \
            cuda_backend_test_emu simt_test
          run_stage tsan --test-dir build-tsan --output-on-failure -j "$jobs" -L 'concurrency|simt'
          ;;
        *) echo "unknown stage '$stage' in RELGEN_TEST_STAGES (main, asan, tsan)" >&2; exit 2 ;;
      esac
      took[$stage]=$((SECONDS - t0))
    done
    # One summary over every stage, in ctest's words.
    passed=0
    failed=0
    for stage in $stages; do
      line=$(grep -E "tests passed, [0-9]+ tests failed out of [0-9]+" "$logs/$stage.log" | tail -1 || true)
      if [ -z "$line" ]; then
        echo "== [$stage] no ctest summary (did it run?)"
        failed=$((failed + 1))
        continue
      fi
      f=$(echo "$line" | sed -E 's/.* ([0-9]+) tests failed out of ([0-9]+).*/\1/')
      n=$(echo "$line" | sed -E 's/.* ([0-9]+) tests failed out of ([0-9]+).*/\2/')
      echo "== [$stage] $((n - f)) passed, $f failed (${took[$stage]} s)"
      passed=$((passed + n - f))
      failed=$((failed + f))
    done
    rm -rf "$logs"
    echo "$passed passed, $failed failed"
    [ "$failed" -eq 0 ]
    ;;
  serve)
    model=models/default
    for arg in "$@"; do
      case "$arg" in --model|--model=*) exec build/server/relgen-server "$@" ;; esac
    done
    if [ ! -f "$model/config.json" ]; then
      # Until a trained model ships, serve a small random one (its output is noise).
      model=build/demo-model
      [ -f "$model/config.json" ] || /usr/bin/python3 tools/make_random_model.py --out "$model" --name demo-random
    fi
    exec build/server/relgen-server --model "$model" "$@"
    ;;
esac

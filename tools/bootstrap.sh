#!/usr/bin/env bash
# The two commands of the README, for a fresh Debian 12 machine (as root):
#   bash tools/bootstrap.sh serve   install what is missing, build, serve the default model
#   bash tools/bootstrap.sh test    install what is missing, build, run every test
# Both are idempotent: installed packages and an existing build are reused.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode="${1:-}"
case "$mode" in
  serve|test|build) ;;
  *) echo "usage: bash tools/bootstrap.sh serve|test|build" >&2; exit 2 ;;
esac
shift

packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc protobuf-compiler libprotobuf-dev libabsl-dev
  prometheus-cpp-dev libgtest-dev libgmock-dev libopenblas-dev libopenblas0-pthread
  nlohmann-json3-dev libsentencepiece-dev
  python3 python3-torch python3-numpy openssl curl
  fortunes prometheus python3-yaml python3-grpcio python3-grpc-tools python3-protobuf python3-venv python3-setuptools python3-pip python3-matplotlib
)
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

jobs=$(nproc)
echo "== configuring and building (build/, $jobs jobs)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${RELGEN_CMAKE_ARGS:-} > build.log 2>&1 \
  || { cat build.log; exit 1; }
cmake --build build -j "$jobs"

case "$mode" in
  build) ;;
  test)
    echo "== running every test"
    ctest --test-dir build --output-on-failure -j "$jobs" "$@"
    ;;
  serve)
    model=models/default
    if [ ! -f "$model/config.json" ]; then
      # Until a trained model ships, serve a small random one (its output is noise).
      model=build/demo-model
      [ -f "$model/config.json" ] || /usr/bin/python3 tools/make_random_model.py --out "$model" --name demo-random
    fi
    exec build/server/relgen-server --model "$model" "$@"
    ;;
esac

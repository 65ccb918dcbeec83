# relgen-server image: built on a devel image, run on the matching runtime image.
# From the repository root (docs/operations.md, "Container image"):
#   CUDA (default):  podman build --format docker -t relgen .        (or: docker build -t relgen .)
#   CPU, Debian 12:  podman build --format docker -t relgen:cpu \
#                      --build-arg BUILD_BASE=localhost/relgen-debian12 \
#                      --build-arg RUNTIME_BASE=localhost/relgen-debian12 --build-arg RELGEN_CUDA=OFF .
# --format docker keeps the HEALTHCHECK (OCI images have none). tests/container_test.sh builds and
# serves the CPU image. The build stage needs an apt-based base carrying the Debian 12 generation of
# gRPC, protobuf and Abseil (Debian 12, Ubuntu 24.04); the runtime packages are not listed here but
# derived from what the binaries link (ldd, then dpkg -S), so both bases get their own names.
ARG BUILD_BASE=nvidia/cuda:12.6.3-devel-ubuntu24.04
ARG RUNTIME_BASE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

FROM ${BUILD_BASE} AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends \
      build-essential cmake ninja-build pkg-config \
      libgrpc++-dev protobuf-compiler-grpc protobuf-compiler libprotobuf-dev libabsl-dev \
      prometheus-cpp-dev libopenblas-dev nlohmann-json3-dev libsentencepiece-dev libcpp-httplib-dev libgtest-dev libgmock-dev \
    && rm -rf /var/lib/apt/lists/*
# ON requires nvcc (the CUDA devel base); OFF builds the CPU backend only.
ARG RELGEN_CUDA=ON
ARG CUDA_ARCHITECTURES="80;90"
# Parallel compile jobs; empty: ninja's default (all cores).
ARG BUILD_JOBS=
WORKDIR /src
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DRELGEN_CUDA=${RELGEN_CUDA} \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}" --no-warn-unused-cli \
    && cmake --build build ${BUILD_JOBS:+-j ${BUILD_JOBS}} --target relgen-server relgen-client relgen_spm
# What the runtime stage installs: the package owning each library the binaries load (ldd), found
# with dpkg -S under the path ldd printed, its /usr or non-/usr twin (merged /usr), or the path
# with symlinks resolved (alternatives, /usr/local/cuda). libcuda.so.1 is the driver's, which the
# NVIDIA container runtime mounts in; any other library no package owns fails the build.
RUN set -eu; mkdir -p /out/bin; \
    cp build/server/relgen-server build/client/relgen-client build/lib/librelgen_spm.so /out/bin/; \
    cd /out/bin; ldd relgen-server relgen-client librelgen_spm.so | tee /out/ldd.txt; \
    missing=$(grep 'not found' /out/ldd.txt | awk '{print $1}' | sort -u | grep -vx 'libcuda.so.1' || true); \
    if [ -n "$missing" ]; then echo "unresolved libraries: $missing" >&2; exit 1; fi; \
    : > /out/runtime-packages.unsorted; \
    for lib in $(awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' /out/ldd.txt | sort -u); do \
      real=$(readlink -f "$lib"); pkg=""; \
      for p in "$lib" "/usr$lib" "${lib#/usr}" "$real" "${real#/usr}"; do \
        pkg=$(dpkg-query -S "$p" 2>/dev/null | grep -v '^diversion' | head -n 1 | cut -d: -f1); \
        [ -z "$pkg" ] || break; \
      done; \
      if [ -z "$pkg" ]; then echo "no package owns $lib ($real)" >&2; exit 1; fi; \
      echo "$lib: $pkg"; echo "$pkg" >> /out/runtime-packages.unsorted; \
    done; \
    sort -u /out/runtime-packages.unsorted > /out/runtime-packages; rm /out/runtime-packages.unsorted; \
    echo "runtime packages: $(tr '\n' ' ' < /out/runtime-packages)"

FROM ${RUNTIME_BASE}
ARG DEBIAN_FRONTEND=noninteractive
COPY --from=build /out/runtime-packages /opt/relgen/runtime-packages
RUN apt-get update && apt-get install -y --no-install-recommends $(cat /opt/relgen/runtime-packages) \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /opt/relgen --no-create-home relgen
COPY --from=build /out/bin/ /opt/relgen/bin/
# Every library resolves on this base (the driver's libcuda.so.1 excepted, see above).
RUN ! ldd /opt/relgen/bin/relgen-server /opt/relgen/bin/relgen-client /opt/relgen/bin/librelgen_spm.so \
      | grep 'not found' | grep -v 'libcuda\.so\.1 '
COPY models/default /opt/relgen/models/default
WORKDIR /opt/relgen
USER relgen
EXPOSE 50051 8000 9400
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["/opt/relgen/bin/relgen-client", "health", "--server", "127.0.0.1:50051", "--timeout", "2"]
ENTRYPOINT ["/opt/relgen/bin/relgen-server"]
CMD ["--device", "auto", "--listen", "0.0.0.0:50051", "--http_listen", "0.0.0.0:8000", "--metrics_listen", "0.0.0.0:9400"]

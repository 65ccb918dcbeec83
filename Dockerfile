# relgen-server image: built on a CUDA devel image, run on the matching runtime image.
# Build from the repository root:  docker build -t relgen .
# Ubuntu 24.04 carries the same gRPC, protobuf and Abseil generations as Debian 12.
FROM nvidia/cuda:12.6.3-devel-ubuntu24.04 AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends \
      build-essential cmake ninja-build pkg-config \
      libgrpc++-dev protobuf-compiler-grpc protobuf-compiler libprotobuf-dev libabsl-dev \
      prometheus-cpp-dev libopenblas-dev nlohmann-json3-dev libsentencepiece-dev libgtest-dev libgmock-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DRELGEN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="80;90" \
    && cmake --build build --target relgen-server relgen-client relgen_spm

FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends \
      libgrpc++1.51t64 libprotobuf32t64 libopenblas0-pthread libsentencepiece0 \
      libprometheus-cpp-core1.0 libabsl20220623t64 libcublas-12-6 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home /opt/relgen relgen
COPY --from=build /src/build/server/relgen-server /src/build/client/relgen-client /src/build/lib/librelgen_spm.so /opt/relgen/bin/
COPY models/default /opt/relgen/models/default
WORKDIR /opt/relgen
USER relgen
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["/opt/relgen/bin/relgen-client", "health", "--server", "127.0.0.1:50051", "--timeout", "2"]
ENTRYPOINT ["/opt/relgen/bin/relgen-server"]
CMD ["--device", "auto", "--listen", "0.0.0.0:50051", "--metrics_listen", "0.0.0.0:9400"]

#!/usr/bin/env bash
# Builds the CPU image from the repository's Dockerfile with podman and serves with it:
#   1. a Debian 12 base image (debootstrap --variant=minbase + podman import), made once per machine
#      and kept as localhost/relgen-debian12 (RELGEN_CONTAINER_REBUILD_BASE=1 remakes it);
#   2. podman build --isolation chroot --format docker with the Debian base and RELGEN_CUDA=OFF;
#   3. the image's ENTRYPOINT and CMD, with --listen, --http_listen and --metrics_listen moved to 127.0.0.1:0, run
#      as the image's user: with podman run where the sandbox allows it, else chrooted into the
#      image's filesystem (podman create + podman mount); the ports come from the startup line;
#   4. the image's own HEALTHCHECK command (from podman image inspect, port substituted) and a
#      Generate with the image's relgen-client, both in the same root, must exit 0;
#   5. SIGTERM, and the server must exit 0.
# Exit 77 (ctest SKIP_RETURN_CODE) where podman or debootstrap cannot run here.
#
# usage: tests/container_test.sh [SOURCE_DIR]
# environment: RELGEN_CONTAINER_RUN=auto|podman|chroot (auto), RELGEN_CONTAINER_NO_CACHE=1 (build
# without podman's layer cache), RELGEN_CONTAINER_BUILD_JOBS (2), RELGEN_CONTAINER_REBUILD_BASE=1,
# RELGEN_DEBIAN_MIRROR (default: the Debian mirror apt uses here). The image localhost/relgen:cpu-test
# is kept: its layers are the next run's cache.
set -euo pipefail

SOURCE=$(cd "${1:-$(dirname "${BASH_SOURCE[0]}")/..}" && pwd)
BASE=localhost/relgen-debian12
IMAGE=localhost/relgen:cpu-test
RUN_MODE=${RELGEN_CONTAINER_RUN:-auto}
JOBS=${RELGEN_CONTAINER_BUILD_JOBS:-2}

say() { echo "== container_test: $*"; }
skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAILED: $*" >&2; exit 1; }

# --- can it run here? -------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || skip "needs root (debootstrap, podman's chroot isolation, chroot)"
command -v podman > /dev/null || skip "podman is not installed (apt-get install podman)"
podman info > /dev/null 2>&1 || skip "podman cannot run here: $(podman info 2>&1 | tail -n 1)"
[ -f "$SOURCE/Dockerfile" ] || fail "no Dockerfile in $SOURCE"

# One run at a time per machine: the base image, the image tag and the probe image are shared.
exec 9> /var/tmp/relgen-container-test.lock
flock 9
work=$(mktemp -d /var/tmp/relgen-container-test.XXXXXX)
ctr=""          # podman container (run mode) or working container (chroot mode)
root=""         # its mounted root filesystem (chroot mode)
server_pid=""
cleanup() {
  local rc=$?
  set +e
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2> /dev/null; then
    kill -KILL "$server_pid" 2> /dev/null
    wait "$server_pid" 2> /dev/null
  fi
  if [ -n "$root" ]; then
    for m in "$root/dev" "$root/proc"; do
      mountpoint -q "$m" && umount "$m"
    done
  fi
  if [ -n "$ctr" ]; then
    podman umount "$ctr" > /dev/null 2>&1
    podman rm -f "$ctr" > /dev/null 2>&1
  fi
  podman rmi -f localhost/relgen-probe:latest > /dev/null 2>&1
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- 1. the Debian 12 base image ----------------------------------------------------------------
# The mirrors apt uses here (deb822 .sources or one-line .list), else Debian's default ones.
apt_uri() {  # suite
  {
    sed -E 's/\[[^]]*\] *//' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2> /dev/null \
      | awk -v s="$1" '$1 == "deb" && $3 == s {print $2}'
    awk -v s="$1" '/^URIs:/ {u = $2} /^$/ {u = ""}
      /^Suites:/ {for (i = 2; i <= NF; i++) if ($i == s && u != "") print u}' \
      /etc/apt/sources.list.d/*.sources 2> /dev/null
  } | head -n 1
}
if [ "${RELGEN_CONTAINER_REBUILD_BASE:-0}" = 1 ] || ! podman image exists "$BASE"; then
  command -v debootstrap > /dev/null || skip "debootstrap is not installed (apt-get install debootstrap)"
  mirror=${RELGEN_DEBIAN_MIRROR:-$(apt_uri bookworm)}
  mirror=${mirror:-http://deb.debian.org/debian}
  security=$(apt_uri bookworm-security)
  security=${security:-http://deb.debian.org/debian-security}
  say "making $BASE: debootstrap --variant=minbase bookworm from $mirror"
  t0=$(date +%s)
  if ! debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" > "$work/debootstrap.log" 2>&1; then
    tail -n 20 "$work/debootstrap.log"
    skip "debootstrap cannot make a Debian 12 root here (log above)"
  fi
  cat > "$work/rootfs/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
EOF
  rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
  tar --numeric-owner -C "$work/rootfs" -c . \
    | podman import --change 'CMD ["/bin/bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --message "debootstrap --variant=minbase bookworm $mirror" - "$BASE" > /dev/null
  rm -rf "$work/rootfs"
  say "made $BASE in $(( $(date +%s) - t0 )) s"
else
  say "reusing $BASE (made $(podman image inspect --format '{{.Created}}' "$BASE"))"
fi

# Can podman build (RUN steps with chroot isolation) here at all?
mkdir -p "$work/probe"
printf 'FROM %s\nRUN true\n' "$BASE" > "$work/probe/Containerfile"
if ! podman build --isolation chroot --jobs 1 --quiet -t localhost/relgen-probe:latest "$work/probe" \
    > "$work/probe.log" 2>&1; then
  tail -n 20 "$work/probe.log"
  skip "podman build --isolation chroot cannot run a RUN step here (log above)"
fi
podman rmi -f localhost/relgen-probe:latest > /dev/null 2>&1 || true

# --- 2. the CPU image ---------------------------------------------------------------------------
build_args=(--build-arg "BUILD_BASE=$BASE" --build-arg "RUNTIME_BASE=$BASE" --build-arg RELGEN_CUDA=OFF
            --build-arg "BUILD_JOBS=$JOBS")
cache=()
[ "${RELGEN_CONTAINER_NO_CACHE:-0}" = 1 ] && cache=(--no-cache)
say "building $IMAGE from $SOURCE/Dockerfile: podman build --isolation chroot --jobs 1 --format docker ${cache[*]:+${cache[*]} }${build_args[*]}"
t0=$(date +%s)
if ! podman build --isolation chroot --jobs 1 --format docker --layers "${cache[@]}" "${build_args[@]}" \
    -f "$SOURCE/Dockerfile" -t "$IMAGE" "$SOURCE" 2>&1 \
    | while IFS= read -r line; do printf '[build %4ds] %s\n' $(( $(date +%s) - t0 )) "$line"; done; then
  fail "podman build failed"
fi
build_s=$(( $(date +%s) - t0 ))
size_b=$(podman image inspect --format '{{.Size}}' "$IMAGE")
size="$(( size_b / 1024 / 1024 )) MiB ($size_b bytes)"
say "built $IMAGE in $build_s s; image size $size"

# The image's configuration: the server as ENTRYPOINT + CMD, its user, its environment, its
# working directory and its HEALTHCHECK.
inspect() { podman image inspect --format "$1" "$IMAGE"; }
lines() { echo "{{range \$i, \$e := $1}}{{if \$i}}{{\"\\n\"}}{{end}}{{\$e}}{{end}}"; }  # one per line
mapfile -t entrypoint < <(inspect "$(lines .Config.Entrypoint)")
mapfile -t cmd < <(inspect "$(lines .Config.Cmd)")
mapfile -t env < <(inspect "$(lines .Config.Env)")
mapfile -t health < <(inspect "{{if .HealthCheck}}$(lines .HealthCheck.Test){{end}}")
user=$(inspect '{{.Config.User}}')
workdir=$(inspect '{{.Config.WorkingDir}}')
[ ${#entrypoint[@]} -gt 0 ] || fail "the image has no ENTRYPOINT"
[ -n "$user" ] && [ "$user" != root ] && [ "$user" != 0 ] || fail "the image runs as root ('$user')"
[ "${health[0]:-}" = CMD ] || fail "the image has no exec-form HEALTHCHECK (got: ${health[*]:-none}); built without --format docker?"
health=("${health[@]:1}")
say "ENTRYPOINT ${entrypoint[*]}; CMD ${cmd[*]}; USER $user; WORKDIR $workdir; HEALTHCHECK ${health[*]}"

# CMD with every listener moved to a free loopback port (the server binds port 0 and says which).
args=()
for ((i = 0; i < ${#cmd[@]}; i++)); do
  case "${cmd[i]}" in
    --listen|--http_listen|--metrics_listen) args+=("${cmd[i]}" 127.0.0.1:0); i=$((i + 1)) ;;
    --listen=*|--http_listen=*|--metrics_listen=*) args+=("${cmd[i]%%=*}=127.0.0.1:0") ;;
    *) args+=("${cmd[i]}") ;;
  esac
done
printf '%s\n' "${args[@]}" | grep -qx -- --listen || args+=(--listen 127.0.0.1:0)
printf '%s\n' "${args[@]}" | grep -qx -- --http_listen || args+=(--http_listen 127.0.0.1:0)
printf '%s\n' "${args[@]}" | grep -qx -- --metrics_listen || args+=(--metrics_listen 127.0.0.1:0)

# --- 3. serve -----------------------------------------------------------------------------------
# podman run as is, else with rlimits no higher than this process's (this sandbox refuses to
# raise them, and refuses even equal RLIMIT_NPROC) and with runc (crun refuses hybrid cgroups).
run_opts=()
if [ "$RUN_MODE" = auto ] || [ "$RUN_MODE" = podman ]; then
  ulimits="--ulimit nofile=$(ulimit -Sn):$(ulimit -Hn) --ulimit nproc=4096:4096"
  tries=("" "$ulimits")
  command -v runc > /dev/null && tries+=("--runtime runc $ulimits")
  ran=0
  for opts in "${tries[@]}"; do
    read -r -a run_opts <<< "$opts"
    if timeout 120 podman run --rm --no-healthcheck --network host "${run_opts[@]}" --entrypoint /bin/true \
        "$IMAGE" > "$work/run-probe.log" 2>&1; then
      ran=1
      break
    fi
    say "podman run ${opts:-(no options)} refused: $(grep -v 'level=' "$work/run-probe.log" | tail -n 1)"
  done
  if [ "$ran" = 1 ]; then
    RUN_MODE=podman
  elif [ "$RUN_MODE" = podman ]; then
    fail "podman run cannot run the image here (RELGEN_CONTAINER_RUN=podman)"
  else
    RUN_MODE=chroot
    say "podman run refused here; chroot into the image's filesystem instead"
  fi
fi

log="$work/server.log"
case "$RUN_MODE" in
  podman)
    ctr=relgen-container-test-$$
    say "podman run --no-healthcheck --network host ${run_opts[*]} $IMAGE ${args[*]}"
    podman run -d --name "$ctr" --no-healthcheck --network host "${run_opts[@]}" "$IMAGE" "${args[@]}" > /dev/null
    in_root() { timeout 60 podman exec "$ctr" "$@"; }
    server_log() { podman logs "$ctr" > "$log" 2>&1 || true; }
    server_running() { [ "$(podman inspect --format '{{.State.Running}}' "$ctr" 2> /dev/null)" = true ]; }
    ;;
  chroot)
    ctr=$(podman create "$IMAGE")
    root=$(podman mount "$ctr")
    mount -t proc proc "$root/proc"
    mount --bind /dev "$root/dev"
    # The image's user, groups and home from its own /etc/passwd, as numbers (chroot would resolve
    # names outside the new root).
    name=${user%%:*}
    ids=$(awk -F: -v u="$name" '$1 == u || $3 == u {print $3 ":" $4; exit}' "$root/etc/passwd")
    home=$(awk -F: -v u="$name" '$1 == u || $3 == u {print $6; exit}' "$root/etc/passwd")
    [ -n "$ids" ] || fail "user $name is not in the image's /etc/passwd"
    as_user=(chroot --userspec="$ids" --groups="${ids#*:}" "$root"
             /usr/bin/env -i --chdir="${workdir:-/}" "${env[@]}" HOME="$home")
    in_root() { timeout 60 "${as_user[@]}" "$@"; }
    server_log() { :; }
    say "chroot $root as $user ($ids): ${entrypoint[*]} ${args[*]}"
    "${as_user[@]}" "${entrypoint[@]}" "${args[@]}" > "$log" 2>&1 &
    server_pid=$!  # chroot execs env, which execs the server: the same process
    server_running() { kill -0 "$server_pid" 2> /dev/null; }
    ;;
  *) fail "RELGEN_CONTAINER_RUN must be auto, podman or chroot, not '$RUN_MODE'" ;;
esac

grpc_port=""
for _ in $(seq 1 600); do
  server_log
  line=$(grep -m 1 -E 'gRPC on 127\.0\.0\.1:[0-9]+; HTTP on 127\.0\.0\.1:[0-9]+; metrics on 127\.0\.0\.1:[0-9]+' "$log" || true)
  if [ -n "$line" ]; then
    grpc_port=$(echo "$line" | sed -E 's/.*gRPC on 127\.0\.0\.1:([0-9]+);.*/\1/')
    http_port=$(echo "$line" | sed -E 's/.*HTTP on 127\.0\.0\.1:([0-9]+);.*/\1/')
    metrics_port=$(echo "$line" | sed -E 's/.*metrics on 127\.0\.0\.1:([0-9]+).*/\1/')
    break
  fi
  server_running || { cat "$log"; fail "the server exited before its startup line"; }
  sleep 0.1
done
[ -n "$grpc_port" ] || { cat "$log"; fail "no startup line within 60 s"; }
say "server up: $line"

# --- 4. the image's HEALTHCHECK, and a Generate -------------------------------------------------
probe=()
for word in "${health[@]}"; do
  probe+=("$(echo "$word" | sed -E "s/(127\.0\.0\.1|localhost|0\.0\.0\.0):50051\$/127.0.0.1:$grpc_port/")")
done
say "HEALTHCHECK: ${probe[*]}"
health_rc=0
in_root "${probe[@]}" > "$work/health.out" 2>&1 || health_rc=$?
cat "$work/health.out"

say "Generate: relgen-client generate --server 127.0.0.1:$grpc_port --max_new_tokens 8 --temperature 0 hello"
gen_rc=0
in_root "$(dirname "${entrypoint[0]}")/relgen-client" generate --server "127.0.0.1:$grpc_port" \
  --max_new_tokens 8 --temperature 0 "hello" > "$work/generate.out" 2> "$work/generate.err" || gen_rc=$?
cat "$work/generate.out" "$work/generate.err"

# The HTTP API, from the host (the container shares its network).
say "HTTP: GET /v1/models on 127.0.0.1:$http_port"
http_code=$(curl -s -o "$work/models.json" -w '%{http_code}' --max-time 10 "http://127.0.0.1:$http_port/v1/models" || true)
cat "$work/models.json"; echo

# --- 5. SIGTERM ---------------------------------------------------------------------------------
say "SIGTERM"
case "$RUN_MODE" in
  podman)
    podman stop --time 40 "$ctr" > /dev/null
    server_rc=$(podman wait "$ctr")
    server_log
    ;;
  chroot)
    kill -TERM "$server_pid"
    server_rc=0
    wait "$server_pid" || server_rc=$?
    server_pid=""
    ;;
esac
echo "--- server output"
cat "$log"
echo "---"

failures=()
[ "$health_rc" = 0 ] || failures+=("HEALTHCHECK exited $health_rc")
[ "$gen_rc" = 0 ] || failures+=("relgen-client generate exited $gen_rc")
[ -s "$work/generate.out" ] || failures+=("relgen-client generate printed nothing")
[ "$http_code" = 200 ] || failures+=("GET /v1/models answered $http_code")
[ "$server_rc" = 0 ] || failures+=("relgen-server exited $server_rc after SIGTERM")
say "image $IMAGE: size $size; build time $build_s s$([ ${#cache[@]} = 0 ] && echo ' (with podman layer cache)'); ran with $RUN_MODE"
[ ${#failures[@]} = 0 ] || fail "$(IFS=';'; echo "${failures[*]}")"
say "PASSED"

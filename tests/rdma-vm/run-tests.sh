#!/bin/bash
# Build dmkv-verbs' test binaries on the host and run them against Soft-RoCE in one VM boot.
#
# Usage: tests/rdma-vm/run-tests.sh [--bench]
#   --bench   also run the readbench example, perftest's ib_read_lat, and dmkv-getbench and
#             dmkv-cluster-bench over rdma and tcp on one node and on a 3-node cluster (same VM boot)
# Env: CARGO_TARGET_DIR (default: <repo>/target), DMKV_RDMA_VM_CACHE (image cache, see
#      build-image.sh), BENCH_ITERS (readbench iterations, default 5000),
#      BENCH_RELEASE=1 (build readbench with --release: the debug build's own overhead is
#      visible in its latency), BENCH_ONLY=puts (with --bench: only the verbs / TCP RPC PUT
#      rounds, no test binaries).
# Exits non-zero if any test binary fails (or the VM does). Needs root (apt-get, image build).
set -euo pipefail
t0=$(date +%s)
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
BENCH=0
case "${1:-}" in
  --bench) BENCH=1 ;;
  "") ;;
  *) echo "usage: $0 [--bench]" >&2; exit 2 ;;
esac
log() { echo "run-tests: $*" >&2; }

# Host packages that ibverbs-sys needs to build (bindgen over the libibverbs headers, link).
need=()
for p in cmake pkg-config libnl-3-dev libnl-route-3-dev libclang-dev libibverbs-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing host packages: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

"$HERE/build-image.sh" >/dev/null

cd "$REPO"
TARGET=${CARGO_TARGET_DIR:-$REPO/target}
log "building test binaries"
# Only the test harness executables: lib unit tests and the integration tests.
mapfile -t BINS < <(cargo test -p dmkv-verbs --no-run --message-format=json 2>/dev/null \
  | grep '"reason":"compiler-artifact"' | grep '"test":true' \
  | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
[ ${#BINS[@]} -gt 0 ] || { log "no test executables (run 'cargo test -p dmkv-verbs --no-run' to see why)"; exit 1; }
# dmkvd with RDMA, and the end-to-end tests that drive it: GETs over RDMA READ,
# the racing-writers stress test with RDMA readers, and a 3-node cluster read
# over RDMA through a leader kill and a frozen leader.
cargo build -q -p dmkv-server --features rdma --bin dmkvd
# Only these test targets: the package's bins are built for its tests too.
# rdma_cluster starts three dmkvd nodes on the one rxe device.
mapfile -t E2E < <(cargo test -p dmkv-tests --features rdma --test rdma --test stress --test rdma_cluster --no-run --message-format=json 2>/dev/null \
  | grep '"reason":"compiler-artifact"' | grep '"test":true' | grep '"kind":\["test"\]' \
  | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
[ ${#E2E[@]} -eq 3 ] || { log "expected the rdma, stress and rdma_cluster test executables (run 'cargo test -p dmkv-tests --features rdma --no-run')"; exit 1; }
BINS+=("${E2E[@]}")
BENCH_BIN=$TARGET/debug/examples/readbench
if [ "$BENCH" = 1 ]; then
  if [ "${BENCH_RELEASE:-0}" = 1 ]; then
    cargo build -q --release -p dmkv-verbs --example readbench
    BENCH_BIN=$TARGET/release/examples/readbench
  else
    cargo build -q -p dmkv-verbs --example readbench
  fi
  # GETs/s over rdma beside tcp and rpc in the same VM: release dmkvd and getbench.
  cargo build -q --release -p dmkv-server --features rdma --bin dmkvd
  cargo build -q --release -p dmkv-benches --features dmkv-client/rdma --bin dmkv-getbench --bin dmkv-cluster-bench
fi

# Share only a staging copy: the guest sees the binaries and nothing else of the host.
STAGE="$TARGET/rdma-vm-stage"
rm -rf "$STAGE"; mkdir -p "$STAGE"
: > "$STAGE/tests.list"
for b in "${BINS[@]}"; do
  cp "$b" "$STAGE/"
  basename "$b" >> "$STAGE/tests.list"
  log "test binary: $(basename "$b")"
done
cp "$TARGET/debug/dmkvd" "$STAGE/"
cp "$HERE/guest-run-tests.sh" "$STAGE/"
if [ "$BENCH" = 1 ]; then
  cp "$BENCH_BIN" "$STAGE/readbench"
  mkdir -p "$STAGE/release"
  cp "$TARGET/release/dmkvd" "$TARGET/release/dmkv-getbench" "$TARGET/release/dmkv-cluster-bench" "$STAGE/release/"
fi

t1=$(date +%s)
log "booting the VM ($((t1 - t0)) s of preparation)"
set +e
"$HERE/run.sh" -C "$STAGE" -t 1500 -e "bench=$BENCH" -e "bench_iters=${BENCH_ITERS:-5000}" \
  -e "bench_only=${BENCH_ONLY:-}" -- ./guest-run-tests.sh
rc=$?
set -e
t2=$(date +%s)
log "VM stage took $((t2 - t1)) s (total $((t2 - t0)) s); exit status $rc"
exit "$rc"

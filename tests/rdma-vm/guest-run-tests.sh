#!/bin/bash
# Runs INSIDE the test VM, in the staging directory run-tests.sh shares at /host.
# Runs every test binary listed in tests.list (one path per line) with DMKV_RDMA_TESTS=1, so a
# missing device fails instead of skipping. With bench=1 in the environment it then runs the
# readbench example and perftest's ib_read_lat as a baseline. Exit status: number of failed
# test binaries (capped at 100), 0 when all passed.
set -u
export DMKV_RDMA_TESTS=1 RUST_BACKTRACE=1
# The end-to-end tests start ./dmkvd (built with RDMA) and read over RDMA only.
# Two RDMA readers for 10 s: under emulation writes are slow (a few hundred a
# second), and the tearing mode must still provoke tears for them to catch.
export DMKV_BIN_DIR=$PWD DMKV_STRESS_TRANSPORTS=rdma,rdma DMKV_STRESS_SECS=${stress_secs:-10}
# Every step that could hang gets its own limit; a hang would otherwise cost the VM's whole budget.
T="timeout 600"
ibv_devinfo -d rxe0 | grep -E 'hca_id|state|active_mtu|link_layer' || true
failed=0
if [ "${bench_only:-}" = puts ]; then
  # PUTs over verbs RPC and TCP RPC side by side, rounds alternated: one
  # node and three, one PUT in flight and 16, and the servers' CPU per PUT.
  for round in 1 2; do
    for nodes in 1 3; do
      for conc in 1 16; do
        for rpc in verbs tcp; do
          echo "=== puts round $round: $nodes node(s), $conc in flight, $rpc"
          DMKV_BIN_DIR=$PWD/release $T ./release/dmkv-cluster-bench put-latency --sync none --puts "${bench_puts:-5000}" \
            --nodes "$nodes" --concurrency "$conc" --rpc-transport "$rpc" || echo "=== put-latency $rpc FAILED"
        done
      done
    done
  done
  exit 0
fi
while read -r bin; do
  [ -n "$bin" ] || continue
  echo "=== $bin"
  if ! $T "./$bin" --test-threads=1 --nocapture; then
    echo "=== FAILED: $bin"
    failed=$((failed + 1))
  fi
done < tests.list
echo "=== test binaries failed: $failed"

if [ "${bench:-0}" = 1 ] && [ -x ./readbench ]; then
  echo "=== readbench ${bench_iters:-5000}"
  $T ./readbench "${bench_iters:-5000}" rxe0 || echo "=== readbench FAILED"
  for size in 64 1024; do
    echo "=== ib_read_lat -s $size"
    # Server and client on the same rxe0: loopback through the guest's own IPv4 GID (index 1).
    timeout 120 ib_read_lat -d rxe0 -x 1 -F -n 5000 -s "$size" > "/tmp/lat-server-$size.log" 2>&1 &
    sleep 1
    timeout 120 ib_read_lat -d rxe0 -x 1 -F -n 5000 -s "$size" localhost || echo "=== ib_read_lat FAILED"
    wait
  done
fi
if [ "${bench:-0}" = 1 ] && [ -x ./release/dmkv-getbench ]; then
  # One dmkvd (release, RDMA), 10k keys of 1000 B, then GETs/s of one client core per path.
  ./release/dmkvd --listen 127.0.0.1:0 --memory 256MiB --log warn > /tmp/dmkvd.out 2>&1 &
  DPID=$!
  for _ in $(seq 100); do grep -q 'rpc=' /tmp/dmkvd.out && break; sleep 0.1; done
  ADDR=$(sed -n 's/.*rpc=\([^ ]*\).*/\1/p' /tmp/dmkvd.out)
  echo "=== getbench against $(cat /tmp/dmkvd.out)"
  $T ./release/dmkv-getbench --server "$ADDR" --load --keys 10000 --transport rpc --secs 1 > /dev/null
  for path in rdma tcp rpc; do
    for batch in 1 16; do
      $T ./release/dmkv-getbench --server "$ADDR" --keys 10000 --transport $path --batch $batch \
        --secs "${bench_secs:-5}" --server-pid "$DPID" || echo "=== getbench $path FAILED"
    done
  done
  # More callers than the client's 2 runtime workers: GETs/s and p99 of the shared path.
  $T ./release/dmkv-getbench --server "$ADDR" --keys 10000 --transport rdma --callers 4 \
    --secs "${bench_secs:-5}" || echo "=== getbench rdma callers FAILED"
  kill "$DPID"
fi
if [ "${bench:-0}" = 1 ] && [ -x ./release/dmkv-cluster-bench ]; then
  # A 3-node cluster (2 shards: see tests/tests/rdma_cluster.rs for why so
  # few in this VM), 10k keys of 1000 B, then GETs/s of one client core over
  # rdma and the engine, single and multi-get of 16, rounds interleaved.
  printf 'shards = 2\nreplicas = 3\n' > /tmp/cluster.toml
  for i in 1 2 3; do
    printf '[[node]]\nid = %s\nrpc = "127.0.0.1:%s"\npeer = "127.0.1.%s:7300"\n' "$i" "$((7310 + i))" "$i" >> /tmp/cluster.toml
  done
  CPIDS=()
  for i in 1 2 3; do
    ./release/dmkvd --cluster /tmp/cluster.toml --node-id "$i" --memory 256MiB --log warn > "/tmp/node$i.out" 2>&1 &
    CPIDS+=($!)
  done
  for i in 1 2 3; do for _ in $(seq 200); do grep -q 'rpc=' "/tmp/node$i.out" && break; sleep 0.1; done; done
  sleep 3
  echo "=== cluster getbench against $(cat /tmp/node1.out)"
  $T ./release/dmkv-getbench --server 127.0.0.1:7311 --load --keys 10000 --transport rpc --secs 1 > /dev/null
  for round in 1 2 3; do
    for path in rdma tcp; do
      for batch in 1 16; do
        echo "=== cluster round $round: $path batch $batch"
        $T ./release/dmkv-getbench --server 127.0.0.1:7311 --keys 10000 --transport $path --batch $batch \
          --secs "${bench_secs:-5}" || echo "=== cluster getbench $path FAILED"
      done
    done
  done
  kill "${CPIDS[@]}"; wait "${CPIDS[@]}" 2>/dev/null
  # Kill shard leaders: time to the first acknowledged PUT, and to the first
  # GET answered by an RDMA READ of the new leader's region.
  echo "=== cluster failover"
  DMKV_BIN_DIR=$PWD/release $T ./release/dmkv-cluster-bench failover --kills "${bench_kills:-10}" --shards 2 \
    --reader-transport rdma || echo "=== cluster failover FAILED"
fi
[ "$failed" -gt 100 ] && failed=100
exit "$failed"

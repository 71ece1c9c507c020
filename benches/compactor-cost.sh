#!/usr/bin/env bash
# YCSB-A latency with the compactor moving items all the time
# (--compactor continuous) beside the same run with it off, rounds
# interleaved on one machine. Needs release builds of dmkvd, dmkv and
# dmkv-ycsb (cargo build --release --workspace --bins). Run it on a quiet
# machine: nothing else building or benchmarking.
#
#   benches/compactor-cost.sh [ROUNDS]
set -euo pipefail
BIN=${BIN:-target/release}
ROUNDS=${1:-3}
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
for round in $(seq 1 "$ROUNDS"); do
  for mode in off continuous; do
    "$BIN/dmkvd" --listen 127.0.0.1:0 --memory 256MiB --compactor "$mode" --log error >"$tmp/out" &
    pid=$!
    until grep -q "rpc=" "$tmp/out" 2>/dev/null; do sleep 0.1; done
    addr=$(grep -o "rpc=[^ ]*" "$tmp/out" | cut -d= -f2)
    "$BIN/dmkv-ycsb" --server "$addr" --workload a --records 100000 --threads 2 --in-flight 16 \
      --duration 10 --warmup 2s --label "compactor-$mode" --json "$tmp/r.json" >/dev/null
    moves=$("$BIN/dmkv" --server "$addr" stats | awk '$1=="compactor_moves"{print $2}')
    moved=$("$BIN/dmkv" --server "$addr" stats | awk '$1=="compactor_moved_bytes"{print $2}')
    cpu=$("$BIN/dmkv" --server "$addr" stats | awk '$1=="compactor_cpu_micros"{print $2}')
    python3 - "$tmp/r.json" "$round" "$mode" "$moves" "$moved" "$cpu" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["run"]
ops = {o["op"]: o for o in run["ops"]}
row = lambda op: f"{ops[op]['p50_us']:.0f}/{ops[op]['p99_us']:.0f}"
print(f"round {sys.argv[2]} compactor={sys.argv[3]:10} ops/s={run['ops_per_sec']:.0f} READ p50/p99 us={row('READ')} "
      f"UPDATE p50/p99 us={row('UPDATE')} moves={sys.argv[4]} moved_bytes={sys.argv[5]} compactor_cpu_us={sys.argv[6]}")
PY
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done

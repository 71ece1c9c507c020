#!/usr/bin/env bash
# What the extra hop costs on a cluster's memcached port: a 3-node cluster
# with one shard (3 replicas), YCSB-B over memcached's text protocol
# through the node that leads the shard and through one that does not
# (which passes each request on to the leader over the peer connections),
# one after the other in each round, same keys, same client.
#
#   benches/mc-hop.sh [--rounds N] [--duration S] [--records N] [--in-flight N]
#
# Needs release builds of dmkvd and dmkv-ycsb (built here if missing). Run
# on a quiet machine: busy cores change RPC numbers by 2x.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=3
DURATION=10
RECORDS=20000
IN_FLIGHT="1 16"
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) ROUNDS="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --records) RECORDS="$2"; shift 2 ;;
        --in-flight) IN_FLIGHT="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
BIN="${CARGO_TARGET_DIR:-target}/release"
[ -x "$BIN/dmkvd" ] && [ -x "$BIN/dmkv-ycsb" ] || cargo build --release --bin dmkvd --bin dmkv-ycsb
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
{
    echo "shards = 1"
    echo "replicas = 3"
    for id in 1 2 3; do
        printf '[[node]]\nid = %s\nrpc = "127.0.0.1:%s"\npeer = "127.0.0.1:%s"\n' "$id" "$(free_port)" "$(free_port)"
    done
} > "$WORK/cluster.toml"
declare -A MC
for id in 1 2 3; do
    MC[$id]=$(free_port)
    "$BIN/dmkvd" --cluster "$WORK/cluster.toml" --node-id "$id" --memory 512MiB --threads 2 --log error \
        --memcached-listen "127.0.0.1:${MC[$id]}" > "$WORK/node$id.out" 2>&1 &
done
for id in 1 2 3; do
    for _ in $(seq 100); do grep -q 'rpc=' "$WORK/node$id.out" && break; sleep 0.1; done
done

stat() { printf 'stats\r\nquit\r\n' | python3 -c '
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(sys.stdin.buffer.read()); data = b""
while not data.endswith(b"END\r\n"):
    chunk = s.recv(65536)
    if not chunk: break
    data += chunk
for line in data.decode().splitlines():
    p = line.split()
    if len(p) == 3 and p[1] == sys.argv[2]: print(p[2])
' "$1" "$2"; }

# The leader: the node whose `stats` count the shard's items once loaded.
"$BIN/dmkv-ycsb" --backend memcached --server "127.0.0.1:${MC[1]}" --workload b --records "$RECORDS" \
    --operations 1 --threads 1 > /dev/null
LEADER=""
for id in 1 2 3; do
    [ "$(stat "${MC[$id]}" curr_items)" != "0" ] && LEADER=$id
done
[ -n "$LEADER" ] || { echo "no leader found" >&2; exit 1; }
OTHER=$(( LEADER % 3 + 1 ))
echo "node $LEADER leads the shard; node $OTHER passes requests on"

run() {
    local label=$1 node=$2 inflight=$3
    "$BIN/dmkv-ycsb" --backend memcached --server "127.0.0.1:${MC[$node]}" --workload b --records "$RECORDS" \
        --skip-load --duration "$DURATION" --warmup 2s --threads 1 --in-flight "$inflight" \
        --json "$WORK/$label.json" > /dev/null
    python3 - "$label" "$WORK/$label.json" <<'PY'
import json, sys
run = json.load(open(sys.argv[2]))["run"]
read = next(o for o in run["ops"] if o["op"].lower() == "read")
upd = next(o for o in run["ops"] if o["op"].lower() == "update")
assert run["bad_values"] == 0 and read["errors"] == 0 and upd["errors"] == 0, run
print(f"{sys.argv[1]:>22}  {run['ops_per_sec']:>8.0f} ops/s  GET p50 {read['p50_us']:.0f} us p99 {read['p99_us']:.0f} us"
      f"  SET p50 {upd['p50_us']:.0f} us p99 {upd['p99_us']:.0f} us")
PY
}

for round in $(seq "$ROUNDS"); do
    echo "round $round"
    for f in $IN_FLIGHT; do
        run "leader-inflight$f" "$LEADER" "$f"
        run "forwarded-inflight$f" "$OTHER" "$f"
    done
done
echo "forwarded by node $OTHER: $(stat "${MC[$OTHER]}" forwarded)"

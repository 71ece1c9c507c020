#!/usr/bin/env bash
# Hit ratio of an evicting cluster against one node at equal memory: the
# same cache-aside zipfian trace (dmkv-hitratio: GET, and on a miss SET)
# through the SDK against one dmkvd (--memory M --evict lru) and against a
# 3-node cluster of one shard (3 replicas, each node --memory M, so the
# shard's region is the single node's size), each fresh.
#
#   benches/hitratio-cluster.sh [--memory-mib M] [--keys N] [--ops N] [--path rpc|one-sided]
#
# Needs release builds of dmkvd and dmkv-hitratio (built here if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
MEMORY_MIB=32
KEYS=150000
OPS=1000000
PATHS="rpc one-sided"
while [ $# -gt 0 ]; do
    case "$1" in
        --memory-mib) MEMORY_MIB="$2"; shift 2 ;;
        --keys) KEYS="$2"; shift 2 ;;
        --ops) OPS="$2"; shift 2 ;;
        --path) PATHS="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
BIN="${CARGO_TARGET_DIR:-target}/release"
[ -x "$BIN/dmkvd" ] && [ -x "$BIN/dmkv-hitratio" ] || cargo build --release --bin dmkvd --bin dmkv-hitratio
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 100); do grep -q 'rpc=' "$1" && return; sleep 0.1; done; echo "no start: $(cat "$1")" >&2; exit 1; }

trace() {
    "$BIN/dmkv-hitratio" --backend dmkv --server "$1" --path "$2" --keys "$KEYS" --ops "$OPS" --value-size 1000 \
        --label "$3" --json "$WORK/$3.json" > /dev/null
    python3 - "$3" "$WORK/$3.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[2]))
print(f"{sys.argv[1]:>24}  hit ratio {r['hit_ratio']*100:.2f} %  ({r['measured']['gets']} measured GETs, {r['sets']} SETs)")
PY
}

for path in $PATHS; do
    port=$(free_port)
    "$BIN/dmkvd" --listen "127.0.0.1:$port" --memory "${MEMORY_MIB}MiB" --evict lru --threads 2 --log error \
        > "$WORK/single.out" 2>&1 &
    pid=$!
    wait_up "$WORK/single.out"
    trace "127.0.0.1:$port" "$path" "single-$path"
    kill "$pid"; wait "$pid" 2>/dev/null || true

    { echo "shards = 1"; echo "replicas = 3"
      for id in 1 2 3; do
          printf '[[node]]\nid = %s\nrpc = "127.0.0.1:%s"\npeer = "127.0.0.1:%s"\n' "$id" "$(free_port)" "$(free_port)"
      done; } > "$WORK/cluster.toml"
    pids=()
    for id in 1 2 3; do
        "$BIN/dmkvd" --cluster "$WORK/cluster.toml" --node-id "$id" --memory "${MEMORY_MIB}MiB" --evict lru \
            --threads 2 --log error > "$WORK/node$id.out" 2>&1 &
        pids+=($!)
    done
    for id in 1 2 3; do wait_up "$WORK/node$id.out"; done
    seed=$(sed -n 's/.*rpc=\([^ ]*\).*/\1/p' "$WORK/node1.out")
    sleep 1
    trace "$seed" "$path" "cluster-$path"
    kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null || true
done

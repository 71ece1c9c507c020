#!/usr/bin/env bash
# The cost of TLS (and of authentication) on dmkv's RPC path: YCSB-C over
# RPC, 2 client threads x 16 in flight, against one dmkvd without TLS and
# one with, rounds interleaved, each with a fresh server and fresh load.
#
#   benches/tls-cost.sh [--rounds N] [--duration S] [--records N]
#
# Needs release builds of dmkvd and dmkv-ycsb (built here if missing) and
# openssl (for a throwaway CA and server certificate). Run on a quiet
# machine: busy cores change RPC numbers by 2x.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=3
DURATION=10
RECORDS=100000
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) ROUNDS="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --records) RECORDS="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
BIN="${CARGO_TARGET_DIR:-target}/release"
[ -x "$BIN/dmkvd" ] && [ -x "$BIN/dmkv-ycsb" ] || cargo build --release --bin dmkvd --bin dmkv-ycsb
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=dmkv-bench-ca \
    -keyout "$WORK/ca.key" -out "$WORK/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
    -keyout "$WORK/server.key" -out "$WORK/server.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > "$WORK/san"
openssl x509 -req -in "$WORK/server.csr" -CA "$WORK/ca.pem" -CAkey "$WORK/ca.key" -CAcreateserial -days 1 \
    -extfile "$WORK/san" -out "$WORK/server.pem" 2>/dev/null
TOKEN=bench-data-token-0123456789abcdef
printf 'data %s\n' "$TOKEN" > "$WORK/auth"

# run LABEL DMKVD-ARGS... -- YCSB-ARGS...
run() {
    local label=$1; shift
    local server_args=() ycsb_args=()
    while [ "$1" != "--" ]; do server_args+=("$1"); shift; done
    shift; ycsb_args=("$@")
    "$BIN/dmkvd" --listen 127.0.0.1:0 --memory 1GiB --threads 2 --log warn "${server_args[@]}" > "$WORK/out" 2>&1 &
    local pid=$!
    for _ in $(seq 100); do grep -q 'rpc=' "$WORK/out" && break; sleep 0.1; done
    local addr; addr=$(sed -n 's/.*rpc=\([^ ]*\).*/\1/p' "$WORK/out")
    DMKV_TOKEN=$TOKEN "$BIN/dmkv-ycsb" --server "$addr" --workload c --records "$RECORDS" --duration "$DURATION" \
        --warmup 2s --threads 2 --in-flight 16 --path rpc "${ycsb_args[@]}" --json "$WORK/$label.json" > /dev/null
    kill "$pid"; wait "$pid" 2>/dev/null || true
    python3 - "$label" "$WORK/$label.json" <<'PY'
import json, sys
run = json.load(open(sys.argv[2]))["run"]
read = next(o for o in run["ops"] if o["op"].lower() == "read")
assert run["bad_values"] == 0 and read["errors"] == 0, run
print(f"{sys.argv[1]:>6}  {run['ops_per_sec']:>9.0f} ops/s  p50 {read['p50_us']:.0f} us  p99 {read['p99_us']:.0f} us")
PY
}

for round in $(seq "$ROUNDS"); do
    echo "round $round"
    run plain --auth-file "$WORK/auth" -- 
    run tls --auth-file "$WORK/auth" --tls-cert "$WORK/server.pem" --tls-key "$WORK/server.key" -- --tls-ca "$WORK/ca.pem"
done

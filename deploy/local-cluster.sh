#!/usr/bin/env bash
# Runs a 3-node dmkv cluster on loopback, for trying things out and tests.
#
#   deploy/local-cluster.sh start            # build if needed, start nodes 1-3
#   deploy/local-cluster.sh add-node         # start node 4 (a spare) and give it its share of replicas
#   deploy/local-cluster.sh remove-node NODE # move every replica off a node (it stays, a spare)
#   deploy/local-cluster.sh status           # processes and `dmkv cluster status`
#   deploy/local-cluster.sh kill NODE        # SIGKILL one node (a crash)
#   deploy/local-cluster.sh restart NODE     # start it again (from its raft log)
#   deploy/local-cluster.sh rolling-restart  # SIGTERM and start each node in turn
#   deploy/local-cluster.sh stop             # SIGTERM every node
#
# Node N serves clients on 127.0.0.1:(7069+N), raft on 127.0.0.1:(7169+N) and
# memcached's protocols on 127.0.0.1:(7269+N) (any key on any node), so
# `dmkv put k v` (default server 127.0.0.1:7070) reaches node 1. Set
# DMKV_CLUSTER_PORT to move the first client port (peers: +100, memcached:
# +200), and
# DMKV_CLUSTER_DIR for where logs, raft logs and pid files go. DMKVD and
# DMKV name the binaries (default: target/release, built if missing).
set -euo pipefail

cd "$(dirname "$0")/.."
NODES=3
# Node 4 is listed as a spare (no replicas until add-node gives it some).
ALL=4
PORT=${DMKV_CLUSTER_PORT:-7070}
DIR=${DMKV_CLUSTER_DIR:-${TMPDIR:-/tmp}/dmkv-local-cluster}
MEMORY=${DMKV_CLUSTER_MEMORY:-256MiB}
DMKVD=${DMKVD:-target/release/dmkvd}
DMKV=${DMKV:-target/release/dmkv}

die() { echo "local-cluster: $*" >&2; exit 2; }

build() {
    if [[ ! -x $DMKVD || ! -x $DMKV ]]; then
        echo "building dmkvd and dmkv (release)..."
        cargo build --release --bin dmkvd --bin dmkv
    fi
}

write_config() {
    mkdir -p "$DIR"
    {
        echo "# written by deploy/local-cluster.sh"
        echo "shards = 6"
        echo "replicas = 3"
        for n in $(seq 1 $ALL); do
            echo "[[node]]"
            echo "id = $n"
            echo "rpc = \"127.0.0.1:$((PORT + n - 1))\""
            echo "peer = \"127.0.0.1:$((PORT + 100 + n - 1))\""
            if (( n > NODES )); then echo "spare = true"; fi
        done
    } > "$DIR/cluster.toml"
}

pid_of() { cat "$DIR/node$1.pid" 2>/dev/null || true; }
running() { local p; p=$(pid_of "$1"); [[ -n $p ]] && kill -0 "$p" 2>/dev/null; }

start_node() {
    local n=$1
    if running "$n"; then
        echo "node $n already running (pid $(pid_of "$n"))"
        return
    fi
    mkdir -p "$DIR/node$n"
    nohup "$DMKVD" --cluster "$DIR/cluster.toml" --node-id "$n" --data-dir "$DIR/node$n" \
        --memory "$MEMORY" --memcached-listen "127.0.0.1:$((PORT + 200 + n - 1))" > "$DIR/node$n.out" 2> "$DIR/node$n.log" < /dev/null &
    echo $! > "$DIR/node$n.pid"
}

wait_serving() {
    local n=$1
    for _ in $(seq 1 200); do
        if grep -q "^dmkvd listening" "$DIR/node$n.out" 2>/dev/null; then
            return
        fi
        running "$n" || die "node $n exited; see $DIR/node$n.log:
$(tail -5 "$DIR/node$n.log")"
        sleep 0.1
    done
    die "node $n did not start within 20 s; see $DIR/node$n.log"
}

wait_leaders() {
    for _ in $(seq 1 100); do
        if "$DMKV" --server "127.0.0.1:$PORT" cluster status 2>/dev/null | awk '
            /^SHARD/ { table = 1; next }
            table && $3 == "none" { missing = 1 }
            table { shards++ }
            END { exit !(shards > 0 && !missing) }'; then
            return
        fi
        sleep 0.1
    done
    die "not every shard elected a leader within 10 s; try: $0 status"
}

node_arg() {
    [[ ${1:-} =~ ^[1-9][0-9]*$ && $1 -le $ALL ]] || die "name a node: 1 to $ALL"
}

stop_node() {
    local n=$1
    if running "$n"; then kill -TERM "$(pid_of "$n")"; fi
    for _ in $(seq 1 100); do running "$n" || break; sleep 0.1; done
    if running "$n"; then kill -KILL "$(pid_of "$n")"; fi
    rm -f "$DIR/node$n.pid"
}

case ${1:-} in
start)
    build
    [[ -f $DIR/cluster.toml ]] || write_config
    for n in $(seq 1 $NODES); do start_node "$n"; done
    for n in $(seq 1 $NODES); do wait_serving "$n"; done
    wait_leaders
    echo "cluster up: clients may use any of 127.0.0.1:$PORT-$((PORT + NODES - 1)); state in $DIR"
    ;;
stop)
    for n in $(seq 1 $ALL); do
        if running "$n"; then kill -TERM "$(pid_of "$n")"; fi
    done
    for n in $(seq 1 $ALL); do stop_node "$n"; done
    echo "cluster stopped (raft logs kept in $DIR; remove it to start afresh)"
    ;;
status)
    for n in $(seq 1 $ALL); do
        if running "$n"; then echo "node $n: running (pid $(pid_of "$n"))"; else echo "node $n: stopped"; fi
    done
    for n in $(seq 1 $ALL); do
        if running "$n"; then
            exec "$DMKV" --server "127.0.0.1:$((PORT + n - 1))" cluster status
        fi
    done
    ;;
kill)
    node_arg "${2:-}"
    running "$2" || die "node $2 is not running"
    kill -KILL "$(pid_of "$2")"
    rm -f "$DIR/node$2.pid"
    echo "node $2 killed"
    ;;
restart)
    node_arg "${2:-}"
    if running "$2"; then
        kill -KILL "$(pid_of "$2")"
        for _ in $(seq 1 50); do running "$2" || break; sleep 0.1; done
    fi
    rm -f "$DIR/node$2.pid"
    [[ -f $DIR/cluster.toml ]] || die "no cluster here; run: $0 start"
    : > "$DIR/node$2.out"
    start_node "$2"
    wait_serving "$2"
    echo "node $2 restarted"
    ;;
add-node)
    [[ -f $DIR/cluster.toml ]] || die "no cluster here; run: $0 start"
    grep -q "^id = $ALL\$" "$DIR/cluster.toml" ||
        die "$DIR/cluster.toml lists no node $ALL (written by an older version): stop, remove $DIR, start again"
    if ! running "$ALL"; then
        : > "$DIR/node$ALL.out"
        start_node "$ALL"
        wait_serving "$ALL"
    fi
    "$DMKV" --server "127.0.0.1:$PORT" cluster add-node "$ALL"
    ;;
remove-node)
    node_arg "${2:-}"
    "$DMKV" --server "127.0.0.1:$PORT" cluster remove-node "$2"
    ;;
rolling-restart)
    # One node at a time: a stopping node hands its shards' leadership
    # over first, so clients see no election.
    [[ -f $DIR/cluster.toml ]] || die "no cluster here; run: $0 start"
    for n in $(seq 1 $ALL); do
        if ((n > NODES)) && ! running "$n"; then continue; fi
        stop_node "$n"
        : > "$DIR/node$n.out"
        start_node "$n"
        wait_serving "$n"
        wait_leaders
        echo "node $n restarted"
    done
    ;;
*)
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac

# Shell helpers the benchmark scripts share (compare.sh, memcaslap.sh,
# hitratio.sh): sourced after the script has set BIN, RESULTS, COMMANDS,
# PORT_TRIES and START_TRIES, from the repository's root.
# shellcheck shell=bash

# Servers started, stopped at exit.
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Prints the command as the docs show it: binaries by their path in the
# repository, whatever target directory was used, and the run's directory
# of raw reports (not committed) as $OUT. Later rounds repeat the first
# one's commands (on other ports): with SHOW=0 they stay out of the page.
SHOW=1
record() {
    local shown="$*"
    shown="${shown//$BIN/target/release}"
    shown="${shown//$RESULTS/\$OUT}"
    [ "$SHOW" = 1 ] && echo "$shown" >> "$COMMANDS"
    echo "\$ $shown" >&2
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port() {
    local p i
    for ((i = 0; i < PORT_TRIES; i++)); do
        p=$((20000 + RANDOM % 40000))
        port_open "$p" || { echo "$p"; return 0; }
    done
    echo "$(basename "$0"): no free port found" >&2
    return 1
}

wait_port() { # port pid
    local i
    for ((i = 0; i < START_TRIES; i++)); do
        port_open "$1" && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# SERVER_PID may name several processes (a cluster's nodes).
stop_store() {
    local p
    for p in $SERVER_PID; do kill "$p" 2>/dev/null || true; done
    for p in $SERVER_PID; do wait "$p" 2>/dev/null || true; done
}

# Starts memcached on a free port with SERVER_THREADS, MEMORY_MIB and any
# further flags given; sets ADDR and SERVER_PID. Its log goes to
# $RESULTS/memcached.log.
start_memcached() { # flags...
    local port user=()
    port="$(free_port)"
    [ "$(id -u)" = 0 ] && user=(-u root)
    record memcached "${user[@]}" -l 127.0.0.1 -p "$port" -U 0 -t "$SERVER_THREADS" -m "$MEMORY_MIB" "$@"
    memcached "${user[@]}" -l 127.0.0.1 -p "$port" -U 0 -t "$SERVER_THREADS" -m "$MEMORY_MIB" "$@" \
        > "$RESULTS/memcached.log" 2>&1 &
    SERVER_PID=$!
    PIDS+=("$SERVER_PID")
    ADDR="127.0.0.1:$port"
    wait_port "$port" "$SERVER_PID" || { echo "$(basename "$0"): memcached did not start" >&2; exit 1; }
}

# Starts $BIN/dmkvd with the given flags, its output in $RESULTS/NAME.out
# and .err; sets SERVER_PID, and ADDR to the endpoint FIELD (rpc,
# memcached, ...) of its listening line.
start_dmkvd() { # field name flags...
    local field="$1" name="$2" i
    shift 2
    record "$BIN/dmkvd" "$@"
    "$BIN/dmkvd" "$@" > "$RESULTS/$name.out" 2> "$RESULTS/$name.err" &
    SERVER_PID=$!
    PIDS+=("$SERVER_PID")
    ADDR=""
    for ((i = 0; i < START_TRIES; i++)); do
        ADDR="$(sed -n "s/^dmkvd listening.* $field=\([^ ]*\).*/\1/p" "$RESULTS/$name.out")"
        [ -n "$ADDR" ] && break
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.1
    done
    [ -n "$ADDR" ] || { echo "$(basename "$0"): dmkvd did not start (or printed no $field= address)" >&2
        cat "$RESULTS/$name.err" >&2; exit 1; }
}

# Starts a 3-node cluster of $BIN/dmkvd on loopback: SHARDS shards of 3
# replicas, each node with the given flags and a memcached port. Sets
# ADDR to node 1's memcached address (clients send every key there, so
# node 1 passes on the keys of shards it does not lead), MC_ADDRS to
# every node's, and SERVER_PID to the three processes. Returns once node
# 1 stores a key of every shard (each shard has a leader).
start_dmkv_cluster() { # shards flags...
    local try
    # A port free when picked may be taken before a node binds it.
    for try in 1 2 3; do
        start_dmkv_cluster_once "$@" && return 0
        stop_store
        echo "$(basename "$0"): the cluster did not start (try $try of 3)" >&2
    done
    exit 1
}

start_dmkv_cluster_once() { # shards flags...
    local shards="$1" dir id i ok
    shift
    dir="$RESULTS/cluster-$(date +%s%N)"
    mkdir -p "$dir"
    {
        echo "shards = $shards"
        echo "replicas = 3"
        for id in 1 2 3; do
            printf '[[node]]\nid = %s\nrpc = "127.0.0.1:%s"\npeer = "127.0.0.1:%s"\n' "$id" "$(free_port)" "$(free_port)"
        done
    } > "$dir/cluster.toml"
    SERVER_PID=""
    MC_ADDRS=()
    for id in 1 2 3; do
        [ "$id" = 1 ] && record "$BIN/dmkvd" --cluster "\$OUT/cluster.toml" --node-id 1 --memcached-listen 127.0.0.1:0 "$@"
        "$BIN/dmkvd" --cluster "$dir/cluster.toml" --node-id "$id" --memcached-listen 127.0.0.1:0 "$@" \
            > "$dir/node$id.out" 2> "$dir/node$id.err" &
        SERVER_PID="$SERVER_PID $!"
        PIDS+=("$!")
    done
    for id in 1 2 3; do
        ADDR=""
        for ((i = 0; i < START_TRIES; i++)); do
            ADDR="$(sed -n "s/^dmkvd listening.* memcached=\([^ ]*\).*/\1/p" "$dir/node$id.out")"
            [ -n "$ADDR" ] && break
            sleep 0.1
        done
        [ -n "$ADDR" ] || { echo "$(basename "$0"): cluster node $id did not start" >&2; tail -3 "$dir/node$id.err" >&2; return 1; }
        MC_ADDRS+=("$ADDR")
    done
    ADDR="${MC_ADDRS[0]}"
    # 64 keys reach every shard of a small cluster with near certainty;
    # each set waits out its shard's election on node 1.
    for ((i = 0; i < START_TRIES; i++)); do
        ok="$(mc_sets "$ADDR" 64)"
        [ "$ok" = 64 ] && return 0
        sleep 0.1
    done
    echo "$(basename "$0"): the cluster did not elect its leaders" >&2
    return 1
}

# How many of N sets of probe keys to ADDR were STORED.
mc_sets() { # addr n
    python3 - "$1" "$2" <<'PY'
import socket, sys
host, port = sys.argv[1].rsplit(":", 1)
n = int(sys.argv[2])
try:
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(b"".join(b"set probe-%d 0 0 1\r\nx\r\n" % i for i in range(n)))
    data = b""
    while data.count(b"\r\n") < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    print(data.count(b"STORED\r\n"))
except OSError:
    print(0)
PY
}

# The sum of numbers from `stats` on the memcached port at ADDR (absent
# ones count 0).
mc_stat() { # addr name...
    python3 - "$@" <<'PY'
import socket, sys
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=5)
s.sendall(b"stats\r\n")
data = b""
while not data.endswith(b"END\r\n"):
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
names = set(sys.argv[2:])
print(sum(int(p[2]) for p in (l.split() for l in data.decode().splitlines()) if len(p) == 3 and p[1] in names))
PY
}

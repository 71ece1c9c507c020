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

stop_store() {
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
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

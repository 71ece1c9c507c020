#!/usr/bin/env bash
# memcaslap (libmemcached-tools) against memcached and against dmkvd's
# memcached port with the same settings, each run on a fresh server,
# rounds interleaved, and writes docs/memcaslap.md: a side-by-side table
# of the median run (by TPS) with the range, the machine and the commands.
#
#   benches/memcaslap.sh [--runs N] [--duration S] [--threads N] [--concurrency N]
#                        [--value-size B] [--memory-mib M] [--server-threads N]
#                        [--stores "memcached dmkv-memcached dmkv-cluster-memcached"] [--no-install]
#
# dmkv-cluster-memcached is the memcached ports of a 3-node cluster on
# this machine (3 shards of 3 replicas, each node with the same threads
# and memory as the single dmkvd): memcaslap spreads keys over the three
# nodes by its own hashing, and each node passes on those of shards it
# does not lead; the table says what share was passed on (the nodes'
# `stats` counter `forwarded`).
#
# Workload: memcaslap's own (keys it has set, a window per connection),
# 32 B keys, fixed-size values, 90 % get / 10 % set. Raw output goes to
# benches/results/<time>-memcaslap/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
INVOCATION="benches/memcaslap.sh${*:+ $*}"

RUNS=1
DURATION=10                 # seconds per run
THREADS=2                   # memcaslap -T
CONCURRENCY=32              # memcaslap -c
VALUE_SIZE=1000             # memcaslap -X
MEMORY_MIB=1024             # memcached -m, dmkvd --memory
SERVER_THREADS=2            # memcached -t, dmkvd --threads
KEY_SIZE=32
GET_SHARE=0.9
STORES="memcached dmkv-memcached"
INSTALL=1
START_TRIES=100             # x 0.1 s: how long a server gets to start
PORT_TRIES=50
DOC=docs/memcaslap.md

while [ $# -gt 0 ]; do
    case "$1" in
        --runs) RUNS="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --value-size) VALUE_SIZE="$2"; shift 2 ;;
        --memory-mib) MEMORY_MIB="$2"; shift 2 ;;
        --server-threads) SERVER_THREADS="$2"; shift 2 ;;
        --stores) STORES="$2"; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
        *) echo "memcaslap.sh: unknown flag $1" >&2; exit 2 ;;
    esac
done
for n in "$RUNS" "$DURATION" "$THREADS" "$CONCURRENCY" "$VALUE_SIZE" "$MEMORY_MIB" "$SERVER_THREADS"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "memcaslap.sh: not a positive number: $n" >&2; exit 2; }
done
for s in $STORES; do
    case "$s" in
        memcached|dmkv-memcached|dmkv-cluster-memcached) ;;
        *) echo "memcaslap.sh: unknown store $s (memcached, dmkv-memcached, dmkv-cluster-memcached)" >&2; exit 2 ;;
    esac
done

log() { echo "== $*" >&2; }

if ! command -v memcached >/dev/null || ! command -v memcaslap >/dev/null; then
    [ "$INSTALL" = 1 ] || { echo "memcaslap.sh: memcached or memcaslap missing (and --no-install)" >&2; exit 2; }
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    log "installing memcached and libmemcached-tools"
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y memcached libmemcached-tools
fi

BIN="${CARGO_TARGET_DIR:-target}/release"
if [[ " $STORES " == *" dmkv-"* ]]; then
    log "building (release)"
    cargo build --release -p dmkv-server --bin dmkvd
    if ! "$BIN/dmkvd" --help | grep -q -- --memcached-listen; then
        echo "memcaslap.sh: this dmkvd has no --memcached-listen, so dmkv cannot be measured yet;" \
            "build a dmkvd with the memcached port, or run with --stores memcached" >&2
        exit 2
    fi
fi

STAMP="$(date -u +%Y%m%d-%H%M%S)"
RESULTS="benches/results/$STAMP-memcaslap"
mkdir -p "$RESULTS"
COMMANDS="$RESULTS/commands.txt"
: > "$COMMANDS"

# memcaslap's workload file: key and value sizes (min max share) and the
# command mix (0 set, 1 get). -X below fixes the value size too.
CONFIG="$RESULTS/memcaslap.cfg"
printf 'key\n%s %s 1\nvalue\n%s %s 1\ncmd\n0 %s\n1 %s\n' "$KEY_SIZE" "$KEY_SIZE" "$VALUE_SIZE" "$VALUE_SIZE" \
    "$(awk -v g="$GET_SHARE" 'BEGIN { printf "%.2f", 1 - g }')" "$GET_SHARE" > "$CONFIG"

# shellcheck source=benches/lib.sh
source benches/lib.sh

# Starts a fresh store; sets ADDR (its memcached-protocol address) and SERVER_PID.
start_store() {
    local store="$1"
    case "$store" in
        memcached) start_memcached -c 4096 ;;
        dmkv-memcached)
            start_dmkvd memcached dmkvd --listen 127.0.0.1:0 --memcached-listen 127.0.0.1:0 \
                --threads "$SERVER_THREADS" --memory "${MEMORY_MIB}MiB" --log warn
            ;;
        dmkv-cluster-memcached)
            start_dmkv_cluster 3 --threads "$SERVER_THREADS" --memory "${MEMORY_MIB}MiB" --log warn
            ;;
    esac
}


# One line per run: store, TPS, get and set average latency (µs), hit
# ratio (%), output file, share of commands passed on (%, a cluster's). memcaslap prints latency only with -S; a
# statistics period as long as the run gives one block for the whole run.
SUMMARY="$RESULTS/runs.tsv"
: > "$SUMMARY"
parse() { # store file
    awk -v store="$1" -v file="$(basename "$2")" -v fw="${3:-}" '
        /^Get Statistics \(/ { block = "get" }
        /^Set Statistics \(/ { block = "set" }
        /^Total Statistics \(/ { block = "" }
        /^ *Avg:/ && block == "get" { get_avg = $2 }
        /^ *Avg:/ && block == "set" { set_avg = $2 }
        /^cmd_get:/ { gets = $2 }
        /^cmd_set:/ { sets = $2 }
        /^get_misses:/ { misses = $2 }
        /TPS:/ { for (i = 1; i < NF; i++) if ($i == "TPS:") tps = $(i + 1) }
        END {
            if (tps == "") exit 1
            hit = gets > 0 ? sprintf("%.2f", 100 * (1 - misses / gets)) : "–"
            share = fw != "" && gets + sets > 0 ? sprintf("%.1f %%", 100 * fw / (gets + sets)) : "–"
            printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", store, tps, get_avg == "" ? "–" : get_avg,
                set_avg == "" ? "–" : set_avg, hit, file, share
        }' "$2"
}

LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg)"
for ((round = 1; round <= RUNS; round++)); do
    [ "$round" = 1 ] && SHOW=1 || SHOW=0
    for store in $STORES; do
        log "$store, run $round of $RUNS"
        start_store "$store"
        out="$RESULTS/$store-r$round.txt"
        args=(-s "$ADDR" -T "$THREADS" -c "$CONCURRENCY" -t "${DURATION}s" -S "${DURATION}s" -F "$CONFIG" -X "$VALUE_SIZE")
        fw0=""
        if [ "$store" = dmkv-cluster-memcached ]; then
            fw0=0
            for a in "${MC_ADDRS[@]}"; do fw0=$(( fw0 + $(mc_stat "$a" forwarded) )); done
            args[1]="$(IFS=,; echo "${MC_ADDRS[*]}")"
        fi
        record memcaslap "${args[@]}"
        # memcaslap clears the screen before each statistics block.
        memcaslap "${args[@]}" 2>&1 | tr -d '\033' > "$out" || true
        fw=""
        if [ -n "$fw0" ]; then
            fw=$(( -fw0 ))
            for a in "${MC_ADDRS[@]}"; do fw=$(( fw + $(mc_stat "$a" forwarded) )); done
        fi
        parse "$store" "$out" "$fw" >> "$SUMMARY" || { echo "memcaslap.sh: no TPS in $out:" >&2; tail -5 "$out" >&2; exit 1; }
        tail -1 "$SUMMARY" >&2
        stop_store
    done
done
LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg)"

cpu="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
{
    echo "# memcaslap: memcached and dmkv's memcached port"
    echo
    echo "Generated by \`benches/memcaslap.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC') from commit \`$(git rev-parse --short HEAD)\`."
    echo
    echo "## Machine"
    echo
    echo "| | |"
    echo "|---|---|"
    echo "| CPU | $cpu |"
    echo "| cores | $(nproc) |"
    echo "| kernel | $(uname -sr) |"
    echo "| memcached | $(memcached --version) |"
    echo "| memcaslap | $(memcaslap -V 2>&1 | head -1) |"
    echo "| load average (1, 5, 15 min) | before: $LOAD_BEFORE; after: $LOAD_AFTER |"
    echo
    echo "## Setup"
    echo
    echo "memcaslap and the server share the machine's cores, over loopback; one server at a time, fresh for"
    echo "every run, runs of the stores interleaved. memcaslap: $THREADS threads, $CONCURRENCY connections,"
    echo "${DURATION} s, $KEY_SIZE B keys, $VALUE_SIZE B values, $(awk -v g="$GET_SHARE" 'BEGIN { printf "%.0f", 100 * g }') % gets; it reads only keys it has"
    echo "written, so a miss means the server dropped an item. Server threads: $SERVER_THREADS; memory: $MEMORY_MIB MiB."
    echo "Latency is memcaslap's average per command in µs. Each store ran $RUNS time(s); the table shows the"
    echo "run of median TPS and the range of TPS over the runs."
    if [[ " $STORES " == *" dmkv-cluster-memcached "* ]]; then
        echo
        echo "\`dmkv-cluster-memcached\` is the memcached ports of a 3-node cluster on these same cores (3 shards"
        echo "of 3 replicas: every write goes through raft to all three nodes; each node has the threads and memory"
        echo "above). memcaslap spreads its keys over the three nodes by its own hashing (\`-s\` with all three);"
        echo "each node serves the shards it leads and passes the rest on to their leaders; \"passed on\" is the share"
        echo "of commands passed on (the nodes' \`forwarded\` counters over memcaslap's commands)."
    fi
    echo
    echo "## Results"
    echo
    echo "| store | TPS | runs: TPS range | get avg µs | set avg µs | get hit ratio | passed on |"
    echo "|---|---:|---|---:|---:|---:|---:|"
    for store in $STORES; do
        rows="$(awk -F'\t' -v s="$store" '$1 == s' "$SUMMARY" | sort -t$'\t' -k2,2n)"
        n="$(wc -l <<< "$rows")"
        median="$(sed -n "$(( (n - 1) / 2 + 1 ))p" <<< "$rows")"
        low="$(head -1 <<< "$rows" | cut -f2)"
        high="$(tail -1 <<< "$rows" | cut -f2)"
        IFS=$'\t' read -r _ tps get_avg set_avg hit _ share <<< "$median"
        range="1"; [ "$n" = 1 ] || range="$n: $low–$high"
        echo "| $store | $tps | $range | $get_avg | $set_avg | $hit % | $share |"
    done
    echo
    echo "## Commands"
    echo
    [ "$RUNS" = 1 ] || echo "Run 1 of $RUNS; the other runs repeated them on other ports."
    [ "$RUNS" = 1 ] || echo
    echo '```sh'
    echo "$INVOCATION"
    echo "# which ran (\$OUT/memcaslap.cfg below):"
    cat "$COMMANDS"
    echo '```'
    echo
    echo '```'
    cat "$CONFIG"
    echo '```'
} > "$DOC"
log "wrote $DOC"

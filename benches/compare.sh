#!/usr/bin/env bash
# Runs the same YCSB workloads against dmkv, memcached and Redis on this
# machine, one store at a time, and writes docs/benchmarks.md with the
# machine, the exact commands, a table per workload and SVG plots.
#
#   benches/compare.sh [--workloads "a b c"] [--configs "1x1 32x1 2x16"]
#                      [--records N] [--value-size B] [--update-writes record|field]
#                      [--duration S] [--warmup W] [--server-threads N] [--memory-mib N] [--seed N]
#                      [--stores "dmkv dmkv-onesided memcached dmkv-memcached redis"] [--runs N] [--no-install]
#                      [--doc-dir DIR]
#
# dmkv-memcached is dmkvd serving memcached's text protocol on its second
# port (--memcached-listen), driven like memcached. A dmkvd without that
# port drops it from the default stores with a warning (named in --stores,
# it is an error). dmkv-cluster-memcached (only when named in --stores) is
# the memcached port of node 1 of a 3-node cluster on this machine (3
# shards of 3 replicas, each node with the settings of the single dmkvd),
# driven the same way; the page says what share of requests node 1 passed
# on to other nodes. --doc-dir (default docs) is where the page, its plots
# and the CSV go.
#
# Configurations are threads x in flight; those with one in flight (Tx1)
# are YCSB's own mode and come first in the tables, the others are
# labelled "pipelined, not YCSB-comparable". With --runs N every store is
# measured N times, rounds interleaved (each round restarts the stores and
# reloads the records); tables and plots show the median run and the range.
# Defaults (one round) take about five minutes. Raw reports (JSON, CSV,
# logs) go to benches/results/<time>/ (git-ignored); the page, its plots
# and a CSV of every run's summary go to docs/.
set -euo pipefail
cd "$(dirname "$0")/.."
INVOCATION="benches/compare.sh${*:+ $*}"

WORKLOADS="a b c"
# Client threads x operations in flight per thread. 1x1: one synchronous
# client. 32x1: 32 operations outstanding the YCSB way, 32 threads waiting
# for one reply each. 2x16: the same 32 outstanding, pipelined 16 deep on
# two threads (how dmkv's clients run; not YCSB-comparable).
CONFIGS="1x1 32x1 2x16"
RECORDS=100000
VALUE_SIZE=1000
UPDATE_WRITES=record        # record: updates rewrite all 10 fields; field: one (YCSB's default)
DURATION=5                  # measured seconds per run
WARMUP=1s                   # unmeasured start of each run
SERVER_THREADS=2            # dmkvd --threads, memcached -t
MEMORY_MIB=1024             # dmkvd --memory, memcached -m
SEED=1
STORES="dmkv dmkv-onesided memcached dmkv-memcached redis"
STORES_GIVEN=0
ROUNDS=1
INSTALL=1
DOC_DIR=docs
START_TRIES=100             # x 0.1 s: how long a server gets to start
PORT_TRIES=50

while [ $# -gt 0 ]; do
    case "$1" in
        --workloads) WORKLOADS="$2"; shift 2 ;;
        --configs) CONFIGS="$2"; shift 2 ;;
        --records) RECORDS="$2"; shift 2 ;;
        --value-size) VALUE_SIZE="$2"; shift 2 ;;
        --update-writes) UPDATE_WRITES="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --warmup) WARMUP="$2"; shift 2 ;;
        --server-threads) SERVER_THREADS="$2"; shift 2 ;;
        --memory-mib) MEMORY_MIB="$2"; shift 2 ;;
        --seed) SEED="$2"; shift 2 ;;
        --stores) STORES="$2"; STORES_GIVEN=1; shift 2 ;;
        --runs) ROUNDS="$2"; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        --doc-dir) DOC_DIR="$2"; shift 2 ;;
        # The usage is the comment block at the top, without its markers.
        -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
        *) echo "compare.sh: unknown flag $1" >&2; exit 2 ;;
    esac
done

log() { echo "== $*" >&2; }

# --- memcached and redis-server from Debian packages, if missing.
missing=""
for b in memcached redis-server; do command -v "$b" >/dev/null || missing="$missing $b"; done
if [ -n "$missing" ]; then
    [ "$INSTALL" = 1 ] || { echo "compare.sh: missing$missing (and --no-install)" >&2; exit 2; }
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    log "installing$missing"
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y memcached redis-server
fi

log "building (release)"
cargo build --release -p dmkv-server -p dmkv-benches --bins
BIN="${CARGO_TARGET_DIR:-target}/release"

if [[ " $STORES " == *" dmkv-memcached "* ]] && ! "$BIN/dmkvd" --help | grep -q -- --memcached-listen; then
    if [ "$STORES_GIVEN" = 1 ]; then
        echo "compare.sh: this dmkvd has no --memcached-listen: dmkv-memcached cannot run" >&2
        exit 2
    fi
    log "this dmkvd has no --memcached-listen: leaving dmkv-memcached out"
    STORES=" $STORES "
    STORES="${STORES// dmkv-memcached / }"
fi

STAMP="$(date -u +%Y%m%d-%H%M%S)"
RESULTS="benches/results/$STAMP"
mkdir -p "$RESULTS"
mkdir -p "$DOC_DIR"
COMMANDS="$RESULTS/commands.txt"
: > "$COMMANDS"

# shellcheck source=benches/lib.sh
source benches/lib.sh

# Starts a store; sets ADDR and SERVER_PID.
start_store() {
    local store="$1" port
    case "$store" in
        dmkv|dmkv-onesided|dmkv-memcached)
            # dmkv-memcached talks to the memcached port, the others to RPC.
            local args=(--listen 127.0.0.1:0) field=rpc
            [ "$store" = dmkv-memcached ] && { args+=(--memcached-listen 127.0.0.1:0); field=memcached; }
            start_dmkvd "$field" dmkvd "${args[@]}" --threads "$SERVER_THREADS" --memory "${MEMORY_MIB}MiB" --log warn
            ;;
        dmkv-cluster-memcached)
            start_dmkv_cluster 3 --threads "$SERVER_THREADS" --memory "${MEMORY_MIB}MiB" --log warn
            ;;
        memcached) start_memcached -c 4096 ;;
        redis)
            port="$(free_port)"
            record redis-server --port "$port" --bind 127.0.0.1 --save "''" --appendonly no --maxmemory 0
            redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --maxmemory 0 \
                --logfile "$RESULTS/redis.log" &
            SERVER_PID=$!
            PIDS+=("$SERVER_PID")
            ADDR="127.0.0.1:$port"
            wait_port "$port" "$SERVER_PID" || { echo "compare.sh: redis-server did not start" >&2; exit 1; }
            ;;
        *) echo "compare.sh: unknown store $store" >&2; exit 2 ;;
    esac
}


LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg)"
RUNS=0
for ((round = 1; round <= ROUNDS; round++)); do
[ "$round" = 1 ] && SHOW=1 || SHOW=0
for store in $STORES; do
    log "$store, round $round of $ROUNDS"
    start_store "$store"
    loaded=0
    for cfg in $CONFIGS; do
        threads="${cfg%x*}"
        inflight="${cfg#*x}"
        for w in $WORKLOADS; do
            name="$store-$w-${threads}x$inflight-r$round"
            backend="$store"
            [ "$store" = dmkv-onesided ] && backend=dmkv
            [ "$store" = dmkv-memcached ] && backend=memcached
            [ "$store" = dmkv-cluster-memcached ] && backend=memcached
            args=(--backend "$backend" --label "$store" --server "$ADDR" --workload "$w" --records "$RECORDS" --value-size "$VALUE_SIZE"
                --update-writes "$UPDATE_WRITES" --threads "$threads" --in-flight "$inflight" --duration "$DURATION" --warmup "$WARMUP" --seed "$SEED"
                --json "$RESULTS/$name.json" --csv "$RESULTS/$name.csv")
            [ "$store" = dmkv ] && args+=(--path rpc)
            [ "$store" = dmkv-onesided ] && args+=(--path one-sided)
            # The first run of a store loads the records; the others reuse them.
            [ "$loaded" = 1 ] && args+=(--skip-load)
            record "$BIN/dmkv-ycsb" "${args[@]}"
            if [ "$store" = dmkv-cluster-memcached ]; then
                fw0="$(mc_stat "$ADDR" forwarded)"; cmd0="$(mc_stat "$ADDR" cmd_get cmd_set)"
            fi
            "$BIN/dmkv-ycsb" "${args[@]}" | tee "$RESULTS/$name.txt"
            if [ "$store" = dmkv-cluster-memcached ]; then
                fw=$(( $(mc_stat "$ADDR" forwarded) - fw0 )); cmd=$(( $(mc_stat "$ADDR" cmd_get cmd_set) - cmd0 ))
                printf '%s\t%s\t%s\n' "$name" "$fw" "$cmd" >> "$RESULTS/forwarded.tsv"
            fi
            loaded=1
            RUNS=$((RUNS + 1))
        done
    done
    stop_store
done
done
SHOW=1
LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg)"

log "plots, tables and the runs' summary"
first_csv="$(ls "$RESULTS"/*.csv | head -1)"
# One file per run; the first column names the run (store-workload-config-round).
{
    echo "run,$(head -1 "$first_csv")"
    for f in "$RESULTS"/*.csv; do tail -n +2 "$f" | sed "s/^/$(basename "$f" .csv),/"; done
} > "$DOC_DIR/benchmarks.csv"
log "plots and tables"
record "$BIN/dmkv-ycsb-plot" --out-dir "$DOC_DIR" --markdown "$RESULTS/tables.md" "$RESULTS/*.json"
"$BIN/dmkv-ycsb-plot" --out-dir "$DOC_DIR" --markdown "$RESULTS/tables.md" "$RESULTS"/*.json

cpu="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
mem="$(awk '/^MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
{
    echo "# Benchmarks: dmkv, memcached and Redis under YCSB"
    echo
    echo "Generated by \`benches/compare.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC') from commit \`$(git rev-parse --short HEAD)\`."
    echo "The summary of every run (CSV, one row per run and operation) is committed beside this page as"
    echo "[benchmarks.csv](benchmarks.csv). The raw reports (JSON, text) went to a directory of the run's own,"
    echo "\`\$OUT\` in the commands below (\`benches/results/<time>/\`, git-ignored): rerun the invocation to get them."
    echo
    echo "## Machine"
    echo
    echo "| | |"
    echo "|---|---|"
    echo "| CPU | $cpu |"
    echo "| cores | $(nproc) |"
    echo "| memory | $mem |"
    echo "| kernel | $(uname -sr) |"
    echo "| transparent huge pages for shared memory | $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null || echo unknown) (see docs/performance.md) |"
    echo "| memcached | $(memcached --version) |"
    echo "| Redis | $(redis-server --version | sed 's/ sha=.*//') |"
    echo "| rustc | $(rustc --version) |"
    echo "| load average (1, 5, 15 min) | before: $LOAD_BEFORE; after: $LOAD_AFTER |"
    echo
    echo "Clients and servers share these cores, over loopback. The machine is shared with"
    echo "other work at times; the load average above says how quiet it was. Each configuration ran $ROUNDS time(s), in"
    echo "interleaved rounds ($RUNS runs in all); tables and plots show the run of median throughput."
    echo
    echo "## Setup"
    echo
    echo "- $RECORDS records of $VALUE_SIZE B in 10 fields, keys chosen as YCSB does (scrambled zipfian, 0.99, over the"
    echo "  records and one more key, which is drawn again)."
    if [ "$UPDATE_WRITES" = field ]; then
        echo "- Updates write one field (\`--update-writes field\`, YCSB's default \`writeallfields=false\`). The stores"
        echo "  as driven here have no partial writes, so the field replaces the stored value, as YCSB's memcached"
        echo "  binding does it; reads then return a record or a field."
    else
        echo "- Updates rewrite the whole record (\`--update-writes record\`, YCSB with \`writeallfields=true\`; YCSB's"
        echo "  default writes one field, \`--update-writes field\`)."
    fi
    echo "- Each run: $WARMUP warm-up, then $DURATION s measured; closed loop (a new operation starts when one completes)."
    echo "- Concurrency (client threads × operations in flight per thread): $CONFIGS. Each thread has one connection;"
    echo "  every store gets the same threads, connections and depth."
    echo "- **YCSB-comparable** rows (T×1) run as YCSB does: each client thread waits for every reply before it sends"
    echo "  its next request. They come first in each table. Rows with more than one operation in flight per thread"
    echo "  are labelled **pipelined, not YCSB-comparable**: that is how dmkv's clients run, but YCSB cannot, so"
    echo "  those numbers do not belong beside published YCSB results."
    if [[ " $CONFIGS " == *" 32x1 "* && " $CONFIGS " == *" 2x16 "* ]]; then
        echo "- 32×1 and 2×16 keep the same 32 operations outstanding, the YCSB way and the pipelined way."
    fi
    echo "- One store runs at a time. Server threads: dmkvd \`--threads $SERVER_THREADS\`, memcached \`-t $SERVER_THREADS\`;"
    echo "  Redis executes commands on one thread (its I/O threads are off by default), so it gets one core's worth."
    echo "- Redis without persistence (\`--save '' --appendonly no\`); memcached and dmkvd with $MEMORY_MIB MiB."
    echo "- dmkv's own client is measured two ways: \`dmkv\` on the RPC path (\`--path rpc\`), the path the target below is about, and"
    echo "  \`dmkv-onesided\` with GETs as one-sided reads (\`--path one-sided\`: shared memory, since client and"
    echo "  server share this host; PUTs still go over RPC)."
    if [[ " $STORES " == *" dmkv-memcached "* ]]; then
        echo "- \`dmkv-memcached\` is dmkvd serving memcached's text protocol on its second port (\`--memcached-listen\`),"
        echo "  driven by the same client as memcached (\`--backend memcached\`); it sits beside memcached in the tables."
    fi
    if [[ " $STORES " == *" dmkv-cluster-memcached "* ]]; then
        echo "- \`dmkv-cluster-memcached\` is the memcached port of node 1 of a 3-node cluster on these same cores (3 shards"
        echo "  of 3 replicas: every write goes through raft to all three nodes; each node has the threads and memory"
        echo "  of the single dmkvd). Every key goes to node 1, which serves the shards it leads and passes the rest on"
        echo "  to their leaders. Share of requests node 1 passed on (its \`forwarded\` counter over its \`cmd_get\` +"
        echo "  \`cmd_set\`, warm-up included), per run:"
        awk -F'\t' '$3 > 0 { printf "  %s %.1f %%;", $1, 100 * $2 / $3 } END { print "" }' "$RESULTS/forwarded.tsv"
    fi
    echo "- Measured where YCSB measures. Throughput: operations over the measured wall-clock window (first"
    echo "  measured start to last reply, all threads together). Latency: service time in µs, from sending the"
    echo "  request (the key already chosen, the value built) to its reply; failures are counted, not timed. In"
    echo "  workload F the READ and UPDATE inside each READ-MODIFY-WRITE are timed on their own rows too."
    echo "  (Open-loop runs, \`--target-rate\`, also report latency from each operation's intended start, labelled.)"
    echo "- At 1×1 every store waits one loopback round trip per operation, so throughput there mostly measures"
    echo "  how fast the kernel (and, on a virtual machine, the hypervisor) wakes an idle client or server thread."
    echo "  That depends on what else runs on the machine and can vary several-fold between runs (see the range"
    echo "  column). More operations outstanding keep the servers busy and say more about the stores themselves."
    echo '- Plots are SVG from `dmkv-ycsb-plot` (plotters'"'"' SVG backend: no system fonts needed, the viewer draws the text).'
    echo
    echo "## Commands"
    echo
    [ "$ROUNDS" = 1 ] || echo "Round 1 of $ROUNDS; the other rounds ran the same commands on other ports (files -r2, -r3, ...)."
    [ "$ROUNDS" = 1 ] || echo
    echo '```sh'
    echo "$INVOCATION"
    echo "# which ran:"
    cat "$COMMANDS"
    echo '```'
    echo
    echo "## Results"
    echo
    echo "![throughput](ycsb-throughput.svg)"
    echo
    echo "![p99 latency](ycsb-p99.svg)"
    echo
    cat "$RESULTS/tables.md"
} > "$DOC_DIR/benchmarks.md"
log "wrote $DOC_DIR/benchmarks.md ($RUNS runs)"

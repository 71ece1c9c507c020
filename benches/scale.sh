#!/usr/bin/env bash
# How GET cost and memory per item grow with the number of keys, and how
# dmkv's bytes per item compare with memcached's at the same keys and
# sizes. Writes docs/scale.md.
#
#   benches/scale.sh [--counts "100000 1000000 10000000"] [--mem-counts "..."]
#                    [--value-size B] [--secs S] [--out FILE]
#
# For each count N of --counts (GET cost) and of --mem-counts (bytes per
# item; default: the same counts):
# - GET cost: a fresh dmkvd loaded with N keys (`dmkv-getbench --load`,
#   16-byte keys), then single GETs through the synchronous shared-memory
#   API (`--sync`), uniform and zipfian keys, one client core.
# - Bytes per item: a fresh dmkvd and a fresh memcached each loaded with
#   the same N YCSB records (`dmkv-ycsb`, one field of VALUE_SIZE bytes),
#   then their own counters: dmkv's allocated data bytes and index bytes,
#   memcached's item bytes, hash table and slab memory, each per item.
# Raw output goes to benches/results/<time>-scale/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
INVOCATION="benches/scale.sh${*:+ $*}"

COUNTS="100000 1000000 10000000"
MEM_COUNTS=""
VALUE_SIZE=16
SECS=3
SERVER_THREADS=2
START_TRIES=300             # x 0.1 s: how long a server gets to start
PORT_TRIES=50
DOC=docs/scale.md

while [ $# -gt 0 ]; do
    case "$1" in
        --counts) COUNTS="$2"; shift 2 ;;
        --mem-counts) MEM_COUNTS="$2"; shift 2 ;;
        --value-size) VALUE_SIZE="$2"; shift 2 ;;
        --secs) SECS="$2"; shift 2 ;;
        --out) DOC="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
        *) echo "scale.sh: unknown flag $1" >&2; exit 2 ;;
    esac
done
MEM_COUNTS="${MEM_COUNTS:-$COUNTS}"
for n in $COUNTS $MEM_COUNTS "$VALUE_SIZE" "$SECS"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "scale.sh: not a positive number: $n" >&2; exit 2; }
done
command -v memcached >/dev/null || { echo "scale.sh: needs memcached (apt-get install memcached)" >&2; exit 2; }

log() { echo "== $*" >&2; }

log "building (release)"
cargo build --release -p dmkv-server -p dmkv-benches --bins >&2
BIN="$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/release"
RESULTS="benches/results/$(date -u +%Y%m%d-%H%M%S)-scale"
mkdir -p "$RESULTS"
COMMANDS="$RESULTS/commands.txt"
: > "$COMMANDS"
# shellcheck source=benches/lib.sh
source benches/lib.sh

# Memory for N items of B bytes each (room to spare included), at least 256 MiB.
mib_for() { local m=$(( $1 * $2 / 1048576 + 1 )); [ "$m" -lt 256 ] && m=256; echo "$m"; }

# A dmkvd stat (the `dmkv stats` line KEY VALUE).
stat_of() { sed -n "s/^$1 //p" "$2"; }

ROWS_GET=()
ROWS_MEM=()
for n in $COUNTS; do
    # getbench's 16-byte keys: a 32-byte header, key and value in 64-byte
    # units, plus the index.
    MEMORY_MIB="$(mib_for "$n" 128)"
    log "$n keys: GET cost"
    start_dmkvd rpc "dmkvd-get-$n" --listen 127.0.0.1:0 --memory "${MEMORY_MIB}MiB" --threads "$SERVER_THREADS" --log warn
    record "$BIN/dmkv-getbench" --server "$ADDR" --load --keys "$n" --value-size "$VALUE_SIZE" --transport rpc --secs 0.1
    "$BIN/dmkv-getbench" --server "$ADDR" --load --keys "$n" --value-size "$VALUE_SIZE" --transport rpc --secs 0.1 \
        > "$RESULTS/load-$n.txt"
    line=()
    for dist in uniform zipfian; do
        record "$BIN/dmkv-getbench" --server "$ADDR" --keys "$n" --value-size "$VALUE_SIZE" --transport shm --sync \
            --distribution "$dist" --secs "$SECS"
        "$BIN/dmkv-getbench" --server "$ADDR" --keys "$n" --value-size "$VALUE_SIZE" --transport shm --sync \
            --distribution "$dist" --secs "$SECS" | tee "$RESULTS/get-$n-$dist.txt" >&2
        us="$(sed -n 's/.*(\([0-9.]*\) us\/GET).*/\1/p' "$RESULTS/get-$n-$dist.txt")"
        bad="$(sed -n 's/.*wrong\/missing=\([0-9]*\).*/\1/p' "$RESULTS/get-$n-$dist.txt")"
        [ "$bad" = 0 ] || { echo "scale.sh: $bad GETs of $n keys found nothing or the wrong size" >&2; exit 1; }
        line+=("$us")
    done
    ROWS_GET+=("| $n | ${line[0]} | ${line[1]} |")
    stop_store
done

for n in $MEM_COUNTS; do
    # YCSB's keys are longer (up to 23 bytes): two units per item.
    MEMORY_MIB="$(mib_for "$n" 256)"
    log "$n keys: bytes per item"
    # The index starts small and grows by splitting, so its size follows
    # the items (the default sizes it for a memory full of 1 KB items).
    start_dmkvd rpc "dmkvd-mem-$n" --listen 127.0.0.1:0 --memory "${MEMORY_MIB}MiB" --buckets 1024 \
        --threads "$SERVER_THREADS" --log warn
    ycsb=(--workload c --records "$n" --value-size "$VALUE_SIZE" --fields 1 --operations 1 --threads 2 --in-flight 16)
    record "$BIN/dmkv-ycsb" --backend dmkv --path rpc --server "$ADDR" "${ycsb[@]}"
    "$BIN/dmkv-ycsb" --backend dmkv --path rpc --server "$ADDR" "${ycsb[@]}" > "$RESULTS/ycsb-dmkv-$n.txt"
    "$BIN/dmkv" --server "$ADDR" stats > "$RESULTS/stats-dmkv-$n.txt"
    stop_store
    items="$(stat_of items "$RESULTS/stats-dmkv-$n.txt")"
    alloc="$(stat_of allocated_bytes "$RESULTS/stats-dmkv-$n.txt")"
    index="$(stat_of index_bytes "$RESULTS/stats-dmkv-$n.txt")"
    [ "$items" = "$n" ] || { echo "scale.sh: dmkv holds $items items, not $n" >&2; exit 1; }

    start_memcached -c 4096
    record "$BIN/dmkv-ycsb" --backend memcached --server "$ADDR" "${ycsb[@]}"
    "$BIN/dmkv-ycsb" --backend memcached --server "$ADDR" "${ycsb[@]}" > "$RESULTS/ycsb-memcached-$n.txt"
    { printf 'stats\r\nstats slabs\r\nquit\r\n'; sleep 1; } | (exec 3<>"/dev/tcp/${ADDR%:*}/${ADDR#*:}"; cat >&3 & cat <&3) \
        > "$RESULTS/stats-memcached-$n.txt" || true
    stop_store
    mstat() { sed -n "s/^STAT $1 \([0-9]*\).*/\1/p" "$RESULTS/stats-memcached-$n.txt" | head -1; }
    mitems="$(mstat curr_items)"
    mbytes="$(mstat bytes)"
    mhash="$(mstat hash_bytes)"
    mmalloc="$(mstat total_malloced)"
    [ "$mitems" = "$n" ] || { echo "scale.sh: memcached holds $mitems items, not $n" >&2; exit 1; }
    per() { awk -v a="$1" -v n="$2" 'BEGIN { printf "%.1f", a / n }'; }
    # allocated_bytes counts the index's segments too (they live in the
    # data area).
    ROWS_MEM+=("| $n | $(per $((alloc - index)) "$n") | $(per "$index" "$n") | $(per "$alloc" "$n") | $(per "$mbytes" "$n") | $(per "$mhash" "$n") | $(per "$mmalloc" "$n") | $(per $((mmalloc + mhash)) "$n") |")
done

{
    echo "# Scale: GET cost and bytes per item as the key count grows"
    echo
    echo "Generated by \`$INVOCATION\` on $(date -u +%Y-%m-%d) at commit $(git rev-parse --short HEAD)."
    echo "Machine: $(nproc) cores, $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1),"
    echo "$(uname -sr), shared-memory transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null || echo unknown)."
    echo
    echo "## GET cost (µs per GET, one client core, synchronous shared-memory API, $VALUE_SIZE-byte values)"
    echo
    echo "| keys | uniform | zipfian 0.99 |"
    echo "|---:|---:|---:|"
    printf '%s\n' "${ROWS_GET[@]}"
    echo
    echo "## Bytes per item ($VALUE_SIZE-byte values, YCSB keys, the same records in both stores)"
    echo
    echo "dmkv: data (\`allocated_bytes\` less the index: items of a 32-byte header, key and value, rounded up to"
    echo "64-byte units) and \`index_bytes\` (128-byte buckets of a header and fifteen 8-byte slots, in 4 KiB segments"
    echo "that split as items arrive; the index starts at 1024 buckets)."
    echo "memcached: \`bytes\` (items with their headers), \`hash_bytes\` (its hash table) and \`total_malloced\`"
    echo "(slab pages handed out: items plus slab-class rounding)."
    echo
    echo "| items | dmkv data | dmkv index | dmkv total | memcached items | memcached hash | memcached slabs | memcached total (slabs + hash) |"
    echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
    printf '%s\n' "${ROWS_MEM[@]}"
    echo
    echo "## Commands"
    echo
    echo '```'
    cat "$COMMANDS"
    echo '```'
} > "$DOC"
log "wrote $DOC"

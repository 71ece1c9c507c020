#!/usr/bin/env bash
# Hit ratio at equal memory: the same cache-aside zipfian trace
# (dmkv-hitratio: GET, and on a miss SET) against memcached (-m M) and
# dmkvd (--memory M --evict lru), each store fresh, and writes the results
# section of docs/eviction.md (between its hitratio markers).
#
#   benches/hitratio.sh [--memory-mib M] [--keys N] [--ops N] [--value-size B]
#                       [--zipf C] [--seed N] [--warmup OPS] [--server-threads N]
#                       [--stores "memcached dmkv-memcached dmkv-rpc dmkv-onesided"]
#                       [--no-install]
#
# Stores: memcached; dmkv-memcached, dmkvd over its memcached port;
# dmkv-rpc and dmkv-onesided, dmkvd through the SDK with --path rpc and
# --path one-sided. Defaults: 64 MiB, 300000 keys of 1000 B (a working set
# about 4.5x memory), 3000000 operations, zipfian 0.99, warm-up ops/5.
# Raw reports go to benches/results/<time>-hitratio/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
INVOCATION="benches/hitratio.sh${*:+ $*}"

MEMORY_MIB=64
KEYS=300000
OPS=3000000
VALUE_SIZE=1000
ZIPF=0.99
SEED=1
WARMUP=""                   # empty: dmkv-hitratio's default, ops / 5
SERVER_THREADS=2            # dmkvd --threads, memcached -t
STORES="memcached dmkv-memcached dmkv-rpc dmkv-onesided"
INSTALL=1
START_TRIES=100             # x 0.1 s: how long a server gets to start
PORT_TRIES=50
DOC=docs/eviction.md
BEGIN_MARK="<!-- hitratio:begin -->"
END_MARK="<!-- hitratio:end -->"

while [ $# -gt 0 ]; do
    case "$1" in
        --memory-mib) MEMORY_MIB="$2"; shift 2 ;;
        --keys) KEYS="$2"; shift 2 ;;
        --ops) OPS="$2"; shift 2 ;;
        --value-size) VALUE_SIZE="$2"; shift 2 ;;
        --zipf) ZIPF="$2"; shift 2 ;;
        --seed) SEED="$2"; shift 2 ;;
        --warmup) WARMUP="$2"; shift 2 ;;
        --server-threads) SERVER_THREADS="$2"; shift 2 ;;
        --stores) STORES="$2"; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
        *) echo "hitratio.sh: unknown flag $1" >&2; exit 2 ;;
    esac
done
for n in "$MEMORY_MIB" "$KEYS" "$OPS" "$VALUE_SIZE" "$SEED" "$SERVER_THREADS" ${WARMUP:+"$WARMUP"}; do
    [[ "$n" =~ ^[0-9]+$ ]] || { echo "hitratio.sh: not a number: $n" >&2; exit 2; }
done
for s in $STORES; do
    case "$s" in
        memcached|dmkv-memcached|dmkv-rpc|dmkv-onesided) ;;
        *) echo "hitratio.sh: unknown store $s (memcached, dmkv-memcached, dmkv-rpc, dmkv-onesided)" >&2; exit 2 ;;
    esac
done

log() { echo "== $*" >&2; }

if ! command -v memcached >/dev/null; then
    [ "$INSTALL" = 1 ] || { echo "hitratio.sh: memcached missing (and --no-install)" >&2; exit 2; }
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    log "installing memcached"
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y memcached
fi

log "building (release)"
cargo build --release -p dmkv-server -p dmkv-benches --bin dmkvd --bin dmkv-hitratio
BIN="${CARGO_TARGET_DIR:-target}/release"

# Fail before any run, not after memcached's: an unattended run should
# not spend its time on half a table.
if [[ " $STORES " == *" dmkv"* ]]; then
    help="$("$BIN/dmkvd" --help)"
    for flag in --evict --memcached-listen; do
        if ! grep -q -- "$flag" <<< "$help"; then
            echo "hitratio.sh: this dmkvd has no $flag, so dmkv cannot be measured yet;" \
                "build a dmkvd with eviction and the memcached port, or run with --stores memcached" >&2
            exit 2
        fi
    done
fi

STAMP="$(date -u +%Y%m%d-%H%M%S)"
RESULTS="benches/results/$STAMP-hitratio"
mkdir -p "$RESULTS"
COMMANDS="$RESULTS/commands.txt"
: > "$COMMANDS"

# shellcheck source=benches/lib.sh
source benches/lib.sh

# Starts a fresh store; sets ADDR (the address dmkv-hitratio talks to) and SERVER_PID.
start_store() {
    local store="$1" field=rpc
    # memcached gets no extra flags here (one connection).
    # shellcheck disable=SC2119
    case "$store" in
        memcached) start_memcached ;;
        dmkv-*)
            [ "$store" = dmkv-memcached ] && field=memcached
            start_dmkvd "$field" "$store.dmkvd" --listen 127.0.0.1:0 --memcached-listen 127.0.0.1:0 \
                --threads "$SERVER_THREADS" --memory "${MEMORY_MIB}MiB" --evict lru --log warn
            ;;
    esac
}


declare -A RATIO
for store in $STORES; do
    log "$store"
    start_store "$store"
    args=(--server "$ADDR" --label "$store" --keys "$KEYS" --ops "$OPS" --value-size "$VALUE_SIZE"
        --zipf "$ZIPF" --seed "$SEED" ${WARMUP:+--warmup "$WARMUP"} --json "$RESULTS/$store.json")
    case "$store" in
        memcached|dmkv-memcached) args=(--backend memcached "${args[@]}") ;;
        dmkv-rpc) args=(--backend dmkv --path rpc "${args[@]}") ;;
        dmkv-onesided) args=(--backend dmkv --path one-sided "${args[@]}") ;;
    esac
    record "$BIN/dmkv-hitratio" "${args[@]}"
    "$BIN/dmkv-hitratio" "${args[@]}" | tee "$RESULTS/$store.txt"
    RATIO[$store]="$(sed -n 's/^hit ratio \([0-9.]*\) %.*/\1/p' "$RESULTS/$store.txt")"
    [ -n "${RATIO[$store]}" ] || { echo "hitratio.sh: no hit ratio in $RESULTS/$store.txt" >&2; exit 1; }
    stop_store
done

cpu="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
section="$RESULTS/section.md"
{
    echo "$BEGIN_MARK"
    echo
    echo "## Results: hit ratio at equal memory"
    echo
    echo "Generated by \`benches/hitratio.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC') from commit"
    echo "\`$(git rev-parse --short HEAD)\`; machine: $(nproc) cores, $cpu, $(uname -sr); $(memcached --version)."
    echo "One cache-aside trace for every store (GET; on a miss, SET): scrambled zipfian $ZIPF, seed $SEED;"
    echo "hits / GETs after the warm-up (${WARMUP:-ops / 5} operations). Each store starts empty."
    echo
    echo "| store | memory | keys | value size | ops | hit ratio | vs memcached |"
    echo "|---|---:|---:|---:|---:|---:|---:|"
    for store in $STORES; do
        diff="–"
        if [ -n "${RATIO[memcached]:-}" ] && [ "$store" != memcached ]; then
            diff="$(awk -v a="${RATIO[$store]}" -v b="${RATIO[memcached]}" 'BEGIN { printf "%+.2f pp", a - b }')"
        fi
        echo "| $store | $MEMORY_MIB MiB | $KEYS | $VALUE_SIZE B | $OPS | ${RATIO[$store]} % | $diff |"
    done
    echo
    echo '```sh'
    echo "$INVOCATION"
    echo "# which ran:"
    cat "$COMMANDS"
    echo '```'
    echo
    echo "$END_MARK"
} > "$section"

# Replace what lies between the markers (markers included); the rest of
# the page is written by hand.
if [ ! -f "$DOC" ]; then
    printf '# Eviction\n\n%s\n%s\n' "$BEGIN_MARK" "$END_MARK" > "$DOC"
fi
if ! grep -qxF "$BEGIN_MARK" "$DOC" || ! grep -qxF "$END_MARK" "$DOC"; then
    echo "hitratio.sh: $DOC lacks the markers $BEGIN_MARK and $END_MARK (each on a line of its own)" >&2
    exit 1
fi
awk -v begin="$BEGIN_MARK" -v end="$END_MARK" -v section="$section" '
    $0 == begin { while ((getline line < section) > 0) print line; skip = 1; next }
    $0 == end { skip = 0; next }
    !skip { print }
' "$DOC" > "$RESULTS/eviction.md"
cp "$RESULTS/eviction.md" "$DOC"
log "wrote the results section of $DOC"

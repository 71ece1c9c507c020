#!/usr/bin/env bash
# Fuzzes each target for a bounded time, one afl-fuzz at a time, then
# minimizes what it found into corpus/<target>/ (replayed by `cargo test`).
#
# Needs cargo-afl (`cargo install cargo-afl`; its first run builds AFL++).
# Usage: fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]
# AFL_OUT sets where afl-fuzz writes (default: target/afl-out under CARGO_TARGET_DIR or fuzz/).
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(frame_request frame_response proto_request proto_response engine_request engine_reply
        engine_next_frame item region_header read_lookup shm_handoff)
fi
tgt=${CARGO_TARGET_DIR:-target}
out=${AFL_OUT:-$tgt/afl-out}
cargo afl build --release
# cargo-afl's afl-cmin calls afl-showmap from PATH: put cargo-afl's own
# AFL++ first, or a distribution's older one is run with flags it lacks.
afl_bin=$(ls -d "${XDG_DATA_HOME:-$HOME/.local/share}"/afl.rs/rustc-*/afl.rs-*/afl/bin 2>/dev/null | tail -1 || true)
[ -n "$afl_bin" ] && export PATH="$afl_bin:$PATH"
export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 AFL_NO_AFFINITY=1
for t in "${targets[@]}"; do
    rm -rf "$out/$t" "$out/$t-min"
    mkdir -p "$out"
    cargo afl fuzz -i "corpus/$t" -o "$out/$t" -V "$secs" "$tgt/release/$t" > "$out/$t.log" 2>&1
    stats="$out/$t/default/fuzzer_stats"
    echo "$t: $(grep -E '^(execs_done|saved_crashes|saved_hangs|corpus_count)' "$stats" | tr -s ' ' | tr '\n' ' ')"
    # The shell afl-cmin: cargo-afl's default (Python) one found no tuples here.
    if [ -x "$afl_bin/afl-cmin.bash" ]; then
        "$afl_bin/afl-cmin.bash" -i "$out/$t/default/queue" -o "$out/$t-min" -- "$tgt/release/$t" > "$out/$t-cmin.log" 2>&1
    else
        cargo afl cmin -i "$out/$t/default/queue" -o "$out/$t-min" -- "$tgt/release/$t" > "$out/$t-cmin.log" 2>&1
    fi
    if ! ls "$out/$t-min"/* > /dev/null 2>&1; then
        echo "$t: minimization kept nothing; corpus left as it was (see $out/$t-cmin.log)" >&2
        continue
    fi
    rm -rf "corpus/$t"
    mkdir -p "corpus/$t"
    # Named by content, so re-runs keep what they share.
    for f in "$out/$t-min"/*; do
        cp "$f" "corpus/$t/$(sha1sum < "$f" | cut -c1-16)"
    done
done

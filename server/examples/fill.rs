//! Fills a store in process with values of one size until PUTs are
//! refused, and reports when and why: the measurement behind "items stored
//! at the first refusal" (index slots vs memory).
//!
//! ```sh
//! cargo run --release -p dmkv-server --example fill -- 64MiB 16
//! ```

use std::sync::Arc;
use std::time::Duration;

use dmkv_common::error::Error;
use dmkv_common::limits::UNIT;
use dmkv_server::config::DEFAULT_BYTES_PER_BUCKET;
use dmkv_server::region::Region;
use dmkv_server::store::Store;

/// Refusals in a row after which the store counts as full.
const GIVE_UP_AFTER: u32 = 10_000;

fn parse_size(s: &str) -> usize {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: usize = n.parse().expect("a size such as 64MiB");
    n * match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => panic!("unknown unit {other}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let memory = parse_size(args.get(1).map_or("64MiB", String::as_str));
    let value_len: usize = args.get(2).map_or(16, |s| s.parse().expect("value size in bytes"));
    let buckets = (memory as u64 / DEFAULT_BYTES_PER_BUCKET).next_power_of_two();
    let region = Arc::new(Region::create("fill", memory).expect("region"));
    let s = Store::format(region, buckets, 0x5EED, 1, Duration::ZERO).expect("format");
    let data = s.header().data_len;
    let index_bytes = || s.counters.index_bytes.load(std::sync::atomic::Ordering::Relaxed);
    let value = vec![7u8; value_len];
    let (mut stored, mut first, mut refused_in_a_row, mut i) = (0u64, None, 0u32, 0u64);
    let mut last_err = None;
    while refused_in_a_row < GIVE_UP_AFTER {
        match s.put(format!("user{i:012}").as_bytes(), &value) {
            Ok(_) => {
                stored += 1;
                refused_in_a_row = 0;
            }
            Err(e @ (Error::IndexFull | Error::OutOfMemory)) => {
                refused_in_a_row += 1;
                if first.is_none() {
                    let used = s.space().used * UNIT as u64;
                    first = Some((i, stored, e.clone(), used, s.index_stats(), index_bytes()));
                }
                last_err = Some(e);
            }
            Err(e) => panic!("{e}"),
        }
        i += 1;
    }
    let used = s.space().used * UNIT as u64;
    let pct = |a: u64, b: u64| a as f64 * 100.0 / b as f64;
    println!("region {memory} B, {buckets} buckets to start, data area {data} B, values of {value_len} B");
    if let Some((put, items, e, used_then, ix, ib)) = first {
        println!(
            "first refusal at put #{put} ({e}): {items} items, {:.1} % of {} slots in {} segments ({} splits), \
             {:.1} % of the data area used ({:.1} % by the index)",
            pct(items, ix.slots),
            ix.slots,
            ix.segments,
            ix.splits,
            pct(used_then, data),
            pct(ib, data)
        );
    }
    let ix = s.index_stats();
    println!(
        "full after {i} puts ({} refused in a row, last: {}): {stored} items, {:.1} % of {} slots, \
         {:.1} % of the data area used ({:.1} % by the index)",
        GIVE_UP_AFTER,
        last_err.map_or("-".into(), |e| e.to_string()),
        pct(stored, ix.slots),
        ix.slots,
        pct(used, data),
        pct(index_bytes(), data)
    );
}

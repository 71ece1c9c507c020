//! STATS entries of a node's stores and compactors.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::compact::Compactor;
use crate::store::Store;

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// Several stores' counters as one: sums, except depths and ratios, which
/// do not add up (the largest of them).
pub fn summed<'a>(stores: impl Iterator<Item = &'a Store>) -> Vec<(String, u64)> {
    let mut out: BTreeMap<&'static str, u64> = BTreeMap::new();
    for store in stores {
        for (k, v) in store_stats(store) {
            let e = out.entry(k).or_default();
            *e = if k.ends_with("_permille") || k.ends_with("_depth") { (*e).max(v) } else { *e + v };
        }
    }
    out.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Compactor threads' counters: CPU time and demands summed, `active` 1
/// while any of them empties a window.
pub fn compactor_stats<'a>(compactors: impl IntoIterator<Item = &'a Compactor>) -> Vec<(String, u64)> {
    let (mut active, mut demands, mut cpu_nanos) = (0, 0, 0);
    for c in compactors {
        let s = c.stats();
        active = active.max(load(&s.active));
        demands += load(&s.demands);
        cpu_nanos += load(&s.cpu_nanos);
    }
    vec![
        ("compactor_active".into(), active),
        ("compactor_demands".into(), demands),
        ("compactor_cpu_micros".into(), cpu_nanos / 1000),
    ]
}

/// One store's counters.
pub fn store_stats(s: &Store) -> Vec<(&'static str, u64)> {
    let c = &s.counters;
    let space = s.space();
    let unit = dmkv_common::limits::UNIT as u64;
    let index = s.index_stats();
    vec![
        ("gets", load(&c.gets)),
        ("get_hits", load(&c.get_hits)),
        ("get_expired", load(&c.get_expired)),
        ("evictions", load(&c.evictions)),
        ("evicted_for_room", load(&c.evicted_for_room)),
        ("puts", load(&c.puts)),
        ("deletes", load(&c.deletes)),
        ("items", load(&c.items)),
        ("out_of_memory_errors", load(&c.out_of_memory)),
        ("index_full_errors", load(&c.index_full)),
        ("corrupt_reads", load(&c.corrupt_reads)),
        ("foreign_slots", load(&c.foreign_slots)),
        ("live_bytes", load(&c.used_bytes)),
        ("allocated_bytes", space.used * unit),
        ("data_bytes", s.header().data_len),
        ("free_bytes", (space.free + space.parked) * unit),
        ("largest_free_bytes", space.largest_free * unit),
        ("fragmentation_permille", space.fragmentation_permille()),
        ("compactor_moves", load(&c.compactor_moves)),
        ("compactor_moved_bytes", load(&c.compactor_moved_bytes)),
        ("compactor_windows", load(&c.compactor_ranges)),
        ("compactor_windows_done", load(&c.compactor_ranges_done)),
        ("compactor_windows_abandoned", load(&c.compactor_ranges_abandoned)),
        ("region_bytes", s.header().region_len),
        ("index_slots", index.slots),
        ("index_segments", index.segments),
        ("index_splits", index.splits),
        ("index_bytes", load(&c.index_bytes)),
        ("index_load_permille", (load(&c.items) * 1000).checked_div(index.slots).unwrap_or(0)),
        ("index_depth", index.max_depth),
        ("directory_depth", index.dir_depth),
    ]
}

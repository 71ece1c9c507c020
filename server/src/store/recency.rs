//! Last-access stamps for eviction (`--evict lru`): one per unit of the
//! data area.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

/// Last-access stamps, one per unit of the data area.
pub struct Recency {
    start: Instant,
    first_unit: u64,
    stamps: Box<[AtomicU32]>,
}

impl Recency {
    pub(super) fn new(units: std::ops::Range<u64>) -> Recency {
        let n = (units.end - units.start) as usize;
        Recency { start: Instant::now(), first_unit: units.start, stamps: (0..n).map(|_| AtomicU32::new(0)).collect() }
    }

    pub(super) fn now(&self) -> u32 {
        (self.start.elapsed().as_millis() as u32).wrapping_add(1).max(1)
    }

    /// Stamps the item at `unit` as used now; units outside the data area
    /// (a report can name anything) are ignored.
    pub(super) fn stamp(&self, unit: u64) {
        if let Some(s) = unit.checked_sub(self.first_unit).and_then(|i| self.stamps.get(i as usize)) {
            s.store(self.now(), Ordering::Relaxed);
        }
    }

    /// Gives the item at `to` the stamp of the one at `from`.
    pub(super) fn copy(&self, from: u64, to: u64) {
        let at = |u: u64| u.checked_sub(self.first_unit).and_then(|i| self.stamps.get(i as usize));
        if let (Some(f), Some(t)) = (at(from), at(to)) {
            t.store(f.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// How long ago the item at `unit` was used (never: the longest).
    pub(super) fn age(&self, unit: u64, now: u32) -> u32 {
        match unit.checked_sub(self.first_unit).and_then(|i| self.stamps.get(i as usize)) {
            Some(s) => match s.load(Ordering::Relaxed) {
                0 => u32::MAX,
                t => now.wrapping_sub(t),
            },
            None => u32::MAX,
        }
    }
}

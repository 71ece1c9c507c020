//! The client's copy of a server's index directory: filled an entry at a
//! time as keys need them, and corrected an entry at a time when a bucket
//! header says an entry is stale (the segment it names split). Shared by
//! all of a path's callers without a lock: each entry is one word.

use std::sync::atomic::{AtomicU64, Ordering};

use dmkv_common::layout::{DirEntry, KeyHash};

/// Most entries cached per server (8 bytes each: 32 MiB). A deeper
/// directory shares cache entries between directory indexes that agree in
/// their low bits, which name the same segment unless it is deeper than
/// this; a wrong one is caught by the bucket headers like a stale one.
pub const MAX_CACHED_DEPTH: u64 = 22;

/// Directory entries by index (zero: not cached).
pub struct DirCache {
    depth: u64,
    entries: Box<[AtomicU64]>,
}

impl DirCache {
    /// An empty cache for a directory of depth `dir_depth`.
    pub fn new(dir_depth: u64) -> DirCache {
        let depth = dir_depth.min(MAX_CACHED_DEPTH);
        DirCache { depth, entries: (0..1u64 << depth).map(|_| AtomicU64::new(0)).collect() }
    }

    fn at(&self, kh: &KeyHash) -> &AtomicU64 {
        &self.entries[kh.dir_index(self.depth) as usize]
    }

    /// Asks the CPU for the cache line of `kh`'s entry (see
    /// [`dmkv_common::racy::prefetch`]).
    pub fn prefetch(&self, kh: &KeyHash) {
        dmkv_common::racy::prefetch(std::ptr::from_ref(self.at(kh)).cast::<u8>(), 8);
    }

    /// The cached entry for `kh`'s segment, if any.
    pub fn get(&self, kh: &KeyHash) -> Option<DirEntry> {
        DirEntry::unpack(self.at(kh).load(Ordering::Relaxed))
    }

    /// Caches `e` as `kh`'s entry.
    pub fn put(&self, kh: &KeyHash, e: DirEntry) {
        self.at(kh).store(e.pack(), Ordering::Relaxed);
    }

    /// Caches `e` for every directory index a segment of `depth` with
    /// `suffix` serves (as its bucket headers said), so its other keys need
    /// no directory read. Over a client's life these fills cost one store
    /// per cached index and split, whatever the order of discovery.
    pub fn learn(&self, e: DirEntry, depth: u8, suffix: u32) {
        let depth = u64::from(depth).min(self.depth);
        let step = 1usize << depth;
        let first = (u64::from(suffix) & ((1 << depth) - 1)) as usize;
        let v = e.pack();
        for slot in self.entries.iter().skip(first).step_by(step) {
            slot.store(v, Ordering::Relaxed);
        }
    }

    /// Forgets `kh`'s entry if it is still `stale` (another caller may have
    /// refreshed it meanwhile).
    pub fn forget(&self, kh: &KeyHash, stale: DirEntry) {
        let _ = self.at(kh).compare_exchange(stale.pack(), 0, Ordering::Relaxed, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_common::layout::key_hash;

    #[test]
    fn entries_are_cached_and_forgotten_only_if_unchanged() {
        let c = DirCache::new(10);
        let kh = key_hash(b"k", 1);
        assert_eq!(c.get(&kh), None);
        let (a, b) = (DirEntry { offset_units: 100, tag: 1 }, DirEntry { offset_units: 200, tag: 2 });
        c.put(&kh, a);
        assert_eq!(c.get(&kh), Some(a));
        c.put(&kh, b);
        c.forget(&kh, a);
        assert_eq!(c.get(&kh), Some(b), "a newer entry is kept");
        c.forget(&kh, b);
        assert_eq!(c.get(&kh), None);
        // What a segment's headers say fills every index it serves.
        let c = DirCache::new(4);
        c.learn(a, 2, 0b01);
        let filled: Vec<usize> = (0..16).filter(|&i| c.entries[i].load(Ordering::Relaxed) != 0).collect();
        assert_eq!(filled, [1, 5, 9, 13]);
        // Deep directories share cache entries, boundedly.
        assert_eq!(DirCache::new(30).entries.len(), 1 << MAX_CACHED_DEPTH);
    }
}

//! Eviction (`--evict lru`): when memory runs short, the least recently
//! used of a random sample of items goes, as Redis's approximated LRU
//! does. The server sees its own reads and writes; one-sided reads it
//! cannot see, so clients report the items they read in batches
//! (`ACCESS_REPORT`), and a report only ever moves an item's recency.
//!
//! Recency is one 32-bit stamp per unit of the data area, kept in the
//! server's private memory (4 bytes per 64: 6.25 % of the region, only
//! when eviction is on): the time of the last access to the item that
//! starts at that unit, in milliseconds since the store started (plus
//! one; 0: never accessed). Stamps wrap after 49 days; ages are compared
//! with wrapping arithmetic, so only an item idle for 49 days looks young.
//!
//! Evicted items are unlinked and retired as any overwritten item is, so
//! a one-sided reader that saw one keeps finding its bytes intact for the
//! grace period. That delay is why eviction runs ahead of need: a
//! background pass keeps [`Store::evict_to_headroom`]'s headroom of the
//! data area free or retiring, so writes rarely wait for space.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crossbeam_epoch as epoch;
use dmkv_common::layout::Slot;
use dmkv_common::limits::{SEGMENT_BUCKETS, SLOTS_PER_BUCKET};

use super::Store;
use super::recency::Recency;
use crate::lock::lock;

/// Items sampled for each eviction: the oldest of them goes. Redis finds
/// 10 close to true LRU; 16 is closer, and costs two bucket scans.
pub const EVICT_SAMPLES: usize = 16;
/// Most bucket draws one eviction makes to find its samples (a nearly
/// empty store has few items to find).
const MAX_DRAWS: usize = 64;
/// Most items evicted under one hold of the writer lock: writes wait no
/// longer than this many evictions.
pub const EVICT_BATCH: usize = 64;
/// How often the background pass checks the headroom.
pub const EVICT_INTERVAL: Duration = Duration::from_millis(5);
/// The headroom kept free or retiring: this share of the data area...
pub const HEADROOM_DIVISOR: u64 = 32;
/// ...but at least this many bytes (room for a maximum item and a split).
pub const MIN_HEADROOM: u64 = 2 << 20;
/// Most item offsets one access report may carry.
pub const MAX_ACCESS_REPORT: usize = 4096;

/// Most items one background pass evicts before it sleeps again.
pub const MAX_EVICTIONS_PER_PASS: usize = 4096;

/// Turns eviction on for `store` and starts its background pass, a thread
/// that keeps the headroom free every [`EVICT_INTERVAL`] and ends with the
/// store.
pub fn start(store: &std::sync::Arc<Store>) -> std::io::Result<()> {
    store.enable_eviction();
    let weak = std::sync::Arc::downgrade(store);
    std::thread::Builder::new().name("dmkv-evict".into()).spawn(move || {
        while let Some(store) = weak.upgrade() {
            store.evict_to_headroom(MAX_EVICTIONS_PER_PASS);
            drop(store);
            std::thread::sleep(EVICT_INTERVAL);
        }
    })?;
    Ok(())
}

/// xorshift64: the sampling needs spread, not quality.
fn next(rng: &mut u64) -> u64 {
    let mut x = *rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *rng = x;
    x
}

impl Store {
    /// Turns eviction on (once; before the store takes traffic, so every
    /// item written gets a stamp).
    pub fn enable_eviction(&self) {
        self.recency.get_or_init(|| Recency::new(self.data_units()));
    }

    /// Whether eviction is on.
    pub fn evicts(&self) -> bool {
        self.recency.get().is_some()
    }

    /// Turns eviction on for a cluster replica: recency kept, items
    /// removed only through the log ([`Store::plan_victims`]).
    pub fn enable_replicated_eviction(&self) {
        self.replicated_eviction.store(true, Ordering::Release);
        self.enable_eviction();
    }

    /// Whether this store removes items on its own when it runs short (a
    /// single node with eviction on).
    pub fn evicts_here(&self) -> bool {
        self.evicts() && !self.replicated_eviction.load(Ordering::Acquire)
    }

    /// Notes a read of the item at `unit` (the server's own, or one a
    /// client reported).
    pub(super) fn note_access(&self, unit: u64) {
        if let Some(r) = self.recency.get() {
            r.stamp(unit);
        }
    }

    /// Carries an item's recency to where the compactor moved it.
    pub(super) fn note_moved(&self, from: u64, to: u64) {
        if let Some(r) = self.recency.get() {
            r.copy(from, to);
        }
    }

    /// Notes a write of an item at `unit`: written is used.
    pub(super) fn note_write(&self, unit: u64, _units: usize) {
        self.note_access(unit);
    }

    /// Takes a client's report of items it read one-sidedly (item offsets
    /// in units; at most [`MAX_ACCESS_REPORT`] are looked at). Nothing but
    /// recency changes, whatever the report says.
    pub fn note_remote_accesses(&self, units: &[u64]) {
        if let Some(r) = self.recency.get() {
            for &u in units.iter().take(MAX_ACCESS_REPORT) {
                r.stamp(u);
            }
        }
    }

    /// Bytes of the data area that are neither live items nor index:
    /// free, or retired and coming back after the grace period.
    fn available_soon(&self) -> u64 {
        let c = &self.counters;
        let held = c.used_bytes.load(Ordering::Relaxed) + c.index_bytes.load(Ordering::Relaxed);
        self.header.data_len.saturating_sub(held)
    }

    /// The headroom eviction keeps.
    pub fn headroom(&self) -> u64 {
        (self.header.data_len / HEADROOM_DIVISOR).max(MIN_HEADROOM).min(self.header.data_len / 4)
    }

    /// Evicts until the headroom is free or retiring (at most `max_items`
    /// items); returns how many items went. Does nothing without eviction.
    pub fn evict_to_headroom(&self, max_items: usize) -> usize {
        let want = self.headroom();
        let mut evicted = 0;
        while evicted < max_items && self.available_soon() < want {
            let n = self.evict_some(EVICT_BATCH.min(max_items - evicted), want);
            if n == 0 {
                break;
            }
            evicted += n;
        }
        evicted
    }

    /// For a write that found no room for `bytes`: evicts until that much
    /// (and the headroom) is free or retiring; returns how many items
    /// went. Space already retiring is waited for, not added to: under a
    /// burst that outruns reclamation the cache must not shrink.
    pub fn evict_bytes(&self, bytes: u64) -> usize {
        let target = self.headroom().max(bytes);
        let mut evicted = 0;
        while self.available_soon() < target {
            let n = self.evict_some(EVICT_BATCH, target);
            if n == 0 {
                break;
            }
            evicted += n;
        }
        evicted
    }

    /// For a cluster shard's leader, which does not remove items itself
    /// (every replica must remove the same ones, through the log): the
    /// least recently used items, sampled as [`Store::evict_to_headroom`]
    /// samples them, whose bytes come to `bytes`, at most `max` of them,
    /// as (key, version). Nothing changes here.
    pub fn plan_victims(&self, max: usize, bytes: u64) -> Vec<(Vec<u8>, u64)> {
        let Some(rec) = self.recency.get() else { return Vec::new() };
        // Items are read after the writer lock is let go (a plan of
        // large items copies megabytes): under the epoch guard, as a GET
        // reads, so a victim's block is not reused meanwhile. One replaced
        // or removed since is named with its old version, which the
        // log's removal then does not match.
        let _guard = epoch::pin();
        let mut w = lock(&self.writer);
        let segments = w.index.meta.len() as u64;
        let (mut slots, mut chosen, mut freed) = (Vec::new(), std::collections::HashSet::new(), 0u64);
        while segments > 0 && slots.len() < max && freed < bytes {
            let now = rec.now();
            let mut oldest: Option<(u32, Slot)> = None;
            let mut seen = 0;
            for _ in 0..MAX_DRAWS {
                if seen >= EVICT_SAMPLES {
                    break;
                }
                let r = next(&mut w.rng);
                let seg = self.index.seg((r % segments) as u32);
                if !seg.live.load(Ordering::Acquire) {
                    continue;
                }
                let b = ((r >> 32) % SEGMENT_BUCKETS as u64) as usize;
                for i in 0..SLOTS_PER_BUCKET {
                    let Some(slot) = Slot::unpack(seg.slot(b, i)) else { continue };
                    if chosen.contains(&slot.offset_units) {
                        continue;
                    }
                    seen += 1;
                    let age = rec.age(slot.offset_units, now);
                    if oldest.is_none_or(|(a, _)| age > a) {
                        oldest = Some((age, slot));
                    }
                }
            }
            let Some((_, slot)) = oldest else { break };
            chosen.insert(slot.offset_units);
            freed += slot.len() as u64;
            slots.push(slot);
        }
        drop(w);
        // A slot whose item does not read back (damaged) is no victim to
        // name; its bytes still counted, so the plan ends.
        let mut buf = Vec::new();
        let mut out = Vec::with_capacity(slots.len());
        for slot in slots {
            if self.read_verified(slot, &mut buf)
                && let Ok(it) = dmkv_common::layout::decode_item(&buf)
            {
                out.push((it.key.to_vec(), it.version));
            }
        }
        out
    }

    /// Up to `max` evictions under one hold of the writer lock, stopping
    /// once `target` bytes are available soon.
    fn evict_some(&self, max: usize, target: u64) -> usize {
        let Some(rec) = self.recency.get() else { return 0 };
        let guard = epoch::pin();
        let mut w = lock(&self.writer);
        let segments = w.index.meta.len() as u64;
        if segments == 0 {
            return 0;
        }
        let mut evicted = 0;
        while evicted < max && self.available_soon() < target {
            let now = rec.now();
            // (age, segment, bucket, slot index, slot)
            let mut oldest: Option<(u32, u32, usize, usize, Slot)> = None;
            let mut seen = 0;
            for _ in 0..MAX_DRAWS {
                if seen >= EVICT_SAMPLES {
                    break;
                }
                let r = next(&mut w.rng);
                let id = (r % segments) as u32;
                let seg = self.index.seg(id);
                if !seg.live.load(Ordering::Acquire) {
                    continue;
                }
                let b = ((r >> 32) % SEGMENT_BUCKETS as u64) as usize;
                for i in 0..SLOTS_PER_BUCKET {
                    let Some(slot) = Slot::unpack(seg.slot(b, i)) else { continue };
                    seen += 1;
                    let age = rec.age(slot.offset_units, now);
                    if oldest.is_none_or(|(a, ..)| age > a) {
                        oldest = Some((age, id, b, i, slot));
                    }
                }
            }
            let Some((_, id, b, i, slot)) = oldest else { break };
            let seg = self.index.seg(id);
            self.set_slot(seg, b, i, Slot::EMPTY);
            self.counters.items.fetch_sub(1, Ordering::Relaxed);
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            self.retire(slot, &guard);
            evicted += 1;
        }
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use crate::store::item::Write;
    use std::sync::Arc;

    fn slot_bytes(s: &Slot) -> u64 {
        u64::from(s.units) * dmkv_common::limits::UNIT as u64
    }

    const NOW: u64 = 1_800_000_000_000;

    fn store(mib: usize) -> Store {
        let s =
            Store::format(Arc::new(Region::create("evict", mib << 20).unwrap()), 1024, 7, 1, Duration::ZERO).unwrap();
        s.enable_eviction();
        s
    }

    /// A store kept full by eviction takes every write, and keeps the
    /// items read most recently rather than those written long ago.
    #[test]
    fn a_full_store_evicts_the_least_recently_used() {
        let s = store(8);
        let value = [7u8; 1000];
        // A hot set, read after every write, and a stream of cold keys.
        let hot: Vec<String> = (0..200).map(|i| format!("hot{i}")).collect();
        for k in &hot {
            s.write(k.as_bytes(), &Write::set(&value), NOW).unwrap();
        }
        for i in 0..40_000u32 {
            loop {
                match s.write(format!("cold{i}").as_bytes(), &Write::set(&value), NOW) {
                    Ok(_) => break,
                    Err(dmkv_common::Error::OutOfMemory) => {
                        s.evict_bytes(64 << 10);
                        s.reclaim_wait();
                        std::thread::yield_now();
                    }
                    Err(e) => panic!("cold{i}: {e}"),
                }
            }
            s.evict_to_headroom(usize::MAX);
            let k = &hot[i as usize % hot.len()];
            s.get_item(k.as_bytes(), NOW).unwrap();
        }
        assert!(s.counters.evictions.load(Ordering::Relaxed) > 10_000);
        let kept = hot.iter().filter(|k| s.get_item(k.as_bytes(), NOW).unwrap().is_some()).count();
        let corrupt = s.counters.corrupt_reads.load(Ordering::Relaxed);
        assert!(
            kept >= 190,
            "only {kept} of 200 hot keys survived; corrupt {corrupt} evictions {}",
            s.counters.evictions.load(Ordering::Relaxed)
        );
        assert!(s.available_soon() >= s.headroom() - slot_bytes(&Slot::new(0, 64, 16)));
    }

    #[test]
    fn reports_move_recency_and_bogus_ones_change_nothing_else() {
        let s = store(8);
        s.write(b"k", &Write::set(b"v"), NOW).unwrap();
        s.note_remote_accesses(&[0, u64::MAX, 1 << 40]);
        let (_, at) = s.get_item(b"k", NOW).unwrap().unwrap();
        let unit = Slot::unpack(at.slot).unwrap().offset_units;
        s.note_remote_accesses(&[unit]);
        let rec = s.recency.get().unwrap();
        assert!(rec.age(unit, rec.now()) < 1000);
        assert_eq!(rec.age(0, rec.now()), u32::MAX);
        assert_eq!(s.get_item(b"k", NOW).unwrap().unwrap().0.value, bytes::Bytes::from_static(b"v"));
    }
}

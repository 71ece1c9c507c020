//! The store's work on its index ([`super::index`]): publishing slots and
//! directory entries (in the region and in the server's copy), laying out
//! and splitting segments (the steps are in the index's comment), audits,
//! and reclaiming retired segments. Kept apart from the index's types so
//! that the store, which holds an index, and this code, which works on a
//! store, do not name each other.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use crossbeam_epoch as epoch;
use dmkv_common::error::Error;
use dmkv_common::layout::{self, BucketHeader, DirEntry, KeyHash, SEGMENT_UNITS, Slot, key_hash};
use dmkv_common::limits::{MAX_KEY_LEN, SEGMENT_BUCKETS, SLOTS_PER_BUCKET, UNIT, WORDS_PER_BUCKET};
use tracing::debug;

use super::index::*;
use super::{Store, Writer};
use crate::lock::lock;

impl Store {
    fn store_word(&self, seg: &Seg, b: usize, w: usize, v: u64) {
        self.region.store_slot(seg.word_offset(b, w), v);
        seg.words[b * WORDS_PER_BUCKET + w].store(v, Ordering::Release);
    }

    /// Publishes `v` as slot `i` of bucket `b` of `seg`, in the region and
    /// in the server's copy. Writer only.
    pub(super) fn set_slot(&self, seg: &Seg, b: usize, i: usize, v: u64) {
        self.store_word(seg, b, i + 1, v);
    }

    /// Points directory entry `d` at segment `id`, in the region and in the
    /// server's copy. Writer only.
    fn set_dir(&self, d: u64, id: u32, entry: DirEntry) {
        self.region.store_slot(self.header.dir_entry_offset(d), entry.pack());
        self.index.dir[d as usize].store(id, Ordering::Release);
    }

    fn entry_of(&self, w: &Writer, id: u32) -> DirEntry {
        DirEntry { offset_units: self.index.seg(id).at, tag: w.index.meta[id as usize].tag }
    }

    /// A segment to fill: one retired past its grace period, else new
    /// space. Its slots are clear; its headers say nothing yet.
    fn take_segment(&self, w: &mut Writer) -> Result<u32, Error> {
        let id = match w.index.pool.pop() {
            Some(id) => id,
            None => {
                let id = w.index.meta.len();
                if id >= self.index.capacity {
                    return Err(Error::IndexFull);
                }
                let at = w.alloc.alloc(SEGMENT_UNITS).ok_or(Error::OutOfMemory)?;
                let seg = Seg {
                    at,
                    live: AtomicBool::new(false),
                    words: (0..SEGMENT_WORDS).map(|_| AtomicU64::new(0)).collect(),
                };
                self.index.create(id, seg);
                w.index.meta.push(SegMeta { depth: 0, suffix: 0, tag: 0 });
                self.counters.index_bytes.fetch_add((SEGMENT_UNITS * UNIT) as u64, Ordering::Relaxed);
                // Fresh space may hold an old item's bytes: clear it all
                // (no reader has an entry for it, so no order matters).
                self.region.write(at * UNIT as u64, &[0u8; SEGMENT_UNITS * UNIT]);
                return Ok(id as u32);
            }
        };
        // A pooled segment's words are its frozen old slots (its headers
        // are zero since it retired): clear all of it, in the region too
        // (whatever else may have been written there), before any header
        // says it serves keys again.
        let seg = self.index.seg(id);
        self.region.write(seg.at * UNIT as u64, &[0u8; SEGMENT_UNITS * UNIT]);
        for w in seg.words.iter() {
            w.store(0, Ordering::Release);
        }
        Ok(id)
    }

    /// Makes segment `id` serve (depth, suffix) under a new tag: writes its
    /// bucket headers. Its slots must be in place already.
    fn open_segment(&self, w: &mut Writer, id: u32, depth: u8, suffix: u32) {
        let tag = w.index.tag();
        w.index.meta[id as usize] = SegMeta { depth, suffix, tag };
        let seg = self.index.seg(id);
        let h = BucketHeader { depth, suffix, tag }.pack();
        for b in 0..SEGMENT_BUCKETS {
            self.store_word(seg, b, 0, h);
        }
        seg.live.store(true, Ordering::Release);
        w.index.live += 1;
        w.index.max_depth = w.index.max_depth.max(depth);
    }

    /// Lays out the first `n` segments (a power of two) and the directory.
    pub(super) fn format_index(&self, w: &mut Writer, n: u64) -> Result<(), Error> {
        let depth = n.trailing_zeros() as u8;
        let ids = (0..n).map(|_| self.take_segment(w)).collect::<Result<Vec<_>, _>>()?;
        for (suffix, &id) in ids.iter().enumerate() {
            self.open_segment(w, id, depth, suffix as u32);
        }
        for d in 0..self.header.dir_entries() {
            let id = ids[(d & (n - 1)) as usize];
            self.set_dir(d, id, self.entry_of(w, id));
        }
        Ok(())
    }

    /// Splits segment `id` in two (see the module's comment). On an error
    /// nothing changed.
    pub(super) fn split(&self, w: &mut Writer, id: u32, guard: &epoch::Guard) -> Result<(), Error> {
        let SegMeta { depth, suffix, .. } = w.index.meta[id as usize];
        if u64::from(depth) >= self.header.dir_depth {
            return Err(Error::IndexFull);
        }
        let first = self.take_segment(w)?;
        let second = match self.take_segment(w) {
            Ok(s) => s,
            Err(e) => {
                w.index.pool.push(first);
                return Err(e);
            }
        };
        let old = self.index.seg(id);
        let halves = [self.index.seg(first), self.index.seg(second)];
        let mut buf = Vec::new();
        for b in 0..SEGMENT_BUCKETS {
            for i in 0..SLOTS_PER_BUCKET {
                let word = old.slot(b, i);
                let Some(slot) = Slot::unpack(word) else { continue };
                // The key decides the half; an item whose header is not
                // sound, or whose key's fingerprint is not the slot's (the
                // region was written behind the server's back), is dropped
                // here as a write would drop it (`find_for_write`). It stays
                // in the frozen old segment; retired so its space comes back.
                match self.key_of(slot, &mut buf) {
                    Some(kh) if kh.fingerprint == slot.fingerprint => {
                        let half = (kh.dir_hash >> depth) & 1;
                        self.set_slot(halves[half as usize], b, i, word);
                    }
                    _ => {
                        self.counters.items.fetch_sub(1, Ordering::Relaxed);
                        self.retire(slot, guard);
                    }
                }
            }
        }
        self.open_segment(w, first, depth + 1, suffix);
        self.open_segment(w, second, depth + 1, suffix | 1 << depth);
        let entries = [self.entry_of(w, first), self.entry_of(w, second)];
        let step = 1u64 << depth;
        let mut d = u64::from(suffix);
        while d < self.header.dir_entries() {
            let half = ((d >> depth) & 1) as usize;
            self.set_dir(d, [first, second][half], entries[half]);
            d += step;
        }
        for b in 0..SEGMENT_BUCKETS {
            self.store_word(old, b, 0, 0);
        }
        old.live.store(false, Ordering::Release);
        w.index.live -= 1;
        w.index.splits += 1;
        self.counters.index_splits.fetch_add(1, Ordering::Relaxed);
        let done = std::sync::Arc::clone(&self.segs_done);
        let seq = self.retire_seq.fetch_add(1, Ordering::AcqRel);
        let at = Instant::now();
        guard.defer(move || lock(&done).push((id, at, seq)));
        // Into the collector's global queue now (splits are rare): left in
        // this thread's bag, the segment would wait for the thread's next
        // batch of retired blocks, which an insert-only load never makes.
        guard.flush();
        debug!(segment = id, depth, suffix, "index segment split");
        Ok(())
    }

    /// The key hash of the item of `slot`, reading only its header and key
    /// (a split reads every item of the segment under the writer lock, so
    /// not their values: at most 480 × 1 KiB). Writer only: items of its
    /// own index never change while linked. `None` if the header cannot
    /// be the slot's item.
    pub(super) fn key_of(&self, slot: Slot, buf: &mut Vec<u8>) -> Option<KeyHash> {
        buf.resize(layout::ITEM_HEADER_LEN, 0);
        self.region.try_read(slot.offset(), buf).ok()?;
        let key_len = u32::from_le_bytes(buf[16..20].try_into().expect("4 bytes")) as usize;
        if key_len == 0 || key_len > MAX_KEY_LEN || layout::ITEM_HEADER_LEN + key_len > slot.len() {
            return None;
        }
        buf.resize(key_len, 0);
        self.region.try_read(slot.offset() + layout::ITEM_HEADER_LEN as u64, buf).ok()?;
        Some(key_hash(buf, self.header.hash_seed))
    }

    /// Puts back directory entry `d` in the region if it differs from the
    /// server's (one-sided readers would otherwise fall back to RPC for
    /// every key of it). Writer only.
    pub(super) fn audit_dir(&self, w: &Writer, kh: &KeyHash) {
        let d = kh.dir_index(self.header.dir_depth);
        let id = self.index.dir[d as usize].load(Ordering::Acquire);
        let own = self.entry_of(w, id).pack();
        let off = self.header.dir_entry_offset(d);
        if self.region.load_slot(off) != own {
            self.counters.foreign_slots.fetch_add(1, Ordering::Relaxed);
            self.region.store_slot(off, own);
        }
    }

    /// Whether any segment lies in `range` (units). Writer only (segments
    /// are made under the writer lock).
    pub(super) fn segment_in(&self, range: &std::ops::Range<u64>) -> bool {
        self.index.all().any(|(_, s)| s.at < range.end && s.at + SEGMENT_UNITS as u64 > range.start)
    }

    /// Moves retired segments past their epoch and grace period to the
    /// pool. Writer only.
    pub(super) fn reclaim_segments(&self, w: &mut Writer, hold: u64) {
        {
            let mut done = lock(&self.segs_done);
            if !done.is_empty() {
                done.sort_by_key(|&(_, _, seq)| seq);
                w.index.waiting.extend(done.drain(..));
            }
        }
        // A view walks the segments of its directory, split or not.
        while let Some(&(id, since, seq)) = w.index.waiting.front() {
            if since.elapsed() < self.grace || seq >= hold {
                break;
            }
            w.index.pool.push(id);
            w.index.waiting.pop_front();
        }
    }

    /// Starts (in units) of every segment ever made, sorted: they never
    /// move, so compaction plans around them.
    pub fn segment_starts(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.index.all().map(|(_, s)| s.at).collect();
        v.sort_unstable();
        v
    }
}

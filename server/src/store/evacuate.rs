//! The store's side of compaction: emptying a range of the data area by
//! moving its live items into a block reserved for them, under the writer
//! lock, one item at a time. When to do it, and which range, is
//! `crate::compact`'s business.
//!
//! A move is an overwrite with the same item: the bytes are copied to a
//! new block outside the range, published with one release store of the
//! key's slot, and the old block is retired with the grace period like any
//! overwritten item. A one-sided reader that saw the old slot reads the old
//! copy, intact for the grace period; one that sees the new slot reads a
//! copy written before the slot was. Both carry the same version and value,
//! so a move is invisible to readers (docs/one-sided.md).

use std::ops::Range;
use std::sync::atomic::Ordering;

use crossbeam_epoch as epoch;
use dmkv_common::layout::Slot;
use dmkv_common::limits::{UNIT, WORDS_PER_BUCKET};

use super::index::Seg;
use super::relocation::{Candidate, Relocation};
use super::{Store, Writer};

/// Free blocks copied per hold of the writer lock (about 0.3 ms).
const FREE_BLOCKS_PER_LOCK: usize = 16_384;
/// Most scans for a range's items (a split during one repeats it).
const SCANS: usize = 4;
use crate::lock::lock;

impl Store {
    /// The allocator's free blocks (start, length in units) in address
    /// order, for planning which range to empty. Copied a piece at a time:
    /// a fragmented store has millions of them (2.4 M in 1 GiB of 100 B
    /// holes took 46 ms to copy), too long to hold up writes. So it is not
    /// one moment's picture, only sorted and without overlaps; plans are
    /// checked when carried out (the park and the reserve are exact).
    pub fn free_blocks(&self) -> Vec<(u64, u64)> {
        let mut all: Vec<(u64, u64)> = Vec::new();
        let mut from = 0;
        loop {
            let piece = lock(&self.writer).alloc.free_blocks_from(from, FREE_BLOCKS_PER_LOCK);
            let Some(&(at, len)) = piece.last() else { break };
            // Blocks merged meanwhile with one already copied start before
            // `from` and are skipped: no overlaps.
            from = at + len;
            let done = piece.len() < FREE_BLOCKS_PER_LOCK;
            all.extend(piece);
            if done {
                break;
            }
        }
        all
    }

    /// Starts emptying `range` (in units): from now on no allocation lands
    /// in it. Returns the live items overlapping it, to be moved with
    /// [`Store::relocate`], or `None` if another range is being emptied.
    /// The range comes back by itself once all of it is free.
    pub fn begin_evacuation(&self, range: Range<u64>) -> Option<Vec<Candidate>> {
        {
            let mut w = lock(&self.writer);
            // A segment made since the plan (they never move) would keep
            // the range from ever emptying.
            if w.alloc.parked().is_some() || self.segment_in(&range) {
                return None;
            }
            w.alloc.park(range.clone());
        }
        self.counters.compactor_ranges.fetch_add(1, Ordering::Relaxed);
        // Every item allocated in the range was published before the park
        // (under the lock just released), and none can be allocated there
        // since. Retired segments hold frozen copies of slots that live on
        // in their halves, so only live segments are scanned; a split
        // during the scan can hide a segment's items from it (listed in
        // neither the old segment nor its halves), so the scan is repeated
        // until no split ran during it, a few times at most.
        let mut found = Vec::new();
        for _ in 0..SCANS {
            let splits = self.counters.index_splits.load(Ordering::Acquire);
            found = self.scan(&range);
            if self.counters.index_splits.load(Ordering::Acquire) == splits {
                break;
            }
        }
        Some(found)
    }

    /// Every linked slot of the live segments: (segment, word position,
    /// word, slot). Retired segments hold frozen copies of slots that live
    /// on in their halves, so they are left out.
    pub(super) fn live_slots(&self) -> impl Iterator<Item = (u32, usize, u64, Slot)> + '_ {
        self.index.all().filter(|(_, seg)| seg.live.load(Ordering::Acquire)).flat_map(|(id, seg)| {
            seg.words()
                .filter(|(pos, _)| pos % WORDS_PER_BUCKET != 0)
                .filter_map(move |(pos, word)| Slot::unpack(word).map(|slot| (id, pos, word, slot)))
        })
    }

    /// The live items overlapping `range`, from the live segments.
    fn scan(&self, range: &Range<u64>) -> Vec<Candidate> {
        let mut found = Vec::new();
        for (id, pos, word, slot) in self.live_slots() {
            let end = slot.offset_units + u64::from(slot.units);
            if slot.offset_units < range.end && end > range.start {
                found.push(Candidate { seg: id, pos, word });
            }
        }
        found
    }

    /// Takes `units` units at the start of the largest free block, for
    /// [`Store::relocate`] to pack items into; where they start.
    pub fn reserve(&self, units: u64) -> Option<u64> {
        lock(&self.writer).alloc.alloc_largest(units)
    }

    /// Frees reserved units that no item was moved into. They were never
    /// published, so no reader can be looking at them: no grace period.
    pub fn unreserve(&self, at: u64, units: u64) {
        if units > 0 {
            lock(&self.writer).alloc.free(at, units as usize);
        }
    }

    /// Where a listed item's slot is now, if it is still the one listed:
    /// (segment, bucket, slot index, slot).
    fn find_listed<'s>(&'s self, w: &mut Writer, c: &Candidate) -> Option<(&'s Seg, usize, usize, Slot)> {
        let (bucket, i) = (c.pos / WORDS_PER_BUCKET, c.pos % WORDS_PER_BUCKET - 1);
        let old = Slot::unpack(c.word)?;
        let mut seg = self.index.seg(c.seg);
        if !seg.live.load(Ordering::Acquire) || seg.slot(bucket, i) != c.word {
            // The segment may have split since the listing (and its id been
            // reused): the slot, if still current, is at the same position
            // in the segment serving its key now.
            let mut probe = std::mem::take(&mut w.scratch);
            let kh = self.key_of(old, &mut probe);
            w.scratch = probe;
            seg = self.index.segment(&kh?).1;
        }
        (seg.slot(bucket, i) == c.word).then_some((seg, bucket, i, old))
    }

    /// Evicts one listed item of the parked range instead of moving it
    /// (`--evict lru`, when a write needs the range in one piece and there
    /// is no block to move its items into): unlinked and retired as any
    /// eviction, so the range still comes back after the grace period.
    pub fn evict_listed(&self, c: &Candidate) -> Relocation {
        let guard = epoch::pin();
        let mut w = lock(&self.writer);
        let Some((seg, bucket, i, old)) = self.find_listed(&mut w, c) else { return Relocation::Gone };
        self.set_slot(seg, bucket, i, Slot::EMPTY);
        self.counters.items.fetch_sub(1, Ordering::Relaxed);
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        self.counters.evicted_for_room.fetch_add(1, Ordering::Relaxed);
        self.retire(old, &guard);
        Relocation::Evicted
    }

    /// Moves one listed item out of the parked range into the reserved
    /// units at `to` (as many as the item has). On anything but `Moved`
    /// those units are still the caller's.
    pub fn relocate(&self, c: &Candidate, to: u64) -> Relocation {
        let guard = epoch::pin();
        let mut w = lock(&self.writer);
        let w = &mut *w;
        let Some((seg, bucket, i, old)) = self.find_listed(w, c) else { return Relocation::Gone };
        let mut buf = std::mem::take(&mut w.scratch);
        if !self.read_verified(old, &mut buf) {
            // Its value is lost either way (as in `find_for_write`); left
            // linked it would pin the range for good.
            self.set_slot(seg, bucket, i, Slot::EMPTY);
            self.counters.items.fetch_sub(1, Ordering::Relaxed);
            self.retire(old, &guard);
            w.scratch = buf;
            return Relocation::Gone;
        }
        debug_assert!(w.alloc.parked().is_none_or(|r| to + u64::from(old.units) <= r.start || r.end <= to));
        self.region.write(to * UNIT as u64, &buf);
        let new = Slot { offset_units: to, ..old };
        // A copy made after a view began: the view has the old one (in its
        // unlinked list once retired below), which may be older than this
        // one if a touch came between the view and the move.
        self.views.note_relinked(new);
        self.set_slot(seg, bucket, i, new.pack());
        // A move is no use: the item keeps its recency (eviction).
        self.note_moved(old.offset_units, to);
        let bytes = u64::from(old.units) * UNIT as u64;
        self.retire(old, &guard);
        // `retire` took the old copy's bytes off the live count; the new
        // copy holds the same.
        self.counters.used_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.counters.compactor_moves.fetch_add(1, Ordering::Relaxed);
        self.counters.compactor_moved_bytes.fetch_add(bytes, Ordering::Relaxed);
        w.scratch = buf;
        Relocation::Moved
    }

    /// The range being emptied, if any (it is over once all of it is free).
    pub fn evacuating(&self) -> Option<Range<u64>> {
        lock(&self.writer).alloc.parked()
    }

    /// Gives up on the range being emptied: its free space is handed out
    /// again, and what is still used there is freed as usual later.
    pub fn abandon_evacuation(&self) {
        let mut w = lock(&self.writer);
        if w.alloc.parked().is_some() {
            w.alloc.unpark();
            self.counters.compactor_ranges_abandoned.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Hands the store's batch of retired blocks to the epoch collector,
    /// flushes (a collection: the compactor's waits drive the epoch on in
    /// a store nobody writes to) and frees what has finished its grace
    /// period, so a range waiting for its last retired blocks can come back.
    pub fn reclaim_now(&self) {
        let guard = epoch::pin();
        let mut w = lock(&self.writer);
        self.hand_over(&guard);
        guard.flush();
        self.reclaim(&mut w, &guard);
    }
}

//! Allocator for the data area, in 64-byte units: best fit with
//! coalescing, plus a parked range the compactor is emptying.
//!
//! Pure bookkeeping (no memory access). Free space is a set of maximal
//! blocks kept twice: by address (to merge a freed block with its free
//! neighbours at once) and by (length, address) (to find the smallest block
//! that fits, lowest address first). A block is allocated in exactly the
//! units asked for, split off the front of the block that fits; the rest
//! stays free. So freed space of any size serves any later size once its
//! neighbours are free too, and a store that was emptied is one free block
//! again, whatever sizes it held. What coalescing cannot fix (live items
//! scattered between holes) the compactor (`crate::compact`) fixes by
//! moving items out of one range: while it does, that range is *parked*:
//! its free space is set aside and never handed out, so the range only
//! empties, and once all of it is free it returns as one block.
//!
//! The grace period is not this module's business: the store frees a block
//! only once its grace period has passed.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

/// Allocator state over a data area `[start, end)` measured in units.
#[derive(Debug)]
pub struct Allocator {
    start: u64,
    end: u64,
    /// Free blocks outside the parked range: start → length.
    by_addr: BTreeMap<u64, u64>,
    /// The same blocks as (length, start).
    by_len: BTreeSet<(u64, u64)>,
    /// Units in `by_addr`.
    free_units: u64,
    used_units: u64,
    parked: Option<Parked>,
}

/// A range being emptied: its free blocks are kept apart, not handed out.
#[derive(Debug)]
struct Parked {
    range: Range<u64>,
    /// Free blocks inside `range`, merged among themselves: start → length.
    free: BTreeMap<u64, u64>,
    free_units: u64,
}

impl Parked {
    fn add(&mut self, mut at: u64, mut len: u64) {
        self.free_units += len;
        if let Some((&prev, &plen)) = self.free.range(..at).next_back()
            && prev + plen == at
        {
            self.free.remove(&prev);
            at = prev;
            len += plen;
        }
        if let Some(nlen) = self.free.remove(&(at + len)) {
            len += nlen;
        }
        self.free.insert(at, len);
    }

    fn is_all_free(&self) -> bool {
        self.free_units == self.range.end - self.range.start
    }
}

/// Free-space figures, for STATS and the compactor's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Space {
    /// Units handed out and not yet freed (live items and retired ones
    /// waiting out their grace period).
    pub used: u64,
    /// Free units that can be handed out.
    pub free: u64,
    /// The largest block of `free`.
    pub largest_free: u64,
    /// Free units set aside in the parked range.
    pub parked: u64,
}

impl Space {
    /// How broken up free space is: 0 when it is one block, towards 1000
    /// when no block is more than a sliver of it. Parts per thousand.
    pub fn fragmentation_permille(&self) -> u64 {
        let free = self.free + self.parked;
        (self.largest_free * 1000).checked_div(free).map_or(0, |share| 1000 - share)
    }
}

impl Allocator {
    /// An allocator for units `start..end` (absolute unit offsets in the region).
    pub fn new(start: u64, end: u64) -> Self {
        assert!(start >= 1 && start <= end);
        let mut a = Allocator {
            start,
            end,
            by_addr: BTreeMap::new(),
            by_len: BTreeSet::new(),
            free_units: 0,
            used_units: 0,
            parked: None,
        };
        a.insert(start, end - start);
        a
    }

    /// The data area, in units.
    pub fn area(&self) -> Range<u64> {
        self.start..self.end
    }

    fn insert(&mut self, at: u64, len: u64) {
        if len == 0 {
            return;
        }
        self.by_addr.insert(at, len);
        self.by_len.insert((len, at));
        self.free_units += len;
    }

    fn remove(&mut self, at: u64, len: u64) {
        let was = self.by_addr.remove(&at);
        debug_assert_eq!(was, Some(len));
        self.by_len.remove(&(len, at));
        self.free_units -= len;
    }

    /// Allocates `units` units (at least one); returns the block's unit offset.
    pub fn alloc(&mut self, units: usize) -> Option<u64> {
        assert!(units >= 1, "empty allocation");
        let want = units as u64;
        let &(len, at) = self.by_len.range((want, 0)..).next()?;
        Some(self.take_front(at, len, want))
    }

    /// Hands out the first `units` of the free block `at`+`len`.
    fn take_front(&mut self, at: u64, len: u64, units: u64) -> u64 {
        self.remove(at, len);
        self.insert(at + units, len - units);
        self.used_units += units;
        debug_assert!(self.outside_parked(at..at + units));
        at
    }

    /// Allocates `units` units at the start of the largest free block, if
    /// it is that long: the compactor packs the items it moves there.
    pub fn alloc_largest(&mut self, units: u64) -> Option<u64> {
        let &(len, at) = self.by_len.last()?;
        (units > 0 && len >= units).then(|| self.take_front(at, len, units))
    }

    /// Returns the block of `units` units at `at`, merging it with its free
    /// neighbours. The part inside the parked range, if any, is set aside.
    pub fn free(&mut self, at: u64, units: usize) {
        let len = units as u64;
        assert!(at >= self.start && at + len <= self.end, "freeing {at}+{len} outside the data area");
        self.used_units -= len;
        let Some(p) = &mut self.parked else { return self.merge_in(at, len) };
        let (lo, hi) = (at.max(p.range.start), (at + len).min(p.range.end));
        if lo >= hi {
            return self.merge_in(at, len);
        }
        p.add(lo, hi - lo);
        let all_free = p.is_all_free();
        self.merge_in(at, lo - at);
        self.merge_in(hi, at + len - hi);
        if all_free {
            self.unpark();
        }
    }

    fn merge_in(&mut self, mut at: u64, mut len: u64) {
        if len == 0 {
            return;
        }
        if let Some((&prev, &plen)) = self.by_addr.range(..at).next_back() {
            debug_assert!(prev + plen <= at, "double free at {at}");
            if prev + plen == at {
                self.remove(prev, plen);
                at = prev;
                len += plen;
            }
        }
        if let Some(&nlen) = self.by_addr.get(&(at + len)) {
            self.remove(at + len, nlen);
            len += nlen;
        }
        self.insert(at, len);
    }

    fn outside_parked(&self, r: Range<u64>) -> bool {
        self.parked.as_ref().is_none_or(|p| r.end <= p.range.start || p.range.end <= r.start)
    }

    /// Sets `range` aside: its free space is no longer handed out, and
    /// space freed inside it later waits there until all of it is free;
    /// then it comes back as one block by itself. One range at a time.
    pub fn park(&mut self, range: Range<u64>) {
        assert!(self.parked.is_none(), "a range is parked already");
        assert!(self.start <= range.start && range.start < range.end && range.end <= self.end);
        let inside: Vec<(u64, u64)> = self
            .by_addr
            .range(..range.end)
            .rev()
            .take_while(|&(&at, &len)| at + len > range.start)
            .map(|(&at, &len)| (at, len))
            .collect();
        let mut p = Parked { range, free: BTreeMap::new(), free_units: 0 };
        for (at, len) in inside {
            self.remove(at, len);
            let (lo, hi) = (at.max(p.range.start), (at + len).min(p.range.end));
            p.add(lo, hi - lo);
            self.insert(at, lo - at);
            self.insert(hi, at + len - hi);
        }
        let whole = p.is_all_free();
        self.parked = Some(p);
        if whole {
            self.unpark();
        }
    }

    /// Ends the parking (the compactor is done with the range, or gives up
    /// on it): its free blocks can be handed out again, merged with their
    /// neighbours; blocks still used in it are freed as usual later.
    pub fn unpark(&mut self) {
        let Some(p) = self.parked.take() else { return };
        for (at, len) in p.free {
            self.merge_in(at, len);
        }
    }

    /// Up to `max` free blocks (start, length) that start at or after
    /// `from`, in address order, parked ones left out: what the compactor
    /// plans by, a piece at a time.
    pub fn free_blocks_from(&self, from: u64, max: usize) -> Vec<(u64, u64)> {
        self.by_addr.range(from..).take(max).map(|(&at, &len)| (at, len)).collect()
    }

    /// The parked range, if any.
    pub fn parked(&self) -> Option<Range<u64>> {
        self.parked.as_ref().map(|p| p.range.clone())
    }

    /// Free-space figures.
    pub fn space(&self) -> Space {
        Space {
            used: self.used_units,
            free: self.free_units,
            largest_free: self.by_len.last().map_or(0, |&(len, _)| len),
            parked: self.parked.as_ref().map_or(0, |p| p.free_units),
        }
    }

    /// Checks the books: every unit is free, parked-free or used, free
    /// blocks do not touch (they would have been merged) and stay outside
    /// the parked range. For tests; linear in the number of free blocks.
    pub fn check(&self) {
        let mut last_end = None;
        let mut sum = 0;
        for (&at, &len) in &self.by_addr {
            assert!(len > 0 && at >= self.start && at + len <= self.end);
            assert!(last_end.is_none_or(|e| e < at), "free blocks at {at} touch or overlap");
            assert!(self.by_len.contains(&(len, at)));
            assert!(self.outside_parked(at..at + len), "free block {at}+{len} in the parked range");
            last_end = Some(at + len);
            sum += len;
        }
        assert_eq!(self.by_len.len(), self.by_addr.len());
        assert_eq!(sum, self.free_units);
        let mut parked = 0;
        if let Some(p) = &self.parked {
            let mut last_end = None;
            for (&at, &len) in &p.free {
                assert!(len > 0 && p.range.start <= at && at + len <= p.range.end);
                assert!(last_end.is_none_or(|e| e < at), "parked blocks at {at} touch or overlap");
                last_end = Some(at + len);
                parked += len;
            }
            assert_eq!(parked, p.free_units);
        }
        assert_eq!(self.free_units + parked + self.used_units, self.end - self.start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn freed_neighbours_merge_and_serve_any_size() {
        let mut a = Allocator::new(10, 10 + 1000);
        let blocks: Vec<u64> = (0..500).map(|_| a.alloc(2).unwrap()).collect();
        assert_eq!(a.alloc(1), None);
        for (i, &b) in blocks.iter().enumerate() {
            if i % 2 == 0 {
                a.free(b, 2);
            }
        }
        // Half is free, in holes of 2: nothing larger fits.
        assert_eq!(a.space().free, 500);
        assert_eq!(a.alloc(3), None);
        for (i, &b) in blocks.iter().enumerate() {
            if i % 2 == 1 {
                a.free(b, 2);
            }
        }
        a.check();
        assert_eq!(a.space(), Space { used: 0, free: 1000, largest_free: 1000, parked: 0 });
        assert_eq!(a.alloc(1000), Some(10));
    }

    #[test]
    fn best_fit_keeps_large_blocks_for_large_items() {
        let mut a = Allocator::new(1, 101);
        let x = a.alloc(10).unwrap();
        let _y = a.alloc(1).unwrap();
        a.free(x, 10);
        // A hole of 10 and a tail of 89: a 5-unit item takes the hole.
        assert_eq!(a.alloc(5), Some(x));
        assert_eq!(a.space().largest_free, 89);
    }

    #[test]
    fn free_blocks_come_a_piece_at_a_time_in_address_order() {
        let mut a = Allocator::new(1, 101);
        let blocks: Vec<u64> = (0..10).map(|_| a.alloc(10).unwrap()).collect();
        for &b in blocks.iter().step_by(2) {
            a.free(b, 10);
        }
        assert_eq!(a.free_blocks_from(0, 2), vec![(1, 10), (21, 10)]);
        assert_eq!(a.free_blocks_from(31, 2), vec![(41, 10), (61, 10)]);
        assert_eq!(a.free_blocks_from(71, 2), vec![(81, 10)]);
        assert_eq!(a.free_blocks_from(91, 2), vec![]);
    }

    #[test]
    fn the_largest_block_is_allocated_from_its_start() {
        let mut a = Allocator::new(1, 101);
        let x = a.alloc(10).unwrap();
        a.alloc(10).unwrap();
        a.free(x, 10);
        assert_eq!(a.alloc_largest(81), None, "too long");
        assert_eq!(a.alloc_largest(30), Some(21), "not the first block: the largest");
        assert_eq!(a.alloc_largest(50), Some(51));
        assert_eq!(a.alloc_largest(10), Some(1), "now the largest");
        a.check();
        assert_eq!(a.space().free, 0);
    }

    #[test]
    fn a_parked_range_only_empties_and_comes_back_whole() {
        let mut a = Allocator::new(1, 1 + 100);
        let blocks: Vec<u64> = (0..10).map(|_| a.alloc(10).unwrap()).collect();
        a.free(blocks[2], 10);
        a.free(blocks[4], 10);
        // Park 20..50 (blocks 2, 3 and 4, with 2 and 4 free).
        a.park(21..51);
        assert_eq!(a.space().parked, 20);
        assert_eq!(a.alloc(10), None, "the only free space is parked");
        a.free(blocks[0], 10);
        assert_eq!(a.alloc(10), Some(blocks[0]));
        a.free(blocks[3], 10);
        a.check();
        assert_eq!(a.parked(), None, "all free: unparked by itself");
        assert_eq!(a.alloc(30), Some(21));
    }

    #[test]
    fn giving_up_on_a_parked_range_frees_its_gaps() {
        let mut a = Allocator::new(1, 1 + 100);
        let blocks: Vec<u64> = (0..10).map(|_| a.alloc(10).unwrap()).collect();
        a.free(blocks[5], 10);
        a.park(41..71);
        assert_eq!(a.alloc(10), None);
        a.unpark();
        a.check();
        assert_eq!(a.alloc(10), Some(blocks[5]));
    }

    proptest! {
        #[test]
        fn blocks_never_overlap_and_books_balance(
            ops in prop::collection::vec((1usize..600, 0u8..8), 1..400),
        ) {
            let mut a = Allocator::new(100, 100 + 20_000);
            let mut live: Vec<(u64, usize)> = Vec::new();
            for (units, op) in ops {
                match op {
                    0..=2 if !live.is_empty() => {
                        let (at, u) = live.swap_remove(units % live.len());
                        a.free(at, u);
                    }
                    3 if a.parked().is_none() => {
                        let lo = 100 + (units as u64 * 31) % 19_000;
                        a.park(lo..lo + units as u64);
                    }
                    4 if a.parked().is_some() => a.unpark(),
                    _ => {
                        if let Some(at) = a.alloc(units) {
                            let c = units as u64;
                            prop_assert!(at >= 100 && at + c <= 20_100);
                            if let Some(r) = a.parked() {
                                prop_assert!(at + c <= r.start || r.end <= at, "allocated in the parked range");
                            }
                            for &(o, u) in &live {
                                prop_assert!(at + c <= o || o + u as u64 <= at, "overlap");
                            }
                            live.push((at, units));
                        }
                    }
                }
                a.check();
                let want: u64 = live.iter().map(|&(_, u)| u as u64).sum();
                prop_assert_eq!(a.space().used, want);
            }
            for (at, u) in live.drain(..) {
                a.free(at, u);
            }
            if let Some(r) = a.parked() {
                prop_assert!(false, "a fully free parked range {:?} stayed parked", r);
            }
            prop_assert_eq!(a.space().largest_free, 20_000);
        }
    }
}

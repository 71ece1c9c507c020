//! Size-class allocator for the data area, in 64-byte units.
//!
//! Pure bookkeeping (no memory access): blocks are handed out by class from
//! a free list or, when the list is empty, from a bump pointer. Classes are
//! exact up to 32 units (2 KiB) and then four per power of two, so a block
//! wastes at most 25% (jemalloc-style spacing). Freed blocks go back to
//! their class; blocks are not split or merged, so a workload that moves
//! all its memory from one size to another can run out while free space
//! remains in other classes (as memcached's slabs can). The server reports
//! that as out-of-memory; it never overwrites live data.

use dmkv_common::layout::MAX_ITEM_UNITS;

const EXACT_CLASSES: usize = 32;
const SUBCLASSES_PER_POW2: usize = 4;

/// Units of the block that holds an item of `units` units.
pub fn class_units(units: usize) -> usize {
    assert!((1..=MAX_ITEM_UNITS).contains(&units), "item of {units} units");
    if units <= EXACT_CLASSES {
        return units;
    }
    // Round up to the next multiple of 2^(k-2) where 2^k <= units < 2^(k+1).
    let k = usize::BITS - 1 - units.leading_zeros();
    let step = 1usize << (k - SUBCLASSES_PER_POW2.trailing_zeros());
    units.next_multiple_of(step)
}

/// Index of the class holding items of `units` units.
pub fn class_index(units: usize) -> usize {
    let c = class_units(units);
    if c <= EXACT_CLASSES {
        return c - 1;
    }
    let k = (usize::BITS - 1 - c.leading_zeros()) as usize;
    let step = 1usize << (k - 2);
    let sub = (c - (1 << k)) / step; // 0..4, or 4 when c == 2^(k+1) (counted in the next power)
    EXACT_CLASSES + (k - 5) * SUBCLASSES_PER_POW2 + sub - 1
}

/// Number of classes.
pub fn class_count() -> usize {
    class_index(MAX_ITEM_UNITS) + 1
}

/// Allocator state over a data area `[start, end)` measured in units.
#[derive(Debug)]
pub struct Allocator {
    free: Vec<Vec<u64>>,
    next: u64,
    end: u64,
    used_units: u64,
}

impl Allocator {
    /// An allocator for units `start..end` (absolute unit offsets in the region).
    pub fn new(start: u64, end: u64) -> Self {
        assert!(start >= 1 && start <= end);
        Allocator { free: vec![Vec::new(); class_count()], next: start, end, used_units: 0 }
    }

    /// Allocates a block for an item of `units` units; returns its unit offset.
    pub fn alloc(&mut self, units: usize) -> Option<u64> {
        let c = class_units(units) as u64;
        let at = match self.free[class_index(units)].pop() {
            Some(at) => at,
            None if self.end - self.next >= c => {
                let at = self.next;
                self.next += c;
                at
            }
            None => return None,
        };
        self.used_units += c;
        Some(at)
    }

    /// Returns the block at `at` that was allocated for `units` units.
    pub fn free(&mut self, at: u64, units: usize) {
        let c = class_units(units) as u64;
        debug_assert!(at + c <= self.next);
        self.used_units -= c;
        self.free[class_index(units)].push(at);
    }

    /// Units handed out and not yet freed.
    pub fn used_units(&self) -> u64 {
        self.used_units
    }

    /// Units never handed out (beyond the bump pointer).
    pub fn untouched_units(&self) -> u64 {
        self.end - self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn classes_are_monotonic_and_bounded() {
        let mut last = (1, 0);
        assert_eq!((class_units(1), class_index(1)), last);
        for u in 2..=MAX_ITEM_UNITS {
            let c = class_units(u);
            let i = class_index(u);
            assert!(c >= u && (c - u) * 4 <= c, "{u} -> {c}");
            assert!(c >= last.0 && i >= last.1);
            assert_eq!(i != last.1, c != last.0, "index changes exactly when the class does at {u}");
            if c <= MAX_ITEM_UNITS {
                assert_eq!(class_units(c), c);
            }
            last = (c, i);
        }
        assert!(class_count() < 128);
    }

    proptest! {
        #[test]
        fn blocks_never_overlap(ops in prop::collection::vec((1usize..600, any::<bool>()), 1..400)) {
            let mut a = Allocator::new(100, 100 + 20_000);
            let mut live: Vec<(u64, usize)> = Vec::new();
            for (units, free) in ops {
                if free && !live.is_empty() {
                    let (at, u) = live.swap_remove(units % live.len());
                    a.free(at, u);
                } else if let Some(at) = a.alloc(units) {
                    let c = class_units(units) as u64;
                    prop_assert!(at >= 100 && at + c <= 20_100);
                    for &(o, u) in &live {
                        let oc = class_units(u) as u64;
                        prop_assert!(at + c <= o || o + oc <= at, "overlap");
                    }
                    live.push((at, units));
                }
                let want: u64 = live.iter().map(|&(_, u)| class_units(u) as u64).sum();
                prop_assert_eq!(a.used_units(), want);
            }
        }
    }
}

//! How the RDMA backend splits a batch of reads into posts (pure: no
//! verbs, so it is tested in every build): at most so many reads and
//! bytes per post, around the reads it refuses, and with the batch's last
//! read ordered after all the others when the region is leased.

use std::ops::Range;

use dmkv_common::read::ReadSpec;

/// What one post may carry: the queue pair's reads per doorbell and the
/// lane buffer's bytes.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub reads: usize,
    pub bytes: usize,
}

/// What the backend does with a batch's specs, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Posts these specs as one batch of READs (one doorbell), each at the
    /// sum of the lengths before it in the lane's buffer; with
    /// `fence_last`, the last starts only once the others completed.
    Post { reads: Range<usize>, fence_last: bool },
    /// This spec lies outside the region, or does not fit a lane's
    /// buffer: refused (its result is `None`), nothing posted.
    Refuse(usize),
}

/// The steps of one batch. Each post is waited for before the next, so
/// reads of a later post read memory after those of an earlier one; with
/// `last_after_rest` the batch's last read is also fenced inside its own
/// post (when it shares one), so it reads memory after every other read
/// of the batch: a leased region's lease block.
pub struct Plan<'s> {
    specs: &'s [ReadSpec],
    region_len: u64,
    limits: Limits,
    last_after_rest: bool,
    next: usize,
}

impl<'s> Plan<'s> {
    pub fn new(specs: &'s [ReadSpec], region_len: u64, limits: Limits, last_after_rest: bool) -> Plan<'s> {
        debug_assert!(limits.reads > 0 && limits.bytes > 0, "a post carries something");
        Plan { specs, region_len, limits, last_after_rest, next: 0 }
    }

    fn fits(&self, s: &ReadSpec) -> bool {
        let inside = s.offset.checked_add(s.len as u64).is_some_and(|end| end <= self.region_len);
        inside && s.len as usize <= self.limits.bytes
    }
}

impl Iterator for Plan<'_> {
    type Item = Step;

    fn next(&mut self) -> Option<Step> {
        let start = self.next;
        let first = self.specs.get(start)?;
        if !self.fits(first) {
            self.next += 1;
            return Some(Step::Refuse(start));
        }
        let (mut end, mut used) = (start, 0usize);
        while let Some(s) = self.specs.get(end) {
            if end - start == self.limits.reads || !self.fits(s) || used + s.len as usize > self.limits.bytes {
                break;
            }
            used += s.len as usize;
            end += 1;
        }
        debug_assert!(end > start, "a spec that fits starts a post of its own");
        self.next = end;
        let fence_last = self.last_after_rest && end == self.specs.len() && end - start > 1;
        Some(Step::Post { reads: start..end, fence_last })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIMITS: Limits = Limits { reads: 4, bytes: 100 };
    const REGION: u64 = 1000;

    fn spec(offset: u64, len: u32) -> ReadSpec {
        ReadSpec { offset, len }
    }

    #[test]
    fn a_leased_batch_fences_its_last_read_in_the_last_post() {
        let specs = [spec(0, 10), spec(100, 10), spec(128, 48)];
        let steps: Vec<Step> = Plan::new(&specs, REGION, LIMITS, true).collect();
        assert_eq!(steps, vec![Step::Post { reads: 0..3, fence_last: true }]);
        let steps: Vec<Step> = Plan::new(&specs, REGION, LIMITS, false).collect();
        assert_eq!(steps, vec![Step::Post { reads: 0..3, fence_last: false }]);
    }

    #[test]
    fn splits_refusals_and_a_last_read_alone() {
        // Five reads: a post of four, then the last alone (after the first
        // completed, so no fence is needed); one out of bounds between.
        let specs = [
            spec(0, 1),
            spec(1, 1),
            spec(2, 1),
            spec(999, 2),
            spec(3, 1),
            spec(4, 1),
            spec(5, 1),
            spec(6, 1),
            spec(7, 1),
        ];
        let steps: Vec<Step> = Plan::new(&specs, REGION, LIMITS, true).collect();
        assert_eq!(
            steps,
            vec![
                Step::Post { reads: 0..3, fence_last: false },
                Step::Refuse(3),
                Step::Post { reads: 4..8, fence_last: false },
                Step::Post { reads: 8..9, fence_last: false },
            ]
        );
    }

    proptest! {
        /// Every spec once, in order; every post within the limits; only
        /// the post holding the batch's last read may be fenced, and it is
        /// (for a leased region) whenever that read shares its post.
        #[test]
        fn posts_cover_the_batch_in_order_within_the_limits(
            raw in prop::collection::vec((0u64..1100, 0u32..130), 0..30),
            leased in any::<bool>(),
        ) {
            let specs: Vec<ReadSpec> = raw.iter().map(|&(o, l)| spec(o, l)).collect();
            let steps: Vec<Step> = Plan::new(&specs, REGION, LIMITS, leased).collect();
            let mut next = 0;
            for (k, step) in steps.iter().enumerate() {
                match step {
                    Step::Refuse(i) => {
                        prop_assert_eq!(*i, next);
                        let s = specs[*i];
                        prop_assert!(s.offset + s.len as u64 > REGION || s.len as usize > LIMITS.bytes);
                        next += 1;
                    }
                    Step::Post { reads, fence_last } => {
                        prop_assert_eq!(reads.start, next);
                        prop_assert!(!reads.is_empty() && reads.len() <= LIMITS.reads);
                        let bytes: usize = specs[reads.clone()].iter().map(|s| s.len as usize).sum();
                        prop_assert!(bytes <= LIMITS.bytes);
                        prop_assert!(specs[reads.clone()].iter().all(|s| s.offset + s.len as u64 <= REGION));
                        let holds_last = reads.end == specs.len();
                        prop_assert_eq!(*fence_last, leased && holds_last && reads.len() > 1);
                        prop_assert!(!holds_last || k == steps.len() - 1);
                        next = reads.end;
                    }
                }
            }
            prop_assert_eq!(next, specs.len());
        }
    }
}

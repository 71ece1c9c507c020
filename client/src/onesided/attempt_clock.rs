//! The clock that times one-sided attempts against the grace period.
//!
//! An attempt may trust what it read only if it ended within the grace
//! period of its start: its measured length must never be shorter than the
//! true one. So its start may be read early, and its judgement never early.
//! The kernel's coarse monotonic clock is the precise monotonic clock as of
//! its last tick: on the same timeline, never ahead of it, and cheap (a
//! precise read cost a tenth of a shared-memory GET on a VM's clock source).
//! It starts attempts. Every judgement reads the precise clock. A coarse
//! clock must not judge: it lags by as much as a late tick lets it, more
//! than its resolution (12 ms against a 4 ms resolution on a busy VM).

use rustix::time::{ClockId, clock_getres, clock_gettime};

/// The coarse clock starts attempts only if its resolution is at most this
/// fraction of the grace period: a start read that early makes attempts
/// look longer than they were, and too many would be abandoned as slow.
const MAX_RESOLUTION_SHARE: u64 = 10;

/// Monotonic nanoseconds for starting and judging attempts.
#[derive(Debug)]
pub struct AttemptClock {
    /// Whether attempts start on the coarse clock.
    coarse: bool,
}

fn nanos(t: rustix::time::Timespec) -> u64 {
    (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
}

/// This host's `CLOCK_MONOTONIC` in nanoseconds: the clock a shard leader
/// on this host publishes its lease on.
pub fn mono_ns() -> u64 {
    nanos(clock_gettime(ClockId::Monotonic))
}

impl AttemptClock {
    /// The cheapest clock that can time attempts against a grace period of
    /// `grace_nanos`.
    pub fn new(grace_nanos: u64) -> AttemptClock {
        let res = nanos(clock_getres(ClockId::MonotonicCoarse));
        AttemptClock { coarse: res > 0 && res.saturating_mul(MAX_RESOLUTION_SHARE) <= grace_nanos }
    }

    /// When an attempt starts: never later than the true time.
    pub fn start(&self) -> u64 {
        if self.coarse { nanos(clock_gettime(ClockId::MonotonicCoarse)) } else { self.judge() }
    }

    /// When an attempt is judged: never earlier than the true time.
    pub fn judge(&self) -> u64 {
        nanos(clock_gettime(ClockId::Monotonic))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_are_never_late_and_judgements_never_early() {
        let c = AttemptClock::new(100_000_000);
        for _ in 0..100_000 {
            let start = c.start();
            let before = nanos(clock_gettime(ClockId::Monotonic));
            let judged = c.judge();
            // A start read first is at most the true time read after it;
            // a judgement read after the true time is at least it.
            assert!(start <= before, "start {start} after the true time {before}");
            assert!(judged >= before, "judged {judged} before the true time {before}");
        }
        // A grace period near the resolution starts on the precise clock.
        assert!(!AttemptClock::new(1).coarse);
    }
}

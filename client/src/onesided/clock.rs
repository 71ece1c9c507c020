//! The clock that times one-sided attempts against the grace period.
//!
//! Every attempt reads it twice, and a precise monotonic clock read cost a
//! tenth of a shared-memory GET here (a VM's clock source). The kernel's
//! coarse monotonic clock costs a few nanoseconds; it lags the true time by
//! at most its resolution, so an attempt is judged against a grace period
//! shortened by that resolution and can never outlast the real one
//! unnoticed. When the resolution is not small against the grace period
//! (or the coarse clock is missing), the precise clock is used.

use std::time::Instant;

use rustix::time::{ClockId, clock_getres, clock_gettime};

/// The coarse clock is used only if its resolution is at most this
/// fraction of the grace period.
const MAX_RESOLUTION_SHARE: u64 = 10;

/// A monotonic clock in nanoseconds, and the grace period to check with it.
#[derive(Debug)]
pub struct AttemptClock {
    start: Instant,
    /// The coarse clock's resolution, if it is the one read.
    coarse: Option<u64>,
}

fn nanos(t: rustix::time::Timespec) -> u64 {
    (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
}

impl AttemptClock {
    /// The cheapest clock that can check a grace period of `grace_nanos`.
    pub fn new(grace_nanos: u64) -> AttemptClock {
        let res = nanos(clock_getres(ClockId::MonotonicCoarse));
        let usable = res > 0 && res.saturating_mul(MAX_RESOLUTION_SHARE) <= grace_nanos;
        AttemptClock { start: Instant::now(), coarse: usable.then_some(res) }
    }

    /// The precise clock, whatever the grace period (for tests).
    #[cfg(test)]
    pub fn precise() -> AttemptClock {
        AttemptClock { start: Instant::now(), coarse: None }
    }

    /// Nanoseconds on this clock (only differences mean anything).
    pub fn now(&self) -> u64 {
        match self.coarse {
            Some(_) => nanos(clock_gettime(ClockId::MonotonicCoarse)),
            None => self.start.elapsed().as_nanos() as u64,
        }
    }

    /// The grace period to judge attempts timed by this clock against.
    pub fn grace(&self, grace_nanos: u64) -> u64 {
        grace_nanos.saturating_sub(self.coarse.unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_coarse_clock_shortens_the_grace_period_by_its_resolution() {
        let c = AttemptClock::new(100_000_000);
        match c.coarse {
            Some(res) => assert_eq!(c.grace(100_000_000), 100_000_000 - res),
            None => assert_eq!(c.grace(100_000_000), 100_000_000),
        }
        // A grace period near the resolution takes the precise clock.
        let tight = AttemptClock::new(1);
        assert_eq!((tight.coarse, tight.grace(1)), (None, 1));
        assert_eq!(AttemptClock::precise().grace(5), 5);
        let (a, b) = (c.now(), c.now());
        assert!(b >= a, "monotonic");
    }
}

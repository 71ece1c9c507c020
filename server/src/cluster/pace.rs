//! Pacing of a partition move's copy: at most a rate of bytes a second,
//! so the source's walk and the target's log leave foreground requests
//! their share. Pure (time passed in).

use std::time::{Duration, Instant};

/// Most one wait of a paced copy: a chunk is at most about 1 MiB, so at
/// the lowest rate (1 MiB/s) a wait is about a second; a longer one comes
/// only from a clock that jumped.
pub const MAX_PACE_WAIT: Duration = Duration::from_secs(2);

/// A copy paced for this long goes on unpaced: the mover's step (which
/// the copy is) has `MOVE_STEP_TIMEOUT` (120 s), and one that times out is
/// asked again while the first may still run.
pub const MAX_PACED: Duration = Duration::from_secs(60);

/// A copy's pace: `rate` bytes a second from `start` (0: unpaced).
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    rate: u64,
    start: Instant,
}

impl Pace {
    pub fn new(rate: u64, start: Instant) -> Pace {
        Pace { rate, start }
    }

    /// How long to wait at `now`, `sent` bytes into the copy, before
    /// sending more: until the rate allows what was sent.
    pub fn delay(&self, sent: u64, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.start);
        if self.rate == 0 || elapsed >= MAX_PACED {
            return Duration::ZERO;
        }
        let due = Duration::from_secs_f64(sent as f64 / self.rate as f64);
        due.saturating_sub(elapsed).min(MAX_PACE_WAIT).min(MAX_PACED - elapsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_ahead_of_its_rate_waits_and_one_behind_does_not() {
        let t = Instant::now();
        let mib = 1u64 << 20;
        let p = Pace::new(mib, t);
        assert_eq!(p.delay(2 * mib, t + Duration::from_secs(1)), Duration::from_secs(1));
        assert_eq!(p.delay(mib, t + Duration::from_secs(3)), Duration::ZERO);
        assert_eq!(p.delay(mib / 2, t), Duration::from_millis(500));
        // A clock that jumped back, or a huge chunk: the wait is bounded.
        assert_eq!(p.delay(100 * mib, t), MAX_PACE_WAIT);
        assert_eq!(Pace::new(0, t).delay(100 * mib, t), Duration::ZERO);
        // Never past MAX_PACED: then unpaced.
        assert_eq!(p.delay(100 * mib, t + MAX_PACED - Duration::from_millis(10)), Duration::from_millis(10));
        assert_eq!(p.delay(100 * mib, t + MAX_PACED), Duration::ZERO);
    }
}

//! PLB-style repathing: a connection whose round trips stay above the
//! target delay for several consecutive rounds hands its traffic to a
//! fresh connection. On a real fabric the new connection's ports hash to
//! another ECMP path; anywhere it sheds a connection stuck behind a slow
//! queue.

use super::units::MILLIS;

/// Consecutive congested rounds that trigger a repath (PLB's N).
pub const DEFAULT_CONGESTED_ROUNDS: u32 = 5;
/// Fraction of a round's samples above target that make it congested
/// (PLB's K, there of ECN-marked packets).
pub const CONGESTED_FRACTION: f64 = 0.5;
/// Shortest round: a round lasts one smoothed RTT, but never less, so a
/// path with microsecond delays does not repath on a millisecond hiccup.
pub const MIN_ROUND_NS: u64 = MILLIS;
/// Least time between two repaths of one connection slot, so persistent
/// congestion everywhere does not churn connections.
pub const MIN_REPATH_INTERVAL_NS: u64 = 1_000 * MILLIS;

/// Congestion rounds of one connection.
#[derive(Debug, Clone, Default)]
pub struct Repath {
    round_start: Option<u64>,
    above: u32,
    total: u32,
    congested_rounds: u32,
    last_repath: Option<u64>,
}

impl Repath {
    /// A detector with no history.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a round trip of `delay` against `target`, in rounds of
    /// `round` ns. Returns true when the connection should be replaced now;
    /// the detector then starts over.
    pub fn on_sample(&mut self, now: u64, delay: u64, target: u64, round: u64, rounds_needed: u32) -> bool {
        let start = *self.round_start.get_or_insert(now);
        self.total += 1;
        if delay > target {
            self.above += 1;
        }
        if now.saturating_sub(start) < round.max(MIN_ROUND_NS) {
            return false;
        }
        let congested = f64::from(self.above) > CONGESTED_FRACTION * f64::from(self.total);
        self.congested_rounds = if congested { self.congested_rounds + 1 } else { 0 };
        self.round_start = Some(now);
        self.above = 0;
        self.total = 0;
        let rested = self.last_repath.is_none_or(|t| now.saturating_sub(t) >= MIN_REPATH_INTERVAL_NS);
        if self.congested_rounds >= rounds_needed.max(1) && rested {
            self.congested_rounds = 0;
            self.last_repath = Some(now);
            return true;
        }
        false
    }

    /// Consecutive congested rounds so far.
    pub fn congested_rounds(&self) -> u32 {
        self.congested_rounds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUND: u64 = 2 * MILLIS;

    fn feed(r: &mut Repath, from: u64, rounds: u64, delay: u64) -> (u64, u32) {
        let mut repaths = 0;
        let mut t = from;
        for _ in 0..rounds * 10 {
            t += ROUND / 10;
            if r.on_sample(t, delay, 100, ROUND, DEFAULT_CONGESTED_ROUNDS) {
                repaths += 1;
            }
        }
        (t, repaths)
    }

    #[test]
    fn repaths_after_n_congested_rounds_not_before() {
        let mut r = Repath::new();
        let (t, n) = feed(&mut r, 0, u64::from(DEFAULT_CONGESTED_ROUNDS) - 1, 500);
        assert_eq!(n, 0);
        let (_, n) = feed(&mut r, t, 2, 500);
        assert_eq!(n, 1);
    }

    #[test]
    fn a_good_round_resets_the_count() {
        let mut r = Repath::new();
        let mut t = 0;
        for _ in 0..20 {
            let (t1, n) = feed(&mut r, t, 3, 500);
            let (t2, m) = feed(&mut r, t1, 1, 50);
            assert_eq!(n + m, 0);
            t = t2;
        }
    }

    #[test]
    fn repaths_are_spaced() {
        let mut r = Repath::new();
        let (_, n) = feed(&mut r, 0, 200, 500);
        // 200 rounds of 2 ms = 400 ms: one repath, then the rest interval.
        assert_eq!(n, 1);
        let (_, n) = feed(&mut r, MIN_REPATH_INTERVAL_NS * 2, 20, 500);
        assert_eq!(n, 1);
    }
}

//! Round-trip delay of one path: a windowed minimum as the base (the delay
//! with empty queues) and an exponentially weighted mean of recent samples.

use super::units::MILLIS;

/// How long a minimum counts as the base delay: between one and two of
/// these. Long enough to span bursts of congestion, short enough that a
/// path whose real base rose (a new route) is believed within seconds.
pub const BASE_WINDOW_NS: u64 = 10_000 * MILLIS;
/// Weight of a new sample in the smoothed delay (as TCP's SRTT: 1/8).
pub const SMOOTHING: f64 = 1.0 / 8.0;
/// Weight of a new deviation in the delay variation (as TCP's RTTVAR: 1/4).
pub const VARIATION_SMOOTHING: f64 = 1.0 / 4.0;
/// Weight of a sample that comes after a silence of more than
/// [`SPARSE_GAP_RTTS`] smoothed delays: on a path known only by occasional
/// probes each sample is the only news for a long while, and at 1/8 the
/// estimate would lag the path by dozens of probe intervals.
pub const SPARSE_SMOOTHING: f64 = 1.0 / 4.0;
/// See [`SPARSE_SMOOTHING`].
pub const SPARSE_GAP_RTTS: f64 = 8.0;
/// A sample enters the smoothed delay capped at this many variations above
/// it, so a rare outlier (a descheduled thread, a retransmit) moves it a
/// little instead of doubling it; a lasting rise still gets through within
/// a few more samples, as each capped sample widens the variation.
pub const OUTLIER_VARIATIONS: f64 = 4.0;
/// Floor of the variation in that cap, as a fraction of the smoothed delay,
/// so a path that was steady for long can still rise.
pub const MIN_VARIATION: f64 = 1.0 / 8.0;

/// Weight of a sample below half the smoothed delay. Queues drain at once
/// and noise cannot push a delay below the base, so such good news is
/// believed fast: a path that was congested looks usable again within a few
/// probes instead of dozens.
pub const DRAIN_SMOOTHING: f64 = 1.0 / 2.0;

/// Base and smoothed delay of one path or connection.
#[derive(Debug, Clone, Default)]
pub struct DelayEstimator {
    /// Minimum of the current base window and when that window began.
    cur_min: Option<u64>,
    cur_start: u64,
    /// Minimum of the window before it.
    prev_min: Option<u64>,
    smoothed: Option<f64>,
    variation: f64,
    latest: Option<u64>,
    latest_at: u64,
    samples: u64,
}

impl DelayEstimator {
    /// An estimator with no samples.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one round trip of `delay` ns that ended at `now`.
    pub fn on_sample(&mut self, now: u64, delay: u64) {
        if self.cur_min.is_none() || now.saturating_sub(self.cur_start) >= BASE_WINDOW_NS {
            self.prev_min = self.cur_min;
            self.cur_min = Some(delay);
            self.cur_start = now;
        } else if let Some(m) = &mut self.cur_min {
            *m = (*m).min(delay);
        }
        let d = delay as f64;
        match &mut self.smoothed {
            None => {
                self.smoothed = Some(d);
                self.variation = d / 2.0;
            }
            Some(s) => {
                let gap = now.saturating_sub(self.latest_at) as f64;
                let weight = if d < *s / 2.0 {
                    DRAIN_SMOOTHING
                } else if gap > SPARSE_GAP_RTTS * *s {
                    SPARSE_SMOOTHING
                } else {
                    SMOOTHING
                };
                let d = d.min(*s + OUTLIER_VARIATIONS * self.variation.max(MIN_VARIATION * *s));
                self.variation += VARIATION_SMOOTHING * ((*s - d).abs() - self.variation);
                *s += weight * (d - *s);
            }
        }
        self.latest = Some(delay);
        self.latest_at = now;
        self.samples += 1;
    }

    /// The lowest delay seen lately, if any sample was seen.
    pub fn base(&self) -> Option<u64> {
        match (self.cur_min, self.prev_min) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The smoothed delay, if any sample was seen.
    pub fn smoothed(&self) -> Option<f64> {
        self.smoothed
    }

    /// The mean deviation of samples from the smoothed delay.
    pub fn variation(&self) -> f64 {
        self.variation
    }

    /// The last sample.
    pub fn latest(&self) -> Option<u64> {
        self.latest
    }

    /// Samples seen in all.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_is_the_windowed_minimum_and_forgets_old_windows() {
        let mut d = DelayEstimator::new();
        d.on_sample(0, 100);
        d.on_sample(1, 50);
        d.on_sample(2, 80);
        assert_eq!(d.base(), Some(50));
        // One window later the old minimum still counts...
        d.on_sample(BASE_WINDOW_NS, 90);
        assert_eq!(d.base(), Some(50));
        // ...two windows later it is gone.
        d.on_sample(2 * BASE_WINDOW_NS, 95);
        assert_eq!(d.base(), Some(90));
    }

    #[test]
    fn smoothed_follows_a_step_within_a_few_dozen_samples() {
        let mut d = DelayEstimator::new();
        for i in 0..100 {
            d.on_sample(i, 100);
        }
        assert_eq!(d.smoothed(), Some(100.0));
        for i in 100..140 {
            d.on_sample(i, 1_000);
        }
        let s = d.smoothed().unwrap();
        assert!(s > 990.0 && s <= 1_000.0, "{s}");
        assert_eq!(d.base(), Some(100));
    }

    #[test]
    fn an_outlier_moves_the_mean_a_little_and_sparse_samples_count_more() {
        let mut d = DelayEstimator::new();
        for i in 0..100 {
            d.on_sample(i, 100 + i % 7);
        }
        let before = d.smoothed().unwrap();
        d.on_sample(100, 10_000);
        let after = d.smoothed().unwrap();
        assert!(after < before * 1.1, "{before} -> {after}");

        let mut busy = d.clone();
        let mut idle = d;
        busy.on_sample(101, 70);
        idle.on_sample(100 + 100 * 1_000, 70);
        assert!(idle.smoothed().unwrap() < busy.smoothed().unwrap());
    }

    #[test]
    fn a_drained_queue_is_believed_within_a_few_samples() {
        let mut d = DelayEstimator::new();
        for i in 0..100 {
            d.on_sample(i, 50_000);
        }
        for i in 100..110 {
            d.on_sample(i, 100);
        }
        let s = d.smoothed().unwrap();
        assert!(s < 200.0, "{s}");
    }
}

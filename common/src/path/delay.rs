//! Round-trip delay of one path: a windowed minimum as the base (the delay
//! with empty queues) and an exponentially weighted mean of recent samples.

use super::MILLIS;

/// How long a minimum counts as the base delay: between one and two of
/// these. Long enough to span bursts of congestion, short enough that a
/// path whose real base rose (a new route) is believed within seconds.
pub const BASE_WINDOW_NS: u64 = 10_000 * MILLIS;
/// Weight of a new sample in the smoothed delay (as TCP's SRTT: 1/8).
pub const SMOOTHING: f64 = 1.0 / 8.0;
/// Weight of a new deviation in the delay variation (as TCP's RTTVAR: 1/4).
pub const VARIATION_SMOOTHING: f64 = 1.0 / 4.0;

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
                self.variation += VARIATION_SMOOTHING * ((*s - d).abs() - self.variation);
                *s += SMOOTHING * (d - *s);
            }
        }
        self.latest = Some(delay);
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
}

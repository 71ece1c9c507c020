//! A Swift-style congestion window on outstanding operations: additive
//! increase while the delay is below a target, multiplicative decrease in
//! proportion to how far above it the delay is, at most once per round trip.

/// Settings of a [`Window`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowConfig {
    /// Smallest window: a path always may have this many GETs outstanding.
    pub min: f64,
    /// Largest window.
    pub max: f64,
    /// Window of a path not yet measured.
    pub initial: f64,
    /// Growth per round trip below target.
    pub additive_increase: f64,
    /// Strength of the decrease per unit of relative excess delay.
    pub beta: f64,
    /// Largest fraction one decrease removes.
    pub max_decrease: f64,
    /// The target is the base delay plus the larger of this many ns...
    pub target_margin_ns: u64,
    /// ...and this fraction of the base delay.
    pub target_ratio: f64,
}

impl Default for WindowConfig {
    fn default() -> Self {
        WindowConfig {
            min: 1.0,
            max: 1024.0,
            initial: 16.0,
            additive_increase: 1.0,
            beta: 0.8,
            max_decrease: 0.5,
            // Generous for a datacenter fabric (Swift targets tens of µs)
            // because loopback and VM scheduling add hundreds of µs of
            // noise; real congestion (a queue at a bottleneck, a saturated
            // server) shows up as milliseconds and is caught all the same.
            target_margin_ns: 500 * super::units::MICROS,
            target_ratio: 1.0,
        }
    }
}

impl WindowConfig {
    /// The target delay for a path whose base delay is `base`.
    pub fn target(&self, base: u64) -> u64 {
        // Saturating: a sample may be any u64 (a stuck request, a clock jump).
        base.saturating_add(self.target_margin_ns.max((base as f64 * self.target_ratio) as u64))
    }
}

/// A congestion window in operations (fractional, as in Swift).
#[derive(Debug, Clone)]
pub struct Window {
    cfg: WindowConfig,
    cwnd: f64,
    last_decrease: Option<u64>,
}

impl Window {
    /// A window at its initial size.
    pub fn new(cfg: WindowConfig) -> Self {
        assert!(cfg.min >= 1.0 && cfg.min <= cfg.initial && cfg.initial <= cfg.max, "bad window bounds {cfg:?}");
        assert!(cfg.max_decrease > 0.0 && cfg.max_decrease < 1.0);
        Window { cfg, cwnd: cfg.initial, last_decrease: None }
    }

    /// The window now.
    pub fn cwnd(&self) -> f64 {
        self.cwnd
    }

    /// Whether one more operation may start with `in_flight` outstanding.
    pub fn allows(&self, in_flight: u32) -> bool {
        f64::from(in_flight) + 1.0 <= self.cwnd.max(self.cfg.min)
    }

    /// An operation completed with `delay` against `target`; `rtt` is the
    /// path's smoothed delay, which spaces decreases.
    pub fn on_ack(&mut self, now: u64, delay: u64, target: u64, rtt: u64) {
        if delay < target {
            // +additive_increase per window's worth of acks: once per RTT.
            self.cwnd += self.cfg.additive_increase / self.cwnd.max(1.0);
        } else if self.may_decrease(now, rtt) {
            let excess = (delay - target) as f64 / delay.max(1) as f64;
            let factor = (1.0 - self.cfg.beta * excess).max(1.0 - self.cfg.max_decrease);
            self.cwnd *= factor;
            self.last_decrease = Some(now);
        }
        self.clamp();
    }

    /// An operation failed or timed out: the largest decrease (once per RTT).
    pub fn on_failure(&mut self, now: u64, rtt: u64) {
        if self.may_decrease(now, rtt) {
            self.cwnd *= 1.0 - self.cfg.max_decrease;
            self.last_decrease = Some(now);
        }
        self.clamp();
    }

    fn may_decrease(&self, now: u64, rtt: u64) -> bool {
        self.last_decrease.is_none_or(|t| now.saturating_sub(t) >= rtt)
    }

    fn clamp(&mut self) {
        self.cwnd = self.cwnd.clamp(self.cfg.min, self.cfg.max);
        debug_assert!(self.cwnd.is_finite());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_by_about_one_per_window_below_target() {
        let mut w = Window::new(WindowConfig::default());
        let start = w.cwnd();
        for i in 0..16 {
            w.on_ack(i, 10, 100, 10);
        }
        assert!((w.cwnd() - (start + 1.0)).abs() < 0.1, "{}", w.cwnd());
    }

    #[test]
    fn decreases_at_most_once_per_rtt_and_never_below_min() {
        let cfg = WindowConfig::default();
        let mut w = Window::new(cfg);
        w.on_ack(1_000, 10_000, 1_000, 500);
        let after_one = w.cwnd();
        assert!(after_one < cfg.initial);
        w.on_ack(1_100, 10_000, 1_000, 500);
        assert_eq!(w.cwnd(), after_one, "a second decrease within one RTT");
        for i in 0..100 {
            w.on_ack(2_000 + i * 1_000, 1_000_000, 1_000, 500);
        }
        assert_eq!(w.cwnd(), cfg.min);
        assert!(w.allows(0));
        assert!(!w.allows(1));
    }

    #[test]
    fn target_has_a_floor_and_scales_with_base() {
        let c = WindowConfig::default();
        assert_eq!(c.target(1_000), 1_000 + c.target_margin_ns);
        assert_eq!(c.target(10 * c.target_margin_ns), 20 * c.target_margin_ns);
    }
}

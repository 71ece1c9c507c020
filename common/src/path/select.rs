//! The per-request choice between one-sided reads and an RPC.
//!
//! Each GET is priced on both paths as its expected completion time:
//! round trips it will take (one-sided: that key's recent history, else the
//! path's mean; RPC: one) × the path's smoothed round-trip delay, plus the
//! wait for a window slot when the path's window is full. Server queueing
//! is inside the RPC delay; verification retries are inside the one-sided
//! round trips. The cheaper path wins, with two brakes against flapping:
//! the preferred path changes only when the other is cheaper by a margin
//! ([`PathConfig::hysteresis`]; one-sided, which costs the server no CPU,
//! takes the traffic back already when within half that margin of RPC) and
//! not more often than once per [`PathConfig::min_dwell_ns`], a dwell that
//! doubles while the changes keep undoing each other (flap damping) unless
//! the other path is cheaper by [`DWELL_BYPASS_RATIO`]. The path not
//! in use is kept measured by background probes: copies of a real GET whose
//! answers are thrown away, so a probe down a congested path never adds to
//! a caller's latency.

use super::delay::DelayEstimator;
use super::keys::{DEFAULT_KEY_ENTRIES, KeyRounds};
use super::repath::DEFAULT_CONGESTED_ROUNDS;
use super::units::{MICROS, MILLIS};
use super::window::{Window, WindowConfig};

/// The two ways a GET can go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// Reads of the server's memory: shared memory, RDMA or the engine.
    OneSided,
    /// A GET request served by the server's workers.
    Rpc,
}

impl Path {
    /// Both paths, in index order.
    pub const ALL: [Path; 2] = [Path::OneSided, Path::Rpc];

    /// The other path.
    pub fn other(self) -> Path {
        match self {
            Path::OneSided => Path::Rpc,
            Path::Rpc => Path::OneSided,
        }
    }

    /// Position in [`Path::ALL`], for per-path arrays.
    pub fn idx(self) -> usize {
        self as usize
    }

    /// A short name for logs and stats.
    pub fn name(self) -> &'static str {
        match self {
            Path::OneSided => "one-sided",
            Path::Rpc => "rpc",
        }
    }
}

/// Settings of a [`Controller`]. The defaults suit both shared memory
/// (microsecond round trips) and networks (tens of microseconds and up).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PathConfig {
    /// Each path's congestion window.
    pub window: WindowConfig,
    /// RPC must be cheaper by this fraction to take the traffic from
    /// one-sided; one-sided takes it back once within half of it. A single
    /// GET is diverted to the other path when cheaper by this fraction.
    pub hysteresis: f64,
    /// How long the other path must stay cheaper before the preferred path
    /// changes: a real change persists, a noise spike of the estimate
    /// decays within a few samples.
    pub confirm_ns: u64,
    /// Least time between two changes of the preferred path.
    pub min_dwell_ns: u64,
    /// Least time between two background probes of one path.
    pub probe_interval_ns: u64,
    /// Least time between probes of a path priced far above the one in use
    /// ([`FAR_RATIO`]): it would take a large change to matter, and every
    /// RPC probe costs the server CPU. Good news from a probe (a delay under
    /// half the estimate) brings back the short interval.
    pub far_probe_interval_ns: u64,
    /// First wait before a failed path is probed again; doubles per failed
    /// probe up to `max_backoff_ns`.
    pub backoff_ns: u64,
    /// Longest wait between probes of a failed path.
    pub max_backoff_ns: u64,
    /// Keys whose one-sided round trips are remembered.
    pub key_entries: usize,
    /// How long a key's round trips are remembered.
    pub key_memory_ns: u64,
    /// Congested rounds after which a connection is replaced (PLB).
    pub repath_rounds: u32,
}

impl Default for PathConfig {
    fn default() -> Self {
        PathConfig {
            window: WindowConfig::default(),
            hysteresis: 0.10,
            confirm_ns: 10 * MILLIS,
            min_dwell_ns: 50 * MILLIS,
            probe_interval_ns: 5 * MILLIS,
            far_probe_interval_ns: 50 * MILLIS,
            backoff_ns: 100 * MILLIS,
            max_backoff_ns: 5_000 * MILLIS,
            key_entries: DEFAULT_KEY_ENTRIES,
            key_memory_ns: 500 * MILLIS,
            repath_rounds: DEFAULT_CONGESTED_ROUNDS,
        }
    }
}

/// A switch back within this many dwells of the previous switch is a flap:
/// the next dwell doubles (see `Controller::dwell_ns`).
pub const FLAP_WINDOW_DWELLS: u64 = 4;
/// The longest dwell that flapping can build up to.
pub const MAX_FLAP_DWELL_NS: u64 = 1_000 * MILLIS;
/// The other path cheaper by this factor moves the traffic after the
/// confirmation and the configured minimum dwell, whatever dwell flapping
/// built up beyond it: a real change (congestion, a failure) is never held
/// back by damping.
pub const DWELL_BYPASS_RATIO: f64 = 4.0;

/// A path priced this many times above the one in use is probed at
/// [`PathConfig::far_probe_interval_ns`].
pub const FAR_RATIO: f64 = 4.0;
/// Most that this client's load is assumed to lift an idle path's delay
/// above its base (see `Controller::loaded`): past it, the preferred path is
/// congested by more than this client's load.
pub const MAX_LIFT: f64 = 2.0;
/// Round trips a one-sided GET is assumed to take before any is measured:
/// a bucket read and an item read.
const INITIAL_ROUNDS: f64 = 2.0;
/// Weight of a new GET in a path's mean round trips.
const ROUNDS_SMOOTHING: f64 = 1.0 / 16.0;
/// Fallback delay of a path with a window but no samples, for pricing
/// queued GETs only.
const UNKNOWN_DELAY_NS: f64 = (100 * MICROS) as f64;

/// What one GET should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// The path that serves the caller.
    pub path: Path,
    /// Also send a background copy down this path to measure it.
    pub probe: Option<Path>,
}

/// How a GET on a path ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// From start (after window admission) to answer, in ns.
    pub latency_ns: u64,
    /// Round trips it took (an RPC: 1).
    pub round_trips: u32,
    /// Of those, round trips spent on attempts that had to retry.
    pub retries: u32,
}

#[derive(Debug, Clone)]
struct PathState {
    delay: DelayEstimator,
    window: Window,
    rounds: f64,
    round_samples: u32,
    in_flight: u32,
    queued: u32,
    usable: bool,
    down: bool,
    retry_at: u64,
    backoff: u64,
    probe_in_flight: bool,
    last_probe: Option<u64>,
    /// The last probe came back well under the estimate.
    good_news: bool,
    requests: u64,
    probes: u64,
    failures: u64,
    retries: u64,
    diverted: u64,
}

/// A path's state for stats and tests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PathSnapshot {
    /// GETs served on this path for callers.
    pub requests: u64,
    /// Background probes completed or failed on this path.
    pub probes: u64,
    /// Failures (connection lost, timeout).
    pub failures: u64,
    /// Round trips spent on attempts that retried.
    pub retries: u64,
    /// GETs sent here against the preferred path, priced by their key.
    pub diverted: u64,
    /// Congestion window, in GETs.
    pub window: f64,
    /// GETs outstanding now, and GETs waiting for the window.
    pub in_flight: u32,
    pub queued: u32,
    /// Base and smoothed delay of one round trip, ns (0 before a sample).
    pub base_delay_ns: u64,
    pub delay_ns: u64,
    /// The target delay the window steers to, ns (0 before a sample).
    pub target_ns: u64,
    /// Mean round trips per GET.
    pub round_trips: f64,
    /// Whether the path exists and is not failed.
    pub usable: bool,
}

/// Counters and state of a whole [`Controller`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ControllerStats {
    pub one_sided: PathSnapshot,
    pub rpc: PathSnapshot,
    /// The path GETs go by default now.
    pub preferred: Path,
    /// Changes of the preferred path.
    pub switches: u64,
}

/// Path selection for the GETs to one server.
#[derive(Debug, Clone)]
pub struct Controller {
    cfg: PathConfig,
    paths: [PathState; 2],
    keys: KeyRounds,
    preferred: Path,
    last_switch: Option<u64>,
    /// Least time before the next change of the preferred path: the
    /// configured dwell, doubled by every flap (a change that undoes the
    /// previous one soon after) up to [`MAX_FLAP_DWELL_NS`], and back to
    /// the configured one after a calm spell. Two paths of equal cost
    /// otherwise trade the traffic every dwell, each looking cheaper as
    /// soon as this client's load leaves it.
    dwell_ns: u64,
    /// Since when the other path has been cheaper enough to take over.
    leave_since: Option<u64>,
    switches: u64,
}

impl Controller {
    /// A controller with neither path usable yet; one-sided is preferred
    /// until measurements say otherwise (it costs the server nothing).
    pub fn new(cfg: PathConfig) -> Self {
        assert!((0.0..1.0).contains(&cfg.hysteresis), "hysteresis must be in [0, 1)");
        let st = PathState {
            delay: DelayEstimator::new(),
            window: Window::new(cfg.window),
            rounds: 1.0,
            round_samples: 0,
            in_flight: 0,
            queued: 0,
            usable: false,
            down: false,
            retry_at: 0,
            backoff: cfg.backoff_ns,
            probe_in_flight: false,
            last_probe: None,
            good_news: false,
            requests: 0,
            probes: 0,
            failures: 0,
            retries: 0,
            diverted: 0,
        };
        let mut paths = [st.clone(), st];
        paths[Path::OneSided.idx()].rounds = INITIAL_ROUNDS;
        Controller {
            cfg,
            paths,
            keys: KeyRounds::new(cfg.key_entries, cfg.key_memory_ns),
            preferred: Path::OneSided,
            last_switch: None,
            dwell_ns: cfg.min_dwell_ns,
            leave_since: None,
            switches: 0,
        }
    }

    /// The settings.
    pub fn config(&self) -> &PathConfig {
        &self.cfg
    }

    /// Says whether `path` exists at all (one-sided reads attached, say).
    /// A path that becomes usable again starts healthy.
    pub fn set_usable(&mut self, path: Path, usable: bool) {
        let st = &mut self.paths[path.idx()];
        if usable && !st.usable {
            st.down = false;
            st.backoff = self.cfg.backoff_ns;
        }
        st.usable = usable;
    }

    fn serving(&self, p: Path) -> bool {
        let st = &self.paths[p.idx()];
        st.usable && !st.down
    }

    /// Picks the path for a GET of the key hashing to `key`.
    pub fn choose(&mut self, now: u64, key: u64) -> Choice {
        self.choose_priced(now, key, None)
    }

    /// [`Controller::choose`] for a key whose one-sided GET is expected to
    /// take `rounds` round trips (1 when the client has its item's address
    /// cached, 2 otherwise). The key's own recent history, if any, still
    /// wins: it knows about retries and stale addresses.
    pub fn choose_priced(&mut self, now: u64, key: u64, rounds: Option<f64>) -> Choice {
        let (os, rpc) = (self.serving(Path::OneSided), self.serving(Path::Rpc));
        let mut global = Path::ALL.map(|p| self.cost(p, None, now));
        let path = match (os, rpc) {
            (true, false) => Path::OneSided,
            (false, true) => Path::Rpc,
            // Nothing is healthy: the caller's RPC will fail or revive it.
            (false, false) => Path::Rpc,
            (true, true) => {
                if self.update_preferred(now, &global) {
                    // The path not in use is priced differently (see `loaded`).
                    global = Path::ALL.map(|p| self.cost(p, None, now));
                }
                let pref = self.preferred;
                let alt = pref.other();
                // Only one-sided costs differ per key; an RPC is one round trip.
                let mut keyed = global;
                keyed[Path::OneSided.idx()] = self.cost_with(Path::OneSided, Some(key), rounds, now);
                match (keyed[pref.idx()], keyed[alt.idx()]) {
                    (Some(cp), Some(ca)) if self.leaves(pref, cp, ca) => {
                        self.paths[alt.idx()].diverted += 1;
                        alt
                    }
                    _ => pref,
                }
            }
        };
        let far = match (global[path.idx()], global[path.other().idx()]) {
            (Some(c), Some(o)) => o > FAR_RATIO * c,
            _ => false,
        };
        let probe = self.probe_due(now, path.other(), far);
        if let Some(p) = probe {
            let st = &mut self.paths[p.idx()];
            st.probe_in_flight = true;
            st.last_probe = Some(now);
        }
        Choice { path, probe }
    }

    /// Whether traffic priced `c_from` on `from` should move to the other
    /// path priced `c_to`. One-sided is the home path (it costs the server
    /// no CPU): RPC takes over when cheaper by the hysteresis margin, and
    /// keeps the traffic only while one-sided stays dearer by half that
    /// margin. A symmetric band would leave equal paths on RPC for good
    /// after one congestion.
    fn leaves(&self, from: Path, c_from: f64, c_to: f64) -> bool {
        match from {
            Path::OneSided => c_to < c_from * (1.0 - self.cfg.hysteresis),
            Path::Rpc => c_to < c_from * (1.0 + self.cfg.hysteresis / 2.0),
        }
    }

    /// Changes the preferred path if the other has been cheaper long enough;
    /// `global` holds both paths' costs for a typical key. True on a change.
    fn update_preferred(&mut self, now: u64, global: &[Option<f64>; 2]) -> bool {
        let pref = self.preferred;
        let (Some(cp), Some(ca)) = (global[pref.idx()], global[pref.other().idx()]) else {
            return false;
        };
        if !self.leaves(pref, cp, ca) {
            self.leave_since = None;
            return false;
        }
        let since = *self.leave_since.get_or_insert(now);
        let confirmed = now.saturating_sub(since) >= self.cfg.confirm_ns;
        // A far cheaper path skips the dwell that flapping added, never the
        // configured minimum: at most one switch per `min_dwell_ns` still.
        let rested = self.last_switch.is_none_or(|t| {
            let since = now.saturating_sub(t);
            since >= self.dwell_ns || (since >= self.cfg.min_dwell_ns && ca * DWELL_BYPASS_RATIO < cp)
        });
        if confirmed && rested {
            self.switch_to(pref.other(), now);
            return true;
        }
        false
    }

    fn switch_to(&mut self, p: Path, now: u64) {
        if self.preferred != p {
            let calm = self.dwell_ns.saturating_mul(FLAP_WINDOW_DWELLS);
            self.dwell_ns = match self.last_switch {
                Some(t) if now.saturating_sub(t) < calm => self
                    .dwell_ns
                    .saturating_mul(2)
                    .clamp(self.cfg.min_dwell_ns, MAX_FLAP_DWELL_NS.max(self.cfg.min_dwell_ns)),
                _ => self.cfg.min_dwell_ns,
            };
            self.preferred = p;
            self.last_switch = Some(now);
            self.leave_since = None;
            self.switches += 1;
        }
    }

    fn probe_due(&self, now: u64, p: Path, far: bool) -> Option<Path> {
        let st = &self.paths[p.idx()];
        if !st.usable || st.probe_in_flight {
            return None;
        }
        if st.down {
            return (now >= st.retry_at).then_some(p);
        }
        let interval = if far && !st.good_news { self.cfg.far_probe_interval_ns } else { self.cfg.probe_interval_ns };
        st.last_probe.is_none_or(|t| now.saturating_sub(t) >= interval).then_some(p)
    }

    /// Expected completion time of a GET on `path`, in ns; `None` before
    /// the path has been measured. `key` prices that key's own history.
    pub fn cost(&self, path: Path, key: Option<u64>, now: u64) -> Option<f64> {
        self.cost_with(path, key, None, now)
    }

    fn cost_with(&self, path: Path, key: Option<u64>, expected: Option<f64>, now: u64) -> Option<f64> {
        let st = &self.paths[path.idx()];
        let mut delay = st.delay.smoothed()?;
        if path != self.preferred {
            delay = delay.max(self.loaded(path).unwrap_or(0.0));
        }
        let rounds = match path {
            Path::Rpc => 1.0,
            Path::OneSided => key.and_then(|k| self.keys.get(k, now)).or(expected).unwrap_or(st.rounds),
        };
        Some(delay * rounds + self.queue_wait(st, rounds))
    }

    /// What `path`, now measured only by probes (one GET at a time, none
    /// of this client's load), would show if it carried this client's
    /// GETs: its base delay scaled by how far this client's load lifts the
    /// preferred path above its own base. Without it an idle path always
    /// looks cheaper than the loaded one, and a client moves its load back
    /// and forth. A path congested by others still shows its probes' delay
    /// (the larger of the two counts).
    fn loaded(&self, path: Path) -> Option<f64> {
        let cur = &self.paths[self.preferred.idx()];
        let lift = cur.delay.smoothed()? / cur.delay.base()?.max(1) as f64;
        Some(self.paths[path.idx()].delay.base()? as f64 * lift.clamp(1.0, MAX_LIFT))
    }

    /// How long a new GET would wait for a window slot: the GETs ahead of
    /// it beyond the window, drained a window per service time.
    fn queue_wait(&self, st: &PathState, rounds: f64) -> f64 {
        let cwnd = st.window.cwnd();
        let ahead = f64::from(st.in_flight + st.queued) + 1.0 - cwnd;
        if ahead <= 0.0 {
            return 0.0;
        }
        ahead / cwnd * st.delay.smoothed().unwrap_or(UNKNOWN_DELAY_NS) * rounds
    }

    /// Takes a window slot on `path` for a caller's GET, if one is free.
    /// On `false` the caller queues ([`Controller::enqueue`]) and tries
    /// again when a GET on that path ends.
    pub fn try_admit(&mut self, path: Path) -> bool {
        let st = &mut self.paths[path.idx()];
        if st.window.allows(st.in_flight) {
            st.in_flight += 1;
            true
        } else {
            false
        }
    }

    /// A GET starts waiting for a window slot on `path`.
    pub fn enqueue(&mut self, path: Path) {
        self.paths[path.idx()].queued += 1;
    }

    /// GETs waiting for a window slot on `path`.
    pub fn queued(&self, path: Path) -> u32 {
        self.paths[path.idx()].queued
    }

    /// A GET stops waiting for a window slot on `path`.
    pub fn dequeue(&mut self, path: Path) {
        let st = &mut self.paths[path.idx()];
        debug_assert!(st.queued > 0, "dequeue without enqueue");
        st.queued = st.queued.saturating_sub(1);
    }

    fn end(&mut self, path: Path, probe: bool) {
        let st = &mut self.paths[path.idx()];
        if probe {
            debug_assert!(st.probe_in_flight, "probe ended twice");
            st.probe_in_flight = false;
            st.probes += 1;
        } else {
            debug_assert!(st.in_flight > 0, "GET ended without admission");
            st.in_flight = st.in_flight.saturating_sub(1);
            st.requests += 1;
        }
    }

    /// A GET (or probe) on `path` for `key` was answered.
    pub fn on_complete(&mut self, now: u64, path: Path, key: u64, probe: bool, c: Completion) {
        self.end(path, probe);
        let rounds = c.round_trips.max(1);
        let per_round = c.latency_ns / u64::from(rounds);
        let window_cfg = self.cfg.window;
        let st = &mut self.paths[path.idx()];
        if probe {
            st.good_news = st.delay.smoothed().is_some_and(|s| (per_round as f64) < s / 2.0);
        }
        st.delay.on_sample(now, per_round);
        let base = st.delay.base().unwrap_or(per_round);
        let srtt = st.delay.smoothed().unwrap_or(per_round as f64) as u64;
        st.window.on_ack(now, per_round, window_cfg.target(base), srtt);
        st.retries += u64::from(c.retries);
        if st.down {
            st.down = false;
            st.backoff = self.cfg.backoff_ns;
        }
        if path == Path::OneSided {
            // A plain mean until there are enough samples, so the prior
            // does not outweigh the first measurements for long.
            st.round_samples = st.round_samples.saturating_add(1);
            let weight = (1.0 / f64::from(st.round_samples)).max(ROUNDS_SMOOTHING);
            st.rounds += weight * (f64::from(rounds) - st.rounds);
            self.keys.record(key, f64::from(rounds), now);
        }
    }

    /// A GET (or probe) on `path` failed: the connection broke or it timed
    /// out. Traffic moves to the other path at once; this one is probed
    /// again after a backoff.
    pub fn on_failure(&mut self, now: u64, path: Path, probe: bool) {
        if probe {
            let st = &mut self.paths[path.idx()];
            st.probe_in_flight = false;
            st.probes += 1;
        } else {
            self.end(path, false);
        }
        let st = &mut self.paths[path.idx()];
        st.failures += 1;
        let srtt = st.delay.smoothed().unwrap_or(0.0) as u64;
        st.window.on_failure(now, srtt);
        // The backoff doubles per failed probe only: the other GETs that
        // were out when the path broke fail too, and counting them would
        // put the first probe at the cap instead of after one backoff.
        if !st.down {
            st.down = true;
            st.backoff = self.cfg.backoff_ns;
            st.retry_at = now.saturating_add(st.backoff);
        } else if probe {
            st.backoff = st.backoff.saturating_mul(2).min(self.cfg.max_backoff_ns);
            st.retry_at = now.saturating_add(st.backoff);
        }
        if self.preferred == path && self.serving(path.other()) {
            self.switch_to(path.other(), now);
        }
    }

    /// A GET on `path` was abandoned by its caller before it ended; it
    /// frees its slot and teaches nothing.
    pub fn on_cancel(&mut self, path: Path, probe: bool) {
        let st = &mut self.paths[path.idx()];
        if probe {
            st.probe_in_flight = false;
        } else {
            st.in_flight = st.in_flight.saturating_sub(1);
        }
    }

    /// Starts a caller's GET on `path` without asking the window: for
    /// clients whose path is fixed (measured, not steered) and for GETs
    /// that waited too often.
    pub fn start(&mut self, path: Path) {
        self.paths[path.idx()].in_flight += 1;
    }

    /// The path GETs go by default now.
    pub fn preferred(&self) -> Path {
        self.preferred
    }

    /// The target delay of `path`, once it has a base delay.
    pub fn target(&self, path: Path) -> Option<u64> {
        self.paths[path.idx()].delay.base().map(|b| self.cfg.window.target(b))
    }

    /// The smoothed round-trip delay of `path`, once measured.
    pub fn delay(&self, path: Path) -> Option<f64> {
        self.paths[path.idx()].delay.smoothed()
    }

    /// Counters and state.
    pub fn stats(&self) -> ControllerStats {
        let snap = |p: Path| {
            let st = &self.paths[p.idx()];
            PathSnapshot {
                requests: st.requests,
                probes: st.probes,
                failures: st.failures,
                retries: st.retries,
                diverted: st.diverted,
                window: st.window.cwnd(),
                in_flight: st.in_flight,
                queued: st.queued,
                base_delay_ns: st.delay.base().unwrap_or(0),
                delay_ns: st.delay.smoothed().unwrap_or(0.0) as u64,
                target_ns: self.target(p).unwrap_or(0),
                round_trips: st.rounds,
                usable: st.usable && !st.down,
            }
        };
        ControllerStats {
            one_sided: snap(Path::OneSided),
            rpc: snap(Path::Rpc),
            preferred: self.preferred,
            switches: self.switches,
        }
    }
}

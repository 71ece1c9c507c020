//! Path selection in the client: which way each GET goes, and which
//! connection carries it.
//!
//! The decisions are made by the pure [`Controller`] of
//! `dmkv_common::path`; this module feeds it real time and real
//! completions, makes GETs wait when a path's window is full, and replaces
//! connections that stay congested ([`ConnHealth`], PLB-style).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use dmkv_common::path::Path;
use dmkv_common::path::{Choice, Completion, Controller, ControllerStats, DelayEstimator, PathConfig, Repath};
use tokio::sync::Notify;

/// Most times one GET goes back to waiting for a window slot before it is
/// let through regardless; waiting is also bounded by the request timeout.
pub const MAX_ADMISSION_WAITS: u32 = 1024;

/// A stable hash of a key, to remember its one-sided round trips.
pub fn selector_hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key)
}

/// The controller of one client, with a clock and wake-ups for GETs that
/// wait for a window slot.
pub struct PathSelector {
    ctl: Mutex<Controller>,
    clock: Instant,
    wake: [Notify; 2],
    /// GETs of a fixed path that the controller does not see (see
    /// [`PathSelector::admit_sampled`]), by path.
    fixed: [AtomicU64; 2],
    /// GETs offered to [`PathSelector::admit_sampled`].
    sampled: AtomicU64,
}

/// One in this many GETs on an unsteered path is measured.
pub const FIXED_SAMPLE: u64 = 64;

/// A GET that holds a window slot on [`Admission::path`]. Dropping it
/// without [`Admission::complete`] or [`Admission::fail`] (the caller gave
/// up) frees the slot and teaches the controller nothing.
pub struct Admission {
    sel: Arc<PathSelector>,
    /// The path the GET takes.
    pub path: Path,
    key: u64,
    probe: bool,
    start: Instant,
    done: bool,
}

impl PathSelector {
    /// A selector with neither path usable yet.
    pub fn new(cfg: PathConfig) -> Arc<Self> {
        Arc::new(PathSelector {
            ctl: Mutex::new(Controller::new(cfg)),
            clock: Instant::now(),
            wake: [Notify::new(), Notify::new()],
            fixed: [AtomicU64::new(0), AtomicU64::new(0)],
            sampled: AtomicU64::new(0),
        })
    }

    fn now(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Controller> {
        self.ctl.lock().expect("path controller poisoned")
    }

    /// Says whether `path` exists (one-sided reads attached, say).
    pub fn set_usable(&self, path: Path, usable: bool) {
        self.lock().set_usable(path, usable);
        self.wake[path.other().idx()].notify_waiters();
    }

    /// Picks a path for a GET of `key` and takes a slot in its window,
    /// waiting while the chosen path's window is full (and choosing again
    /// after each wait: the other path may have become cheaper). `rounds`
    /// is what a one-sided GET of this key is expected to take (1 with its
    /// address cached, else 2). Returns the admission and the probes to
    /// send in the background; `None` when `deadline` passed first.
    pub async fn admit(
        self: &Arc<Self>,
        key: u64,
        rounds: Option<f64>,
        deadline: tokio::time::Instant,
    ) -> Option<(Admission, Vec<Admission>)> {
        let mut probes = Vec::new();
        for _ in 0..MAX_ADMISSION_WAITS {
            let (path, wait) = {
                let mut ctl = self.lock();
                let Choice { path, probe } = ctl.choose_priced(self.now(), key, rounds);
                if let Some(p) = probe {
                    probes.push(self.ticket(p, key, true));
                }
                if ctl.try_admit(path) {
                    return Some((self.ticket(path, key, false), probes));
                }
                ctl.enqueue(path);
                // Registered before the lock is released, so a completion
                // between here and the await still wakes this GET.
                (path, self.wake[path.idx()].notified())
            };
            let woke = tokio::time::timeout_at(deadline, wait).await.is_ok();
            self.lock().dequeue(path);
            if !woke {
                return None;
            }
        }
        let mut ctl = self.lock();
        let path = ctl.choose_priced(self.now(), key, rounds).path;
        ctl.start(path);
        Some((self.ticket(path, key, false), probes))
    }

    /// Admits a GET on `path` whatever its window says: for clients whose
    /// read path is fixed, which are measured but not steered.
    pub fn admit_fixed(self: &Arc<Self>, path: Path, key: u64) -> Admission {
        self.lock().start(path);
        self.ticket(path, key, false)
    }

    fn ticket(self: &Arc<Self>, path: Path, key: u64, probe: bool) -> Admission {
        Admission { sel: Arc::clone(self), path, key, probe, start: Instant::now(), done: false }
    }

    /// The path GETs go by default now.
    pub fn preferred(&self) -> Path {
        self.lock().preferred()
    }

    /// Admits a GET on a path nothing steers (a fixed read path, or shared
    /// memory), measuring one in [`FIXED_SAMPLE`]: the others are only
    /// counted. Steering needs no measurement when there is nothing to
    /// steer, and the controller's lock and clock reads were a seventh of
    /// an RPC GET's cost; the sampled ones keep its estimates (delay,
    /// window) alive for operators.
    pub fn admit_sampled(self: &Arc<Self>, path: Path, key: &[u8]) -> Option<Admission> {
        if self.sampled.fetch_add(1, Ordering::Relaxed).is_multiple_of(FIXED_SAMPLE) {
            return Some(self.admit_fixed(path, selector_hash(key)));
        }
        self.fixed[path.idx()].fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Counts a GET on `path` that is not measured at all (the
    /// synchronous local GETs, which take no clock reads for it).
    pub fn count_unmeasured(&self, path: Path) {
        self.fixed[path.idx()].fetch_add(1, Ordering::Relaxed);
    }

    /// Counters and state of the controller; GETs only counted by
    /// [`PathSelector::admit_sampled`] are in `requests`.
    pub fn stats(&self) -> ControllerStats {
        let mut st = self.lock().stats();
        st.one_sided.requests += self.fixed[Path::OneSided.idx()].load(Ordering::Relaxed);
        st.rpc.requests += self.fixed[Path::Rpc.idx()].load(Ordering::Relaxed);
        st
    }
}

impl Admission {
    /// The GET was answered after `round_trips`, of which `retries` were
    /// spent on attempts that had to be retried.
    pub fn complete(self, round_trips: u32, retries: u32) {
        let latency_ns = self.start.elapsed().as_nanos() as u64;
        self.complete_after(latency_ns, round_trips, retries);
    }

    /// [`Admission::complete`] for a caller that measured the latency from
    /// [`Admission::started`] already (one clock read fewer).
    pub fn complete_after(mut self, latency_ns: u64, round_trips: u32, retries: u32) {
        self.done = true;
        let c = Completion { latency_ns, round_trips, retries };
        // The selector's clock: the admission's start plus its latency.
        let now = (self.start.saturating_duration_since(self.sel.clock).as_nanos() as u64).saturating_add(latency_ns);
        let waiting = {
            let mut ctl = self.sel.lock();
            ctl.on_complete(now, self.path, self.key, self.probe, c);
            ctl.queued(self.path) > 0
        };
        // Waking is a lock of its own: skip it when nobody waits.
        if waiting {
            self.sel.wake[self.path.idx()].notify_waiters();
        }
    }

    /// When the GET was admitted.
    pub fn started(&self) -> Instant {
        self.start
    }

    /// Whether this is a background probe of a path, not a caller's GET.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// The path failed under this GET (connection lost, timeout).
    pub fn fail(mut self) {
        self.done = true;
        let now = self.sel.now();
        self.sel.lock().on_failure(now, self.path, self.probe);
        self.sel.wake[0].notify_waiters();
        self.sel.wake[1].notify_waiters();
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if !self.done {
            let waiting = {
                let mut ctl = self.sel.lock();
                ctl.on_cancel(self.path, self.probe);
                ctl.queued(self.path) > 0
            };
            if waiting {
                self.sel.wake[self.path.idx()].notify_waiters();
            }
        }
    }
}

/// Congestion of each connection of a pool, for PLB-style repathing: a
/// connection whose round trips stay above the pool's target delay for
/// several rounds is replaced by a fresh one (new ports: on a real fabric,
/// a new ECMP path).
pub struct ConnHealth {
    state: Mutex<(DelayEstimator, Vec<Repath>)>,
    cfg: PathConfig,
    clock: Instant,
    repaths: Arc<AtomicU64>,
    /// Round trips offered to [`ConnHealth::sample_next`], per connection
    /// (one count for the pool would sample the same slot every time when
    /// the pool's size divides [`HEALTH_SAMPLE`]).
    offered: Vec<AtomicU64>,
}

/// One round trip in this many is timed for [`ConnHealth`] by a caller that
/// asks [`ConnHealth::sample_next`]: the sample's lock, estimator and clock
/// read were about 3 % of a forced-RPC GET's client CPU. A round (at least
/// [`dmkv_common::path::repath::MIN_ROUND_NS`]) closes only on a sample,
/// so at low rates rounds are longer, not missed.
pub const HEALTH_SAMPLE: u64 = 4;

impl ConnHealth {
    /// Health of a pool of `conns` connections; repaths are counted in
    /// `repaths`.
    pub fn new(conns: usize, cfg: PathConfig, repaths: Arc<AtomicU64>) -> Self {
        ConnHealth {
            state: Mutex::new((DelayEstimator::new(), vec![Repath::new(); conns])),
            cfg,
            clock: Instant::now(),
            repaths,
            offered: (0..conns).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Whether the caller's next round trip on connection `conn` is one to
    /// time and record (one in [`HEALTH_SAMPLE`] of each connection's).
    pub fn sample_next(&self, conn: usize) -> bool {
        self.offered.get(conn).is_some_and(|n| n.fetch_add(1, Ordering::Relaxed).is_multiple_of(HEALTH_SAMPLE))
    }

    /// Records a round trip of `delay_ns` on connection `conn`; true when
    /// that connection should be replaced now.
    pub fn record(&self, conn: usize, delay_ns: u64) -> bool {
        self.record_at(self.clock.elapsed().as_nanos() as u64, conn, delay_ns)
    }

    /// [`ConnHealth::record`] of a round trip that ended at `end` (saves
    /// the caller's clock read).
    pub fn record_ended(&self, end: Instant, conn: usize, delay_ns: u64) -> bool {
        self.record_at(end.saturating_duration_since(self.clock).as_nanos() as u64, conn, delay_ns)
    }

    fn record_at(&self, now: u64, conn: usize, delay_ns: u64) -> bool {
        let mut st = self.state.lock().expect("conn health poisoned");
        let (delay, conns) = &mut *st;
        delay.on_sample(now, delay_ns);
        let (Some(base), Some(srtt)) = (delay.base(), delay.smoothed()) else { return false };
        let target = self.cfg.window.target(base);
        let Some(r) = conns.get_mut(conn) else { return false };
        let repath = r.on_sample(now, delay_ns, target, srtt as u64, self.cfg.repath_rounds);
        if repath {
            self.repaths.fetch_add(1, Ordering::Relaxed);
        }
        repath
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sampling caller times one round trip in [`HEALTH_SAMPLE`] of each
    /// connection, starting with its first, whatever the pool's size: round
    /// robin over two or four connections would otherwise sample only one.
    #[test]
    fn every_connection_has_one_round_trip_in_health_sample_timed() {
        for conns in [1, 2, 3, 4, 8] {
            let h = ConnHealth::new(conns, PathConfig::default(), Arc::default());
            let mut timed = vec![0u64; conns];
            for k in 0..HEALTH_SAMPLE as usize * 10 * conns {
                if h.sample_next(k % conns) {
                    timed[k % conns] += 1;
                }
            }
            assert_eq!(timed, vec![10; conns], "{conns} connections");
        }
        let h = ConnHealth::new(2, PathConfig::default(), Arc::default());
        assert!(!h.sample_next(2), "a connection the pool does not have is sampled");
    }
}

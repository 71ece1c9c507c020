//! Deterministic simulations of `dmkv_common::path::Controller` on a virtual
//! clock: two queueing paths, a closed loop of callers, background load and
//! failures switched on and off at given times. Every run is a function of
//! its seed; a failing assertion prints the seed, and `PATH_SIM_SEED=<n>`
//! reruns every simulation with that seed alone.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use dmkv_common::path::{Choice, Completion, Controller, MICROS, MILLIS, Path, PathConfig};
#[allow(unused_imports)]
use proptest::prelude::*;

// ---------------------------------------------------------------- PRNG

/// splitmix64: tiny, seedable, good enough for noise and key choice.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Exponentially distributed with the given mean.
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

/// Seeds each simulation runs with, or the one in `PATH_SIM_SEED`.
fn seeds(defaults: &[u64]) -> Vec<u64> {
    match std::env::var("PATH_SIM_SEED") {
        Ok(s) => vec![s.trim().parse().expect("PATH_SIM_SEED must be an integer")],
        Err(_) => defaults.to_vec(),
    }
}

fn idx(p: Path) -> usize {
    match p {
        Path::OneSided => 0,
        Path::Rpc => 1,
    }
}

// ---------------------------------------------------------------- model

/// A path as a FIFO server with `workers` parallel workers behind a
/// propagation delay that carries the noise (scheduling, the network).
#[derive(Debug, Clone, Copy)]
struct PathModel {
    /// Round-trip propagation, split evenly around the server.
    prop_ns: u64,
    service_ns: u64,
    workers: usize,
    /// Propagation is scaled by a uniform factor in [1 - noise, 1 + noise]...
    noise: f64,
    /// ...and with this probability by `outlier_factor` on top.
    outlier_p: f64,
    outlier_factor: f64,
}

impl PathModel {
    fn new(prop_ns: u64, service_ns: u64, workers: usize) -> Self {
        PathModel { prop_ns, service_ns, workers, noise: 0.0, outlier_p: 0.0, outlier_factor: 1.0 }
    }

    fn noisy(self, noise: f64, outlier_p: f64, outlier_factor: f64) -> Self {
        PathModel { noise, outlier_p, outlier_factor, ..self }
    }

    /// Loopback TCP-like: tens of microseconds, a few server workers.
    fn loopback() -> Self {
        Self::new(40 * MICROS, 8 * MICROS, 2)
    }
}

/// What is happening to a path now; tests change it between steps.
#[derive(Debug, Clone, Copy)]
struct Cond {
    /// Service time multiplier (a slower server, a busy NIC).
    slowdown: f64,
    /// Background jobs per millisecond competing in the same FIFO.
    bg_per_ms: f64,
    /// Everything sent fails after `fail_ns`.
    down: bool,
}

impl Default for Cond {
    fn default() -> Self {
        Cond { slowdown: 1.0, bg_per_ms: 0.0, down: false }
    }
}

/// Key hashes: index 0 is the hot key.
fn key_hash(i: u64) -> u64 {
    Rng(i ^ 0x5eed).next_u64()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A caller starts a GET (or retries a failed one).
    Issue(usize),
    /// An op's request reaches the path's server.
    Arrive(usize),
    /// An op's round trip ends back at the client.
    Return(usize),
    /// An op fails (down path).
    Fail(usize),
    /// A background job arrives at a path's server.
    Bg(usize),
}

#[derive(Debug, Clone, Copy)]
struct Op {
    caller: Option<usize>,
    path: Path,
    key: u64,
    start: u64,
    rounds: u32,
    done: u32,
}

/// One served GET: when it was admitted and where.
#[derive(Debug, Clone, Copy)]
struct Served {
    at: u64,
    path: Path,
    key: u64,
}

/// The controller's view after one completion on a path.
#[derive(Debug, Clone, Copy)]
struct Ack {
    at: u64,
    path: Path,
    probe: bool,
    per_round: u64,
    cwnd: f64,
    srtt: f64,
}

struct Sim {
    seed: u64,
    rng: Rng,
    now: u64,
    seq: u64,
    events: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    budget: u64,
    ctl: Controller,
    model: [PathModel; 2],
    cond: [Cond; 2],
    /// When each worker of each path's server is next free.
    free_at: [Vec<u64>; 2],
    bg_pending: [bool; 2],
    ops: Vec<Op>,
    free_ops: Vec<usize>,
    /// Callers waiting for a window slot, with the key they want.
    waiters: [VecDeque<(usize, u64)>; 2],
    in_flight: [u32; 2],
    probes_out: [bool; 2],
    /// Think time between GETs, distinct keys, hot key share.
    think_ns: u64,
    keys: u64,
    hot_share: f64,
    /// One-sided round trips of the hot key: uniform in this range.
    hot_rounds: (u32, u32),
    fail_ns: u64,
    served: Vec<Served>,
    acks: Vec<Ack>,
    probes: Vec<(u64, Path)>,
    /// Failures: when, where, whether of a probe.
    failures: Vec<(u64, Path, bool)>,
    record_acks: bool,
}

impl Sim {
    fn new(seed: u64, cfg: PathConfig, os: PathModel, rpc: PathModel, callers: usize) -> Self {
        let mut ctl = Controller::new(cfg);
        ctl.set_usable(Path::OneSided, true);
        ctl.set_usable(Path::Rpc, true);
        let mut sim = Sim {
            seed,
            rng: Rng(seed),
            now: 0,
            seq: 0,
            events: BinaryHeap::new(),
            budget: 3_000_000,
            ctl,
            model: [os, rpc],
            cond: [Cond::default(); 2],
            free_at: [vec![0; os.workers], vec![0; rpc.workers]],
            bg_pending: [false; 2],
            ops: Vec::new(),
            free_ops: Vec::new(),
            waiters: [VecDeque::new(), VecDeque::new()],
            in_flight: [0; 2],
            probes_out: [false; 2],
            think_ns: 0,
            keys: 1_000,
            hot_share: 0.0,
            hot_rounds: (2, 4),
            fail_ns: 200 * MICROS,
            served: Vec::new(),
            acks: Vec::new(),
            probes: Vec::new(),
            failures: Vec::new(),
            record_acks: false,
        };
        for c in 0..callers {
            // Staggered starts so callers do not move in lockstep.
            let at = sim.rng.below(10 * MICROS);
            sim.push(at, Ev::Issue(c));
        }
        sim
    }

    fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, ev)));
    }

    fn set_cond(&mut self, p: Path, c: Cond) {
        self.cond[idx(p)] = c;
        if c.bg_per_ms > 0.0 && !self.bg_pending[idx(p)] {
            self.bg_pending[idx(p)] = true;
            self.push(self.now, Ev::Bg(idx(p)));
        }
    }

    /// Processes every event up to `until`, within the event budget.
    fn run_until(&mut self, until: u64) {
        while let Some(&Reverse((at, _, ev))) = self.events.peek() {
            if at > until {
                break;
            }
            self.events.pop();
            assert!(self.budget > 0, "seed {}: event budget exhausted at {} ns", self.seed, self.now);
            self.budget -= 1;
            assert!(at >= self.now, "seed {}: time went backwards", self.seed);
            self.now = at;
            match ev {
                Ev::Issue(c) => self.issue(c),
                Ev::Arrive(o) => self.arrive(o),
                Ev::Return(o) => self.round_trip_back(o),
                Ev::Fail(o) => self.fail(o),
                Ev::Bg(p) => self.background(p),
            }
        }
        self.now = self.now.max(until);
    }

    fn pick_key(&mut self) -> u64 {
        if self.hot_share > 0.0 && self.rng.unit() < self.hot_share { 0 } else { 1 + self.rng.below(self.keys) }
    }

    fn issue(&mut self, caller: usize) {
        let key = self.pick_key();
        self.route(caller, key);
    }

    /// choose → probe → try_admit, or queue behind the path's window.
    fn route(&mut self, caller: usize, key: u64) {
        let Choice { path, probe } = self.ctl.choose(self.now, key_hash(key));
        if let Some(p) = probe {
            assert!(!self.probes_out[idx(p)], "seed {}: second probe on {p:?} at {}", self.seed, self.now);
            assert_ne!(p, path, "seed {}: probe of the chosen path", self.seed);
            self.probes_out[idx(p)] = true;
            self.probes.push((self.now, p));
            self.start(None, p, key);
        }
        if self.ctl.try_admit(path) {
            self.in_flight[idx(path)] += 1;
            self.served.push(Served { at: self.now, path, key });
            self.start(Some(caller), path, key);
        } else {
            self.ctl.enqueue(path);
            self.waiters[idx(path)].push_back((caller, key));
        }
    }

    fn start(&mut self, caller: Option<usize>, path: Path, key: u64) {
        let rounds = match path {
            Path::Rpc => 1,
            Path::OneSided if key == 0 && self.hot_share > 0.0 => {
                let (lo, hi) = self.hot_rounds;
                lo + self.rng.below(u64::from(hi - lo + 1)) as u32
            }
            Path::OneSided => 1,
        };
        let op = Op { caller, path, key, start: self.now, rounds, done: 0 };
        let o = match self.free_ops.pop() {
            Some(o) => {
                self.ops[o] = op;
                o
            }
            None => {
                self.ops.push(op);
                self.ops.len() - 1
            }
        };
        self.send(o);
    }

    /// Sends one round trip of op `o`.
    fn send(&mut self, o: usize) {
        let p = idx(self.ops[o].path);
        if self.cond[p].down {
            self.push(self.now + self.fail_ns, Ev::Fail(o));
            return;
        }
        let half = self.noisy_prop(p) / 2;
        self.push(self.now + half, Ev::Arrive(o));
    }

    fn noisy_prop(&mut self, p: usize) -> u64 {
        let m = self.model[p];
        let mut f = 1.0 + m.noise * (2.0 * self.rng.unit() - 1.0);
        if m.outlier_p > 0.0 && self.rng.unit() < m.outlier_p {
            f *= m.outlier_factor;
        }
        (m.prop_ns as f64 * f) as u64
    }

    /// Queues a job at path `p`'s server; returns when its service ends.
    fn serve(&mut self, p: usize) -> u64 {
        let service = (self.model[p].service_ns as f64 * self.cond[p].slowdown) as u64;
        let (w, &free) = self.free_at[p].iter().enumerate().min_by_key(|&(_, t)| *t).expect("a worker");
        let end = free.max(self.now) + service;
        self.free_at[p][w] = end;
        end
    }

    fn arrive(&mut self, o: usize) {
        let p = idx(self.ops[o].path);
        let end = self.serve(p);
        let half = self.noisy_prop(p) / 2;
        self.push(end + half, Ev::Return(o));
    }

    fn background(&mut self, p: usize) {
        let rate = self.cond[p].bg_per_ms;
        if rate <= 0.0 {
            self.bg_pending[p] = false;
            return;
        }
        self.serve(p);
        let gap = self.rng.exp(MILLIS as f64 / rate) as u64;
        self.push(self.now + gap.max(1), Ev::Bg(p));
    }

    fn round_trip_back(&mut self, o: usize) {
        let path = self.ops[o].path;
        if self.cond[idx(path)].down {
            // The connection broke while the round trip was out.
            return self.fail(o);
        }
        self.ops[o].done += 1;
        let op = self.ops[o];
        if op.done < op.rounds {
            return self.send(o);
        }
        let c = Completion {
            latency_ns: self.now - op.start,
            round_trips: op.rounds,
            retries: op.rounds.saturating_sub(2),
        };
        let probe = op.caller.is_none();
        self.ctl.on_complete(self.now, path, key_hash(op.key), probe, c);
        if self.record_acks {
            let p = self.ctl.stats();
            let snap = if path == Path::OneSided { p.one_sided } else { p.rpc };
            self.acks.push(Ack {
                at: self.now,
                path,
                probe,
                per_round: c.latency_ns / u64::from(op.rounds),
                cwnd: snap.window,
                srtt: self.ctl.delay(path).unwrap_or(0.0),
            });
        }
        self.finish(o, op, true);
    }

    fn fail(&mut self, o: usize) {
        let op = self.ops[o];
        self.ctl.on_failure(self.now, op.path, op.caller.is_none());
        self.failures.push((self.now, op.path, op.caller.is_none()));
        self.finish(o, op, false);
    }

    fn finish(&mut self, o: usize, op: Op, ok: bool) {
        self.free_ops.push(o);
        let p = idx(op.path);
        match op.caller {
            None => self.probes_out[p] = false,
            Some(c) => {
                self.in_flight[p] -= 1;
                if ok {
                    self.push(self.now + self.think_ns, Ev::Issue(c));
                } else {
                    // The caller retries the same key; the controller decides where.
                    self.route(c, op.key);
                }
                self.wake(op.path);
            }
        }
        self.check_counts();
    }

    /// A slot may have freed on `path`: waiters choose again, in order,
    /// until one has to queue again.
    fn wake(&mut self, path: Path) {
        for _ in 0..self.waiters[idx(path)].len() {
            let Some((c, key)) = self.waiters[idx(path)].pop_front() else { break };
            self.ctl.dequeue(path);
            let queued_before = self.waiters[0].len() + self.waiters[1].len();
            self.route(c, key);
            if self.waiters[0].len() + self.waiters[1].len() > queued_before {
                break;
            }
        }
    }

    fn check_counts(&self) {
        let s = self.ctl.stats();
        for (p, snap) in [(Path::OneSided, s.one_sided), (Path::Rpc, s.rpc)] {
            let i = idx(p);
            assert_eq!(snap.in_flight, self.in_flight[i], "seed {}: in_flight of {p:?}", self.seed);
            assert_eq!(snap.queued as usize, self.waiters[i].len(), "seed {}: queued of {p:?}", self.seed);
            assert!(
                snap.window.is_finite() && snap.window >= self.ctl.config().window.min,
                "seed {}: window {}",
                self.seed,
                snap.window
            );
        }
    }

    /// Share of GETs served in [from, to) that went `path`, and how many.
    fn share(&self, from: u64, to: u64, path: Path) -> (f64, usize) {
        let sel = self.served.iter().filter(|s| s.at >= from && s.at < to);
        let (n, hit) = sel.fold((0, 0), |(n, h), s| (n + 1, h + usize::from(s.path == path)));
        (if n == 0 { 0.0 } else { hit as f64 / n as f64 }, n)
    }
}

fn mean(xs: impl IntoIterator<Item = f64>) -> f64 {
    let (n, s) = xs.into_iter().fold((0usize, 0.0), |(n, s), x| (n + 1, s + x));
    if n == 0 { f64::NAN } else { s / n as f64 }
}

// ---------------------------------------------------------------- tests

/// A bottleneck of 4 µs per GET behind 40 µs of propagation: the target
/// (base + 100 µs) is reached at about 36 GETs in flight.
fn bottleneck() -> PathModel {
    PathModel::new(40 * MICROS, 4 * MICROS, 1).noisy(0.1, 0.0, 1.0)
}

/// A datacenter-fabric profile: Swift-like target of base + 100 µs. The
/// defaults allow 500 µs for the scheduling noise of loopback and VMs; the
/// window's dynamics are the same, only the operating point moves.
fn fabric() -> PathConfig {
    let mut cfg = PathConfig::default();
    cfg.window.target_margin_ns = 100 * MICROS;
    cfg.window.max = 256.0;
    cfg
}

fn one_path_sim(seed: u64, callers: usize) -> Sim {
    let m = bottleneck();
    let mut sim = Sim::new(seed, fabric(), m, m, callers);
    sim.ctl.set_usable(Path::Rpc, false);
    sim.record_acks = true;
    sim
}

#[test]
fn window_converges_to_target_under_steady_load() {
    for seed in seeds(&[1, 2]) {
        let mut sim = one_path_sim(seed, 128);
        sim.run_until(150 * MILLIS);
        let cfg = sim.ctl.config().window;
        let target = sim.ctl.target(Path::OneSided).expect("measured") as f64;
        let late: Vec<&Ack> =
            sim.acks.iter().filter(|a| a.path == Path::OneSided && !a.probe && a.at >= 75 * MILLIS).collect();
        let delay = mean(late.iter().map(|a| a.per_round as f64));
        let cwnd = mean(late.iter().map(|a| a.cwnd));
        let sd = mean(late.iter().map(|a| (a.cwnd - cwnd).powi(2))).sqrt();
        let (lo, hi) = late.iter().fold((f64::MAX, 0.0f64), |(lo, hi), a| (lo.min(a.cwnd), hi.max(a.cwnd)));
        eprintln!("seed {seed}: target {target} delay {delay:.0} cwnd {cwnd:.1} sd {sd:.2} [{lo:.1}, {hi:.1}]");
        assert!(delay > 0.7 * target && delay < 1.3 * target, "seed {seed}: delay {delay:.0} vs target {target}");
        assert!(lo > cfg.min && hi < cfg.max, "seed {seed}: window pinned, [{lo}, {hi}]");
        assert!(sd < 0.2 * cwnd, "seed {seed}: window oscillates: mean {cwnd:.1}, sd {sd:.1}");
    }
}

#[test]
fn window_backs_off_under_a_delay_spike_and_recovers() {
    for seed in seeds(&[3, 4]) {
        let mut sim = one_path_sim(seed, 128);
        let cfg = sim.ctl.config().window;
        sim.run_until(60 * MILLIS);
        let before = mean(sim.acks.iter().filter(|a| a.at >= 40 * MILLIS).map(|a| a.cwnd));
        let rtt = sim.ctl.delay(Path::OneSided).expect("measured");
        // Background jobs take ~75 % of the server.
        let spike = 60 * MILLIS;
        sim.set_cond(Path::OneSided, Cond { bg_per_ms: 190.0, ..Cond::default() });
        sim.run_until(100 * MILLIS);
        let end = 100 * MILLIS;
        sim.set_cond(Path::OneSided, Cond::default());
        sim.run_until(130 * MILLIS);

        let cwnd_at = |t: u64| sim.acks.iter().take_while(|a| a.at <= t).last().map_or(f64::NAN, |a| a.cwnd);
        let soon = spike + (10.0 * rtt) as u64;
        let during = mean(sim.acks.iter().filter(|a| a.at >= spike + 20 * MILLIS && a.at < end).map(|a| a.cwnd));
        let after = mean(sim.acks.iter().filter(|a| a.at >= end + 10 * MILLIS).map(|a| a.cwnd));
        eprintln!(
            "seed {seed}: rtt {rtt:.0} before {before:.1} at+10rtt {:.1} during {during:.1} after {after:.1}",
            cwnd_at(soon)
        );
        assert!(cwnd_at(soon) < 0.6 * before, "seed {seed}: window {} 10 RTTs into the spike", cwnd_at(soon));
        assert!(during < 0.5 * before && during > cfg.min, "seed {seed}: window {during:.1} during the spike");
        assert!(after > 0.8 * before, "seed {seed}: window {after:.1} after the spike, {before:.1} before");

        // Every decrease is at most max_decrease, and at least an RTT
        // (the smoothed delay the controller passed) after the last one.
        let mut last_decrease: Option<u64> = None;
        for w in sim.acks.windows(2) {
            if w[1].cwnd < w[0].cwnd {
                let f = w[1].cwnd / w[0].cwnd;
                assert!(f >= 1.0 - cfg.max_decrease - 1e-9, "seed {seed}: decrease by {f} at {}", w[1].at);
                if let Some(t) = last_decrease {
                    let gap = w[1].at - t;
                    assert!(
                        gap >= w[1].srtt as u64,
                        "seed {seed}: decreases {gap} ns apart at {}, rtt {}",
                        t,
                        w[1].srtt
                    );
                }
                last_decrease = Some(w[1].at);
            }
        }
    }
}

/// Share of one-sided GETs per `bucket` of virtual time, for failure output.
fn timeline(sim: &Sim, bucket: u64) -> String {
    let end = sim.now;
    (0..end.div_ceil(bucket))
        .map(|i| {
            let (s, n) = sim.share(i * bucket, (i + 1) * bucket, Path::OneSided);
            if n == 0 { "  -".to_string() } else { format!("{:3.0}", s * 100.0) }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn equal_paths(seed: u64) -> Sim {
    let m = PathModel::loopback().noisy(0.1, 0.0, 1.0);
    let mut sim = Sim::new(seed, PathConfig::default(), m, m, 8);
    sim.think_ns = 50 * MICROS;
    sim
}

#[test]
fn prefers_the_cheaper_path_and_comes_back() {
    for seed in seeds(&[5, 6]) {
        let mut sim = equal_paths(seed);
        let congested = Cond { slowdown: 20.0, ..Cond::default() };
        sim.run_until(200 * MILLIS);
        sim.set_cond(Path::OneSided, congested);
        sim.run_until(500 * MILLIS);
        sim.set_cond(Path::OneSided, Cond::default());
        sim.run_until(800 * MILLIS);
        let tl = timeline(&sim, 20 * MILLIS);
        eprintln!("seed {seed}: one-sided % per 20 ms: {tl}\n{:?}", sim.ctl.stats());
        let os = |from: u64, to: u64| sim.share(from * MILLIS, to * MILLIS, Path::OneSided).0;
        assert!(os(100, 200) > 0.95, "seed {seed}: equal paths should stay one-sided: {tl}");
        assert!(os(220, 500) < 0.05, "seed {seed}: congested one-sided still used after 20 ms: {tl}");
        assert!(os(600, 800) > 0.95, "seed {seed}: one-sided not taken back within 100 ms: {tl}");
        assert!(sim.ctl.stats().switches <= 4, "seed {seed}: {} switches: {tl}", sim.ctl.stats().switches);
    }
}

#[test]
fn a_slow_rpc_server_leaves_or_gives_the_traffic_to_one_sided() {
    for seed in seeds(&[7, 8]) {
        // RPC's server queues from the start: one-sided keeps the traffic.
        let mut sim = equal_paths(seed);
        sim.set_cond(Path::Rpc, Cond { slowdown: 10.0, ..Cond::default() });
        sim.run_until(200 * MILLIS);
        let tl = timeline(&sim, 20 * MILLIS);
        assert!(sim.share(0, 200 * MILLIS, Path::OneSided).0 > 0.99, "seed {seed}: {tl}");
        assert_eq!(sim.ctl.stats().switches, 0, "seed {seed}: {tl}");

        // RPC has the traffic (one-sided congested), then its server slows
        // as one-sided recovers: one-sided gets the traffic back.
        let mut sim = equal_paths(seed);
        sim.set_cond(Path::OneSided, Cond { slowdown: 20.0, ..Cond::default() });
        sim.run_until(200 * MILLIS);
        sim.set_cond(Path::OneSided, Cond::default());
        sim.set_cond(Path::Rpc, Cond { slowdown: 10.0, ..Cond::default() });
        sim.run_until(400 * MILLIS);
        let tl = timeline(&sim, 20 * MILLIS);
        eprintln!("seed {seed}: one-sided % per 20 ms: {tl}");
        let os = |from: u64, to: u64| sim.share(from * MILLIS, to * MILLIS, Path::OneSided).0;
        assert!(os(100, 200) < 0.05, "seed {seed}: {tl}");
        assert!(os(260, 400) > 0.95, "seed {seed}: one-sided not back 60 ms after RPC slowed: {tl}");
    }
}

/// Runs the simulation until `gets` GETs were served.
fn run_gets(sim: &mut Sim, gets: usize) {
    let mut t = 0;
    while sim.served.len() < gets {
        t += 10 * MILLIS;
        sim.run_until(t);
    }
}

fn noisy(prop_ns: u64) -> PathModel {
    PathModel::new(prop_ns, 4 * MICROS, 4).noisy(0.3, 0.002, 10.0)
}

#[test]
fn does_not_flap_under_noise() {
    for seed in seeds(&[9, 10]) {
        let mut sim = Sim::new(seed, PathConfig::default(), noisy(40 * MICROS), noisy(40 * MICROS), 8);
        sim.think_ns = 50 * MICROS;
        run_gets(&mut sim, 100_000);
        let s = sim.ctl.stats();
        let (os, n) = sim.share(0, sim.now, Path::OneSided);
        eprintln!("seed {seed}: {} switches in {n} GETs over {} ms, one-sided {os:.3}", s.switches, sim.now / MILLIS);
        assert!(s.switches <= 6, "seed {seed}: {} switches in {n} GETs: {}", s.switches, timeline(&sim, 50 * MILLIS));
    }
}

/// Two equal paths, each slowed by this client's own load (one worker, a
/// service time near the think time): the path not in use always looks
/// cheaper, so without damping the traffic changes path every dwell.
#[test]
fn trading_the_traffic_between_equal_loaded_paths_is_damped() {
    for seed in seeds(&[15, 16]) {
        let m = PathModel::new(40 * MICROS, 4 * MICROS, 4).noisy(0.5, 0.02, 20.0);
        let mut sim = Sim::new(seed, PathConfig::default(), m, m, 4);
        sim.think_ns = 0;
        sim.run_until(3_000 * MILLIS);
        let s = sim.ctl.stats();
        let tl = timeline(&sim, 100 * MILLIS);
        eprintln!("seed {seed}: {} switches in 3 s; one-sided % per 100 ms: {tl}", s.switches);
        // Undamped: a change every 50 ms dwell, about 60 in 3 s.
        assert!(s.switches <= 12, "seed {seed}: {} switches in 3 s: {tl}", s.switches);
        // Damping holds back only small differences: one path congested
        // twentyfold is left within 50 ms, whatever dwell flapping built.
        sim.set_cond(Path::OneSided, Cond { slowdown: 20.0, ..Cond::default() });
        sim.set_cond(Path::Rpc, Cond::default());
        sim.run_until(3_050 * MILLIS);
        sim.run_until(3_200 * MILLIS);
        let os = sim.share(3_050 * MILLIS, 3_200 * MILLIS, Path::OneSided).0;
        assert!(os < 0.05, "seed {seed}: congested one-sided still used 50 ms on: {}", timeline(&sim, 50 * MILLIS));
    }
}

#[test]
fn picks_the_path_twice_as_fast_under_noise() {
    for seed in seeds(&[11, 12]) {
        for better in Path::ALL {
            let (fast, slow) = (noisy(25 * MICROS), noisy(50 * MICROS));
            let (os, rpc) = if better == Path::OneSided { (fast, slow) } else { (slow, fast) };
            let mut sim = Sim::new(seed, PathConfig::default(), os, rpc, 8);
            sim.think_ns = 50 * MICROS;
            run_gets(&mut sim, 50_000);
            let (share, n) = sim.share(0, sim.now, better);
            let s = sim.ctl.stats();
            eprintln!("seed {seed}: {better:?} better: share {share:.3} of {n}, {} switches", s.switches);
            assert!(share > 0.95, "seed {seed}: {better:?} got {share:.3}: {}", timeline(&sim, 50 * MILLIS));
            assert!(s.switches <= 3, "seed {seed}: {better:?} better, {} switches", s.switches);
        }
    }
}

#[test]
fn a_hot_key_goes_rpc_while_the_others_stay_one_sided() {
    for seed in seeds(&[13, 14]) {
        let mut sim = equal_paths(seed);
        sim.hot_share = 0.05;
        sim.hot_rounds = (2, 4);
        sim.run_until(300 * MILLIS);
        let late = sim.served.iter().filter(|s| s.at >= 50 * MILLIS);
        let (mut hot, mut hot_rpc, mut cold, mut cold_os) = (0, 0, 0, 0);
        for s in late {
            if s.key == 0 {
                hot += 1;
                hot_rpc += usize::from(s.path == Path::Rpc);
            } else {
                cold += 1;
                cold_os += usize::from(s.path == Path::OneSided);
            }
        }
        let (h, c) = (hot_rpc as f64 / hot as f64, cold_os as f64 / cold as f64);
        eprintln!("seed {seed}: hot key on rpc {h:.3} of {hot}, others one-sided {c:.3} of {cold}");
        assert!(hot > 500 && h > 0.9, "seed {seed}: hot key on RPC for {h:.3} of {hot} GETs");
        assert!(c > 0.98, "seed {seed}: other keys one-sided for only {c:.3}");
        assert_eq!(sim.ctl.preferred(), Path::OneSided, "seed {seed}");
    }
}

#[test]
fn a_failed_path_is_left_at_once_probed_with_backoff_and_taken_back() {
    for seed in seeds(&[15, 16]) {
        let cfg = PathConfig { backoff_ns: 2 * MILLIS, max_backoff_ns: 20 * MILLIS, ..PathConfig::default() };
        let (os, rpc) = (PathModel::new(20 * MICROS, 4 * MICROS, 4), PathModel::new(50 * MICROS, 4 * MICROS, 4));
        let mut sim = Sim::new(seed, cfg, os, rpc, 8);
        sim.think_ns = 50 * MICROS;
        sim.run_until(100 * MILLIS);
        assert_eq!(sim.ctl.preferred(), Path::OneSided, "seed {seed}");
        let (down, up) = (100 * MILLIS, 300 * MILLIS);
        sim.set_cond(Path::OneSided, Cond { down: true, ..Cond::default() });
        // The first failures come fail_ns after the path went down.
        sim.run_until(down + sim.fail_ns + 10 * MICROS);
        assert_eq!(sim.ctl.preferred(), Path::Rpc, "seed {seed}: still one-sided right after a failure");
        sim.run_until(up);
        sim.set_cond(Path::OneSided, Cond::default());
        sim.run_until(400 * MILLIS);

        let tl = timeline(&sim, 10 * MILLIS);
        let os_share = |from: u64, to: u64| sim.share(from, to, Path::OneSided).0;
        assert!(os_share(down + MILLIS, up) == 0.0, "seed {seed}: GETs sent to a failed path: {tl}");

        // Probes of the failed path: the first a backoff after its first
        // failure, then each a doubled backoff after the last one failed,
        // up to the cap.
        let probes: Vec<u64> = sim.probes.iter().filter(|p| p.1 == Path::OneSided && p.0 > down).map(|p| p.0).collect();
        let failed_at =
            |probe: bool| sim.failures.iter().filter(move |f| f.1 == Path::OneSided && f.2 == probe).map(|f| f.0);
        let mut last = failed_at(false).next().expect("GETs failed");
        let mut backoff = cfg.backoff_ns;
        let slack = MILLIS;
        let probe_failures: Vec<u64> = failed_at(true).collect();
        for (i, &t) in probes.iter().take_while(|&&t| t < up).enumerate() {
            let gap = t - last;
            assert!(
                gap >= backoff && gap <= backoff + slack,
                "seed {seed}: probe {gap} ns after the last failure, backoff {backoff}: {probes:?}"
            );
            last = probe_failures[i];
            backoff = (backoff * 2).min(cfg.max_backoff_ns);
        }
        assert_eq!(backoff, cfg.max_backoff_ns, "seed {seed}: backoff never reached its cap");
        // A successful probe revives it; one-sided is cheaper, so it returns.
        let back = up + cfg.max_backoff_ns + slack;
        assert!(os_share(back, 400 * MILLIS) > 0.95, "seed {seed}: one-sided not back: {tl}");
        assert!(sim.ctl.stats().one_sided.usable, "seed {seed}");
    }
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let run = |seed: u64| {
        let mut sim = Sim::new(seed, PathConfig::default(), noisy(40 * MICROS), noisy(45 * MICROS), 8);
        sim.think_ns = 20 * MICROS;
        sim.hot_share = 0.02;
        sim.run_until(30 * MILLIS);
        sim.set_cond(Path::OneSided, Cond { slowdown: 8.0, bg_per_ms: 50.0, down: false });
        sim.run_until(60 * MILLIS);
        (sim.ctl.stats(), sim.served.len(), sim.probes.clone())
    };
    for seed in seeds(&[17]) {
        let a = run(seed);
        assert_eq!(a, run(seed), "seed {seed}: two runs differ");
        assert_ne!(a.0, run(seed + 1).0, "seed {seed}: the seed changes nothing");
    }
}

// ---------------------------------------------------------------- proptest

#[derive(Debug, Clone)]
enum Step {
    /// Advance the clock, then choose and admit a GET (queueing it if full).
    Get {
        dt: u64,
        key: u64,
    },
    /// Advance the clock, then end the n-th outstanding GET or probe.
    Complete {
        dt: u64,
        n: usize,
        latency: u64,
        rounds: u32,
        retries: u32,
    },
    Fail {
        dt: u64,
        n: usize,
    },
    Cancel {
        n: usize,
    },
    /// The n-th queued GET stops waiting and tries to get admitted again.
    Retry {
        n: usize,
    },
    SetUsable {
        one_sided: bool,
        usable: bool,
    },
}

fn dt() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 0..10 * MICROS, 0..200 * MILLIS, 0..u64::MAX / 1024]
}

fn step() -> impl Strategy<Value = Step> {
    let latency = prop_oneof![Just(0u64), 0..MILLIS, Just(u64::MAX), any::<u64>()];
    prop_oneof![
        4 => (dt(), 0..8u64).prop_map(|(dt, key)| Step::Get { dt, key }),
        4 => (dt(), any::<usize>(), latency, 0..6u32, 0..6u32)
            .prop_map(|(dt, n, latency, rounds, retries)| Step::Complete { dt, n, latency, rounds, retries }),
        1 => (dt(), any::<usize>()).prop_map(|(dt, n)| Step::Fail { dt, n }),
        1 => any::<usize>().prop_map(|n| Step::Cancel { n }),
        1 => any::<usize>().prop_map(|n| Step::Retry { n }),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(one_sided, usable)| Step::SetUsable { one_sided, usable }),
    ]
}

/// What the driver believes is outstanding: (path, probe, key).
struct Driver {
    ctl: Controller,
    now: u64,
    out: Vec<(Path, bool, u64)>,
    queued: Vec<(Path, u64)>,
    usable: [bool; 2],
}

impl Driver {
    fn route(&mut self, key: u64) {
        let Choice { path, probe } = self.ctl.choose(self.now, key);
        if let Some(p) = probe {
            assert!(self.usable[idx(p)], "probe of unusable {p:?}");
            assert!(!self.out.iter().any(|o| o.0 == p && o.1), "second probe in flight on {p:?}");
            self.out.push((p, true, key));
        }
        if self.ctl.try_admit(path) {
            self.out.push((path, false, key));
        } else {
            self.ctl.enqueue(path);
            self.queued.push((path, key));
        }
    }

    fn check(&self) {
        let s = self.ctl.stats();
        let cfg = self.ctl.config().window;
        for (p, snap) in [(Path::OneSided, s.one_sided), (Path::Rpc, s.rpc)] {
            let n = |probe: bool| self.out.iter().filter(|o| o.0 == p && o.1 == probe).count();
            assert_eq!(snap.in_flight as usize, n(false), "in_flight of {p:?}");
            assert_eq!(snap.queued as usize, self.queued.iter().filter(|q| q.0 == p).count(), "queued of {p:?}");
            assert!(n(true) <= 1, "probes in flight on {p:?}");
            assert!(snap.window.is_finite() && snap.window >= cfg.min && snap.window <= cfg.max, "{snap:?}");
            assert!(snap.round_trips.is_finite() && snap.round_trips >= 1.0, "{snap:?}");
            let delay = self.ctl.delay(p);
            assert!(delay.is_none_or(|d| d.is_finite() && d >= 0.0), "delay {delay:?}");
            for key in [None, Some(0), Some(3)] {
                let c = self.ctl.cost(p, key, self.now);
                assert!(c.is_none_or(|c| c.is_finite() && c >= 0.0), "cost {c:?}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn any_sequence_keeps_the_controller_consistent(steps in prop::collection::vec(step(), 1..300)) {
        let mut d = Driver {
            ctl: Controller::new(PathConfig::default()),
            now: 0,
            out: Vec::new(),
            queued: Vec::new(),
            usable: [true; 2],
        };
        d.ctl.set_usable(Path::OneSided, true);
        d.ctl.set_usable(Path::Rpc, true);
        for s in steps {
            match s {
                Step::Get { dt, key } => {
                    d.now = d.now.saturating_add(dt);
                    d.route(key);
                }
                Step::Complete { dt, n, latency, rounds, retries } if !d.out.is_empty() => {
                    d.now = d.now.saturating_add(dt);
                    let (p, probe, key) = d.out.swap_remove(n % d.out.len());
                    let c = Completion { latency_ns: latency, round_trips: rounds, retries };
                    d.ctl.on_complete(d.now, p, key, probe, c);
                }
                Step::Fail { dt, n } if !d.out.is_empty() => {
                    d.now = d.now.saturating_add(dt);
                    let (p, probe, _) = d.out.swap_remove(n % d.out.len());
                    d.ctl.on_failure(d.now, p, probe);
                }
                Step::Cancel { n } if !d.out.is_empty() => {
                    let (p, probe, _) = d.out.swap_remove(n % d.out.len());
                    d.ctl.on_cancel(p, probe);
                }
                Step::Retry { n } if !d.queued.is_empty() => {
                    let (p, key) = d.queued.swap_remove(n % d.queued.len());
                    d.ctl.dequeue(p);
                    d.route(key);
                }
                Step::SetUsable { one_sided, usable } => {
                    let p = if one_sided { Path::OneSided } else { Path::Rpc };
                    d.usable[idx(p)] = usable;
                    d.ctl.set_usable(p, usable);
                }
                _ => {}
            }
            d.check();
        }
    }
}

/// A path that turns twentyfold slower and back every 20 ms: each turn is
/// past the damping bypass, yet the preferred path still changes at most
/// once per configured minimum dwell.
#[test]
fn the_damping_bypass_keeps_the_minimum_dwell() {
    for seed in seeds(&[17, 18]) {
        let mut sim = equal_paths(seed);
        let min_dwell = PathConfig::default().min_dwell_ns;
        let (mut last, mut switched_at) = (sim.ctl.preferred(), Vec::new());
        for step in 0..600u64 {
            if step % 20 == 0 {
                let slow = Cond { slowdown: 20.0, ..Cond::default() };
                let (congested, clear) =
                    if (step / 20) % 2 == 0 { (Path::OneSided, Path::Rpc) } else { (Path::Rpc, Path::OneSided) };
                sim.set_cond(congested, slow);
                sim.set_cond(clear, Cond::default());
            }
            sim.run_until((step + 1) * MILLIS);
            let now = sim.ctl.preferred();
            if now != last {
                switched_at.push(step + 1);
                last = now;
            }
        }
        eprintln!("seed {seed}: switches at ms {switched_at:?}");
        assert!(switched_at.len() >= 2, "seed {seed}: the conditions never moved the traffic: {switched_at:?}");
        for w in switched_at.windows(2) {
            // One step of slack: a switch is seen at the end of its step.
            assert!(
                (w[1] - w[0]) * MILLIS + MILLIS >= min_dwell,
                "seed {seed}: switches {} ms apart, under the minimum dwell: {switched_at:?}",
                w[1] - w[0]
            );
        }
    }
}

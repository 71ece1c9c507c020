//! The load and run phases: `threads` OS threads, each with its own
//! single-threaded runtime and one connection, on which `in_flight` tasks
//! keep one operation each outstanding.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use tokio::task::JoinSet;

use crate::backend::{BackendKind, DmkvConn, DmkvOptions, KvConn, MemcachedConn, RedisConn};
use crate::generator::{EtaGrowth, KeyChooser, Rng, derive, key_name, zipfian_key_space};
use crate::report::{ALL_OPS, OpStats, PhaseStats, Report, new_histogram};
use crate::workload::{BadValue, Distribution, Mix, OP_KINDS, OpKind, Workload, check_value, make_value};

/// Most client threads.
pub const MAX_THREADS: usize = 1024;
/// Most operations in flight per thread.
pub const MAX_IN_FLIGHT: usize = 4096;
/// Largest value (dmkv's limit; memcached's default item limit is the same).
pub const MAX_VALUE_SIZE: usize = dmkv_common::limits::MAX_VALUE_LEN;
/// Operations of a run when neither `--operations` nor `--duration` is given.
pub const DEFAULT_OPERATIONS: u64 = 100_000;

/// Operations excluded from the measurement at the start of the run.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Warmup {
    /// Measure from the first operation.
    #[default]
    None,
    /// The first this-long of the run.
    Time(Duration),
    /// The first this-many operations (split over threads).
    Ops(u64),
}

impl FromStr for Warmup {
    type Err = String;

    /// "10s", "2.5s" or "500ms" is time; a plain number is operations.
    fn from_str(s: &str) -> Result<Warmup, String> {
        let s = s.trim();
        let bad = || format!("invalid warmup {s:?}: expected seconds such as 5s, or a number of operations");
        let secs = if let Some(ms) = s.strip_suffix("ms") {
            Some(ms.parse::<f64>().map_err(|_| bad())? / 1000.0)
        } else if let Some(sec) = s.strip_suffix('s') {
            Some(sec.parse::<f64>().map_err(|_| bad())?)
        } else {
            None
        };
        match secs {
            Some(x) if x.is_finite() && x >= 0.0 => {
                Ok(if x == 0.0 { Warmup::None } else { Warmup::Time(Duration::from_secs_f64(x)) })
            }
            Some(_) => Err(bad()),
            None => match s.parse::<u64>().map_err(|_| bad())? {
                0 => Ok(Warmup::None),
                n => Ok(Warmup::Ops(n)),
            },
        }
    }
}

/// Everything that defines a run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The store's name in reports.
    pub label: String,
    pub backend: BackendKind,
    pub server: String,
    pub dmkv: DmkvOptions,
    pub workload: Workload,
    pub distribution: Distribution,
    /// How the latest distribution's zipfian grows with inserts.
    pub latest_eta: EtaGrowth,
    /// Inserts the zipfian key space is sized for; `None`: YCSB's estimate,
    /// operations × insert proportion.
    pub expected_inserts: Option<u64>,
    pub records: u64,
    /// Measured operations; `None` with a duration.
    pub operations: Option<u64>,
    /// Measured time; `None` with a count of operations.
    pub duration: Option<Duration>,
    pub value_size: usize,
    pub threads: usize,
    pub in_flight: usize,
    /// Operations per second over all threads (open loop); `None`: as fast
    /// as replies come back (closed loop).
    pub target_rate: Option<f64>,
    pub warmup: Warmup,
    pub seed: u64,
    pub skip_load: bool,
}

impl Settings {
    /// Checks the settings against the limits; the error says why not.
    pub fn validate(&self) -> Result<Mix, String> {
        let mix = self.workload.mix()?;
        if self.threads == 0 || self.threads > MAX_THREADS {
            return Err(format!("--threads must be 1 to {MAX_THREADS}"));
        }
        if self.in_flight == 0 || self.in_flight > MAX_IN_FLIGHT {
            return Err(format!("--in-flight must be 1 to {MAX_IN_FLIGHT}"));
        }
        if self.records == 0 {
            return Err("--records must be at least 1".into());
        }
        if self.value_size > MAX_VALUE_SIZE {
            return Err(format!("--value-size must be at most {MAX_VALUE_SIZE}"));
        }
        if let Some(r) = self.target_rate
            && !(r.is_finite() && r > 0.0)
        {
            return Err("--target-rate must be a positive number of operations per second".into());
        }
        match (self.operations, self.duration) {
            (Some(_), Some(_)) => return Err("give --operations or --duration, not both".into()),
            (None, None) => return Err("give --operations or --duration".into()),
            (_, Some(d)) if d.is_zero() => return Err("--duration must be positive".into()),
            _ => {}
        }
        self.key_space(mix)?;
        Ok(mix)
    }

    /// Keys of the zipfian chooser, sized once for the run as YCSB does:
    /// the records, twice the expected inserts, and one more. YCSB expects
    /// operationcount × insertproportion inserts; warm-up operations count
    /// here, since they insert too.
    pub fn key_space(&self, mix: Mix) -> Result<u64, String> {
        let new_keys = match (self.expected_inserts, self.operations) {
            (Some(n), _) => n.checked_mul(2),
            (None, Some(ops)) => {
                let warm = if let Warmup::Ops(w) = self.warmup { w } else { 0 };
                // YCSB: (int) (opcount * insertproportion * 2.0).
                Some((ops.saturating_add(warm) as f64 * mix.insert * 2.0) as u64)
            }
            (None, None) if mix.insert > 0.0 && self.distribution == Distribution::Zipfian => {
                return Err("--distribution zipfian with inserts and --duration needs --expected-inserts N: \
                     the zipfian key space is sized once, before the run, from the inserts expected"
                    .into());
            }
            (None, None) => Some(0),
        };
        new_keys
            .and_then(|n| zipfian_key_space(self.records, n))
            .ok_or_else(|| "the zipfian key space (records + 2 × expected inserts + 1) does not fit in 64 bits".into())
    }
}

/// Keys acknowledged as inserted: every key below `limit` is readable.
/// Inserts complete out of order, so later keys wait in a heap until the
/// gap below them closes (YCSB's `AcknowledgedCounterGenerator`).
struct Acked {
    limit: AtomicU64,
    early: Mutex<BinaryHeap<Reverse<u64>>>,
}

impl Acked {
    fn new(limit: u64) -> Acked {
        Acked { limit: AtomicU64::new(limit), early: Mutex::new(BinaryHeap::new()) }
    }

    fn limit(&self) -> u64 {
        self.limit.load(Ordering::Acquire)
    }

    fn ack(&self, key: u64) {
        let mut early = self.early.lock().expect("acked poisoned");
        early.push(Reverse(key));
        let mut l = self.limit.load(Ordering::Acquire);
        while early.peek() == Some(&Reverse(l)) {
            early.pop();
            l += 1;
        }
        self.limit.store(l, Ordering::Release);
    }
}

/// State of a phase shared by every thread.
struct Phase {
    s: Settings,
    mix: Mix,
    load: bool,
    /// Next key number to insert.
    next_insert: AtomicU64,
    acked: Acked,
    /// Each thread starts from a copy (the latest chooser grows as it draws).
    keys: KeyChooser,
}

/// What went wrong with one operation.
enum Failure {
    Error(String),
    NotFound(u64),
    Bad(u64, BadValue),
}

/// Measurements of one thread.
struct Stats {
    hist: Vec<Histogram<u64>>,
    errors: [u64; OP_KINDS.len()],
    not_found: u64,
    bad_values: u64,
    first_error: Option<String>,
    /// Intended start of the first measured operation and end of the last.
    window: Option<(Instant, Instant)>,
}

impl Stats {
    fn new() -> Stats {
        Stats {
            hist: OP_KINDS.iter().map(|_| new_histogram()).collect(),
            errors: [0; OP_KINDS.len()],
            not_found: 0,
            bad_values: 0,
            first_error: None,
            window: None,
        }
    }

    fn record(&mut self, op: OpKind, start: Instant, end: Instant, result: Result<(), Failure>) {
        self.window = Some(match self.window {
            None => (start, end),
            Some((a, b)) => (a.min(start), b.max(end)),
        });
        let fail = match result {
            Ok(()) => {
                let ns = end.saturating_duration_since(start).as_nanos().min(u64::MAX as u128) as u64;
                self.hist[op.index()].saturating_record(ns.max(1));
                return;
            }
            Err(f) => f,
        };
        self.errors[op.index()] += 1;
        let msg = match fail {
            Failure::Error(e) => e,
            Failure::NotFound(k) => {
                self.not_found += 1;
                format!("key {k} ({}) not found", key_name(k))
            }
            Failure::Bad(k, b) => {
                self.bad_values += 1;
                format!("key {k} ({}): {b}", key_name(k))
            }
        };
        self.first_error.get_or_insert(format!("{}: {msg}", op.name()));
    }

    fn seconds(&self) -> f64 {
        self.window.map_or(0.0, |(a, b)| b.saturating_duration_since(a).as_secs_f64())
    }
}

/// Per-thread state shared by the thread's in-flight tasks.
struct Local {
    thread: u64,
    /// Index of the next operation of this thread.
    next: AtomicU64,
    /// Measured operations started.
    measured: AtomicU64,
    /// Measured operations this thread runs (`None`: until the deadline).
    ops: Option<u64>,
    /// Warm-up operations this thread runs before measuring.
    warm_ops: u64,
    start: Instant,
    warm_until: Instant,
    deadline: Option<Instant>,
    /// Seconds between intended starts (open loop).
    interval: Option<f64>,
    keys: Mutex<KeyChooser>,
    stats: Mutex<Stats>,
}

/// Share `total` of thread `t` out of `n`.
fn share(total: u64, t: u64, n: u64) -> u64 {
    total / n + u64::from(t < total % n)
}

impl Local {
    fn new(p: &Phase, thread: u64) -> Local {
        let s = &p.s;
        let n = s.threads as u64;
        let start = Instant::now();
        let (warm_time, warm_ops) = match (p.load, s.warmup) {
            (false, Warmup::Time(d)) => (d, 0),
            (false, Warmup::Ops(w)) => (Duration::ZERO, share(w, thread, n)),
            _ => (Duration::ZERO, 0),
        };
        let warm_until = start + warm_time;
        let (ops, deadline) = if p.load {
            (None, None)
        } else {
            (s.operations.map(|o| share(o, thread, n)), s.duration.map(|d| warm_until + d))
        };
        let interval = if p.load { None } else { s.target_rate.map(|r| n as f64 / r) };
        Local {
            thread,
            next: AtomicU64::new(0),
            measured: AtomicU64::new(0),
            ops,
            warm_ops,
            start,
            warm_until,
            deadline,
            interval,
            keys: Mutex::new(p.keys.clone()),
            stats: Mutex::new(Stats::new()),
        }
    }
}

/// Loads (unless `skip_load`) and runs the workload; the report of both.
pub fn run(s: &Settings) -> Result<Report, String> {
    match s.backend {
        BackendKind::Dmkv => run_with(s, |s: Settings| async move { DmkvConn::connect(&s.server, &s.dmkv).await }),
        BackendKind::Memcached => run_with(s, |s: Settings| async move { MemcachedConn::connect(&s.server).await }),
        BackendKind::Redis => run_with(s, |s: Settings| async move { RedisConn::connect(&s.server).await }),
    }
}

/// As [`run`], on connections that `connect` makes (one per thread, from
/// the thread's runtime): for stores the driver does not know, and tests.
pub fn run_with<C, F, Fut>(s: &Settings, connect: F) -> Result<Report, String>
where
    C: KvConn,
    F: Fn(Settings) -> Fut + Sync,
    Fut: Future<Output = Result<C, String>>,
{
    let mix = s.validate()?;
    let load = if s.skip_load { None } else { Some(phase(s, mix, true, &connect)?) };
    let run = phase(s, mix, false, &connect)?;
    let dmkv = s.backend == BackendKind::Dmkv;
    Ok(Report {
        store: s.label.clone(),
        server: s.server.clone(),
        workload: s.workload.name().into(),
        distribution: s.distribution.name().into(),
        latest_eta: (s.distribution == Distribution::Latest).then(|| s.latest_eta.name().into()),
        key_space: if s.distribution == Distribution::Zipfian { Some(s.key_space(mix)?) } else { None },
        records: s.records,
        value_size: s.value_size,
        threads: s.threads,
        in_flight: s.in_flight,
        target_rate: s.target_rate,
        seed: s.seed,
        read_path: dmkv.then(|| format!("{:?}", s.dmkv.read_path).to_lowercase()),
        transport: if dmkv { s.dmkv.transport.map(|t| format!("{t:?}").to_lowercase()) } else { None },
        load,
        run,
    })
}

fn phase<C, F, Fut>(s: &Settings, mix: Mix, load: bool, connect: &F) -> Result<PhaseStats, String>
where
    C: KvConn,
    F: Fn(Settings) -> Fut + Sync,
    Fut: Future<Output = Result<C, String>>,
{
    let p = Arc::new(Phase {
        s: s.clone(),
        mix,
        load,
        next_insert: AtomicU64::new(if load { 0 } else { s.records }),
        acked: Acked::new(s.records),
        keys: KeyChooser::new(s.distribution, s.records, s.key_space(mix)?, s.latest_eta),
    });
    let stats = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..s.threads as u64)
            .map(|t| {
                let p = Arc::clone(&p);
                scope.spawn(move || thread_main(p, t, connect))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a client thread panicked".into())))
            .collect::<Result<Vec<Stats>, String>>()
    })?;
    let kinds: &[OpKind] = if load { &[OpKind::Insert] } else { &OP_KINDS };
    Ok(summarise(&stats, kinds, mix, load))
}

fn summarise(stats: &[Stats], kinds: &[OpKind], mix: Mix, load: bool) -> PhaseStats {
    let ran = |k: OpKind| {
        load || match k {
            OpKind::Read => mix.read > 0.0,
            OpKind::Update => mix.update > 0.0,
            OpKind::Insert => mix.insert > 0.0,
            OpKind::ReadModifyWrite => mix.rmw > 0.0,
        }
    };
    // Each thread's rate over its own window, summed: threads that start or
    // finish a little apart are not charged for each other's idle time.
    let rate = |count: &dyn Fn(&Stats) -> u64| -> f64 {
        stats.iter().filter(|st| st.seconds() > 0.0).map(|st| count(st) as f64 / st.seconds()).sum()
    };
    let mut ops = Vec::new();
    let mut all = new_histogram();
    let mut all_errors = 0;
    for &k in kinds.iter().filter(|k| ran(**k)) {
        let i = k.index();
        let mut h = new_histogram();
        for st in stats {
            h.add(&st.hist[i]).expect("same bounds");
        }
        let errors: u64 = stats.iter().map(|st| st.errors[i]).sum();
        all.add(&h).expect("same bounds");
        all_errors += errors;
        let r = rate(&|st| st.hist[i].len() + st.errors[i]);
        ops.push(OpStats::from_histogram(k.name(), &h, errors, r));
    }
    let total = |st: &Stats| st.hist.iter().map(|h| h.len()).sum::<u64>() + st.errors.iter().sum::<u64>();
    let ops_per_sec = rate(&total);
    ops.push(OpStats::from_histogram(ALL_OPS, &all, all_errors, ops_per_sec));
    PhaseStats {
        seconds: stats.iter().map(Stats::seconds).fold(0.0, f64::max),
        operations: stats.iter().map(total).sum(),
        ops_per_sec,
        not_found: stats.iter().map(|st| st.not_found).sum(),
        bad_values: stats.iter().map(|st| st.bad_values).sum(),
        first_error: stats.iter().find_map(|st| st.first_error.clone()),
        ops,
    }
}

fn thread_main<C, F, Fut>(p: Arc<Phase>, t: u64, connect: &F) -> Result<Stats, String>
where
    C: KvConn,
    F: Fn(Settings) -> Fut,
    Fut: Future<Output = Result<C, String>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    rt.block_on(async move {
        let conn = connect(p.s.clone()).await?;
        drive(conn, p, t).await
    })
}

async fn drive<C: KvConn>(conn: C, p: Arc<Phase>, t: u64) -> Result<Stats, String> {
    let conn = Arc::new(conn);
    let local = Arc::new(Local::new(&p, t));
    let mut tasks = JoinSet::new();
    for _ in 0..p.s.in_flight {
        let (conn, p, local) = (Arc::clone(&conn), Arc::clone(&p), Arc::clone(&local));
        tasks.spawn(async move {
            if p.load { load_slot(&*conn, &p, &local).await } else { run_slot(&*conn, &p, &local).await }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.map_err(|e| format!("a client task failed: {e}"))?;
    }
    let stats = std::mem::replace(&mut *local.stats.lock().expect("stats poisoned"), Stats::new());
    Ok(stats)
}

async fn load_slot<C: KvConn>(conn: &C, p: &Phase, local: &Local) {
    let s = &p.s;
    // Bounded by the number of records: every iteration claims a key.
    loop {
        let k = p.next_insert.fetch_add(1, Ordering::Relaxed);
        if k >= s.records {
            break;
        }
        let value = make_value(s.seed, k, derive(s.seed, 0, k), s.value_size);
        let start = Instant::now();
        let r = conn.set(Bytes::from(key_name(k)), value).await.map_err(Failure::Error);
        local.stats.lock().expect("stats poisoned").record(OpKind::Insert, start, Instant::now(), r);
    }
}

async fn run_slot<C: KvConn>(conn: &C, p: &Phase, local: &Local) {
    let s = &p.s;
    // Bounded by the operation count or by the deadline (one of them is set).
    loop {
        let idx = local.next.fetch_add(1, Ordering::Relaxed);
        let intended = match local.interval {
            // Open loop: the schedule, not the last reply, says when an
            // operation starts, and latency counts from then.
            Some(iv) => local.start + Duration::from_secs_f64(idx as f64 * iv),
            None => Instant::now(),
        };
        if local.deadline.is_some_and(|d| intended >= d) {
            break;
        }
        if local.interval.is_some() {
            tokio::time::sleep_until(intended.into()).await;
        }
        let measuring = idx >= local.warm_ops && intended >= local.warm_until;
        if measuring
            && let Some(n) = local.ops
            && local.measured.fetch_add(1, Ordering::Relaxed) >= n
        {
            break;
        }
        let mut rng = Rng::new(derive(s.seed, local.thread + 1, idx));
        let op = p.mix.choose(rng.next_f64());
        let r = execute(conn, p, local, op, &mut rng).await;
        let end = Instant::now();
        if measuring {
            local.stats.lock().expect("stats poisoned").record(op, intended, end, r);
        }
    }
}

fn choose_key(p: &Phase, local: &Local, rng: &mut Rng) -> u64 {
    local.keys.lock().expect("key chooser poisoned").next(rng, p.acked.limit())
}

async fn read<C: KvConn>(conn: &C, s: &Settings, k: u64) -> Result<(), Failure> {
    match conn.get(Bytes::from(key_name(k))).await {
        Ok(Some(v)) => check_value(s.seed, k, s.value_size, &v).map_err(|b| Failure::Bad(k, b)),
        Ok(None) => Err(Failure::NotFound(k)),
        Err(e) => Err(Failure::Error(e)),
    }
}

async fn execute<C: KvConn>(conn: &C, p: &Phase, local: &Local, op: OpKind, rng: &mut Rng) -> Result<(), Failure> {
    let s = &p.s;
    match op {
        OpKind::Read => read(conn, s, choose_key(p, local, rng)).await,
        OpKind::Update => {
            let k = choose_key(p, local, rng);
            let v = make_value(s.seed, k, rng.next_u64(), s.value_size);
            conn.set(Bytes::from(key_name(k)), v).await.map_err(Failure::Error)
        }
        OpKind::Insert => {
            let k = p.next_insert.fetch_add(1, Ordering::Relaxed);
            let v = make_value(s.seed, k, rng.next_u64(), s.value_size);
            let r = conn.set(Bytes::from(key_name(k)), v).await.map_err(Failure::Error);
            // YCSB acknowledges in a finally block: a failed insert (counted
            // in r) must not hold back the keys inserted after it.
            p.acked.ack(k);
            r
        }
        OpKind::ReadModifyWrite => {
            let k = choose_key(p, local, rng);
            read(conn, s, k).await?;
            let v = make_value(s.seed, k, rng.next_u64(), s.value_size);
            conn.set(Bytes::from(key_name(k)), v).await.map_err(Failure::Error)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;

    /// A store in memory that fails the SETs it is told to.
    #[derive(Default)]
    struct MemStore {
        map: Mutex<HashMap<Bytes, Bytes>>,
        /// Keys whose next SET fails.
        fail: Mutex<HashSet<Bytes>>,
        /// Keys read, in order.
        gets: Mutex<Vec<Bytes>>,
    }

    struct MemConn(Arc<MemStore>);

    impl KvConn for MemConn {
        async fn get(&self, key: Bytes) -> Result<Option<Bytes>, String> {
            self.0.gets.lock().unwrap().push(key.clone());
            Ok(self.0.map.lock().unwrap().get(&key).cloned())
        }

        async fn set(&self, key: Bytes, value: Bytes) -> Result<(), String> {
            if self.0.fail.lock().unwrap().remove(&key) {
                return Err("injected failure".into());
            }
            self.0.map.lock().unwrap().insert(key, value);
            Ok(())
        }
    }

    fn mem_settings(workload: Workload, records: u64, operations: u64) -> Settings {
        Settings {
            label: "mem".into(),
            backend: BackendKind::Dmkv,
            server: "in memory".into(),
            dmkv: DmkvOptions::default(),
            workload,
            distribution: workload.default_distribution(),
            latest_eta: EtaGrowth::Ycsb,
            expected_inserts: None,
            records,
            operations: Some(operations),
            duration: None,
            value_size: 100,
            threads: 2,
            in_flight: 4,
            target_rate: None,
            warmup: Warmup::None,
            seed: 3,
            skip_load: false,
        }
    }

    fn run_mem(s: &Settings, store: &Arc<MemStore>) -> Report {
        let store = Arc::clone(store);
        run_with(s, move |_| {
            let store = Arc::clone(&store);
            async move { Ok(MemConn(store)) }
        })
        .unwrap()
    }

    #[test]
    fn workload_d_keeps_advancing_after_a_failed_insert() {
        let (records, operations) = (100, 4000);
        let store = Arc::new(MemStore::default());
        // The first key the run inserts.
        store.fail.lock().unwrap().insert(Bytes::from(key_name(records)));
        let r = run_mem(&mem_settings(Workload::D, records, operations), &store);
        let inserts = r.run.op("INSERT").unwrap();
        assert_eq!(inserts.errors, 1, "the failed insert is counted");
        assert!(inserts.count > 100, "{} inserts", inserts.count);
        // Acknowledged all the same, as YCSB does, so reads reach the keys
        // inserted after it: the newest quarter of them is read.
        let newest = records + (inserts.count + 1) * 3 / 4;
        let late: HashSet<Bytes> = (newest..records + inserts.count + 1).map(|k| Bytes::from(key_name(k))).collect();
        let gets = store.gets.lock().unwrap();
        assert!(gets.iter().any(|k| late.contains(k)), "no read of a key at or above {newest}");
    }

    #[test]
    fn warmup_parses() {
        assert_eq!("5s".parse(), Ok(Warmup::Time(Duration::from_secs(5))));
        assert_eq!("250ms".parse(), Ok(Warmup::Time(Duration::from_millis(250))));
        assert_eq!("1000".parse(), Ok(Warmup::Ops(1000)));
        assert_eq!("0".parse(), Ok(Warmup::None));
        assert_eq!("0s".parse(), Ok(Warmup::None));
        assert!("x".parse::<Warmup>().is_err());
        assert!("-1s".parse::<Warmup>().is_err());
    }

    #[test]
    fn shares_add_up() {
        for (total, n) in [(10, 3), (0, 4), (7, 7), (5, 8)] {
            assert_eq!((0..n).map(|t| share(total, t, n)).sum::<u64>(), total);
        }
    }

    #[test]
    fn acknowledged_keys_close_gaps_in_order() {
        let a = Acked::new(10);
        a.ack(11);
        a.ack(12);
        assert_eq!(a.limit(), 10);
        a.ack(10);
        assert_eq!(a.limit(), 13);
        a.ack(13);
        assert_eq!(a.limit(), 14);
    }
}

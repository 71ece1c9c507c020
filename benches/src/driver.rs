//! The load and run phases: `threads` OS threads, each with its own
//! single-threaded runtime and one connection, on which `in_flight` tasks
//! keep one operation each outstanding.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use tokio::task::JoinSet;

use crate::backend::{BackendKind, DmkvConn, DmkvOptions, KvConn, MemcachedConn, RedisConn};
use crate::generator::{EtaGrowth, KeyChooser, Rng, derive, key_name, zipfian_key_space};
use crate::report::{ALL_OPS, OpStats, PhaseStats, Report, new_histogram};
use crate::workload::{BadValue, Distribution, Mix, OP_KINDS, OpKind, UpdateWrites, Workload, check_value, make_value};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Most client threads.
pub const MAX_THREADS: usize = 1024;
/// Most operations in flight per thread.
pub const MAX_IN_FLIGHT: usize = 4096;
/// Slowest `--target-rate` accepted, in operations per second.
pub const MIN_TARGET_RATE: f64 = 0.001;
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
            Some(0.0) => Ok(Warmup::None),
            Some(x) if x > 0.0 => Duration::try_from_secs_f64(x).map(Warmup::Time).map_err(|_| bad()),
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
    /// Bytes of a record (every field).
    pub value_size: usize,
    /// Fields of a record, `value_size / fields` bytes each (YCSB: 10).
    pub fields: usize,
    pub update_writes: UpdateWrites,
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
    /// A run of `workload` against `server` with YCSB's defaults: 1000
    /// records of 10 fields × 100 B, 1000 operations, one synchronous
    /// thread, the workload's distribution, whole-record updates. Callers
    /// (tests, embedders) change what they need.
    pub fn new(backend: BackendKind, server: &str, workload: Workload) -> Settings {
        Settings {
            label: backend.name().to_string(),
            backend,
            server: server.to_string(),
            dmkv: DmkvOptions::default(),
            workload,
            distribution: workload.default_distribution(),
            latest_eta: EtaGrowth::Ycsb,
            expected_inserts: None,
            records: 1000,
            operations: Some(1000),
            duration: None,
            value_size: 1000,
            fields: 10,
            update_writes: UpdateWrites::Record,
            threads: 1,
            in_flight: 1,
            target_rate: None,
            warmup: Warmup::None,
            seed: 1,
            skip_load: false,
        }
    }

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
        if self.fields == 0 {
            return Err("--fields must be at least 1".into());
        }
        if self.update_writes == UpdateWrites::Field
            && (!self.value_size.is_multiple_of(self.fields) || self.value_size == 0)
        {
            return Err(format!(
                "--update-writes field needs --value-size to be a positive multiple of --fields ({}): \
                 YCSB's records are 10 fields × 100 B",
                self.fields
            ));
        }
        if let Some(r) = self.target_rate
            && !(r.is_finite() && r >= MIN_TARGET_RATE)
        {
            // Far below one operation a second, the schedule's times
            // overflow what a clock can hold.
            return Err(format!("--target-rate must be at least {MIN_TARGET_RATE} operations per second"));
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

    /// Bytes an update writes: the record, or one field of it.
    pub fn update_bytes(&self) -> usize {
        match self.update_writes {
            UpdateWrites::Record => self.value_size,
            UpdateWrites::Field => self.value_size / self.fields.max(1),
        }
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
    gate: Gate,
    /// When the phase started, for every thread: the warm-up, the deadline
    /// and the open-loop schedule count from it.
    start: OnceLock<Instant>,
}

impl Phase {
    fn start(&self) -> Instant {
        *self.start.get_or_init(Instant::now)
    }
}

/// Where every thread waits until all have connected, so that no thread's
/// measured window starts while others are still connecting.
struct Gate {
    /// Threads arrived, and whether one failed.
    state: Mutex<(usize, bool)>,
    all_in: Condvar,
    threads: usize,
}

impl Gate {
    fn new(threads: usize) -> Gate {
        Gate { state: Mutex::new((0, false)), all_in: Condvar::new(), threads }
    }

    /// Waits for every thread; whether all arrived `ok`.
    fn pass(&self, ok: bool) -> bool {
        let mut st = self.state.lock().expect("gate poisoned");
        st.0 += 1;
        st.1 |= !ok;
        if st.0 >= self.threads {
            self.all_in.notify_all();
        }
        while st.0 < self.threads {
            st = self.all_in.wait(st).expect("gate poisoned");
        }
        !st.1
    }
}

/// A thread's place at the [`Gate`]: dropped unused (the thread failed or
/// panicked before it got there), it passes as failed, so that no other
/// thread waits for it forever.
struct Ticket<'a> {
    gate: &'a Gate,
    used: bool,
}

impl Ticket<'_> {
    fn pass(mut self, ok: bool) -> bool {
        self.used = true;
        self.gate.pass(ok)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if !self.used {
            self.gate.pass(false);
        }
    }
}

/// What went wrong with one operation.
enum Failure {
    Error(String),
    NotFound(u64),
    Bad(u64, BadValue),
    /// The read or the update of a read-modify-write failed (and was
    /// counted as such).
    Part,
}

/// Latencies of one operation type, or of every operation the workload
/// chose (not the read and update inside a read-modify-write).
struct Row {
    /// From sending the request to its reply (after the key was chosen and
    /// the value built).
    service: Histogram<u64>,
    /// From the operation's intended start (open loop).
    intended: Histogram<u64>,
    errors: u64,
}

/// Row of [`Stats::rows`] that holds every operation the workload chose.
const ALL_ROW: usize = OP_KINDS.len();

/// Measurements of one thread.
struct Stats {
    /// One per [`OP_KINDS`], then [`ALL_ROW`].
    rows: Vec<Row>,
    not_found: u64,
    bad_values: u64,
    first_error: Option<String>,
    /// Intended start of the first measured operation and end of the last.
    window: Option<(Instant, Instant)>,
}

/// One timed request: the read or the update of a read-modify-write.
struct Part {
    op: OpKind,
    start: Instant,
    end: Instant,
    result: Result<(), Failure>,
}

/// What an operation did. A read-modify-write also times its read and its
/// update on their own, as YCSB's DBWrapper does.
struct Outcome {
    end: Instant,
    result: Result<(), Failure>,
    parts: Vec<Part>,
}

fn nanos(from: Instant, to: Instant) -> u64 {
    to.saturating_duration_since(from).as_nanos().min(u64::MAX as u128) as u64
}

impl Stats {
    fn new() -> Stats {
        let row = || Row { service: new_histogram(), intended: new_histogram(), errors: 0 };
        Stats {
            rows: (0..=ALL_ROW).map(|_| row()).collect(),
            not_found: 0,
            bad_values: 0,
            first_error: None,
            window: None,
        }
    }

    /// Records an operation the workload chose, started at `start` and
    /// meant to start at `intended` (the same in a closed loop).
    fn record(&mut self, op: OpKind, intended: Instant, start: Instant, o: Outcome) {
        self.window = Some(match self.window {
            None => (intended, o.end),
            Some((a, b)) => (a.min(intended), b.max(o.end)),
        });
        for part in o.parts {
            self.time(part.op.index(), intended, part.start, part.end, part.result.is_ok());
            self.fail(part.op, part.result);
        }
        let ok = o.result.is_ok();
        self.time(op.index(), intended, start, o.end, ok);
        self.time(ALL_ROW, intended, start, o.end, ok);
        self.fail(op, o.result);
    }

    /// Times a success; a failure is counted, not timed.
    fn time(&mut self, row: usize, intended: Instant, start: Instant, end: Instant, ok: bool) {
        let row = &mut self.rows[row];
        if ok {
            row.service.saturating_record(nanos(start, end).max(1));
            row.intended.saturating_record(nanos(intended, end).max(1));
        } else {
            row.errors += 1;
        }
    }

    fn fail(&mut self, op: OpKind, result: Result<(), Failure>) {
        let msg = match result {
            Ok(()) | Err(Failure::Part) => return,
            Err(Failure::Error(e)) => e,
            Err(Failure::NotFound(k)) => {
                self.not_found += 1;
                format!("key {k} ({}) not found", key_name(k))
            }
            Err(Failure::Bad(k, b)) => {
                self.bad_values += 1;
                format!("key {k} ({}): {b}", key_name(k))
            }
        };
        self.first_error.get_or_insert(format!("{}: {msg}", op.name()));
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
        let start = p.start();
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
        // Threads share a start, so their schedules interleave rather than
        // all sending at the same instants.
        let start = start + s.target_rate.map_or(Duration::ZERO, |r| Duration::from_secs_f64(thread as f64 / r));
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
    let mut r = Report {
        store: s.label.clone(),
        comparability: String::new(),
        server: s.server.clone(),
        workload: s.workload.name().into(),
        distribution: s.distribution.name().into(),
        latest_eta: (s.distribution == Distribution::Latest).then(|| s.latest_eta.name().into()),
        key_space: if s.distribution == Distribution::Zipfian { Some(s.key_space(mix)?) } else { None },
        records: s.records,
        value_size: s.value_size,
        fields: s.fields,
        update_bytes: s.update_bytes(),
        threads: s.threads,
        in_flight: s.in_flight,
        target_rate: s.target_rate,
        seed: s.seed,
        read_path: dmkv.then(|| format!("{:?}", s.dmkv.read_path).to_lowercase()),
        transport: if dmkv { s.dmkv.transport.map(|t| format!("{t:?}").to_lowercase()) } else { None },
        load,
        run,
    };
    r.comparability = r.comparability_label();
    Ok(r)
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
        gate: Gate::new(s.threads),
        start: OnceLock::new(),
    });
    let bar = if load { load_bar(s.records) } else { ProgressBar::hidden() };
    let done = std::sync::atomic::AtomicBool::new(false);
    let stats = std::thread::scope(|scope| {
        // The bar follows the inserts handed out, from a thread of its own
        // so the client threads' measured loops do not pay for it.
        if !bar.is_hidden() {
            scope.spawn(|| {
                while !done.load(Ordering::Acquire) {
                    bar.set_position(p.next_insert.load(Ordering::Relaxed).min(s.records));
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
        }
        let handles: Vec<_> = (0..s.threads as u64)
            .map(|t| {
                let p = Arc::clone(&p);
                scope.spawn(move || thread_main(p, t, connect))
            })
            .collect();
        let stats = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a client thread panicked".into())))
            .collect::<Result<Vec<Stats>, String>>();
        done.store(true, Ordering::Release);
        stats
    });
    bar.finish_and_clear();
    let stats = stats?;
    let kinds: &[OpKind] = if load { &[OpKind::Insert] } else { &OP_KINDS };
    Ok(summarise(&stats, kinds, mix, load, !load && s.target_rate.is_some()))
}

/// The load phase's progress bar on stderr: drawn only on a terminal
/// (indicatif hides a terminal target that is not one) and never under CI
/// (`CI` set), whose logs keep no cursor movements.
fn load_bar(records: u64) -> ProgressBar {
    if std::env::var_os("CI").is_some() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(records), ProgressDrawTarget::stderr());
    // The template is a constant: a bad one is a bug, not an input.
    if let Ok(style) = ProgressStyle::with_template("load {bar:40} {pos}/{len} records {per_sec} eta {eta}") {
        bar.set_style(style);
    }
    bar
}

/// The phase's statistics from every thread's. Throughput is operations
/// over the measured wall window (first intended start to last reply, over
/// all threads), as YCSB reports it; `open_loop` adds latencies from the
/// intended start.
fn summarise(stats: &[Stats], kinds: &[OpKind], mix: Mix, load: bool, open_loop: bool) -> PhaseStats {
    let ran = |k: OpKind| {
        load || match k {
            OpKind::Read => mix.read > 0.0 || mix.rmw > 0.0,
            OpKind::Update => mix.update > 0.0 || mix.rmw > 0.0,
            OpKind::Insert => mix.insert > 0.0,
            OpKind::ReadModifyWrite => mix.rmw > 0.0,
        }
    };
    let window = stats.iter().filter_map(|st| st.window).reduce(|(a, b), (c, d)| (a.min(c), b.max(d)));
    let seconds = window.map_or(0.0, |(a, b)| b.saturating_duration_since(a).as_secs_f64());
    let rate = |n: u64| if seconds > 0.0 { n as f64 / seconds } else { 0.0 };
    let (mut ops, mut intended) = (Vec::new(), Vec::new());
    let rows = kinds.iter().filter(|k| ran(**k)).map(|k| (k.name(), k.index())).chain([(ALL_OPS, ALL_ROW)]);
    for (name, i) in rows {
        let (mut service, mut from_intended) = (new_histogram(), new_histogram());
        for st in stats {
            service.add(&st.rows[i].service).expect("same bounds");
            from_intended.add(&st.rows[i].intended).expect("same bounds");
        }
        let errors: u64 = stats.iter().map(|st| st.rows[i].errors).sum();
        let r = rate(service.len() + errors);
        ops.push(OpStats::from_histogram(name, &service, errors, r));
        if open_loop {
            intended.push(OpStats::from_histogram(name, &from_intended, errors, r));
        }
    }
    let all = ops.last().expect("the ALL row");
    let operations = all.count + all.errors;
    PhaseStats {
        seconds,
        operations,
        ops_per_sec: rate(operations),
        not_found: stats.iter().map(|st| st.not_found).sum(),
        bad_values: stats.iter().map(|st| st.bad_values).sum(),
        first_error: stats.iter().find_map(|st| st.first_error.clone()),
        ops,
        intended,
    }
}

fn thread_main<C, F, Fut>(p: Arc<Phase>, t: u64, connect: &F) -> Result<Stats, String>
where
    C: KvConn,
    F: Fn(Settings) -> Fut,
    Fut: Future<Output = Result<C, String>>,
{
    let ticket = Ticket { gate: &p.gate, used: false };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    rt.block_on(async {
        let conn = connect(p.s.clone()).await;
        // Blocks this thread's runtime, which has nothing else to do yet.
        if !ticket.pass(conn.is_ok()) {
            // The thread that failed reports why; the others stop quietly.
            return conn.map(|_| Stats::new());
        }
        drive(conn?, Arc::clone(&p), t).await
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
        let (name, value) = (Bytes::from(key_name(k)), make_value(s.seed, k, derive(s.seed, 0, k), s.value_size));
        let start = Instant::now();
        let result = conn.set(name, value).await.map_err(Failure::Error);
        let o = Outcome { end: Instant::now(), result, parts: Vec::new() };
        local.stats.lock().expect("stats poisoned").record(OpKind::Insert, start, start, o);
    }
}

async fn run_slot<C: KvConn>(conn: &C, p: &Phase, local: &Local) {
    let s = &p.s;
    // Bounded by the operation count or by the deadline (one of them is set).
    loop {
        let idx = local.next.fetch_add(1, Ordering::Relaxed);
        let scheduled = local.interval.map(|iv| local.start + Duration::from_secs_f64(idx as f64 * iv));
        let intended = scheduled.unwrap_or_else(Instant::now);
        if local.deadline.is_some_and(|d| intended >= d) {
            break;
        }
        if let Some(at) = scheduled {
            // Open loop: the schedule, not the last reply, says when an
            // operation starts.
            tokio::time::sleep_until(at.into()).await;
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
        let prepared = prepare(p, local, op, &mut rng);
        // YCSB's DBWrapper starts its clock here, after the key was chosen
        // and the value built: at one-sided speeds those take a fair share
        // of an operation.
        let start = Instant::now();
        let o = perform(conn, p, prepared, start).await;
        if measuring {
            // Closed loop: the operation was meant to start when it did.
            let intended = scheduled.unwrap_or(start);
            local.stats.lock().expect("stats poisoned").record(op, intended, start, o);
        }
    }
}

/// An operation ready to send: its key chosen and its value built.
struct Prepared {
    op: OpKind,
    key: u64,
    name: Bytes,
    value: Bytes,
}

fn prepare(p: &Phase, local: &Local, op: OpKind, rng: &mut Rng) -> Prepared {
    let s = &p.s;
    let key = match op {
        OpKind::Insert => p.next_insert.fetch_add(1, Ordering::Relaxed),
        _ => local.keys.lock().expect("key chooser poisoned").next(rng, p.acked.limit()),
    };
    let value = match op {
        OpKind::Read => Bytes::new(),
        OpKind::Insert => make_value(s.seed, key, rng.next_u64(), s.value_size),
        OpKind::Update | OpKind::ReadModifyWrite => make_value(s.seed, key, rng.next_u64(), s.update_bytes()),
    };
    Prepared { op, key, name: Bytes::from(key_name(key)), value }
}

async fn read<C: KvConn>(conn: &C, s: &Settings, k: u64, name: Bytes) -> Result<(), Failure> {
    match conn.get(name).await {
        Ok(Some(v)) => {
            // Once updated with one field, a record is that field.
            let size = if v.len() == s.update_bytes() { v.len() } else { s.value_size };
            check_value(s.seed, k, size, &v).map_err(|b| Failure::Bad(k, b))
        }
        Ok(None) => Err(Failure::NotFound(k)),
        Err(e) => Err(Failure::Error(e)),
    }
}

/// Sends `op`, which the caller started timing at `start`.
async fn perform<C: KvConn>(conn: &C, p: &Phase, op: Prepared, start: Instant) -> Outcome {
    let s = &p.s;
    let done = |result| Outcome { end: Instant::now(), result, parts: Vec::new() };
    match op.op {
        OpKind::Read => done(read(conn, s, op.key, op.name).await),
        OpKind::Update => done(conn.set(op.name, op.value).await.map_err(Failure::Error)),
        OpKind::Insert => {
            let r = conn.set(op.name, op.value).await.map_err(Failure::Error);
            // YCSB acknowledges in a finally block: a failed insert (counted
            // in r) must not hold back the keys inserted after it.
            p.acked.ack(op.key);
            done(r)
        }
        OpKind::ReadModifyWrite => {
            let read = read(conn, s, op.key, op.name.clone()).await;
            let mid = Instant::now();
            // As YCSB, the update is sent whatever the read found.
            let update = conn.set(op.name, op.value).await.map_err(Failure::Error);
            let end = Instant::now();
            let result = if read.is_ok() && update.is_ok() { Ok(()) } else { Err(Failure::Part) };
            let parts = vec![
                Part { op: OpKind::Read, start, end: mid, result: read },
                Part { op: OpKind::Update, start: mid, end, result: update },
            ];
            Outcome { end, result, parts }
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
        /// How long each request takes.
        delay: Duration,
        map: Mutex<HashMap<Bytes, Bytes>>,
        /// Keys whose next SET fails.
        fail: Mutex<HashSet<Bytes>>,
        /// Keys read, in order.
        gets: Mutex<Vec<Bytes>>,
    }

    struct MemConn(Arc<MemStore>);

    impl KvConn for MemConn {
        async fn get(&self, key: Bytes) -> Result<Option<Bytes>, String> {
            tokio::time::sleep(self.0.delay).await;
            self.0.gets.lock().unwrap().push(key.clone());
            Ok(self.0.map.lock().unwrap().get(&key).cloned())
        }

        async fn set(&self, key: Bytes, value: Bytes) -> Result<(), String> {
            tokio::time::sleep(self.0.delay).await;
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
            records,
            operations: Some(operations),
            value_size: 100,
            threads: 2,
            in_flight: 4,
            seed: 3,
            ..Settings::new(BackendKind::Dmkv, "in memory", workload)
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

    #[test]
    fn throughput_is_operations_over_the_wall_window() {
        // Two threads, each 100 reads in one second, one after the other:
        // 200 operations in 2 s is 100 ops/s (summing each thread's own
        // rate would say 200).
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let thread = |from: u64| {
            let mut st = Stats::new();
            for i in 0..100 {
                let start = at(from + i * 10);
                st.record(
                    OpKind::Read,
                    start,
                    start,
                    Outcome { end: start + Duration::from_millis(10), result: Ok(()), parts: Vec::new() },
                );
            }
            st
        };
        let mix = Workload::C.mix().unwrap();
        let p = summarise(&[thread(0), thread(1000)], &OP_KINDS, mix, false, false);
        assert_eq!(p.operations, 200);
        assert!((p.seconds - 2.0).abs() < 1e-9, "{} s", p.seconds);
        assert!((p.ops_per_sec - 100.0).abs() < 1e-6, "{} ops/s", p.ops_per_sec);
        assert!((p.op("READ").unwrap().ops_per_sec - 100.0).abs() < 1e-6);
    }

    #[test]
    fn workload_f_times_the_read_and_update_inside_each_read_modify_write() {
        let store = Arc::new(MemStore::default());
        let r = run_mem(&mem_settings(Workload::F, 50, 400), &store);
        assert_eq!(r.failures(), 0, "{:?}", r.run.first_error);
        assert_eq!(r.comparability, "pipelined, not YCSB-comparable", "4 in flight per thread");
        let count = |op: &str| r.run.op(op).map_or(0, |o| o.count);
        let rmw = count("READ-MODIFY-WRITE");
        assert!(rmw > 100 && rmw < 300, "{rmw} read-modify-writes");
        assert_eq!(count(ALL_OPS), 400, "a read-modify-write is one operation");
        assert_eq!(r.run.operations, 400);
        assert_eq!(count("UPDATE"), rmw);
        assert_eq!(count("READ"), (400 - rmw) + rmw, "READ counts the reads inside read-modify-writes too");
        let rate = r.run.operations as f64 / r.run.seconds;
        assert!((r.run.ops_per_sec - rate).abs() < 1e-6 * rate);
        assert!(r.run.intended.is_empty(), "closed loop: service time only");
    }

    #[test]
    fn latency_is_timed_after_the_value_is_built() {
        // Values of 1 MiB take a while to build; an in-memory store answers
        // at once, so an UPDATE's latency must be far below the build time.
        // Timed builds before and after the run, the faster counting: a
        // latency that included the build would be at least that, plus the
        // store's copy. Other work on the machine slows both alike, so the
        // bound is a ratio with room for that noise (0.35 seen under load,
        // well under 0.1 on a quiet machine).
        let size = MAX_VALUE_SIZE;
        let build_us = || {
            let t = Instant::now();
            let built = (0..5).map(|i| make_value(1, i, i, size).len()).sum::<usize>();
            assert_eq!(built, 5 * size);
            t.elapsed().as_secs_f64() * 1e6 / 5.0
        };
        let before = build_us();
        let store = Arc::new(MemStore::default());
        let s = Settings { value_size: size, threads: 1, in_flight: 1, ..mem_settings(Workload::A, 10, 100) };
        let r = run_mem(&s, &store);
        let build_us = before.min(build_us());
        assert_eq!(r.comparability, "YCSB-comparable", "one operation in flight per thread");
        let update = r.run.op("UPDATE").unwrap();
        assert!(update.count > 20, "{} updates", update.count);
        assert!(
            update.p50_us < build_us * 0.6,
            "UPDATE p50 {:.0} µs, building a value {build_us:.0} µs",
            update.p50_us
        );
    }

    #[test]
    fn open_loop_reports_service_time_and_latency_from_the_intended_start() {
        // 2 ms a request against a schedule of one every 0.5 ms: operations
        // fall ever further behind, which only the intended start shows.
        let store = Arc::new(MemStore { delay: Duration::from_millis(2), ..MemStore::default() });
        let s = Settings { threads: 1, in_flight: 1, target_rate: Some(2000.0), ..mem_settings(Workload::C, 10, 100) };
        let r = run_mem(&s, &store);
        let (service, intended) = (r.run.op(ALL_OPS).unwrap(), &r.run.intended);
        let from_intended = intended.iter().find(|o| o.op == ALL_OPS).unwrap();
        assert_eq!(intended.len(), r.run.ops.len());
        assert_eq!(from_intended.count, service.count);
        assert!(
            from_intended.p50_us > 5.0 * service.p50_us,
            "p50 from the intended start {:.0} µs, service time {:.0} µs",
            from_intended.p50_us,
            service.p50_us
        );
        let text = crate::report::table(&r);
        assert!(text.contains("service time") && text.contains("from the intended start"), "{text}");
        assert!(crate::report::csv(&r).contains(",run,ALL,intended,"));
    }

    #[test]
    fn field_updates_write_one_field_and_reads_accept_it() {
        let store = Arc::new(MemStore::default());
        let s = Settings { value_size: 1000, update_writes: UpdateWrites::Field, ..mem_settings(Workload::A, 50, 400) };
        let r = run_mem(&s, &store);
        assert_eq!(r.failures(), 0, "{:?}", r.run.first_error);
        assert_eq!((r.fields, r.update_bytes), (10, 100));
        assert!(crate::report::table(&r).contains("one 100 B field"));
        let sizes: HashSet<usize> = store.map.lock().unwrap().values().map(|v| v.len()).collect();
        assert!(sizes.contains(&100), "no record was updated with one field: sizes {sizes:?}");
        // Whole-record updates (the default) leave every record whole.
        let store = Arc::new(MemStore::default());
        let r = run_mem(&Settings { value_size: 1000, ..mem_settings(Workload::A, 50, 400) }, &store);
        assert_eq!((r.update_bytes, r.failures()), (1000, 0));
        assert!(store.map.lock().unwrap().values().all(|v| v.len() == 1000));
    }
}

//! Scenarios for read-path selection: a latency-sensitive probe client GETs
//! a small key set while other clients load one of the two read paths, over
//! a real network path (a veth pair into a network namespace, where dmkvd
//! runs with `--no-shm`, so one-sided reads go through its TCP engine).
//!
//! - [`Scenario::EngineCongested`]: the engine's port is rate-limited with
//!   HTB and saturated by a bulk reader (one-sided GETs of large values).
//!   The probe's one-sided replies queue behind the bulk data; RPC replies
//!   do not.
//! - [`Scenario::RpcSaturated`]: writers keep the server's RPC workers busy
//!   with pipelined PUTs. RPC GETs queue behind them; engine reads do less
//!   work per GET.
//! - [`Scenario::HotKey`]: a writer rewrites the one key the probe GETs, so
//!   each one-sided GET finds its cached address stale and needs a second
//!   round trip; an RPC GET needs one.
//!
//! How the probe's GETs split between the paths is measured on the server:
//! the STATS counter `gets` counts RPC GETs (and each key of an RPC
//! multi-GET), the engine's counters count one-sided reads of every client.
//! The loads add no RPC GETs (the bulk reader is forced one-sided, writers
//! only PUT; the bulk reader's RPC fallbacks, which should be none, are
//! subtracted), so the delta of `gets` over a window is the probe's RPC
//! GETs. The probe's own `read_stats()` gives a second, client-side split;
//! [`Window::splits`] lists every source.
//!
//! `dmkv-pathbench` runs the scenarios and reports; `tests/pathsel.rs` checks
//! `ReadPath::Auto` against them.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::ValueEnum;
use dmkv_client::{Client, ClientConfig, ReadPath, Transport};
use dmkv_tests::ServerProcess;
use dmkv_tests::netns::{ClassStats, Netns};
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::generator::Rng;
use crate::report::new_histogram;

/// How long a load generator gets to connect and complete its first request.
pub const LOAD_READY_DEADLINE: Duration = Duration::from_secs(20);
/// Requests a single task of a load or the probe makes at most per phase
/// (a bound that time, not count, reaches first in practice).
const MAX_OPS_PER_TASK: u64 = 100_000_000;
/// PUTs in flight while preloading.
const PRELOAD_DEPTH: usize = 32;

/// The three situations the read-path selector must handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// The engine's port is rate-limited and saturated by a bulk reader.
    EngineCongested,
    /// The server's RPC workers are saturated by PUTs.
    RpcSaturated,
    /// The probe's key is rewritten continuously.
    HotKey,
}

impl Scenario {
    pub const ALL: [Scenario; 3] = [Scenario::EngineCongested, Scenario::RpcSaturated, Scenario::HotKey];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::EngineCongested => "engine-congested",
            Scenario::RpcSaturated => "rpc-saturated",
            Scenario::HotKey => "hot-key",
        }
    }

    /// The measured phases in order; the load runs during those marked true.
    pub fn phases(self) -> &'static [(&'static str, bool)] {
        match self {
            Scenario::EngineCongested => &[("idle", false), ("bulk", true), ("after", false)],
            Scenario::RpcSaturated => &[("idle", false), ("puts", true)],
            Scenario::HotKey => &[("idle", false), ("writes", true)],
        }
    }
}

/// Name of a read path as the CLI spells it.
pub fn path_name(p: ReadPath) -> &'static str {
    match p {
        ReadPath::Auto => "auto",
        ReadPath::OneSided => "one-sided",
        ReadPath::Rpc => "rpc",
    }
}

/// Every knob of the scenarios. The defaults suit release builds on a
/// 2-core machine: the probe alone (about 120 k one-sided GETs/s, 1.3 KB
/// of reply each) uses about 60 % of the 2 Gbit/s engine link, and four
/// bulk readers with four 2 × 64 KiB multi-GETs in flight each fill it.
#[derive(Debug, Clone, Serialize)]
pub struct Params {
    /// Values of the probe's keys and of the writers' PUTs.
    pub value_size: usize,
    /// Keys the probe GETs (uniformly), except in hot-key.
    pub probe_keys: u64,
    /// The probe's GETs in flight.
    pub in_flight: usize,
    /// HTB rate of the engine's replies (engine-congested), tc syntax.
    pub rate: String,
    /// Byte limit of the rate-limited queue; `None`: about 30 ms at `rate`.
    pub queue_limit: Option<u32>,
    /// Bulk reader: value size, keys, clients, multi-GETs in flight per
    /// client, keys per multi-GET.
    pub bulk_value_size: usize,
    pub bulk_keys: u64,
    pub bulk_clients: usize,
    pub bulk_in_flight: usize,
    pub bulk_batch: usize,
    /// PUT load (rpc-saturated): clients, PUTs in flight per client, keys.
    pub writers: usize,
    pub writer_in_flight: usize,
    pub writer_keys: u64,
    /// Hot-key writer: PUTs of the hot key in flight.
    pub hot_in_flight: usize,
    pub seed: u64,
    /// Hard limit of any load generator's run, whatever else happens.
    pub load_limit: Duration,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            value_size: 1000,
            probe_keys: 1000,
            in_flight: 4,
            rate: "2gbit".into(),
            queue_limit: None,
            bulk_value_size: 64 * 1024,
            bulk_keys: 64,
            bulk_clients: 4,
            bulk_in_flight: 4,
            bulk_batch: 2,
            writers: 4,
            writer_in_flight: 32,
            writer_keys: 20_000,
            hot_in_flight: 16,
            seed: 1,
            load_limit: Duration::from_secs(600),
        }
    }
}

/// Bytes per second of a tc rate ("40mbit", "1gbit", "500kbit", "1000000").
pub fn rate_bytes_per_sec(rate: &str) -> Option<u64> {
    let r = rate.trim().to_ascii_lowercase();
    let split = r.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(r.len());
    let (num, unit) = r.split_at(split);
    let n: f64 = num.parse().ok()?;
    let bits = match unit {
        "" | "bit" | "bps" => n,
        "kbit" => n * 1e3,
        "mbit" => n * 1e6,
        "gbit" => n * 1e9,
        _ => return None,
    };
    Some((bits / 8.0) as u64)
}

/// The probe's key `i`.
pub fn probe_key(i: u64) -> Bytes {
    Bytes::from(format!("probe{i:06}"))
}

/// The key the hot-key scenario rewrites and GETs.
pub fn hot_key() -> Bytes {
    Bytes::from_static(b"hot-key")
}

fn bulk_key(i: u64) -> Bytes {
    Bytes::from(format!("bulk{i:06}"))
}

fn writer_key(i: u64) -> Bytes {
    Bytes::from(format!("w{i:08}"))
}

/// A namespace with dmkvd inside, shaped for one scenario. Dropping it
/// stops the server, then deletes the namespace.
pub struct Setup {
    // Field order is drop order: the server leaves the namespace first.
    server: ServerProcess,
    ns: Netns,
    pub scenario: Scenario,
    pub params: Params,
    /// dmkvd's RPC and engine addresses (inside the namespace).
    pub rpc: String,
    pub engine: String,
}

impl Setup {
    /// Creates the namespace, starts dmkvd in it (`--no-shm`, so one-sided
    /// reads go to the engine) and, for engine-congested, rate-limits the
    /// engine's replies.
    pub fn start(scenario: Scenario, params: Params) -> Result<Setup, String> {
        Netns::available().map_err(|e| format!("network namespaces unavailable: {e}"))?;
        let ns = Netns::new()?;
        let listen = format!("{}:0", ns.ns_addr());
        // A private namespace: nobody else can reach it, so no secrets.
        let mut args = vec!["--engine-listen", &listen, "--no-shm", "--insecure"];
        if scenario == Scenario::RpcSaturated {
            args.extend(["--memory", "512MiB"]);
        }
        let server = ServerProcess::start_with(&ns.exec_prefix(), &listen, &args)?;
        let engine = server.endpoint("engine").ok_or("dmkvd reported no engine address")?.to_string();
        let rpc = server.rpc.clone();
        let setup = Setup { server, ns, scenario, params, rpc, engine };
        if scenario == Scenario::EngineCongested {
            let port = setup.engine_port()?;
            let p = &setup.params;
            let bps = rate_bytes_per_sec(&p.rate).ok_or_else(|| format!("bad rate {:?}", p.rate))?;
            // About 30 ms of queue, but room for a few 64 KiB GSO packets.
            let limit = p.queue_limit.unwrap_or_else(|| (bps * 3 / 100).max(192 * 1024) as u32);
            setup.ns.shape_sport(port, &p.rate, Some(limit))?;
        }
        Ok(setup)
    }

    /// The engine's port (for shaping its replies).
    pub fn engine_port(&self) -> Result<u16, String> {
        self.engine
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .ok_or_else(|| format!("bad engine address {:?}", self.engine))
    }

    /// The namespace.
    pub fn netns(&self) -> &Netns {
        &self.ns
    }

    /// dmkvd's pid.
    pub fn server_pid(&self) -> u32 {
        self.server.pid()
    }

    /// Counters of the rate-limited class, where there is one.
    pub fn slow_class(&self) -> Option<ClassStats> {
        (self.scenario == Scenario::EngineCongested).then(|| self.ns.slow_class_stats().ok()).flatten()
    }

    /// A client of the given read path (one-sided reads over the engine).
    pub async fn client(&self, path: ReadPath) -> Result<Client, String> {
        self.client_with(ClientConfig::default().read_path(path)).await
    }

    /// A client with settings of its own; one-sided reads over the engine.
    pub async fn client_with(&self, cfg: ClientConfig) -> Result<Client, String> {
        let cfg = cfg.transport(Some(Transport::Engine));
        Client::connect_with(self.rpc.clone(), cfg).await.map_err(|e| format!("connect to {}: {e}", self.rpc))
    }

    /// The keys the probe GETs.
    pub fn probe_keys(&self) -> Arc<Vec<Bytes>> {
        Arc::new(match self.scenario {
            Scenario::HotKey => vec![hot_key()],
            _ => (0..self.params.probe_keys).map(probe_key).collect(),
        })
    }

    /// Stores every key the scenario reads.
    pub async fn preload(&self) -> Result<(), String> {
        let c = self.client(ReadPath::Rpc).await?;
        let p = &self.params;
        let value = Bytes::from(vec![b'p'; p.value_size]);
        let mut items: Vec<(Bytes, Bytes)> = (0..p.probe_keys).map(|i| (probe_key(i), value.clone())).collect();
        items.push((hot_key(), value.clone()));
        if self.scenario == Scenario::EngineCongested {
            let big = Bytes::from(vec![b'b'; p.bulk_value_size]);
            items.extend((0..p.bulk_keys).map(|i| (bulk_key(i), big.clone())));
        }
        let items = Arc::new(items);
        let next = Arc::new(AtomicU64::new(0));
        let mut tasks: tokio::task::JoinSet<Result<(), String>> = tokio::task::JoinSet::new();
        for _ in 0..PRELOAD_DEPTH {
            let (c, items, next) = (c.clone(), Arc::clone(&items), Arc::clone(&next));
            tasks.spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some((k, v)) = items.get(i) else { return Ok(()) };
                    c.put(k, v).await.map_err(|e| format!("preload PUT: {e}"))?;
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.map_err(|e| format!("preload task: {e}"))??;
        }
        Ok(())
    }

    /// Starts the scenario's load and waits until every client of it has
    /// completed a request.
    pub fn start_load(&self) -> Result<Load, String> {
        let p = self.params.clone();
        let rpc = self.rpc.clone();
        match self.scenario {
            Scenario::EngineCongested => Load::spawn("bulk", p.load_limit, move |ctx| bulk_reader(rpc, p, ctx)),
            Scenario::RpcSaturated => Load::spawn("puts", p.load_limit, move |ctx| put_writers(rpc, p, ctx)),
            Scenario::HotKey => Load::spawn("hot-writer", p.load_limit, move |ctx| hot_writer(rpc, p, ctx)),
        }
    }

    /// Warms the probe up: GETs every probe key once (caches addresses).
    pub async fn warm(&self, probe: &Client, keys: &[Bytes]) -> Result<(), String> {
        for k in keys {
            probe.get(k).await.map_err(|e| format!("warm-up GET: {e}"))?;
        }
        Ok(())
    }

    /// Runs the probe for `dur`: `in_flight` closed-loop GETs of random
    /// `keys`, each GET timed. Every GET started is finished before the
    /// window's counters are read, so the server's deltas are exactly the
    /// window's. `load` is the load running meanwhile, if any.
    pub async fn window(
        &self,
        probe: &Client,
        admin: &Client,
        keys: &Arc<Vec<Bytes>>,
        dur: Duration,
        load: Option<&Load>,
    ) -> Result<Window, String> {
        let stats = |m: &HashMap<String, u64>, k: &str| m.get(k).copied().unwrap_or(0);
        let s0 = admin.stats().await.map_err(|e| format!("STATS: {e}"))?;
        let r0 = probe.read_stats();
        let p0 = probe.path_stats().controller;
        let l0 = load.map(|l| l.snapshot()).unwrap_or_default();
        let c0 = self.slow_class();
        let start = Instant::now();
        let deadline = start + dur;
        let mut tasks = tokio::task::JoinSet::new();
        for t in 0..self.params.in_flight.max(1) {
            let (probe, keys, want) = (probe.clone(), Arc::clone(keys), self.params.value_size);
            let mut rng = Rng::new(crate::generator::derive(self.params.seed, 0x9e0be, t as u64));
            tasks.spawn(async move {
                let mut h = new_histogram();
                let (mut errors, mut wrong, mut first_error) = (0u64, 0u64, None);
                for _ in 0..MAX_OPS_PER_TASK {
                    if Instant::now() >= deadline {
                        break;
                    }
                    let k = &keys[rng.below(keys.len() as u64) as usize];
                    let t0 = Instant::now();
                    let r = probe.get(k).await;
                    h.saturating_record(t0.elapsed().as_nanos() as u64);
                    match r {
                        Ok(Some(v)) if v.len() == want => {}
                        Ok(_) => wrong += 1,
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert(e.to_string());
                        }
                    }
                }
                (h, errors, wrong, first_error)
            });
        }
        let mut w = Window { hist: new_histogram(), ..Default::default() };
        while let Some(r) = tasks.join_next().await {
            let (h, errors, wrong, first_error) = r.map_err(|e| format!("probe task: {e}"))?;
            w.hist.add(&h).map_err(|e| format!("histogram: {e}"))?;
            w.errors += errors;
            w.wrong += wrong;
            if w.first_error.is_none() {
                w.first_error = first_error;
            }
        }
        w.secs = start.elapsed().as_secs_f64();
        let s1 = admin.stats().await.map_err(|e| format!("STATS: {e}"))?;
        let r1 = probe.read_stats();
        let p1 = probe.path_stats().controller;
        let l1 = load.map(|l| l.snapshot()).unwrap_or_default();
        w.gets = w.hist.len();
        w.load_rpc_gets = l1.rpc_gets - l0.rpc_gets;
        w.server_rpc_gets = (stats(&s1, "gets") - stats(&s0, "gets")).saturating_sub(w.load_rpc_gets);
        w.engine_batches = stats(&s1, "engine_batches") - stats(&s0, "engine_batches");
        w.engine_reads = stats(&s1, "engine_reads") - stats(&s0, "engine_reads");
        w.client_one_sided = r1.gets - r0.gets;
        w.selector_rpc = p1.rpc.requests - p0.rpc.requests;
        w.selector_one_sided = p1.one_sided.requests - p0.one_sided.requests;
        w.switches = p1.switches - p0.switches;
        w.selector = Some(p1);
        w.client_fallbacks = r1.fallbacks - r0.fallbacks;
        w.client_retries = (r1.torn + r1.other_key + r1.slow) - (r0.torn + r0.other_key + r0.slow);
        w.hint_hits = r1.hint_hits - r0.hint_hits;
        w.load_ops = l1.ops - l0.ops;
        w.load_bytes = l1.bytes - l0.bytes;
        w.load_errors = l1.errors - l0.errors;
        if let (Some(a), Some(b)) = (c0, self.slow_class()) {
            w.slow_class_bytes = Some(b.sent_bytes - a.sent_bytes);
            w.slow_class_drops = Some(b.dropped - a.dropped);
        }
        Ok(w)
    }
}

/// What one probe window measured.
#[derive(Debug, Clone)]
pub struct Window {
    pub secs: f64,
    /// Latency of every GET, in nanoseconds.
    pub hist: Histogram<u64>,
    pub gets: u64,
    pub errors: u64,
    /// GETs that found no value or one of the wrong length.
    pub wrong: u64,
    pub first_error: Option<String>,
    /// The probe's RPC GETs, counted by the server.
    pub server_rpc_gets: u64,
    /// RPC GETs the load made (fallbacks of the bulk reader); subtracted.
    pub load_rpc_gets: u64,
    /// Engine work of all clients.
    pub engine_batches: u64,
    pub engine_reads: u64,
    /// The probe's one-sided GETs, counted by its client (`read_stats`).
    pub client_one_sided: u64,
    /// The probe's GETs per path by its path controller (`path_stats`):
    /// callers' GETs only, no background probes.
    pub selector_rpc: u64,
    pub selector_one_sided: u64,
    /// Changes of the preferred path during the window.
    pub switches: u64,
    /// The controller's state at the end of the window.
    pub selector: Option<dmkv_common::path::ControllerStats>,
    pub client_fallbacks: u64,
    pub client_retries: u64,
    pub hint_hits: u64,
    /// The load's requests (keys, for multi-GETs), bytes and errors.
    pub load_ops: u64,
    pub load_bytes: u64,
    pub load_errors: u64,
    /// Bytes sent and packets dropped by the rate-limited class.
    pub slow_class_bytes: Option<u64>,
    pub slow_class_drops: Option<u64>,
}

impl Default for Window {
    fn default() -> Self {
        Window {
            secs: 0.0,
            hist: new_histogram(),
            gets: 0,
            errors: 0,
            wrong: 0,
            first_error: None,
            server_rpc_gets: 0,
            load_rpc_gets: 0,
            engine_batches: 0,
            engine_reads: 0,
            client_one_sided: 0,
            selector_rpc: 0,
            selector_one_sided: 0,
            switches: 0,
            selector: None,
            client_fallbacks: 0,
            client_retries: 0,
            hint_hits: 0,
            load_ops: 0,
            load_bytes: 0,
            load_errors: 0,
            slow_class_bytes: None,
            slow_class_drops: None,
        }
    }
}

/// How the probe's GETs of a window split between the paths, by one source.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Split {
    /// "server" (STATS deltas) or "client" (the probe's `read_stats`).
    pub source: &'static str,
    pub rpc: u64,
    pub one_sided: u64,
}

impl Split {
    /// Share of the GETs that went RPC, 0 to 1 (0 without GETs).
    pub fn rpc_share(&self) -> f64 {
        let all = self.rpc + self.one_sided;
        if all == 0 { 0.0 } else { self.rpc as f64 / all as f64 }
    }
}

impl Window {
    /// GETs per second.
    pub fn rate(&self) -> f64 {
        self.gets as f64 / self.secs.max(1e-9)
    }

    /// Latency quantile in microseconds.
    pub fn quantile_us(&self, q: f64) -> f64 {
        if self.hist.is_empty() { 0.0 } else { self.hist.value_at_quantile(q) as f64 / 1000.0 }
    }

    /// The split of the probe's GETs by every source available: the
    /// server's first, then the probe's `read_stats`, then its path
    /// controller's. The first two have a bias once the controller probes
    /// the path it does not prefer: the server also counts RPC probes,
    /// `read_stats` also counts one-sided probes. The controller's own
    /// per-path request counters leave probes out and are exact, but they
    /// are the client's word; the server's count checks it.
    pub fn splits(&self) -> Vec<Split> {
        let server_rpc = self.server_rpc_gets.min(self.gets);
        let client_os = self.client_one_sided.min(self.gets);
        vec![
            Split { source: "server", rpc: server_rpc, one_sided: self.gets - server_rpc },
            Split { source: "client", rpc: self.gets - client_os, one_sided: client_os },
            Split { source: "selector", rpc: self.selector_rpc, one_sided: self.selector_one_sided },
        ]
    }

    /// The server-side split.
    pub fn server_split(&self) -> Split {
        self.splits()[0]
    }

    /// One line for logs.
    pub fn summary(&self) -> String {
        let s = self.server_split();
        let mut line = format!(
            "{:.0} GETs/s p50 {:.0}us p99 {:.0}us rpc {:.0}% (server) {:.0}% (client) {:.0}% (selector) switches {} errors {} wrong {} load {:.0} ops/s",
            self.rate(),
            self.quantile_us(0.5),
            self.quantile_us(0.99),
            100.0 * s.rpc_share(),
            100.0 * self.splits()[1].rpc_share(),
            100.0 * self.splits()[2].rpc_share(),
            self.switches,
            self.errors,
            self.wrong,
            self.load_ops as f64 / self.secs.max(1e-9),
        );
        if let Some(b) = self.slow_class_bytes {
            line += &format!(" shaped {:.1} Mbit/s", b as f64 * 8.0 / 1e6 / self.secs.max(1e-9));
        }
        line
    }
}

/// Counters a load keeps while it runs.
#[derive(Debug, Default)]
struct LoadCounters {
    ops: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    rpc_gets: AtomicU64,
}

/// A snapshot of a load's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LoadSnapshot {
    /// Requests (keys, for multi-GETs) completed.
    pub ops: u64,
    pub bytes: u64,
    pub errors: u64,
    /// GETs that fell back to RPC (bulk reader only).
    pub rpc_gets: u64,
}

/// What a load's tasks see.
#[derive(Clone)]
pub struct LoadCtx {
    stop: Arc<AtomicBool>,
    limit: Instant,
    counters: Arc<LoadCounters>,
    ready: mpsc::SyncSender<Result<(), String>>,
}

impl LoadCtx {
    /// Whether to stop: asked to, or past the hard limit.
    pub fn done(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || Instant::now() >= self.limit
    }

    fn ready(&self, r: Result<(), String>) {
        let _ = self.ready.try_send(r);
    }
}

/// A load generator on its own thread and runtime; stopped and joined on
/// drop.
pub struct Load {
    name: &'static str,
    stop: Arc<AtomicBool>,
    counters: Arc<LoadCounters>,
    thread: Option<JoinHandle<Result<(), String>>>,
}

impl Load {
    /// Runs `body` on a new thread; returns once it reports ready (or fails).
    pub fn spawn<F, Fut>(name: &'static str, limit: Duration, body: F) -> Result<Load, String>
    where
        F: FnOnce(LoadCtx) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), String>>,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(LoadCounters::default());
        let (tx, rx) = mpsc::sync_channel(1);
        let ctx = LoadCtx {
            stop: Arc::clone(&stop),
            limit: Instant::now() + limit,
            counters: Arc::clone(&counters),
            ready: tx,
        };
        let thread = std::thread::Builder::new()
            .name(format!("load-{name}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| format!("runtime: {e}"))?;
                let ready = ctx.ready.clone();
                let r = rt.block_on(body(ctx));
                let _ = ready.try_send(r.clone().and(Err("the load ended before it was ready".into())));
                r
            })
            .map_err(|e| format!("spawn load thread: {e}"))?;
        let mut load = Load { name, stop, counters, thread: Some(thread) };
        match rx.recv_timeout(LOAD_READY_DEADLINE) {
            Ok(Ok(())) => Ok(load),
            Ok(Err(e)) => {
                let _ = load.stop();
                Err(format!("load {name}: {e}"))
            }
            Err(_) => {
                let _ = load.stop();
                Err(format!("load {name} not ready within {LOAD_READY_DEADLINE:?}"))
            }
        }
    }

    /// The counters now.
    pub fn snapshot(&self) -> LoadSnapshot {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LoadSnapshot { ops: l(&c.ops), bytes: l(&c.bytes), errors: l(&c.errors), rpc_gets: l(&c.rpc_gets) }
    }

    /// Stops the load and waits for its thread (each task finishes the
    /// request it is in, bounded by the client's request timeout).
    pub fn stop(&mut self) -> Result<LoadSnapshot, String> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().map_err(|_| format!("load {} panicked", self.name))??;
        }
        Ok(self.snapshot())
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("{e}");
        }
    }
}

async fn connect(rpc: &str, path: ReadPath) -> Result<Client, String> {
    let cfg = ClientConfig::default().read_path(path).transport(Some(Transport::Engine)).pool_size(1);
    Client::connect_with(rpc.to_string(), cfg).await.map_err(|e| format!("connect to {rpc}: {e}"))
}

/// Runs `tasks_per_client` copies of `op` per client until the load stops;
/// reports ready once every client has completed one `op`.
async fn run_tasks<F, Fut>(
    clients: Vec<Client>,
    tasks_per_client: usize,
    ctx: LoadCtx,
    seed: u64,
    op: F,
) -> Result<(), String>
where
    F: Fn(Client, &mut Rng) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(u64, u64), String>> + Send,
{
    let op = Arc::new(op);
    let mut rng = Rng::new(seed);
    for c in &clients {
        let (n, bytes) = op(c.clone(), &mut rng).await?;
        ctx.counters.ops.fetch_add(n, Ordering::Relaxed);
        ctx.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
    ctx.ready(Ok(()));
    let mut tasks = tokio::task::JoinSet::new();
    for (ci, c) in clients.into_iter().enumerate() {
        for t in 0..tasks_per_client.max(1) {
            let (c, ctx, op) = (c.clone(), ctx.clone(), Arc::clone(&op));
            let mut rng = Rng::new(crate::generator::derive(seed, ci as u64, t as u64));
            tasks.spawn(async move {
                for _ in 0..MAX_OPS_PER_TASK {
                    if ctx.done() {
                        break;
                    }
                    match op(c.clone(), &mut rng).await {
                        Ok((n, bytes)) => {
                            ctx.counters.ops.fetch_add(n, Ordering::Relaxed);
                            ctx.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
                        }
                        Err(_) => {
                            ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.map_err(|e| format!("load task: {e}"))?;
    }
    Ok(())
}

/// One-sided multi-GETs of large values, forced over the engine.
async fn bulk_reader(rpc: String, p: Params, ctx: LoadCtx) -> Result<(), String> {
    let mut clients = Vec::new();
    for _ in 0..p.bulk_clients.max(1) {
        clients.push(connect(&rpc, ReadPath::OneSided).await?);
    }
    let counters = Arc::clone(&ctx.counters);
    let fallbacks: Arc<Vec<Client>> = Arc::new(clients.clone());
    let (keys, batch) = (p.bulk_keys.max(1), p.bulk_batch.max(1));
    run_tasks(clients, p.bulk_in_flight, ctx, p.seed ^ 0xb01c, move |c, rng| {
        let ks: Vec<Bytes> = (0..batch).map(|_| bulk_key(rng.below(keys))).collect();
        let (counters, all) = (Arc::clone(&counters), Arc::clone(&fallbacks));
        async move {
            let vs = c.multi_get(&ks).await.map_err(|e| e.to_string())?;
            // A one-sided GET that gives up goes RPC and counts in the
            // server's `gets`: keep the total for the windows to subtract.
            let fb: u64 = all.iter().map(|c| c.read_stats().fallbacks).sum();
            counters.rpc_gets.fetch_max(fb, Ordering::Relaxed);
            Ok((vs.len() as u64, vs.iter().flatten().map(|v| v.len() as u64).sum()))
        }
    })
    .await
}

/// Pipelined PUTs of random keys from several connections.
async fn put_writers(rpc: String, p: Params, ctx: LoadCtx) -> Result<(), String> {
    let mut clients = Vec::new();
    for _ in 0..p.writers.max(1) {
        clients.push(connect(&rpc, ReadPath::Rpc).await?);
    }
    let value = Bytes::from(vec![b'w'; p.value_size]);
    let keys = p.writer_keys.max(1);
    run_tasks(clients, p.writer_in_flight, ctx, p.seed ^ 0x9075, move |c, rng| {
        let (k, v) = (writer_key(rng.below(keys)), value.clone());
        async move {
            c.put(&k, &v).await.map_err(|e| e.to_string())?;
            Ok((1, v.len() as u64))
        }
    })
    .await
}

/// PUTs of the hot key, pipelined.
async fn hot_writer(rpc: String, p: Params, ctx: LoadCtx) -> Result<(), String> {
    let c = connect(&rpc, ReadPath::Rpc).await?;
    let value = Bytes::from(vec![b'h'; p.value_size]);
    run_tasks(vec![c], p.hot_in_flight, ctx, p.seed ^ 0x4077, move |c, _| {
        let v = value.clone();
        async move {
            c.put(hot_key(), &v).await.map_err(|e| e.to_string())?;
            Ok((1, v.len() as u64))
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tc_rates() {
        assert_eq!(rate_bytes_per_sec("40mbit"), Some(5_000_000));
        assert_eq!(rate_bytes_per_sec("1gbit"), Some(125_000_000));
        assert_eq!(rate_bytes_per_sec("800kbit"), Some(100_000));
        assert_eq!(rate_bytes_per_sec("8000"), Some(1000));
        assert_eq!(rate_bytes_per_sec("fast"), None);
    }

    #[test]
    fn splits_never_exceed_the_gets() {
        let w = Window {
            gets: 10,
            server_rpc_gets: 12,
            client_one_sided: 4,
            selector_rpc: 7,
            selector_one_sided: 3,
            ..Default::default()
        };
        let s = w.splits();
        assert_eq!(s[0], Split { source: "server", rpc: 10, one_sided: 0 });
        assert_eq!(s[1], Split { source: "client", rpc: 6, one_sided: 4 });
        assert_eq!(s[2], Split { source: "selector", rpc: 7, one_sided: 3 });
        assert_eq!(Split { source: "x", rpc: 0, one_sided: 0 }.rpc_share(), 0.0);
    }
}

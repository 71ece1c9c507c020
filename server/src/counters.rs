//! Counters that one part of the server keeps and another exports (STATS
//! in the RPC service, `/metrics` in the scraper): here, at the bottom, so
//! that the parts that count (listeners, framed connections, the raft
//! log) do not depend on the parts that read the counts.
//!
//! The hot path only adds to fixed arrays of relaxed atomics.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use dmkv_common::proto::{ErrorCode, Response, request::Op, response::Result as R};

/// What the one-sided engine counts. Relaxed atomics: they are statistics.
#[derive(Debug, Default)]
pub struct EngineCounters {
    pub batches: AtomicU64,
    pub reads: AtomicU64,
    pub bytes: AtomicU64,
    pub rejected: AtomicU64,
}

/// The operations requests are counted by (`op` label).
pub const OPS: [&str; 7] = ["get", "put", "delete", "multi_get", "stats", "region_info", "other"];
/// Latency histogram buckets: upper bounds from [`FIRST_BOUND_US`]
/// doubling, plus +Inf.
pub const LATENCY_BUCKETS: usize = 20;
/// The smallest latency bucket's upper bound, in microseconds.
pub const FIRST_BOUND_US: u64 = 10;
/// Error codes counted per op (the protocol's codes are below this; a
/// larger one is counted as `internal`).
pub(crate) const ERROR_CODES: usize = 32;
/// Result slots per op: ok, not_found, then one per error code.
pub(crate) const RESULTS: usize = 2 + ERROR_CODES;
/// The index of GET in [`OPS`].
pub(crate) const GET: usize = 0;
// A connection notes (op, result) indexes as bytes until it counts them.
const _: () = assert!(OPS.len() <= 256 && RESULTS <= 256);
pub(crate) const OK: usize = 0;
pub(crate) const NOT_FOUND: usize = 1;

/// Latency of one kind of request, and how its requests ended.
pub(crate) struct OpStats {
    pub(crate) results: [AtomicU64; RESULTS],
    /// Per bucket (not cumulative); the last is +Inf.
    pub(crate) buckets: [AtomicU64; LATENCY_BUCKETS + 1],
    pub(crate) sum_nanos: AtomicU64,
}

/// Copies of the request counters, one per group of worker threads, so
/// that workers do not fight over the cache lines of shared counters on
/// every request; readers add them up.
const STAT_SHARDS: usize = 8;

/// One copy of every op's counters, on cache lines of its own.
#[repr(align(128))]
#[derive(Default)]
struct StatShard([OpStats; OPS.len()]);

/// The shard this thread counts in.
fn stat_shard() -> usize {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static SHARD: usize = (NEXT.fetch_add(1, Relaxed) % STAT_SHARDS as u64) as usize;
    }
    SHARD.with(|s| *s)
}

impl OpStats {
    /// Adds `other`'s counts to these.
    fn add(&self, other: &OpStats) {
        let pairs = self.results.iter().zip(&other.results).chain(self.buckets.iter().zip(&other.buckets));
        for (a, b) in pairs.chain(std::iter::once((&self.sum_nanos, &other.sum_nanos))) {
            a.fetch_add(b.load(Relaxed), Relaxed);
        }
    }
}

impl Default for OpStats {
    fn default() -> Self {
        OpStats {
            results: std::array::from_fn(|_| AtomicU64::new(0)),
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_nanos: AtomicU64::new(0),
        }
    }
}

/// What one listener moved: bytes and connections.
#[derive(Debug)]
pub struct ListenerStats {
    /// The `listener` label, and the listener's name in logs.
    pub name: &'static str,
    pub received: AtomicU64,
    pub sent: AtomicU64,
    pub open: AtomicU64,
    pub accepted: AtomicU64,
}

impl ListenerStats {
    /// Counters for the listener called `name`.
    pub fn new(name: &'static str) -> Arc<ListenerStats> {
        Arc::new(ListenerStats {
            name,
            received: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            open: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
        })
    }
}

/// The server's own counters (what is not already kept elsewhere).
pub struct Metrics {
    ops: Box<[StatShard; STAT_SHARDS]>,
    pub rpc: Arc<ListenerStats>,
    pub engine: Arc<ListenerStats>,
    pub shm: Arc<ListenerStats>,
    pub peer: Arc<ListenerStats>,
    pub metrics: Arc<ListenerStats>,
    /// The memcached port (`--memcached-listen`).
    pub memcached: Arc<ListenerStats>,
    /// The verbs RPC's queue pairs (bytes of requests and replies in its
    /// messages; `open`: queue pairs now).
    pub verbs: Arc<ListenerStats>,
    /// Re-registrations done by `--rkey-rotate-secs`.
    pub rkey_rotations: AtomicU64,
    /// Set once every listener is up.
    pub serving: AtomicBool,
    /// The first listener that failed after start (the engine's thread did
    /// not start, the shm handoff's loop ended): not ready from then on.
    pub failed: std::sync::OnceLock<String>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ops: Box::default(),
            rpc: ListenerStats::new("rpc"),
            engine: ListenerStats::new("engine"),
            shm: ListenerStats::new("shm"),
            peer: ListenerStats::new("peer"),
            metrics: ListenerStats::new("metrics"),
            memcached: ListenerStats::new("memcached"),
            verbs: ListenerStats::new("verbs"),
            rkey_rotations: AtomicU64::new(0),
            serving: AtomicBool::new(false),
            failed: std::sync::OnceLock::new(),
        }
    }
}

/// The `op` index of a request.
pub fn op_index(op: Option<&Op>) -> usize {
    match op {
        Some(Op::Get(_)) => GET,
        Some(Op::Put(_)) => 1,
        Some(Op::Delete(_)) => 2,
        Some(Op::MultiGet(_)) => 3,
        Some(Op::Stats(_)) => 4,
        Some(Op::RegionInfo(_)) => 5,
        _ => 6,
    }
}

/// How a reply ended: ok, not_found (a GET that found nothing, a DELETE of
/// nothing), or its error code.
pub(crate) fn result_index(resp: &Response) -> usize {
    match &resp.result {
        Some(R::Error(e)) => {
            let code = usize::try_from(e.code).ok().filter(|&c| c < ERROR_CODES);
            2 + code.unwrap_or(ErrorCode::Internal as usize)
        }
        Some(R::Get(g)) if !g.found => NOT_FOUND,
        Some(R::Delete(d)) if !d.existed => NOT_FOUND,
        _ => OK,
    }
}

/// Whether result `i` of op `op` is always shown (ok always; not_found
/// for the ops that can find nothing), or only once it happened.
pub(crate) fn always_shown(op: usize, i: usize) -> bool {
    i == OK || (i == NOT_FOUND && matches!(OPS[op], "get" | "delete"))
}

/// The `result` label of a result slot.
pub(crate) fn result_name(i: usize) -> String {
    match i {
        OK => "ok".into(),
        NOT_FOUND => "not_found".into(),
        _ => match ErrorCode::try_from((i - 2) as i32) {
            Ok(c) => c.as_str_name().to_ascii_lowercase(),
            Err(_) => format!("code_{}", i - 2),
        },
    }
}

/// The histogram bucket of a latency: the first whose bound it does not
/// exceed (bounds are inclusive, as Prometheus's `le`).
pub(crate) fn bucket_of(nanos: u64) -> usize {
    let first = FIRST_BOUND_US * 1000;
    let q = nanos.saturating_sub(1) / first;
    ((u64::BITS - q.leading_zeros()) as usize).min(LATENCY_BUCKETS)
}

/// A bucket's upper bound in microseconds.
pub(crate) fn bound_us(i: usize) -> u64 {
    FIRST_BOUND_US << i
}

impl Metrics {
    /// Counts one request of kind `op` answered with `resp` after `took`.
    pub fn record(&self, op: usize, resp: &Response, took: Duration) {
        self.record_result(op, result_index(resp), took);
    }

    /// Counts requests of kind `op` with result index `result` (see
    /// `result_index`), all answered after `took`: a connection's batch,
    /// timed by one clock read.
    /// Runs of equal entries (a batch is mostly one kind) are added at once.
    pub(crate) fn record_batch(&self, done: &[(u8, u8)], took: Duration) {
        let shard = &self.ops[stat_shard()].0;
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let bucket = bucket_of(nanos);
        for run in done.chunk_by(|a, b| a == b) {
            let (op, result) = run[0];
            let Some(s) = shard.get(usize::from(op)) else { continue };
            let n = run.len() as u64;
            s.results[usize::from(result).min(RESULTS - 1)].fetch_add(n, Relaxed);
            s.buckets[bucket].fetch_add(n, Relaxed);
            s.sum_nanos.fetch_add(nanos.saturating_mul(n), Relaxed);
        }
    }

    /// Counts one request refused with `code` before it ran.
    pub fn record_error(&self, op: usize, code: ErrorCode, took: Duration) {
        self.record_result(op, 2 + code as usize, took);
    }

    fn record_result(&self, op: usize, result: usize, took: Duration) {
        let Some(s) = self.ops[stat_shard()].0.get(op) else { return };
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        s.results[result.min(RESULTS - 1)].fetch_add(1, Relaxed);
        s.buckets[bucket_of(nanos)].fetch_add(1, Relaxed);
        s.sum_nanos.fetch_add(nanos, Relaxed);
    }

    /// The request counts and latency histograms as STATS keys:
    /// `latency_us_<op>_le_<bound>` (cumulative), `_le_inf`, `_count`,
    /// `_sum` (microseconds), and `requests_<op>_<result>` (ok always,
    /// not_found for get and delete, error codes once seen).
    pub fn stats_into(&self, out: &mut HashMap<String, u64>) {
        for (op, (name, s)) in OPS.iter().zip(&self.op_totals()).enumerate() {
            let mut cumulative = 0;
            for (i, b) in s.buckets.iter().enumerate() {
                cumulative += b.load(Relaxed);
                let key = if i < LATENCY_BUCKETS {
                    format!("latency_us_{name}_le_{}", bound_us(i))
                } else {
                    format!("latency_us_{name}_le_inf")
                };
                out.insert(key, cumulative);
            }
            out.insert(format!("latency_us_{name}_count"), cumulative);
            out.insert(format!("latency_us_{name}_sum"), s.sum_nanos.load(Relaxed) / 1000);
            for (i, r) in s.results.iter().enumerate() {
                let n = r.load(Relaxed);
                if always_shown(op, i) || n > 0 {
                    out.insert(format!("requests_{name}_{}", result_name(i)), n);
                }
            }
        }
        // What crossed the verbs RPC, so a client can tell it was used.
        out.insert("verbs_rpc_bytes_received".into(), self.verbs.received.load(Relaxed));
        out.insert("verbs_rpc_connections_accepted".into(), self.verbs.accepted.load(Relaxed));
    }

    /// Every op's counters, summed over the shards.
    pub(crate) fn op_totals(&self) -> [OpStats; OPS.len()] {
        let totals: [OpStats; OPS.len()] = Default::default();
        for shard in self.ops.iter() {
            for (t, s) in totals.iter().zip(&shard.0) {
                t.add(s);
            }
        }
        totals
    }

    pub(crate) fn listeners(&self) -> [&ListenerStats; 7] {
        [&self.rpc, &self.engine, &self.shm, &self.peer, &self.metrics, &self.memcached, &self.verbs]
    }
}

/// The raft log's fsyncs (process-wide: the log is one per process).
pub static FSYNC: FsyncHistogram = FsyncHistogram::new();

/// A latency histogram with the request buckets, for the raft log's syncs.
pub struct FsyncHistogram {
    pub(crate) buckets: [AtomicU64; LATENCY_BUCKETS + 1],
    pub(crate) sum_nanos: AtomicU64,
}

impl FsyncHistogram {
    const fn new() -> Self {
        FsyncHistogram { buckets: [const { AtomicU64::new(0) }; LATENCY_BUCKETS + 1], sum_nanos: AtomicU64::new(0) }
    }

    /// Counts one sync that took `took`.
    pub fn observe(&self, took: Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[bucket_of(nanos)].fetch_add(1, Relaxed);
        self.sum_nanos.fetch_add(nanos, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_inclusive_upper_bounds_doubling_from_10us() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(10_000), 0);
        assert_eq!(bucket_of(10_001), 1);
        assert_eq!(bucket_of(20_000), 1);
        assert_eq!(bucket_of(20_001), 2);
        assert_eq!(bucket_of(40_000), 2);
        let last = bound_us(LATENCY_BUCKETS - 1) * 1000;
        assert_eq!(bucket_of(last), LATENCY_BUCKETS - 1);
        assert_eq!(bucket_of(last + 1), LATENCY_BUCKETS);
        assert_eq!(bucket_of(u64::MAX), LATENCY_BUCKETS);
    }

    #[test]
    fn stats_keys_are_cumulative_with_count_and_sum() {
        let m = Metrics::default();
        let ok = Response { id: 1, result: Some(R::Put(Default::default())) };
        m.record(1, &ok, Duration::from_micros(15));
        m.record(1, &ok, Duration::from_micros(5));
        m.record_error(0, ErrorCode::NotLeader, Duration::from_micros(1));
        let mut out = HashMap::new();
        m.stats_into(&mut out);
        assert_eq!(out["latency_us_put_le_10"], 1);
        assert_eq!(out["latency_us_put_le_20"], 2);
        assert_eq!(out["latency_us_put_le_inf"], 2);
        assert_eq!(out["latency_us_put_count"], 2);
        assert_eq!(out["latency_us_put_sum"], 20);
        assert_eq!(out["requests_put_ok"], 2);
        assert_eq!(out["requests_get_not_leader"], 1);
        assert_eq!(out["requests_get_not_found"], 0);
        assert!(!out.contains_key("requests_put_not_found"));
        assert!(!out.contains_key("requests_get_busy"));
    }

    #[test]
    fn a_batch_counts_as_its_requests_one_by_one() {
        let (one, batch) = (Metrics::default(), Metrics::default());
        let took = Duration::from_micros(30);
        // Runs of one kind, a lone other kind, and a refusal.
        let done = [(0, 0), (0, 0), (0, 1), (1, 0), (0, 0), (0, 2 + ErrorCode::Busy as u8)];
        for &(op, result) in &done {
            one.record_result(usize::from(op), usize::from(result), took);
        }
        batch.record_batch(&done, took);
        let (mut a, mut b) = (HashMap::new(), HashMap::new());
        one.stats_into(&mut a);
        batch.stats_into(&mut b);
        assert_eq!(a, b);
        assert_eq!(b["latency_us_get_count"], 5);
        assert_eq!(b["latency_us_get_sum"], 150);
        assert_eq!(b["requests_get_ok"], 3);
    }
}

//! What dmkvd counts about itself, and how it is read: Prometheus text at
//! `/metrics` (with `/healthz` and `/readyz`) on `--metrics-listen`, and
//! the request counts and latency histograms in STATS too. The metric
//! names are a contract (docs/operations.md lists them): dashboards and
//! `dmkv top` read them.
//!
//! The hot path only adds to fixed arrays of relaxed atomics, which live
//! at the bottom (`crate::counters`) so that what bumps them does not
//! depend on this module; everything else (region space, shard state,
//! engine counters) is read at scrape time from where the server keeps it
//! already, so there is no second bookkeeping to drift from STATS.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpStream;

use crate::counters::{FSYNC, LATENCY_BUCKETS, ListenerStats, OPS, RESULTS, always_shown, bound_us, result_name};
use crate::service::Shared;

/// Connections the metrics listener serves at once; scrapers are few.
pub const MAX_METRICS_CONNECTIONS: usize = 16;
/// Largest request head the metrics listener reads (hyper's minimum
/// buffer is 8 KiB); anything larger is refused by hyper.
pub const MAX_METRICS_REQUEST_BYTES: usize = 16 * 1024;
/// How long a metrics client may take to send its request head.
pub const METRICS_HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one metrics connection may last in all (one request each:
/// keep-alive is off, so a scraper cannot hold a connection open).
pub const METRICS_CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// A cluster node is ready while each local replica has applied to
/// within this many entries of the commit index it knows.
pub const READY_MAX_APPLY_LAG: u64 = 64;

/// Whether the server serves, or why not (one line, for `/readyz`).
pub fn readiness(shared: &Shared) -> Result<(), String> {
    if !shared.metrics.serving.load(Relaxed) {
        return Err("starting: listeners not up yet".into());
    }
    if let Some(why) = shared.metrics.failed.get() {
        return Err(why.clone());
    }
    if let Some(node) = shared.node.cluster() {
        for (shard, st) in node.statuses() {
            if st.role() == "stopped" {
                return Err(format!("shard {shard}: replica stopped (see the log)"));
            }
            if st.leader.load(Relaxed) == 0 {
                return Err(format!("shard {shard}: no leader known"));
            }
            let (commit, applied) = (st.commit.load(Relaxed), st.applied.load(Relaxed));
            if commit.saturating_sub(applied) > READY_MAX_APPLY_LAG {
                return Err(format!("shard {shard}: applied {applied} of {commit} committed entries"));
            }
        }
    }
    Ok(())
}

/// Everything `/metrics` shows, in the Prometheus text format.
pub fn render(shared: &Arc<Shared>) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape(Arc::clone(shared))));
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)?;
    Ok(out)
}

/// Reads the server's state at scrape time.
struct Scrape(Arc<Shared>);

impl std::fmt::Debug for Scrape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scrape")
    }
}

type Labels<'a> = Vec<(&'static str, &'a str)>;

/// One metric family of constant values.
fn family<'a, M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    series: impl IntoIterator<Item = (Labels<'a>, M)>,
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in series {
        v.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

fn counter<'a>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (Labels<'a>, u64)>,
) -> std::fmt::Result {
    family(enc, name, help, MetricType::Counter, series.into_iter().map(|(l, v)| (l, ConstCounter::new(v))))
}

fn gauge<'a>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (Labels<'a>, u64)>,
) -> std::fmt::Result {
    let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    family(enc, name, help, MetricType::Gauge, series.into_iter().map(|(l, v)| (l, ConstGauge::new(to_i64(v)))))
}

/// A histogram's series from per-bucket counts and a sum in nanoseconds.
fn histogram(
    m: &mut prometheus_client::encoding::MetricEncoder,
    labels: &Labels,
    buckets: &[AtomicU64; LATENCY_BUCKETS + 1],
    sum_nanos: &AtomicU64,
) -> std::fmt::Result {
    let counts: Vec<(f64, u64)> = buckets
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let bound = if i < LATENCY_BUCKETS { bound_us(i) as f64 / 1e6 } else { f64::INFINITY };
            (bound, b.load(Relaxed))
        })
        .collect();
    let count = counts.iter().map(|c| c.1).sum();
    let sum = sum_nanos.load(Relaxed) as f64 / 1e9;
    m.encode_family(labels)?.encode_histogram::<NoLabelSet>(sum, count, &counts, None)
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let shared = &self.0;
        let m = &shared.metrics;
        gauge(
            &mut enc,
            "dmkv_build_info",
            "Always 1; the version label says which dmkvd this is.",
            [(vec![("version", env!("CARGO_PKG_VERSION"))], 1)],
        )?;
        let names: Vec<String> = (0..RESULTS).map(result_name).collect();
        let mut series = Vec::new();
        let totals = m.op_totals();
        for (o, (op, s)) in OPS.iter().zip(&totals).enumerate() {
            for (i, r) in s.results.iter().enumerate() {
                let n = r.load(Relaxed);
                if always_shown(o, i) || n > 0 {
                    series.push((vec![("op", *op), ("result", names[i].as_str())], n));
                }
            }
        }
        counter(&mut enc, "dmkv_requests", "RPC requests answered, by operation and result.", series)?;
        let mut h = enc.encode_descriptor(
            "dmkv_request_duration_seconds",
            "Time from reading an RPC request to its reply being ready.",
            None,
            MetricType::Histogram,
        )?;
        for (op, s) in OPS.iter().zip(&totals) {
            histogram(&mut h, &vec![("op", *op)], &s.buckets, &s.sum_nanos)?;
        }
        let per_listener = |f: fn(&ListenerStats) -> &AtomicU64| {
            m.listeners().map(|l| (vec![("listener", l.name)], f(l).load(Relaxed)))
        };
        counter(&mut enc, "dmkv_received_bytes", "Bytes read from connections.", per_listener(|l| &l.received))?;
        counter(&mut enc, "dmkv_sent_bytes", "Bytes written to connections.", per_listener(|l| &l.sent))?;
        gauge(&mut enc, "dmkv_connections", "Connections open now.", per_listener(|l| &l.open))?;
        counter(&mut enc, "dmkv_connections_accepted", "Connections accepted.", per_listener(|l| &l.accepted))?;
        let e = &shared.engine_counters;
        let one = |v: &AtomicU64| [(Labels::new(), v.load(Relaxed))];
        counter(&mut enc, "dmkv_engine_reads", "One-sided reads served by the software engine.", one(&e.reads))?;
        counter(&mut enc, "dmkv_engine_read_bytes", "Bytes of one-sided reads served by the engine.", one(&e.bytes))?;
        counter(
            &mut enc,
            "dmkv_engine_rejected_reads",
            "One-sided reads the engine refused (unknown rkey, out of bounds).",
            one(&e.rejected),
        )?;
        // Read from the registrations themselves: a cluster leader's fence
        // re-registers its shard's region without going through the service.
        let registrations = shared.node.registrations();
        counter(
            &mut enc,
            "dmkv_region_registrations",
            "Region registrations: one per region at start, and one per re-registration (REREGISTER, rkey \
             rotation, a leader's fence).",
            [(Labels::new(), registrations)],
        )?;
        counter(
            &mut enc,
            "dmkv_rkey_rotations",
            "Scheduled re-registrations (--rkey-rotate-secs).",
            one(&m.rkey_rotations),
        )?;
        let space = space(shared);
        let g = |v: u64| [(Labels::new(), v)];
        gauge(&mut enc, "dmkv_region_size_bytes", "Bytes of the data regions.", g(space.size))?;
        gauge(&mut enc, "dmkv_region_used_bytes", "Bytes of the data areas allocated to items.", g(space.used))?;
        gauge(
            &mut enc,
            "dmkv_region_free_bytes",
            "Bytes of the data areas free or in their grace period.",
            g(space.free),
        )?;
        gauge(
            &mut enc,
            "dmkv_region_largest_free_bytes",
            "The largest free extent of any region (the largest item that fits without compaction).",
            g(space.largest_free),
        )?;
        gauge(&mut enc, "dmkv_index_bytes", "Bytes of the hash indexes.", g(space.index))?;
        gauge(&mut enc, "dmkv_items", "Items stored (in a cluster: in this node's replicas).", g(space.items))?;
        counter(
            &mut enc,
            "dmkv_compactor_moved_bytes",
            "Bytes the compactor moved to defragment free space.",
            g(space.moved),
        )?;
        if let Some(node) = shared.node.cluster() {
            shard_families(&mut enc, node)?;
        }
        Ok(())
    }
}

/// The regions' space, summed over a cluster node's replicas (largest
/// free: the largest of any).
#[derive(Default)]
struct Space {
    size: u64,
    used: u64,
    free: u64,
    largest_free: u64,
    index: u64,
    items: u64,
    moved: u64,
}

fn space(shared: &Shared) -> Space {
    let stores = shared.node.stores();
    let unit = dmkv_common::limits::UNIT as u64;
    let mut s = Space::default();
    for st in stores {
        let sp = st.space();
        s.size += st.header().region_len;
        s.used += sp.used * unit;
        s.free += (sp.free + sp.parked) * unit;
        s.largest_free = s.largest_free.max(sp.largest_free * unit);
        s.index += st.counters.index_bytes.load(Relaxed);
        s.items += st.counters.items.load(Relaxed);
        s.moved += st.counters.compactor_moved_bytes.load(Relaxed);
    }
    s
}

fn shard_families(enc: &mut DescriptorEncoder, node: &crate::cluster::node::ClusterNode) -> std::fmt::Result {
    let statuses = node.statuses();
    let shards: Vec<String> = statuses.iter().map(|(s, _)| s.to_string()).collect();
    let per = |f: &dyn Fn(&crate::cluster::driver::ReplicaStatus) -> u64| -> Vec<(Labels, u64)> {
        statuses.iter().zip(&shards).map(|((_, st), name)| (vec![("shard", name.as_str())], f(st))).collect()
    };
    gauge(enc, "dmkv_shard_raft_term", "The raft term this node's replica is in.", per(&|s| s.term.load(Relaxed)))?;
    gauge(enc, "dmkv_shard_leader", "1 if this node's replica leads the shard.", per(&|s| u64::from(s.is_leader())))?;
    gauge(
        enc,
        "dmkv_shard_commit_index",
        "The commit index this node's replica knows.",
        per(&|s| s.commit.load(Relaxed)),
    )?;
    gauge(
        enc,
        "dmkv_shard_applied_index",
        "The last entry this node's replica applied.",
        per(&|s| s.applied.load(Relaxed)),
    )?;
    let lags: Vec<(String, Vec<(String, u64)>)> = statuses
        .iter()
        .zip(&shards)
        .map(|((_, st), name)| (name.clone(), st.lag().into_iter().map(|(f, n)| (f.to_string(), n)).collect()))
        .collect();
    let series = lags.iter().flat_map(|(shard, followers)| {
        followers.iter().map(move |(f, n)| (vec![("shard", shard.as_str()), ("follower", f.as_str())], *n))
    });
    gauge(
        enc,
        "dmkv_shard_follower_lag_entries",
        "On the leader: entries each follower (raft id) is behind the leader's log.",
        series,
    )?;
    counter(
        enc,
        "dmkv_shard_leader_changes",
        "Times this node's replica saw the shard's leader change.",
        per(&|s| s.leader_changes.load(Relaxed)),
    )?;
    gauge(
        enc,
        "dmkv_shard_snapshot_bytes",
        "Size of the last snapshot this node's replica built for a follower.",
        per(&|s| s.snapshot_bytes.load(Relaxed)),
    )?;
    let remembered = node.remembered();
    let names: Vec<String> = remembered.iter().map(|(s, _)| s.to_string()).collect();
    let per_remembered = |f: &dyn Fn(&crate::cluster::apply::RememberedStats) -> u64| -> Vec<(Labels, u64)> {
        remembered.iter().zip(&names).map(|((_, st), name)| (vec![("shard", name.as_str())], f(st))).collect()
    };
    gauge(
        enc,
        "dmkv_shard_remembered_writes",
        "Identified writes whose outcome this node's replica remembers, so that one sent again applies once.",
        per_remembered(&|s| s.writes.load(Relaxed)),
    )?;
    counter(
        enc,
        "dmkv_shard_remembered_dropped_early",
        "Identified writes forgotten before their retry window passed twice, to stay within the shard's bound.",
        per_remembered(&|s| s.dropped_early.load(Relaxed)),
    )?;
    gauge(
        enc,
        "dmkv_raft_log_bytes",
        "Bytes of this node's raft log (raft-engine's files; 0 without --data-dir).",
        [(Labels::new(), node.log_bytes())],
    )?;
    let mut h = enc.encode_descriptor(
        "dmkv_raft_fsync_duration_seconds",
        "Time the raft log took to reach disk, per synced write or batch sync.",
        None,
        MetricType::Histogram,
    )?;
    histogram(&mut h, &Labels::new(), &FSYNC.buckets, &FSYNC.sum_nanos)
}

/// Serves one metrics connection: one request, bounded in size and time.
pub async fn serve_connection(stream: TcpStream, shared: Arc<Shared>) {
    use hyper::server::conn::http1;
    let stats = Arc::clone(&shared.metrics.metrics);
    let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let shared = Arc::clone(&shared);
        async move { Ok::<_, Infallible>(respond(&shared, req.method(), req.uri().path())) }
    });
    let io = hyper_util::rt::TokioIo::new(Counted { inner: stream, stats });
    let conn = http1::Builder::new()
        .keep_alive(false)
        .max_buf_size(MAX_METRICS_REQUEST_BYTES)
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(METRICS_HEADER_TIMEOUT)
        .serve_connection(io, svc);
    match tokio::time::timeout(METRICS_CONNECTION_TIMEOUT, conn).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(listener = "metrics", "metrics connection: {e}"),
        Err(_) => tracing::debug!(listener = "metrics", "metrics connection timed out"),
    }
}

/// The reply to `method path`.
fn respond(shared: &Arc<Shared>, method: &hyper::Method, path: &str) -> hyper::Response<Full<Bytes>> {
    let reply = |status: u16, ctype: &'static str, body: String| {
        let mut r = hyper::Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
        if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    };
    const PLAIN: &str = "text/plain; charset=utf-8";
    if method != hyper::Method::GET && method != hyper::Method::HEAD {
        return reply(405, PLAIN, "only GET\n".into());
    }
    match path {
        "/metrics" => match render(shared) {
            Ok(text) => reply(200, prometheus_client::encoding::prometheus_text::CONTENT_TYPE, text),
            Err(_) => reply(500, PLAIN, "cannot encode the metrics\n".into()),
        },
        "/healthz" => reply(200, PLAIN, "ok\n".into()),
        "/readyz" => match readiness(shared) {
            Ok(()) => reply(200, PLAIN, "ready\n".into()),
            Err(why) => {
                let mut body = why;
                let _ = writeln!(body);
                reply(503, PLAIN, body)
            }
        },
        _ => reply(404, PLAIN, "not found: try /metrics, /healthz or /readyz\n".into()),
    }
}

/// A stream that counts its bytes into a listener's counters.
pub struct Counted<S> {
    pub inner: S,
    pub stats: Arc<ListenerStats>,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Counted<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        self.stats.received.fetch_add((buf.filled().len() - before) as u64, Relaxed);
        r
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = &r {
            self.stats.sent.fetch_add(*n as u64, Relaxed);
        }
        r
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

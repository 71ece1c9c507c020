//! The client's own Prometheus metrics.
//!
//! One-sided GETs never reach the server, so its counters see only the
//! reads that went over RPC: an application that wants to know how its
//! reads went registers its client here, in its own registry, and scrapes
//! it beside the server's `/metrics`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dmkv_client::ClientError> {
//! use prometheus_client::registry::Registry;
//! let client = dmkv_client::Client::connect("127.0.0.1:7070").await?;
//! let mut registry = Registry::default();
//! client.register_metrics(&mut registry);
//! let mut text = String::new();
//! prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
//! # Ok(()) }
//! ```
//!
//! Nothing is counted twice: a collector reads the client's existing
//! counters ([`Client::read_stats`], [`Client::path_stats`]) at scrape
//! time. It holds the client weakly: once every clone of the client is
//! dropped, its metrics disappear from the registry's output.
//!
//! Several clients in one registry: give each its own label with
//! `registry.sub_registry_with_label(("client".into(), "name".into()))`, or the
//! series of two clients would collide.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use crate::client::{Client, WeakClient};
use dmkv_common::path::{Path, PathSnapshot};

/// The label value of each path (`Path::name` says `one-sided`, which
/// reads poorly as a label value next to metric names with underscores).
fn label(path: Path) -> &'static str {
    match path {
        Path::OneSided => "one_sided",
        Path::Rpc => "rpc",
    }
}

/// Registers `client`'s metrics in `registry` (see the module docs for
/// the names).
pub fn register(client: &Client, registry: &mut Registry) {
    registry.register_collector(Box::new(ClientCollector { client: client.downgrade() }));
}

impl Client {
    /// Registers this client's metrics in `registry`: see [`crate::metrics`].
    pub fn register_metrics(&self, registry: &mut Registry) {
        register(self, registry);
    }
}

/// Reads one client's counters at each scrape.
#[derive(Debug)]
struct ClientCollector {
    client: WeakClient,
}

/// Writes one metric family: `values` are (label set, value) pairs, each
/// an empty label list for a family without labels.
fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    metric_type: MetricType,
    values: &[(&[(&str, &str)], M)],
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, unit, metric_type)?;
    if let [(labels, value)] = values
        && labels.is_empty()
    {
        return value.encode(metric);
    }
    for (labels, value) in values {
        debug_assert!(!labels.is_empty(), "{name}: an unlabelled series among labelled ones");
        value.encode(metric.encode_family(labels)?)?;
    }
    Ok(())
}

impl Collector for ClientCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // The client is gone: it has nothing more to say.
        let Some(client) = self.client.upgrade() else { return Ok(()) };
        let reads = client.read_stats();
        let paths = client.path_stats();
        let counter = |v: u64| ConstCounter::new(v);
        let os = [("path", label(Path::OneSided))];
        let rpc = [("path", label(Path::Rpc))];
        // Counters are named without `_total`: the encoder appends it.
        family(
            &mut enc,
            "dmkv_client_gets",
            "Keys this client read, by the path that answered them (probes included; each key of a multi-get counts)",
            None,
            MetricType::Counter,
            &[(&os, counter(reads.gets)), (&rpc, counter(reads.rpc_gets))],
        )?;
        let causes = [
            [("cause", "torn")],
            [("cause", "other_key")],
            [("cause", "slow")],
            [("cause", "stale_directory")],
            [("cause", "no_clock")],
        ];
        let counts = [reads.torn, reads.other_key, reads.slow, reads.stale_directory, reads.no_clock];
        let retries: Vec<_> = causes.iter().zip(counts).map(|(l, v)| (&l[..], counter(v))).collect();
        family(
            &mut enc,
            "dmkv_client_one_sided_retries",
            "One-sided read attempts abandoned and retried, by cause",
            None,
            MetricType::Counter,
            &retries,
        )?;
        family(
            &mut enc,
            "dmkv_client_rpc_fallbacks",
            "One-sided GETs that used up their attempts and were answered over RPC",
            None,
            MetricType::Counter,
            &[(&[], counter(reads.fallbacks))],
        )?;
        let c = &paths.controller;
        family(
            &mut enc,
            "dmkv_client_path_switches",
            "Changes of the path GETs take by default",
            None,
            MetricType::Counter,
            &[(&[], counter(c.switches))],
        )?;
        let per_path =
            |f: fn(&PathSnapshot) -> u64| [(&os[..], counter(f(&c.one_sided))), (&rpc[..], counter(f(&c.rpc)))];
        family(
            &mut enc,
            "dmkv_client_path_requests",
            "GETs the path controller admitted to each path and saw end (probes excluded)",
            None,
            MetricType::Counter,
            &per_path(|s| s.requests),
        )?;
        family(
            &mut enc,
            "dmkv_client_path_failures",
            "GETs and probes that failed on each path (connection lost, timeout)",
            None,
            MetricType::Counter,
            &per_path(|s| s.failures),
        )?;
        family(
            &mut enc,
            "dmkv_client_path_window",
            "Congestion window of each path, in GETs",
            None,
            MetricType::Gauge,
            &[(&os[..], ConstGauge::new(c.one_sided.window)), (&rpc[..], ConstGauge::new(c.rpc.window))],
        )?;
        let secs = |ns: u64| ConstGauge::new(ns as f64 / 1e9);
        family(
            &mut enc,
            "dmkv_client_path_delay",
            "Smoothed round-trip delay of each path (0 before a sample)",
            Some(&Unit::Seconds),
            MetricType::Gauge,
            &[(&os[..], secs(c.one_sided.delay_ns)), (&rpc[..], secs(c.rpc.delay_ns))],
        )?;
        Ok(())
    }
}

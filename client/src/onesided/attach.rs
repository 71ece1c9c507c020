//! Attaching a one-sided path: which backend, its connection, and the
//! clock a cluster shard's leases are judged by.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use dmkv_common::cluster::lease::ClockSample;
use dmkv_common::layout::{LAYOUT_VERSION, RegionHeader};
use dmkv_common::proto::{RegionDescriptor, RegionInfoReply};
use dmkv_common::read::MAX_BATCH_KEYS;

use super::access_log::AccessLog;
use super::attempt_clock::{AttemptClock, mono_ns};
use super::directory::DirCache;
use super::hints::HintCache;
use crate::pool::RpcPool;
use crate::read_path::Transport;
use dmkv_common::cluster::lease_check::{self as lease, LeaseClock};

use super::backend::BackendError;
use super::counters::ReadCounters;
#[cfg(feature = "rdma")]
use super::rdma;
use super::region::{Backend, OneSided};
use super::{engine, shm};

/// How to attach a one-sided path.
pub struct AttachOptions {
    /// Only this transport (default: the best one available).
    pub forced: Option<Transport>,
    /// Longest wait for connections and reads.
    pub timeout: Duration,
    /// Keys whose item address is cached.
    pub hint_entries: usize,
    /// Where reads are counted.
    pub counters: std::sync::Arc<ReadCounters>,
    /// Abandon attempts that outlast the grace period.
    pub enforce_grace: bool,
    /// Connections to the engine (TCP transport).
    pub engine_connections: usize,
    /// Settings of congestion detection for engine connections.
    pub path_config: dmkv_common::path::PathConfig,
    /// Where replacements of congested engine connections are counted.
    pub repaths: std::sync::Arc<AtomicU64>,
    /// The secret to prove to servers that require authentication.
    pub token: Option<std::sync::Arc<dmkv_common::auth::Token>>,
    /// Which region: `None`, a single node's (the first); `Some(s)`, the
    /// region of cluster shard `s`'s replica on this node.
    pub shard: Option<u32>,
    /// The server's clock as sampled just before attaching (the region
    /// info's `monotonic_ns`, between this client's clock before and after
    /// the call): how a cluster region's lease is judged. Needed for
    /// cluster regions only.
    pub clock: Option<ClockSample>,
    /// Check leases of cluster regions. Only tests that show the check
    /// matters turn it off.
    pub check_leases: bool,
    /// The router's map, which a shard region's batches are checked
    /// against (docs/elasticity.md).
    pub routes: Option<std::sync::Arc<crate::route_view::RouteView>>,
    /// The session's RDMA lanes to the node, which its shard regions
    /// share (a single node's path has lanes of its own).
    pub node_rdma: std::sync::Arc<NodeRdma>,
}

/// A session's RDMA queue pairs to its node, for all the shard regions it
/// reads there; empty until the first RDMA attach (and in builds without
/// the `rdma` feature).
#[derive(Default)]
pub struct NodeRdma {
    #[cfg(feature = "rdma")]
    lanes: rdma::NodeLanes,
}

/// Picks and attaches a backend for the server described by `info`.
///
/// `opts.forced` limits the choice to one transport; otherwise RDMA is
/// tried first (when the server offers it and this host has a device), then
/// shared memory (only when the server runs on this host), then the engine.
pub async fn attach(
    pool: &std::sync::Arc<RpcPool>,
    info: &RegionInfoReply,
    opts: AttachOptions,
) -> Result<OneSided, BackendError> {
    let AttachOptions {
        forced,
        timeout,
        hint_entries,
        counters,
        enforce_grace,
        engine_connections,
        path_config,
        repaths,
        token,
        shard,
        clock,
        check_leases,
        node_rdma,
        routes,
    } = opts;
    let desc = match shard {
        None => info.regions.first().ok_or_else(|| BackendError::Attach("server has no region".into()))?,
        Some(s) => info
            .regions
            .iter()
            .find(|d| d.leased && d.shard == s)
            .ok_or_else(|| BackendError::Attach(format!("node holds no replica of shard {s}")))?,
    };
    // A shard replica's region is read only under its lease: never as a
    // single node's.
    if desc.leased != shard.is_some() {
        return Err(BackendError::Attach("a cluster shard's region is read through the cluster router".into()));
    }
    let header = header_of(desc)?;
    let candidates: &[Transport] = match forced {
        Some(t) => &[t][..],
        None => &[Transport::Rdma, Transport::Shm, Transport::Engine],
    };
    let mut errors = Vec::new();
    for &t in candidates {
        let attempt = match offered(info, t) {
            Err(why) => Err(BackendError::Attach(why)),
            Ok(()) => match t {
                Transport::Shm => {
                    shm::ShmRegion::attach(&info.shm_socket, desc.rkey, desc.epoch, token.as_deref(), timeout)
                        .await
                        .map(Backend::Shm)
                }
                Transport::Engine => {
                    let health =
                        crate::path::ConnHealth::new(engine_connections, path_config, std::sync::Arc::clone(&repaths));
                    match engine_dialer(pool, info) {
                        Ok(dialer) => engine::EnginePool::connect(
                            &info.engine_addr,
                            desc.rkey,
                            timeout,
                            engine_connections,
                            health,
                            dialer,
                        )
                        .await
                        .map(Backend::Engine),
                        Err(e) => Err(e),
                    }
                }
                Transport::Rdma => attach_rdma(pool, desc, shard.is_some(), &node_rdma, timeout).await,
            },
        };
        match attempt {
            Ok(backend) => {
                let lease = match (desc.leased && check_leases, clock) {
                    (false, _) => None,
                    (true, None) => return Err(BackendError::Attach("no clock sample to judge leases by".into())),
                    (true, Some(sample)) => {
                        let same_clock = !info.host_id.is_empty()
                            && info.host_id == local_host_id()
                            && info.time_namespace != 0
                            && info.time_namespace == dmkv_common::host::time_namespace();
                        let c = LeaseClock::choose(t == Transport::Engine, same_clock, sample)
                            .map_err(|e| BackendError::Attach(format!("clock sample refused: {e}")))?;
                        if let LeaseClock::Sampled(s) = &c {
                            spawn_resync(
                                std::sync::Arc::clone(pool),
                                std::sync::Arc::downgrade(s),
                                std::sync::Arc::clone(&counters),
                            );
                        }
                        Some(c)
                    }
                };
                let clock = AttemptClock::new(header.grace_nanos);
                return Ok(OneSided {
                    header,
                    dir: DirCache::new(header.dir_depth),
                    backend,
                    transport: t,
                    hints: Mutex::new(HintCache::new(hint_entries)),
                    counters,
                    clock,
                    enforce_grace,
                    batch_keys: AtomicUsize::new(MAX_BATCH_KEYS),
                    route: shard.filter(|_| lease.is_some()).map(|s| (s, routes.clone())),
                    lease,
                    accesses: AccessLog::new(desc.evicts),
                    region_id: desc.region_id,
                });
            }
            // A forced transport's own reason, for `TransportUnavailable`.
            Err(e) if forced.is_some() => return Err(e),
            Err(e) => errors.push(format!("{t}: {e}")),
        }
    }
    debug_assert_eq!(errors.len(), candidates.len(), "every candidate failed once");
    Err(BackendError::Attach(errors.join("; ")))
}

/// Whether the server described by `info` offers transport `t` to this
/// client at all; if not, why, in words for whoever forced `t`. Passing
/// does not promise that attaching works (connections may still fail).
pub fn offered(info: &RegionInfoReply, t: Transport) -> Result<(), String> {
    match t {
        Transport::Shm if info.shm_socket.is_empty() => {
            Err("the server does not offer shared memory (dmkvd --no-shm, or shm = false)".into())
        }
        Transport::Shm if info.host_id.is_empty() || info.host_id != local_host_id() => {
            Err("the server is on another host; shared memory works only on the server's host".into())
        }
        Transport::Engine if info.engine_addr.is_empty() => {
            Err("the server does not offer its one-sided engine (dmkvd --no-engine, or engine = false)".into())
        }
        Transport::Rdma if info.rdma_device.is_empty() => Err(NO_SERVER_RDMA.into()),
        Transport::Rdma if !cfg!(feature = "rdma") => Err(NO_CLIENT_RDMA.into()),
        Transport::Shm | Transport::Engine | Transport::Rdma => Ok(()),
    }
}

const NO_SERVER_RDMA: &str = "the server has no region registered for RDMA (it found no RDMA device, \
                              runs with --no-rdma, or was built without the `rdma` feature)";
const NO_CLIENT_RDMA: &str = "this client was built without RDMA support (cargo feature `rdma`)";

/// How to reach the engine: with TLS when it speaks it (and this client
/// is configured for TLS), proving the client's token.
fn engine_dialer(pool: &RpcPool, info: &RegionInfoReply) -> Result<engine::Dialer, BackendError> {
    let tls = match (info.engine_tls, pool.tls()) {
        (false, _) => None,
        (true, Some(c)) => Some(c.clone()),
        (true, None) => {
            return Err(BackendError::Attach("the engine speaks TLS; configure ClientConfig::tls to use it".into()));
        }
    };
    Ok(engine::Dialer { tls, token: pool.token().cloned() })
}

#[cfg(feature = "rdma")]
async fn attach_rdma(
    pool: &RpcPool,
    desc: &RegionDescriptor,
    shard: bool,
    node: &NodeRdma,
    timeout: Duration,
) -> Result<Backend, BackendError> {
    let path = match shard {
        false => rdma::RdmaPath::attach(pool, desc.epoch, timeout).await?,
        true => rdma::RdmaPath::attach_region(pool, &node.lanes, desc, timeout).await?,
    };
    Ok(Backend::Rdma(Box::new(path)))
}

#[cfg(not(feature = "rdma"))]
async fn attach_rdma(
    _: &RpcPool,
    _: &RegionDescriptor,
    _: bool,
    _: &NodeRdma,
    _: Duration,
) -> Result<Backend, BackendError> {
    // `offered` refuses RDMA in builds without it.
    Err(BackendError::Attach(NO_CLIENT_RDMA.into()))
}

/// Takes a sample of `client`'s server's clock: its region info, and
/// this client's clock before and after asking for it.
pub(crate) async fn clock_sample(pool: &RpcPool) -> Result<(RegionInfoReply, ClockSample), crate::error::ClientError> {
    let sent = mono_ns();
    let info = pool.region_info().await?;
    let sample = ClockSample { sent, server: info.monotonic_ns, received: mono_ns() };
    Ok((info, sample))
}

/// Samples the server's clock every [`lease::CLOCK_RESYNC_INTERVAL`] while
/// the path that needs it lives.
fn spawn_resync(
    pool: std::sync::Arc<RpcPool>,
    clock: std::sync::Weak<lease::SampledClock>,
    counters: std::sync::Arc<ReadCounters>,
) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(lease::CLOCK_RESYNC_INTERVAL).await;
            let Some(c) = clock.upgrade() else { return };
            // A failed call leaves the last sample to age out.
            if let Ok((_, sample)) = clock_sample(&pool).await
                && !c.resample(sample)
            {
                counters.clock_disagreements.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "the server's clock and this client's disagree beyond the drift bound; one-sided reads of its shards are refused until they agree again"
                );
            }
        }
    });
}

fn header_of(d: &RegionDescriptor) -> Result<RegionHeader, BackendError> {
    if d.layout_version != LAYOUT_VERSION {
        return Err(BackendError::Attach(format!(
            "server's layout version {} is not {LAYOUT_VERSION}",
            d.layout_version
        )));
    }
    let h = RegionHeader {
        epoch: d.epoch,
        dir_depth: d.directory_depth,
        hash_seed: d.hash_seed,
        index_offset: d.index_offset,
        data_offset: d.data_offset,
        data_len: d.data_length,
        region_len: d.length,
        grace_nanos: d.grace_nanos,
    };
    h.validate().map_err(|e| BackendError::Attach(format!("bad region descriptor: {e}")))?;
    Ok(h)
}

fn local_host_id() -> String {
    dmkv_common::host::host_id()
}

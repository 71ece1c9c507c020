//! dmkvd, the dmkv server: a memfd-backed region laid out per
//! `dmkv_common::layout`, the store that writes it, and the RPC service.
//!
//! Where a request goes: [`framed`] reads it off its connection, [`service`]
//! decodes it, the [`node`] runs it (a single node's [`store`], or a
//! cluster node's shard replicas), and the store runs it against the
//! [`region`], whose space [`alloc`] hands out. One-sided GETs never reach
//! the service or the store: same-host clients map the region after a
//! [`shm`] handoff, others read it through the [`engine`] (served by the
//! same [`framed`] loop); both check the [`registration`]. All three
//! listeners accept through [`listen`], which bounds how many connections
//! each serves.

pub mod access;
pub mod alloc;
pub mod clock;
pub mod cluster;
pub mod compact;
pub mod config;
pub mod counters;
pub mod engine;
pub mod framed;
pub mod kv;
pub mod listen;
pub mod lock;
pub mod memcache;
pub mod metrics;
pub mod node;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod region;
pub mod registration;
pub mod service;
pub mod shm;
pub mod store;
pub mod tls;
#[cfg(feature = "rdma")]
pub mod verbs_rpc;
pub mod workers;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{info, warn};

pub use config::Config;
use config::validate::plain;
use node::Node;
use service::Shared;

/// A bound, formatted server, ready to serve.
pub struct Server {
    listener: TcpListener,
    engine: Option<TcpListener>,
    shm: Option<shm::ShmListener>,
    shared: Arc<Shared>,
    max_connections: usize,
    rkey_rotate: Option<std::time::Duration>,
    max_engine_connections: usize,
    max_shm_connections: usize,
    max_memcached_connections: usize,
    /// The peer port of a cluster node.
    peer: Option<TcpListener>,
    /// `/metrics`, `/healthz`, `/readyz`, with `--metrics-listen`.
    metrics: Option<TcpListener>,
    /// memcached's protocols, with `--memcached-listen`.
    memcached: Option<TcpListener>,
    /// Worker threads (memcached's `stats` shows them).
    threads: usize,
    /// The threads client connections (RPC, memcached) are served on.
    workers: Arc<workers::Workers>,
    stop: (watch::Sender<bool>, watch::Receiver<bool>),
}

impl Server {
    /// Creates the region, formats it, and binds the RPC listener (a
    /// cluster node: starts its shard replicas, whose regions hold the
    /// data, and binds the peer listener too).
    pub async fn bind(cfg: &Config) -> std::io::Result<Server> {
        let stop = watch::channel(false);
        let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
        let (node, peer) = match &cfg.cluster {
            Some(setup) => {
                let me = setup.config.node(setup.node_id).map_err(invalid)?;
                let peer = TcpListener::bind(me.peer).await.map_err(|e| bind_error("peer", me.peer, e))?;
                if setup.data_dir.is_none() {
                    warn!(
                        "cluster node in memory only (no --data-dir): after a restart its replicas rejoin as new \
                         members and copy their shards from the leaders (docs/replication.md)"
                    );
                }
                // Config refuses these on a cluster node; a Config built
                // in code is held to the same.
                if cfg.rkey_rotate.is_some() {
                    warn!(
                        "--rkey-rotate-secs: not served in cluster mode (each shard's leader gives its region \
                         a new engine rkey and epoch when it fences; RDMA registrations last the node's life)"
                    );
                }
                if cfg.tls.is_some() && setup.peer_tls.is_none() {
                    warn!(
                        "TLS covers clients only: raft traffic between nodes is not encrypted \
                         (--peer-tls-cert, --peer-tls-key and --peer-tls-ca encrypt it)"
                    );
                }
                let params = cluster::node::NodeParams {
                    memory: cfg.memory,
                    compactor: cfg.compactor,
                    grace: cfg.grace,
                    max_frame: cfg.max_frame,
                    token: cfg.auth.node_token(setup.node_id).cloned(),
                    #[cfg(feature = "rdma")]
                    rdma: open_rdma(cfg)?,
                };
                let node = cluster::node::ClusterNode::start(setup, params, stop.1.clone())
                    .map_err(|e| invalid(format!("cluster node {}: {e}", setup.node_id)))?;
                let node = Arc::new(node);
                // The placement as the metadata group has it.
                cluster::meta::spawn_map_refresh(&node, stop.1.clone());
                // Stopped moves carried on by the group's leader.
                cluster::move_resume::spawn_move_resumer(&node, stop.1.clone());
                // Replicas opened and closed as the map places shards.
                cluster::reconcile::spawn_reconciler(&node, stop.1.clone());
                if cfg.evict == config::Evict::Lru {
                    // Leaders choose, the log removes (docs/eviction.md).
                    cluster::node::start_eviction(&node, stop.1.clone());
                }
                (Node::Cluster(node), Some(peer))
            }
            None => {
                let single = node::SingleNode::format(&node::SingleParams {
                    memory: cfg.memory,
                    buckets: cfg.buckets,
                    grace: cfg.grace,
                    evict: cfg.evict == config::Evict::Lru,
                    compactor: cfg.compactor,
                })?;
                #[cfg(feature = "rdma")]
                let single = {
                    let mut single = single;
                    if let Some(rdma) = open_rdma(cfg)? {
                        single.register_rdma(&rdma).map_err(std::io::Error::other)?;
                    }
                    single
                };
                (Node::Single(Arc::new(single)), None)
            }
        };
        let listener = TcpListener::bind(cfg.listen).await.map_err(|e| bind_error("rpc", cfg.listen, e))?;
        let engine = match cfg.engine_listen {
            Some(addr) => Some(TcpListener::bind(addr).await.map_err(|e| bind_error("engine", addr, e))?),
            None => None,
        };
        let metrics = match cfg.metrics_listen {
            Some(addr) => Some(TcpListener::bind(addr).await.map_err(|e| bind_error("metrics", addr, e))?),
            None => None,
        };
        let memcached = match cfg.memcached_listen {
            Some(addr) => Some(TcpListener::bind(addr).await.map_err(|e| bind_error("memcached", addr, e))?),
            None => None,
        };
        let shm = match &cfg.shm_socket {
            Some(path) => Some(shm::ShmListener::bind(path).map_err(|e| bind_error("shm", path.display(), e))?),
            None => None,
        };
        let tls = match &cfg.tls {
            Some(files) => Some(tls::acceptor(files).map_err(invalid)?),
            None => None,
        };
        let shared = Arc::new(Shared {
            max_frame: cfg.max_frame,
            engine_addr: engine.as_ref().map(|l| l.local_addr()).transpose()?,
            shm_socket: shm.as_ref().map(|s| s.path().to_path_buf()),
            host_id: dmkv_common::host::host_id(),
            engine_counters: Arc::default(),
            gate: Arc::new(access::Gate::new(Arc::clone(&cfg.auth))),
            engine_tls: tls.is_some() && engine.is_some(),
            tls,
            limits: framed::Limits { idle_timeout: cfg.idle_timeout, frame_timeout: cfg.frame_timeout },
            raft: node.cluster().map(|c| c.sink() as Arc<dyn cluster::wire::RaftSink>),
            time_namespace: dmkv_common::host::time_namespace(),
            peer_ips: cfg.cluster.as_ref().map(|c| cluster::identity::PeerIps::of(&c.config)).unwrap_or_default(),
            #[cfg(feature = "rdma")]
            verbs_rpc: node.rdma_device().and_then(|d| match verbs_rpc::VerbsRpc::start(d) {
                Ok(v) => Some(v),
                Err(e) => {
                    tracing::warn!("no verbs RPC on {}: {e}; RPCs take TCP only", d.device_name());
                    None
                }
            }),
            node,
            metrics: Arc::default(),
        });
        Ok(Server {
            listener,
            engine,
            shm,
            shared,
            max_connections: cfg.max_connections,
            max_engine_connections: cfg.max_engine_connections,
            max_shm_connections: cfg.max_shm_connections,
            max_memcached_connections: cfg.max_memcached_connections,
            // Nothing of a cluster node's is the service's to rotate.
            rkey_rotate: cfg.rkey_rotate.filter(|_| cfg.cluster.is_none()),
            peer,
            metrics,
            memcached,
            threads: cfg.threads,
            workers: Arc::new(workers::Workers::start(cfg.threads, "dmkvd-conn")?),
            stop,
        })
    }

    /// The one-sided engine's address, if it is on.
    pub fn engine_addr(&self) -> Option<SocketAddr> {
        self.shared.engine_addr
    }

    /// The shared-memory handoff socket, if it is on.
    pub fn shm_socket(&self) -> Option<&std::path::Path> {
        self.shared.shm_socket.as_deref()
    }

    /// Test hook: the state the service shares, to reach the store while
    /// the server runs (e.g. [`store::Store::scribble_for_tests`]).
    #[doc(hidden)]
    pub fn shared_for_tests(&self) -> Arc<Shared> {
        Arc::clone(&self.shared)
    }

    /// The line `dmkvd` prints once it serves: every endpoint as key=value.
    pub fn endpoints_line(&self) -> String {
        let mut line = format!("dmkvd listening rpc={}", self.local_addr());
        if let Some(p) = &self.peer {
            line += &format!(" peer={}", p.local_addr().expect("bound listener has an address"));
        }
        if let Some(a) = self.engine_addr() {
            line += &format!(" engine={a}");
        }
        if let Some(p) = self.shm_socket() {
            line += &format!(" shm={}", p.display());
        }
        if let Some(a) = self.metrics_addr() {
            line += &format!(" metrics={a}");
        }
        if let Some(a) = self.memcached_addr() {
            line += &format!(" memcached={a}");
        }
        #[cfg(feature = "rdma")]
        if let Some(d) = self.shared.node.rdma_device() {
            line += &format!(" rdma={}", d.device_name());
        }
        line
    }

    /// The metrics address actually bound, if `--metrics-listen` is on.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The memcached address actually bound, if `--memcached-listen` is on.
    pub fn memcached_addr(&self) -> Option<SocketAddr> {
        self.memcached.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The RPC address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
    }

    /// Serves until `shutdown` resolves, then stops accepting and lets every
    /// connection answer the requests it has read (bounded by a deadline).
    pub async fn serve(self, shutdown: impl std::future::Future<Output = ()>) {
        let (stop_tx, stop_rx) = self.stop;
        let mut side = JoinSet::new();
        if let Some(l) = self.peer {
            let (shared, rx) = (Arc::clone(&self.shared), stop_rx.clone());
            let cap = self.max_connections;
            side.spawn(async move {
                let srx = rx.clone();
                let stats = Arc::clone(&shared.metrics.peer);
                let mut conns = listen::serve(l, stats, cap, rx, move |(stream, _)| {
                    service::serve_peer_connection(stream, Arc::clone(&shared), srx.clone())
                })
                .await;
                while conns.join_next().await.is_some() {}
            });
        }
        // What one-sided readers may read: the node's region, or in a
        // cluster each of its shard replicas' (read only under a lease).
        let served = self.shared.node.served();
        if let Some(l) = self.engine {
            let engine = engine::Engine {
                regions: served.clone(),
                counters: Arc::clone(&self.shared.engine_counters),
                bounds: engine::Bounds { max_connections: self.max_engine_connections, limits: self.shared.limits },
                gate: Arc::clone(&self.shared.gate),
                tls: self.shared.tls.clone(),
                stats: Arc::clone(&self.shared.metrics.engine),
            };
            match engine::spawn_thread(l, engine, stop_rx.clone()) {
                Ok(done) => {
                    side.spawn(async move {
                        let _ = done.await;
                    });
                }
                Err(e) => {
                    warn!("one-sided engine not started: {e}");
                    let _ = self.shared.metrics.failed.set(format!("engine not started: {e}"));
                }
            }
        }
        if let Some(l) = self.shm {
            let (served, rx) = (served.clone(), stop_rx.clone());
            let cap = self.max_shm_connections;
            let gate = Arc::clone(&self.shared.gate);
            let stats = Arc::clone(&self.shared.metrics.shm);
            let shared = Arc::clone(&self.shared);
            side.spawn(async move {
                if let Err(e) = shm::serve(l, served, gate, cap, stats, rx).await {
                    warn!("shared-memory handoff stopped: {e}");
                    let _ = shared.metrics.failed.set(format!("shared-memory handoff stopped: {e}"));
                }
            });
        }
        if let Some(every) = self.rkey_rotate {
            let (shared, mut rx) = (Arc::clone(&self.shared), stop_rx.clone());
            side.spawn(async move {
                let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {
                            match shared.node.reregister() {
                                Ok(_) => {
                                    shared.metrics.rkey_rotations.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                }
                                Err(e) => warn!("scheduled rkey rotation failed: {e}"),
                            }
                        }
                        _ = rx.changed() => break,
                    }
                }
            });
        }
        if let Some(l) = self.memcached {
            let (rx, srx) = (stop_rx.clone(), stop_rx.clone());
            let backend = match &self.shared.node {
                crate::node::Node::Single(n) => memcache::backend::Backend::Single(Arc::clone(n)),
                crate::node::Node::Cluster(c) => memcache::backend::Backend::Cluster(Arc::clone(c)),
            };
            let svc = Arc::new(memcache::Service::new(
                Arc::clone(&self.shared),
                backend,
                self.threads,
                self.max_memcached_connections,
            ));
            let stats = Arc::clone(&self.shared.metrics.memcached);
            let cap = self.max_memcached_connections;
            let workers = Arc::clone(&self.workers);
            side.spawn(async move {
                let l = listen::Rehomed(l);
                let mut conns = listen::serve_on(l, stats, cap, rx, &workers, move |(stream, _)| {
                    let (svc, srx) = (Arc::clone(&svc), srx.clone());
                    listen::serve_rehomed("memcached", stream, |s| memcache::serve_connection(s, svc, srx))
                })
                .await;
                // Connections answer what they have read, as RPC ones do.
                let drain = async { while conns.join_next().await.is_some() {} };
                if tokio::time::timeout(config::SHUTDOWN_DRAIN, drain).await.is_err() {
                    conns.shutdown().await;
                }
            });
        }
        // Every listener is bound (the kernel queues connections from
        // then on) and the others' loops are started; the RPC loop starts
        // below without yielding. Set before the metrics loop can answer,
        // so /readyz never says 503 to a server that printed its line.
        self.shared.metrics.serving.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(l) = self.metrics {
            let (shared, rx) = (Arc::clone(&self.shared), stop_rx.clone());
            side.spawn(async move {
                let stats = Arc::clone(&shared.metrics.metrics);
                let mut conns = listen::serve(l, stats, metrics::MAX_METRICS_CONNECTIONS, rx, move |(stream, _)| {
                    metrics::serve_connection(stream, Arc::clone(&shared))
                })
                .await;
                // Scrapes are not worth waiting for at shutdown.
                conns.shutdown().await;
            });
        }
        let shared = Arc::clone(&self.shared);
        let rx = stop_rx.clone();
        let stats = Arc::clone(&self.shared.metrics.rpc);
        let workers = Arc::clone(&self.workers);
        let l = listen::Rehomed(self.listener);
        let accept = listen::serve_on(l, stats, self.max_connections, stop_rx, &workers, move |(stream, _)| {
            let (shared, rx) = (Arc::clone(&shared), rx.clone());
            listen::serve_rehomed("rpc", stream, |s| service::serve_connection(s, shared, rx))
        });
        let node = self.shared.node.cluster().cloned();
        let stop = async {
            shutdown.await;
            // Before anything stops (the peer links carry the transfer):
            // clients find the shards' new leaders without an election.
            if let Some(node) = node {
                match tokio::task::spawn_blocking(move || node.hand_over_leadership()).await {
                    Ok((0, _)) => {}
                    Ok((led, 0)) => info!(shards = led, "leadership handed over"),
                    Ok((led, still)) => warn!(shards = led, still, "leadership not handed over in time"),
                    Err(e) => warn!("handing leadership over failed: {e}"),
                }
            }
            // Connections answer what they have read, then close.
            let _ = stop_tx.send(true);
        };
        let (mut conns, ()) = tokio::join!(accept, stop);
        info!(connections = conns.len(), "shutting down: no longer accepting");
        let drain = async { while conns.join_next().await.is_some() {} };
        if tokio::time::timeout(config::SHUTDOWN_DRAIN, drain).await.is_err() {
            warn!("connections still open after the drain deadline; closing them");
        }
        while side.join_next().await.is_some() {}
        // Connections past the drain deadline end with their threads.
        drop(conns);
        let _ = tokio::task::spawn_blocking(move || workers.stop()).await;
        if let Some(node) = self.shared.node.cluster().cloned() {
            // Joins threads and syncs the log: off the async workers.
            let _ = tokio::task::spawn_blocking(move || node.shut_down()).await;
        }
        info!("stopped");
    }
}

/// A listener that could not bind, named with its address: dmkvd binds
/// up to six (rpc, engine, shm, peer, metrics, memcached) and the OS error alone says not which.
fn bind_error(kind: &str, addr: impl std::fmt::Display, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("cannot bind the {kind} listener to {addr}: {}", plain(&e)))
}

#[cfg(feature = "rdma")]
fn open_rdma(cfg: &Config) -> std::io::Result<Option<rdma::RdmaUse>> {
    if !cfg.rdma {
        return Ok(None);
    }
    match rdma::RdmaDevice::open(cfg.rdma_device.as_deref()) {
        Ok(device) => Ok(Some(rdma::RdmaUse { device, required: cfg.rdma_device.is_some() })),
        Err(e) if cfg.rdma_device.is_some() => {
            let dev = cfg.rdma_device.as_deref().unwrap_or_default();
            Err(std::io::Error::other(format!("--rdma-device {dev}: {e}")))
        }
        Err(dmkv_verbs::VerbsError::NoDevice) => {
            info!("no RDMA device: one-sided reads over shared memory and TCP only");
            Ok(None)
        }
        Err(e) => {
            warn!("RDMA unavailable: {e}");
            Ok(None)
        }
    }
}

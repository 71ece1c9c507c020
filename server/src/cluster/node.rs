//! A dmkvd node in a cluster: its shard replicas (each a raft group member
//! with its own region and store, driven by its own thread), its peer
//! queues, and its view of the cluster map. The RPC service asks it to
//! carry out writes (proposed to the key's shard) and linearizable reads.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dmkv_common::cluster::map::{ClusterMap, META_SHARD, NodeId, ShardId, ShardInfo, meta_nodes, node_of, replica_id};
use dmkv_common::error::{Error as StoreError, check_key, check_value};
use dmkv_common::proto;
use tokio::sync::{oneshot, watch};

use super::apply::{
    Applied, RememberedStats, encode_arith, encode_delete_cas, encode_evict, encode_flush_all, encode_touch,
    encode_write,
};
use super::config::ClusterConfig;
use super::desk::Desk;
use super::driver::ReplicaStatus;
use super::last_run;
use super::local::LocalShards;
use super::log::{RaftLog, Recovery};
use super::peer::{Dialer, Peers};
use super::shard::{JoinStep, ProposeError};
use super::sync_policy::{BATCH_SYNC_INTERVAL, SyncPolicy};
use crate::compact::Compactor;
use crate::kv::Item;
use crate::registration::{Registration, Served, ServedSet};
use crate::store::{Location, Store};

pub(super) use super::local_replica::LocalReplica;
pub use super::local_replica::{ELECTION_TICKS, LEASE_DRIFT_PPM, LEASE_MARGIN, lease_config};

/// Most a stopping node waits for its shards' leadership to move
/// ([`ClusterNode::hand_over_leadership`]): raft gives a transfer up after
/// an election timeout (up to 300 ms), and a catching-up voter may need a
/// few round trips first.
pub const MAX_HAND_OVER_WAIT: Duration = Duration::from_secs(2);
/// How often a stopping node asks a shard it still leads to hand over
/// again (a transfer raft gave up).
pub const HAND_OVER_RETRY: Duration = Duration::from_millis(400);
/// A leader admits a write while live items, the index, the writes on
/// their way and this one take at most this share of the data area: below
/// the store's guarantee (`compact::GUARANTEED_PERCENT`), so that every
/// replica can apply what the leader admitted.
pub const ADMIT_PERCENT: u64 = crate::compact::GUARANTEED_PERCENT - 5;
/// Most items one eviction entry names (`--evict lru`).
pub const EVICT_ENTRY_ITEMS: usize = 256;
/// The least room an evicting shard keeps below its admission bound.
pub const EVICT_MIN_HEADROOM: u64 = dmkv_common::limits::MAX_VALUE_LEN as u64 + (64 << 10);
/// How often a node looks whether a shard it leads must evict.
pub const EVICT_CHECK: Duration = Duration::from_millis(10);

/// How long one shard's eviction round may wait for its removal to apply
/// before the next round starts (a quarter of what a write waits for
/// room, so a stalled shard costs the others' writers no refusal).
pub const EVICT_ROUND_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a shard's later rounds wait for an eviction entry its round
/// stopped waiting for, before they plan another (an entry lost with a
/// leadership change may never be answered).
pub const EVICT_ENTRY_PATIENCE: Duration = Duration::from_secs(5);

/// Tries of one RPC read whose permission did not hold by the end of the
/// read (the lease ended, or the store was emptied meanwhile); then BUSY.
pub const MAX_READ_TRIES: usize = 8;

/// Smallest region a shard replica gets: the smallest region there is.
pub const MIN_SHARD_MEMORY: u64 = dmkv_common::limits::MIN_REGION_LEN as u64;

/// How a node joins its cluster (`--cluster FILE --node-id N
/// [--data-dir DIR]`).
#[derive(Debug, Clone)]
pub struct ClusterSetup {
    pub config: ClusterConfig,
    pub node_id: NodeId,
    /// Where the raft log lives; `None`: in memory only.
    pub data_dir: Option<PathBuf>,
    /// When the log is forced to disk.
    pub sync: SyncPolicy,
    /// When shard logs are compacted.
    pub log_limits: super::shard::LogLimits,
    /// TLS between nodes (`--peer-tls-cert` and friends).
    pub peer_tls: Option<super::peer_tls::PeerTlsFiles>,
}

/// Why a cluster request was not carried out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterError {
    /// Ask `leader` (if known); this node's map has `map_version`.
    NotLeader {
        leader: Option<NodeId>,
        map_version: u64,
    },
    /// The key's partition is not on the shard this node's map (of
    /// `map_version`) names: it moved. Nothing was changed.
    WrongShard {
        map_version: u64,
    },
    Busy,
    /// The write may or may not have taken effect.
    Uncertain,
    Store(StoreError),
    Failed(String),
}

/// A local replica's region as one-sided readers find it.
pub struct ReplicaRegion {
    pub shard: ShardId,
    pub store: Arc<Store>,
    pub reg: Arc<Registration>,
    /// The rkey of its RDMA registration (0: none).
    pub rdma_rkey: u32,
}

/// This node's part of the cluster.
pub struct ClusterNode {
    pub id: NodeId,
    /// The map as this node knows it: the placement the metadata group
    /// last told it (`refresh_map`), and the leaders its replicas know.
    map: Arc<Mutex<ClusterMap>>,
    /// The cluster file's map: the metadata group's state before any
    /// change was written.
    first_map: ClusterMap,
    /// The data shards' replicas on this node: opened at the start, and
    /// opened and closed while it runs as the map places shards here or
    /// elsewhere (`reconcile.rs`).
    replicas: std::sync::RwLock<HashMap<ShardId, Arc<LocalReplica>>>,
    /// How a replica is opened (at the start, and later).
    pub(super) opener: super::local_replica::Opener,
    /// Region bytes of a replica opened while the node runs.
    pub(super) later_per_shard: u64,
    /// The replicas' regions as the engine and the handoff serve them,
    /// set again whenever a replica opens or closes.
    served: ServedSet,
    /// `--evict lru`: replicas opened later evict too.
    evicts: std::sync::atomic::AtomicBool,
    /// The data directory records that replicas moved ([`REPLICAS_MOVED`]).
    replicas_moved: std::sync::atomic::AtomicBool,
    /// A replica move runs from this node (`replica_move.rs`).
    pub(super) replica_moving: std::sync::atomic::AtomicBool,
    /// This node's replica of the metadata group, if it is one of its
    /// nodes.
    meta: Option<Arc<LocalReplica>>,
    /// The metadata group's nodes and their peer addresses.
    meta_nodes: Vec<(NodeId, std::net::SocketAddr)>,
    /// The node last found leading the metadata group (0: none known).
    pub(super) meta_leader: AtomicU64,
    /// Wakes the map's refresh (a shard refused a key that moved).
    map_wake: Arc<tokio::sync::Notify>,
    /// A partition move runs on this node (`mover.rs`).
    pub(super) mover_running: std::sync::atomic::AtomicBool,
    /// A rebalance's moves run from this node (`rebalancer.rs`).
    pub(super) rebalancing: std::sync::atomic::AtomicBool,
    /// The asks of the metadata group made for clients' stale maps.
    pub(super) client_asks: super::client_asks::ClientAsks,
    /// The moves this node takes part in, for `dmkv cluster status`.
    pub(super) move_book: super::move_book::MoveBook,
    dialer: Dialer,
    sink: Arc<LocalShards>,
    /// The raft log's engine, with `--data-dir` (its size is a metric).
    log: Option<Arc<raft_engine::Engine>>,
    data_dir: Option<PathBuf>,
    sync: SyncPolicy,
    /// TLS on the peer port, and on dials to peers.
    pub peer_tls: Option<Arc<super::peer_tls::PeerTls>>,
    /// Requests this node passes on to the node that leads their shard.
    pub forward: super::forward::Forwarder,
    /// The device every replica's region is registered with.
    #[cfg(feature = "rdma")]
    rdma: Option<Arc<crate::rdma::RdmaDevice>>,
}

/// What a node needs from the server's configuration.
pub struct NodeParams {
    /// Memory for all of this node's replicas together.
    pub memory: u64,
    pub compactor: crate::compact::Mode,
    pub grace: Duration,
    pub max_frame: usize,
    pub token: Option<dmkv_common::auth::Token>,
    /// Registers each replica's region for RDMA reads on this device.
    #[cfg(feature = "rdma")]
    pub rdma: Option<crate::rdma::RdmaUse>,
}

impl ClusterNode {
    /// Opens the log, creates a region and store per local replica, starts
    /// the shard threads and the peer senders (on the current runtime).
    pub fn start(setup: &ClusterSetup, p: NodeParams, stop: watch::Receiver<bool>) -> Result<ClusterNode, String> {
        let cfg = &setup.config;
        let me = cfg.node(setup.node_id)?.id;
        let map = cfg.initial_map().map_err(|e| e.to_string())?;
        let mut local: Vec<_> = map.shards().iter().filter(|s| s.replicas.contains(&me)).cloned().collect();
        let data_shards = local.len();
        // The metadata group, on the first nodes: a shard like the others
        // to raft, its log and its snapshots, that holds the map.
        let meta_nodes = meta_nodes(cfg.placed_nodes());
        if meta_nodes.contains(&me) {
            local.push(ShardInfo { id: META_SHARD, replicas: meta_nodes.clone(), leader: None, term: 0 });
        }
        let peers: Vec<_> = cfg.nodes.iter().filter(|n| n.id != me).map(|n| (n.id, n.peer)).collect();
        let peer_tls = match &setup.peer_tls {
            Some(files) => {
                let nodes = cfg.nodes.iter().map(|n| n.id).collect();
                Some(Arc::new(super::peer_tls::PeerTls::load(files.clone(), me, nodes)?))
            }
            None => None,
        };
        let dialer = Dialer {
            me,
            token: p.token,
            max_frame: p.max_frame,
            source: Dialer::source_of(cfg.node(me)?.peer),
            tls: peer_tls.clone(),
        };
        let forward = super::forward::Forwarder::new(dialer.clone(), &peers);
        let peers = Arc::new(Peers::start(dialer.clone(), peers, stop.clone(), p.memory));
        // A log that may lack what its replicas acknowledged (see
        // `last_run`, `log::Recovery`) is not trusted to vote: replicas of
        // shards that have others rejoin as new incarnations.
        let mut distrust = None;
        let engine = match &setup.data_dir {
            Some(dir) => {
                let raft_dir = dir.join("raft");
                std::fs::create_dir_all(&raft_dir)
                    .map_err(|e| format!("cannot create data directory {}: {e}", raft_dir.display()))?;
                if let last_run::Trust::Distrusted(why) = last_run::begin(dir, setup.sync)? {
                    distrust = Some(why);
                }
                let raft_path = raft_dir.to_string_lossy().to_string();
                let mark = |why: &str| last_run::distrust(dir, &format!("the raft log was damaged ({why})"));
                let (engine, recovery) =
                    match RaftLog::open_engine_then(&raft_path, log_purge_threshold(p.memory), mark) {
                        // Every shard has other replicas to catch up from (one
                        // `replicas` for all): the log is set aside, the node
                        // starts with an empty one, and its replicas rejoin.
                        Err(e @ super::log::LogError::Damaged { .. }) if local.iter().all(|s| s.replicas.len() > 1) => {
                            let aside = RaftLog::set_aside(&raft_path).map_err(|e| e.to_string())?;
                            tracing::error!("{e}: set aside as {aside}; every replica of this node rejoins its shard");
                            std::fs::create_dir_all(&raft_dir)
                                .map_err(|e| format!("cannot create data directory {}: {e}", raft_dir.display()))?;
                            let (engine, _) =
                                RaftLog::open_engine_then(&raft_path, log_purge_threshold(p.memory), |_| Ok(()))
                                    .map_err(|e| e.to_string())?;
                            (engine, Recovery::Repaired(e.to_string()))
                        }
                        r => r.map_err(|e| e.to_string())?,
                    };
                if let Recovery::Repaired(why) = recovery {
                    distrust = Some(format!("the raft log was damaged and repaired ({why})"));
                }
                super::engine_panic::abort_on_engine_panic(dir);
                if setup.sync == SyncPolicy::Batch {
                    spawn_batch_sync(Arc::clone(&engine), stop.clone())
                        .map_err(|e| format!("cannot start the log syncer: {e}"))?;
                }
                spawn_log_purge(Arc::clone(&engine), stop.clone())
                    .map_err(|e| format!("cannot start the log purger: {e}"))?;
                Some(engine)
            }
            None => None,
        };
        // Whole pages: the region is mapped and read in words. The
        // metadata group's replica takes the smallest region beside. A
        // replica placed here later gets what a node of an even placement
        // gives each (a spare holds none at first).
        let even = (cfg.shards as usize * cfg.replicas).div_ceil(cfg.placed_nodes().count().max(1));
        let per_shard = (p.memory / data_shards.max(1) as u64 / 4096 * 4096).max(MIN_SHARD_MEMORY);
        let later_per_shard = (p.memory / even.max(1) as u64 / 4096 * 4096).max(MIN_SHARD_MEMORY);
        let mut replicas = HashMap::new();
        let mut meta = None;
        // Woken when a replica here applies a placement change too: the
        // map that goes with it is asked for at once, not at the next poll.
        let map_wake: Arc<tokio::sync::Notify> = Arc::default();
        let opener = super::local_replica::Opener {
            me,
            cfg: cfg.clone(),
            first_map: map.clone(),
            compactor: p.compactor,
            grace: p.grace,
            engine: engine.clone(),
            data_dir: setup.data_dir.clone(),
            sync: setup.sync,
            log_limits: setup.log_limits,
            dialer: dialer.clone(),
            peers,
            sink: Arc::default(),
            map_wake: Arc::clone(&map_wake),
            map: Arc::new(Mutex::new(map.clone())),
            distrust: distrust.clone(),
            logger: slog::Logger::root(slog::Discard, slog::o!()),
            stop: stop.clone(),
            #[cfg(feature = "rdma")]
            rdma: p.rdma,
        };
        // Once the map placed replicas elsewhere than the file, the file's
        // first members of a shard are no longer who founds it.
        let moved_before = setup.data_dir.as_ref().is_some_and(|d| d.join(REPLICAS_MOVED).exists());
        let opened: std::collections::BTreeSet<u64> = local.iter().map(|sh| u64::from(sh.id)).collect();
        for sh in local {
            let size = if sh.id == META_SHARD { MIN_SHARD_MEMORY } else { per_shard };
            let may_found = sh.id == META_SHARD || !moved_before;
            let replica = Arc::new(opener.open(&sh, &sh.replicas, size, distrust.clone(), may_found)?);
            match sh.id {
                META_SHARD => meta = Some(replica),
                id => {
                    replicas.insert(id, replica);
                }
            }
        }
        if let (Some(why), Some(dir)) = (&distrust, &setup.data_dir) {
            // Shards placed here at run time open later, and would rejoin
            // anew too: their logs go now, before the distrust is settled,
            // so that a stop before they open cannot make them trusted.
            if let Some(engine) = engine.as_ref().filter(|_| cfg.replicas > 1) {
                for g in engine.raft_groups().into_iter().filter(|g| !opened.contains(g)) {
                    RaftLog::new(Arc::clone(engine), g).forget().map_err(|e| format!("shard {g}: {e}"))?;
                }
            }
            // Every replica that could drop the distrusted log has, durably.
            last_run::settled(dir)?;
            tracing::info!("{why}: every replica with others to catch up from rejoins as a new incarnation");
        }
        Ok(ClusterNode {
            id: me,
            map: Arc::clone(&opener.map),
            first_map: map,
            meta,
            meta_nodes: meta_nodes
                .iter()
                .filter_map(|&n| cfg.nodes.iter().find(|e| e.id == n).map(|e| (n, e.peer)))
                .collect(),
            meta_leader: AtomicU64::new(0),
            map_wake,
            mover_running: Default::default(),
            rebalancing: Default::default(),
            client_asks: Default::default(),
            move_book: Default::default(),
            dialer,
            sink: Arc::clone(&opener.sink),
            log: engine,
            data_dir: setup.data_dir.clone(),
            sync: setup.sync,
            peer_tls,
            forward,
            #[cfg(feature = "rdma")]
            rdma: opener.rdma.as_ref().map(|r| Arc::clone(&r.device)),
            opener,
            later_per_shard,
            served: ServedSet::new(served_of(replicas.values())),
            evicts: Default::default(),
            replicas_moved: std::sync::atomic::AtomicBool::new(moved_before),
            replica_moving: Default::default(),
            replicas: std::sync::RwLock::new(replicas),
        })
    }

    /// Hands the leadership of every shard this node leads to another of
    /// its voters (a rolling restart then costs no election timeout and no
    /// stretch without a lease), and waits until none is led here, at most
    /// [`MAX_HAND_OVER_WAIT`]; returns how many shards it had to hand over
    /// and how many of those it still leads. Blocks. A shard led alone has
    /// no one to hand over to, and is not waited for. Raft gives a transfer up after an
    /// election timeout (the voter went down, or is too far behind): the
    /// shard is asked again every [`HAND_OVER_RETRY`], and picks a voter
    /// heard from lately. What is still led at the deadline stops leading
    /// as it would have anyway.
    pub fn hand_over_leadership(&self) -> (usize, usize) {
        use super::shard::NoHandOver;
        let deadline = std::time::Instant::now() + MAX_HAND_OVER_WAIT;
        // Every shard led now but not alone: asked until it leads no more.
        let mut waiting: Vec<Arc<LocalReplica>> =
            self.all_replicas().into_iter().filter(|r| r.status.is_leader()).collect();
        loop {
            // All asked at once, then the answers collected against the
            // one deadline (a shard thread busy with a long apply answers
            // late, or not before it).
            let asked: Vec<(*const LocalReplica, _)> = waiting
                .iter()
                .filter(|r| r.status.is_leader())
                .map(|r| (Arc::as_ptr(r), r.thread.hand_over(None)))
                .collect();
            for (asked, rx) in asked {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if let Some(Err(NoHandOver::NotLeader | NoHandOver::Alone)) =
                    rx.and_then(|rx| rx.recv_timeout(left).ok())
                {
                    waiting.retain(|r| !std::ptr::eq(Arc::as_ptr(r), asked));
                }
            }
            let retry = (std::time::Instant::now() + HAND_OVER_RETRY).min(deadline);
            loop {
                let still = waiting.iter().filter(|r| r.status.is_leader()).count();
                if still == 0 || std::time::Instant::now() >= deadline {
                    return (waiting.len(), still);
                }
                if std::time::Instant::now() >= retry {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }

    /// Stops every replica (each fences first), forces the log to disk and
    /// records that this run stopped cleanly (`last_run`). Blocks.
    pub fn shut_down(&self) {
        for r in self.all_replicas() {
            r.thread.halt();
        }
        if let (Some(engine), Some(dir)) = (&self.log, &self.data_dir) {
            match engine.sync() {
                Ok(()) => {
                    if let Err(e) = last_run::end(dir, self.sync) {
                        tracing::warn!("cannot record the clean stop: {e}");
                    }
                }
                Err(e) => tracing::error!("the raft log could not be synced at shutdown: {e}"),
            }
        }
    }

    /// Where peers' raft messages go.
    pub fn sink(&self) -> Arc<LocalShards> {
        Arc::clone(&self.sink)
    }

    /// The map with what this node's replicas know of their leaders. A
    /// replica that stopped (it failed, and is starting again) is never
    /// named leader: clients go to the others.
    pub fn map(&self) -> ClusterMap {
        let mut map = crate::lock::lock(&self.map);
        for (shard, r) in self.data_replicas() {
            if r.status.role() == "stopped" {
                map.forget_leader(shard, self.id);
                continue;
            }
            let leader = node_of(r.status.leader.load(std::sync::atomic::Ordering::Relaxed));
            if leader != 0 {
                let _ = map.set_leader(shard, leader, r.status.term.load(std::sync::atomic::Ordering::Relaxed));
            }
        }
        map.clone()
    }

    /// The map as a reply, with this node's replicas' state.
    pub fn map_reply(&self) -> proto::ClusterMapReply {
        use std::sync::atomic::Ordering::Relaxed;
        let mut reply = self.map().to_proto();
        reply.node_id = self.id;
        let mut local: Vec<_> = self
            .data_replicas()
            .into_iter()
            .chain(self.meta.as_ref().map(|m| (META_SHARD, Arc::clone(m))))
            .map(|(shard, r)| {
                let (voters, learners) = r.status.members();
                proto::ReplicaState {
                    shard,
                    role: r.status.role().into(),
                    term: r.status.term.load(Relaxed),
                    leader: node_of(r.status.leader.load(Relaxed)),
                    commit: r.status.commit.load(Relaxed),
                    applied: r.status.applied.load(Relaxed),
                    lag: r.status.lag().into_iter().collect(),
                    replica_id: r.status.id.load(Relaxed),
                    voters,
                    learners,
                    partitions: r.placement.count(),
                    placement_version: r.placement.version(),
                    items: r.store.counters.items.load(Relaxed),
                    bytes: r.store.live_bytes(),
                }
            })
            .collect();
        local.sort_by_key(|r| r.shard);
        reply.local = local;
        reply.moves = self.move_book.reports();
        reply
    }

    /// The local replica of `key`'s shard, or where to go instead.
    fn replica_of(&self, key: &[u8]) -> Result<Arc<LocalReplica>, ClusterError> {
        let map = crate::lock::lock(&self.map);
        let shard = map.shard_of(key);
        match self.data_replica(shard.id) {
            Some(r) => Ok(r),
            None => Err(ClusterError::NotLeader { leader: shard.leader, map_version: map.version }),
        }
    }

    pub(super) fn map_version(&self) -> u64 {
        crate::lock::lock(&self.map).version
    }

    /// A shard refused a key that moved: this node's map is behind.
    fn wrong_shard(&self) -> ClusterError {
        self.map_wake.notify_one();
        ClusterError::WrongShard { map_version: self.map_version() }
    }

    /// This node's replica of `shard` (a data shard or the metadata group).
    pub(super) fn replica(&self, shard: ShardId) -> Option<Arc<LocalReplica>> {
        match shard {
            META_SHARD => self.meta.clone(),
            _ => self.data_replica(shard),
        }
    }

    /// This node's replica of the metadata group, if it has one.
    pub(super) fn meta_replica(&self) -> Option<&LocalReplica> {
        self.meta.as_deref()
    }

    /// This node's replica of data shard `shard`, if it holds one.
    pub(super) fn data_replica(&self, shard: ShardId) -> Option<Arc<LocalReplica>> {
        self.replicas.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&shard).cloned()
    }

    /// This node's data shards' replicas, by shard.
    pub(super) fn data_replicas(&self) -> Vec<(ShardId, Arc<LocalReplica>)> {
        let mut v: Vec<_> = self
            .replicas
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(&s, r)| (s, Arc::clone(r)))
            .collect();
        v.sort_by_key(|r| r.0);
        v
    }

    /// Every replica on this node, the metadata group's included.
    fn all_replicas(&self) -> Vec<Arc<LocalReplica>> {
        self.data_replicas().into_iter().map(|(_, r)| r).chain(self.meta.clone()).collect()
    }

    /// Adds `replica` of `shard` (opened while the node runs); one-sided
    /// readers can attach to its region from now on.
    pub(super) fn insert_replica(&self, shard: ShardId, replica: Arc<LocalReplica>) {
        let mut table = self.replicas.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Under the table's lock: `enable_eviction` sees this replica, or
        // this sees its flag.
        if self.evicts.load(Ordering::Acquire) {
            replica.store.enable_replicated_eviction();
        }
        table.insert(shard, replica);
        self.served.set(served_of(table.values()));
    }

    /// Takes this node's replica of `shard` out of its table and out of
    /// what one-sided readers are served.
    pub(super) fn remove_replica(&self, shard: ShardId) -> Option<Arc<LocalReplica>> {
        let mut table = self.replicas.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        let r = table.remove(&shard);
        self.served.set(served_of(table.values()));
        r
    }

    /// The regions one-sided readers are served (the engine's and the
    /// handoff's list, which follows the replicas).
    pub fn served(&self) -> ServedSet {
        self.served.clone()
    }

    /// The metadata group's nodes and their peer addresses.
    pub(super) fn meta_nodes(&self) -> &[(NodeId, std::net::SocketAddr)] {
        &self.meta_nodes
    }

    /// The cluster file's map.
    pub(super) fn first_map(&self) -> &ClusterMap {
        &self.first_map
    }

    /// How this node dials its peers.
    pub(super) fn dialer(&self) -> &Dialer {
        &self.dialer
    }

    /// What wakes the map's refresh.
    pub(super) fn map_wake(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.map_wake)
    }

    /// Whether a replica here applied a placement change newer than this
    /// node's map: the map that goes with it is on its way.
    pub(super) fn map_behind(&self) -> bool {
        let v = self.map_version();
        self.data_replicas().iter().any(|(_, r)| r.placement.version() > v)
    }

    /// Takes `theirs` (the metadata group's) if its placement is newer than
    /// this node's map's, or as new with another move record (a move
    /// paused or claimed by another mover: routing is the same); the
    /// leaders this node knows stay, for shards whose replicas are the
    /// same. Whether the map changed.
    pub fn adopt_map(&self, mut theirs: ClusterMap) -> bool {
        // Recorded before any replica can act on the map (a forgotten log),
        // and a map that cannot be recorded is not taken (asked again at
        // the next poll).
        let moved = self.first_map.shards().iter().zip(theirs.shards()).any(|(a, b)| a.replicas != b.replicas);
        if moved && !self.note_replicas_moved() {
            return false;
        }
        let mut map = crate::lock::lock(&self.map);
        if theirs.version < map.version || (theirs.version == map.version && theirs.moving == map.moving) {
            return false;
        }
        for sh in map.shards() {
            if let Some(l) = sh.leader {
                let _ = theirs.set_leader(sh.id, l, sh.term);
            }
        }
        *map = theirs;
        true
    }

    /// Records in the data directory (once, durably) that the map has
    /// placed replicas elsewhere than the cluster file does: from the next
    /// start on, a replica with no state never founds its shard anew (the
    /// file's first members of a shard that moved away would otherwise
    /// find each other at term 0, and start a stray group under it).
    /// Whether it is recorded (or nothing needs to be: no data directory).
    /// Once per node life: one fsync, on the caller's thread.
    fn note_replicas_moved(&self) -> bool {
        let Some(dir) = &self.data_dir else { return true };
        if self.replicas_moved.load(Ordering::Acquire) {
            return true;
        }
        match write_synced(&dir.join(REPLICAS_MOVED), b"the map placed replicas elsewhere than the cluster file\n") {
            Ok(()) => {
                self.replicas_moved.store(true, Ordering::Release);
                true
            }
            Err(e) => {
                tracing::error!("cannot record that replicas moved (the new map is not taken): {e}");
                false
            }
        }
    }

    pub(super) fn cluster_error(&self, e: ProposeError) -> ClusterError {
        match e {
            ProposeError::NotLeader { leader } => {
                ClusterError::NotLeader { leader: leader.map(node_of), map_version: self.map_version() }
            }
            // Another leader's entry took its place: nothing happened.
            ProposeError::Dropped => ClusterError::NotLeader { leader: None, map_version: self.map_version() },
            ProposeError::Busy => ClusterError::Busy,
            ProposeError::Unknown => ClusterError::Uncertain,
            ProposeError::Store(s) => ClusterError::Failed(s),
        }
    }

    async fn propose(&self, key: &[u8], data: Vec<u8>) -> Result<Applied, ClusterError> {
        match self.propose_raw(key, data).await? {
            // A condition that did not hold, on every replica alike.
            Applied::Refused(e) => Err(ClusterError::Store(e)),
            Applied::WrongShard => Err(self.wrong_shard()),
            a => Ok(a),
        }
    }

    async fn propose_raw(&self, key: &[u8], data: Vec<u8>) -> Result<Applied, ClusterError> {
        let r = self.replica_of(key)?;
        // A follower proposes nothing: it says who leads before any wait
        // for room (it evicts nothing itself, so a wait would only end in
        // OUT_OF_MEMORY).
        if !r.status.is_leader() {
            let leader = r.status.leader.load(Ordering::Relaxed);
            let leader = (leader != 0).then(|| node_of(leader)).filter(|&n| n != self.id);
            return Err(ClusterError::NotLeader { leader, map_version: self.map_version() });
        }
        // Admitted only while it fits every replica's guarantee with what
        // is already on its way (a DELETE needs no room but is counted
        // alike: it is small).
        let bytes = (data.len() + dmkv_common::layout::ITEM_HEADER_LEN) as u64;
        if !admit(&r, bytes) {
            // An evicting shard makes room (`evict_round`, through the
            // log): the write waits for it, boundedly, as a single node's
            // waits for its own eviction. Each waiter is admitted on its
            // own bytes, not on all waiters' at once.
            let _waiting = InFlight::add(&r.waiting, bytes);
            let deadline = tokio::time::Instant::now() + crate::compact::OUT_OF_MEMORY_WAIT;
            loop {
                // Deposed meanwhile: nothing here evicts any more, and
                // the write belongs with the new leader.
                if !r.status.is_leader() {
                    let leader = r.status.leader.load(Ordering::Relaxed);
                    let leader = (leader != 0).then(|| node_of(leader)).filter(|&n| n != self.id);
                    return Err(ClusterError::NotLeader { leader, map_version: self.map_version() });
                }
                if !r.store.evicts() || tokio::time::Instant::now() >= deadline {
                    return Err(ClusterError::Store(StoreError::OutOfMemory));
                }
                tokio::time::sleep(EVICT_CHECK / 2).await;
                if admit(&r, bytes) {
                    break;
                }
            }
        }
        let _done = InFlight(&r.in_flight, bytes);
        match r.thread.propose(data).await {
            Ok(Ok(a)) => Ok(a),
            Ok(Err(e)) => Err(self.cluster_error(e)),
            // The replica failed with the write on its way: it may have
            // committed (and be applied by the others). The client sends
            // it again with its id, to whichever replica leads now.
            Err(_) => Err(ClusterError::Uncertain),
        }
    }

    /// A PUT, answered once committed and applied here.
    /// `id`: the client's write id, so that a PUT sent again applies once.
    pub async fn put(&self, key: &[u8], value: &[u8], id: Option<proto::WriteId>) -> Result<u64, ClusterError> {
        let p =
            proto::Put { key: key.to_vec().into(), value: value.to_vec().into(), write_id: id, ..Default::default() };
        self.write(p).await
    }

    /// Any write a PUT asks for (mode, flags, TTL, CAS); returns the
    /// item's new version. The leader's clock makes its TTL an absolute
    /// expiry; the condition is judged where the entry applies.
    pub async fn write(&self, p: proto::Put) -> Result<u64, ClusterError> {
        check_key(&p.key).and_then(|()| check_value(&p.value)).map_err(ClusterError::Store)?;
        let key = p.key.clone();
        match self.propose(&key, encode_write(p, crate::clock::now_ms())).await? {
            Applied::Put { version } => Ok(version),
            other => Err(unexpected("a PUT", other)),
        }
    }

    /// A DELETE, answered once committed and applied here.
    pub async fn delete(&self, key: &[u8], id: Option<proto::WriteId>) -> Result<bool, ClusterError> {
        self.delete_cas(proto::Delete { key: key.to_vec().into(), write_id: id, cas: 0 }).await
    }

    /// A DELETE, of only the item of version `d.cas` when that is set.
    pub async fn delete_cas(&self, d: proto::Delete) -> Result<bool, ClusterError> {
        check_key(&d.key).map_err(ClusterError::Store)?;
        let key = d.key.clone();
        match self.propose(&key, encode_delete_cas(d, crate::clock::now_ms())).await? {
            Applied::Delete { existed } => Ok(existed),
            other => Err(unexpected("a DELETE", other)),
        }
    }

    /// A counter operation: the new value and the item's version.
    pub async fn arith(&self, a: proto::Arith) -> Result<(u64, u64), ClusterError> {
        check_key(&a.key).map_err(ClusterError::Store)?;
        let key = a.key.clone();
        match self.propose(&key, encode_arith(a, crate::clock::now_ms())).await? {
            Applied::Counter { value, version } => Ok((value, version)),
            other => Err(unexpected("a counter operation", other)),
        }
    }

    /// Gives a key's live item a new expiry; returns the item.
    pub async fn touch(&self, t: proto::Touch) -> Result<Option<Item>, ClusterError> {
        check_key(&t.key).map_err(ClusterError::Store)?;
        let key = t.key.clone();
        match self.propose(&key, encode_touch(t, crate::clock::now_ms())).await? {
            Applied::Touched { item } => Ok(item.map(|i| *i)),
            other => Err(unexpected("a touch", other)),
        }
    }

    /// Empties every shard this node's replicas lead (memcached's
    /// flush_all on this node's part); returns how many items went. A
    /// shard another node leads is not touched: NOT_LEADER names it.
    pub async fn flush_led(&self) -> Result<u64, ClusterError> {
        let mut items = 0;
        for (_, r) in self.data_replicas() {
            if !r.status.is_leader() {
                continue;
            }
            match r.thread.propose(encode_flush_all(crate::clock::now_ms())).await {
                Ok(Ok(Applied::Flushed { items: n })) => items += n,
                Ok(Ok(other)) => return Err(unexpected("a flush", other)),
                Ok(Err(e)) => return Err(self.cluster_error(e)),
                Err(_) => return Err(ClusterError::Uncertain),
            }
        }
        Ok(items)
    }

    /// Reads `key`'s shard's store linearizably with `read`: once a quorum
    /// round or the lease permits it. A read permitted under the lease
    /// counts only if it ended before the lease did, on this node's clock
    /// read after it: the permission was decided on the shard thread's
    /// clock as of its last poll, which a preempted thread (or this task,
    /// preempted between the permission and the read) may have made long
    /// before the read. One that ended too late is asked again, under a
    /// quorum round. Any read counts only if the store was not emptied
    /// since the permission (its generation), else it is asked again. The
    /// retries are bounded by the request's own deadline (the caller's
    /// timeout drops this future).
    ///
    /// And only if the shard still owns what was read (`owned`, asked after
    /// the read): a partition given up before the read may have taken
    /// writes on its new shard since (docs/elasticity.md).
    async fn read_linearizably<T>(
        &self,
        key: &[u8],
        read: impl Fn(&Store) -> Result<T, StoreError>,
        owned: impl Fn(&super::placement::SharedPlacement) -> bool,
    ) -> Result<T, ClusterError> {
        let r = self.replica_of(key)?;
        self.read_replica(&r, read, owned).await
    }

    /// [`ClusterNode::read_linearizably`] of replica `r`'s store.
    pub(super) async fn read_replica<T>(
        &self,
        r: &LocalReplica,
        read: impl Fn(&Store) -> Result<T, StoreError>,
        owned: impl Fn(&super::placement::SharedPlacement) -> bool,
    ) -> Result<T, ClusterError> {
        let mut lease_ok = true;
        for _ in 0..MAX_READ_TRIES {
            let placement = r.placement.version();
            let grant = match r.thread.read(lease_ok).await {
                Ok(Ok(g)) => g,
                Ok(Err(e)) => return Err(self.cluster_error(e)),
                // The replica failed meanwhile: another one answers.
                Err(_) => return Err(ClusterError::NotLeader { leader: None, map_version: self.map_version() }),
            };
            let got = read(&r.store).map_err(ClusterError::Store);
            if r.store.generation() != grant.generation {
                // Emptied and refilled under the read (a snapshot, a
                // replacement, a restart): what it saw is no state the
                // replica was in. Asked again, from the start.
                r.status.lease_read_retries.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let got = got?;
            if !owned(&r.placement) {
                return Err(self.wrong_shard());
            }
            if r.placement.version() != placement {
                // Given up and taken back under the read: what it saw may
                // be from a time the shard did not own it. Asked again.
                continue;
            }
            match grant.lease_until {
                Some(until) if crate::clock::mono_ns() >= until => {
                    r.status.lease_read_retries.fetch_add(1, Ordering::Relaxed);
                    lease_ok = false;
                }
                _ => return Ok(got),
            }
        }
        Err(ClusterError::Busy)
    }

    /// A linearizable GET on the shard's leader: the live item (by this
    /// node's clock, the one its region publishes to one-sided readers)
    /// and where its slot is.
    pub async fn get(&self, key: &[u8]) -> Result<Option<(Item, Location)>, ClusterError> {
        self.read_linearizably(key, |s| s.get_item(key, crate::clock::now_ms()), |p| p.owns_key(key)).await
    }

    /// Linearizable GETs of many keys: one read permission per shard
    /// (a quorum round, or the lease), then every key of that shard.
    pub async fn multi_get(&self, keys: &[Bytes]) -> Result<Vec<Option<(Item, Location)>>, ClusterError> {
        let mut by_shard: std::collections::BTreeMap<ShardId, Vec<usize>> = Default::default();
        {
            let map = crate::lock::lock(&self.map);
            for (i, k) in keys.iter().enumerate() {
                by_shard.entry(map.shard_of(k).id).or_default().push(i);
            }
        }
        let mut out = vec![None; keys.len()];
        for idx in by_shard.values() {
            let first = &keys[idx[0]];
            let got = self
                .read_linearizably(
                    first,
                    |s| {
                        let now = crate::clock::now_ms();
                        idx.iter().map(|&i| s.get_item(&keys[i], now)).collect::<Result<Vec<_>, _>>()
                    },
                    |p| idx.iter().all(|&i| p.owns_key(&keys[i])),
                )
                .await?;
            for (&i, v) in idx.iter().zip(got) {
                out[i] = v;
            }
        }
        Ok(out)
    }

    /// Takes a chunk of a snapshot a leader on node `c.from_node` streams to
    /// this node's replica of `c.shard`. The last one, once the whole
    /// stream checked out, hands raft the MsgSnapshot it carries.
    pub async fn receive_snapshot(&self, c: proto::SnapshotChunk) -> Result<proto::SnapshotChunkReply, ClusterError> {
        let Some(r) = self.replica(c.shard) else {
            return Err(ClusterError::Failed(format!("shard {} has no replica on node {}", c.shard, self.id)));
        };
        let desk = Arc::clone(&r.desk);
        let (from, id, offset, last) = (c.from_node, c.id, c.offset, c.last);
        let data = c.data;
        // Writes (and, at the end, a sync and a read of the whole stream)
        // are off the async workers.
        let taken = tokio::task::spawn_blocking(move || desk.receive(from, id, offset, &data, last))
            .await
            .map_err(|e| ClusterError::Failed(e.to_string()))?
            .map_err(ClusterError::Failed)?;
        let data = match taken {
            super::desk::Taken::More(n) => return Ok(proto::SnapshotChunkReply { received: n }),
            super::desk::Taken::Whole(data) => data,
        };
        let refuse = |why: String| ClusterError::Failed(format!("snapshot refused: {why}"));
        let d = data.clone();
        let checked = tokio::task::spawn_blocking(move || Desk::validate(&d))
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .and_then(|summary| {
                let m = <raft::prelude::Message as protobuf::Message>::parse_from_bytes(&c.raft_message)
                    .map_err(|e| e.to_string())?;
                let desc = super::desk::Descriptor::decode(m.get_snapshot().get_data());
                let meta = m.get_snapshot().get_metadata();
                if m.get_msg_type() != raft::prelude::MessageType::MsgSnapshot
                    || desc != Some(super::desk::Descriptor { id, at: summary.at })
                    || (meta.index, meta.term) != (summary.at.index, summary.at.term)
                {
                    return Err("its raft message does not describe it".to_string());
                }
                Ok((summary, desc, m))
            });
        let (summary, desc, m) = match checked {
            Ok(x) => x,
            Err(why) => {
                // A shard's worth of bytes: not left behind.
                Desk::discard(&data);
                return Err(refuse(why));
            }
        };
        r.desk.received(desc.expect("checked"), data);
        super::wire::RaftSink::deliver(&*self.sink, from, vec![(c.shard, m)]);
        Ok(proto::SnapshotChunkReply { received: summary.bytes })
    }

    /// A new replica of `shard` (raft id `replica`) asks to be made a
    /// member: the next step, if this node's replica leads.
    pub async fn join_shard(&self, shard: ShardId, replica: u64) -> Result<JoinStep, ClusterError> {
        let Some(r) = self.replica(shard) else {
            return Err(ClusterError::Failed(format!("shard {shard} has no replica on node {}", self.id)));
        };
        // Only the nodes the map places the shard on hold it (the
        // metadata group: its first three).
        let placed = match shard {
            META_SHARD => self.meta_nodes.iter().any(|&(n, _)| n == node_of(replica)),
            _ => crate::lock::lock(&self.map)
                .shards()
                .iter()
                .any(|s| s.id == shard && s.replicas.contains(&node_of(replica))),
        };
        if !placed {
            return Err(ClusterError::Failed(format!(
                "replica {replica} is on node {}, which does not hold shard {shard}",
                node_of(replica)
            )));
        }
        match r.thread.join(replica).await {
            Ok(Ok(step)) => Ok(step),
            Ok(Err(e)) => Err(self.cluster_error(e)),
            Err(_) => Err(ClusterError::Failed("the shard's replica stopped".into())),
        }
    }

    /// Replaces this node's replica of `shard` by a new one with no state
    /// (a new raft id), which joins the shard and catches up from its
    /// leader; the old one is removed from the shard's members. Returns the
    /// new raft id.
    pub async fn replace_replica(&self, shard: ShardId) -> Result<u64, ClusterError> {
        // The group's size was not the user's choice: with fewer than three
        // members, the old member still counted would leave no quorum.
        if shard == META_SHARD && self.meta_nodes.len() < 3 {
            return Err(ClusterError::Failed(format!(
                "the metadata group has {} members: a replica of it is replaced only in a group of three",
                self.meta_nodes.len()
            )));
        }
        let Some(r) = self.replica(shard) else {
            return Err(ClusterError::Failed(format!("shard {shard} has no replica on node {}", self.id)));
        };
        let id = replica_id(self.id, rand::random_range(2..=u32::MAX));
        match r.thread.replace(id).await {
            Ok(Ok(())) => Ok(id),
            Ok(Err(e)) => Err(ClusterError::Failed(e)),
            Err(_) => Err(ClusterError::Failed("the shard's replica stopped".into())),
        }
    }

    /// This node's shard replicas' regions, for one-sided readers, by shard.
    pub fn regions(&self) -> Vec<ReplicaRegion> {
        let mut v: Vec<_> = self
            .data_replicas()
            .into_iter()
            .map(|(shard, r)| ReplicaRegion {
                shard,
                store: Arc::clone(&r.store),
                reg: Arc::clone(&r.reg),
                rdma_rkey: r.rdma_rkey(),
            })
            .collect();
        v.sort_by_key(|r| r.shard);
        v
    }

    /// The RDMA device the replicas' regions are registered with: none if
    /// no replica's registration worked (a device found, not named, and
    /// a memlock limit too low), so clients are not offered RDMA for
    /// nothing.
    #[cfg(feature = "rdma")]
    pub fn rdma_device(&self) -> Option<&Arc<crate::rdma::RdmaDevice>> {
        self.rdma.as_ref().filter(|_| self.data_replicas().iter().any(|(_, r)| r.rdma.is_some()))
    }

    /// Counters of this node's replicas, summed (for STATS).
    pub fn replica_counters(&self) -> [(&'static str, u64); 8] {
        use std::sync::atomic::Ordering::Relaxed;
        let local = self.data_replicas();
        let sum = |f: fn(&ReplicaStatus) -> &AtomicU64| local.iter().map(|(_, r)| f(&r.status).load(Relaxed)).sum();
        let remembered = |f: fn(&RememberedStats) -> &AtomicU64| -> u64 {
            local.iter().map(|(_, r)| f(&r.remembered).load(Relaxed)).sum()
        };
        [
            ("shard_lease_reads", sum(|s| &s.lease_reads)),
            ("shard_lease_read_retries", sum(|s| &s.lease_read_retries)),
            ("shard_replica_restarts", sum(|s| &s.restarts)),
            ("shard_apply_stalls", sum(|s| &s.apply_stalls)),
            ("shard_snapshots_built", sum(|s| &s.snapshots_built)),
            ("shard_snapshots_installed", sum(|s| &s.snapshots_installed)),
            ("shard_remembered_writes", remembered(|s| &s.writes)),
            ("shard_remembered_dropped_early", remembered(|s| &s.dropped_early)),
        ]
    }

    /// Each local replica's status, by shard (for metrics and readiness).
    pub fn statuses(&self) -> Vec<(ShardId, Arc<ReplicaStatus>)> {
        let v: Vec<_> = self.data_replicas().into_iter().map(|(s, r)| (s, Arc::clone(&r.status))).collect();
        v
    }

    /// Each local replica's remembered writes, by shard (for metrics).
    pub fn remembered(&self) -> Vec<(ShardId, Arc<RememberedStats>)> {
        let v: Vec<_> = self.data_replicas().into_iter().map(|(s, r)| (s, Arc::clone(&r.remembered))).collect();
        v
    }

    /// Bytes of the raft log on disk (0 when it is in memory only).
    pub fn log_bytes(&self) -> u64 {
        self.log.as_ref().map_or(0, |e| e.get_used_size() as u64)
    }

    /// Each local replica's shard, live items, checksum of its items and
    /// about the index they are as of (0: an entry applied during the walk;
    /// the index is published after each batch, so it may lag the items),
    /// for STATS with digests. Walks every store under its writer lock.
    pub fn digests(&self) -> Vec<(ShardId, u64, u64, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        self.data_replicas()
            .into_iter()
            .map(|(shard, r)| {
                let before = r.status.applied.load(Relaxed);
                let (items, digest) = r.store.digest();
                let applied = if r.status.applied.load(Relaxed) == before { before } else { 0 };
                (shard, items, digest, applied)
            })
            .collect()
    }

    /// The stores of this node's replicas (for STATS).
    pub fn stores(&self) -> Vec<Arc<Store>> {
        self.data_replicas().into_iter().map(|(_, r)| Arc::clone(&r.store)).collect()
    }

    /// Notes a client's one-sided reads of `shard`'s leader's region, for
    /// eviction's recency, if this node's replica leads it (and so owns
    /// the region read); anything else is dropped.
    pub fn note_accesses(&self, shard: ShardId, units: &[u64]) {
        if let Some(r) = self.data_replica(shard).filter(|r| r.status.is_leader()) {
            r.store.note_remote_accesses(units);
        }
    }

    /// Turns eviction on for every replica (`--evict lru`): recency
    /// stamps, before the node takes traffic. Only a leader chooses what
    /// goes, and every replica removes it as a log entry applies
    /// ([`start_eviction`]).
    pub fn enable_eviction(&self) {
        let table = self.replicas.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.evicts.store(true, Ordering::Release);
        drop(table);
        for (_, r) in self.data_replicas() {
            r.store.enable_replicated_eviction();
        }
    }

    /// One look at every shard this node leads: one whose live items (and
    /// index) come within a headroom of the admission bound logs the
    /// removal of its least recently used items, and waits for it to
    /// apply, at most EVICT_ROUND_TIMEOUT. How many items went (those of
    /// an earlier round's entry that applied late included).
    pub async fn evict_round(&self) -> u64 {
        // Shards side by side, each round bounded: one whose log is slow
        // (an apply stalled, a quorum lost) holds up the next round of
        // the others for at most EVICT_ROUND_TIMEOUT. Its removal may
        // still apply after the round gave up on it (it names items by
        // version, so it removes nothing written since); until it does,
        // that shard plans no other.
        let rounds = self.data_replicas().into_iter().map(|(_, r)| async move {
            if !r.status.is_leader() || !r.store.evicts() {
                return 0;
            }
            // The last round's entry, if it is still on its way.
            let mut late = 0;
            {
                let mut pending = crate::lock::lock(&r.evicting);
                if let Some((since, rx)) = pending.as_mut() {
                    match rx.try_recv() {
                        Err(oneshot::error::TryRecvError::Empty) if since.elapsed() < EVICT_ENTRY_PATIENCE => return 0,
                        Ok(Ok(Applied::Evicted { items })) => late = items,
                        _ => {}
                    }
                    *pending = None;
                }
            }
            // Below the admission bound by a headroom that takes any one
            // item (a write waits for no eviction): a 32nd of the region,
            // at least the largest value.
            let data = r.store.header().data_len;
            let headroom = (data / 32).max(EVICT_MIN_HEADROOM);
            let keep = (data / 100 * ADMIT_PERCENT).saturating_sub(headroom);
            // Writes waiting for room count up to one headroom more per
            // round: a burst larger than the shard is refused in time, not
            // paid for with every item the shard holds.
            let waiting = r.waiting.load(Ordering::Relaxed).min(headroom);
            let want = (r.store.live_bytes() + r.in_flight.load(Ordering::Relaxed) + waiting).saturating_sub(keep);
            if want == 0 {
                return late;
            }
            // Reads the victims' items: off the async workers.
            let store = Arc::clone(&r.store);
            let victims = tokio::task::spawn_blocking(move || store.plan_victims(EVICT_ENTRY_ITEMS, want))
                .await
                .unwrap_or_default();
            if victims.is_empty() {
                return late;
            }
            let since = Instant::now();
            let mut rx = r.thread.propose(encode_evict(victims, crate::clock::now_ms()));
            late + match tokio::time::timeout(EVICT_ROUND_TIMEOUT, &mut rx).await {
                Ok(Ok(Ok(Applied::Evicted { items }))) => items,
                Ok(_) => 0,
                Err(_) => {
                    *crate::lock::lock(&r.evicting) = Some((since, rx));
                    0
                }
            }
        });
        futures_util::future::join_all(rounds).await.into_iter().sum()
    }

    /// The stores of the shards this node leads now (what its memcached
    /// port's `stats` counts: every item once across the cluster).
    pub fn led_stores(&self) -> Vec<Arc<Store>> {
        self.data_replicas()
            .into_iter()
            .filter(|(_, r)| r.status.is_leader())
            .map(|(_, r)| Arc::clone(&r.store))
            .collect()
    }

    /// The compactors of this node's replicas (for STATS).
    pub fn compactors(&self) -> Vec<Arc<Compactor>> {
        self.data_replicas().into_iter().map(|(_, r)| Arc::clone(&r.compactor)).collect()
    }
}

/// What a shard answers when an entry applied as another kind of write
/// than was proposed: the log holds another command at its index.
fn unexpected(what: &str, a: Applied) -> ClusterError {
    ClusterError::Failed(format!("{what} applied as {a:?}"))
}

/// `--sync batch`: forces the node's log to disk every
/// [`BATCH_SYNC_INTERVAL`] until the node stops.
fn spawn_batch_sync(engine: Arc<raft_engine::Engine>, stop: watch::Receiver<bool>) -> std::io::Result<()> {
    std::thread::Builder::new().name("dmkvd-log-sync".into()).spawn(move || {
        while !*stop.borrow() {
            std::thread::sleep(BATCH_SYNC_INTERVAL);
            let started = std::time::Instant::now();
            let synced = engine.sync();
            crate::counters::FSYNC.observe(started.elapsed());
            if let Err(e) = synced {
                tracing::error!("raft log sync failed: {e}");
            }
        }
    })?;
    Ok(())
}

/// Log bytes past which old files are deleted: what the shards' logs may
/// hold together (twice the node's memory: each is cut at twice its
/// shard's), so the disk holds at most about twice that.
fn log_purge_threshold(memory: u64) -> u64 {
    memory.saturating_mul(2)
}

/// How often the log's files behind every shard's compaction point are
/// deleted. The engine only marks them when a log is cut; without this a
/// node's disk fills with entries no shard needs.
pub const LOG_PURGE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// Deletes the node's expired log files every [`LOG_PURGE_INTERVAL`],
/// off the shard threads (it may rewrite what little is left of a file),
/// until the node stops.
fn spawn_log_purge(engine: Arc<raft_engine::Engine>, stop: watch::Receiver<bool>) -> std::io::Result<()> {
    std::thread::Builder::new().name("dmkvd-log-purge".into()).spawn(move || {
        super::thread_priority::background();
        let mut last = std::time::Instant::now();
        while !*stop.borrow() {
            std::thread::sleep(std::time::Duration::from_millis(200));
            if last.elapsed() < LOG_PURGE_INTERVAL {
                continue;
            }
            last = std::time::Instant::now();
            if let Err(e) = engine.purge_expired_files() {
                tracing::warn!("purging the raft log's old files failed (tried again later): {e}");
            }
        }
    })?;
    Ok(())
}

/// Bytes proposed and not yet answered, released when the answer comes.
pub(super) struct InFlight<'a>(pub(super) &'a AtomicU64, pub(super) u64);

impl<'a> InFlight<'a> {
    /// Counts `bytes` in `counter` until dropped.
    fn add(counter: &'a AtomicU64, bytes: u64) -> InFlight<'a> {
        counter.fetch_add(bytes, Ordering::Relaxed);
        InFlight(counter, bytes)
    }
}

/// Counts a write of `bytes` as on its way in `r` if it fits the
/// admission bound with what is already on its way (the caller then owns
/// an [`InFlight`] for it); a compare-and-swap, so that two writes never
/// both take the last room.
pub(super) fn admit(r: &LocalReplica, bytes: u64) -> bool {
    let mut ahead = r.in_flight.load(Ordering::Relaxed);
    loop {
        if !r.store.live_within(ahead + bytes, ADMIT_PERCENT) {
            return false;
        }
        match r.in_flight.compare_exchange_weak(ahead, ahead + bytes, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(now) => ahead = now,
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// The file in a data directory that says the map has placed replicas
/// elsewhere than the cluster file ([`ClusterNode::note_replicas_moved`]).
pub const REPLICAS_MOVED: &str = "replicas-moved";

/// Writes `bytes` to `path` and forces it to disk (the directory too).
fn write_synced(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// What one-sided readers of `replicas` are served.
fn served_of<'a>(replicas: impl Iterator<Item = &'a Arc<LocalReplica>>) -> Vec<Served> {
    replicas.map(|r| Served { region: Arc::clone(r.store.region()), reg: Arc::clone(&r.reg) }).collect()
}

/// Starts `node`'s eviction (`--evict lru`): every [`EVICT_CHECK`], each
/// shard it leads evicts through the log as it must ([`ClusterNode::evict_round`]);
/// ends when `stop` turns true or the node is dropped.
pub fn start_eviction(node: &Arc<ClusterNode>, mut stop: watch::Receiver<bool>) {
    node.enable_eviction();
    let weak = Arc::downgrade(node);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(EVICT_CHECK) => {}
                _ = stop.changed() => return,
            }
            let Some(node) = weak.upgrade() else { return };
            node.evict_round().await;
        }
    });
}

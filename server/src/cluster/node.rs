//! A dmkvd node in a cluster: its shard replicas (each a raft group member
//! with its own region and store, driven by its own thread), its peer
//! queues, and its view of the cluster map. The RPC service asks it to
//! carry out writes (proposed to the key's shard) and linearizable reads.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dmkv_common::cluster::map::{ClusterMap, NodeId, ShardId, node_of, replica_id};
use dmkv_common::error::{Error as StoreError, check_key, check_value};
use dmkv_common::proto;
use raft::prelude::ConfState;
use tokio::sync::watch;

use super::apply::Remembered;
use super::apply::{Applied, encode_delete_with, encode_put_with};
use super::config::ClusterConfig;
use super::driver::{LeasePublisher, ReplicaStatus, ShardThread, TICK};
use super::leasing::LeaseKeeper;
use super::local::LocalShards;
use super::log::{BATCH_SYNC_INTERVAL, RaftLog, SyncPolicy};
use super::peer::{self as peer, Dialer, Peers};
use super::replica::{MemLog, Replica};
use super::shard::{JoinStep, ProposeError, RoomHook, ShardCore};
use super::snapshot::{self as snap, SnapshotSlot};
use crate::compact::Compactor;
use crate::region::Region;
use crate::registration::Registration;
use crate::store::{Location, Store};

/// Raft's election timeout in ticks of [`super::driver::TICK`]: 150 ms,
/// randomized by raft up to twice that. Heartbeats go every 30 ms.
pub const ELECTION_TICKS: usize = 15;
/// Most any node's clock rate is taken to differ from true time (ppm):
/// ten times what a crystal oscillator without NTP drifts.
pub const LEASE_DRIFT_PPM: u64 = 1000;
/// Taken off the lease for scheduling between reading a clock and acting.
pub const LEASE_MARGIN: Duration = Duration::from_millis(20);

/// The lease bounds of this node's shard leaders. The election timeout is
/// one tick short of raft's: a follower's count starts at a message but
/// ends on whole ticks.
pub fn lease_config() -> dmkv_common::cluster::lease::LeaseConfig {
    dmkv_common::cluster::lease::LeaseConfig {
        election_timeout_ns: (ELECTION_TICKS as u64 - 1) * TICK.as_nanos() as u64,
        max_drift_ppm: LEASE_DRIFT_PPM,
        max_skew_ns: 0,
        margin_ns: LEASE_MARGIN.as_nanos() as u64,
    }
}

/// A leader admits a write while live items, the index, the writes on
/// their way and this one take at most this share of the data area: below
/// the store's guarantee (`compact::GUARANTEED_PERCENT`), so that every
/// replica can apply what the leader admitted.
pub const ADMIT_PERCENT: u64 = crate::compact::GUARANTEED_PERCENT - 5;

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
    pub sync: super::log::SyncPolicy,
    /// When shard logs are compacted.
    pub log_limits: super::shard::LogLimits,
}

/// Why a cluster request was not carried out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterError {
    /// Ask `leader` (if known); this node's map has `map_version`.
    NotLeader {
        leader: Option<NodeId>,
        map_version: u64,
    },
    Busy,
    /// The write may or may not have taken effect.
    Uncertain,
    Store(StoreError),
    Failed(String),
}

/// One shard replica on this node.
struct LocalReplica {
    thread: ShardThread,
    store: Arc<Store>,
    /// Its own compactor: each replica's free space is its own.
    _compactor: Arc<Compactor>,
    /// Bytes of writes proposed here and not answered yet: admitted
    /// against the guarantee before they are applied.
    in_flight: AtomicU64,
    reg: Arc<Registration>,
    status: Arc<ReplicaStatus>,
}

/// This node's part of the cluster.
pub struct ClusterNode {
    pub id: NodeId,
    map: Mutex<ClusterMap>,
    replicas: HashMap<ShardId, LocalReplica>,
    sink: Arc<LocalShards>,
    /// The raft log's engine, with `--data-dir` (its size is a metric).
    log: Option<Arc<raft_engine::Engine>>,
}

/// What a node needs from the server's configuration.
pub struct NodeParams {
    /// Memory for all of this node's replicas together.
    pub memory: u64,
    pub compactor: crate::compact::Mode,
    pub grace: Duration,
    pub max_frame: usize,
    pub token: Option<dmkv_common::auth::Token>,
}

impl ClusterNode {
    /// Opens the log, creates a region and store per local replica, starts
    /// the shard threads and the peer senders (on the current runtime).
    pub fn start(setup: &ClusterSetup, p: NodeParams, stop: watch::Receiver<bool>) -> Result<ClusterNode, String> {
        let cfg = &setup.config;
        let me = cfg.node(setup.node_id)?.id;
        let map = cfg.initial_map().map_err(|e| e.to_string())?;
        let local: Vec<_> = map.shards().iter().filter(|s| s.replicas.contains(&me)).cloned().collect();
        let peers: Vec<_> = cfg.nodes.iter().filter(|n| n.id != me).map(|n| (n.id, n.peer)).collect();
        let dialer =
            Dialer { me, token: p.token, max_frame: p.max_frame, source: Dialer::source_of(cfg.node(me)?.peer) };
        let peers = Arc::new(Peers::start(dialer.clone(), peers, stop.clone()));
        let engine = match &setup.data_dir {
            Some(dir) => {
                let raft_dir = dir.join("raft");
                std::fs::create_dir_all(&raft_dir)
                    .map_err(|e| format!("cannot create data directory {}: {e}", raft_dir.display()))?;
                let engine = RaftLog::open_engine(&raft_dir.to_string_lossy()).map_err(|e| e.to_string())?;
                if setup.sync == SyncPolicy::Batch {
                    spawn_batch_sync(Arc::clone(&engine), stop.clone())
                        .map_err(|e| format!("cannot start the log syncer: {e}"))?;
                }
                Some(engine)
            }
            None => None,
        };
        // Whole pages: the region is mapped and read in words.
        let per_shard = (p.memory / local.len().max(1) as u64 / 4096 * 4096).max(MIN_SHARD_MEMORY);
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let mut replicas = HashMap::new();
        let mut sink = LocalShards::default();
        for sh in local {
            let region = Region::create(&format!("dmkv-shard-{}", sh.id), per_shard as usize)
                .map_err(|e| format!("shard {}: cannot create its region: {e}", sh.id))?;
            let epoch = rand::random::<u32>() as u64 + 1;
            let buckets = per_shard / 4096;
            // Every replica of a shard hashes keys alike, so their indexes
            // split alike and a command that fits one fits all.
            let store = Arc::new(
                Store::format(Arc::new(region), buckets, shard_seed(cfg, sh.id), epoch, p.grace)
                    .map_err(|e| format!("shard {}: {e}", sh.id))?,
            );
            let compactor = Arc::new(
                Compactor::spawn(Arc::clone(&store), p.compactor)
                    .map_err(|e| format!("shard {}: cannot start its compactor: {e}", sh.id))?,
            );
            let room = || -> RoomHook {
                let c = Arc::clone(&compactor);
                Box::new(move |units| c.after_out_of_memory(units))
            };
            let reg = Arc::new(Registration::new(*store.header()));
            let publisher =
                || LeasePublisher::new(Arc::clone(store.region()), Arc::clone(&reg), store.header().hash_seed);
            let keeper = || LeaseKeeper::new(lease_config()).map_err(|e| e.to_string());
            // The first members: every replica node's first incarnation.
            let conf =
                ConfState { voters: sh.replicas.iter().map(|&n| replica_id(n, 1)).collect(), ..Default::default() };
            let status = Arc::new(ReplicaStatus::for_shard(sh.id));
            let send = {
                let (peers, shard) = (Arc::clone(&peers), sh.id);
                move |msgs: Vec<raft::prelude::Message>| {
                    for m in msgs {
                        peers.send(shard, m);
                    }
                }
            };
            let name = format!("shard-{}", sh.id);
            let slot = Arc::new(SnapshotSlot::default());
            let first = replica_id(me, 1);
            // A replica with no state starts as a member-to-be under a new
            // incarnation; the membership task makes it a first member or
            // has the leader add it (see `membership`).
            let fresh = replica_id(me, rand::random_range(2..=u32::MAX));
            let raft_err = |e: raft::Error| format!("shard {}: raft: {e}", sh.id);
            let (thread, joining) = match &engine {
                Some(engine) => {
                    let log = RaftLog::new(Arc::clone(engine), u64::from(sh.id))
                        .with_sync(setup.sync == SyncPolicy::Always)
                        .with_snapshots(Arc::clone(&slot));
                    if raft::Storage::initial_state(&log).map_err(|e| e.to_string())?.conf_state.voters.is_empty() {
                        log.set_conf_state(&conf).map_err(|e| e.to_string())?;
                    }
                    let known = log.replica_id().map_err(|e| e.to_string())?;
                    let (applied, remembered) = recover(&log, &store).map_err(|e| format!("shard {}: {e}", sh.id))?;
                    let replica =
                        Replica::new_at(known.unwrap_or(fresh), log.clone(), ELECTION_TICKS, applied, &logger)
                            .map_err(raft_err)?;
                    let mut core = ShardCore::new(replica, Arc::clone(&store))
                        .with_leases(keeper()?, ELECTION_TICKS as u64)
                        .with_room(room())
                        .with_snapshots(setup.log_limits, slot)
                        .restored(applied, remembered);
                    let (fresh_log, fresh_logger, fresh_conf) = (log.clone(), logger.clone(), conf.clone());
                    core = core.with_fresh(Box::new(move |id| {
                        fresh_log
                            .reset(id, &fresh_conf)
                            .map_err(|e| raft::Error::Store(raft::StorageError::Other(e.into())))?;
                        Replica::new(id, fresh_log.clone(), ELECTION_TICKS, &fresh_logger)
                    }));
                    if known.is_none() {
                        let (log, logger) = (log.clone(), logger.clone());
                        core = core.with_first_member(Box::new(move || {
                            log.set_replica_id(first)
                                .map_err(|e| raft::Error::Store(raft::StorageError::Other(e.into())))?;
                            Replica::new(first, log, ELECTION_TICKS, &logger)
                        }));
                    }
                    let joining = known.is_none().then(|| {
                        let log = log.clone();
                        Box::new(move |id| log.set_replica_id(id).map_err(|e| e.to_string())) as RecordId
                    });
                    (ShardThread::spawn(name, core, Arc::clone(&status), Some(publisher()), send), joining)
                }
                None => {
                    let replica =
                        Replica::new(fresh, MemLog::new(conf.clone(), Arc::clone(&slot)), ELECTION_TICKS, &logger)
                            .map_err(raft_err)?;
                    let (logger, first_slot) = (logger.clone(), Arc::clone(&slot));
                    let (fresh_logger, fresh_slot, fresh_conf) = (logger.clone(), Arc::clone(&slot), conf.clone());
                    let core = ShardCore::new(replica, Arc::clone(&store))
                        .with_fresh(Box::new(move |id| {
                            let log = MemLog::new(fresh_conf.clone(), Arc::clone(&fresh_slot));
                            Replica::new(id, log, ELECTION_TICKS, &fresh_logger)
                        }))
                        .with_leases(keeper()?, ELECTION_TICKS as u64)
                        .with_room(room())
                        .with_snapshots(setup.log_limits, slot)
                        .with_first_member(Box::new(move || {
                            Replica::new(first, MemLog::new(conf, first_slot), ELECTION_TICKS, &logger)
                        }));
                    let joining = Some(Box::new(|_| Ok(())) as RecordId);
                    (ShardThread::spawn(name, core, Arc::clone(&status), Some(publisher()), send), joining)
                }
            };
            let thread = thread.map_err(|e| format!("shard {}: cannot start its thread: {e}", sh.id))?;
            let shard_peers: Vec<_> = sh
                .replicas
                .iter()
                .filter(|&&n| n != me)
                .filter_map(|&n| cfg.nodes.iter().find(|e| e.id == n).map(|e| (n, e.peer)))
                .collect();
            tokio::spawn(membership(Membership {
                shard: sh.id,
                dialer: dialer.clone(),
                peers: shard_peers,
                status: Arc::clone(&status),
                undecided: joining,
                bootstrap: thread.bootstrapper(),
                stop: stop.clone(),
            }));
            sink.insert(sh.id, Box::new(thread.inbox()));
            replicas.insert(
                sh.id,
                LocalReplica { thread, store, _compactor: compactor, in_flight: AtomicU64::new(0), reg, status },
            );
        }
        Ok(ClusterNode { id: me, map: Mutex::new(map), replicas, sink: Arc::new(sink), log: engine })
    }

    /// Where peers' raft messages go.
    pub fn sink(&self) -> Arc<LocalShards> {
        Arc::clone(&self.sink)
    }

    /// The map with what this node's replicas know of their leaders.
    pub fn map(&self) -> ClusterMap {
        let mut map = crate::lock::lock(&self.map);
        for (&shard, r) in &self.replicas {
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
            .replicas
            .iter()
            .map(|(&shard, r)| {
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
                }
            })
            .collect();
        local.sort_by_key(|r| r.shard);
        reply.local = local;
        reply
    }

    /// The local replica of `key`'s shard, or where to go instead.
    fn replica_of(&self, key: &[u8]) -> Result<&LocalReplica, ClusterError> {
        let map = crate::lock::lock(&self.map);
        let shard = map.shard_of(key);
        match self.replicas.get(&shard.id) {
            Some(r) => Ok(r),
            None => Err(ClusterError::NotLeader { leader: shard.leader, map_version: map.version }),
        }
    }

    fn map_version(&self) -> u64 {
        crate::lock::lock(&self.map).version
    }

    fn cluster_error(&self, e: ProposeError) -> ClusterError {
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
        let r = self.replica_of(key)?;
        // Admitted only while it fits every replica's guarantee with what
        // is already on its way (a DELETE needs no room but is counted
        // alike: it is small).
        let bytes = (data.len() + dmkv_common::layout::ITEM_HEADER_LEN) as u64;
        let ahead = r.in_flight.fetch_add(bytes, Ordering::Relaxed);
        let _done = InFlight(&r.in_flight, bytes);
        if !r.store.live_within(ahead + bytes, ADMIT_PERCENT) {
            return Err(ClusterError::Store(StoreError::OutOfMemory));
        }
        match r.thread.propose(data).await {
            Ok(Ok(a)) => Ok(a),
            Ok(Err(e)) => Err(self.cluster_error(e)),
            Err(_) => Err(ClusterError::Failed("the shard's replica stopped".into())),
        }
    }

    /// A PUT, answered once committed and applied here.
    /// `id`: the client's write id, so that a PUT sent again applies once.
    pub async fn put(&self, key: &[u8], value: &[u8], id: Option<proto::WriteId>) -> Result<u64, ClusterError> {
        check_key(key).and_then(|()| check_value(value)).map_err(ClusterError::Store)?;
        match self.propose(key, encode_put_with(key, value, id)).await? {
            Applied::Put { version } => Ok(version),
            other => Err(ClusterError::Failed(format!("a PUT applied as {other:?}"))),
        }
    }

    /// A DELETE, answered once committed and applied here.
    pub async fn delete(&self, key: &[u8], id: Option<proto::WriteId>) -> Result<bool, ClusterError> {
        check_key(key).map_err(ClusterError::Store)?;
        match self.propose(key, encode_delete_with(key, id)).await? {
            Applied::Delete { existed } => Ok(existed),
            other => Err(ClusterError::Failed(format!("a DELETE applied as {other:?}"))),
        }
    }

    /// The store of `key`'s shard, once a read of it is linearizable.
    async fn readable(&self, key: &[u8]) -> Result<&Store, ClusterError> {
        let r = self.replica_of(key)?;
        match r.thread.read().await {
            Ok(Ok(())) => Ok(&r.store),
            Ok(Err(e)) => Err(self.cluster_error(e)),
            Err(_) => Err(ClusterError::Failed("the shard's replica stopped".into())),
        }
    }

    /// A linearizable GET on the shard's leader.
    pub async fn get(&self, key: &[u8]) -> Result<Option<(Bytes, u64, Location)>, ClusterError> {
        self.readable(key).await?.get_located(key).map_err(ClusterError::Store)
    }

    /// Linearizable GETs of many keys: one read permission per shard
    /// (a quorum round, or the lease), then every key of that shard.
    pub async fn multi_get(&self, keys: &[Bytes]) -> Result<Vec<Option<(Bytes, u64, Location)>>, ClusterError> {
        let mut permitted = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let shard = crate::lock::lock(&self.map).shard_of(k).id;
            let store = if permitted.insert(shard) { self.readable(k).await? } else { &self.replica_of(k)?.store };
            out.push(store.get_located(k).map_err(ClusterError::Store)?);
        }
        Ok(out)
    }

    /// A new replica of `shard` (raft id `replica`) asks to be made a
    /// member: the next step, if this node's replica leads.
    pub async fn join_shard(&self, shard: ShardId, replica: u64) -> Result<JoinStep, ClusterError> {
        let Some(r) = self.replicas.get(&shard) else {
            return Err(ClusterError::Failed(format!("shard {shard} has no replica on node {}", self.id)));
        };
        // Only the nodes the cluster file places the shard on hold it.
        let placed = crate::lock::lock(&self.map)
            .shards()
            .iter()
            .any(|s| s.id == shard && s.replicas.contains(&node_of(replica)));
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
        let Some(r) = self.replicas.get(&shard) else {
            return Err(ClusterError::Failed(format!("shard {shard} has no replica on node {}", self.id)));
        };
        let id = replica_id(self.id, rand::random_range(2..=u32::MAX));
        match r.thread.replace(id).await {
            Ok(Ok(())) => Ok(id),
            Ok(Err(e)) => Err(ClusterError::Failed(e)),
            Err(_) => Err(ClusterError::Failed("the shard's replica stopped".into())),
        }
    }

    /// This node's shard replicas' regions, for one-sided readers: (shard,
    /// store, registration), by shard.
    pub fn regions(&self) -> Vec<(ShardId, Arc<Store>, Arc<Registration>)> {
        let mut v: Vec<_> = self.replicas.iter().map(|(&s, r)| (s, Arc::clone(&r.store), Arc::clone(&r.reg))).collect();
        v.sort_by_key(|r| r.0);
        v
    }

    /// Counters of this node's replicas, summed (for STATS).
    pub fn replica_counters(&self) -> [(&'static str, u64); 4] {
        use std::sync::atomic::Ordering::Relaxed;
        let sum =
            |f: fn(&ReplicaStatus) -> &AtomicU64| self.replicas.values().map(|r| f(&r.status).load(Relaxed)).sum();
        [
            ("shard_lease_reads", sum(|s| &s.lease_reads)),
            ("shard_apply_stalls", sum(|s| &s.apply_stalls)),
            ("shard_snapshots_built", sum(|s| &s.snapshots_built)),
            ("shard_snapshots_installed", sum(|s| &s.snapshots_installed)),
        ]
    }

    /// Each local replica's status, by shard (for metrics and readiness).
    pub fn statuses(&self) -> Vec<(ShardId, Arc<ReplicaStatus>)> {
        let mut v: Vec<_> = self.replicas.iter().map(|(&s, r)| (s, Arc::clone(&r.status))).collect();
        v.sort_by_key(|r| r.0);
        v
    }

    /// Bytes of the raft log on disk (0 when it is in memory only).
    pub fn log_bytes(&self) -> u64 {
        self.log.as_ref().map_or(0, |e| e.get_used_size() as u64)
    }

    /// The stores of this node's replicas (for STATS).
    pub fn stores(&self) -> impl Iterator<Item = &Arc<Store>> {
        self.replicas.values().map(|r| &r.store)
    }
}

/// Records the raft id a replica joins under (durable logs keep it).
type RecordId = Box<dyn Fn(u64) -> Result<(), String> + Send + Sync>;

/// How often the membership task looks again.
pub const MEMBERSHIP_INTERVAL: Duration = Duration::from_millis(300);
/// How often a replica with no state asks its peers while it cannot tell
/// a first start from a restart: often, so that nodes starting together
/// all see each other before any has a term (a node that sees a term
/// first joins as a new member, which is safe but slower).
pub const UNDECIDED_INTERVAL: Duration = Duration::from_millis(20);

/// What a shard replica's membership task works with.
struct Membership {
    shard: ShardId,
    dialer: Dialer,
    /// The other nodes holding the shard: (node, peer address).
    peers: Vec<(NodeId, std::net::SocketAddr)>,
    status: Arc<ReplicaStatus>,
    /// A replica that started with no state, and how to record the id it
    /// joins under; `None`: it knows who it is.
    undecided: Option<RecordId>,
    bootstrap: Box<dyn Fn() + Send + Sync>,
    stop: watch::Receiver<bool>,
}

/// Makes a replica a member of its shard and keeps it one. A replica that
/// started with no state cannot tell a first start from a restart, so it
/// asks the shard's other nodes: if every one answers and none ever had a
/// raft term, the shard never ran and the replica becomes one of its first
/// members (incarnation 1); if any has a term, the shard runs without
/// this node's forgotten replica, and the replica joins as a new member
/// (its own incarnation, so it never votes or acknowledges as the old one
/// did). A joining replica asks the peers until the leader made it a voter
/// and removed its node's older replicas.
async fn membership(mut m: Membership) {
    let mut warned = false;
    loop {
        if *m.stop.borrow() {
            return;
        }
        if let Some(record) = &m.undecided {
            let mut terms = Vec::new();
            for &(_, addr) in &m.peers {
                let term = match peer::ask(&m.dialer, addr, proto::request::Op::GetMap(proto::GetMap {})).await {
                    Ok(proto::response::Result::Map(r)) => r.local.iter().find(|l| l.shard == m.shard).map(|l| l.term),
                    _ => None,
                };
                terms.push(term);
            }
            let id = m.status.id.load(Ordering::Relaxed);
            if terms.iter().any(|t| t.is_some_and(|t| t > 0)) {
                match record(id) {
                    Ok(()) => {
                        tracing::info!(shard = m.shard, id, "the shard runs: joining it as a new replica");
                        m.undecided = None;
                    }
                    Err(e) => tracing::error!(shard = m.shard, "cannot record the replica's id: {e}"),
                }
            } else if terms.iter().all(|t| *t == Some(0)) {
                (m.bootstrap)();
                m.undecided = None;
            } else if !warned {
                tracing::info!(shard = m.shard, "waiting for the shard's other nodes to tell whether it ran before");
                warned = true;
            }
        } else if !m.status.joined() && m.status.id.load(Ordering::Relaxed) != 0 {
            let join = proto::JoinShard { shard: m.shard, replica_id: m.status.id.load(Ordering::Relaxed) };
            for &(_, addr) in &m.peers {
                if let Ok(proto::response::Result::JoinShard(r)) =
                    peer::ask(&m.dialer, addr, proto::request::Op::JoinShard(join)).await
                {
                    tracing::info!(shard = m.shard, step = r.step, "joining the shard");
                    break;
                }
            }
        }
        let wait = if m.undecided.is_some() { UNDECIDED_INTERVAL } else { MEMBERSHIP_INTERVAL };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = m.stop.changed() => return,
        }
    }
}

/// Restores `store` from the shard's saved snapshot, if it has one;
/// returns the index it is at and the writes it remembers. A snapshot
/// saved while the log was being replaced by it (a crash in between) is
/// installed in the log now.
fn recover(log: &RaftLog, store: &Store) -> Result<(u64, Remembered), String> {
    let Some(bytes) = log.load_snapshot().map_err(|e| e.to_string())? else { return Ok((0, Remembered::default())) };
    let file = log.snapshot_file();
    let d = snap::decode(&bytes).map_err(|e| format!("{}: {e}", file.display()))?;
    let remembered = snap::restore(store, &d).map_err(|e| format!("{}: {e}", file.display()))?;
    let commit = raft::Storage::initial_state(log).map_err(|e| e.to_string())?.hard_state.commit;
    if d.at.index > commit {
        log.finish_install(d.at).map_err(|e| e.to_string())?;
    }
    Ok((d.at.index, remembered))
}

/// `--sync batch`: forces the node's log to disk every
/// [`BATCH_SYNC_INTERVAL`] until the node stops.
fn spawn_batch_sync(engine: Arc<raft_engine::Engine>, stop: watch::Receiver<bool>) -> std::io::Result<()> {
    std::thread::Builder::new().name("dmkvd-log-sync".into()).spawn(move || {
        while !*stop.borrow() {
            std::thread::sleep(BATCH_SYNC_INTERVAL);
            let started = std::time::Instant::now();
            let synced = engine.sync();
            crate::metrics::FSYNC.observe(started.elapsed());
            if let Err(e) = synced {
                tracing::error!("raft log sync failed: {e}");
            }
        }
    })?;
    Ok(())
}

/// Bytes proposed and not yet answered, released when the answer comes.
struct InFlight<'a>(&'a AtomicU64, u64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// The hash seed of `shard`'s stores: the same on every replica (from the
/// cluster file every node shares), different per shard.
fn shard_seed(cfg: &ClusterConfig, shard: ShardId) -> u64 {
    let nodes: Vec<String> = cfg.nodes.iter().map(|n| format!("{}={}/{}", n.id, n.rpc, n.peer)).collect();
    xxhash_rust::xxh3::xxh3_64(format!("dmkv shard seed {shard} {}", nodes.join(",")).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::snapshot::{Point, encode};
    use raft::prelude::{Snapshot, SnapshotMetadata};

    fn store() -> Store {
        Store::format(Arc::new(Region::create("recover", 4 << 20).unwrap()), 64, 1, 1, Duration::ZERO).unwrap()
    }

    #[test]
    fn a_saved_snapshot_restores_and_a_damaged_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let engine = RaftLog::open_engine(dir.path().join("raft").to_str().unwrap()).unwrap();
        let log = RaftLog::new(engine, 4);
        assert_eq!(recover(&log, &store()).unwrap().0, 0, "nothing saved: from the start");
        let from = store();
        from.put(b"k", b"v").unwrap();
        let at = Point { index: 42, term: 3 };
        let mut sn = Snapshot { data: encode(&from, &Remembered::default(), at).into(), ..Default::default() };
        sn.set_metadata(SnapshotMetadata { index: 42, term: 3, ..Default::default() });
        // Taken from a leader: saved, and the log starts after it.
        crate::cluster::replica::LogStore::persist(&log, &[], None, Some(&sn)).unwrap();
        let to = store();
        assert_eq!(recover(&log, &to).unwrap().0, 42);
        assert_eq!(to.get(b"k").unwrap().unwrap().0, bytes::Bytes::from_static(b"v"));
        assert_eq!(raft::Storage::first_index(&log).unwrap(), 43);
        let mut bytes = std::fs::read(log.snapshot_file()).unwrap();
        let n = bytes.len();
        bytes[n / 2] ^= 0xff;
        std::fs::write(log.snapshot_file(), bytes).unwrap();
        let err = recover(&log, &store()).unwrap_err();
        assert!(err.contains("shard-4.snap") && err.contains("checksum"), "{err}");
    }
}

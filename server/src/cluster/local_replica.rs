//! A shard replica on this node, and its opening: its region and store,
//! its raft log (on disk or in memory), its thread, and the task that
//! makes it a member of its shard. At the node's start for the shards the cluster
//! file places here; while it runs, for the shards the map places here
//! later (`reconcile.rs`; docs/elasticity.md, "Adding and removing
//! nodes").

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dmkv_common::cluster::map::{ClusterMap, META_SHARD, NodeId, ShardId, ShardInfo, replica_id};
use dmkv_common::proto;
use raft::prelude::ConfState;
use tokio::sync::watch;

use super::apply::{Remembered, RememberedStats};
use super::config::ClusterConfig;
use super::desk::Desk;
use super::driver::{LeasePublisher, ReplicaStatus, Restart, ShardThread, TICK};
use super::leasing::LeaseKeeper;
use super::local::LocalShards;
use super::log::RaftLog;
use super::peer::{self as peer, Dialer, Peers};
use super::replica::{MemLog, Replica};
use super::shard::{RoomHook, ShardCore};
use super::snapshot::{self as snap, SnapshotSlot};
use super::sync_policy::SyncPolicy;
use super::transfer::Link;
use crate::compact::Compactor;
use crate::region::Region;
use crate::registration::Registration;
use crate::store::Store;

/// Raft's election timeout in ticks of [`super::driver::TICK`]: 150 ms,
/// randomized by raft up to twice that. Heartbeats go every 30 ms.
pub const ELECTION_TICKS: usize = 15;
/// Most any node's clock rate is taken to differ from true time (ppm).
pub const LEASE_DRIFT_PPM: u64 = dmkv_common::cluster::lease::MAX_DRIFT_PPM;
/// Taken off the lease for scheduling between reading a clock and acting.
pub const LEASE_MARGIN: Duration = Duration::from_millis(20);

/// The lease bounds of this node's shard leaders. The election timeout is
/// one tick short of raft's: a follower's count starts at a message but
/// ends on whole ticks.
pub fn lease_config() -> dmkv_common::cluster::lease::LeaseConfig {
    dmkv_common::cluster::lease::LeaseConfig {
        election_timeout_ns: (ELECTION_TICKS as u64 - 1) * TICK.as_nanos() as u64,
        max_drift_ppm: LEASE_DRIFT_PPM,
        margin_ns: LEASE_MARGIN.as_nanos() as u64,
    }
}

/// One shard replica on this node.
pub(super) struct LocalReplica {
    pub(super) thread: ShardThread,
    pub(super) store: Arc<Store>,
    /// Its own compactor: each replica's free space is its own.
    pub(super) compactor: Arc<Compactor>,
    /// Bytes of writes proposed here and not answered yet: admitted
    /// against the guarantee before they are applied.
    pub(super) in_flight: AtomicU64,
    /// Bytes of writes waiting for eviction to make room for them.
    pub(super) waiting: AtomicU64,
    /// An eviction entry whose round stopped waiting for it, and when it
    /// was proposed: no other is planned while it may still apply (it
    /// would remove the same want again).
    pub(super) evicting: Mutex<Option<(Instant, EvictAnswer)>>,
    pub(super) reg: Arc<Registration>,
    pub(super) status: Arc<ReplicaStatus>,
    pub(super) remembered: Arc<RememberedStats>,
    /// The partitions it owns, as its thread applied them.
    pub(super) placement: Arc<super::placement::SharedPlacement>,
    /// Its snapshots (the receiver hands them chunks).
    pub(super) desk: Arc<Desk>,
    /// Set when the replica closes: its membership task ends.
    pub(super) closed: watch::Sender<bool>,
    /// Its region's registration for RDMA reads, for the node's life: a
    /// fence does not rotate it (readers of a fenced region find its lease
    /// block cleared, in the same batch as their data: docs/replication.md).
    #[cfg(feature = "rdma")]
    pub(super) rdma: Option<crate::rdma::RdmaRegion>,
}

impl LocalReplica {
    /// The version of its placement's last change applied.
    pub(super) fn placement_version(&self) -> u64 {
        self.placement.version()
    }

    pub(super) fn rdma_rkey(&self) -> u32 {
        #[cfg(feature = "rdma")]
        if let Some(Ok(r)) = self.rdma.as_ref().map(|r| r.remote()) {
            return r.rkey;
        }
        0
    }
}

/// The answer to an eviction entry.
pub(super) type EvictAnswer = tokio::sync::oneshot::Receiver<Result<super::apply::Applied, super::shard::ProposeError>>;

/// What opening a replica needs from the node, kept for its life.
pub(super) struct Opener {
    pub(super) me: NodeId,
    pub(super) cfg: ClusterConfig,
    /// The cluster file's map: every shard's first members and placement.
    pub(super) first_map: ClusterMap,
    pub(super) compactor: crate::compact::Mode,
    pub(super) grace: Duration,
    pub(super) engine: Option<Arc<raft_engine::Engine>>,
    pub(super) data_dir: Option<PathBuf>,
    pub(super) sync: SyncPolicy,
    pub(super) log_limits: super::shard::LogLimits,
    pub(super) dialer: Dialer,
    pub(super) peers: Arc<Peers>,
    pub(super) sink: Arc<LocalShards>,
    pub(super) map_wake: Arc<tokio::sync::Notify>,
    /// The node's map (its placement as the metadata group last told it).
    pub(super) map: Arc<Mutex<ClusterMap>>,
    /// Why the node's log is not to be trusted (its last run may have lost
    /// what it acknowledged): every replica opened with a log from then,
    /// at the start or later, rejoins as a new incarnation.
    pub(super) distrust: Option<String>,
    pub(super) logger: slog::Logger,
    pub(super) stop: watch::Receiver<bool>,
    #[cfg(feature = "rdma")]
    pub(super) rdma: Option<crate::rdma::RdmaUse>,
}

impl Opener {
    /// Opens this node's replica of `sh` (its first members: `sh.replicas`)
    /// with a region of `per_shard` bytes, whose shard the nodes `members`
    /// hold now. `distrust`: why the node's log is not to be trusted.
    /// `may_found`: a replica with no state may turn out to be one of a
    /// new shard's first members (opened as the node starts, the map never
    /// having placed replicas elsewhere); otherwise it only ever joins a
    /// shard that runs.
    pub(super) fn open(
        &self,
        sh: &ShardInfo,
        members: &[NodeId],
        per_shard: u64,
        distrust: Option<String>,
        may_found: bool,
    ) -> Result<LocalReplica, String> {
        let distrust = &distrust;
        let region = Region::create(&format!("dmkv-shard-{}", sh.id), per_shard as usize)
            .map_err(|e| format!("shard {}: cannot create its region: {e}", sh.id))?;
        let epoch = rand::random::<u32>() as u64 + 1;
        let buckets = per_shard / 4096;
        // Every replica of a shard hashes keys alike, so their indexes
        // split alike and a command that fits one fits all.
        let store = Arc::new(
            Store::format(Arc::new(region), buckets, shard_seed(&self.cfg, sh.id), epoch, self.grace)
                .map_err(|e| format!("shard {}: {e}", sh.id))?,
        );
        let compactor = Arc::new(
            Compactor::spawn(Arc::clone(&store), self.compactor)
                .map_err(|e| format!("shard {}: cannot start its compactor: {e}", sh.id))?,
        );
        // Before the shard's thread starts: a registration that must
        // work (a named device) fails the start with nothing running.
        #[cfg(feature = "rdma")]
        let rdma = match &self.rdma {
            Some(rdma) => rdma.register(Arc::clone(store.region()), &format!("shard {}'s region", sh.id))?,
            None => None,
        };
        let reg = Arc::new(Registration::new(*store.header()));
        let publisher = LeasePublisher::new(Arc::clone(store.region()), Arc::clone(&reg), store.header().hash_seed);
        // The first members: every replica node's first incarnation.
        let conf = ConfState { voters: sh.replicas.iter().map(|&n| replica_id(n, 1)).collect(), ..Default::default() };
        let status = Arc::new(ReplicaStatus::for_shard(sh.id));
        let remembered = Arc::new(RememberedStats::default());
        let first_placement = match sh.id {
            META_SHARD => super::placement::Placement::all(),
            id => super::placement::Placement::of_map(&self.first_map, id),
        };
        let placement =
            Arc::new(super::placement::SharedPlacement::new(&first_placement).with_wake(Arc::clone(&self.map_wake)));
        let send = {
            let (peers, shard) = (Arc::clone(&self.peers), sh.id);
            move |msgs: Vec<raft::prelude::Message>| {
                for m in msgs {
                    peers.send(shard, m);
                }
            }
        };
        let name = format!("shard-{}", sh.id);
        // A received snapshot holds at most the region's items, met at
        // most twice (see `store::view`), and its framing.
        let max_snapshot = 2 * per_shard + super::desk::RECEIVE_SLACK;
        let desk = Arc::new(match &self.engine {
            Some(_) => {
                let dir = self.data_dir.as_ref().expect("a log engine comes with a data dir");
                let snaps = PathBuf::from(format!("{}-snapshots", dir.join("raft").display()));
                Desk::durable(&snaps, sh.id, max_snapshot).map_err(|e| format!("shard {}: {e}", sh.id))?
            }
            None => Desk::memory(sh.id, max_snapshot),
        });
        // An in-memory log is cut by bytes too, tied to the memory it
        // takes beside the region; one on disk by the time it replays.
        let max_log_bytes =
            if self.engine.is_some() { 2 * per_shard } else { per_shard / super::shard::LOG_MEMORY_SHARE };
        let parts = Arc::new(ShardParts {
            shard: sh.id,
            me: self.me,
            store: Arc::clone(&store),
            slot: Arc::new(SnapshotSlot::default()),
            desk: Arc::clone(&desk),
            conf,
            limits: super::shard::LogLimits { max_bytes: max_log_bytes, ..self.log_limits },
            replicas: members.len(),
            compactor: Arc::clone(&compactor),
            logger: self.logger.clone(),
            distrust: Mutex::new(distrust.clone().filter(|_| members.len() > 1)),
            remembered: Arc::clone(&remembered),
            placement: first_placement.clone(),
            shared_placement: Arc::clone(&placement),
        });
        if let (Some(why), 1) = (&distrust, members.len()) {
            tracing::error!(
                shard = sh.id,
                "{why}; the shard has no other replica to catch up from, so it goes on with what the log holds"
            );
        }
        let (thread, joining) = match &self.engine {
            Some(engine) => {
                let log = RaftLog::new(Arc::clone(engine), u64::from(sh.id))
                    .with_sync(self.sync == SyncPolicy::Always)
                    .with_snapshots(Arc::clone(&parts.slot))
                    .with_desk(Arc::clone(&desk));
                if raft::Storage::initial_state(&log).map_err(|e| e.to_string())?.conf_state.voters.is_empty() {
                    log.set_conf_state(&parts.conf).map_err(|e| e.to_string())?;
                }
                let (core, joining) = parts.durable(&log)?;
                let again = Arc::clone(&parts);
                // After a failure: the store again from the snapshot
                // and the log, as at a start.
                let restart: Restart<RaftLog> = Box::new(move |_| {
                    log.probe().map_err(|e| format!("the disk takes no writes yet: {e}"))?;
                    again.store.clear(1).map_err(|e| format!("emptying the store: {e}"))?;
                    again.durable(&log).map(|(core, _)| core)
                });
                (ShardThread::spawn(name, core, restart, Arc::clone(&status), Some(publisher), send), joining)
            }
            None => {
                // A replica with no state starts as a member-to-be
                // under a new incarnation; the membership task makes it
                // a first member or has the leader add it (see
                // `membership`).
                let core = parts.memory(fresh_incarnation(self.me), may_found)?;
                let again = Arc::clone(&parts);
                // After a failure its memory is not to be trusted: it
                // joins again as a new incarnation, as after a restart.
                let restart: Restart<MemLog> = Box::new(move |_| {
                    again.store.clear(1).map_err(|e| format!("emptying the store: {e}"))?;
                    again.memory(fresh_incarnation(again.me), false)
                });
                let joining = Some(Box::new(|_| Ok(())) as RecordId);
                (ShardThread::spawn(name, core, restart, Arc::clone(&status), Some(publisher), send), joining)
            }
        };
        let thread = thread.map_err(|e| format!("shard {}: cannot start its thread: {e}", sh.id))?;
        // Asked each round: the shard's nodes in the map as this node has
        // it now (the leader may be on a node placed since), and its first
        // members (the cluster file's, before the map is heard from).
        let peers: PeerSource = {
            let (map, shard, me, first) = (Arc::clone(&self.map), sh.id, self.me, sh.replicas.clone());
            let addrs: Vec<(NodeId, std::net::SocketAddr)> = self.cfg.nodes.iter().map(|e| (e.id, e.peer)).collect();
            Box::new(move || {
                let mut nodes = crate::lock::lock(&map)
                    .shards()
                    .get(shard as usize)
                    .map(|s| s.replicas.clone())
                    .unwrap_or_default();
                nodes.extend(first.iter().copied());
                let mut seen = std::collections::BTreeSet::new();
                nodes
                    .into_iter()
                    .filter(|&n| n != me && seen.insert(n))
                    .filter_map(|n| addrs.iter().find(|a| a.0 == n).copied())
                    .collect()
            })
        };
        let (closed, closed_rx) = watch::channel(false);
        tokio::spawn(membership(Membership {
            shard: sh.id,
            dialer: self.dialer.clone(),
            peers,
            status: Arc::clone(&status),
            undecided: joining,
            bootstrap: thread.bootstrapper(),
            stop: self.stop.clone(),
            closed: closed_rx,
            may_bootstrap: may_found,
        }));
        self.sink.insert(sh.id, Box::new(thread.inbox()));
        self.peers.snapshots.register(sh.id, Link { desk: Arc::clone(&desk), failed: thread.snapshot_failer() });
        let replica = LocalReplica {
            thread,
            store,
            compactor,
            in_flight: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            evicting: Mutex::new(None),
            reg,
            status,
            remembered,
            placement,
            desk,
            closed,
            #[cfg(feature = "rdma")]
            rdma,
        };
        Ok(replica)
    }
}

/// Records the raft id a replica joins under (durable logs keep it).
type RecordId = Box<dyn Fn(u64) -> Result<(), String> + Send + Sync>;

/// A raft id for this node's replica under a new random incarnation.
fn fresh_incarnation(me: NodeId) -> u64 {
    replica_id(me, rand::random_range(2..=u32::MAX))
}

/// What one shard replica is built from: at the node's start, and again
/// by its thread after it failed.
struct ShardParts {
    shard: ShardId,
    me: NodeId,
    store: Arc<Store>,
    slot: Arc<SnapshotSlot>,
    desk: Arc<Desk>,
    /// The shard's first members.
    conf: ConfState,
    limits: super::shard::LogLimits,
    /// Replicas the shard has.
    replicas: usize,
    compactor: Arc<Compactor>,
    logger: slog::Logger,
    /// Why the log is not to be trusted, until the replica has dropped it
    /// (taken at the first build).
    distrust: Mutex<Option<String>>,
    /// Counts of the replica's remembered write ids (every build shares
    /// them, so the metrics follow the replica across restarts).
    remembered: Arc<RememberedStats>,
    /// The partitions the shard owns before anything applied.
    placement: super::placement::Placement,
    /// What it owns as its thread applies changes (every build shares it).
    shared_placement: Arc<super::placement::SharedPlacement>,
}

type Core<S> = ShardCore<S, super::driver::Answer, super::driver::ReadAnswer>;

impl ShardParts {
    fn raft_err(&self) -> impl Fn(raft::Error) -> String + '_ {
        move |e| format!("shard {}: raft: {e}", self.shard)
    }

    /// The core around `replica`, with what every replica has.
    fn core<S: super::replica::LogStore>(&self, replica: Replica<S>) -> Result<Core<S>, String> {
        let keeper = LeaseKeeper::new(lease_config()).map_err(|e| e.to_string())?;
        let c = Arc::clone(&self.compactor);
        let room: RoomHook = Box::new(move |units| c.after_out_of_memory(units));
        Ok(ShardCore::new(replica, Arc::clone(&self.store))
            .with_leases(keeper, ELECTION_TICKS as u64)
            .with_room(room)
            .with_snapshots(self.limits, Arc::clone(&self.slot), Arc::clone(&self.desk))
            .with_remembered_stats(Arc::clone(&self.remembered))
            .with_placement(self.placement.clone(), Arc::clone(&self.shared_placement)))
    }

    /// A replica over a durable log: the store restored from the saved
    /// snapshot and the log replayed after it. One that never decided who
    /// it is (an empty log) starts as a member-to-be: returned with how to
    /// record the id it joins under.
    fn durable(&self, log: &RaftLog) -> Result<(Core<RaftLog>, Option<RecordId>), String> {
        if let Some(why) = crate::lock::lock(&self.distrust).take() {
            // Never as the member it was: its log and snapshot go, and it
            // joins under a new incarnation, catching up from the leader.
            let id = fresh_incarnation(self.me);
            tracing::warn!(shard = self.shard, id, "{why}: the replica rejoins the shard as a new incarnation");
            log.reset(id, &self.conf).map_err(|e| e.to_string())?;
        }
        // A log that knows no replica id holds nothing (new, or cleaned when
        // its node left the shard): a snapshot beside it was left by a close
        // that stopped between cleaning the log and removing the snapshot,
        // and is not this replica's.
        if log.replica_id().map_err(|e| e.to_string())?.is_none() {
            self.desk.reset().map_err(|e| format!("shard {}: {e}", self.shard))?;
        }
        let (applied, remembered, placement) = match recover(log, &self.desk, &self.store) {
            Ok(r) => (r.at.index, r.remembered, r.placement),
            // Where the shard has other replicas to catch up from, a
            // replica whose saved state is damaged starts over (a new
            // incarnation, as a distrusted log does): a node always starts.
            Err(Unrecovered::Damaged(e)) if self.replicas > 1 => {
                let id = fresh_incarnation(self.me);
                tracing::error!(shard = self.shard, id, "{e}: the replica rejoins the shard as a new incarnation");
                log.reset(id, &self.conf).map_err(|e| e.to_string())?;
                self.store.clear(1).map_err(|e| format!("emptying the store: {e}"))?;
                (0, Remembered::default(), None)
            }
            Err(Unrecovered::Damaged(e) | Unrecovered::Other(e)) => return Err(format!("shard {}: {e}", self.shard)),
        };
        let known = log.replica_id().map_err(|e| e.to_string())?;
        let id = known.unwrap_or_else(|| fresh_incarnation(self.me));
        let replica =
            Replica::new_at(id, log.clone(), ELECTION_TICKS, applied, &self.logger).map_err(self.raft_err())?;
        let mut core = self.core(replica)?.restored(applied, remembered, placement);
        let (fresh_log, fresh_logger, fresh_conf) = (log.clone(), self.logger.clone(), self.conf.clone());
        core = core.with_fresh(Box::new(move |id| {
            fresh_log.reset(id, &fresh_conf).map_err(|e| raft::Error::Store(raft::StorageError::Other(e.into())))?;
            Replica::new(id, fresh_log.clone(), ELECTION_TICKS, &fresh_logger)
        }));
        if known.is_some() {
            return Ok((core, None));
        }
        let (first_log, logger, first) = (log.clone(), self.logger.clone(), replica_id(self.me, 1));
        core = core.with_first_member(Box::new(move || {
            first_log.set_replica_id(first).map_err(|e| raft::Error::Store(raft::StorageError::Other(e.into())))?;
            Replica::new(first, first_log, ELECTION_TICKS, &logger)
        }));
        let record = log.clone();
        Ok((core, Some(Box::new(move |id| record.set_replica_id(id).map_err(|e| e.to_string())) as RecordId)))
    }

    /// A replica kept in memory only, as raft id `id`: a member-to-be (the
    /// leader adds it), that may become one of the shard's first members
    /// if `may_be_first` and the shard turns out never to have run.
    fn memory(&self, id: u64, may_be_first: bool) -> Result<Core<MemLog>, String> {
        let log = MemLog::new(self.conf.clone(), Arc::clone(&self.slot));
        let replica = Replica::new(id, log, ELECTION_TICKS, &self.logger).map_err(self.raft_err())?;
        let (fresh_logger, fresh_slot, fresh_conf) = (self.logger.clone(), Arc::clone(&self.slot), self.conf.clone());
        let mut core = self.core(replica)?.with_fresh(Box::new(move |id| {
            let log = MemLog::new(fresh_conf.clone(), Arc::clone(&fresh_slot));
            Replica::new(id, log, ELECTION_TICKS, &fresh_logger)
        }));
        if may_be_first {
            let (logger, slot, conf, first) =
                (self.logger.clone(), Arc::clone(&self.slot), self.conf.clone(), replica_id(self.me, 1));
            core = core.with_first_member(Box::new(move || {
                Replica::new(first, MemLog::new(conf, slot), ELECTION_TICKS, &logger)
            }));
        }
        Ok(core)
    }
}

/// How often the membership task looks again.
pub const MEMBERSHIP_INTERVAL: Duration = Duration::from_millis(300);
/// How often a replica with no state asks its peers while it cannot tell
/// a first start from a restart: often, so that nodes starting together
/// all see each other before any has a term (a node that sees a term
/// first joins as a new member, which is safe but slower).
pub const UNDECIDED_INTERVAL: Duration = Duration::from_millis(20);

/// The other nodes of a replica's shard as its node knows them now.
type PeerSource = Box<dyn Fn() -> Vec<(NodeId, std::net::SocketAddr)> + Send + Sync>;

/// What a shard replica's membership task works with.
struct Membership {
    shard: ShardId,
    dialer: Dialer,
    /// The other nodes holding the shard: (node, peer address).
    peers: PeerSource,
    status: Arc<ReplicaStatus>,
    /// A replica that started with no state, and how to record the id it
    /// joins under; `None`: it knows who it is.
    undecided: Option<RecordId>,
    bootstrap: Box<dyn Fn() + Send + Sync>,
    /// Whether the replica may be one of a new shard's first members (it
    /// opened with the node): one opened later only joins.
    may_bootstrap: bool,
    stop: watch::Receiver<bool>,
    /// Turns true when the replica closes (its shard left the node).
    closed: watch::Receiver<bool>,
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
        if *m.stop.borrow() || *m.closed.borrow() {
            return;
        }
        if let Some(record) = &m.undecided {
            let mut terms = Vec::new();
            for (to, addr) in (m.peers)() {
                let term = match peer::ask(&m.dialer, to, addr, proto::request::Op::GetMap(proto::GetMap::default()))
                    .await
                {
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
            } else if m.may_bootstrap && terms.iter().all(|t| *t == Some(0)) {
                (m.bootstrap)();
                m.undecided = None;
            } else if !warned {
                tracing::info!(shard = m.shard, "waiting for the shard's other nodes to tell whether it ran before");
                warned = true;
            }
        } else if !m.status.joined() && m.status.id.load(Ordering::Relaxed) != 0 {
            let join =
                proto::JoinShard { shard: m.shard, replica_id: m.status.id.load(Ordering::Relaxed), leave: false };
            for (to, addr) in (m.peers)() {
                if let Ok(proto::response::Result::JoinShard(r)) =
                    peer::ask(&m.dialer, to, addr, proto::request::Op::JoinShard(join)).await
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
            _ = m.closed.changed() => return,
        }
    }
}

/// Restores `store` from the shard's saved snapshot, if it has one;
/// returns the index it is at and the writes it remembers. The file is
/// read whole first (a damaged one changes nothing, and is named). A
/// snapshot saved while the log was being replaced by it (a crash in
/// between) is installed in the log now.
fn recover(log: &RaftLog, desk: &Desk, store: &Store) -> Result<snap::Restored, Unrecovered> {
    let other = Unrecovered::Other;
    let none = || snap::Restored { at: snap::Point::default(), remembered: Remembered::default(), placement: None };
    let Some((file, f)) = desk.saved().map_err(other)? else { return Ok(none()) };
    let named = |e: snap::SnapshotError| {
        let why = format!("{}: {e}", file.display());
        match e {
            snap::SnapshotError::Damaged(_) | snap::SnapshotError::WrongPoint { .. } => Unrecovered::Damaged(why),
            _ => Unrecovered::Other(why),
        }
    };
    snap::validate(std::io::BufReader::with_capacity(1 << 20, f)).map_err(named)?;
    let f = std::fs::File::open(&file).map_err(|e| other(format!("{}: {e}", file.display())))?;
    let got = snap::restore(store, std::io::BufReader::with_capacity(1 << 20, f)).map_err(named)?;
    let commit = raft::Storage::initial_state(log).map_err(|e| other(e.to_string()))?.hard_state.commit;
    if got.at.index > commit {
        log.finish_install(got.at).map_err(|e| other(e.to_string()))?;
    }
    Ok(got)
}

/// Why a replica's saved state could not be restored.
#[derive(Debug)]
enum Unrecovered {
    /// The snapshot file is damaged: the replica may start over from its
    /// peers.
    Damaged(String),
    /// Anything else (the disk failing, a store too small for what was
    /// saved, an older format): the state may be the only copy of
    /// acknowledged writes, so it is kept and the error reported.
    Other(String),
}

/// The hash seed of `shard`'s stores: the same on every replica (from the
/// cluster file every node shares), different per shard. Spares are left
/// out, so that adding one to the file changes no replica's seed.
fn shard_seed(cfg: &ClusterConfig, shard: ShardId) -> u64 {
    let nodes: Vec<String> =
        cfg.nodes.iter().filter(|n| !n.spare).map(|n| format!("{}={}/{}", n.id, n.rpc, n.peer)).collect();
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

    /// A durable replica's desk and log of `shard`, in a directory of their own.
    fn durable(shard: u32) -> (tempfile::TempDir, Arc<Desk>, RaftLog) {
        let dir = tempfile::tempdir().unwrap();
        let engine = RaftLog::open_engine(dir.path().join("raft").to_str().unwrap()).unwrap().0;
        let desk = Arc::new(Desk::durable(&dir.path().join("raft-snapshots"), shard, 1 << 30).unwrap());
        let log = RaftLog::new(engine, u64::from(shard)).with_desk(Arc::clone(&desk));
        (dir, desk, log)
    }

    /// `from`'s items taken as from a leader at index 42 (as snapshot
    /// `id`): received, saved, and the log starts after it.
    fn take_snapshot(desk: &Desk, log: &RaftLog, from: &Arc<Store>, id: u64) {
        let at = Point { index: 42, term: 3 };
        let bytes = encode(&from.view().unwrap(), &Default::default(), at).unwrap();
        let desc = crate::cluster::desk::Descriptor { id, at };
        let crate::cluster::desk::Taken::Whole(data) = desk.receive(1, id, 0, &bytes, true).unwrap() else {
            panic!("one part")
        };
        desk.received(desc, data);
        let mut sn = Snapshot { data: desc.encode().into(), ..Default::default() };
        sn.set_metadata(SnapshotMetadata { index: at.index, term: at.term, ..Default::default() });
        crate::cluster::replica::LogStore::persist(log, &[], None, Some(&sn)).unwrap();
    }

    #[test]
    fn a_saved_snapshot_restores_and_a_damaged_one_is_named() {
        let (_dir, desk, log) = durable(4);
        assert_eq!(recover(&log, &desk, &store()).unwrap().at.index, 0, "nothing saved: from the start");
        let from = Arc::new(store());
        from.put(b"k", b"v").unwrap();
        take_snapshot(&desk, &log, &from, 9);
        let to = store();
        assert_eq!(recover(&log, &desk, &to).unwrap().at.index, 42);
        assert_eq!(to.get(b"k").unwrap().unwrap().0, bytes::Bytes::from_static(b"v"));
        assert_eq!(raft::Storage::first_index(&log).unwrap(), 43);
        // A store too small for what was saved is no damage: the replica
        // must keep its state (it may hold the only copy) and say why.
        let tiny = store();
        let big = Arc::new(
            Store::format(Arc::new(Region::create("recover-big", 16 << 20).unwrap()), 64, 1, 1, Duration::ZERO)
                .unwrap(),
        );
        for i in 0..700u32 {
            big.put(format!("big{i}").as_bytes(), &[7u8; 8 << 10]).unwrap();
        }
        let (dir2, desk2, log2) = durable(5);
        take_snapshot(&desk2, &log2, &big, 10);
        assert!(matches!(recover(&log2, &desk2, &tiny), Err(Unrecovered::Other(_))), "too small is not damaged");
        drop(dir2);
        let file = desk.saved_file().unwrap();
        let mut bytes = std::fs::read(&file).unwrap();
        let n = bytes.len();
        bytes[n / 2] ^= 0xff;
        std::fs::write(&file, bytes).unwrap();
        let kept = store();
        kept.put(b"kept", b"1").unwrap();
        let Err(Unrecovered::Damaged(err)) = recover(&log, &desk, &kept) else { panic!("damage must be told apart") };
        assert!(err.contains("shard-4.snap") && err.contains("damaged"), "{err}");
        assert!(kept.get(b"kept").unwrap().is_some(), "a damaged file changes nothing");
    }
}

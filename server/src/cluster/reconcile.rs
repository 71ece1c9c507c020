//! A node's replicas follow the map: a shard the map places here that the
//! node holds no replica of is opened (a new member, which joins the
//! shard and catches up from its leader); a replica of a shard the map no
//! longer places here hands its leadership over, asks the shard's leader
//! to take it out of the members, and closes once it is out. The map is
//! changed by `move-replica` (`replica_move.rs`), which places the new
//! node before it takes the old one out: the replicas that stay hold a
//! quorum of their own before any leaves (`ShardCore::leave`).
//! docs/elasticity.md, "Adding and removing nodes", has the design.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dmkv_common::cluster::map::{META_SHARD, NodeId, ShardId, ShardInfo, node_of, replica_id};
use dmkv_common::proto::{self, request::Op, response::Result as R};
use tokio::sync::watch;

use super::dial;
use super::local_replica::LocalReplica;
use super::log::RaftLog;
use super::node::{ClusterError, ClusterNode};
use super::shard::JoinStep;

/// How often a node compares its replicas with its map.
pub const RECONCILE_INTERVAL: Duration = Duration::from_millis(300);
/// Most a leave ask of one node waits for its answer.
pub const LEAVE_ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// Least time between two tries to open a replica that could not open
/// (each creates and formats a whole region).
pub const OPEN_RETRY: Duration = Duration::from_secs(10);
/// Least time between two asks of a leaving replica to hand over.
pub const HAND_OVER_GAP: Duration = Duration::from_secs(2);

impl ClusterNode {
    /// Node `node_of(replica)`'s replicas of `shard` leave it (its node is
    /// no longer placed there): the next step, if this node's replica
    /// leads. Refused while this node's map still places the shard there.
    pub async fn leave_shard(&self, shard: ShardId, replica: u64) -> Result<JoinStep, ClusterError> {
        if shard == META_SHARD {
            return Err(ClusterError::Failed("the metadata group's members are its first three nodes".into()));
        }
        let Some(r) = self.data_replica(shard) else {
            return Err(ClusterError::Failed(format!("shard {shard} has no replica on node {}", self.id)));
        };
        let map = self.map();
        let placed = map.shards().get(shard as usize).map(|s| s.replicas.clone()).unwrap_or_default();
        let node = node_of(replica);
        if placed.contains(&node) {
            return Err(ClusterError::Failed(format!(
                "the map (version {}) still places shard {shard} on node {node}",
                map.version
            )));
        }
        match tokio::time::timeout(LEAVE_ASK_TIMEOUT, r.thread.leave(node, placed)).await {
            Ok(Ok(Ok(step))) => Ok(step),
            Ok(Ok(Err(e))) => Err(self.cluster_error(e)),
            Ok(Err(_)) => Err(ClusterError::Failed("the shard's replica stopped".into())),
            Err(_) => Err(ClusterError::Busy),
        }
    }

    /// One comparison of the replicas with the map, and the steps it calls
    /// for. Nothing is done on the cluster file's map: the node has not
    /// heard from the metadata group yet, and the file's placement is what
    /// it opened.
    async fn reconcile(self: &Arc<Self>, state: &mut Reconciling) {
        let map = self.map();
        if map.version <= self.first_map().version {
            return;
        }
        for sh in map.shards() {
            match (sh.replicas.contains(&self.id), self.data_replica(sh.id)) {
                (true, None) if state.failed_open.get(&sh.id).is_none_or(|t| t.elapsed() >= OPEN_RETRY) => {
                    match self.open_placed(sh).await {
                        Some(true) => drop(state.failed_open.remove(&sh.id)),
                        Some(false) => drop(state.failed_open.insert(sh.id, Instant::now())),
                        None => {}
                    }
                }
                (false, Some(r)) => self.leave_unplaced(sh, &r, state).await,
                (true, Some(r)) if r.status.is_leader() => self.remove_unplaced(sh, &r).await,
                _ => {}
            }
        }
    }

    /// As `sh`'s leader: takes out the members of a node the map no longer
    /// places on it, once every placed node has a voter (one change at a
    /// time, `ShardCore::leave`). The leaving node asks the same itself;
    /// this is for a node that is down, or restarted without the shard.
    async fn remove_unplaced(&self, sh: &ShardInfo, r: &LocalReplica) {
        let (voters, learners) = r.status.members();
        let Some(node) = voters.iter().chain(&learners).map(|&id| node_of(id)).find(|n| !sh.replicas.contains(n))
        else {
            return;
        };
        // This node's map may be behind the group's (a node placed since,
        // added by a leader that knew): the group's own map decides.
        let placed = match self.fetch_meta_map().await {
            Ok(m) => m.shards().get(sh.id as usize).map(|s| s.replicas.clone()).unwrap_or_default(),
            Err(_) => return,
        };
        if placed.contains(&node) {
            return;
        }
        match tokio::time::timeout(LEAVE_ASK_TIMEOUT, r.thread.leave(node, placed)).await {
            Ok(Ok(Ok(step))) => tracing::debug!(shard = sh.id, node, ?step, "taking an unplaced node's replica out"),
            Ok(Ok(Err(e))) => tracing::debug!(shard = sh.id, node, "not taken out yet: {e:?}"),
            _ => {}
        }
    }

    /// Opens a replica of `sh`, placed here: a member-to-be that joins the
    /// running shard (its membership task asks the leader). Whether it
    /// opened (`None`: not yet, asked again next round).
    async fn open_placed(self: &Arc<Self>, sh: &ShardInfo) -> Option<bool> {
        let Some(first) = self.first_map().shards().get(sh.id as usize).cloned() else { return Some(false) };
        // A log this node kept of the shard names a member only if the
        // shard still counts it: one taken out while the node was away (a
        // remove-node of a node that was down) would come back as a voter
        // no one talks to. Then the log goes, and the replica joins anew.
        if let Some(engine) = &self.opener.engine {
            let log = RaftLog::new(Arc::clone(engine), u64::from(sh.id));
            if let Ok(Some(id)) = log.replica_id() {
                match shard_members(self, sh.id, &sh.replicas).await {
                    Some((voters, learners)) if !voters.contains(&id) && !learners.contains(&id) => {
                        tracing::info!(
                            shard = sh.id,
                            id,
                            "the shard no longer counts this node's replica: it joins anew"
                        );
                        if let Err(e) = log.forget() {
                            tracing::error!(shard = sh.id, "cannot empty the shard's log: {e}");
                            return Some(false);
                        }
                    }
                    Some(_) => {}
                    // No leader to ask: a shard of other replicas waits for
                    // one; a shard of this replica only opens what it has.
                    None if sh.replicas.iter().any(|&n| n != self.id) => return None,
                    None => {}
                }
            }
        }
        let (node, members, shard) = (Arc::clone(self), sh.replicas.clone(), sh.id);
        // Creating the region and formatting the store touch every page of
        // the index: off the async workers. A log the node distrusts
        // (its last run may have lost what it acknowledged) is dropped and
        // the replica rejoins as a new incarnation, as at the start.
        let opened = tokio::task::spawn_blocking(move || {
            let distrust = node.opener.distrust.clone();
            node.opener.open(&first, &members, node.later_per_shard, distrust, false).map(Arc::new)
        })
        .await;
        match opened {
            Ok(Ok(r)) => {
                tracing::info!(shard, "the map places the shard here: its replica opened, and joins");
                self.insert_replica(shard, r);
                Some(true)
            }
            Ok(Err(e)) => {
                tracing::error!(shard, "the map places the shard here, but its replica cannot open: {e}");
                Some(false)
            }
            Err(e) => {
                tracing::error!(shard, "opening the shard's replica failed: {e}");
                Some(false)
            }
        }
    }

    /// A step out of `sh`, which the map no longer places here: hand the
    /// leadership over if it leads; else ask the leader to take this
    /// node's replicas out; once none is left, close.
    async fn leave_unplaced(self: &Arc<Self>, sh: &ShardInfo, r: &LocalReplica, state: &mut Reconciling) {
        if r.status.is_leader() {
            // Each ask gives the lease up while the transfer runs: not
            // asked again before the last one had its time.
            if state.handed_over.get(&sh.id).is_none_or(|t| t.elapsed() >= HAND_OVER_GAP) {
                state.handed_over.insert(sh.id, Instant::now());
                let _ = r.thread.hand_over(None);
            }
            return;
        }
        let id = match r.status.id.load(Ordering::Relaxed) {
            0 => replica_id(self.id, 1),
            id => id,
        };
        let ask = proto::JoinShard { shard: sh.id, replica_id: id, leave: true };
        for &n in &sh.replicas {
            let Some(addr) = self.opener.cfg.nodes.iter().find(|e| e.id == n).map(|e| e.peer) else { continue };
            let answer = dial::ask_within(self.dialer(), n, addr, Op::JoinShard(ask), LEAVE_ASK_TIMEOUT).await;
            match answer {
                Ok(R::JoinShard(j)) if j.done => {
                    self.close_replica(sh.id).await;
                    return;
                }
                Ok(R::JoinShard(j)) => {
                    tracing::debug!(shard = sh.id, step = j.step, "leaving the shard");
                    return;
                }
                _ => {}
            }
        }
    }

    /// Closes this node's replica of `shard`, out of its members: no more
    /// raft traffic, snapshots or one-sided readers reach it, its thread
    /// stops, and a log on disk forgets it (a replica placed here again
    /// joins as a new member).
    pub(super) async fn close_replica(self: &Arc<Self>, shard: ShardId) {
        let Some(r) = self.remove_replica(shard) else { return };
        let _ = r.closed.send(true);
        self.opener.sink.remove(shard);
        self.opener.peers.snapshots.unregister(shard);
        let engine = self.opener.engine.clone();
        let closed = tokio::task::spawn_blocking(move || {
            r.thread.halt();
            match engine {
                Some(engine) => RaftLog::new(engine, u64::from(shard)).with_desk(Arc::clone(&r.desk)).forget(),
                None => Ok(()),
            }
        })
        .await;
        match closed {
            Ok(Ok(())) => tracing::info!(shard, "the shard left this node: its replica closed"),
            Ok(Err(e)) => tracing::error!(shard, "the shard's replica closed, but its log could not be emptied: {e}"),
            Err(e) => tracing::error!(shard, "closing the shard's replica failed: {e}"),
        }
    }
}

/// What the reconciler remembers between rounds.
#[derive(Default)]
struct Reconciling {
    /// When a replica that could not open was last tried, by shard.
    failed_open: HashMap<ShardId, Instant>,
    /// When a leaving replica that leads was last asked to hand over.
    handed_over: HashMap<ShardId, Instant>,
}

/// Keeps `node`'s replicas what its map places on it, every
/// [`RECONCILE_INTERVAL`]; ends when `stop` turns true or the node is
/// dropped.
pub fn spawn_reconciler(node: &Arc<ClusterNode>, mut stop: watch::Receiver<bool>) {
    let weak = Arc::downgrade(node);
    tokio::spawn(async move {
        let mut state = Reconciling::default();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(RECONCILE_INTERVAL) => {}
                _ = stop.changed() => return,
            }
            let Some(node) = weak.upgrade() else { return };
            node.reconcile(&mut state).await;
        }
    });
}

/// The members of `shard` as its leader reports them (voters, learners),
/// asked of the nodes `nodes` (this one's own state read directly).
pub(super) async fn shard_members(
    node: &ClusterNode,
    shard: ShardId,
    nodes: &[NodeId],
) -> Option<(Vec<u64>, Vec<u64>)> {
    for &n in nodes {
        let reply = if n == node.id {
            node.map_reply()
        } else {
            let Some(addr) = node.opener.cfg.nodes.iter().find(|e| e.id == n).map(|e| e.peer) else { continue };
            match dial::ask_within(node.dialer(), n, addr, Op::GetMap(proto::GetMap::default()), LEAVE_ASK_TIMEOUT)
                .await
            {
                Ok(R::Map(m)) => *m,
                _ => continue,
            }
        };
        if let Some(l) = reply.local.iter().find(|l| l.shard == shard && l.role == "leader") {
            return Some((l.voters.clone(), l.learners.clone()));
        }
    }
    None
}

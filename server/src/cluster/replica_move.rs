//! Moving a shard's replica from one node to another, driven by the node
//! leading the metadata group (`dmkv cluster move-replica`, and
//! `add-node`/`remove-node` move by move). Two map changes, each a CAS
//! through the group's log, with the nodes' reconcilers (`reconcile.rs`)
//! doing the rest:
//!
//! 1. The map places the shard on the new node too. Its reconciler opens a
//!    replica, which joins as a learner, catches up (a snapshot, then the
//!    log) and is promoted to voter. The old replica still votes: the shard
//!    has one more member for a while, never one fewer.
//! 2. Once the new node has a voter, the map no longer places the shard on
//!    the old node. Its reconciler hands the leadership over if it led, has
//!    the leader take its replica out of the members, and closes it.
//!
//! Each step is safe to ask again: a move asked again (its driver died, or
//! a new metadata leader) goes on from the map as it is. Routing is not
//! touched (the partitions stay on the shard), so one-sided readers see no
//! placement change; a reader of the old node's region finds its lease
//! gone once it stops leading, like after any hand-over.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dmkv_common::cluster::map::{META_SHARD, NodeId, ShardId, node_of};
use dmkv_common::proto;

use super::node::{ClusterError, ClusterNode};
use super::reconcile::shard_members;

/// Most a new replica may take to become a voter (it catches up from a
/// snapshot of the whole shard, at the snapshot sender's pace).
pub const REPLICA_JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// Most the old replica may take to be taken out once its node is no
/// longer placed (a hand-over, then one membership change).
pub const REPLICA_LEAVE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the mover looks at the shard's members.
pub const REPLICA_MOVE_POLL: Duration = Duration::from_millis(100);
/// Map writes tried again after another change took the group's map
/// first (a partition move's, or a node's).
pub const MAP_WRITE_TRIES: usize = 20;
/// Most a replica move waits for a partition move under way to end.
pub const PARTITION_MOVE_WAIT: Duration = Duration::from_secs(300);

impl ClusterNode {
    /// Moves `shard`'s replica on node `from` to node `to` (see the
    /// module's doc); this node must lead the metadata group.
    pub async fn move_replica(
        &self,
        shard: ShardId,
        from: NodeId,
        to: NodeId,
    ) -> Result<proto::MoveReplicaReply, ClusterError> {
        let started = Instant::now();
        let failed = |why: String| ClusterError::Failed(why);
        // One at a time: two moves of one shard's replicas (a move and its
        // reverse, asked at once) could each take out the node the other
        // placed.
        if self.replica_moving.swap(true, Ordering::AcqRel) {
            return Err(failed("another replica move runs on this node: one at a time".into()));
        }
        struct Running<'a>(&'a AtomicBool);
        impl Drop for Running<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _running = Running(&self.replica_moving);
        if shard == META_SHARD {
            return Err(failed("the metadata group's members are its first three nodes: they do not move".into()));
        }
        if from == to {
            return Err(failed(format!("node {from} is both where the replica is and where it goes")));
        }
        let (map, _) = self.meta_map().await?;
        let Some(sh) = map.shards().get(shard as usize) else {
            return Err(failed(format!("shard {shard} does not exist: there are {}", map.shards().len())));
        };
        if !map.nodes.contains_key(&to) {
            return Err(failed(format!("node {to} is not in the cluster")));
        }
        let (has_from, has_to) = (sh.replicas.contains(&from), sh.replicas.contains(&to));
        if !has_from && has_to {
            self.wait_out(shard, from, &sh.replicas).await?;
            let version = map.version;
            return Ok(proto::MoveReplicaReply { version, total_ms: 0, outcome: "already".into() });
        }
        if !has_from {
            return Err(failed(format!("shard {shard} has no replica on node {from} (it is on {:?})", sh.replicas)));
        }
        // 1. The new node too.
        if !has_to {
            self.place(shard, |r| {
                if !r.contains(&to) {
                    r.push(to);
                }
            })
            .await?;
        }
        self.wait_voter(shard, to).await?;
        // 2. Not the old one, and only while the new one is still placed
        // (a change made meanwhile by another metadata leader is not
        // undone: the move stops and says so).
        let version = self
            .place(shard, |r| {
                if r.contains(&to) {
                    r.retain(|&n| n != from);
                }
            })
            .await?;
        let (map, _) = self.meta_map().await?;
        let placed = map.shards().get(shard as usize).map(|s| s.replicas.clone()).unwrap_or_default();
        if !placed.contains(&to) || placed.contains(&from) {
            return Err(failed(format!(
                "shard {shard}'s placement changed while its replica moved (it is on {placed:?} now); ask again"
            )));
        }
        self.wait_out(shard, from, &placed).await?;
        tracing::info!(shard, from, to, "replica moved");
        Ok(proto::MoveReplicaReply { version, total_ms: started.elapsed().as_millis() as u64, outcome: "done".into() })
    }

    /// Writes the group's map with `shard`'s nodes changed by `change`, as
    /// a CAS, read again and retried if another change came first; returns
    /// the version written (or the map's, if `change` changed nothing).
    async fn place(&self, shard: ShardId, change: impl Fn(&mut Vec<NodeId>)) -> Result<u64, ClusterError> {
        let deadline = Instant::now() + PARTITION_MOVE_WAIT;
        let mut tries = 0;
        while tries < MAP_WRITE_TRIES {
            let (map, stored) = self.meta_map().await?;
            // A partition move holds the map's next versions (its flip):
            // the placement changes between two (a rebalance's are a
            // second apart).
            if let Some(m) = map.moving {
                if Instant::now() >= deadline {
                    return Err(ClusterError::Failed(format!(
                        "partition {}'s move has been under way for {} s: replicas move between partition moves \
                         (pause or cancel it, or ask again)",
                        m.partition,
                        PARTITION_MOVE_WAIT.as_secs()
                    )));
                }
                tokio::time::sleep(REPLICA_MOVE_POLL).await;
                continue;
            }
            tries += 1;
            let mut nodes = map.shards().get(shard as usize).map(|s| s.replicas.clone()).unwrap_or_default();
            let before = nodes.clone();
            change(&mut nodes);
            if nodes == before {
                return Ok(map.version);
            }
            let mut next = map.clone();
            next.set_replicas(shard, nodes).map_err(|e| ClusterError::Failed(e.to_string()))?;
            match self.meta_write(stored, &next).await {
                Ok(_) => {
                    self.adopt_map(next.clone());
                    return Ok(next.version);
                }
                // Another change took the map first: read it again.
                Err(ClusterError::Store(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(ClusterError::Busy)
    }

    /// Waits until `shard`'s leader counts a voter of node `to`.
    async fn wait_voter(&self, shard: ShardId, to: NodeId) -> Result<(), ClusterError> {
        let deadline = Instant::now() + REPLICA_JOIN_TIMEOUT;
        loop {
            let nodes = self.map().shards().get(shard as usize).map(|s| s.replicas.clone()).unwrap_or_default();
            if let Some((voters, _)) = shard_members(self, shard, &nodes).await
                && voters.iter().any(|&v| node_of(v) == to)
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(ClusterError::Failed(format!(
                    "node {to}'s replica of shard {shard} did not become a voter within {} s (it stays placed \
                     there; ask again to go on)",
                    REPLICA_JOIN_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(REPLICA_MOVE_POLL).await;
        }
    }

    /// Waits until `shard`'s leader (on one of `placed`) counts no member
    /// of node `from`.
    async fn wait_out(&self, shard: ShardId, from: NodeId, placed: &[NodeId]) -> Result<(), ClusterError> {
        let deadline = Instant::now() + REPLICA_LEAVE_TIMEOUT;
        loop {
            if let Some((voters, learners)) = shard_members(self, shard, placed).await
                && !voters.iter().chain(&learners).any(|&v| node_of(v) == from)
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(ClusterError::Failed(format!(
                    "node {from}'s replica of shard {shard} was not taken out within {} s (the map no longer \
                     places it there; it leaves when its node reaches the leader)",
                    REPLICA_LEAVE_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(REPLICA_MOVE_POLL).await;
        }
    }
}

//! The metadata group: a raft group on the cluster's first three nodes
//! (`map::meta_nodes`) that keeps the map's placement (nodes, shards,
//! partition → shard, shard → replicas, and its version). To raft, its
//! log and its snapshots it is a shard like the others (`META_SHARD`),
//! never dealt a partition; its state is one item, the map, written only
//! conditionally on the version it replaces, so two changes made from two
//! nodes (or by a leader that was deposed meanwhile) never both apply.
//! Until the first change is written the group holds the cluster file's
//! map. Leaders are not kept here: every node learns them from its own
//! replicas and from clients' reports. docs/elasticity.md has the design.
//!
//! Every node keeps its map's placement up to date from the group
//! ([`spawn_map_refresh`]): it asks every [`MAP_POLL`], and at once when a
//! shard refused a key that moved.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use dmkv_common::cluster::map::{ClusterMap, NodeId, node_of};
use dmkv_common::proto::{self, request::Op, response::Result as R};
use prost::Message;
use tokio::sync::watch;

use super::apply::{Applied, encode_write};
use super::node::{ClusterError, ClusterNode};

/// The key the group keeps the map under.
pub const MAP_KEY: &[u8] = b"map";
/// How often a node asks the group for the map.
pub const MAP_POLL: Duration = Duration::from_secs(1);
/// Least time between two asks, however often the refresh is woken (a
/// stream of refused keys wakes it for each).
pub const MAP_ASK_GAP: Duration = Duration::from_millis(100);

/// Least time between two asks of the group made for clients whose map
/// was stale (`ClusterNode::refresh_past`): however many ask, a node asks
/// the group at most this often.
pub const CLIENT_ASK_GAP: Duration = Duration::from_millis(5);
/// Most a client's map request waits for the group's map.
pub const CLIENT_ASK_TIMEOUT: Duration = Duration::from_millis(500);
/// How soon a node whose replica applied a placement newer than its map
/// (a move between its release and its flip) asks the group again; doubled
/// up to [`MAP_ASK_GAP`] while it stays behind (a move that stopped).
pub const BEHIND_ASK_GAP: Duration = Duration::from_millis(10);

/// The map as the group stores it: its placement, no leaders.
pub fn encode_map(map: &ClusterMap) -> Vec<u8> {
    let mut m = map.to_proto();
    for s in &mut m.shards {
        s.leader = 0;
        s.term = 0;
    }
    m.encode_to_vec()
}

/// A map as the group stored it, checked.
pub fn decode_map(b: &[u8]) -> Result<ClusterMap, String> {
    let m = proto::ClusterMapReply::decode(b).map_err(|e| format!("the metadata group's map does not decode: {e}"))?;
    ClusterMap::from_proto(&m).map_err(|e| format!("the metadata group's map is not valid: {e}"))
}

impl ClusterNode {
    /// The group's replica on this node, if it leads the group; else why
    /// not (NOT_LEADER naming the leader it knows of).
    fn meta_leading(&self) -> Result<&super::node::LocalReplica, ClusterError> {
        let not_leader = |leader: Option<NodeId>| ClusterError::NotLeader { leader, map_version: self.map().version };
        let Some(r) = self.meta_replica() else {
            let known = self.meta_leader.load(Ordering::Relaxed);
            return Err(not_leader((known != 0).then_some(known)));
        };
        if !r.status.is_leader() {
            let leader = node_of(r.status.leader.load(Ordering::Relaxed));
            return Err(not_leader((leader != 0 && leader != self.id).then_some(leader)));
        }
        Ok(r)
    }

    /// The map as the group holds it now, read linearizably from this
    /// node's replica of it (which must lead the group), and the version of
    /// the item it is stored under (0: the cluster file's, never changed).
    pub async fn meta_map(&self) -> Result<(ClusterMap, u64), ClusterError> {
        let r = self.meta_leading()?;
        let got = self.read_replica(r, |s| s.get_item(MAP_KEY, crate::clock::now_ms()), |_| true).await?;
        match got {
            None => Ok((self.first_map().clone(), 0)),
            Some((item, _)) => Ok((decode_map(&item.value).map_err(ClusterError::Failed)?, item.meta.version)),
        }
    }

    /// Writes `new` as the group's map if it still holds the one stored
    /// under `stored` (0: the cluster file's); this node's replica must
    /// lead the group. A change made since is refused (`Exists`, or
    /// `NotStored` for the first change), and nothing is written.
    pub async fn meta_write(&self, stored: u64, new: &ClusterMap) -> Result<u64, ClusterError> {
        new.validate().map_err(|e| ClusterError::Failed(format!("the new map is not valid: {e}")))?;
        let r = self.meta_leading()?;
        let mode = if stored == 0 { proto::PutMode::Add } else { proto::PutMode::Set };
        let put = proto::Put {
            key: MAP_KEY.to_vec().into(),
            value: encode_map(new).into(),
            cas: stored,
            mode: mode as i32,
            ..Default::default()
        };
        match r.thread.propose(encode_write(put, crate::clock::now_ms())).await {
            Ok(Ok(Applied::Put { version })) => Ok(version),
            Ok(Ok(Applied::Refused(e))) => Err(ClusterError::Store(e)),
            Ok(Ok(other)) => Err(ClusterError::Failed(format!("a map write applied as {other:?}"))),
            Ok(Err(e)) => Err(self.cluster_error(e)),
            Err(_) => Err(ClusterError::Uncertain),
        }
    }

    /// Asks the group for its map: this node's replica if it leads, else
    /// each of the group's other nodes in turn over the peer port.
    pub async fn fetch_meta_map(&self) -> Result<ClusterMap, String> {
        match self.meta_map().await {
            Ok((map, _)) => return Ok(map),
            Err(e) if self.meta_replica().is_some_and(|r| r.status.is_leader()) => return Err(format!("{e:?}")),
            Err(_) => {}
        }
        let mut last = String::from("the metadata group has no nodes");
        let known = self.meta_leader.load(Ordering::Relaxed);
        let mut order: Vec<(NodeId, std::net::SocketAddr)> =
            self.meta_nodes().iter().copied().filter(|&(n, _)| n != self.id).collect();
        // The node last found leading first.
        order.sort_by_key(|&(n, _)| n != known);
        for (to, addr) in order {
            match super::dial::ask(self.dialer(), to, addr, Op::MetaMap(proto::MetaMap {})).await {
                Ok(R::Map(m)) => {
                    self.meta_leader.store(to, Ordering::Relaxed);
                    return ClusterMap::from_proto(&m).map_err(|e| format!("node {to}'s map is not valid: {e}"));
                }
                Ok(other) => last = format!("node {to} answered {other:?}"),
                Err(e) => last = format!("node {to}: {e}"),
            }
        }
        Err(last)
    }

    /// Makes this node's map newer than `version` if the group's is: a
    /// client found its map at `version` stale (a key's partition moved)
    /// and asks for the map; answered with this node's own, it could wait
    /// out this node's next poll of the group before it learns the flip.
    /// One ask in flight per node: a request that comes meanwhile waits
    /// for it, never asks itself; asks are at least [`CLIENT_ASK_GAP`]
    /// apart ([`MAP_ASK_GAP`] after one failed), each bounded by
    /// [`CLIENT_ASK_TIMEOUT`], and so is every wait. A failed ask leaves
    /// the map as it is.
    pub async fn refresh_past(&self, version: u64) {
        if version == 0 || self.map_version() > version {
            return;
        }
        let asks = &self.client_asks;
        let done = asks.done.notified();
        tokio::pin!(done);
        done.as_mut().enable();
        if asks.asking.swap(true, Ordering::AcqRel) {
            // Whatever that ask brings is as fresh as one of our own.
            let _ = tokio::time::timeout(CLIENT_ASK_TIMEOUT, done).await;
            return;
        }
        // Cleared however this ends (a request dropped with its
        // connection too), and the waiters woken.
        struct Asking<'a>(&'a super::client_asks::ClientAsks);
        impl Drop for Asking<'_> {
            fn drop(&mut self) {
                self.0.asking.store(false, Ordering::Release);
                self.0.done.notify_waiters();
            }
        }
        let _asking = Asking(asks);
        let too_soon = crate::lock::lock(&asks.last)
            .is_some_and(|(at, ok)| at.elapsed() < if ok { CLIENT_ASK_GAP } else { MAP_ASK_GAP });
        if too_soon || self.map_version() > version {
            return;
        }
        let got = tokio::time::timeout(CLIENT_ASK_TIMEOUT, self.fetch_meta_map()).await;
        *crate::lock::lock(&asks.last) = Some((std::time::Instant::now(), matches!(got, Ok(Ok(_)))));
        if let Ok(Ok(map)) = got
            && self.adopt_map(map)
        {
            tracing::info!(version = self.map_version(), "the cluster map changed (asked for a client)");
        }
    }
}

/// Keeps `node`'s map up to date with the group's: asks every
/// [`MAP_POLL`], and at once when woken (`ClusterNode::wake_map_refresh`);
/// ends when `stop` turns true or the node is dropped.
pub fn spawn_map_refresh(node: &Arc<ClusterNode>, mut stop: watch::Receiver<bool>) {
    let weak = Arc::downgrade(node);
    let wake = node.map_wake();
    tokio::spawn(async move {
        let mut last = tokio::time::Instant::now();
        let mut behind_gap = BEHIND_ASK_GAP;
        loop {
            // A replica here applied a placement the map does not have yet
            // (a move's release or own, before its flip): asked again soon,
            // less often the longer it lasts.
            let behind = match weak.upgrade() {
                Some(node) => node.map_behind(),
                None => return,
            };
            let (wait, gap) = match behind {
                true => (behind_gap, behind_gap),
                false => (MAP_POLL, MAP_ASK_GAP),
            };
            behind_gap = if behind { (behind_gap * 2).min(MAP_ASK_GAP) } else { BEHIND_ASK_GAP };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = wake.notified() => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            // Woken by a placement applied meanwhile: the shorter gap.
            let gap = match weak.upgrade() {
                Some(node) if node.map_behind() => gap.min(behind_gap),
                Some(_) => gap,
                None => return,
            };
            tokio::time::sleep_until(last + gap).await;
            last = tokio::time::Instant::now();
            let Some(node) = weak.upgrade() else { return };
            match node.fetch_meta_map().await {
                Ok(map) => {
                    if node.adopt_map(map) {
                        tracing::info!(version = node.map().version, "the cluster map changed");
                    }
                }
                Err(e) => tracing::debug!("the metadata group's map could not be read: {e}"),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// The group stores the placement, never leaders, and a stored map
    /// that does not decode or check out is refused by name.
    #[test]
    fn a_stored_map_keeps_the_placement_and_drops_leaders() {
        let nodes: BTreeMap<NodeId, String> = (1..=3).map(|i| (i, format!("127.0.0.1:{}", 7070 + i))).collect();
        let mut map = ClusterMap::initial(nodes, 4, 3).unwrap();
        let p = map.partitions_of(2).next().unwrap();
        map.move_partition(p, 0).unwrap();
        let placed = map.clone();
        map.set_leader(1, 2, 9).unwrap();
        let back = decode_map(&encode_map(&map)).unwrap();
        assert_eq!(back, placed);
        assert!(back.shards().iter().all(|s| s.leader.is_none()));
        assert!(decode_map(b"\xff\xff").unwrap_err().contains("does not decode"));
        let mut bad = map.to_proto();
        bad.partitions[3] = 77;
        assert!(decode_map(&bad.encode_to_vec()).unwrap_err().contains("not valid"));
    }
}

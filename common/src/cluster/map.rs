//! The cluster map: key → partition → shard → replicas and leader.
//!
//! The key space is cut into [`PARTITIONS`] fixed hash partitions (as
//! Aerospike does), each assigned to a shard; a shard is a raft group of
//! replicas on distinct nodes. The map is versioned: every change of
//! placement (partitions, shards, replicas, nodes) bumps the version, and
//! a client that is told of a newer one refreshes. Leaders are not part of
//! the version: they change with every election, and are ordered by their
//! terms instead. A shard checks what it owns itself; the map only routes
//! (docs/elasticity.md).

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Number of hash partitions. Fixed for the life of a cluster: moving a
/// partition moves its keys, changing this count would move all of them.
pub const PARTITIONS: u32 = 4096;
/// Seed of the partition hash: independent of the index's hash, whose low
/// bits pick directory entries inside a shard's region.
const PARTITION_SEED: u64 = 0x646d_6b76_7061_7274;
/// Most replicas of one shard.
pub const MAX_REPLICAS: usize = 5;
/// Most shards in a cluster (one per partition at most).
pub const MAX_SHARDS: u32 = PARTITIONS;

/// A node's id, as in the cluster file.
pub type NodeId = u64;
/// A shard's id.
pub type ShardId = u32;

/// The raft group that keeps the map (the metadata group): a shard to
/// raft and its log, never dealt a partition.
pub const META_SHARD: ShardId = u32::MAX;
/// Replicas of the metadata group (fewer in a smaller cluster).
pub const META_REPLICAS: usize = 3;

/// The nodes the metadata group lives on: the first [`META_REPLICAS`] by
/// id.
pub fn meta_nodes(nodes: impl IntoIterator<Item = NodeId>) -> Vec<NodeId> {
    let mut ids: Vec<NodeId> = nodes.into_iter().collect();
    ids.sort_unstable();
    ids.dedup();
    ids.truncate(META_REPLICAS);
    ids
}

/// The raft id of incarnation `incarnation` of `node`'s replica of a shard:
/// a replica that lost its state comes back under a new incarnation, as a
/// new member, so nothing counts on what it forgot.
pub fn replica_id(node: NodeId, incarnation: u32) -> u64 {
    (node << 32) | u64::from(incarnation)
}

/// The node a replica (raft id) lives on.
pub fn node_of(replica: u64) -> NodeId {
    replica >> 32
}

/// The partition `key` falls in.
pub fn partition_of(key: &[u8]) -> u32 {
    (xxh3_64_with_seed(key, PARTITION_SEED) % u64::from(PARTITIONS)) as u32
}

/// What is wrong with a map (built locally or received).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MapError {
    #[error("a cluster needs at least one node that is not a spare")]
    NoNodes,
    #[error("{0} shards: must be 1 to {MAX_SHARDS}")]
    Shards(u32),
    #[error("replication factor {rf} with {nodes} nodes (spares aside): must be 1 to min(nodes, {MAX_REPLICAS})")]
    ReplicationFactor { rf: usize, nodes: usize },
    #[error("partition table has {0} entries, not {PARTITIONS}")]
    PartitionCount(usize),
    #[error("partition {partition} names shard {shard}, which does not exist")]
    UnknownShard { partition: u32, shard: ShardId },
    #[error("shard {shard}: replica {node} is not a node of the cluster")]
    UnknownNode { shard: ShardId, node: NodeId },
    #[error("shard {0}: replicas must be distinct and 1 to {MAX_REPLICAS}")]
    Replicas(ShardId),
    #[error("shard {shard}: leader {node} is not one of its replicas")]
    Leader { shard: ShardId, node: NodeId },
    #[error("the move under way is not valid: {0}")]
    Moving(&'static str),
}

/// One shard: its replicas and what is known of its leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    pub id: ShardId,
    /// Nodes holding a replica, in placement order.
    pub replicas: Vec<NodeId>,
    /// The leader as last reported, if any.
    pub leader: Option<NodeId>,
    /// The raft term of that leader.
    pub term: u64,
}

/// The versioned cluster map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterMap {
    /// The placement's version (leaders aside).
    pub version: u64,
    /// Shard of each partition.
    partitions: Vec<ShardId>,
    shards: Vec<ShardInfo>,
    /// Node ids and their RPC addresses.
    pub nodes: BTreeMap<NodeId, String>,
    /// A partition move under way: no other change of the placement is
    /// made until it flips or is abandoned (docs/elasticity.md).
    pub moving: Option<Moving>,
    /// The last moves that ended, oldest first (at most
    /// [`MAX_MOVE_HISTORY`]).
    pub history: Vec<EndedMove>,
}

/// A partition move recorded in the map at its plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moving {
    pub partition: u32,
    pub from: ShardId,
    pub to: ShardId,
    /// The map version the move flips to.
    pub version: u64,
    /// The claim of the mover run that holds the move: a mover acts on the
    /// shards only while the record names it, and every change of the
    /// record is written conditionally on the one it replaces, so a mover
    /// that lost the record (to a mover on a new metadata leader, a pause
    /// or a cancel) neither releases nor abandons. Claims only grow (the
    /// shards order movers by them).
    pub claim: u64,
    /// The run that wrote the claim (random): two runs that read the same
    /// record make the same claim, and only one writes it; this tells
    /// which, when a write's outcome is read back.
    pub run: u64,
    pub phase: MovePhase,
    /// The copy's pace (bytes a second, 0: unpaced), for a mover that
    /// resumes the move by itself.
    pub rate_bytes: u64,
}

/// Where a recorded move stands, as far as what may still be done to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MovePhase {
    /// Copying before the cut-over: it may be paused or abandoned.
    Copying,
    /// The cut-over may have begun (the source may have released the
    /// partition): it can only be carried through.
    Releasing,
    /// Being abandoned (failed or cancelled before its cut-over): it can
    /// only be undone.
    Abandoning,
    /// Stopped before its cut-over by an operator, until asked again.
    Paused,
}

impl MovePhase {
    pub fn code(self) -> u32 {
        match self {
            MovePhase::Copying => 0,
            MovePhase::Releasing => 1,
            MovePhase::Abandoning => 2,
            MovePhase::Paused => 3,
        }
    }

    pub fn of_code(c: u32) -> Option<MovePhase> {
        Some(match c {
            0 => MovePhase::Copying,
            1 => MovePhase::Releasing,
            2 => MovePhase::Abandoning,
            3 => MovePhase::Paused,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            MovePhase::Copying => "copying",
            MovePhase::Releasing => "cut-over",
            MovePhase::Abandoning => "abandoning",
            MovePhase::Paused => "paused",
        }
    }
}

/// Most ended moves a map keeps (oldest dropped first).
pub const MAX_MOVE_HISTORY: usize = 16;
/// Longest outcome text an ended move keeps.
pub const MAX_OUTCOME_LEN: usize = 200;

/// A move that ended, as the map keeps it (so its history outlives the
/// node whose mover ran it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedMove {
    pub partition: u32,
    pub from: ShardId,
    pub to: ShardId,
    pub version: u64,
    /// "done", "cancelled", or "abandoned: why".
    pub outcome: String,
    pub keys: u64,
    pub bytes: u64,
    pub pause_us: u64,
    pub total_ms: u64,
    /// Wall-clock time it ended (ms since the Unix epoch).
    pub ended_unix_ms: u64,
}

impl EndedMove {
    pub fn to_proto(&self) -> crate::proto::MoveReport {
        crate::proto::MoveReport {
            partition: self.partition,
            from: self.from,
            to: self.to,
            version: self.version,
            phase: self.outcome.clone(),
            keys: self.keys,
            bytes: self.bytes,
            elapsed_ms: self.total_ms,
            pause_us: self.pause_us,
            ended_unix_ms: self.ended_unix_ms,
            ..Default::default()
        }
    }

    fn of_proto(r: &crate::proto::MoveReport) -> EndedMove {
        EndedMove {
            partition: r.partition,
            from: r.from,
            to: r.to,
            version: r.version,
            outcome: r.phase.clone(),
            keys: r.keys,
            bytes: r.bytes,
            pause_us: r.pause_us,
            total_ms: r.elapsed_ms,
            ended_unix_ms: r.ended_unix_ms,
        }
    }
}

impl ClusterMap {
    /// The first map of a cluster: `shards` shards of `rf` replicas placed
    /// round-robin on distinct nodes, partitions dealt out round-robin.
    pub fn initial(nodes: BTreeMap<NodeId, String>, shards: u32, rf: usize) -> Result<ClusterMap, MapError> {
        ClusterMap::initial_with_spares(nodes, &BTreeSet::new(), shards, rf)
    }

    /// [`ClusterMap::initial`] with `spares`: nodes of the cluster (in its
    /// map, reachable, able to take replicas later) given none at first.
    pub fn initial_with_spares(
        nodes: BTreeMap<NodeId, String>,
        spares: &BTreeSet<NodeId>,
        shards: u32,
        rf: usize,
    ) -> Result<ClusterMap, MapError> {
        let ids: Vec<NodeId> = nodes.keys().copied().filter(|n| !spares.contains(n)).collect();
        if ids.is_empty() {
            return Err(MapError::NoNodes);
        }
        if shards == 0 || shards > MAX_SHARDS {
            return Err(MapError::Shards(shards));
        }
        if rf == 0 || rf > ids.len() || rf > MAX_REPLICAS {
            return Err(MapError::ReplicationFactor { rf, nodes: ids.len() });
        }
        let shards = (0..shards)
            .map(|s| ShardInfo {
                id: s,
                replicas: (0..rf).map(|i| ids[(s as usize + i) % ids.len()]).collect(),
                leader: None,
                term: 0,
            })
            .collect::<Vec<_>>();
        let n = shards.len() as u32;
        let map = ClusterMap {
            version: 1,
            partitions: (0..PARTITIONS).map(|p| p % n).collect(),
            shards,
            nodes,
            moving: None,
            history: Vec::new(),
        };
        map.validate()?;
        Ok(map)
    }

    /// Checks every reference in the map; a received map is checked before
    /// it is used.
    pub fn validate(&self) -> Result<(), MapError> {
        if self.nodes.is_empty() {
            return Err(MapError::NoNodes);
        }
        if self.shards.is_empty() || self.shards.len() > MAX_SHARDS as usize {
            return Err(MapError::Shards(self.shards.len() as u32));
        }
        if self.partitions.len() != PARTITIONS as usize {
            return Err(MapError::PartitionCount(self.partitions.len()));
        }
        for (p, &s) in self.partitions.iter().enumerate() {
            if s as usize >= self.shards.len() {
                return Err(MapError::UnknownShard { partition: p as u32, shard: s });
            }
        }
        if let Some(m) = self.moving {
            if m.partition >= PARTITIONS || m.to as usize >= self.shards.len() || m.from == m.to {
                return Err(MapError::Moving("a partition or shard that does not exist, or a move to where it is"));
            }
            if self.partitions[m.partition as usize] != m.from {
                return Err(MapError::Moving("the partition is not on the shard it moves from"));
            }
            if m.version <= self.version {
                return Err(MapError::Moving("it flips to a version not past the map's"));
            }
        }
        if self.history.len() > MAX_MOVE_HISTORY || self.history.iter().any(|h| h.outcome.len() > MAX_OUTCOME_LEN) {
            return Err(MapError::Moving("more ended moves, or longer outcomes, than a map keeps"));
        }
        for (i, sh) in self.shards.iter().enumerate() {
            let id = sh.id;
            if id as usize != i || sh.replicas.is_empty() || sh.replicas.len() > MAX_REPLICAS {
                return Err(MapError::Replicas(id));
            }
            for (j, n) in sh.replicas.iter().enumerate() {
                if !self.nodes.contains_key(n) {
                    return Err(MapError::UnknownNode { shard: id, node: *n });
                }
                if sh.replicas[..j].contains(n) {
                    return Err(MapError::Replicas(id));
                }
            }
            if let Some(l) = sh.leader
                && !sh.replicas.contains(&l)
            {
                return Err(MapError::Leader { shard: id, node: l });
            }
        }
        Ok(())
    }

    /// The shard holding `key`.
    pub fn shard_of(&self, key: &[u8]) -> &ShardInfo {
        &self.shards[self.partitions[partition_of(key) as usize] as usize]
    }

    /// The shard partition `p` is dealt to.
    pub fn shard_of_partition(&self, p: u32) -> Option<ShardId> {
        self.partitions.get(p as usize).copied()
    }

    /// Deals partition `p` to shard `to`, as a new version of the map.
    pub fn move_partition(&mut self, p: u32, to: ShardId) -> Result<(), MapError> {
        if p >= PARTITIONS {
            return Err(MapError::PartitionCount(p as usize));
        }
        if to as usize >= self.shards.len() {
            return Err(MapError::UnknownShard { partition: p, shard: to });
        }
        self.partitions[p as usize] = to;
        self.version += 1;
        Ok(())
    }

    /// Places `shard` on `nodes` (its replicas' nodes, in order), as a new
    /// version of the map; checked like a received map, and left as it was
    /// if the result is not valid.
    pub fn set_replicas(&mut self, shard: ShardId, nodes: Vec<NodeId>) -> Result<(), MapError> {
        let mut next = self.clone();
        let sh = next.shards.get_mut(shard as usize).ok_or(MapError::Shards(shard))?;
        if sh.leader.is_some_and(|l| !nodes.contains(&l)) {
            sh.leader = None;
        }
        sh.replicas = nodes;
        next.version += 1;
        next.validate()?;
        *self = next;
        Ok(())
    }

    /// The partitions `shard` holds, in order.
    pub fn partitions_of(&self, shard: ShardId) -> impl Iterator<Item = u32> + '_ {
        (0..PARTITIONS).filter(move |&p| self.partitions[p as usize] == shard)
    }

    /// Every shard.
    pub fn shards(&self) -> &[ShardInfo] {
        &self.shards
    }

    /// Records that `node` leads `shard` in `term`, if that is news (a
    /// higher term, or the same term's first report); returns whether the
    /// map changed (its version stays: leaders are ordered by terms).
    pub fn set_leader(&mut self, shard: ShardId, node: NodeId, term: u64) -> Result<bool, MapError> {
        let sh = self.shards.get_mut(shard as usize).ok_or(MapError::Shards(shard))?;
        if !sh.replicas.contains(&node) {
            return Err(MapError::Leader { shard, node });
        }
        let news = term > sh.term || (term == sh.term && sh.leader.is_none());
        if news {
            sh.leader = Some(node);
            sh.term = term;
        }
        Ok(news)
    }

    /// Forgets that `node` leads `shard` (its replica there stopped), if the
    /// map says it does; returns whether the map changed. The term stays:
    /// the next leader's report, of that term or a later one, is news.
    pub fn forget_leader(&mut self, shard: ShardId, node: NodeId) -> bool {
        match self.shards.get_mut(shard as usize) {
            Some(sh) if sh.leader == Some(node) => {
                sh.leader = None;
                true
            }
            _ => false,
        }
    }

    /// The map as sent to clients (`local` left for the node to fill in).
    pub fn to_proto(&self) -> crate::proto::ClusterMapReply {
        crate::proto::ClusterMapReply {
            version: self.version,
            partitions: self.partitions.clone(),
            shards: self
                .shards
                .iter()
                .map(|s| crate::proto::ShardEntry {
                    id: s.id,
                    replicas: s.replicas.clone(),
                    leader: s.leader.unwrap_or(0),
                    term: s.term,
                })
                .collect(),
            nodes: self.nodes.iter().map(|(&id, rpc)| crate::proto::NodeAddr { id, rpc: rpc.clone() }).collect(),
            moving: self.moving.map(|m| crate::proto::MapMove {
                partition: m.partition,
                from: m.from,
                to: m.to,
                version: m.version,
                claim: m.claim,
                run: m.run,
                phase: m.phase.code(),
                rate_bytes: m.rate_bytes,
            }),
            history: self.history.iter().map(EndedMove::to_proto).collect(),
            ..Default::default()
        }
    }

    /// A map received from a node, checked before it is used.
    pub fn from_proto(m: &crate::proto::ClusterMapReply) -> Result<ClusterMap, MapError> {
        if m.shards.len() > MAX_SHARDS as usize {
            return Err(MapError::Shards(m.shards.len() as u32));
        }
        let map = ClusterMap {
            version: m.version,
            partitions: m.partitions.clone(),
            shards: m
                .shards
                .iter()
                .map(|s| ShardInfo {
                    id: s.id,
                    replicas: s.replicas.clone(),
                    leader: (s.leader != 0).then_some(s.leader),
                    term: s.term,
                })
                .collect(),
            nodes: m.nodes.iter().map(|n| (n.id, n.rpc.clone())).collect(),
            moving: match &m.moving {
                None => None,
                Some(m) => Some(Moving {
                    partition: m.partition,
                    from: m.from,
                    to: m.to,
                    version: m.version,
                    claim: m.claim,
                    run: m.run,
                    phase: MovePhase::of_code(m.phase).ok_or(MapError::Moving("a phase of no known kind"))?,
                    rate_bytes: m.rate_bytes,
                }),
            },
            history: m.history.iter().map(EndedMove::of_proto).collect(),
        };
        map.validate()?;
        Ok(map)
    }

    /// Groups `keys` (by index) by the shard that holds them, for a
    /// multi-get split per shard.
    pub fn split_by_shard<K: AsRef<[u8]>>(&self, keys: &[K]) -> BTreeMap<ShardId, Vec<usize>> {
        let mut out: BTreeMap<ShardId, Vec<usize>> = BTreeMap::new();
        for (i, k) in keys.iter().enumerate() {
            out.entry(self.shard_of(k.as_ref()).id).or_default().push(i);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: u64) -> BTreeMap<NodeId, String> {
        (1..=n).map(|i| (i, format!("127.0.0.1:{}", 7070 + i))).collect()
    }

    #[test]
    fn initial_maps_place_replicas_on_distinct_nodes_and_cover_every_partition() {
        let m = ClusterMap::initial(nodes(3), 8, 3).unwrap();
        assert_eq!(m.shards().len(), 8);
        for sh in m.shards() {
            assert_eq!(sh.replicas.len(), 3);
            let mut r = sh.replicas.clone();
            r.sort();
            r.dedup();
            assert_eq!(r.len(), 3, "{sh:?}");
        }
        // Leaders' load spreads: each node is first replica of some shard.
        for n in 1..=3 {
            assert!(m.shards().iter().any(|s| s.replicas[0] == n));
        }
        // Every key has a shard, and keys spread over all of them.
        let mut hit = vec![0u32; 8];
        for i in 0..10_000 {
            hit[m.shard_of(format!("k{i}").as_bytes()).id as usize] += 1;
        }
        assert!(hit.iter().all(|&h| (1000..1500).contains(&h)), "{hit:?}");
    }

    #[test]
    fn the_metadata_group_lives_on_the_first_three_nodes() {
        assert_eq!(meta_nodes([5, 2, 9, 1, 7]), vec![1, 2, 5]);
        assert_eq!(meta_nodes([4, 4]), vec![4]);
        let mut m = ClusterMap::initial(nodes(3), 4, 3).unwrap();
        let v = m.version;
        let p = m.partitions_of(1).next().unwrap();
        m.move_partition(p, 3).unwrap();
        assert_eq!((m.shard_of_partition(p), m.version), (Some(3), v + 1));
        assert_eq!(m.move_partition(p, 4), Err(MapError::UnknownShard { partition: p, shard: 4 }));
        assert!(m.move_partition(PARTITIONS, 0).is_err());
        assert_eq!(m.version, v + 1);
    }

    #[test]
    fn bad_parameters_and_bad_maps_are_refused() {
        assert_eq!(ClusterMap::initial(BTreeMap::new(), 1, 1), Err(MapError::NoNodes));
        assert_eq!(ClusterMap::initial(nodes(2), 0, 1), Err(MapError::Shards(0)));
        assert_eq!(ClusterMap::initial(nodes(2), 4, 3), Err(MapError::ReplicationFactor { rf: 3, nodes: 2 }));
        let good = ClusterMap::initial(nodes(3), 4, 3).unwrap();
        let mut m = good.clone();
        m.partitions[7] = 99;
        assert_eq!(m.validate(), Err(MapError::UnknownShard { partition: 7, shard: 99 }));
        let mut m = good.clone();
        m.shards[1].replicas[2] = m.shards[1].replicas[0];
        assert_eq!(m.validate(), Err(MapError::Replicas(1)));
        let mut m = good.clone();
        m.shards[2].replicas[0] = 42;
        assert_eq!(m.validate(), Err(MapError::UnknownNode { shard: 2, node: 42 }));
        let mut m = good;
        m.partitions.pop();
        assert_eq!(m.validate(), Err(MapError::PartitionCount(PARTITIONS as usize - 1)));
    }

    #[test]
    fn leaders_change_only_forward_and_leave_the_version() {
        let mut m = ClusterMap::initial(nodes(3), 2, 3).unwrap();
        let v = m.version;
        assert_eq!(m.set_leader(0, 2, 5), Ok(true));
        assert_eq!(m.set_leader(0, 1, 4), Ok(false), "an older term is old news");
        assert_eq!(m.set_leader(0, 3, 5), Ok(false), "one leader per term");
        assert_eq!(m.set_leader(0, 3, 6), Ok(true));
        assert_eq!(m.shards()[0].leader, Some(3));
        assert_eq!(m.set_leader(0, 9, 7), Err(MapError::Leader { shard: 0, node: 9 }));
        assert!(m.forget_leader(0, 3));
        assert_eq!(m.version, v, "the placement did not change");
    }

    #[test]
    fn maps_survive_the_wire_and_bad_ones_are_refused() {
        let mut m = ClusterMap::initial(nodes(3), 5, 3).unwrap();
        m.set_leader(3, 2, 7).unwrap();
        let p = m.to_proto();
        assert_eq!(ClusterMap::from_proto(&p), Ok(m));
        let mut bad = p.clone();
        bad.shards[1].leader = 42;
        assert_eq!(ClusterMap::from_proto(&bad), Err(MapError::Leader { shard: 1, node: 42 }));
        let mut bad = p;
        bad.partitions.truncate(3);
        assert_eq!(ClusterMap::from_proto(&bad), Err(MapError::PartitionCount(3)));
    }

    #[test]
    fn multi_gets_split_per_shard_keep_every_key_once() {
        let m = ClusterMap::initial(nodes(3), 4, 3).unwrap();
        let keys: Vec<String> = (0..100).map(|i| format!("key{i}")).collect();
        let split = m.split_by_shard(&keys);
        let mut all: Vec<usize> = split.values().flatten().copied().collect();
        all.sort();
        assert_eq!(all, (0..100).collect::<Vec<_>>());
        for (s, idx) in &split {
            assert!(idx.iter().all(|&i| m.shard_of(keys[i].as_bytes()).id == *s));
            assert!(idx.iter().all(|&i| m.partitions_of(*s).any(|p| p == partition_of(keys[i].as_bytes()))));
        }
        assert_eq!((0..4).map(|s| m.partitions_of(s).count()).sum::<usize>(), PARTITIONS as usize);
    }
}

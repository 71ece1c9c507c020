//! Where replicas go when a node joins or leaves: pure (the shards'
//! placement in, replica moves out), so the choices are tested as a
//! function; `dmkv cluster add-node` and `remove-node` carry the moves
//! out one at a time (each through `move-replica`: the new replica joins
//! and catches up before the old one leaves, docs/elasticity.md).

use std::collections::BTreeMap;

use super::map::{NodeId, ShardId};

/// Shard `shard`'s replica on node `from` goes to node `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaMove {
    pub shard: ShardId,
    pub from: NodeId,
    pub to: NodeId,
}

/// Replicas per node, every node of `nodes` counted (zero included).
fn counts(shards: &[(ShardId, Vec<NodeId>)], nodes: &[NodeId]) -> BTreeMap<NodeId, usize> {
    let mut c: BTreeMap<NodeId, usize> = nodes.iter().map(|&n| (n, 0)).collect();
    for (_, on) in shards {
        for n in on {
            *c.entry(*n).or_default() += 1;
        }
    }
    c
}

/// The moves that give `node` its share of replicas: while it holds fewer
/// than the mean per node (rounded down) of `nodes`, a replica of a shard
/// it does not hold, taken from the node holding the most (lowest id of
/// equals, so the plan is the same on every run).
pub fn plan_add(shards: &[(ShardId, Vec<NodeId>)], nodes: &[NodeId], node: NodeId) -> Vec<ReplicaMove> {
    let mut now: Vec<(ShardId, Vec<NodeId>)> = shards.to_vec();
    let total: usize = now.iter().map(|(_, on)| on.len()).sum();
    let share = total / nodes.len().max(1);
    let mut moves = Vec::new();
    // Each move raises `node`'s count by one: bounded by `share`.
    while counts(&now, nodes).get(&node).copied().unwrap_or(0) < share {
        let c = counts(&now, nodes);
        let pick = now
            .iter()
            .enumerate()
            .filter(|(_, (_, on))| !on.contains(&node))
            .flat_map(|(i, (_, on))| on.iter().map(move |&n| (i, n)))
            .filter(|&(_, n)| c[&n] > c[&node] + 1)
            .max_by_key(|&(i, n)| (c[&n], std::cmp::Reverse(n), std::cmp::Reverse(i)));
        let Some((i, from)) = pick else { break };
        let (shard, on) = &mut now[i];
        let at = on.iter().position(|&n| n == from).expect("picked from its nodes");
        on[at] = node;
        moves.push(ReplicaMove { shard: *shard, from, to: node });
    }
    moves
}

/// The moves that empty `node`: each of its replicas to the node of
/// `nodes` holding the fewest (lowest id of equals) that does not hold
/// that shard; an error naming the first shard no other node can take.
pub fn plan_remove(
    shards: &[(ShardId, Vec<NodeId>)],
    nodes: &[NodeId],
    node: NodeId,
) -> Result<Vec<ReplicaMove>, String> {
    let mut now: Vec<(ShardId, Vec<NodeId>)> = shards.to_vec();
    let mut moves = Vec::new();
    for i in 0..now.len() {
        let Some(at) = now[i].1.iter().position(|&n| n == node) else { continue };
        let c = counts(&now, nodes);
        let to = nodes
            .iter()
            .copied()
            .filter(|n| *n != node && !now[i].1.contains(n))
            .min_by_key(|n| (c[n], *n))
            .ok_or_else(|| {
                format!("shard {} is on every other node already: no node can take its replica", now[i].0)
            })?;
        now[i].1[at] = to;
        moves.push(ReplicaMove { shard: now[i].0, from: node, to });
    }
    Ok(moves)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` shards of 3 replicas round-robin over nodes 1..=3.
    fn three_nodes(n: u32) -> Vec<(ShardId, Vec<NodeId>)> {
        (0..n).map(|s| (s, (0..3).map(|i| 1 + (u64::from(s) + i) % 3).collect())).collect()
    }

    fn holds_each_shard_once(shards: &[(ShardId, Vec<NodeId>)]) -> bool {
        shards.iter().all(|(_, on)| {
            let mut v = on.clone();
            v.sort_unstable();
            v.dedup();
            v.len() == on.len()
        })
    }

    fn apply(shards: &mut [(ShardId, Vec<NodeId>)], moves: &[ReplicaMove]) {
        for m in moves {
            let on = &mut shards.iter_mut().find(|(s, _)| *s == m.shard).unwrap().1;
            let at = on.iter().position(|&n| n == m.from).unwrap();
            on[at] = m.to;
        }
    }

    #[test]
    fn a_new_node_takes_its_share_from_the_fullest_and_never_two_of_a_shard() {
        let mut shards = three_nodes(6);
        let nodes = [1, 2, 3, 4];
        let moves = plan_add(&shards, &nodes, 4);
        // 18 replicas over 4 nodes: the new one takes 4.
        assert_eq!(moves.len(), 4, "{moves:?}");
        apply(&mut shards, &moves);
        assert!(holds_each_shard_once(&shards), "{shards:?}");
        let c = counts(&shards, &nodes);
        assert_eq!(c.values().copied().max().unwrap() - c.values().copied().min().unwrap(), 1, "{c:?}");
        assert!(plan_add(&shards, &nodes, 4).is_empty(), "asked again, nothing more moves");
        // Three shards on three nodes: the fourth takes two.
        assert_eq!(plan_add(&three_nodes(3), &nodes, 4).len(), 2);
    }

    #[test]
    fn a_node_removed_gives_each_replica_to_the_emptiest_node_without_that_shard() {
        let mut shards = three_nodes(6);
        let nodes = [1, 2, 3, 4];
        let add = plan_add(&shards, &nodes, 4);
        apply(&mut shards, &add);
        let moves = plan_remove(&shards, &nodes, 2).unwrap();
        apply(&mut shards, &moves);
        assert!(shards.iter().all(|(_, on)| !on.contains(&2)), "{shards:?}");
        assert!(holds_each_shard_once(&shards), "{shards:?}");
        let c = counts(&shards, &[1, 3, 4]);
        assert!(c.values().all(|&n| n == 6), "{c:?}");
        // With three nodes of three replicas each, none can take node 3's.
        let err = plan_remove(&three_nodes(3), &[1, 2, 3], 3).unwrap_err();
        assert!(err.contains("every other node"), "{err}");
    }
}

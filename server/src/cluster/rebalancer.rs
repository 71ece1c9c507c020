//! The rebalancer: measures every shard (a census at its leader: its
//! memory and each partition's bytes), plans with
//! `dmkv_common::cluster::rebalance::plan`, and on the node leading the
//! metadata group carries the plan's partition moves out in the
//! background, one at a time (the map holds one move at a time), each
//! paced at the rate asked, so foreground requests keep their share. The
//! plan's leader transfers are returned for the caller to ask of each
//! shard's leader (`dmkv cluster rebalance` does).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use dmkv_common::cluster::map::{ShardId, partition_of};
use dmkv_common::cluster::rebalance::{self, Plan, ShardLoad};
use dmkv_common::proto::{self, move_work::Work};

use super::move_ask::{MoveAnswer, MoveAsk};
use super::node::{ClusterError, ClusterNode};

/// Tries of one shard's census while it is between leaders (5 s).
const CENSUS_TRIES: u32 = 50;
/// Pause between two moves of a rebalance. Each flip costs every client
/// reading either shard one-sided a map refresh (a round trip) on its
/// next GET; moves back to back (tens a second for small partitions) made
/// that a few percent of GETs, and GET p99 several times idle
/// (docs/elasticity.md, "Rebalancing").
pub const REBALANCE_MOVE_GAP: std::time::Duration = std::time::Duration::from_secs(1);

impl ClusterNode {
    /// The bytes and keys of each partition `shard` (led here) holds
    /// items of, from a view of its store, and the shard's memory.
    pub(super) async fn census(&self, shard: ShardId) -> Result<proto::MoveWorkReply, ClusterError> {
        let r = self.leading(shard)?;
        let r = &*r;
        let capacity = r.store.region().len() as u64;
        let MoveAnswer::View { view, .. } = self.ask_leader(r, MoveAsk::View).await? else {
            return Err(ClusterError::Failed("the shard answered notes for a view".into()));
        };
        let walked = tokio::task::spawn_blocking(move || {
            let mut per: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
            view.walk(|it| {
                let e = per.entry(partition_of(it.key)).or_default();
                e.0 += (it.key.len() + it.value.len()) as u64;
                e.1 += 1;
                Ok(())
            })
            .map(|()| per)
        })
        .await
        .map_err(|e| ClusterError::Failed(e.to_string()))?
        .map_err(|e| ClusterError::Failed(format!("walking the shard: {e}")))?;
        let partitions = walked
            .into_iter()
            .map(|(partition, (bytes, keys))| proto::PartitionLoad { partition, bytes, keys })
            .collect();
        Ok(proto::MoveWorkReply { partitions, capacity, ..Default::default() })
    }

    /// Plans a rebalance from a census of every shard; unless `dry_run`,
    /// starts its partition moves in the background (each at `rate`
    /// bytes a second). This node's replica must lead the metadata group.
    pub async fn rebalance(
        self: Arc<Self>,
        dry_run: bool,
        rate: u64,
    ) -> Result<proto::MovePartitionReply, ClusterError> {
        let (map, _) = self.meta_map().await?;
        if let Some(m) = map.moving {
            return Err(ClusterError::Failed(format!(
                "partition {} is moving ({}): rebalance once it ended",
                m.partition,
                m.phase.name()
            )));
        }
        if !dry_run && self.rebalancing.load(Ordering::Acquire) {
            return Err(ClusterError::Failed("a rebalance is running on this node".into()));
        }
        let leaders = self.map();
        let mut loads = Vec::new();
        for sh in map.shards() {
            let got = self.step(sh.id, Work::Census(proto::MoveCensus {}), CENSUS_TRIES).await?;
            // Only what the shard owns (not a stopped move's leftovers).
            let partitions = got
                .partitions
                .iter()
                .filter(|p| map.shard_of_partition(p.partition) == Some(sh.id))
                .map(|p| (p.partition, p.bytes))
                .collect();
            let leader = leaders.shards().iter().find(|s| s.id == sh.id).and_then(|s| s.leader);
            loads.push(ShardLoad {
                shard: sh.id,
                capacity: got.capacity,
                nodes: sh.replicas.clone(),
                leader,
                partitions,
            });
        }
        let plan = rebalance::plan(&loads, rebalance::MAX_PLANNED_MOVES);
        tracing::info!(
            moves = plan.moves.len(),
            leads = plan.leads.len(),
            fill_before = plan.fill_before,
            fill_after = plan.fill_after,
            dry_run,
            "rebalance planned"
        );
        let mut reply = reply_of(&plan);
        if dry_run || plan.moves.is_empty() {
            reply.outcome = "planned".into();
            return Ok(reply);
        }
        if self.rebalancing.swap(true, Ordering::AcqRel) {
            return Err(ClusterError::Failed("a rebalance is running on this node".into()));
        }
        reply.outcome = "started".into();
        let node = Arc::clone(&self);
        tokio::spawn(async move {
            // Cleared however the task ends.
            struct Running(Arc<ClusterNode>);
            impl Drop for Running {
                fn drop(&mut self) {
                    self.0.rebalancing.store(false, Ordering::Release);
                }
            }
            let running = Running(node);
            running.0.carry_out(plan, rate).await;
        });
        Ok(reply)
    }

    /// The plan's moves, one at a time; stops at the first that fails (a
    /// rebalance asked again plans from the cluster as it is then).
    async fn carry_out(&self, plan: Plan, rate: u64) {
        let total = plan.moves.len();
        for (i, m) in plan.moves.into_iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(REBALANCE_MOVE_GAP).await;
            }
            match self.move_partition(m.partition, m.to, rate).await {
                Ok(r) => tracing::info!(
                    partition = m.partition,
                    from = m.from,
                    to = m.to,
                    pause_us = r.pause_us,
                    "rebalance: move {} of {total} done",
                    i + 1
                ),
                Err(e) => {
                    tracing::warn!(partition = m.partition, "rebalance stopped at move {} of {total}: {e:?}", i + 1);
                    return;
                }
            }
        }
        tracing::info!(moves = total, "rebalance done");
    }
}

fn reply_of(plan: &Plan) -> proto::MovePartitionReply {
    proto::MovePartitionReply {
        planned: plan
            .moves
            .iter()
            .map(|m| proto::RebalanceMove { partition: m.partition, from: m.from, to: m.to, bytes: m.bytes })
            .collect(),
        leads: plan.leads.iter().map(|l| proto::RebalanceLead { shard: l.shard, from: l.from, to: l.to }).collect(),
        fill_before: plan.fill_before,
        fill_after: plan.fill_after,
        nodes_before: plan.nodes_before,
        nodes_after: plan.nodes_after,
        ..Default::default()
    }
}

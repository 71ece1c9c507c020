//! Leadership moved by an operator (`dmkv cluster transfer-leader`): the
//! shard's leader gives its lease up and hands over to the node named,
//! once that node's replica has matched its log (so a transfer that raft
//! would give up is not begun: it would cost the lease for the rest of the
//! term); the answer comes once the leadership moved.

use std::sync::atomic::Ordering;
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use dmkv_common::cluster::map::{NodeId, ShardId, node_of};
use dmkv_common::proto;

use super::node::{ClusterError, ClusterNode};
use super::shard::NoHandOver;

/// Most a transfer waits for the voter to catch up before it begins.
pub const MAX_TRANSFER_WAIT: Duration = Duration::from_secs(5);
/// Most the shard's thread may take to answer an ask made just before the
/// deadline (it answers every ask; a late one without beginning it).
const ANSWER_GRACE: Duration = Duration::from_secs(1);
/// Most a begun transfer waits for the voter to lead: raft gives it up
/// after an election timeout (at most 300 ms), and the new leader's status
/// is published at its next tick.
pub const MAX_TAKE_OVER_WAIT: Duration = Duration::from_secs(2);
/// How often the leader is asked again while the voter catches up, and
/// how often the replica's leader is looked at once it began.
const TRANSFER_POLL: Duration = Duration::from_millis(20);

impl ClusterNode {
    /// Hands shard `shard`'s leadership, led here, to node `to`'s replica.
    /// NOT_LEADER (naming the leader) if this node does not lead it.
    pub async fn transfer_leader(
        &self,
        shard: ShardId,
        to: NodeId,
    ) -> Result<proto::TransferLeaderReply, ClusterError> {
        let map = self.map();
        if shard != dmkv_common::cluster::map::META_SHARD && !map.shards().iter().any(|s| s.id == shard) {
            return Err(ClusterError::Failed(format!(
                "shard {shard} does not exist: there are {}",
                map.shards().len()
            )));
        }
        if !map.nodes.contains_key(&to) {
            return Err(ClusterError::Failed(format!("node {to} is not in the cluster")));
        }
        let r = self.leading(shard)?;
        let r = &*r;
        let term = || r.status.term.load(Ordering::Relaxed);
        if to == self.id {
            return Ok(proto::TransferLeaderReply { from: self.id, to, term: term() });
        }
        let deadline = Instant::now() + MAX_TRANSFER_WAIT;
        let mut last = NoHandOver::Behind;
        let replica = loop {
            let answer = match r.thread.hand_over(Some((to, deadline))) {
                Some(rx) => {
                    // The thread answers every ask (one past the deadline
                    // with Behind, without beginning it).
                    let left = deadline.saturating_duration_since(Instant::now()) + ANSWER_GRACE;
                    tokio::task::spawn_blocking(move || rx.recv_timeout(left))
                        .await
                        .map_err(|e| ClusterError::Failed(e.to_string()))?
                        .map_err(|e| match e {
                            RecvTimeoutError::Disconnected => ClusterError::Failed(format!(
                                "shard {shard}'s replica here stopped: ask its next leader"
                            )),
                            RecvTimeoutError::Timeout => ClusterError::Failed(format!(
                                "shard {shard}'s thread did not answer within {:?} (busy): node {} still leads, \
                                 unchanged",
                                MAX_TRANSFER_WAIT + ANSWER_GRACE,
                                self.id
                            )),
                        })
                        .map(Some)?
                }
                None if r.status.role() == "stopped" => {
                    return Err(ClusterError::Failed(format!(
                        "shard {shard}'s replica here stopped: ask its next leader"
                    )));
                }
                // Its queue is full: asked again.
                None => None,
            };
            match answer {
                Some(Ok(replica)) => break replica,
                Some(Err(NoHandOver::NotLeader)) => {
                    return Err(self.leading(shard).err().unwrap_or(ClusterError::Busy));
                }
                Some(Err(NoHandOver::NotAVoter | NoHandOver::Alone)) => {
                    return Err(ClusterError::Failed(format!("node {to} holds no voting replica of shard {shard}")));
                }
                Some(Err(e @ (NoHandOver::Behind | NoHandOver::NoVoterHeard))) => last = e,
                None => {}
            }
            if Instant::now() >= deadline {
                let why = match last {
                    NoHandOver::NoVoterHeard => "has not been heard from lately",
                    _ => "has not caught up with the shard's committed entries",
                };
                return Err(ClusterError::Failed(format!(
                    "node {to}'s replica of shard {shard} {why} within {MAX_TRANSFER_WAIT:?}: node {} still leads, \
                     unchanged",
                    self.id
                )));
            }
            tokio::time::sleep(TRANSFER_POLL).await;
        };
        // Begun: this replica gave its lease up. Raft completes it once the
        // voter campaigns, or gives it up after an election timeout.
        let taken_by = Instant::now() + MAX_TAKE_OVER_WAIT;
        loop {
            let leader = r.status.leader.load(Ordering::Relaxed);
            if leader == replica {
                return Ok(proto::TransferLeaderReply { from: self.id, to, term: term() });
            }
            if leader != 0 && node_of(leader) != self.id && !r.status.is_leader() {
                return Err(ClusterError::Failed(format!(
                    "shard {shard} elected node {}, not node {to}, during the transfer",
                    node_of(leader)
                )));
            }
            if Instant::now() >= taken_by {
                return Err(ClusterError::Failed(format!(
                    "node {to} did not take shard {shard} over within {MAX_TAKE_OVER_WAIT:?} of the transfer's \
                     start (raft gives a transfer up after an election timeout): node {} leads on, without a lease \
                     for the rest of term {}",
                    self.id,
                    term()
                )));
            }
            tokio::time::sleep(TRANSFER_POLL).await;
        }
    }
}

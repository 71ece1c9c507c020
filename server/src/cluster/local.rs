//! The shard replicas a node holds, as peers' raft traffic sees them: a
//! [`RaftSink`] that hands each message to its shard's thread.

use std::collections::HashMap;
use std::sync::RwLock;

use raft::prelude::Message;

use super::wire::RaftSink;

/// Delivers a message to one shard thread (its inbox).
pub type Inbox = Box<dyn Fn(Message) + Send + Sync>;

/// This node's shard replicas, by shard id: replicas open and close while
/// the node runs (docs/elasticity.md, "Adding and removing nodes").
#[derive(Default)]
pub struct LocalShards {
    inboxes: RwLock<HashMap<u32, Inbox>>,
}

impl LocalShards {
    /// Registers shard `shard`'s inbox.
    pub fn insert(&self, shard: u32, inbox: Inbox) {
        self.inboxes.write().unwrap_or_else(std::sync::PoisonError::into_inner).insert(shard, inbox);
    }

    /// Forgets shard `shard`'s inbox: its messages are dropped from now on.
    pub fn remove(&self, shard: u32) {
        self.inboxes.write().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&shard);
    }
}

impl RaftSink for LocalShards {
    fn deliver(&self, from: u64, msgs: Vec<(u32, Message)>) -> usize {
        let mut accepted = 0;
        let inboxes = self.inboxes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (shard, m) in msgs {
            // A message must come from the node it says it is from: a raft
            // id holds its node's id, and the service takes a batch only
            // from a connection of the node it names (`identity`).
            if dmkv_common::cluster::map::node_of(m.from) != from {
                continue;
            }
            if let Some(inbox) = inboxes.get(&shard) {
                inbox(m);
                accepted += 1;
            }
        }
        accepted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn messages_reach_their_shard_only_from_their_sender() {
        let got: Arc<Mutex<Vec<(u32, u64)>>> = Arc::default();
        let local = LocalShards::default();
        for shard in [1, 2] {
            let got = Arc::clone(&got);
            local.insert(shard, Box::new(move |m: Message| got.lock().unwrap().push((shard, m.term))));
        }
        // From replicas of node 7 (any incarnation), and one of node 8.
        let msg = |node: u64, term| Message { from: (node << 32) | 5, term, ..Default::default() };
        let n = local.deliver(7, vec![(1, msg(7, 10)), (2, msg(7, 11)), (3, msg(7, 12)), (1, msg(8, 13))]);
        assert_eq!(n, 2, "shard 3 is not here; node 8 did not send this batch");
        assert_eq!(*got.lock().unwrap(), vec![(1, 10), (2, 11)]);
    }
}

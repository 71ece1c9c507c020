//! Raft messages between nodes: raft-rs's own (protobuf 2) encoding as
//! opaque bytes inside our prost protocol, batched per node pair. Decoding
//! is bounded and never panics: a peer's bytes are not trusted even after
//! it authenticated.

use dmkv_common::proto::{RaftBatch, RaftEnvelope};
use protobuf::Message as _;
use raft::prelude::Message;
use thiserror::Error;

/// Most raft messages in one batch.
pub const MAX_BATCH_MESSAGES: usize = 4096;
/// Largest raft message accepted in one piece (entries of maximum PUTs,
/// with room).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Why a batch was refused (all of it: a peer that sends garbage is
/// disconnected, raft retransmits).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("batch of {0} messages is over the limit of {MAX_BATCH_MESSAGES}")]
    TooMany(usize),
    #[error("raft message of {0} bytes is over the limit of {MAX_MESSAGE_BYTES}")]
    TooLarge(usize),
    #[error("raft message for shard {shard} does not decode: {why}")]
    Malformed { shard: u32, why: String },
    #[error("raft messages in parts are not taken (snapshots travel apart, as snapshot chunks)")]
    Parts,
}

/// Where a node hands peers' raft messages: its local shard replicas.
pub trait RaftSink: Send + Sync {
    /// Delivers messages from node `from`; returns how many named a shard
    /// this node holds (the rest are dropped).
    fn deliver(&self, from: u64, msgs: Vec<(u32, Message)>) -> usize;
}

/// Batches `msgs` (shard, message) from node `from`.
pub fn encode(from: u64, msgs: &[(u32, Message)]) -> RaftBatch {
    RaftBatch {
        from_node: from,
        messages: msgs
            .iter()
            .map(|(shard, m)| RaftEnvelope {
                shard: *shard,
                message: m.write_to_bytes().expect("a raft message always encodes").into(),
                part: 0,
                parts: 0,
            })
            .collect(),
    }
}

/// Decodes a batch into (shard, message) pairs, or refuses all of it.
pub fn decode(batch: &RaftBatch) -> Result<Vec<(u32, Message)>, WireError> {
    if batch.messages.len() > MAX_BATCH_MESSAGES {
        return Err(WireError::TooMany(batch.messages.len()));
    }
    batch
        .messages
        .iter()
        .map(|env| {
            if env.parts > 1 {
                return Err(WireError::Parts);
            }
            if env.message.len() > MAX_MESSAGE_BYTES {
                return Err(WireError::TooLarge(env.message.len()));
            }
            Message::parse_from_bytes(&env.message)
                .map(|m| (env.shard, m))
                .map_err(|e| WireError::Malformed { shard: env.shard, why: e.to_string() })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use raft::prelude::{Entry, MessageType};

    #[test]
    fn messages_round_trip() {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgAppend);
        m.to = 2;
        m.from = 1;
        m.term = 7;
        m.entries = vec![Entry { index: 5, term: 7, data: b"put".to_vec().into(), ..Default::default() }].into();
        let batch = encode(1, &[(3, m.clone()), (4, Message::default())]);
        let back = decode(&batch).unwrap();
        assert_eq!(back, vec![(3, m), (4, Message::default())]);
    }

    #[test]
    fn oversized_batches_are_refused_whole() {
        let env = RaftEnvelope { shard: 0, message: Default::default(), part: 0, parts: 0 };
        let many = RaftBatch { from_node: 1, messages: vec![env; MAX_BATCH_MESSAGES + 1] };
        assert_eq!(decode(&many), Err(WireError::TooMany(MAX_BATCH_MESSAGES + 1)));
    }

    #[test]
    fn messages_in_parts_are_refused() {
        let env = RaftEnvelope { shard: 0, message: Default::default(), part: 0, parts: 3 };
        assert_eq!(decode(&RaftBatch { from_node: 1, messages: vec![env] }), Err(WireError::Parts));
    }

    proptest! {
        /// A peer's bytes: decoded or refused, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let env = RaftEnvelope { shard: 1, message: bytes.into(), part: 0, parts: 0 };
            let batch = RaftBatch { from_node: 1, messages: vec![env] };
            let _ = decode(&batch);
        }
    }
}

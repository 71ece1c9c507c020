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
/// Largest raft message accepted in parts: a snapshot of a shard's items.
/// Parts are kept as they arrive, so memory follows what was sent.
pub const MAX_ASSEMBLED_BYTES: usize = 64 << 30;

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
    #[error("raft message in parts: {0}")]
    Parts(String),
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

/// One message too large for a frame as batches of one part each, of at
/// most `part_bytes` bytes.
pub fn encode_parts(from: u64, shard: u32, m: &Message, part_bytes: usize) -> Vec<RaftBatch> {
    let bytes = m.write_to_bytes().expect("a raft message always encodes");
    let chunks: Vec<&[u8]> = bytes.chunks(part_bytes.max(1)).collect();
    let parts = chunks.len() as u32;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| RaftBatch {
            from_node: from,
            messages: vec![RaftEnvelope { shard, message: c.to_vec().into(), part: i as u32, parts }],
        })
        .collect()
}

/// A connection's message in parts, as far as it arrived.
#[derive(Default)]
pub struct Assembler {
    partial: Option<Partial>,
}

struct Partial {
    shard: u32,
    from: u64,
    parts: u32,
    next: u32,
    bytes: Vec<u8>,
}

impl Assembler {
    /// Decodes a batch: its messages, or, for a part, the whole message
    /// once its last part came (nothing before). A batch out of place
    /// (a part not the next, a whole batch between parts) drops the
    /// message being assembled and is refused.
    pub fn accept(&mut self, batch: &RaftBatch) -> Result<Vec<(u32, Message)>, WireError> {
        let part = match batch.messages.as_slice() {
            [env] if env.parts > 1 => env,
            _ => {
                if self.partial.take().is_some() {
                    return Err(WireError::Parts("a batch came before the last part".into()));
                }
                return decode(batch);
            }
        };
        let p = self.partial.get_or_insert_with(|| Partial {
            shard: part.shard,
            from: batch.from_node,
            parts: part.parts,
            next: 0,
            bytes: Vec::new(),
        });
        if (p.shard, p.from, p.parts, p.next) != (part.shard, batch.from_node, part.parts, part.part) {
            self.partial = None;
            return Err(WireError::Parts(format!("part {} of {} out of place", part.part, part.parts)));
        }
        if p.bytes.len() + part.message.len() > MAX_ASSEMBLED_BYTES {
            self.partial = None;
            return Err(WireError::TooLarge(MAX_ASSEMBLED_BYTES + 1));
        }
        p.bytes.extend_from_slice(&part.message);
        p.next += 1;
        if p.next < p.parts {
            return Ok(Vec::new());
        }
        let p = self.partial.take().expect("assembling");
        Message::parse_from_bytes(&p.bytes)
            .map(|m| vec![(p.shard, m)])
            .map_err(|e| WireError::Malformed { shard: p.shard, why: e.to_string() })
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
    fn a_message_in_parts_arrives_whole_and_parts_out_of_place_are_refused() {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgSnapshot);
        m.to = 2;
        m.mut_snapshot().data = vec![7u8; 10_000].into();
        let parts = encode_parts(1, 3, &m, 999);
        assert!(parts.len() > 10);
        let mut a = Assembler::default();
        for p in &parts[..parts.len() - 1] {
            assert_eq!(a.accept(p).unwrap(), vec![]);
        }
        assert_eq!(a.accept(parts.last().unwrap()).unwrap(), vec![(3, m.clone())]);
        // A part skipped, a part from another sender, a whole batch between.
        let mut a = Assembler::default();
        a.accept(&parts[0]).unwrap();
        assert!(matches!(a.accept(&parts[2]), Err(WireError::Parts(_))));
        a.accept(&parts[0]).unwrap();
        let mut other = parts[1].clone();
        other.from_node = 9;
        assert!(matches!(a.accept(&other), Err(WireError::Parts(_))));
        a.accept(&parts[0]).unwrap();
        assert!(matches!(a.accept(&encode(1, &[(3, Message::default())])), Err(WireError::Parts(_))));
        // And it starts over cleanly.
        for p in &parts[..parts.len() - 1] {
            a.accept(p).unwrap();
        }
        assert_eq!(a.accept(parts.last().unwrap()).unwrap(), vec![(3, m)]);
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

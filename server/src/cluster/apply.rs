//! Applying a shard's committed log entries to its store: every replica
//! applies the same commands in the same order, so their stores hold the
//! same keys, values and versions.

use dmkv_common::error::Error;
use dmkv_common::proto::{self, raft_command::Op};
use prost::Message;
use thiserror::Error;

use crate::store::Store;

/// What applying one entry did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// An entry with no command (a new leader's empty entry).
    Nothing,
    Put {
        version: u64,
    },
    Delete {
        existed: bool,
    },
}

/// Why an entry could not be applied.
#[derive(Debug, Error)]
pub enum ApplyError {
    /// The entry is not a command this build knows: the log came from
    /// somewhere else, or a newer version. Applying nothing would let the
    /// replicas diverge, so the shard stops.
    #[error("log entry is not a command: {0}")]
    Malformed(String),
    /// The store refused (out of memory, index full): the leader checks
    /// room before it proposes, so on a follower this means its memory
    /// differs from the leader's.
    #[error("store refused the command: {0}")]
    Store(#[from] Error),
}

/// Writes whose outcome a shard remembers, so that one sent again is
/// applied once: the last this many, in apply order (the same on every
/// replica, so every replica forgets the same ones).
pub const MAX_REMEMBERED_WRITES: usize = 64 * 1024;

/// The log entry data of a PUT.
pub fn encode_put(key: &[u8], value: &[u8]) -> Vec<u8> {
    encode_put_with(key, value, None)
}

/// The log entry data of a PUT carrying the client's write id.
pub fn encode_put_with(key: &[u8], value: &[u8], write_id: Option<proto::WriteId>) -> Vec<u8> {
    let op =
        Op::Put(proto::Put { key: key.to_vec().into(), value: value.to_vec().into(), write_id, ..Default::default() });
    proto::RaftCommand { op: Some(op), ..Default::default() }.encode_to_vec()
}

/// The log entry data of a DELETE.
pub fn encode_delete(key: &[u8]) -> Vec<u8> {
    encode_delete_with(key, None)
}

/// The log entry data of a DELETE carrying the client's write id.
pub fn encode_delete_with(key: &[u8], write_id: Option<proto::WriteId>) -> Vec<u8> {
    let op = Op::Delete(proto::Delete { key: key.to_vec().into(), write_id, cas: 0 });
    proto::RaftCommand { op: Some(op), ..Default::default() }.encode_to_vec()
}

/// The outcomes of the last [`MAX_REMEMBERED_WRITES`] identified writes
/// (part of the state machine: rebuilt by replaying the log).
#[derive(Debug, Default)]
pub struct Remembered {
    outcomes: std::collections::HashMap<(u64, u64), Applied>,
    order: std::collections::VecDeque<(u64, u64)>,
}

impl Remembered {
    /// The remembered writes, oldest first: ((client, seq), outcome).
    pub fn entries(&self) -> impl Iterator<Item = ((u64, u64), &Applied)> {
        self.order.iter().filter_map(|id| self.outcomes.get(id).map(|a| (*id, a)))
    }

    /// Remembers `entries` (oldest first), as a snapshot carried them.
    pub fn from_entries(entries: impl IntoIterator<Item = ((u64, u64), Applied)>) -> Remembered {
        let mut r = Remembered::default();
        for ((client, seq), a) in entries {
            r.insert(Some(&proto::WriteId { client, seq }), &a);
        }
        r
    }

    fn get(&self, id: Option<&proto::WriteId>) -> Option<Applied> {
        id.and_then(|w| self.outcomes.get(&(w.client, w.seq)).cloned())
    }

    fn insert(&mut self, id: Option<&proto::WriteId>, a: &Applied) {
        let Some(w) = id else { return };
        if self.outcomes.insert((w.client, w.seq), a.clone()).is_none() {
            self.order.push_back((w.client, w.seq));
        }
        while self.order.len() > MAX_REMEMBERED_WRITES {
            if let Some(old) = self.order.pop_front() {
                self.outcomes.remove(&old);
            }
        }
    }
}

/// Applies one committed entry's data to `store`.
pub fn apply(store: &Store, data: &[u8]) -> Result<Applied, ApplyError> {
    apply_once(store, &mut Remembered::default(), data)
}

/// [`apply`], except that a write whose id `seen` remembers is not
/// applied again: it is answered as the first time.
pub fn apply_once(store: &Store, seen: &mut Remembered, data: &[u8]) -> Result<Applied, ApplyError> {
    if data.is_empty() {
        return Ok(Applied::Nothing);
    }
    let cmd = proto::RaftCommand::decode(data).map_err(|e| ApplyError::Malformed(e.to_string()))?;
    let (id, result) = match cmd.op {
        Some(Op::Put(p)) => {
            if let Some(a) = seen.get(p.write_id.as_ref()) {
                return Ok(a);
            }
            (p.write_id, store.put(&p.key, &p.value).map(|version| Applied::Put { version }))
        }
        Some(Op::Delete(d)) => {
            if let Some(a) = seen.get(d.write_id.as_ref()) {
                return Ok(a);
            }
            (d.write_id, store.delete(&d.key).map(|existed| Applied::Delete { existed }))
        }
        Some(Op::Arith(_) | Op::Touch(_)) => return Err(ApplyError::Malformed("not yet".into())),
        None => return Err(ApplyError::Malformed("no operation".into())),
    };
    let applied = result?;
    seen.insert(id.as_ref(), &applied);
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn commands_round_trip_and_bad_entries_change_nothing() {
        let s = Store::format(Arc::new(Region::create("apply", 4 << 20).unwrap()), 64, 1, 1, Duration::ZERO).unwrap();
        assert_eq!(apply(&s, &encode_put(b"k", b"v")).unwrap(), Applied::Put { version: 1 });
        assert_eq!(apply(&s, &encode_delete(b"k")).unwrap(), Applied::Delete { existed: true });
        assert_eq!(apply(&s, &[]).unwrap(), Applied::Nothing);
        s.put(b"kept", b"1").unwrap();
        // Garbage, and a message with no operation (an unknown field only).
        for bad in [&b"\xff\xff\xff"[..], &[0x18, 0x01][..]] {
            let e = apply(&s, bad);
            assert!(matches!(e, Err(ApplyError::Malformed(_))), "{e:?}");
        }
        assert!(matches!(apply(&s, &encode_put(b"", b"v")), Err(ApplyError::Store(Error::EmptyKey))));
        assert_eq!(s.get(b"kept").unwrap().unwrap().0, bytes::Bytes::from_static(b"1"));
    }

    #[test]
    fn a_write_sent_again_applies_once() {
        let s = Store::format(Arc::new(Region::create("apply", 4 << 20).unwrap()), 64, 1, 1, Duration::ZERO).unwrap();
        let mut seen = Remembered::default();
        let id = |seq| Some(proto::WriteId { client: 7, seq });
        let put = encode_put_with(b"k", b"v", id(1));
        let first = apply_once(&s, &mut seen, &put).unwrap();
        // Another client's write in between, then the first one again.
        apply_once(&s, &mut seen, &encode_put_with(b"k", b"w", Some(proto::WriteId { client: 8, seq: 1 }))).unwrap();
        assert_eq!(apply_once(&s, &mut seen, &put).unwrap(), first, "answered as the first time");
        assert_eq!(s.get(b"k").unwrap().unwrap().0, bytes::Bytes::from_static(b"w"), "and not applied again");
        let del = encode_delete_with(b"k", id(2));
        assert_eq!(apply_once(&s, &mut seen, &del).unwrap(), Applied::Delete { existed: true });
        assert_eq!(apply_once(&s, &mut seen, &del).unwrap(), Applied::Delete { existed: true }, "a retried DELETE");
        // Without an id every copy applies.
        apply_once(&s, &mut seen, &encode_put(b"n", b"1")).unwrap();
        assert_eq!(apply_once(&s, &mut seen, &encode_delete(b"n")).unwrap(), Applied::Delete { existed: true });
        assert_eq!(apply_once(&s, &mut seen, &encode_delete(b"n")).unwrap(), Applied::Delete { existed: false });
        // Bounded: the oldest are forgotten first.
        for seq in 10..10 + MAX_REMEMBERED_WRITES as u64 {
            seen.insert(id(seq).as_ref(), &Applied::Nothing);
        }
        assert_eq!(seen.order.len(), MAX_REMEMBERED_WRITES);
        assert!(seen.get(id(1).as_ref()).is_none() && seen.get(id(10).as_ref()).is_some());
    }
}

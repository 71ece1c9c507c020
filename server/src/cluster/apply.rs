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

/// The log entry data of a PUT.
pub fn encode_put(key: &[u8], value: &[u8]) -> Vec<u8> {
    let op = Op::Put(proto::Put { key: key.to_vec().into(), value: value.to_vec().into() });
    proto::RaftCommand { op: Some(op) }.encode_to_vec()
}

/// The log entry data of a DELETE.
pub fn encode_delete(key: &[u8]) -> Vec<u8> {
    proto::RaftCommand { op: Some(Op::Delete(proto::Delete { key: key.to_vec().into() })) }.encode_to_vec()
}

/// Applies one committed entry's data to `store`.
pub fn apply(store: &Store, data: &[u8]) -> Result<Applied, ApplyError> {
    if data.is_empty() {
        return Ok(Applied::Nothing);
    }
    let cmd = proto::RaftCommand::decode(data).map_err(|e| ApplyError::Malformed(e.to_string()))?;
    match cmd.op {
        Some(Op::Put(p)) => Ok(Applied::Put { version: store.put(&p.key, &p.value)? }),
        Some(Op::Delete(d)) => Ok(Applied::Delete { existed: store.delete(&d.key)? }),
        None => Err(ApplyError::Malformed("no operation".into())),
    }
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
}

//! A shard's state machine as one byte string, for raft snapshots: the
//! store's live items with their versions, the version the next write
//! gets, and the remembered write ids, at one applied log index. A
//! replica that catches up by snapshot, or restarts from one, ends up with
//! the same items, versions and remembered writes as the replica that
//! made it.
//!
//! ```text
//! magic "DMKVSNP1" | index u64 | term u64 | next_version u64
//! | remembered u32 | (client u64, seq u64, kind u8, value u64)*
//! | items u64 | (key_len u32, value_len u32, version u64, key, value)*
//! | xxh3-64 of everything before, u64
//! ```
//!
//! All little-endian. Decoding checks the checksum and every length before
//! the store is touched: a damaged or hostile snapshot changes nothing.

use dmkv_common::limits::{MAX_KEY_LEN, MAX_VALUE_LEN};
use thiserror::Error;

use super::apply::{Applied, Remembered};
use crate::store::Store;

const MAGIC: &[u8; 8] = b"DMKVSNP1";
const TRAILER: usize = 8;

/// Why a snapshot was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SnapshotError {
    #[error("snapshot is damaged: {0}")]
    Damaged(String),
    #[error("snapshot is for index {got}, expected {want}")]
    WrongPoint { got: u64, want: u64 },
    #[error("store refused a snapshot item: {0}")]
    Store(dmkv_common::error::Error),
}

/// Where a snapshot was taken: the last log entry it includes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Point {
    pub index: u64,
    pub term: u64,
}

/// Encodes `store`'s items and `remembered` as of `at` (the caller has
/// applied exactly up to it).
pub fn encode(store: &Store, remembered: &Remembered, at: Point) -> Vec<u8> {
    let mut items = Vec::new();
    let mut count = 0u64;
    let next_version = store.dump(|k, v, ver| {
        items.extend_from_slice(&(k.len() as u32).to_le_bytes());
        items.extend_from_slice(&(v.len() as u32).to_le_bytes());
        items.extend_from_slice(&ver.to_le_bytes());
        items.extend_from_slice(k);
        items.extend_from_slice(v);
        count += 1;
    });
    let mut out = Vec::with_capacity(items.len() + 64);
    out.extend_from_slice(MAGIC);
    for x in [at.index, at.term, next_version] {
        out.extend_from_slice(&x.to_le_bytes());
    }
    let remembered: Vec<_> = remembered.entries().collect();
    out.extend_from_slice(&(remembered.len() as u32).to_le_bytes());
    for ((client, seq), a) in remembered {
        let (kind, value) = match a {
            Applied::Nothing => (0u8, 0u64),
            Applied::Put { version } => (1, *version),
            Applied::Delete { existed } => (2, u64::from(*existed)),
        };
        out.extend_from_slice(&client.to_le_bytes());
        out.extend_from_slice(&seq.to_le_bytes());
        out.push(kind);
        out.extend_from_slice(&value.to_le_bytes());
    }
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&items);
    let sum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// A checked snapshot, borrowing its items from the bytes.
#[derive(Debug)]
pub struct Decoded<'a> {
    pub at: Point,
    pub next_version: u64,
    pub remembered: Vec<((u64, u64), Applied)>,
    /// (key, value, version).
    pub items: Vec<(&'a [u8], &'a [u8], u64)>,
}

/// Reads fields off the front of a byte string, never past its end.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], SnapshotError> {
        if self.0.len() < n {
            return Err(SnapshotError::Damaged(format!("truncated in {what}")));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u64(&mut self, what: &str) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn u32(&mut self, what: &str) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
}

/// Checks and parses a snapshot.
pub fn decode(data: &[u8]) -> Result<Decoded<'_>, SnapshotError> {
    if data.len() < MAGIC.len() + TRAILER || &data[..MAGIC.len()] != MAGIC {
        return Err(SnapshotError::Damaged("not a dmkv snapshot".into()));
    }
    let (body, sum) = data.split_at(data.len() - TRAILER);
    if xxhash_rust::xxh3::xxh3_64(body).to_le_bytes() != sum {
        return Err(SnapshotError::Damaged("checksum does not match".into()));
    }
    let mut r = Reader(&body[MAGIC.len()..]);
    let at = Point { index: r.u64("header")?, term: r.u64("header")? };
    let next_version = r.u64("header")?;
    let n = r.u32("remembered writes")? as usize;
    let mut remembered = Vec::with_capacity(n.min(super::apply::MAX_REMEMBERED_WRITES));
    for _ in 0..n {
        let id = (r.u64("remembered writes")?, r.u64("remembered writes")?);
        let kind = r.take(1, "remembered writes")?[0];
        let value = r.u64("remembered writes")?;
        let a = match kind {
            0 => Applied::Nothing,
            1 => Applied::Put { version: value },
            2 => Applied::Delete { existed: value != 0 },
            k => return Err(SnapshotError::Damaged(format!("unknown outcome kind {k}"))),
        };
        remembered.push((id, a));
    }
    let count = r.u64("items")?;
    let mut items = Vec::new();
    for _ in 0..count {
        let (kl, vl) = (r.u32("items")? as usize, r.u32("items")? as usize);
        if kl == 0 || kl > MAX_KEY_LEN || vl > MAX_VALUE_LEN {
            return Err(SnapshotError::Damaged(format!("item with key of {kl} bytes and value of {vl}")));
        }
        let version = r.u64("items")?;
        items.push((r.take(kl, "items")?, r.take(vl, "items")?, version));
    }
    if !r.0.is_empty() {
        return Err(SnapshotError::Damaged(format!("{} bytes after the last item", r.0.len())));
    }
    Ok(Decoded { at, next_version, remembered, items })
}

/// Replaces `store`'s items with a checked snapshot's; the remembered
/// writes it carried. The store is touched only once the whole snapshot
/// checked out.
pub fn restore(store: &Store, d: &Decoded<'_>) -> Result<Remembered, SnapshotError> {
    store.clear(d.next_version).map_err(SnapshotError::Store)?;
    for (k, v, ver) in &d.items {
        store.restore(k, v, *ver).map_err(SnapshotError::Store)?;
    }
    Ok(Remembered::from_entries(d.remembered.iter().cloned()))
}

/// The snapshot a leader hands raft for a follower that needs one: built
/// on the shard thread when raft asks (its storage answers "not yet" and
/// raft asks again a heartbeat later), kept a while for retries, then
/// dropped (it is as large as the shard's data).
#[derive(Default)]
pub struct SnapshotSlot {
    inner: std::sync::Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    ready: Option<raft::prelude::Snapshot>,
    wanted: bool,
}

impl SnapshotSlot {
    /// For `raft::Storage::snapshot`: the ready snapshot if it is at least
    /// at `request_index`; else asks for one.
    pub fn for_raft(&self, request_index: u64) -> raft::Result<raft::prelude::Snapshot> {
        let mut s = crate::lock::lock(&self.inner);
        match &s.ready {
            Some(snap) if snap.get_metadata().index >= request_index => Ok(snap.clone()),
            _ => {
                s.wanted = true;
                Err(raft::Error::Store(raft::StorageError::SnapshotTemporarilyUnavailable))
            }
        }
    }

    /// Whether raft asked for a snapshot since the last [`SnapshotSlot::fill`].
    pub fn wanted(&self) -> bool {
        crate::lock::lock(&self.inner).wanted
    }

    /// Hands over a snapshot for raft to send.
    pub fn fill(&self, snap: raft::prelude::Snapshot) {
        let mut s = crate::lock::lock(&self.inner);
        s.ready = Some(snap);
        s.wanted = false;
    }

    /// Drops the ready snapshot (its memory).
    pub fn clear(&self) {
        crate::lock::lock(&self.inner).ready = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use dmkv_common::proto::WriteId;
    use proptest::prelude::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn store() -> Store {
        Store::format(Arc::new(Region::create("snap", 4 << 20).unwrap()), 64, 9, 1, Duration::ZERO).unwrap()
    }

    fn sample() -> (Store, Remembered) {
        let s = store();
        let mut seen = Remembered::default();
        for i in 0..200u32 {
            let id = Some(WriteId { client: 1, seq: u64::from(i) });
            let put = super::super::apply::encode_put_with(format!("k{i}").as_bytes(), &i.to_le_bytes(), id);
            super::super::apply::apply_once(&s, &mut seen, &put).unwrap();
        }
        s.delete(b"k7").unwrap();
        (s, seen)
    }

    #[test]
    fn a_snapshot_restores_items_versions_and_remembered_writes() {
        let (a, seen) = sample();
        let at = Point { index: 250, term: 3 };
        let bytes = encode(&a, &seen, at);
        let d = decode(&bytes).unwrap();
        assert_eq!((d.at, d.items.len(), d.remembered.len()), (at, 199, 200));
        let b = store();
        b.put(b"k7", b"stale").unwrap();
        let back = restore(&b, &d).unwrap();
        assert_eq!(b.get(b"k7").unwrap(), None);
        assert_eq!(b.get(b"k9").unwrap(), a.get(b"k9").unwrap());
        assert_eq!(back.entries().collect::<Vec<_>>(), seen.entries().collect::<Vec<_>>());
        // The restored replica would send the same snapshot, up to order.
        let again = encode(&b, &back, at);
        let (mut x, mut y) = (decode(&bytes).unwrap(), decode(&again).unwrap());
        x.items.sort();
        y.items.sort();
        assert_eq!((x.items, x.next_version, x.remembered), (y.items, y.next_version, y.remembered));
    }

    #[test]
    fn damaged_snapshots_are_refused_and_change_nothing() {
        let (a, seen) = sample();
        let bytes = encode(&a, &seen, Point { index: 9, term: 1 });
        let b = store();
        b.put(b"kept", b"1").unwrap();
        let mut flipped = bytes.clone();
        flipped[40] ^= 1;
        for bad in [&bytes[..bytes.len() - 1], &flipped[..], &b"DMKVSNP1"[..], &[][..]] {
            assert!(matches!(decode(bad), Err(SnapshotError::Damaged(_))));
        }
        assert_eq!(b.get(b"kept").unwrap().unwrap().0, bytes::Bytes::from_static(b"1"));
    }

    proptest! {
        /// Whatever the bytes (with a valid checksum, so parsing runs):
        /// refused or parsed, never a panic.
        #[test]
        fn arbitrary_bodies_never_panic(body in prop::collection::vec(any::<u8>(), 0..300)) {
            let mut data = MAGIC.to_vec();
            data.extend_from_slice(&body);
            let sum = xxhash_rust::xxh3::xxh3_64(&data);
            data.extend_from_slice(&sum.to_le_bytes());
            let _ = decode(&data);
        }
    }
}

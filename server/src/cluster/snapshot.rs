//! A shard's state machine as a stream of bytes, for raft snapshots: the
//! store's items with their versions, flags and expiries, the version the
//! next write gets, and the remembered write ids, at one applied log
//! index. It is written while it is read from a consistent view of the
//! store (`store::view::StoreView`), a record at a time, and read back the same
//! way, so neither side holds a whole shard in memory or stops its shard
//! thread for it. A replica that catches up by snapshot, or restarts from
//! one, ends up with the same items, versions and remembered writes as the
//! replica that made it.
//!
//! ```text
//! magic "DMKVSNP7" | index u64 | term u64 | next_version u64
//! | remembered_len u32 | remembered: log_now_ms u64, count u32,
//!   (client u64, seq u64, kind u8, a u64, b u64, expires_ms u64, partition u32)*
//! | placement: 0 u8, or 1 u8 | len u16 | `Placement::encode` (version, the
//!   partition bit set, version skew, the moves recorded)
//! | (1 u8 | key_len u32 | value_len u32 | version u64 | flags u32 | expires u32 | key | value)*
//! | 0 u8 | items u64 | xxh3-64 of everything before, u64
//! ```
//!
//! All little-endian. A reader checks every length as it goes and the
//! checksum at the end: a receiver reads a snapshot whole ([`validate`])
//! before raft takes it, so a damaged or hostile one changes nothing. An
//! item may come twice (a view meets an item in the index and again when
//! it was unlinked meanwhile): both copies are the same version, and a
//! restore keeps one.
//!
//! The remembered writes carry their expiry (log time) and the shard's log
//! time, soonest to expire first, so a replica restored from a snapshot
//! forgets the same writes at the same entries as the one that made it.
//! The placement (the partitions the shard owns, `placement.rs`) is part
//! of the state machine too; a snapshot from before placements
//! (`DMKVSNP4`, `DMKVSNP3`) carries none, and the shard's first one holds;
//! one from before moves (`DMKVSNP5`) holds only the version and the bit
//! set, no length.

use std::io::{Read, Write};

use dmkv_common::limits::{MAX_KEY_LEN, MAX_VALUE_LEN};
use thiserror::Error;
use xxhash_rust::xxh3::Xxh3Default;

use super::apply::{
    MAX_REMEMBERED_WRITES, NO_PARTITION, Remembered, RememberedParts, RememberedWrite, outcome_fields, outcome_of,
};
use crate::store::Store;
use crate::store::view::StoreView;

const MAGIC: &[u8; 8] = b"DMKVSNP7";
/// The format before movers' claims: the same, its placement's move
/// records without claims (they decode as 0). Still read; written with a
/// new magic so that an older dmkv refuses a snapshot whose claims it
/// would take for damage.
const MAGIC_V6: &[u8; 8] = b"DMKVSNP6";
/// The format before moves: the placement without skew or moves, and no
/// length before it. Still read.
const MAGIC_V5: &[u8; 8] = b"DMKVSNP5";
/// The format before placements: the same with no placement. Still read.
const MAGIC_V4: &[u8; 8] = b"DMKVSNP4";
/// The format before counters and refusals were remembered: the same but
/// for one value per remembered write. Still read (a node's own saved
/// snapshot from before an upgrade).
const MAGIC_V3: &[u8; 8] = b"DMKVSNP3";
/// Formats this version does not read.
const OLD_MAGICS: [&[u8; 8]; 2] = [b"DMKVSNP1", b"DMKVSNP2"];
const ITEM: u8 = 1;
const END: u8 = 0;
/// Bytes of one remembered write in the stream.
const REMEMBERED_BYTES: usize = 45;
/// Bytes of one before partitions were kept (DMKVSNP4 and DMKVSNP5).
const REMEMBERED_BYTES_V5: usize = 41;
/// Bytes of one in the DMKVSNP3 format.
const REMEMBERED_BYTES_V3: usize = 33;
/// Largest remembered section a reader takes.
const MAX_REMEMBERED_SECTION: usize = 12 + MAX_REMEMBERED_WRITES * REMEMBERED_BYTES;

/// Why a snapshot was refused.
#[derive(Debug, Error)]
pub enum SnapshotError {
    #[error("snapshot is damaged: {0}")]
    Damaged(String),
    #[error("snapshot is for index {got}, expected {want}")]
    WrongPoint { got: u64, want: u64 },
    #[error("store refused a snapshot item: {0}")]
    Store(dmkv_common::error::Error),
    /// A format this version does not read (an older dmkv's).
    #[error("snapshot format {0} is not read by this version: {1}")]
    OldFormat(String, &'static str),
    #[error("reading the snapshot: {0}")]
    Io(#[from] std::io::Error),
}

/// Where a snapshot was taken: the last log entry it includes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Point {
    pub index: u64,
    pub term: u64,
}

/// What a whole snapshot held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summary {
    pub at: Point,
    /// Items in the stream (duplicates counted).
    pub items: u64,
    pub bytes: u64,
}

/// One item of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub version: u64,
    pub flags: u32,
    pub expires_at: u32,
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    out: W,
    hash: Xxh3Default,
    bytes: u64,
}

impl<W: Write> Hashing<W> {
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.hash.update(b);
        self.bytes += b.len() as u64;
        self.out.write_all(b)
    }
}

/// Writes a snapshot stream, a record at a time.
pub struct Encoder<W: Write> {
    w: Hashing<W>,
    at: Point,
    items: u64,
}

impl<W: Write> Encoder<W> {
    /// Starts a snapshot taken at `at` into `out`.
    pub fn new(out: W, at: Point, next_version: u64, remembered: &RememberedParts) -> std::io::Result<Encoder<W>> {
        let mut w = Hashing { out, hash: Xxh3Default::new(), bytes: 0 };
        w.put(MAGIC)?;
        for x in [at.index, at.term, next_version] {
            w.put(&x.to_le_bytes())?;
        }
        let section = encode_remembered(remembered);
        w.put(&(section.len() as u32).to_le_bytes())?;
        w.put(&section)?;
        match &remembered.placement {
            Some(p) => {
                let b = p.encode();
                w.put(&[1])?;
                w.put(&(b.len() as u16).to_le_bytes())?;
                w.put(&b)?;
            }
            None => w.put(&[0])?,
        }
        Ok(Encoder { w, at, items: 0 })
    }

    pub fn item(&mut self, key: &[u8], value: &[u8], version: u64, flags: u32, expires_at: u32) -> std::io::Result<()> {
        let w = &mut self.w;
        w.put(&[ITEM])?;
        w.put(&(key.len() as u32).to_le_bytes())?;
        w.put(&(value.len() as u32).to_le_bytes())?;
        w.put(&version.to_le_bytes())?;
        w.put(&flags.to_le_bytes())?;
        w.put(&expires_at.to_le_bytes())?;
        w.put(key)?;
        w.put(value)?;
        self.items += 1;
        Ok(())
    }

    /// Ends the stream; the writer back, and what it holds.
    pub fn finish(mut self) -> std::io::Result<(W, Summary)> {
        self.w.put(&[END])?;
        self.w.put(&self.items.to_le_bytes())?;
        let sum = self.w.hash.digest();
        self.w.out.write_all(&sum.to_le_bytes())?;
        self.w.out.flush()?;
        let summary = Summary { at: self.at, items: self.items, bytes: self.w.bytes + 8 };
        Ok((self.w.out, summary))
    }
}

/// Writes `view` (with `remembered`, taken at `at`) into `out`.
pub fn encode_view<W: Write>(
    view: &StoreView,
    remembered: &RememberedParts,
    at: Point,
    out: W,
) -> Result<(W, Summary), String> {
    let mut e = Encoder::new(out, at, view.next_version(), remembered).map_err(|e| e.to_string())?;
    view.walk(|it| e.item(it.key, it.value, it.version, it.flags, it.expires_at).map_err(|e| e.to_string()))?;
    e.finish().map_err(|e| e.to_string())
}

/// Reads a snapshot stream, a record at a time. The checksum is checked
/// when the end is read: until then an item may come from a damaged
/// stream, so whoever acts on items reads the stream whole first
/// ([`validate`]), or can undo what it did.
pub struct Decoder<R: Read> {
    r: R,
    hash: Xxh3Default,
    pub at: Point,
    pub next_version: u64,
    pub remembered: RememberedParts,
    items: u64,
    bytes: u64,
    ended: bool,
}

impl<R: Read> Decoder<R> {
    /// Reads the header and the remembered writes.
    pub fn new(r: R) -> Result<Decoder<R>, SnapshotError> {
        let mut d = Decoder {
            r,
            hash: Xxh3Default::new(),
            at: Point::default(),
            next_version: 0,
            remembered: RememberedParts::default(),
            items: 0,
            bytes: 0,
            ended: false,
        };
        let mut magic = [0u8; 8];
        d.take(&mut magic, "header")?;
        if let Some(old) = OLD_MAGICS.iter().find(|m| **m == &magic) {
            return Err(SnapshotError::OldFormat(
                String::from_utf8_lossy(&old[..]).into_owned(),
                "an older dmkv's; a replica whose saved snapshot it is must start with an empty data directory and \
                 catch up from its shard's leader",
            ));
        }
        let v3 = &magic == MAGIC_V3;
        let v4 = &magic == MAGIC_V4;
        let v5 = &magic == MAGIC_V5;
        let known = &magic == MAGIC || &magic == MAGIC_V6 || v3 || v4 || v5;
        if !known && magic.starts_with(b"DMKVSNP") {
            // A newer dmkv's, after a downgrade: no damage, and the
            // replica must not throw away what may be the only copy.
            return Err(SnapshotError::OldFormat(
                String::from_utf8_lossy(&magic).into_owned(),
                "a format this version does not know (a newer dmkv's)",
            ));
        }
        if !known {
            return Err(SnapshotError::Damaged("not a dmkv snapshot".into()));
        }
        d.at = Point { index: d.u64("header")?, term: d.u64("header")? };
        d.next_version = d.u64("header")?;
        let len = d.u32("remembered writes")? as usize;
        if len > MAX_REMEMBERED_SECTION {
            return Err(SnapshotError::Damaged(format!("a remembered section of {len} bytes")));
        }
        let mut section = vec![0u8; len];
        d.take(&mut section, "remembered writes")?;
        // DMKVSNP4's remembered writes are as DMKVSNP5's.
        d.remembered = decode_remembered(&mut Reader(&section), v3, v4 || v5)?;
        if !v3 && !v4 {
            let mut flag = [0u8; 1];
            d.take(&mut flag, "placement")?;
            d.remembered.placement = match flag[0] {
                0 => None,
                1 => {
                    let len = match v5 {
                        true => super::placement::ENCODED_LEN_V1,
                        false => {
                            let mut l = [0u8; 2];
                            d.take(&mut l, "placement")?;
                            u16::from_le_bytes(l) as usize
                        }
                    };
                    if len > super::placement::MAX_ENCODED_LEN {
                        return Err(SnapshotError::Damaged(format!("a placement of {len} bytes")));
                    }
                    let mut b = vec![0u8; len];
                    d.take(&mut b, "placement")?;
                    let p = super::placement::Placement::decode(&b, v5)
                        .ok_or_else(|| SnapshotError::Damaged("a placement that does not decode".into()))?;
                    Some(p)
                }
                f => return Err(SnapshotError::Damaged(format!("placement flag {f}"))),
            };
        }
        Ok(d)
    }

    fn take(&mut self, buf: &mut [u8], what: &str) -> Result<(), SnapshotError> {
        self.r.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => SnapshotError::Damaged(format!("truncated in {what}")),
            _ => SnapshotError::Io(e),
        })?;
        self.hash.update(buf);
        self.bytes += buf.len() as u64;
        Ok(())
    }

    fn u64(&mut self, what: &str) -> Result<u64, SnapshotError> {
        let mut b = [0u8; 8];
        self.take(&mut b, what)?;
        Ok(u64::from_le_bytes(b))
    }

    fn u32(&mut self, what: &str) -> Result<u32, SnapshotError> {
        let mut b = [0u8; 4];
        self.take(&mut b, what)?;
        Ok(u32::from_le_bytes(b))
    }

    /// The next item; `None` at the end, once the count and the checksum
    /// checked out.
    pub fn next_item(&mut self) -> Result<Option<Item>, SnapshotError> {
        if self.ended {
            return Ok(None);
        }
        let mut tag = [0u8; 1];
        self.take(&mut tag, "items")?;
        match tag[0] {
            ITEM => {}
            END => {
                let count = self.u64("the end")?;
                let want = self.hash.digest();
                let mut sum = [0u8; 8];
                self.r.read_exact(&mut sum).map_err(|e| match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => SnapshotError::Damaged("truncated in the checksum".into()),
                    _ => SnapshotError::Io(e),
                })?;
                if u64::from_le_bytes(sum) != want {
                    return Err(SnapshotError::Damaged("checksum does not match".into()));
                }
                if count != self.items {
                    return Err(SnapshotError::Damaged(format!("{} items, the end says {count}", self.items)));
                }
                let mut rest = [0u8; 1];
                if self.r.read(&mut rest)? != 0 {
                    return Err(SnapshotError::Damaged("bytes after the end".into()));
                }
                self.ended = true;
                self.bytes += 8;
                return Ok(None);
            }
            t => return Err(SnapshotError::Damaged(format!("unknown record {t}"))),
        }
        let (kl, vl) = (self.u32("items")? as usize, self.u32("items")? as usize);
        if kl == 0 || kl > MAX_KEY_LEN || vl > MAX_VALUE_LEN {
            return Err(SnapshotError::Damaged(format!("item with key of {kl} bytes and value of {vl}")));
        }
        let version = self.u64("items")?;
        let (flags, expires_at) = (self.u32("items")?, self.u32("items")?);
        let mut key = vec![0u8; kl];
        self.take(&mut key, "items")?;
        let mut value = vec![0u8; vl];
        self.take(&mut value, "items")?;
        self.items += 1;
        Ok(Some(Item { key, value, version, flags, expires_at }))
    }

    /// What was read so far (all of it, once `next_item` said `None`).
    pub fn summary(&self) -> Summary {
        Summary { at: self.at, items: self.items, bytes: self.bytes }
    }
}

/// Reads a whole snapshot, checking everything; what it holds.
pub fn validate<R: Read>(r: R) -> Result<Summary, SnapshotError> {
    let mut d = Decoder::new(r)?;
    while d.next_item()?.is_some() {}
    Ok(d.summary())
}

/// Replaces `store`'s items with a snapshot's; where it was taken, the
/// remembered writes it carried, and the placement (`None`: a snapshot
/// from before placements). Read [`validate`]d snapshots only: a damage
/// found midway leaves the store half restored (the error says so, and the
/// replica must not go on from it).
pub fn restore<R: Read>(store: &Store, r: R) -> Result<Restored, SnapshotError> {
    let mut d = Decoder::new(r)?;
    store.clear(d.next_version).map_err(SnapshotError::Store)?;
    let mut waited = std::time::Duration::ZERO;
    while let Some(it) = d.next_item()? {
        // A second copy of an item is the same version: keep the first.
        if store.get(&it.key).map_err(SnapshotError::Store)?.is_some_and(|(_, v)| v >= it.version) {
            continue;
        }
        restore_item(store, &it, &mut waited)?;
    }
    Ok(Restored { at: d.at, remembered: Remembered::from_parts(&d.remembered), placement: d.remembered.placement })
}

/// What a restored snapshot leaves beside the store's items.
#[derive(Debug)]
pub struct Restored {
    pub at: Point,
    pub remembered: Remembered,
    pub placement: Option<super::placement::Placement>,
}

/// How long a restore waits, in all, for space still in its grace period
/// (the store was just emptied: what it held becomes free only once
/// readers that may have seen it are done).
pub const MAX_RESTORE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

fn restore_item(store: &Store, it: &Item, waited: &mut std::time::Duration) -> Result<(), SnapshotError> {
    loop {
        match store.restore(&it.key, &it.value, it.version, it.flags, it.expires_at) {
            Err(dmkv_common::error::Error::OutOfMemory) if *waited < MAX_RESTORE_WAIT => {
                // No space waiting to be freed: it does not fit.
                let Some(wait) = store.reclaim_wait() else {
                    return Err(SnapshotError::Store(dmkv_common::error::Error::OutOfMemory));
                };
                let wait = wait.max(std::time::Duration::from_millis(1));
                std::thread::sleep(wait);
                *waited += wait;
            }
            r => return r.map_err(SnapshotError::Store),
        }
    }
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

/// The remembered writes' section: the log time, then each write with its
/// outcome and expiry, in the order they are forgotten.
fn encode_remembered(parts: &RememberedParts) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + parts.writes.len() * REMEMBERED_BYTES);
    out.extend_from_slice(&parts.now_ms.to_le_bytes());
    out.extend_from_slice(&(parts.writes.len() as u32).to_le_bytes());
    for w in &parts.writes {
        let (kind, a, b) = outcome_fields(&w.outcome);
        out.extend_from_slice(&w.client.to_le_bytes());
        out.extend_from_slice(&w.seq.to_le_bytes());
        out.push(kind);
        out.extend_from_slice(&a.to_le_bytes());
        out.extend_from_slice(&b.to_le_bytes());
        out.extend_from_slice(&w.expires_ms.to_le_bytes());
        out.extend_from_slice(&w.partition.to_le_bytes());
    }
    out
}

/// Reads what [`encode_remembered`] wrote (`v3`: in the DMKVSNP3 format).
/// More writes than a shard keeps are refused: restored, the bound would
/// drop some, which the replica that made the snapshot remembers.
fn decode_remembered(r: &mut Reader<'_>, v3: bool, v5: bool) -> Result<RememberedParts, SnapshotError> {
    const WHAT: &str = "remembered writes";
    let now_ms = r.u64(WHAT)?;
    let n = r.u32(WHAT)? as usize;
    if n > MAX_REMEMBERED_WRITES {
        return Err(SnapshotError::Damaged(format!(
            "{n} remembered writes, more than the {MAX_REMEMBERED_WRITES} a shard keeps"
        )));
    }
    let each = match (v3, v5) {
        (true, _) => REMEMBERED_BYTES_V3,
        (false, true) => REMEMBERED_BYTES_V5,
        (false, false) => REMEMBERED_BYTES,
    };
    let mut writes = Vec::with_capacity(n.min(r.0.len() / each));
    for _ in 0..n {
        let (client, seq) = (r.u64(WHAT)?, r.u64(WHAT)?);
        let kind = r.take(1, WHAT)?[0];
        let a = r.u64(WHAT)?;
        let b = if v3 { 0 } else { r.u64(WHAT)? };
        if v3 && kind > 2 {
            return Err(SnapshotError::Damaged(format!("unknown outcome kind {kind}")));
        }
        let outcome = outcome_of(kind, a, b)
            .ok_or_else(|| SnapshotError::Damaged(format!("unknown outcome kind {kind} ({a})")))?;
        let expires_ms = r.u64(WHAT)?;
        let partition = if v3 || v5 { NO_PARTITION } else { r.u32(WHAT)? };
        writes.push(RememberedWrite { client, seq, outcome, expires_ms, partition });
    }
    if !r.0.is_empty() {
        return Err(SnapshotError::Damaged(format!("{} bytes after the remembered writes", r.0.len())));
    }
    Ok(RememberedParts { now_ms, writes, placement: None })
}

/// A shard's whole state as bytes in memory (tests, and in-memory
/// replicas' snapshots for followers).
pub fn encode(view: &StoreView, remembered: &RememberedParts, at: Point) -> Result<Vec<u8>, String> {
    encode_view(view, remembered, at, Vec::new()).map(|(v, _)| v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::apply::Applied;
    use crate::region::Region;
    use dmkv_common::proto::WriteId;
    use proptest::prelude::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn store() -> Arc<Store> {
        Arc::new(Store::format(Arc::new(Region::create("snap", 4 << 20).unwrap()), 64, 9, 1, Duration::ZERO).unwrap())
    }

    fn sample() -> (Arc<Store>, Remembered) {
        let s = store();
        let mut seen = Remembered::default();
        for i in 0..200u32 {
            // Windows of 1 to 4 s, and the leader's clock 10 ms on a write.
            let id = Some(WriteId { client: 1, seq: u64::from(i), retry_window_ms: 1000 * (1 + i % 4) });
            let now = 1_000_000 + u64::from(i) * 10;
            let put = super::super::apply::encode_put_with(format!("k{i}").as_bytes(), &i.to_le_bytes(), id, now);
            super::super::apply::apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                u64::from(i) + 1,
                &put,
            )
            .unwrap();
        }
        s.delete(b"k7").unwrap();
        (s, seen)
    }

    fn bytes_of(s: &Arc<Store>, seen: &Remembered, at: Point) -> Vec<u8> {
        encode(&s.view().unwrap(), &seen.to_parts(), at).unwrap()
    }

    fn items(bytes: &[u8]) -> Vec<Item> {
        let mut d = Decoder::new(bytes).unwrap();
        let mut v = Vec::new();
        while let Some(it) = d.next_item().unwrap() {
            v.push(it);
        }
        v.sort_by(|a, b| a.key.cmp(&b.key));
        v
    }

    #[test]
    fn a_snapshot_restores_items_versions_and_remembered_writes() {
        let (a, seen) = sample();
        let at = Point { index: 250, term: 3 };
        let bytes = bytes_of(&a, &seen, at);
        let sum = validate(&bytes[..]).unwrap();
        assert_eq!((sum.at, sum.items, sum.bytes), (at, 199, bytes.len() as u64));
        let b = store();
        b.put(b"k7", b"stale").unwrap();
        let Restored { at: got_at, remembered: back, .. } = restore(&b, &bytes[..]).unwrap();
        assert_eq!(got_at, at);
        assert_eq!(b.get(b"k7").unwrap(), None);
        assert_eq!(b.get(b"k9").unwrap(), a.get(b"k9").unwrap());
        assert_eq!(back.to_parts(), seen.to_parts());
        // The restored replica would send the same snapshot, up to order.
        let again = bytes_of(&b, &back, at);
        assert_eq!(items(&bytes), items(&again));
    }

    #[test]
    fn a_second_copy_of_an_item_is_kept_once() {
        let mut e = Encoder::new(Vec::new(), Point { index: 1, term: 1 }, 10, &RememberedParts::default()).unwrap();
        e.item(b"k", b"v", 3, 7, 0).unwrap();
        e.item(b"k", b"v", 3, 7, 0).unwrap();
        e.item(b"j", b"w", 4, 0, 99).unwrap();
        let (bytes, sum) = e.finish().unwrap();
        assert_eq!(validate(&bytes[..]).unwrap(), sum);
        let s = store();
        restore(&s, &bytes[..]).unwrap();
        assert_eq!(s.get(b"k").unwrap().unwrap().1, 3);
        let mut n = 0;
        assert_eq!(s.dump(|_, _, _| n += 1), 10, "the next version");
        assert_eq!(n, 2, "one copy of k, and j");
    }

    #[test]
    fn remembered_writes_keep_their_expiries_through_a_snapshot() {
        use super::super::apply::{apply_once, encode_put_with};
        let (a, mut seen) = sample();
        let bytes = bytes_of(&a, &seen, Point { index: 250, term: 3 });
        let d = Decoder::new(&bytes[..]).unwrap();
        assert_eq!(d.remembered.now_ms, 1_000_000 + 199 * 10);
        let w = &d.remembered.writes;
        assert!(w.windows(2).all(|p| p[0].expires_ms <= p[1].expires_ms), "soonest to expire first");
        assert_eq!((w[0].seq, w[0].expires_ms), (0, 1_000_000 + 2000));
        let b = store();
        let Restored { remembered: mut back, .. } = restore(&b, &bytes[..]).unwrap();
        // The same entries forget the same writes on both, and answer alike.
        for step in 0..10u64 {
            let now = 1_000_000 + 1990 + step * 700;
            let retry =
                encode_put_with(b"k3", b"again", Some(WriteId { client: 1, seq: 3, retry_window_ms: 4000 }), now);
            assert_eq!(
                apply_once(
                    &a,
                    &mut seen,
                    &mut crate::cluster::placement::Placement::all(),
                    &mut Default::default(),
                    300 + step,
                    &retry
                )
                .unwrap(),
                apply_once(
                    &b,
                    &mut back,
                    &mut crate::cluster::placement::Placement::all(),
                    &mut Default::default(),
                    300 + step,
                    &retry
                )
                .unwrap()
            );
            assert_eq!(back.to_parts(), seen.to_parts(), "at {now}");
        }
        assert!(back.len() < 200, "some were forgotten meanwhile");
    }

    #[test]
    fn counters_and_refusals_are_remembered_through_a_snapshot() {
        use super::super::apply::{apply_once, encode_arith, encode_write};
        use dmkv_common::proto::{Arith, Put, PutMode};
        let a = store();
        let mut seen = Remembered::default();
        let id = |seq| Some(WriteId { client: 9, seq, retry_window_ms: 5000 });
        let now = 1_000_000;
        let set = Put { key: "n".into(), value: "41".into(), write_id: id(1), ..Default::default() };
        let add = Put { mode: PutMode::Add as i32, write_id: id(2), ..set.clone() };
        let incr = Arith { key: "n".into(), delta: 1, write_id: id(3), ..Default::default() };
        let entries = [encode_write(set, now), encode_write(add, now), encode_arith(incr, now)];
        let first: Vec<_> = entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                apply_once(
                    &a,
                    &mut seen,
                    &mut crate::cluster::placement::Placement::all(),
                    &mut Default::default(),
                    i as u64 + 1,
                    e,
                )
                .unwrap()
            })
            .collect();
        assert_eq!(first[1], Applied::Refused(dmkv_common::error::Error::NotStored));
        assert_eq!(first[2], Applied::Counter { value: 42, version: 3 });
        let bytes = bytes_of(&a, &seen, Point { index: 3, term: 1 });
        let b = store();
        let Restored { remembered: mut back, .. } = restore(&b, &bytes[..]).unwrap();
        assert_eq!(back.to_parts(), seen.to_parts());
        // Sent again to the restored replica: answered as the first time,
        // and the counter not incremented twice.
        for (i, e) in entries.iter().enumerate() {
            assert_eq!(
                apply_once(
                    &b,
                    &mut back,
                    &mut crate::cluster::placement::Placement::all(),
                    &mut Default::default(),
                    10 + i as u64,
                    e
                )
                .unwrap(),
                first[i]
            );
        }
        assert_eq!(b.get(b"n").unwrap().unwrap(), (bytes::Bytes::from_static(b"42"), 3));
    }

    /// The placement travels with the items; a snapshot from before
    /// placements (DMKVSNP4) carries none, so the first one holds.
    #[test]
    fn a_snapshot_carries_the_placement() {
        use crate::cluster::placement::Placement;
        let (a, seen) = sample();
        let mut parts = seen.to_parts();
        let mut placement = Placement::all();
        let change = dmkv_common::proto::PlacementChange { version: 9, own: vec![], release: vec![3, 4000], claim: 0 };
        assert_eq!(placement.apply(&change), Ok(true));
        let take = dmkv_common::proto::MoveStep { partition: 3, version: 11, kind: 2, claim: 4 };
        let watch = dmkv_common::proto::MoveStep { partition: 7, version: 12, kind: 1, claim: 0 };
        assert_eq!((placement.apply_step(&take), placement.apply_step(&watch)), (Ok(true), Ok(true)));
        placement.raise_version_skew(40, 7000);
        parts.placement = Some(placement.clone());
        let at = Point { index: 250, term: 3 };
        let bytes = encode(&a.view().unwrap(), &parts, at).unwrap();
        validate(&bytes[..]).unwrap();
        let got = restore(&store(), &bytes[..]).unwrap();
        assert_eq!(got.placement, Some(placement.clone()));
        let flag = 8 + 24 + 4 + u32::from_le_bytes(bytes[32..36].try_into().unwrap()) as usize;
        assert_eq!(bytes[flag], 1, "a placement");
        let len = u16::from_le_bytes(bytes[flag + 1..flag + 3].try_into().unwrap()) as usize;
        // As DMKVSNP6 wrote it: the move records without their claims.
        let claims = 8 * placement.moves().len();
        let mut v6 = b"DMKVSNP6".to_vec();
        v6.extend_from_slice(&bytes[8..flag + 1]);
        v6.extend_from_slice(&((len - claims) as u16).to_le_bytes());
        v6.extend_from_slice(&bytes[flag + 3..flag + 3 + len - claims]);
        v6.extend_from_slice(&bytes[flag + 3 + len..bytes.len() - 8]);
        let sum = xxhash_rust::xxh3::xxh3_64(&v6);
        v6.extend_from_slice(&sum.to_le_bytes());
        let got = restore(&store(), &v6[..]).unwrap().placement.expect("a placement");
        assert_eq!(got.moves().iter().map(|m| (m.partition, m.claim)).collect::<Vec<_>>(), vec![(3, 0), (7, 0)]);
        assert_eq!((got.version(), got.version_skew()), (placement.version(), placement.version_skew()));
        // As DMKVSNP5 wrote it: remembered writes without partitions, the
        // placement's version and bit set with no length.
        let mut v5 = before_partitions(&bytes, b"DMKVSNP5");
        v5.push(1);
        v5.extend_from_slice(&bytes[flag + 3..flag + 3 + crate::cluster::placement::ENCODED_LEN_V1]);
        v5.extend_from_slice(&bytes[flag + 3 + len..bytes.len() - 8]);
        let sum = xxhash_rust::xxh3::xxh3_64(&v5);
        v5.extend_from_slice(&sum.to_le_bytes());
        let got = restore(&store(), &v5[..]).unwrap();
        let unknown = |mut p: RememberedParts| {
            p.writes.iter_mut().for_each(|w| w.partition = NO_PARTITION);
            p
        };
        assert_eq!(got.remembered.to_parts(), unknown(seen.to_parts()), "remembered, partitions not known");
        let got = got.placement.expect("a placement");
        assert_eq!((got.version(), got.version_skew(), got.moves().len()), (9, 0, 0));
        assert!(!got.owns(3) && got.owns(5));
        // A length past the bound is damage, not an allocation.
        let mut long = bytes.clone();
        long[flag + 1..flag + 3].copy_from_slice(&u16::MAX.to_le_bytes());
        let n = long.len();
        let sum = xxhash_rust::xxh3::xxh3_64(&long[..n - 8]);
        long[n - 8..].copy_from_slice(&sum.to_le_bytes());
        assert!(matches!(validate(&long[..]), Err(SnapshotError::Damaged(_))));
        // The same stream with no placement, as DMKVSNP4 wrote it.
        let old = bytes_of(&a, &seen, at);
        let flag = 8 + 24 + 4 + u32::from_le_bytes(old[32..36].try_into().unwrap()) as usize;
        assert_eq!(old[flag], 0, "no placement");
        let mut v4 = before_partitions(&old, b"DMKVSNP4");
        v4.extend_from_slice(&old[flag + 1..old.len() - 8]);
        let sum = xxhash_rust::xxh3::xxh3_64(&v4);
        v4.extend_from_slice(&sum.to_le_bytes());
        let got = restore(&store(), &v4[..]).unwrap();
        assert_eq!((got.at, got.placement), (at, None));
        assert_eq!(got.remembered.to_parts(), unknown(seen.to_parts()));
        // Remembered writes keep their partitions, which a moving
        // partition takes along.
        let back = restore(&store(), &bytes[..]).unwrap().remembered;
        assert_eq!(back.to_parts(), seen.to_parts());
        let p0 = seen.to_parts().writes[0].partition;
        assert!(p0 != NO_PARTITION && back.of_partition(p0).iter().all(|w| w.partition == p0));
        assert!(!back.of_partition(p0).is_empty());
    }

    /// `bytes`' header and remembered writes as `magic`'s format (before
    /// partitions were kept) wrote them: up to the placement flag.
    fn before_partitions(bytes: &[u8], magic: &[u8; 8]) -> Vec<u8> {
        let len = u32::from_le_bytes(bytes[32..36].try_into().unwrap()) as usize;
        let section = &bytes[36..36 + len];
        let n = u32::from_le_bytes(section[8..12].try_into().unwrap()) as usize;
        assert_eq!(section.len(), 12 + n * REMEMBERED_BYTES);
        let mut old = section[..12].to_vec();
        for r in section[12..].chunks_exact(REMEMBERED_BYTES) {
            old.extend_from_slice(&r[..REMEMBERED_BYTES_V5]);
        }
        let mut out = magic.to_vec();
        out.extend_from_slice(&bytes[8..32]);
        out.extend_from_slice(&(old.len() as u32).to_le_bytes());
        out.extend_from_slice(&old);
        out
    }

    #[test]
    fn a_snapshot_in_the_format_before_is_still_read() {
        // DMKVSNP3: one value per remembered write (a PUT's version, a
        // DELETE's existed).
        let mut body = b"DMKVSNP3".to_vec();
        for x in [7u64, 2, 20] {
            body.extend_from_slice(&x.to_le_bytes());
        }
        let mut section = 5000u64.to_le_bytes().to_vec();
        section.extend_from_slice(&1u32.to_le_bytes());
        for x in [4u64, 1] {
            section.extend_from_slice(&x.to_le_bytes());
        }
        section.push(1);
        section.extend_from_slice(&6u64.to_le_bytes());
        section.extend_from_slice(&9000u64.to_le_bytes());
        body.extend_from_slice(&(section.len() as u32).to_le_bytes());
        body.extend_from_slice(&section);
        body.push(ITEM);
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&2u32.to_le_bytes());
        body.extend_from_slice(&6u64.to_le_bytes());
        body.extend_from_slice(&5u32.to_le_bytes());
        body.extend_from_slice(&0u32.to_le_bytes());
        body.extend_from_slice(b"kvv");
        body.push(END);
        body.extend_from_slice(&1u64.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&body);
        body.extend_from_slice(&sum.to_le_bytes());
        let s = store();
        let Restored { at, remembered: back, .. } = restore(&s, &body[..]).unwrap();
        assert_eq!(at, Point { index: 7, term: 2 });
        let parts = back.to_parts();
        assert_eq!(parts.now_ms, 5000);
        assert_eq!(
            parts.writes,
            [RememberedWrite {
                client: 4,
                seq: 1,
                outcome: Applied::Put { version: 6 },
                expires_ms: 9000,
                partition: NO_PARTITION
            }]
        );
        assert_eq!(s.get(b"k").unwrap().unwrap(), (bytes::Bytes::from_static(b"vv"), 6));
    }

    #[test]
    fn older_formats_are_refused_by_name() {
        for magic in [&b"DMKVSNP1"[..], b"DMKVSNP2"] {
            let mut old = magic.to_vec();
            old.extend_from_slice(&[0; 36]);
            let e = validate(&old[..]).unwrap_err();
            assert!(matches!(&e, SnapshotError::OldFormat(name, _) if name.as_bytes() == magic), "{e:?}");
            assert!(e.to_string().contains("empty data directory"), "{e}");
        }
        // A newer format (after a downgrade) is not damage either: a
        // replica must keep it rather than start over from its peers.
        let mut newer = b"DMKVSNP9".to_vec();
        newer.extend_from_slice(&[0; 36]);
        assert!(matches!(validate(&newer[..]), Err(SnapshotError::OldFormat(..))));
        assert!(matches!(validate(&[7u8; 44][..]), Err(SnapshotError::Damaged(_))), "not ours at all");
    }

    #[test]
    fn damaged_snapshots_are_refused_by_validation() {
        let (a, seen) = sample();
        let bytes = bytes_of(&a, &seen, Point { index: 9, term: 1 });
        let mut flipped = bytes.clone();
        flipped[bytes.len() / 2] ^= 1;
        let mut longer = bytes.clone();
        longer.push(0);
        for bad in [&bytes[..bytes.len() - 1], &flipped[..], &longer[..], &b"DMKVSNP3"[..], &[][..]] {
            assert!(matches!(validate(bad), Err(SnapshotError::Damaged(_))), "{}", bad.len());
        }
    }

    proptest! {
        /// Whatever the bytes after a valid header: refused or read, never
        /// a panic, and never an allocation beyond the limits.
        #[test]
        fn arbitrary_streams_never_panic(body in prop::collection::vec(any::<u8>(), 0..400)) {
            let mut data = MAGIC.to_vec();
            data.extend_from_slice(&body);
            let _ = validate(&data[..]);
            let mut e = Encoder::new(Vec::new(), Point::default(), 1, &RememberedParts::default()).unwrap();
            e.item(b"k", &body, 0, 0, 0).unwrap();
            let (mut ok, _) = e.finish().unwrap();
            prop_assert!(validate(&ok[..]).is_ok());
            let cut = body.len() % ok.len();
            ok.truncate(cut);
            prop_assert!(validate(&ok[..]).is_err());
        }
    }
}

/// The snapshot a leader hands raft for a follower that needs one: made on
/// the shard thread when raft asks (its storage answers "not yet" and raft
/// asks again a heartbeat later), and taken by raft once. Its data is a
/// [`super::desk::Descriptor`]: the items stream to the follower apart.
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
    /// For `raft::Storage::snapshot`: the ready snapshot (taken) if it is
    /// at least at `request_index`; else asks for one.
    pub fn for_raft(&self, request_index: u64) -> raft::Result<raft::prelude::Snapshot> {
        let mut s = crate::lock::lock(&self.inner);
        match s.ready.take() {
            Some(snap) if snap.get_metadata().index >= request_index => Ok(snap),
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

    /// Drops the ready snapshot.
    pub fn clear(&self) {
        crate::lock::lock(&self.inner).ready = None;
    }
}

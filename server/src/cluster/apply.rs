//! Applying a shard's committed log entries to its store: every replica
//! applies the same commands in the same order, so their stores hold the
//! same keys, values and versions.

use dmkv_common::error::{Error, check_key, check_value};
use dmkv_common::proto::{self, raft_command::Op};
use prost::Message;
use thiserror::Error;

use super::noted::Noted;
use super::placement::{MAX_VERSION, MoveRole, Placement};
use crate::kv::{self, Item};
use crate::store::Store;
use dmkv_common::cluster::map::partition_of;

/// What applying one entry did: the same on every replica, since each
/// decides it from the log alone (the entry, the store the earlier
/// entries made, and the log's time).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// An entry with no command (a new leader's empty entry).
    Nothing,
    /// A write stored (any mode): the item's version, its log index.
    Put {
        version: u64,
    },
    Delete {
        existed: bool,
    },
    /// A counter's new value and its item's version.
    Counter {
        value: u64,
        version: u64,
    },
    /// A touch: the live item with its new expiry, or none (boxed: a
    /// shard remembers many outcomes, and this one is never among them).
    Touched {
        item: Option<Box<Item>>,
    },
    /// A write whose condition did not hold, or whose result would not be
    /// an item (an append past the value limit): nothing changed, on any
    /// replica. Only [`refusal`] errors.
    Refused(Error),
    /// An eviction: how many of the items named went.
    Evicted {
        items: u64,
    },
    /// A flush: how many items went.
    Flushed {
        items: u64,
    },
    /// A write to a key whose partition the shard does not own: nothing
    /// changed, on any replica (not remembered: the write belongs to
    /// another shard, which may take it).
    WrongShard,
    /// A placement change: whether it changed what the shard owns (one
    /// older than the shard's placement changes nothing).
    Placement {
        changed: bool,
    },
    /// A copy of items of an incoming partition: how many changed the
    /// store, and how many were skipped (ones no source could hold, or all
    /// of them when the shard takes no copy for that move).
    Ingested {
        items: u64,
        skipped: u64,
    },
    /// A move step: whether the shard records the move after it (a
    /// WATCH or TAKE asked again still does; a FORGET leaves none).
    Moving {
        recorded: bool,
    },
}

/// Whether `e` is an outcome every replica reaches alike from the same
/// log (a condition, a counter's value, a result's size), as opposed to
/// room, which differs per replica and is waited for.
pub fn refusal(e: &Error) -> bool {
    matches!(e, Error::NotStored | Error::Exists | Error::NotFound | Error::NotNumeric | Error::ValueTooLarge(_))
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

/// A shard remembers an identified write for this many of its retry
/// windows after applying it: the client sends a write again only within
/// one window of a try that may have reached a node; the second is margin
/// for a try's time in transit and in queues, and for a new leader whose
/// clock is ahead of the last one's (the log's time jumps with it; a clock
/// behind holds it still instead).
pub const REMEMBER_WINDOWS: u64 = 2;

/// Memory a shard's remembered writes may take. Past it the soonest to
/// expire are forgotten early (and counted): 32 MiB holds 262,144 writes,
/// two default 5 s windows at 26,000 identified writes a second per shard.
/// A constant, not a share of the shard's memory: which writes are
/// remembered is part of the state machine, and each node sizes its own
/// replicas' memory.
pub const MAX_REMEMBERED_BYTES: usize = 32 << 20;

/// What one remembered write costs, roughly: its id and outcome in the
/// map (40 bytes and a control byte), its place in the expiry queue (32),
/// and the tables' room to grow (they double; the count is sized for the
/// average, half again the live bytes, so a shard's worst moment, both
/// tables just doubled, takes about 150 bytes a write: 37 MiB).
/// Every write costs the same, so the byte bound is a count bound.
pub const REMEMBERED_ENTRY_BYTES: usize = 128;

/// Most writes a shard remembers (see [`MAX_REMEMBERED_BYTES`]).
pub const MAX_REMEMBERED_WRITES: usize = MAX_REMEMBERED_BYTES / REMEMBERED_ENTRY_BYTES;

fn window_ms(d: std::time::Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// The retry window (ms) a write is remembered by, for a client that asked
/// for `asked` (0: it said none, as older clients do): the maximum when
/// none was said, else within the minimum and the maximum. The leader logs
/// this value; replicas apply it again (it changes nothing logged by this
/// version), since the log came from another node.
pub fn retry_window_ms(asked: u32) -> u32 {
    let max = window_ms(dmkv_common::limits::MAX_WRITE_RETRY_WINDOW);
    let min = window_ms(dmkv_common::limits::MIN_WRITE_RETRY_WINDOW);
    if asked == 0 { max } else { asked.clamp(min, max) }
}

/// The log entry data of a PUT.
pub fn encode_put(key: &[u8], value: &[u8]) -> Vec<u8> {
    encode_put_with(key, value, None, 0)
}

/// The log entry data of a PUT carrying the client's write id, proposed by
/// a leader whose clock reads `now_ms`.
pub fn encode_put_with(key: &[u8], value: &[u8], write_id: Option<proto::WriteId>, now_ms: u64) -> Vec<u8> {
    let p = proto::Put { key: key.to_vec().into(), value: value.to_vec().into(), write_id, ..Default::default() };
    encode_write(p, now_ms)
}

/// The log entry data of any write a PUT asks for (mode, flags, expiry,
/// CAS), proposed by a leader whose clock reads `now_ms`: its TTL becomes
/// an absolute expiry by that clock, so every replica stores the same.
pub fn encode_write(mut p: proto::Put, now_ms: u64) -> Vec<u8> {
    p.expires_at = kv::expiry_of(p.ttl_secs, p.expires_at, now_ms);
    p.ttl_secs = 0;
    p.write_id = p.write_id.map(logged);
    command(Op::Write(p), now_ms)
}

/// The log entry data of a DELETE.
pub fn encode_delete(key: &[u8]) -> Vec<u8> {
    encode_delete_with(key, None, 0)
}

/// The log entry data of a DELETE carrying the client's write id, proposed
/// by a leader whose clock reads `now_ms`.
pub fn encode_delete_with(key: &[u8], write_id: Option<proto::WriteId>, now_ms: u64) -> Vec<u8> {
    encode_delete_cas(proto::Delete { key: key.to_vec().into(), write_id, cas: 0 }, now_ms)
}

/// The log entry data of a DELETE, conditional on a version when `cas` is
/// set.
pub fn encode_delete_cas(mut d: proto::Delete, now_ms: u64) -> Vec<u8> {
    d.write_id = d.write_id.map(logged);
    command(if d.cas == 0 { Op::Delete(d) } else { Op::DeleteCas(d) }, now_ms)
}

/// The log entry data of a counter operation (its TTL made absolute, as a
/// PUT's).
pub fn encode_arith(mut a: proto::Arith, now_ms: u64) -> Vec<u8> {
    a.expires_at = kv::expiry_of(a.ttl_secs, a.expires_at, now_ms);
    a.ttl_secs = 0;
    a.write_id = a.write_id.map(logged);
    command(Op::Arith(a), now_ms)
}

/// The log entry data of a touch (its TTL made absolute).
pub fn encode_touch(mut t: proto::Touch, now_ms: u64) -> Vec<u8> {
    t.expires_at = kv::expiry_of(t.ttl_secs, t.expires_at, now_ms);
    t.ttl_secs = 0;
    t.write_id = t.write_id.map(logged);
    command(Op::Touch(t), now_ms)
}

/// The removal of items the leader chose to evict: `(key, version)`.
pub fn encode_evict(items: Vec<(Vec<u8>, u64)>, now_ms: u64) -> Vec<u8> {
    let items = items.into_iter().map(|(key, version)| proto::EvictItem { key: key.into(), version }).collect();
    command(Op::Evict(proto::Evict { items }), now_ms)
}

/// The log entry data of a flush of the whole shard.
pub fn encode_flush_all(now_ms: u64) -> Vec<u8> {
    command(Op::FlushAll(proto::FlushAll {}), now_ms)
}

/// The log entry data of a copy of items of `partition` from the shard it
/// leaves, for the move at map version `move_version` (each key as the
/// source held it when its next version was `source_version`, or its
/// absence), sent by the mover of `claim`.
pub fn encode_ingest(
    partition: u32,
    move_version: u64,
    source_version: u64,
    claim: u64,
    items: Vec<proto::IngestItem>,
) -> Vec<u8> {
    // No clock: a copy judges nothing by time.
    let g = proto::Ingest { partition, items, move_version, source_version, remembered: Vec::new(), claim };
    command(Op::Ingest(g), 0)
}

/// The log entry data of a copy as given.
pub fn encode_ingest_entry(g: proto::Ingest) -> Vec<u8> {
    command(Op::Ingest(g), 0)
}

/// The log entry data of a step of the move of `partition` at map version
/// `version`, by the mover of `claim`.
pub fn encode_move_step(partition: u32, version: u64, kind: proto::move_step::Kind, claim: u64) -> Vec<u8> {
    command(Op::MoveStep(proto::MoveStep { partition, version, kind: kind as i32, claim }), 0)
}

/// The log entry data of a change of the partitions the shard owns, for
/// map version `version`, by the mover of `claim`.
pub fn encode_placement(version: u64, own: Vec<u32>, release: Vec<u32>, claim: u64, now_ms: u64) -> Vec<u8> {
    command(Op::Placement(proto::PlacementChange { version, own, release, claim }), now_ms)
}

fn command(op: Op, now_ms: u64) -> Vec<u8> {
    proto::RaftCommand { op: Some(op), now_ms }.encode_to_vec()
}

/// A client's write id as the log carries it: with the window it is
/// remembered by, so the log says what every replica does.
fn logged(mut id: proto::WriteId) -> proto::WriteId {
    id.retry_window_ms = retry_window_ms(id.retry_window_ms);
    id
}

/// One remembered write, as a snapshot carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RememberedWrite {
    pub client: u64,
    pub seq: u64,
    pub outcome: Applied,
    /// Log time (ms) at which it is forgotten.
    pub expires_ms: u64,
    /// The partition of the key written ([`NO_PARTITION`]: not known, in
    /// a snapshot from before partitions were kept).
    pub partition: u32,
}

/// A remembered write's partition, not known.
pub const NO_PARTITION: u32 = u32::MAX;

/// A shard's remembered writes as a snapshot carries them, and its
/// placement beside them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RememberedParts {
    /// The shard's log time: the latest leader clock applied.
    pub now_ms: u64,
    /// Soonest to expire first (among equal expiries, first remembered
    /// first): the order they are forgotten in.
    pub writes: Vec<RememberedWrite>,
    /// The partitions the shard owns (`None`: a snapshot from before
    /// placements, or a test's).
    pub placement: Option<Placement>,
}

/// A remembered outcome as (kind, a, b). Touches, flushes, evictions,
/// placement changes and writes to a partition the shard does not own are
/// never remembered (`apply_once` gives them no id, or returns first).
pub fn outcome_fields(a: &Applied) -> (u8, u64, u64) {
    match *a {
        Applied::Nothing
        | Applied::Touched { .. }
        | Applied::Flushed { .. }
        | Applied::Evicted { .. }
        | Applied::WrongShard
        | Applied::Placement { .. }
        | Applied::Ingested { .. }
        | Applied::Moving { .. } => (0, 0, 0),
        Applied::Put { version } => (1, version, 0),
        Applied::Delete { existed } => (2, u64::from(existed), 0),
        Applied::Counter { value, version } => (3, value, version),
        Applied::Refused(ref e) => match e {
            Error::NotStored => (4, 1, 0),
            Error::Exists => (4, 2, 0),
            Error::NotFound => (4, 3, 0),
            Error::NotNumeric => (4, 4, 0),
            Error::ValueTooLarge(n) => (4, 5, *n as u64),
            // `Applied::Refused` holds only what `apply::refusal` takes.
            _ => (0, 0, 0),
        },
    }
}

/// The outcome [`outcome_fields`] gave as (kind, a, b); `None` for a
/// kind that is not one.
pub fn outcome_of(kind: u8, a: u64, b: u64) -> Option<Applied> {
    Some(match (kind, a) {
        (0, _) => Applied::Nothing,
        (1, _) => Applied::Put { version: a },
        (2, _) => Applied::Delete { existed: a != 0 },
        (3, _) => Applied::Counter { value: a, version: b },
        (4, 1) => Applied::Refused(Error::NotStored),
        (4, 2) => Applied::Refused(Error::Exists),
        (4, 3) => Applied::Refused(Error::NotFound),
        (4, 4) => Applied::Refused(Error::NotNumeric),
        (4, 5) => Applied::Refused(Error::ValueTooLarge(usize::try_from(b).unwrap_or(usize::MAX))),
        _ => return None,
    })
}

/// The outcomes of identified writes, each until its window has passed
/// twice by the log's time (part of the state machine: every replica
/// remembers and forgets the same writes at the same entries, since both
/// are decided from the entries alone).
///
/// The log's time is the latest leader clock (`RaftCommand::now_ms`)
/// applied: it never goes back, even when a new leader's clock is behind
/// the last one's, and a write is remembered from that time, not its own
/// entry's (a leader behind would have it forgotten early).
#[derive(Debug, Default)]
pub struct Remembered {
    /// Each write's outcome, and the partition of its key.
    outcomes: std::collections::HashMap<(u64, u64), (Applied, u32)>,
    /// Soonest to expire on top: (expires at, order remembered in, client,
    /// seq). The order makes ties fall the same way on every replica.
    queue: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u64, u64, u64)>>,
    now_ms: u64,
    next_order: u64,
    /// Forgotten before their time to stay within the byte bound, since
    /// last taken.
    dropped_early: u64,
}

impl Remembered {
    /// The shard's log time (ms).
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Writes remembered now.
    pub fn len(&self) -> usize {
        self.outcomes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
    }

    /// The remembered writes, for a snapshot.
    pub fn to_parts(&self) -> RememberedParts {
        let mut queue: Vec<_> = self.queue.iter().map(|e| e.0).collect();
        queue.sort_unstable();
        let writes = queue
            .into_iter()
            .filter_map(|(expires_ms, _, client, seq)| {
                let (outcome, partition) = self.outcomes.get(&(client, seq))?.clone();
                Some(RememberedWrite { client, seq, outcome, expires_ms, partition })
            })
            .collect();
        RememberedParts { now_ms: self.now_ms, writes, placement: None }
    }

    /// The remembered writes to keys of `partition` (and those whose
    /// partition is not known), in the order they are forgotten: what
    /// goes with a partition that moves to another shard.
    pub fn of_partition(&self, partition: u32) -> Vec<RememberedWrite> {
        let mut parts = self.to_parts();
        parts.writes.retain(|w| w.partition == partition || w.partition == NO_PARTITION);
        parts.writes
    }

    /// Remembers what a snapshot carried: the same writes, forgotten at the
    /// same log times and in the same order as where it was taken.
    pub fn from_parts(parts: &RememberedParts) -> Remembered {
        let mut r = Remembered::default();
        for w in &parts.writes {
            r.remember((w.client, w.seq), w.outcome.clone(), w.expires_ms, w.partition);
        }
        r.advance(parts.now_ms);
        r
    }

    /// Writes forgotten early (the byte bound) since the last call.
    pub fn take_dropped_early(&mut self) -> u64 {
        std::mem::take(&mut self.dropped_early)
    }

    /// Moves the log time on to `now_ms` (never back) and forgets the
    /// writes whose time has come: from the queue's top, so an entry costs
    /// only what it forgets.
    fn advance(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        while let Some(&std::cmp::Reverse((expires, _, client, seq))) = self.queue.peek()
            && expires <= self.now_ms
        {
            self.queue.pop();
            self.outcomes.remove(&(client, seq));
        }
    }

    fn get(&self, id: Option<&proto::WriteId>) -> Option<Applied> {
        id.and_then(|w| self.outcomes.get(&(w.client, w.seq)).map(|(a, _)| a.clone()))
    }

    fn insert(&mut self, id: Option<&proto::WriteId>, a: &Applied, partition: u32) {
        let Some(w) = id else { return };
        let window = u64::from(retry_window_ms(w.retry_window_ms));
        self.remember((w.client, w.seq), a.clone(), self.now_ms.saturating_add(REMEMBER_WINDOWS * window), partition);
    }

    fn remember(&mut self, id: (u64, u64), a: Applied, expires_ms: u64, partition: u32) {
        // The first outcome stands (a snapshot naming a write twice, or a
        // moved partition's writes the shard had remembered itself).
        if self.outcomes.contains_key(&id) {
            return;
        }
        self.outcomes.insert(id, (a, partition));
        self.queue.push(std::cmp::Reverse((expires_ms, self.next_order, id.0, id.1)));
        self.next_order += 1;
        while self.outcomes.len() > MAX_REMEMBERED_WRITES {
            let Some(std::cmp::Reverse((_, _, client, seq))) = self.queue.pop() else { break };
            self.outcomes.remove(&(client, seq));
            self.dropped_early += 1;
        }
    }
}

/// What a shard's remembered writes report, for STATS and metrics (written
/// by the shard's thread).
#[derive(Debug, Default)]
pub struct RememberedStats {
    /// Writes remembered now.
    pub writes: std::sync::atomic::AtomicU64,
    /// Writes forgotten before their time to stay within
    /// [`MAX_REMEMBERED_BYTES`]: a retry of one of them would apply again.
    pub dropped_early: std::sync::atomic::AtomicU64,
}

/// Applies the data of the committed entry at `index` to `store`, for a
/// shard that owns every partition.
pub fn apply(store: &Store, index: u64, data: &[u8]) -> Result<Applied, ApplyError> {
    apply_once(store, &mut Remembered::default(), &mut Placement::all(), &mut Noted::default(), index, data)
}

/// [`apply`], except that a write whose id `seen` remembers is not
/// applied again: it is answered as the first time.
///
/// A write's version is its entry's index (plus the shard's version skew,
/// after a copy from another shard): the same on every replica,
/// in log order, whatever else a store did (an emptied store replaying its
/// log, or writes refused for want of room and retried), so a version a
/// client saw on one leader means the same on the next, and a CAS names
/// the same item on every replica.
///
/// Every judgement is made from the log alone: expiry by the log's time
/// (the latest leader clock applied, never this node's clock), conditions
/// against the item the earlier entries left, so the replicas reach the
/// same outcome and hold the same items, versions, flags and expiries. A
/// condition is judged here, at its place in the log, not by the leader
/// when it proposed: another write to the key may be ahead of it in the
/// log, not applied yet when it was proposed.
///
/// So is ownership: a write to a partition `placement` does not hold is
/// refused here (after a remembered outcome, which stands: the write was
/// applied while the shard owned the key, and went with the partition).
pub fn apply_once(
    store: &Store,
    seen: &mut Remembered,
    placement: &mut Placement,
    noted: &mut Noted,
    index: u64,
    data: &[u8],
) -> Result<Applied, ApplyError> {
    if data.is_empty() {
        return Ok(Applied::Nothing);
    }
    let cmd = proto::RaftCommand::decode(data).map_err(|e| ApplyError::Malformed(e.to_string()))?;
    // Time from the entry, never this node's clock: every replica forgets
    // the same writes here, and judges expiry alike.
    seen.advance(cmd.now_ms);
    let now = seen.now_ms;
    // The entry's index plus the shard's version skew: zero until the
    // shard took items from another whose versions ran ahead of this log
    // (an Ingest raises it past them), so a key's versions only go up and
    // a version names one item of it. The skew is raised from what the
    // entries carry, never from what a replica's store did, so it is the
    // same on every replica.
    let version = Some(index.saturating_add(placement.version_skew()));
    let partition = match &cmd.op {
        Some(Op::Put(p) | Op::Write(p)) => partition_of(&p.key),
        Some(Op::Delete(d) | Op::DeleteCas(d)) => partition_of(&d.key),
        Some(Op::Arith(a)) => partition_of(&a.key),
        _ => NO_PARTITION,
    };
    let (id, result) = match cmd.op {
        Some(Op::Put(p) | Op::Write(p)) => {
            if let Some(a) = seen.get(p.write_id.as_ref()) {
                return Ok(a);
            }
            if !placement.owns_key(&p.key) {
                return Ok(Applied::WrongShard);
            }
            noted.note(placement, &p.key);
            let w = kv::write_of(&p, now);
            (p.write_id, store.write_versioned(&p.key, &w, now, version).map(|m| Applied::Put { version: m.version }))
        }
        Some(Op::Delete(d) | Op::DeleteCas(d)) => {
            if let Some(a) = seen.get(d.write_id.as_ref()) {
                return Ok(a);
            }
            if !placement.owns_key(&d.key) {
                return Ok(Applied::WrongShard);
            }
            noted.note(placement, &d.key);
            (d.write_id, store.delete_if(&d.key, d.cas, now).map(|existed| Applied::Delete { existed }))
        }
        Some(Op::Arith(a)) => {
            if let Some(done) = seen.get(a.write_id.as_ref()) {
                return Ok(done);
            }
            if !placement.owns_key(&a.key) {
                return Ok(Applied::WrongShard);
            }
            noted.note(placement, &a.key);
            let r = store
                .arith_versioned(&a.key, &kv::arith_of(&a, now), now, version)
                .map(|(value, m)| Applied::Counter { value, version: m.version });
            (a.write_id, r)
        }
        // Not remembered (its reply carries the item): a touch sent again
        // is timed again by the leader it reaches.
        Some(Op::Touch(t)) if !placement.owns_key(&t.key) => return Ok(Applied::WrongShard),
        Some(Op::Touch(t)) => {
            noted.note(placement, &t.key);
            (None, store.touch(&t.key, t.expires_at, now).map(|item| Applied::Touched { item: item.map(Box::new) }))
        }
        Some(Op::FlushAll(_)) => {
            noted.all_whole(placement);
            // Copies of a partition on its way here are the source's items,
            // not this shard's: the source's flush decides for them (its
            // notes go whole, and the next copy says what is left).
            let incoming = |key: &[u8]| {
                let p = partition_of(key);
                placement.moves().iter().any(|m| m.partition == p && m.role == MoveRole::In)
            };
            let items = if placement.moves().is_empty() { store.clear_all() } else { store.clear_unless(incoming) };
            (None, Ok(Applied::Flushed { items }))
        }
        // Each item only if it is still the version the leader chose (a
        // write since made a new one, which stays); a key already gone is
        // nothing to do. Every replica removes the same items.
        Some(Op::Evict(e)) => {
            let mut items = 0;
            for it in &e.items {
                noted.note(placement, &it.key);
                if it.version != 0 && matches!(store.delete_if(&it.key, it.version, now), Ok(true)) {
                    items += 1;
                }
            }
            store.counters.evictions.fetch_add(items, std::sync::atomic::Ordering::Relaxed);
            (None, Ok(Applied::Evicted { items }))
        }
        // A copy is taken only for the move this shard records as its
        // target, while it does not own the partition: once it owns it, its
        // own writes are newer than anything a copy could carry, and a copy
        // of an abandoned move comes too late.
        Some(Op::Ingest(g)) if !placement.takes(g.partition, g.move_version, g.claim) => {
            // At least one, so a copy of nothing but the horizon that is not
            // taken fails the move too.
            let skipped = (g.items.len() + g.remembered.len()).max(1) as u64;
            return Ok(Applied::Ingested { items: 0, skipped });
        }
        Some(Op::Ingest(g)) => return ingest(store, seen, placement, index, &g),
        Some(Op::MoveStep(m)) => {
            if let Err(e) = placement.apply_step(&m) {
                tracing::warn!("move step at {index} refused: {e:?}");
            }
            noted.retain_watched(placement);
            // Recorded as this mover's: a step of a mover taken over is not.
            let recorded = placement
                .moves()
                .iter()
                .any(|r| r.partition == m.partition && r.version == m.version && r.claim == m.claim);
            return Ok(Applied::Moving { recorded });
        }
        // A change naming what cannot be changes nothing, alike on every
        // replica (stopping here would stop the followers and not the
        // leader that proposed it); the leader checks what it proposes.
        Some(Op::Placement(c)) => match placement.apply(&c) {
            Ok(changed) => return Ok(Applied::Placement { changed }),
            Err(e) => {
                tracing::warn!("placement change at {index} refused: {e}");
                return Ok(Applied::Placement { changed: false });
            }
        },
        None => return Err(ApplyError::Malformed("no operation".into())),
    };
    let applied = match result {
        Err(e) if refusal(&e) => Applied::Refused(e),
        r => r?,
    };
    seen.insert(id.as_ref(), &applied, partition);
    Ok(applied)
}

/// Applies a copy of items of a partition moving here (see `Op::Ingest`).
/// What no source could hold is skipped, alike on every replica (a key of
/// another partition or past the limits, a version of 0 or past
/// [`MAX_VERSION`]), and counted: the mover fails the move on any. Applied
/// again whole after a stall for room, which changes nothing: an item
/// replaces only an older one, an absence removes only an older one.
fn ingest(
    store: &Store,
    seen: &mut Remembered,
    placement: &mut Placement,
    index: u64,
    g: &proto::Ingest,
) -> Result<Applied, ApplyError> {
    let fits = |it: &&proto::IngestItem| {
        partition_of(&it.key) == g.partition
            && check_key(&it.key).is_ok()
            && (1..=MAX_VERSION).contains(&it.version)
            && (!it.present || check_value(&it.value).is_ok())
    };
    // From what the source gave: its horizon and the items' versions. An
    // absence's version only bounds what it removes.
    let above = g.source_version.min(MAX_VERSION);
    let mut highest = above;
    for it in g.items.iter().filter(fits).filter(|it| it.present) {
        highest = highest.max(it.version.saturating_add(1).min(MAX_VERSION));
    }
    // Before the store changes: an entry stalled for room and applied again
    // raises it to the same value.
    placement.raise_version_skew(index, highest);
    let (mut items, mut skipped) = (0, 0);
    for it in &g.items {
        if !fits(&it) {
            skipped += 1;
            continue;
        }
        let changed = match it.present {
            true => store.ingest(&it.key, &it.value, it.version, it.flags, it.expires_at),
            false => store.ingest_absence(&it.key, it.version),
        };
        match changed {
            Ok(changed) => items += u64::from(changed),
            // Stalled and applied again whole once there is room.
            Err(Error::OutOfMemory) => return Err(ApplyError::Store(Error::OutOfMemory)),
            // Counted, never half an entry: the mover fails the move.
            Err(_) => skipped += 1,
        }
    }
    // The outcomes the source remembered for the partition's writes: a
    // write it applied, sent again to this shard, is answered as the
    // first time, not applied again. Remembered as there (same expiry by
    // the log's time, which both shards take from their leaders' clocks).
    for r in &g.remembered {
        let outcome = u8::try_from(r.kind).ok().and_then(|k| outcome_of(k, r.a, r.b));
        match outcome {
            Some(a) => seen.remember((r.client, r.seq), a, r.expires_ms, g.partition),
            None => skipped += 1,
        }
    }
    Ok(Applied::Ingested { items, skipped })
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
        assert_eq!(apply(&s, next(), &encode_put(b"k", b"v")).unwrap(), Applied::Put { version: 1 });
        assert_eq!(apply(&s, next(), &encode_delete(b"k")).unwrap(), Applied::Delete { existed: true });
        assert_eq!(apply(&s, next(), &[]).unwrap(), Applied::Nothing);
        s.put(b"kept", b"1").unwrap();
        // Garbage, and a message with no operation (an unknown field only).
        for bad in [&b"\xff\xff\xff"[..], &[0x18, 0x01][..]] {
            let e = apply(&s, next(), bad);
            assert!(matches!(e, Err(ApplyError::Malformed(_))), "{e:?}");
        }
        assert!(matches!(apply(&s, next(), &encode_put(b"", b"v")), Err(ApplyError::Store(Error::EmptyKey))));
        assert_eq!(s.get(b"kept").unwrap().unwrap().0, bytes::Bytes::from_static(b"1"));
    }

    /// An eviction entry removes each named item only where it is still
    /// the version the leader chose: a write since stays, and a key gone
    /// or never there is nothing to do.
    #[test]
    fn an_eviction_removes_only_the_versions_it_names() {
        let s = Store::format(Arc::new(Region::create("evict", 4 << 20).unwrap()), 64, 1, 1, Duration::ZERO).unwrap();
        let v = |a: Applied| match a {
            Applied::Put { version } => version,
            other => panic!("{other:?}"),
        };
        let a = v(apply(&s, next(), &encode_put(b"a", b"1")).unwrap());
        let b = v(apply(&s, next(), &encode_put(b"b", b"1")).unwrap());
        let b2 = v(apply(&s, next(), &encode_put(b"b", b"2")).unwrap());
        let victims = vec![(b"a".to_vec(), a), (b"b".to_vec(), b), (b"gone".to_vec(), 7), (b"a".to_vec(), 0)];
        assert_eq!(apply(&s, next(), &encode_evict(victims, 0)).unwrap(), Applied::Evicted { items: 1 });
        assert!(s.get(b"a").unwrap().is_none(), "a's version was named");
        let (value, meta) = s.get(b"b").unwrap().unwrap();
        assert_eq!((value, meta), (bytes::Bytes::from_static(b"2"), b2), "a newer b stays");
        assert_eq!(s.counters.evictions.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    /// Once a partition is given up, every write to it is refused alike
    /// and changes nothing, except one applied before (its remembered
    /// outcome stands); reads are the node's to refuse. Taking it back
    /// lets writes in again; a change older than the placement, or one
    /// naming no partition there is, changes nothing.
    #[test]
    fn writes_to_a_partition_the_shard_gave_up_are_refused_alike() {
        use dmkv_common::cluster::map::partition_of;
        let s = store("moved");
        let (mut seen, mut placement) = (Remembered::default(), Placement::all());
        let mut run =
            |data: &[u8]| apply_once(&s, &mut seen, &mut placement, &mut Default::default(), next(), data).unwrap();
        let put = encode_put_with(b"k", b"1", id(3, 1, 0), 0);
        assert!(matches!(run(&put), Applied::Put { .. }));
        let p = partition_of(b"k");
        assert_eq!(run(&encode_placement(2, vec![], vec![p], 0, 0)), Applied::Placement { changed: true });
        assert_eq!(run(&encode_put(b"k", b"2")), Applied::WrongShard);
        assert_eq!(run(&encode_delete(b"k")), Applied::WrongShard);
        let arith = proto::Arith { key: b"k".to_vec().into(), delta: 1, ..Default::default() };
        assert_eq!(run(&encode_arith(arith, 0)), Applied::WrongShard);
        let touch = proto::Touch { key: b"k".to_vec().into(), ttl_secs: 5, ..Default::default() };
        assert_eq!(run(&encode_touch(touch, 0)), Applied::WrongShard);
        assert!(matches!(run(&put), Applied::Put { .. }), "a retry of a write applied before is answered as then");
        assert_eq!(run(&encode_placement(2, vec![p], vec![], 0, 0)), Applied::Placement { changed: false });
        assert_eq!(run(&encode_put(b"k", b"3")), Applied::WrongShard);
        assert_eq!(run(&encode_placement(3, vec![p], vec![], 0, 0)), Applied::Placement { changed: true });
        assert!(matches!(run(&encode_put(b"k", b"3")), Applied::Put { .. }));
        let bad = apply_once(
            &s,
            &mut seen,
            &mut placement,
            &mut Default::default(),
            next(),
            &encode_placement(4, vec![1 << 20], vec![], 0, 0),
        );
        assert_eq!(bad.unwrap(), Applied::Placement { changed: false }, "changes nothing, on every replica");
        assert_eq!(placement.version(), 3);
        assert_eq!(s.get(b"k").unwrap().unwrap().0, bytes::Bytes::from_static(b"3"));
    }

    /// A copy of an incoming partition keeps the source's versions, takes
    /// only keys of that partition and only for the move the shard records
    /// as its target, replaces only older items (so a copy applied again,
    /// or out of order, changes nothing), removes what the source no longer
    /// had, and comes too late once the partition is owned; writes after it
    /// get versions above every version the source gave, on every replica
    /// alike.
    #[test]
    fn an_incoming_partition_keeps_its_versions_and_later_writes_go_above_them() {
        use proto::move_step::Kind;
        let key_in = |p: u32, n: usize| -> Vec<Vec<u8>> {
            (0..).map(|i| format!("key{i}").into_bytes()).filter(|k| partition_of(k) == p).take(n).collect()
        };
        let p = partition_of(b"incoming");
        let other = (p + 1) % dmkv_common::cluster::map::PARTITIONS;
        let [a, b, c, d, e]: [Vec<u8>; 5] = key_in(p, 5).try_into().unwrap();
        let stranger = key_in(other, 1).remove(0);
        let (s1, s2) = (store("ingest-a"), store("ingest-b"));
        let mut outcomes = Vec::new();
        for s in [&s1, &s2] {
            let (mut seen, mut placement, mut noted) = (Remembered::default(), Placement::all(), Noted::default());
            let mut run =
                |index: u64, data: &[u8]| apply_once(s, &mut seen, &mut placement, &mut noted, index, data).unwrap();
            assert_eq!(run(1, &encode_placement(2, vec![], vec![p], 0, 0)), Applied::Placement { changed: true });
            assert!(matches!(run(2, &encode_put(&c, b"old")), Applied::WrongShard));
            let item = |key: &[u8], value: &[u8], version| proto::IngestItem {
                key: key.to_vec().into(),
                present: true,
                value: value.to_vec().into(),
                version,
                flags: 7,
                expires_at: 0,
            };
            let gone =
                |key: &[u8], version| proto::IngestItem { key: key.to_vec().into(), version, ..Default::default() };
            // No record of the move yet: nothing is taken.
            let early = encode_ingest(p, 3, 1200, 0, vec![item(&e, b"early", 10)]);
            assert_eq!(run(3, &early), Applied::Ingested { items: 0, skipped: 1 });
            assert_eq!(run(4, &encode_move_step(p, 3, Kind::Take, 0)), Applied::Moving { recorded: true });
            // What no shard could hold is skipped: a version of 0 or past
            // the bound, an oversized value, another partition's key.
            let huge = vec![0u8; dmkv_common::limits::MAX_VALUE_LEN + 1];
            let copy = vec![
                item(&a, b"va", 1000),
                item(&b, b"vb", 900),
                item(&stranger, b"no", 5),
                item(&d, b"zero", 0),
                item(&d, b"max", u64::MAX),
                item(&d, &huge, 7),
            ];
            assert_eq!(run(5, &encode_ingest(p, 3, 1200, 0, copy.clone())), Applied::Ingested { items: 2, skipped: 4 });
            assert_eq!(
                run(6, &encode_ingest(p, 3, 1200, 0, copy)),
                Applied::Ingested { items: 0, skipped: 4 },
                "again"
            );
            // A catch-up round: b went at the source, a changed; an older
            // copy of a arriving after it changes nothing.
            let round = vec![gone(&b, 1300), item(&a, b"va2", 1250)];
            assert_eq!(run(7, &encode_ingest(p, 3, 1300, 0, round)), Applied::Ingested { items: 2, skipped: 0 });
            // A removal past every version (a purge's) raises no skew.
            let older = vec![item(&a, b"va", 1000), gone(&a, 1100), gone(&e, MAX_VERSION)];
            assert_eq!(run(8, &encode_ingest(p, 3, 1200, 0, older)), Applied::Ingested { items: 0, skipped: 0 });
            // Another move's copy is not this one's.
            let stray = encode_ingest(p, 4, 1300, 0, vec![item(&e, b"stray", 10)]);
            assert_eq!(run(9, &stray), Applied::Ingested { items: 0, skipped: 1 });
            assert_eq!(run(10, &encode_placement(3, vec![p], vec![], 0, 0)), Applied::Placement { changed: true });
            let late = encode_ingest(p, 3, 1300, 0, vec![item(&a, b"stale", 1290)]);
            assert_eq!(run(11, &late), Applied::Ingested { items: 0, skipped: 1 });
            let Applied::Put { version } = run(12, &encode_put(&a, b"new")) else { panic!("a write of an owned key") };
            let Applied::Put { version: next } = run(13, &encode_put(&c, b"c")) else { panic!("a write") };
            outcomes.push((version, next));
        }
        assert_eq!(outcomes[0], outcomes[1], "the same versions on every replica");
        let (version, next) = outcomes[0];
        assert!(version >= 1300 && next > version, "versions go up past the source's: {version}, {next}");
        assert!(version < 1400, "the skew is raised from what the copies carried: {version}");
        let (value, meta) = s1.get(&a).unwrap().unwrap();
        assert_eq!((value, meta), (bytes::Bytes::from_static(b"new"), version));
        assert!(s1.get(&b).unwrap().is_none(), "removed as the source had it");
        assert!(s1.get(&stranger).unwrap().is_none(), "another partition's key is not taken");
        assert!(s1.get(&d).unwrap().is_none(), "nothing a shard could not hold is taken");
        assert!(s1.get(&e).unwrap().is_none(), "nothing taken before the move's record or for another move");
    }

    /// A flush on a target mid-move keeps the copies of the partition on
    /// its way (the source's items: its own flush decides for them) and
    /// removes the shard's own.
    #[test]
    fn a_flush_on_a_target_keeps_the_incoming_copies() {
        use proto::move_step::Kind;
        let p = partition_of(b"incoming-flush");
        let key = (0..).map(|i| format!("f{i}").into_bytes()).find(|k| partition_of(k) == p).unwrap();
        let own = (0..).map(|i| format!("g{i}").into_bytes()).find(|k| partition_of(k) != p).unwrap();
        let s = store("flush-target");
        let (mut seen, mut placement) = (Remembered::default(), Placement::all());
        let mut run = |index: u64, data: &[u8]| {
            apply_once(&s, &mut seen, &mut placement, &mut Default::default(), index, data).unwrap()
        };
        run(1, &encode_placement(2, vec![], vec![p], 0, 0));
        run(2, &encode_move_step(p, 3, Kind::Take, 0));
        run(3, &encode_put(&own, b"mine"));
        let copy = proto::IngestItem {
            key: key.clone().into(),
            present: true,
            value: bytes::Bytes::from_static(b"theirs"),
            version: 9,
            ..Default::default()
        };
        assert_eq!(run(4, &encode_ingest(p, 3, 10, 0, vec![copy])), Applied::Ingested { items: 1, skipped: 0 });
        assert_eq!(run(5, &encode_flush_all(0)), Applied::Flushed { items: 1 });
        assert!(s.get(&own).unwrap().is_none());
        assert!(s.get(&key).unwrap().is_some(), "the incoming copy went with the flush");
    }

    /// The outcomes a source remembered go with the partition: a write it
    /// applied, sent again to the target, is answered as the first time
    /// and not applied again; a bad outcome is skipped and counted.
    #[test]
    fn remembered_writes_move_with_their_partition() {
        use proto::move_step::Kind;
        let p = partition_of(b"remembered");
        let key = (0..).map(|i| format!("r{i}").into_bytes()).find(|k| partition_of(k) == p).unwrap();
        let (src, dst) = (store("remember-src"), store("remember-dst"));
        let (mut seen_s, mut place_s) = (Remembered::default(), Placement::all());
        let put = encode_put_with(&key, b"once", id(9, 1, 5000), 1_000);
        let Applied::Put { version } =
            apply_once(&src, &mut seen_s, &mut place_s, &mut Default::default(), 1, &put).unwrap()
        else {
            panic!("a put")
        };
        let writes = seen_s.of_partition(p);
        assert_eq!(writes.len(), 1);
        assert!(seen_s.of_partition((p + 1) % dmkv_common::cluster::map::PARTITIONS).is_empty());
        let (mut seen_t, mut place_t) = (Remembered::default(), Placement::all());
        let mut run = |index: u64, data: &[u8]| {
            apply_once(&dst, &mut seen_t, &mut place_t, &mut Default::default(), index, data).unwrap()
        };
        assert_eq!(run(1, &encode_placement(2, vec![], vec![p], 0, 1_000)), Applied::Placement { changed: true });
        assert_eq!(run(2, &encode_move_step(p, 3, Kind::Take, 0)), Applied::Moving { recorded: true });
        let outcome = |w: &RememberedWrite| {
            let (kind, a, b) = outcome_fields(&w.outcome);
            proto::RememberedOutcome { client: w.client, seq: w.seq, kind: kind.into(), a, b, expires_ms: w.expires_ms }
        };
        let mut remembered: Vec<_> = writes.iter().map(outcome).collect();
        remembered.push(proto::RememberedOutcome { client: 9, seq: 2, kind: 77, ..Default::default() });
        let g = proto::Ingest { partition: p, move_version: 3, remembered, ..Default::default() };
        assert_eq!(run(3, &encode_ingest_entry(g)), Applied::Ingested { items: 0, skipped: 1 });
        assert_eq!(run(4, &encode_placement(3, vec![p], vec![], 0, 1_000)), Applied::Placement { changed: true });
        // The retry reaches the target: answered, not applied.
        assert_eq!(run(5, &put), Applied::Put { version });
        assert!(dst.get(&key).unwrap().is_none(), "applied again on the target");
    }

    /// A source notes the keys its log writes in a partition it watches,
    /// every kind of write and eviction alike; a flush makes the partition
    /// whole; a released partition's writes are refused, not noted.
    #[test]
    fn a_watched_partition_notes_every_key_its_log_writes() {
        use proto::move_step::Kind;
        let p = partition_of(b"watched");
        let keys: Vec<Vec<u8>> =
            (0..).map(|i| format!("w{i}").into_bytes()).filter(|k| partition_of(k) == p).take(6).collect();
        let outside = (0..).map(|i| format!("o{i}").into_bytes()).find(|k| partition_of(k) != p).unwrap();
        let s = store("noting");
        let (mut seen, mut placement, mut noted) = (Remembered::default(), Placement::all(), Noted::default());
        let mut run = |noted: &mut Noted, index: u64, data: &[u8]| {
            apply_once(&s, &mut seen, &mut placement, noted, index, data).unwrap()
        };
        run(&mut noted, 1, &encode_put(&keys[0], b"before the watch"));
        assert_eq!(run(&mut noted, 2, &encode_move_step(p, 5, Kind::Watch, 0)), Applied::Moving { recorded: true });
        run(&mut noted, 3, &encode_put(&keys[1], b"1"));
        run(&mut noted, 4, &encode_put(&outside, b"1"));
        run(&mut noted, 5, &encode_delete(&keys[2]));
        let incr = proto::Arith { key: keys[3].clone().into(), delta: 1, vivify: true, ..Default::default() };
        run(&mut noted, 6, &encode_arith(incr, 0));
        run(&mut noted, 7, &encode_touch(proto::Touch { key: keys[4].clone().into(), ..Default::default() }, 0));
        let evict = proto::Evict { items: vec![proto::EvictItem { key: keys[0].clone().into(), version: 1 }] };
        run(&mut noted, 8, &command(Op::Evict(evict), 0));
        let got = noted.take(p);
        let want: std::collections::HashSet<bytes::Bytes> =
            [0, 1, 2, 3, 4].iter().map(|&i| bytes::Bytes::from(keys[i].clone())).collect();
        assert_eq!((got.keys, got.whole), (want, false));
        run(&mut noted, 9, &encode_flush_all(0));
        assert!(noted.take(p).whole, "a flush names no keys");
        assert_eq!(
            run(&mut noted, 10, &encode_placement(5, vec![], vec![p], 0, 0)),
            Applied::Placement { changed: true }
        );
        assert_eq!(run(&mut noted, 11, &encode_put(&keys[5], b"after")), Applied::WrongShard);
        assert!(noted.take(p).keys.is_empty(), "refused, not noted");
    }

    thread_local!(static INDEX: std::cell::Cell<u64> = const { std::cell::Cell::new(0) });

    /// The next log index, as raft hands them out.
    fn next() -> u64 {
        INDEX.with(|i| {
            i.set(i.get() + 1);
            i.get()
        })
    }

    fn store(name: &str) -> Store {
        Store::format(Arc::new(Region::create(name, 4 << 20).unwrap()), 64, 1, 1, Duration::ZERO).unwrap()
    }

    fn id(client: u64, seq: u64, retry_window_ms: u32) -> Option<proto::WriteId> {
        Some(proto::WriteId { client, seq, retry_window_ms })
    }

    #[test]
    fn a_write_sent_again_applies_once() {
        let s = store("apply");
        let mut seen = Remembered::default();
        let put = encode_put_with(b"k", b"v", id(7, 1, 0), 0);
        let first = apply_once(
            &s,
            &mut seen,
            &mut crate::cluster::placement::Placement::all(),
            &mut Default::default(),
            next(),
            &put,
        )
        .unwrap();
        // Another client's write in between, then the first one again.
        apply_once(
            &s,
            &mut seen,
            &mut crate::cluster::placement::Placement::all(),
            &mut Default::default(),
            next(),
            &encode_put_with(b"k", b"w", id(8, 1, 0), 0),
        )
        .unwrap();
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &put
            )
            .unwrap(),
            first,
            "answered as the first time"
        );
        assert_eq!(s.get(b"k").unwrap().unwrap().0, bytes::Bytes::from_static(b"w"), "and not applied again");
        let del = encode_delete_with(b"k", id(7, 2, 0), 0);
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &del
            )
            .unwrap(),
            Applied::Delete { existed: true }
        );
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &del
            )
            .unwrap(),
            Applied::Delete { existed: true },
            "a retried DELETE"
        );
        // Without an id every copy applies.
        apply_once(
            &s,
            &mut seen,
            &mut crate::cluster::placement::Placement::all(),
            &mut Default::default(),
            next(),
            &encode_put(b"n", b"1"),
        )
        .unwrap();
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &encode_delete(b"n")
            )
            .unwrap(),
            Applied::Delete { existed: true }
        );
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &encode_delete(b"n")
            )
            .unwrap(),
            Applied::Delete { existed: false }
        );
    }

    /// A PUT of `mode` with `f` set on it.
    fn put(key: &str, value: &str, f: impl FnOnce(&mut proto::Put)) -> proto::Put {
        let mut p = proto::Put {
            key: key.as_bytes().to_vec().into(),
            value: value.as_bytes().to_vec().into(),
            ..Default::default()
        };
        f(&mut p);
        p
    }

    #[test]
    fn every_write_mode_applies_alike_on_every_replica_judged_by_the_log_alone() {
        use proto::PutMode::{Add, Append, Prepend, Replace};
        let t = 1_800_000_000_000u64;
        let secs = (t / 1000) as u32;
        let arith = |key: &str, delta, decrement| proto::Arith {
            key: key.as_bytes().to_vec().into(),
            delta,
            decrement,
            ..Default::default()
        };
        let del = |key: &str, cas| proto::Delete { key: key.as_bytes().to_vec().into(), write_id: None, cas };
        let touch =
            |key: &str, ttl_secs| proto::Touch { key: key.as_bytes().to_vec().into(), ttl_secs, ..Default::default() };
        // (entry, what it must apply as), index i + 1.
        let log: Vec<(Vec<u8>, Applied)> = vec![
            (encode_write(put("a", "1", |p| p.flags = 7), t), Applied::Put { version: 1 }),
            (encode_write(put("a", "2", |p| p.mode = Add as i32), t), Applied::Refused(Error::NotStored)),
            (encode_write(put("b", "x", |p| p.mode = Replace as i32), t), Applied::Refused(Error::NotStored)),
            (encode_write(put("a", "+", |p| p.mode = Append as i32), t), Applied::Put { version: 4 }),
            (encode_write(put("a", "-", |p| p.mode = Prepend as i32), t), Applied::Put { version: 5 }),
            // CAS: the version read (5) wins once; the same version again loses.
            (encode_write(put("a", "c", |p| p.cas = 5), t), Applied::Put { version: 6 }),
            (encode_write(put("a", "d", |p| p.cas = 5), t), Applied::Refused(Error::Exists)),
            (encode_write(put("n", "9", |p| p.ttl_secs = 10), t), Applied::Put { version: 8 }),
            (encode_arith(arith("n", 2, false), t), Applied::Counter { value: 11, version: 9 }),
            (encode_arith(arith("n", 20, true), t), Applied::Counter { value: 0, version: 10 }),
            (encode_arith(arith("a", 1, false), t), Applied::Refused(Error::NotNumeric)),
            (encode_delete_cas(del("a", 5), t), Applied::Refused(Error::Exists)),
            // A leader whose clock is 60 s behind: the log's time stays,
            // and its TTL counts from its own clock.
            (encode_write(put("e", "y", |p| p.ttl_secs = 100), t - 60_000), Applied::Put { version: 13 }),
            // Ten seconds on by the log: n (TTL 10 s) expired. A counter on it
            // finds nothing, and an add takes its place.
            (encode_arith(arith("n", 1, false), t + 10_000), Applied::Refused(Error::NotFound)),
            (encode_write(put("n", "new", |p| p.mode = Add as i32), t + 10_000), Applied::Put { version: 15 }),
            (encode_delete_cas(del("a", 6), t + 10_000), Applied::Delete { existed: true }),
        ];
        let (a, b) = (store("apply-modes-a"), store("apply-modes-b"));
        let (mut ra, mut rb) = (Remembered::default(), Remembered::default());
        for (i, (e, want)) in log.iter().enumerate() {
            let index = i as u64 + 1;
            let got = apply_once(
                &a,
                &mut ra,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                index,
                e,
            )
            .unwrap();
            assert_eq!(&got, want, "entry {index}");
            assert_eq!(
                apply_once(
                    &b,
                    &mut rb,
                    &mut crate::cluster::placement::Placement::all(),
                    &mut Default::default(),
                    index,
                    e
                )
                .unwrap(),
                got,
                "entry {index} on the other replica"
            );
            assert_eq!(a.digest(), b.digest(), "after entry {index}");
        }
        let item = |s: &Store, k: &str| s.get_item(k.as_bytes(), t + 10_000).unwrap().map(|(it, _)| it);
        let e = item(&a, "e").unwrap();
        assert_eq!(
            (e.meta.version, e.meta.expires_at),
            (13, secs - 60 + 100),
            "expiry from the proposing leader's clock"
        );
        let n = item(&a, "n").unwrap();
        assert_eq!((&n.value[..], n.meta.version, n.meta.expires_at), (&b"new"[..], 15, 0));
        assert!(item(&a, "a").is_none());
        // A touch keeps the version and moves the expiry; a flush empties.
        let touched = apply_once(
            &a,
            &mut ra,
            &mut crate::cluster::placement::Placement::all(),
            &mut Default::default(),
            17,
            &encode_touch(touch("e", 5), t + 10_000),
        )
        .unwrap();
        let Applied::Touched { item: Some(it) } = touched else { panic!("{touched:?}") };
        assert_eq!((it.meta.version, it.meta.expires_at, &it.value[..]), (13, secs + 15, &b"y"[..]));
        assert_eq!(
            apply_once(
                &a,
                &mut ra,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                18,
                &encode_flush_all(t + 10_000)
            )
            .unwrap(),
            Applied::Flushed { items: 2 }
        );
        assert_eq!(a.digest(), (0, 0));
    }

    #[test]
    fn a_counter_or_conditional_write_sent_again_applies_once() {
        let s = store("apply-again");
        let mut seen = Remembered::default();
        let t = 1_800_000_000_000u64;
        let incr = encode_arith(
            proto::Arith {
                key: "n".into(),
                delta: 5,
                vivify: true,
                initial: 10,
                write_id: id(4, 1, 0),
                ..Default::default()
            },
            t,
        );
        let first = apply_once(
            &s,
            &mut seen,
            &mut crate::cluster::placement::Placement::all(),
            &mut Default::default(),
            next(),
            &incr,
        )
        .unwrap();
        assert!(matches!(first, Applied::Counter { value: 10, .. }), "{first:?}");
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &incr
            )
            .unwrap(),
            first,
            "answered as the first time"
        );
        assert_eq!(s.get(b"n").unwrap().unwrap().0, bytes::Bytes::from_static(b"10"), "not incremented again");
        // An add whose reply was lost: sent again, it is not NOT_STORED.
        let add = encode_write(
            put("k", "v", |p| {
                p.mode = proto::PutMode::Add as i32;
                p.write_id = id(4, 2, 0);
            }),
            t,
        );
        let first = apply_once(
            &s,
            &mut seen,
            &mut crate::cluster::placement::Placement::all(),
            &mut Default::default(),
            next(),
            &add,
        )
        .unwrap();
        assert!(matches!(first, Applied::Put { .. }));
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &add
            )
            .unwrap(),
            first
        );
        // A CAS that lost is remembered as lost.
        let cas = encode_write(
            put("k", "w", |p| {
                p.cas = 1;
                p.write_id = id(4, 3, 0);
            }),
            t,
        );
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &cas
            )
            .unwrap(),
            Applied::Refused(Error::Exists)
        );
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &cas
            )
            .unwrap(),
            Applied::Refused(Error::Exists)
        );
        // A refusal is remembered, not judged again: an add refused, the
        // key deleted meanwhile, the add sent again is still refused (and
        // stores nothing), though now it would be stored.
        let add_lost = encode_write(
            put("k", "late", |p| {
                p.mode = proto::PutMode::Add as i32;
                p.write_id = id(4, 4, 0);
            }),
            t,
        );
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &add_lost
            )
            .unwrap(),
            Applied::Refused(Error::NotStored)
        );
        apply_once(
            &s,
            &mut seen,
            &mut crate::cluster::placement::Placement::all(),
            &mut Default::default(),
            next(),
            &encode_delete_with(b"k", id(4, 5, 0), t),
        )
        .unwrap();
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &add_lost
            )
            .unwrap(),
            Applied::Refused(Error::NotStored)
        );
        assert_eq!(s.get(b"k").unwrap(), None, "the add sent again stored nothing");
    }

    /// Conditional writes are logged under numbers of their own (a node
    /// from before them stops at one instead of applying a plain set or
    /// delete); the plain entries such nodes logged still apply.
    #[test]
    fn conditional_writes_have_entry_numbers_of_their_own() {
        let s = store("apply-numbers");
        let mut seen = Remembered::default();
        let old = command(Op::Put(put("k", "v", |_| {})), 0);
        assert!(matches!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &old
            )
            .unwrap(),
            Applied::Put { .. }
        ));
        assert_eq!(s.get(b"k").unwrap().unwrap().0, bytes::Bytes::from_static(b"v"));
        let op = |data: Vec<u8>| proto::RaftCommand::decode(&data[..]).unwrap().op;
        assert!(matches!(op(encode_write(put("k", "w", |p| p.flags = 3), 0)), Some(Op::Write(_))));
        let d = proto::Delete { key: "k".into(), cas: 5, ..Default::default() };
        assert!(matches!(op(encode_delete_cas(d, 0)), Some(Op::DeleteCas(_))));
        assert!(matches!(op(encode_delete(b"k")), Some(Op::Delete(_))));
    }

    #[test]
    fn a_write_retried_after_many_others_is_answered_as_the_first_time() {
        // 70,000 identified writes in 4.5 s (15,500 a second): more than the
        // 65,536 a shard once remembered, within one default window.
        let s = store("apply-many");
        let mut seen = Remembered::default();
        let t0 = 1_700_000_000_000;
        let first = encode_put_with(b"k", b"old", id(1, 1, 5000), t0);
        let answer = apply_once(
            &s,
            &mut seen,
            &mut crate::cluster::placement::Placement::all(),
            &mut Default::default(),
            next(),
            &first,
        )
        .unwrap();
        for seq in 0..70_000u64 {
            let del = encode_delete_with(b"gone", id(2, seq, 5000), t0 + seq * 4500 / 70_000);
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &del,
            )
            .unwrap();
        }
        let newer = encode_put_with(b"k", b"new", id(3, 1, 5000), t0 + 4600);
        apply_once(
            &s,
            &mut seen,
            &mut crate::cluster::placement::Placement::all(),
            &mut Default::default(),
            next(),
            &newer,
        )
        .unwrap();
        // The first write's reply was lost: its client sends it again
        // within its window.
        let retry = encode_put_with(b"k", b"old", id(1, 1, 5000), t0 + 4800);
        assert_eq!(
            apply_once(
                &s,
                &mut seen,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &retry
            )
            .unwrap(),
            answer,
            "answered as the first time"
        );
        assert_eq!(s.get(b"k").unwrap().unwrap().0, bytes::Bytes::from_static(b"new"), "the newer value stands");
    }

    #[test]
    fn writes_are_forgotten_after_two_windows_of_log_time_alike_on_every_replica() {
        let t = 1_000_000u64;
        let entries = [
            encode_put_with(b"a", b"1", id(1, 1, 1000), t),
            encode_put_with(b"b", b"1", id(1, 2, 3000), t),
            // None said (an older client): the maximum.
            encode_delete_with(b"c", id(1, 3, 0), t),
            // Far too long, and far too short: clamped.
            encode_put_with(b"d", b"1", id(1, 4, u32::MAX), t),
            encode_put_with(b"e", b"1", id(1, 5, 1), t),
            // A new leader whose clock is 5 s behind the last one's: the
            // log's time stays, and the write is remembered from it.
            encode_put_with(b"f", b"1", id(2, 1, 1000), t - 5000),
            // Time moves on with any entry.
            encode_put_with(b"g", b"1", None, t + 1999),
        ];
        let (a, b) = (store("apply-a"), store("apply-b"));
        let (mut ra, mut rb) = (Remembered::default(), Remembered::default());
        for e in &entries {
            let i = next();
            assert_eq!(
                apply_once(
                    &a,
                    &mut ra,
                    &mut crate::cluster::placement::Placement::all(),
                    &mut Default::default(),
                    i,
                    e
                )
                .unwrap(),
                apply_once(
                    &b,
                    &mut rb,
                    &mut crate::cluster::placement::Placement::all(),
                    &mut Default::default(),
                    i,
                    e
                )
                .unwrap()
            );
            assert_eq!(ra.to_parts(), rb.to_parts());
        }
        let expiries: Vec<_> = ra.to_parts().writes.iter().map(|w| ((w.client, w.seq), w.expires_ms - t)).collect();
        let max = 2 * dmkv_common::limits::MAX_WRITE_RETRY_WINDOW.as_millis() as u64;
        assert_eq!(
            expiries,
            [((1, 1), 2000), ((1, 5), 2000), ((2, 1), 2000), ((1, 2), 6000), ((1, 3), max), ((1, 4), max)]
        );
        assert_eq!(ra.now_ms(), t + 1999);
        // Still remembered one millisecond before: answered as the first time.
        let again = encode_put_with(b"a", b"2", id(1, 1, 1000), t + 1999);
        assert_eq!(
            apply_once(
                &a,
                &mut ra,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                next(),
                &again
            )
            .unwrap(),
            Applied::Put { version: 1 }
        );
        // At two windows of log time the short ones are forgotten, on both
        // replicas alike: the same write now applies (anew) on each.
        let late = encode_put_with(b"a", b"3", id(1, 1, 1000), t + 2000);
        let i = next();
        let (x, y) = (
            apply_once(
                &a,
                &mut ra,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                i,
                &late,
            )
            .unwrap(),
            apply_once(
                &b,
                &mut rb,
                &mut crate::cluster::placement::Placement::all(),
                &mut Default::default(),
                i,
                &late,
            )
            .unwrap(),
        );
        assert!(matches!(x, Applied::Put { version } if version > 1), "{x:?}");
        assert_eq!(x, y);
        assert_eq!(a.get(b"a").unwrap(), b.get(b"a").unwrap());
        assert_eq!(ra.to_parts(), rb.to_parts());
        let left: Vec<_> = ra.to_parts().writes.iter().map(|w| (w.client, w.seq)).collect();
        assert_eq!(left, [(1, 1), (1, 2), (1, 3), (1, 4)], "remembered again, from its new outcome");
    }

    #[test]
    fn past_the_byte_bound_the_soonest_to_expire_are_forgotten_early_and_counted() {
        use std::mem::size_of;
        // The cost counted covers what the tables hold per write.
        let held = size_of::<((u64, u64), Applied)>() + 1 + size_of::<std::cmp::Reverse<(u64, u64, u64, u64)>>();
        assert!(held * 3 / 2 <= REMEMBERED_ENTRY_BYTES, "{held} bytes a write");
        let mut seen = Remembered::default();
        let put = Applied::Put { version: 1 };
        // One with a long window first, then short ones: these expire first.
        seen.insert(id(1, 0, 60_000).as_ref(), &put, 0);
        for seq in 0..MAX_REMEMBERED_WRITES as u64 + 9 {
            seen.insert(id(2, seq, 1000).as_ref(), &put, 0);
        }
        assert_eq!(seen.len(), MAX_REMEMBERED_WRITES);
        assert_eq!(seen.take_dropped_early(), 10);
        assert_eq!(seen.take_dropped_early(), 0, "taken");
        assert!(seen.get(id(1, 0, 0).as_ref()).is_some(), "the one remembered longest stays");
        assert!((0..10).all(|seq| seen.get(id(2, seq, 0).as_ref()).is_none()), "the first short ones went");
        assert!(seen.get(id(2, 10, 0).as_ref()).is_some());
        // Expiry forgets the rest, and counts nothing.
        seen.advance(2000);
        assert_eq!((seen.len(), seen.take_dropped_early()), (1, 0));
    }
}

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
/// map (32 bytes and a control byte), its place in the expiry queue (32),
/// and both tables' room to grow (each doubles, so up to half is empty).
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
    let write_id = write_id.map(logged);
    let op =
        Op::Put(proto::Put { key: key.to_vec().into(), value: value.to_vec().into(), write_id, ..Default::default() });
    proto::RaftCommand { op: Some(op), now_ms }.encode_to_vec()
}

/// The log entry data of a DELETE.
pub fn encode_delete(key: &[u8]) -> Vec<u8> {
    encode_delete_with(key, None, 0)
}

/// The log entry data of a DELETE carrying the client's write id, proposed
/// by a leader whose clock reads `now_ms`.
pub fn encode_delete_with(key: &[u8], write_id: Option<proto::WriteId>, now_ms: u64) -> Vec<u8> {
    let op = Op::Delete(proto::Delete { key: key.to_vec().into(), write_id: write_id.map(logged), cas: 0 });
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
}

/// A shard's remembered writes as a snapshot carries them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RememberedParts {
    /// The shard's log time: the latest leader clock applied.
    pub now_ms: u64,
    /// Soonest to expire first (among equal expiries, first remembered
    /// first): the order they are forgotten in.
    pub writes: Vec<RememberedWrite>,
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
    outcomes: std::collections::HashMap<(u64, u64), Applied>,
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
                let outcome = self.outcomes.get(&(client, seq))?.clone();
                Some(RememberedWrite { client, seq, outcome, expires_ms })
            })
            .collect();
        RememberedParts { now_ms: self.now_ms, writes }
    }

    /// Remembers what a snapshot carried: the same writes, forgotten at the
    /// same log times and in the same order as where it was taken.
    pub fn from_parts(parts: &RememberedParts) -> Remembered {
        let mut r = Remembered::default();
        for w in &parts.writes {
            r.remember((w.client, w.seq), w.outcome.clone(), w.expires_ms);
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
        id.and_then(|w| self.outcomes.get(&(w.client, w.seq)).cloned())
    }

    fn insert(&mut self, id: Option<&proto::WriteId>, a: &Applied) {
        let Some(w) = id else { return };
        let window = u64::from(retry_window_ms(w.retry_window_ms));
        self.remember((w.client, w.seq), a.clone(), self.now_ms.saturating_add(REMEMBER_WINDOWS * window));
    }

    fn remember(&mut self, id: (u64, u64), a: Applied, expires_ms: u64) {
        // The first outcome stands (a snapshot naming a write twice).
        if self.outcomes.contains_key(&id) {
            return;
        }
        self.outcomes.insert(id, a);
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

/// Applies the data of the committed entry at `index` to `store`.
pub fn apply(store: &Store, index: u64, data: &[u8]) -> Result<Applied, ApplyError> {
    apply_once(store, &mut Remembered::default(), index, data)
}

/// [`apply`], except that a write whose id `seen` remembers is not
/// applied again: it is answered as the first time.
///
/// A PUT's version is its entry's index: the same on every replica, in
/// log order, whatever else a store did (an emptied store replaying its
/// log, or writes refused for want of room and retried), so a version a
/// client saw on one leader means the same on the next.
pub fn apply_once(store: &Store, seen: &mut Remembered, index: u64, data: &[u8]) -> Result<Applied, ApplyError> {
    if data.is_empty() {
        return Ok(Applied::Nothing);
    }
    let cmd = proto::RaftCommand::decode(data).map_err(|e| ApplyError::Malformed(e.to_string()))?;
    // Time from the entry, never this node's clock: every replica forgets
    // the same writes here.
    seen.advance(cmd.now_ms);
    let (id, result) = match cmd.op {
        Some(Op::Put(p)) => {
            if let Some(a) = seen.get(p.write_id.as_ref()) {
                return Ok(a);
            }
            (p.write_id, store.put_versioned(&p.key, &p.value, Some(index)).map(|version| Applied::Put { version }))
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
        let first = apply_once(&s, &mut seen, next(), &put).unwrap();
        // Another client's write in between, then the first one again.
        apply_once(&s, &mut seen, next(), &encode_put_with(b"k", b"w", id(8, 1, 0), 0)).unwrap();
        assert_eq!(apply_once(&s, &mut seen, next(), &put).unwrap(), first, "answered as the first time");
        assert_eq!(s.get(b"k").unwrap().unwrap().0, bytes::Bytes::from_static(b"w"), "and not applied again");
        let del = encode_delete_with(b"k", id(7, 2, 0), 0);
        assert_eq!(apply_once(&s, &mut seen, next(), &del).unwrap(), Applied::Delete { existed: true });
        assert_eq!(
            apply_once(&s, &mut seen, next(), &del).unwrap(),
            Applied::Delete { existed: true },
            "a retried DELETE"
        );
        // Without an id every copy applies.
        apply_once(&s, &mut seen, next(), &encode_put(b"n", b"1")).unwrap();
        assert_eq!(apply_once(&s, &mut seen, next(), &encode_delete(b"n")).unwrap(), Applied::Delete { existed: true });
        assert_eq!(
            apply_once(&s, &mut seen, next(), &encode_delete(b"n")).unwrap(),
            Applied::Delete { existed: false }
        );
    }

    #[test]
    fn a_write_retried_after_many_others_is_answered_as_the_first_time() {
        // 70,000 identified writes in 4.5 s (15,500 a second): more than the
        // 65,536 a shard once remembered, within one default window.
        let s = store("apply-many");
        let mut seen = Remembered::default();
        let t0 = 1_700_000_000_000;
        let first = encode_put_with(b"k", b"old", id(1, 1, 5000), t0);
        let answer = apply_once(&s, &mut seen, next(), &first).unwrap();
        for seq in 0..70_000u64 {
            let del = encode_delete_with(b"gone", id(2, seq, 5000), t0 + seq * 4500 / 70_000);
            apply_once(&s, &mut seen, next(), &del).unwrap();
        }
        let newer = encode_put_with(b"k", b"new", id(3, 1, 5000), t0 + 4600);
        apply_once(&s, &mut seen, next(), &newer).unwrap();
        // The first write's reply was lost: its client sends it again
        // within its window.
        let retry = encode_put_with(b"k", b"old", id(1, 1, 5000), t0 + 4800);
        assert_eq!(apply_once(&s, &mut seen, next(), &retry).unwrap(), answer, "answered as the first time");
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
            assert_eq!(apply_once(&a, &mut ra, i, e).unwrap(), apply_once(&b, &mut rb, i, e).unwrap());
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
        assert_eq!(apply_once(&a, &mut ra, next(), &again).unwrap(), Applied::Put { version: 1 });
        // At two windows of log time the short ones are forgotten, on both
        // replicas alike: the same write now applies (anew) on each.
        let late = encode_put_with(b"a", b"3", id(1, 1, 1000), t + 2000);
        let i = next();
        let (x, y) = (apply_once(&a, &mut ra, i, &late).unwrap(), apply_once(&b, &mut rb, i, &late).unwrap());
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
        seen.insert(id(1, 0, 60_000).as_ref(), &put);
        for seq in 0..MAX_REMEMBERED_WRITES as u64 + 9 {
            seen.insert(id(2, seq, 1000).as_ref(), &put);
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

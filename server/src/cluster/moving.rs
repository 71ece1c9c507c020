//! A partition move's steps where the shards are led (docs/elasticity.md):
//! a command proposed to a shard, the copy of a partition's items from
//! the source's leader to the target, and the removal of a partition's
//! leftovers. The mover (`mover.rs`) asks for each step at the node whose
//! replica leads the shard, this node or a peer (`MoveWork` on the peer
//! port); every step is safe to ask again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dmkv_common::cluster::map::{META_SHARD, NodeId, ShardId, node_of, partition_of};
use dmkv_common::error::Error as StoreError;
use dmkv_common::proto::{self, move_work::Work, request::Op, response::Result as R};

use super::apply::{Applied, encode_ingest, encode_ingest_entry, outcome_fields};
use super::move_ask::{MoveAnswer, MoveAsk};
use super::node::{ClusterError, ClusterNode, InFlight, LocalReplica, admit};
use super::pace::Pace;
use super::placement::MAX_VERSION;
use super::shard::ProposeError;

/// Most bytes of items one copy entry carries (one item larger than this
/// goes alone): a copy never holds the target's raft for long.
pub const MAX_INGEST_BYTES: usize = 1 << 20;
/// Most keys one copy entry carries.
pub const MAX_INGEST_KEYS: usize = 4096;
/// Chunks a view's walker may have ready ahead of the proposals.
const WALK_AHEAD: usize = 2;
/// Most partitions one placement change a mover proposes may name.
pub const MAX_PLACEMENT_CHANGE: usize = 64;
/// Most one step at a peer may take, the copy of a big partition included.
pub const MOVE_STEP_TIMEOUT: Duration = Duration::from_secs(120);
/// Pause between two tries of a move's step.
pub(super) const STEP_PAUSE: Duration = Duration::from_millis(100);

impl ClusterNode {
    /// This node's replica of `shard` if it leads it; else NOT_LEADER
    /// naming the leader it knows of.
    pub(super) fn leading(&self, shard: ShardId) -> Result<Arc<LocalReplica>, ClusterError> {
        let map_version = self.map().version;
        let r = self.replica(shard).ok_or(ClusterError::NotLeader { leader: None, map_version })?;
        if !r.status.is_leader() {
            let leader = node_of(r.status.leader.load(Ordering::Relaxed));
            return Err(ClusterError::NotLeader {
                leader: (leader != 0 && leader != self.id).then_some(leader),
                map_version,
            });
        }
        Ok(r)
    }

    /// Serves a peer mover's step (or this node's own).
    pub async fn move_work(&self, w: proto::MoveWork) -> Result<proto::MoveWorkReply, ClusterError> {
        if w.shard == META_SHARD {
            return Err(ClusterError::Failed("the metadata group holds no partitions".into()));
        }
        match w.work {
            Some(Work::Propose(data)) => self.propose_move(w.shard, data.to_vec()).await,
            Some(Work::Copy(c)) => self.copy_out(w.shard, &c).await,
            Some(Work::Purge(p)) => self.purge(w.shard, &p).await,
            Some(Work::Census(_)) => self.census(w.shard).await,
            None => Err(ClusterError::Failed("a move step with no work".into())),
        }
    }

    /// Proposes a move's command to `shard`, led here. Only a move's
    /// commands: a peer's bytes are checked like any other input.
    async fn propose_move(&self, shard: ShardId, data: Vec<u8>) -> Result<proto::MoveWorkReply, ClusterError> {
        use prost::Message;
        let cmd = proto::RaftCommand::decode(&data[..])
            .map_err(|e| ClusterError::Failed(format!("a move's command does not decode: {e}")))?;
        use proto::raft_command::Op as C;
        match &cmd.op {
            Some(C::Ingest(_) | C::MoveStep(_)) => {}
            Some(C::Placement(c)) if c.own.len() + c.release.len() <= MAX_PLACEMENT_CHANGE => {}
            Some(C::Placement(_)) => {
                return Err(ClusterError::Failed(format!(
                    "a placement change of more than {MAX_PLACEMENT_CHANGE} partitions"
                )));
            }
            _ => return Err(ClusterError::Failed("only a move's commands are proposed for a mover".into())),
        };
        if shard == META_SHARD {
            return Err(ClusterError::Failed("the metadata group holds no partitions".into()));
        }
        let r = self.leading(shard)?;
        let r = &*r;
        // Only copies of items take room: a move's steps, removals and
        // remembered outcomes must go through on a full shard (a release,
        // an own or a purge refused would stall the move or leak items).
        let takes_room = matches!(&cmd.op, Some(C::Ingest(g)) if g.items.iter().any(|it| it.present));
        let bytes = if takes_room { (data.len() + dmkv_common::layout::ITEM_HEADER_LEN) as u64 } else { 0 };
        if takes_room && !admit(r, bytes) {
            return Err(ClusterError::Store(StoreError::OutOfMemory));
        }
        let _done = InFlight(&r.in_flight, bytes);
        let applied = match r.thread.propose(data).await {
            Ok(Ok(a)) => a,
            Ok(Err(ProposeError::NotLeader { leader })) => {
                let leader = leader.map(node_of).filter(|&n| n != self.id);
                return Err(ClusterError::NotLeader { leader, map_version: self.map().version });
            }
            Ok(Err(ProposeError::Busy)) => return Err(ClusterError::Busy),
            Ok(Err(ProposeError::Store(s))) => return Err(ClusterError::Failed(s)),
            Ok(Err(ProposeError::Unknown | ProposeError::Dropped)) | Err(_) => return Err(ClusterError::Uncertain),
        };
        let mut reply = proto::MoveWorkReply { applied: format!("{applied:?}"), ..Default::default() };
        match applied {
            Applied::Ingested { items, skipped } => (reply.keys, reply.skipped) = (items, skipped),
            Applied::Moving { recorded: changed } | Applied::Placement { changed } => reply.changed = changed,
            _ => {}
        }
        reply.placement_version = r.placement_version();
        Ok(reply)
    }

    /// Asks this node's leading replica of `shard` for what a move needs.
    pub(super) async fn ask_leader(&self, r: &LocalReplica, ask: MoveAsk) -> Result<MoveAnswer, ClusterError> {
        match r.thread.moving(ask).await {
            Ok(Ok(a)) => Ok(a),
            Ok(Err(ProposeError::NotLeader { leader })) => Err(ClusterError::NotLeader {
                leader: leader.map(node_of).filter(|&n| n != self.id),
                map_version: self.map().version,
            }),
            Ok(Err(ProposeError::Store(s))) => Err(ClusterError::Failed(s)),
            Ok(Err(_)) | Err(_) => Err(ClusterError::Busy),
        }
    }

    /// Copies partition `c.partition` of `shard` (led here) to shard
    /// `c.to`: the keys noted since the last copy, each as the store holds
    /// it now or its absence, or (`c.whole`, or notes that are not
    /// complete) the whole partition from a view, after the target dropped
    /// what it held of it from before the view.
    async fn copy_out(&self, shard: ShardId, c: &proto::MoveCopy) -> Result<proto::MoveWorkReply, ClusterError> {
        let r = self.leading(shard)?;
        let r = &*r;
        let _sending = self.move_book.sending(c.partition, shard, c.to, c.version, c.rate_bytes);
        // Taken before any view: what is written after it is noted anew.
        let MoveAnswer::Notes { notes, horizon } = self.ask_leader(r, MoveAsk::Notes(c.partition, c.claim)).await?
        else {
            return Err(ClusterError::Failed("the shard answered a view for notes".into()));
        };
        let mut reply = proto::MoveWorkReply::default();
        let pace = Pace::new(c.rate_bytes, Instant::now());
        let mut out = Chunks::new(horizon);
        if !c.whole && !notes.whole {
            for key in notes.keys {
                // An expired item too: the target judges it by its clock.
                let item = r.store.get_item(&key, 0).map_err(ClusterError::Store)?;
                let it = match item {
                    Some((item, _)) => {
                        present(&key, &item.value, item.meta.version, item.meta.flags, item.meta.expires_at)
                    }
                    None => absent(&key, horizon),
                };
                if let Some(chunk) = out.push(it) {
                    self.ingest(c, chunk, &mut reply, &pace).await?;
                }
            }
            if let Some(chunk) = out.flush() {
                self.ingest(c, chunk, &mut reply, &pace).await?;
            }
            if c.last {
                self.copy_remembered(r, c, horizon).await?;
            }
            return Ok(reply);
        }
        reply.whole = true;
        let MoveAnswer::View { view, horizon } = self.ask_leader(r, MoveAsk::View).await? else {
            return Err(ClusterError::Failed("the shard answered notes for a view".into()));
        };
        // Everything the target holds of the partition is older than the
        // view's horizon: it goes, and the view brings back what is here.
        let purge = proto::MovePurge { partition: c.partition, version: c.version, below: horizon, claim: c.claim };
        self.work_at(c.to, Work::Purge(purge)).await.map_err(of_target)?;
        let (tx, mut rx) = tokio::sync::mpsc::channel(WALK_AHEAD);
        let p = c.partition;
        let walker = tokio::task::spawn_blocking(move || {
            let mut out = Chunks::new(horizon);
            let walked = view.walk(|it| {
                if partition_of(it.key) != p {
                    return Ok(());
                }
                match out.push(present(it.key, it.value, it.version, it.flags, it.expires_at)) {
                    Some(chunk) => tx.blocking_send(chunk).map_err(|_| "the copy stopped".to_string()),
                    None => Ok(()),
                }
            });
            let flushed = walked.and_then(|()| match out.flush() {
                Some(chunk) => tx.blocking_send(chunk).map_err(|_| "the copy stopped".to_string()),
                None => Ok(()),
            });
            flushed.map_err(|e| (e, view.aborted()))
        });
        while let Some(chunk) = rx.recv().await {
            if let Err(e) = self.ingest(c, chunk, &mut reply, &pace).await {
                drop(rx);
                let _ = walker.await;
                return Err(e);
            }
        }
        match walker.await {
            Ok(Ok(())) => {}
            // Writes outran the view (it holds what they replace): the
            // mover asks again, and a new view starts from what they left.
            Ok(Err((e, true))) => {
                tracing::info!(partition = p, "a move's copy is taken again: {e}");
                return Err(ClusterError::Busy);
            }
            Ok(Err((e, false))) => return Err(ClusterError::Failed(format!("walking the partition: {e}"))),
            Err(e) => return Err(ClusterError::Failed(format!("walking the partition: {e}"))),
        }
        if c.last {
            self.copy_remembered(r, c, horizon).await?;
        }
        Ok(reply)
    }

    /// Sends the outcomes the source remembers of the partition's writes
    /// to the target (at the cut-over, when no more can be written).
    async fn copy_remembered(&self, r: &LocalReplica, c: &proto::MoveCopy, horizon: u64) -> Result<(), ClusterError> {
        let MoveAnswer::Remembered(writes) = self.ask_leader(r, MoveAsk::Remembered(c.partition)).await? else {
            return Err(ClusterError::Failed("the shard answered something else for its remembered writes".into()));
        };
        // At least one entry, carrying the horizon as of the release: the
        // target's later versions go above every one the source gave, even
        // for a partition with no items left (a deleted key's CAS token).
        let empty: [super::apply::RememberedWrite; 0] = [];
        let parts: Vec<&[super::apply::RememberedWrite]> =
            if writes.is_empty() { vec![&empty[..]] } else { writes.chunks(MAX_INGEST_KEYS).collect() };
        for part in parts {
            let remembered = part
                .iter()
                .map(|w| {
                    let (kind, a, b) = outcome_fields(&w.outcome);
                    proto::RememberedOutcome {
                        client: w.client,
                        seq: w.seq,
                        kind: kind.into(),
                        a,
                        b,
                        expires_ms: w.expires_ms,
                    }
                })
                .collect();
            let mut data = proto::Ingest {
                partition: c.partition,
                move_version: c.version,
                source_version: horizon,
                claim: c.claim,
                ..Default::default()
            };
            data.remembered = remembered;
            let got = self.work_at(c.to, Work::Propose(encode_ingest_entry(data).into())).await.map_err(of_target)?;
            if got.skipped > 0 {
                return Err(ClusterError::Failed(format!("shard {} skipped remembered writes: {}", c.to, got.applied)));
            }
        }
        Ok(())
    }

    /// Proposes one chunk of a copy to the target shard.
    async fn ingest(
        &self,
        c: &proto::MoveCopy,
        chunk: Chunk,
        reply: &mut proto::MoveWorkReply,
        pace: &Pace,
    ) -> Result<(), ClusterError> {
        let data = encode_ingest(c.partition, c.version, chunk.horizon, c.claim, chunk.items);
        let got = self.work_at(c.to, Work::Propose(data.into())).await.map_err(of_target)?;
        if got.skipped > 0 {
            return Err(ClusterError::Failed(format!(
                "shard {} skipped {} items of a copy ({}): it takes no copy of partition {} for this move, or an item \
                 could not be held",
                c.to, got.skipped, got.applied, c.partition
            )));
        }
        reply.keys += chunk.keys;
        reply.bytes += chunk.bytes;
        self.move_book.sent(reply.keys, reply.bytes);
        let wait = pace.delay(reply.bytes, Instant::now());
        // Even a zero sleep waits for the timer's next tick.
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        Ok(())
    }

    /// Removes every item of a partition older than `p.below` from `shard`
    /// (led here), through its log, a chunk of keys at a time.
    async fn purge(&self, shard: ShardId, p: &proto::MovePurge) -> Result<proto::MoveWorkReply, ClusterError> {
        let r = self.leading(shard)?;
        let r = &*r;
        let MoveAnswer::View { view, .. } = self.ask_leader(r, MoveAsk::View).await? else {
            return Err(ClusterError::Failed("the shard answered notes for a view".into()));
        };
        let partition = p.partition;
        let keys = tokio::task::spawn_blocking(move || {
            let mut keys = Vec::new();
            view.walk(|it| {
                if partition_of(it.key) == partition {
                    keys.push(bytes::Bytes::copy_from_slice(it.key));
                }
                Ok(())
            })
            .map(|()| keys)
        })
        .await
        .map_err(|e| ClusterError::Failed(e.to_string()))?
        .map_err(|e| ClusterError::Failed(format!("walking the partition: {e}")))?;
        let mut reply = proto::MoveWorkReply::default();
        let below = p.below.min(MAX_VERSION);
        for part in keys.chunks(MAX_INGEST_KEYS) {
            let items = part.iter().map(|k| absent(k, below)).collect();
            // No source version: a removal raises no skew.
            let data = encode_ingest(partition, p.version, 0, p.claim, items);
            let got = self.propose_move(shard, data).await?;
            if got.skipped > 0 {
                return Err(ClusterError::Failed(format!(
                    "shard {shard} takes no removal of partition {partition} for the move at version {}",
                    p.version
                )));
            }
            reply.keys += got.keys;
        }
        Ok(reply)
    }

    /// A step at `shard`'s leader, tried again while the shard is between
    /// leaders, busy, or the outcome unknown (every step may be asked
    /// again).
    pub(super) async fn step(
        &self,
        shard: ShardId,
        work: Work,
        tries: u32,
    ) -> Result<proto::MoveWorkReply, ClusterError> {
        let mut last = ClusterError::Busy;
        for _ in 0..tries {
            match self.work_at(shard, work.clone()).await {
                Ok(r) => return Ok(r),
                Err(e @ (ClusterError::NotLeader { .. } | ClusterError::Busy | ClusterError::Uncertain)) => last = e,
                Err(e) => return Err(e),
            }
            tokio::time::sleep(STEP_PAUSE).await;
        }
        Err(last)
    }

    /// Does a move's step at the node leading `shard`: here, or at the
    /// peer this node believes leads it, following NOT_LEADER answers.
    pub(super) async fn work_at(&self, shard: ShardId, work: Work) -> Result<proto::MoveWorkReply, ClusterError> {
        let w = proto::MoveWork { shard, work: Some(work) };
        let mut to = self.believed_leader(shard);
        // A NOT_LEADER naming another node is followed, a few times.
        for _ in 0..3 {
            let result = match to {
                Some(n) if n != self.id => self.ask_peer(n, Op::MoveWork(w.clone())).await,
                _ => Box::pin(self.move_work(w.clone())).await,
            };
            match result {
                Err(ClusterError::NotLeader { leader: Some(l), .. }) if Some(l) != to => to = Some(l),
                r => return r,
            }
        }
        Err(ClusterError::NotLeader { leader: to, map_version: self.map().version })
    }

    /// The node this node believes leads `shard`: its own replica's view,
    /// else the map's.
    fn believed_leader(&self, shard: ShardId) -> Option<NodeId> {
        if let Some(r) = self.replica(shard) {
            let l = node_of(r.status.leader.load(Ordering::Relaxed));
            if l != 0 {
                return Some(l);
            }
        }
        self.map().shards().get(shard as usize).and_then(|s| s.leader)
    }

    /// A move's step at peer `to`, on a connection of its own.
    async fn ask_peer(&self, to: NodeId, op: Op) -> Result<proto::MoveWorkReply, ClusterError> {
        let addr: SocketAddr = self.forward.addr(to).ok_or_else(|| ClusterError::Failed(format!("no node {to}")))?;
        match super::dial::ask_within(self.dialer(), to, addr, op, MOVE_STEP_TIMEOUT).await {
            Ok(R::MoveWork(reply)) => Ok(reply),
            Ok(other) => Err(ClusterError::Failed(format!("node {to} answered a move step with {other:?}"))),
            Err(e) => Err(peer_error(to, &e)),
        }
    }
}

/// An error of the target's, as the source's step answers it: who leads
/// the target is no answer to who leads the source (the mover would ask
/// the wrong node), so NOT_LEADER becomes "busy, ask again".
fn of_target(e: ClusterError) -> ClusterError {
    match e {
        ClusterError::NotLeader { .. } => ClusterError::Busy,
        e => e,
    }
}

/// A peer's error reply as the error it names, where that matters to the
/// mover (who leads, or to try again); anything else fails the step.
fn peer_error(to: NodeId, e: &str) -> ClusterError {
    // A reply is "Code: message"; anything else is the connection's.
    match e.split_once(": ").map(|(code, _)| code) {
        // The reply names the leader in its text, which is not parsed: the
        // mover asks again where its map points.
        Some("NotLeader") => ClusterError::NotLeader { leader: None, map_version: 0 },
        Some("Busy") => ClusterError::Busy,
        // What the peer decided: the step failed.
        Some(
            "Internal" | "BadRequest" | "PermissionDenied" | "Unauthenticated" | "UnknownOp" | "UnsupportedVersion"
            | "OutOfMemory" | "IndexFull" | "WrongShard",
        ) => ClusterError::Failed(format!("node {to}: {e}")),
        // Timed out, a connection lost or refused, an unknown outcome: the
        // step may or may not have been done, and is safe to ask again.
        _ => ClusterError::Uncertain,
    }
}

fn present(key: &[u8], value: &[u8], version: u64, flags: u32, expires_at: u32) -> proto::IngestItem {
    proto::IngestItem {
        key: bytes::Bytes::copy_from_slice(key),
        present: true,
        value: bytes::Bytes::copy_from_slice(value),
        version,
        flags,
        expires_at,
    }
}

/// `key` is gone at the source, whose versions had reached `below`.
fn absent(key: &[u8], below: u64) -> proto::IngestItem {
    proto::IngestItem { key: bytes::Bytes::copy_from_slice(key), version: below, ..Default::default() }
}

/// One copy entry's items.
struct Chunk {
    items: Vec<proto::IngestItem>,
    keys: u64,
    bytes: u64,
    horizon: u64,
}

/// Items gathered into copy entries of at most [`MAX_INGEST_BYTES`] (or
/// one item) and [`MAX_INGEST_KEYS`].
struct Chunks {
    horizon: u64,
    items: Vec<proto::IngestItem>,
    bytes: usize,
}

impl Chunks {
    fn new(horizon: u64) -> Chunks {
        Chunks { horizon, items: Vec::new(), bytes: 0 }
    }

    /// Adds an item; returns the chunk it completed, if any.
    fn push(&mut self, it: proto::IngestItem) -> Option<Chunk> {
        let size = it.key.len() + it.value.len() + 32;
        let full =
            !self.items.is_empty() && (self.bytes + size > MAX_INGEST_BYTES || self.items.len() >= MAX_INGEST_KEYS);
        let done = if full { self.flush() } else { None };
        self.bytes += size;
        self.items.push(it);
        done
    }

    fn flush(&mut self) -> Option<Chunk> {
        if self.items.is_empty() {
            return None;
        }
        let items = std::mem::take(&mut self.items);
        let bytes = std::mem::take(&mut self.bytes) as u64;
        Some(Chunk { keys: items.len() as u64, items, bytes, horizon: self.horizon })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_hold_a_bounded_size_or_one_item() {
        let mut c = Chunks::new(99);
        let big = vec![0u8; MAX_INGEST_BYTES];
        assert!(c.push(present(b"a", b"small", 1, 0, 0)).is_none());
        let first = c.push(present(b"b", &big, 2, 0, 0)).expect("the big item starts a chunk of its own");
        assert_eq!((first.keys, first.horizon), (1, 99));
        let second = c.push(present(b"c", b"x", 3, 0, 0)).expect("and goes alone");
        assert_eq!(second.keys, 1);
        for i in 0..MAX_INGEST_KEYS - 1 {
            assert!(c.push(absent(format!("k{i}").as_bytes(), 5)).is_none());
        }
        let full = c.push(absent(b"last", 5)).expect("a chunk of the most keys");
        assert_eq!(full.keys as usize, MAX_INGEST_KEYS);
        assert_eq!(c.flush().map(|c| c.keys), Some(1));
        assert!(c.flush().is_none());
    }
}

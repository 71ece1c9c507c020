//! One replica of a shard: a raft-rs `RawNode` and the handling of its
//! `Ready`s, with IO left to the caller (as raft-rs intends): persistence
//! goes through [`LogStore`], messages and committed entries come back as
//! an [`Output`] for the caller to send and apply. The same code drives
//! the shard threads and the deterministic simulation in the tests.

use std::sync::Arc;

use raft::prelude::{ConfState, Entry, HardState, Message, Snapshot};
use raft::storage::MemStorage;
use raft::{Config, RawNode};

use super::snapshot::SnapshotSlot;

/// A raft log the replica can make durable.
pub trait LogStore: raft::Storage {
    /// Persists what a `Ready` carries (entries replace any conflicting
    /// tail; a snapshot replaces the log).
    fn persist(&self, entries: &[Entry], hs: Option<&HardState>, snapshot: Option<&Snapshot>) -> raft::Result<()>;
    /// Records a commit index learned after persisting (a `LightReady`).
    fn set_commit(&self, commit: u64) -> raft::Result<()>;
    /// Drops the entries before `to` (a snapshot holds what they did).
    fn compact(&self, to: u64) -> raft::Result<()>;
    /// Records the members a membership change applied made.
    fn set_conf(&self, cs: &ConfState) -> raft::Result<()>;
    /// Whether the log outlives the process: then the state machine must
    /// be saved (`desk::Desk::save`) before entries are dropped.
    fn durable(&self) -> bool {
        false
    }
}

/// Most bytes of entries raft puts in one append message (at least one
/// entry goes, however large: a maximum PUT fits a frame).
pub const MAX_MESSAGE_BYTES: u64 = 1 << 20;
/// Append messages in flight to one follower at most: with
/// [`MAX_MESSAGE_BYTES`], what a leader sends a follower ahead of its
/// answers.
pub const MAX_INFLIGHT_MESSAGES: usize = 16;

impl LogStore for MemStorage {
    fn persist(&self, entries: &[Entry], hs: Option<&HardState>, snapshot: Option<&Snapshot>) -> raft::Result<()> {
        let mut w = self.wl();
        if let Some(s) = snapshot {
            w.apply_snapshot(s.clone())?;
        }
        w.append(entries)?;
        if let Some(hs) = hs {
            w.set_hardstate(hs.clone());
        }
        Ok(())
    }

    fn set_commit(&self, commit: u64) -> raft::Result<()> {
        self.wl().mut_hard_state().commit = commit;
        Ok(())
    }

    fn compact(&self, to: u64) -> raft::Result<()> {
        self.wl().compact(to)
    }

    fn set_conf(&self, cs: &ConfState) -> raft::Result<()> {
        self.wl().set_conf_state(cs.clone());
        Ok(())
    }
}

/// A log in memory whose snapshots carry the shard's items (raft-rs's
/// `MemStorage` alone sends snapshots without data).
#[derive(Clone)]
pub struct MemLog {
    mem: MemStorage,
    slot: Arc<SnapshotSlot>,
}

impl MemLog {
    /// A log starting from `conf`, handing raft the snapshots put in `slot`.
    pub fn new(conf: ConfState, slot: Arc<SnapshotSlot>) -> MemLog {
        MemLog { mem: MemStorage::new_with_conf_state(conf), slot }
    }
}

impl raft::Storage for MemLog {
    fn initial_state(&self) -> raft::Result<raft::RaftState> {
        self.mem.initial_state()
    }
    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        context: raft::GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        self.mem.entries(low, high, max_size, context)
    }
    fn term(&self, idx: u64) -> raft::Result<u64> {
        self.mem.term(idx)
    }
    fn first_index(&self) -> raft::Result<u64> {
        self.mem.first_index()
    }
    fn last_index(&self) -> raft::Result<u64> {
        self.mem.last_index()
    }
    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        self.slot.for_raft(request_index)
    }
}

impl LogStore for MemLog {
    fn persist(&self, entries: &[Entry], hs: Option<&HardState>, snapshot: Option<&Snapshot>) -> raft::Result<()> {
        self.mem.persist(entries, hs, snapshot)
    }
    fn set_commit(&self, commit: u64) -> raft::Result<()> {
        self.mem.set_commit(commit)
    }
    fn compact(&self, to: u64) -> raft::Result<()> {
        self.mem.compact(to)
    }
    fn set_conf(&self, cs: &ConfState) -> raft::Result<()> {
        self.mem.set_conf(cs)
    }
}

/// What handling one `Ready` produced.
#[derive(Debug, Default)]
pub struct Output {
    /// To send to peers (after the persistence above is done).
    pub messages: Vec<Message>,
    /// Committed entries, in order, to apply to the state machine.
    pub committed: Vec<Entry>,
    /// Reads confirmed by a quorum: each may be answered once the state
    /// machine has applied up to its index.
    pub read_states: Vec<raft::ReadState>,
    /// A leader's snapshot this replica took: the state machine becomes
    /// its contents before `committed` is applied.
    pub snapshot: Option<Snapshot>,
    /// Bytes of entries' data made durable in the log by this ready.
    pub appended_bytes: u64,
}

/// A replica of one shard.
pub struct Replica<S: LogStore> {
    node: RawNode<S>,
}

impl<S: LogStore> Replica<S> {
    /// A replica with raft id `id` over `storage` (which holds its state,
    /// empty or recovered).
    pub fn new(id: u64, storage: S, election_tick: usize, logger: &slog::Logger) -> raft::Result<Self> {
        Self::new_at(id, storage, election_tick, 0, logger)
    }

    /// [`Replica::new`] for a state machine already at `applied` (restored
    /// from a snapshot): raft hands over only the committed entries after.
    pub fn new_at(
        id: u64,
        storage: S,
        election_tick: usize,
        applied: u64,
        logger: &slog::Logger,
    ) -> raft::Result<Self> {
        let cfg = Config {
            id,
            applied,
            election_tick,
            heartbeat_tick: (election_tick / 5).max(1),
            check_quorum: true,
            pre_vote: true,
            max_size_per_msg: MAX_MESSAGE_BYTES,
            max_inflight_msgs: MAX_INFLIGHT_MESSAGES,
            ..Default::default()
        };
        Ok(Replica { node: RawNode::new(&cfg, storage, logger)? })
    }

    /// The raft node, for queries (role, term, leader).
    pub fn raft(&self) -> &RawNode<S> {
        &self.node
    }

    /// The raft node, for the simulation to fix what raft-rs draws from
    /// its own random source.
    #[cfg(test)]
    pub fn raft_mut(&mut self) -> &mut RawNode<S> {
        &mut self.node
    }

    /// Asks raft to hand leadership to voter `to` (see
    /// `ShardCore::transfer_leadership`, which gives the lease up first).
    pub fn transfer_leader(&mut self, to: u64) {
        self.node.transfer_leader(to);
    }

    /// One tick of the logical clock.
    pub fn tick(&mut self) {
        self.node.tick();
    }

    /// Tells raft that a snapshot for `to` did not arrive: it makes and
    /// sends another.
    pub fn snapshot_failed(&mut self, to: u64) {
        self.node.report_snapshot(to, raft::SnapshotStatus::Failure)
    }

    /// Proposes a membership change (only a leader accepts, one at a time).
    pub fn propose_conf_change(&mut self, cc: raft::prelude::ConfChange) -> raft::Result<()> {
        self.node.propose_conf_change(vec![], cc)
    }

    /// Applies a committed membership change entry; the members it makes.
    pub fn apply_conf_entry(&mut self, e: &Entry) -> raft::Result<ConfState> {
        use protobuf::Message as _;
        use raft::prelude::{ConfChange, ConfChangeV2, EntryType};
        if e.get_entry_type() == EntryType::EntryConfChange {
            let cc = ConfChange::parse_from_bytes(&e.data)?;
            self.node.apply_conf_change(&cc)
        } else {
            let cc = ConfChangeV2::parse_from_bytes(&e.data)?;
            self.node.apply_conf_change(&cc)
        }
    }

    /// The first index still in the log.
    pub fn first_index(&self) -> u64 {
        self.node.store().first_index().unwrap_or(1)
    }

    /// A message from a peer.
    pub fn step(&mut self, m: Message) -> raft::Result<()> {
        self.node.step(m)
    }

    /// Proposes a command (only a leader accepts).
    pub fn propose(&mut self, data: Vec<u8>) -> raft::Result<()> {
        self.node.propose(vec![], data)
    }

    /// Asks raft to confirm, through a quorum, that this replica still
    /// leads; the answer comes back in [`Output::read_states`] with `ctx`.
    pub fn read_index(&mut self, ctx: Vec<u8>) {
        self.node.read_index(ctx)
    }

    /// Handles a `Ready` if there is one: persists, then hands back what to
    /// send and what to apply. The order is raft-rs's: messages a leader may
    /// send before persisting, persistence, messages that need it, then the
    /// light ready after `advance`.
    pub fn ready(&mut self) -> raft::Result<Option<Output>> {
        if !self.node.has_ready() {
            return Ok(None);
        }
        let mut rd = self.node.ready();
        let snapshot = (!rd.snapshot().is_empty()).then(|| rd.snapshot().clone());
        let mut out = Output {
            messages: rd.take_messages(),
            committed: Vec::new(),
            read_states: rd.take_read_states(),
            snapshot: snapshot.clone(),
            appended_bytes: 0,
        };
        out.committed = rd.take_committed_entries();
        out.appended_bytes = rd.entries().iter().map(|e| e.data.len() as u64).sum();
        self.node.store().persist(rd.entries(), rd.hs(), snapshot.as_ref())?;
        out.messages.extend(rd.take_persisted_messages());
        let mut light = self.node.advance_append(rd);
        if let Some(commit) = light.commit_index() {
            self.node.store().set_commit(commit)?;
        }
        out.messages.extend(light.take_messages());
        out.committed.extend(light.take_committed_entries());
        Ok(Some(out))
    }

    /// Tells raft the state machine has applied every entry up to `index`
    /// (after the caller applied them: not when they were handed over, as
    /// an apply may wait for room).
    pub fn applied_to(&mut self, index: u64) {
        let log = &self.node.raft.raft_log;
        // raft-rs aborts on an index past what it committed and persisted;
        // the store never gets ahead of those, so the clamp only guards.
        let index = index.min(log.committed).min(log.persisted);
        if index > log.applied {
            self.node.advance_apply_to(index);
        }
    }
}

#[cfg(test)]
mod sim;

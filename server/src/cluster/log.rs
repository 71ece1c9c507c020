//! A shard's raft log, durable in TiKV's raft-engine: entries, the hard
//! state, the conf state and the last snapshot's (index, term), under the
//! shard's id as raft-engine's group id. Implements [`raft::Storage`] for
//! the shard's `RawNode`; the shard thread writes through [`RaftLog::persist`]
//! (one `LogBatch`, one fsync per ready when syncing).
//!
//! raft-engine panics when an append would leave a hole or overwrite
//! compacted entries; both are refused here with an error first (raft-rs
//! never asks for either outside a snapshot, which resets the log).

use std::path::PathBuf;
use std::sync::Arc;

use raft::prelude::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, StorageError};
use raft_engine::{Command, Engine, LogBatch, MessageExt};
use thiserror::Error;

use super::desk::{Descriptor, Desk};
use super::snapshot::{Point, SnapshotSlot};

/// raft-engine's view of raft-rs entries.
#[derive(Clone)]
pub struct EntryExt;

impl MessageExt for EntryExt {
    type Entry = Entry;
    fn index(e: &Entry) -> u64 {
        e.index
    }
}

const HARD_STATE: &[u8] = b"hard_state";
const CONF_STATE: &[u8] = b"conf_state";
const SNAPSHOT_META: &[u8] = b"snapshot_meta";
const REPLICA_ID: &[u8] = b"replica_id";

/// Why the log could not be read or written.
#[derive(Debug, Error)]
pub enum LogError {
    #[error("raft log in {dir}: {source}")]
    Engine { dir: String, source: raft_engine::Error },
    #[error("raft log of shard {shard}: appending at {at} would leave a hole after {last}")]
    Hole { shard: u64, at: u64, last: u64 },
    #[error("raft log of shard {shard}: appending at {at} would overwrite compacted entries (first is {first})")]
    Compacted { shard: u64, at: u64, first: u64 },
    #[error("snapshot file {file}: {source}")]
    Snapshot { file: PathBuf, source: std::io::Error },
    /// Broken beyond what can be cut out (see [`RaftLog::open_engine`]).
    #[error("raft log in {dir} is damaged and cannot be repaired: {why}")]
    Damaged { dir: String, why: String },
}

/// What one `Ready` asks to make durable.
#[derive(Default)]
pub struct Persist<'a> {
    pub entries: &'a [Entry],
    pub hard_state: Option<&'a HardState>,
    pub snapshot: Option<&'a Snapshot>,
    /// fsync before returning (`--sync always`).
    pub sync: bool,
}

/// The engine's own default: log files are deleted only past 10 GB.
pub const DEFAULT_PURGE_THRESHOLD: u64 = 10 << 30;
/// Below this, purging would rewrite live entries again and again.
pub const MIN_PURGE_THRESHOLD: u64 = 256 << 20;

/// One shard's log.
#[derive(Clone)]
pub struct RaftLog {
    engine: Arc<Engine>,
    shard: u64,
    dir: String,
    /// fsync every ready (`SyncPolicy::Always`).
    sync: bool,
    /// Where the snapshot raft sends to followers comes from.
    slot: Option<Arc<SnapshotSlot>>,
    /// The replica's snapshots: a leader's, installed before the log is
    /// replaced by it, and the saved one, dropped by a reset.
    desk: Option<Arc<Desk>>,
}

/// How a log opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// As it was written (a torn last batch, from a crash while writing,
    /// cut off as raft-engine always does).
    Clean,
    /// Broken batches inside it were cut out (a write that failed on a
    /// full disk leaves one, and the log goes on in a later file): what
    /// is left is whole, but entries this node acknowledged may be gone.
    /// Its replicas must not vote as what they were (`node` makes them
    /// new incarnations where the shard has other replicas).
    Repaired(String),
}

impl RaftLog {
    /// Opens (or creates) the log engine in `dir`, shared by a node's
    /// shards. A log raft-engine's default recovery refuses (a broken
    /// batch before its last file) is opened with the recovery that cuts
    /// broken batches out, and said to be repaired: a node always starts.
    pub fn open_engine(dir: &str) -> Result<(Arc<Engine>, Recovery), LogError> {
        RaftLog::open_engine_then(dir, DEFAULT_PURGE_THRESHOLD, |_| Ok(()))
    }

    /// [`RaftLog::open_engine`], calling `before_repair` (with why) before
    /// the log is touched to repair it: the caller records that the log is
    /// not to be trusted first, so a crash during or after the repair
    /// cannot leave a log that looks whole and is not.
    /// `purge_threshold`: bytes of log files past which the engine
    /// deletes the ones behind every shard's compaction point (and
    /// rewrites what little of them is still live), when asked.
    pub fn open_engine_then(
        dir: &str,
        purge_threshold: u64,
        before_repair: impl FnOnce(&str) -> Result<(), String>,
    ) -> Result<(Arc<Engine>, Recovery), LogError> {
        let err = |source| LogError::Engine { dir: dir.to_string(), source };
        let cfg = raft_engine::Config {
            dir: dir.to_string(),
            purge_threshold: raft_engine::ReadableSize(purge_threshold.max(MIN_PURGE_THRESHOLD)),
            ..Default::default()
        };
        match Engine::open(cfg.clone()) {
            Ok(e) => Ok((Arc::new(e), Recovery::Clean)),
            Err(raft_engine::Error::Corruption(why)) => {
                tracing::error!(dir, "raft log damaged ({why}): cutting out what is broken");
                before_repair(&why).map_err(|e| LogError::Damaged { dir: dir.to_string(), why: e })?;
                let cfg =
                    raft_engine::Config { recovery_mode: raft_engine::RecoveryMode::TolerateAnyCorruption, ..cfg };
                // Cutting out a batch in the middle leaves a hole, on which
                // raft-engine panics: that is a refusal too.
                let damaged = |why: String| LogError::Damaged { dir: dir.to_string(), why };
                match super::engine_panic::caught(|| Engine::open(cfg)) {
                    Ok(Ok(e)) => Ok((Arc::new(e), Recovery::Repaired(why))),
                    Ok(Err(e)) => Err(damaged(format!("{why}; cutting it out failed: {e}"))),
                    Err(p) => Err(damaged(format!("{why}; cutting it out leaves a hole ({})", panic_text(&p)))),
                }
            }
            Err(e) => Err(err(e)),
        }
    }

    /// Moves a damaged log `dir` (and its snapshots) aside, under a name
    /// with the time, so that a fresh one can start there; returns where.
    /// Earlier logs set aside are removed: one is kept, for a post-mortem.
    pub fn set_aside(dir: &str) -> Result<String, LogError> {
        let dir = dir.trim_end_matches('/');
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let parent = std::path::Path::new(dir).parent().unwrap_or(std::path::Path::new("."));
        let name = std::path::Path::new(dir).file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        let io = |source| LogError::Snapshot { file: PathBuf::from(dir), source };
        if let Ok(entries) = std::fs::read_dir(parent) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(&format!("{name}.damaged-")) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let aside = format!("{dir}.damaged-{stamp}");
        std::fs::rename(dir, &aside).map_err(io)?;
        let snaps = format!("{dir}-snapshots");
        if std::path::Path::new(&snaps).exists() {
            std::fs::rename(&snaps, format!("{aside}/snapshots")).map_err(io)?;
        }
        std::fs::File::open(parent).and_then(|d| d.sync_all()).map_err(io)?;
        Ok(aside)
    }

    /// Shard `shard`'s log in `engine`.
    pub fn new(engine: Arc<Engine>, shard: u64) -> RaftLog {
        let dir = engine.path().to_string();
        RaftLog { engine, shard, dir, sync: false, slot: None, desk: None }
    }

    /// Hands raft the snapshots put in `slot` (without one, followers that
    /// need a snapshot wait).
    pub fn with_snapshots(mut self, slot: Arc<SnapshotSlot>) -> RaftLog {
        self.slot = Some(slot);
        self
    }

    /// Takes snapshots through `desk` (with this log's snapshot directory,
    /// [`RaftLog::snapshot_dir`]).
    pub fn with_desk(mut self, desk: Arc<Desk>) -> RaftLog {
        self.desk = Some(desk);
        self
    }

    /// Where this shard's snapshots are saved: beside the log's directory.
    pub fn snapshot_dir(&self) -> PathBuf {
        PathBuf::from(format!("{}-snapshots", self.dir.trim_end_matches('/')))
    }

    /// Whether the disk takes writes: a small file written, synced and
    /// removed beside the log. A replica that failed on a full disk is
    /// started again only once this passes, so trying often costs little.
    pub fn probe(&self) -> Result<(), LogError> {
        use std::io::Write;
        let file = PathBuf::from(format!("{}.probe", self.dir.trim_end_matches('/')));
        let err = |source| LogError::Snapshot { file: file.clone(), source };
        let mut f = std::fs::File::create(&file).map_err(err)?;
        let wrote = f.write_all(&[0x5a; 4096]).and_then(|()| f.sync_all());
        let _ = std::fs::remove_file(&file);
        wrote.map_err(err)
    }

    /// Forces every ready batch to disk before raft goes on.
    pub fn with_sync(mut self, sync: bool) -> RaftLog {
        self.sync = sync;
        self
    }

    fn err(&self, source: raft_engine::Error) -> LogError {
        LogError::Engine { dir: self.dir.clone(), source }
    }

    /// The last snapshot's (index, term): (0, 0) before the first.
    fn snapshot_point(&self) -> raft::Result<(u64, u64)> {
        let m: Option<SnapshotMetadata> = self.engine.get_message(self.shard, SNAPSHOT_META).map_err(storage_err)?;
        Ok(m.map_or((0, 0), |m| (m.index, m.term)))
    }

    /// Makes what a `Ready` carries durable, in one batch.
    pub fn persist(&self, p: Persist<'_>) -> Result<(), LogError> {
        let mut b = LogBatch::default();
        let mut hard_state = p.hard_state.cloned();
        if let Some(snap) = p.snapshot {
            // The state machine first: once the log is replaced by the
            // snapshot, a restart can only start from the saved state.
            let desc = Descriptor::decode(snap.get_data()).ok_or_else(|| LogError::Damaged {
                dir: self.dir.clone(),
                why: "a snapshot without a descriptor".into(),
            })?;
            if let Some(desk) = &self.desk {
                desk.install(&desc).map_err(|why| LogError::Damaged { dir: self.dir.clone(), why })?;
            }
            // A snapshot replaces the whole log.
            let meta = snap.get_metadata();
            let mut hs = match hard_state.take() {
                Some(hs) => hs,
                None => self.engine.get_message(self.shard, HARD_STATE).map_err(|e| self.err(e))?.unwrap_or_default(),
            };
            hs.commit = hs.commit.max(meta.index);
            hard_state = Some(hs);
            let id = self.replica_id()?;
            b.add_command(self.shard, Command::Clean);
            if let Some(id) = id {
                b.put_message(self.shard, REPLICA_ID.to_vec(), &HardState { term: id, ..Default::default() })
                    .map_err(|e| self.err(e))?;
            }
            b.put_message(self.shard, SNAPSHOT_META.to_vec(), meta).map_err(|e| self.err(e))?;
            b.put_message(self.shard, CONF_STATE.to_vec(), meta.get_conf_state()).map_err(|e| self.err(e))?;
        }
        if let Some(first) = p.entries.first() {
            let (snap_index, _) = self.snapshot_point().unwrap_or((0, 0));
            let (lo, hi) = match p.snapshot {
                Some(s) => (s.get_metadata().index + 1, s.get_metadata().index),
                None => (
                    self.engine.first_index(self.shard).unwrap_or(snap_index + 1),
                    self.engine.last_index(self.shard).unwrap_or(snap_index),
                ),
            };
            if first.index < lo {
                return Err(LogError::Compacted { shard: self.shard, at: first.index, first: lo });
            }
            if first.index > hi + 1 {
                return Err(LogError::Hole { shard: self.shard, at: first.index, last: hi });
            }
            b.add_entries::<EntryExt>(self.shard, p.entries).map_err(|e| self.err(e))?;
        }
        if let Some(hs) = &hard_state {
            b.put_message(self.shard, HARD_STATE.to_vec(), hs).map_err(|e| self.err(e))?;
        }
        if !b.is_empty() {
            let started = std::time::Instant::now();
            self.engine.write(&mut b, p.sync).map_err(|e| self.err(e))?;
            // Unsynced writes reach the page cache only: not an fsync.
            if p.sync {
                crate::counters::FSYNC.observe(started.elapsed());
            }
        }
        Ok(())
    }

    /// The raft id this node's replica of the shard has, once decided.
    pub fn replica_id(&self) -> Result<Option<u64>, LogError> {
        let v: Option<HardState> = self.engine.get_message(self.shard, REPLICA_ID).map_err(|e| self.err(e))?;
        // Kept in a HardState's term: raft-engine stores protobuf messages.
        Ok(v.map(|h| h.term))
    }

    /// Records the raft id of this node's replica of the shard.
    pub fn set_replica_id(&self, id: u64) -> Result<(), LogError> {
        let mut b = LogBatch::default();
        let v = HardState { term: id, ..Default::default() };
        b.put_message(self.shard, REPLICA_ID.to_vec(), &v).map_err(|e| self.err(e))?;
        self.engine.write(&mut b, true).map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Empties the shard's log and saved snapshot, for a new replica `id`
    /// that starts from `conf` with no state.
    pub fn reset(&self, id: u64, conf: &ConfState) -> Result<(), LogError> {
        if let Some(desk) = &self.desk {
            desk.reset().map_err(|why| LogError::Damaged { dir: self.dir.clone(), why })?;
        }
        let mut b = LogBatch::default();
        b.add_command(self.shard, Command::Clean);
        b.put_message(self.shard, REPLICA_ID.to_vec(), &HardState { term: id, ..Default::default() })
            .map_err(|e| self.err(e))?;
        b.put_message(self.shard, CONF_STATE.to_vec(), conf).map_err(|e| self.err(e))?;
        self.engine.write(&mut b, true).map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Empties the shard's log and saved snapshot and forgets who its
    /// replica was (its node no longer holds the shard): a replica opened
    /// on it again starts with no state, as a new member.
    pub fn forget(&self) -> Result<(), LogError> {
        // The log first: a log without its snapshot would replay from a
        // compacted index into an empty store, where an empty log only
        // joins again.
        let mut b = LogBatch::default();
        b.add_command(self.shard, Command::Clean);
        self.engine.write(&mut b, true).map_err(|e| self.err(e))?;
        if let Some(desk) = &self.desk {
            desk.reset().map_err(|why| LogError::Damaged { dir: self.dir.clone(), why })?;
        }
        Ok(())
    }

    /// Records a membership change applied at the state machine.
    pub fn set_conf_state(&self, cs: &ConfState) -> Result<(), LogError> {
        let mut b = LogBatch::default();
        b.put_message(self.shard, CONF_STATE.to_vec(), cs).map_err(|e| self.err(e))?;
        self.engine.write(&mut b, true).map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Makes the log start after a snapshot at `at` whose state was saved
    /// but whose install in the log did not happen (a crash in between):
    /// what the log held up to there is in the snapshot.
    pub fn finish_install(&self, at: Point) -> Result<(), LogError> {
        let cs: Option<ConfState> = self.engine.get_message(self.shard, CONF_STATE).map_err(|e| self.err(e))?;
        let mut hs: HardState =
            self.engine.get_message(self.shard, HARD_STATE).map_err(|e| self.err(e))?.unwrap_or_default();
        hs.commit = hs.commit.max(at.index);
        if at.term > hs.term {
            // A vote belongs to its term.
            hs.term = at.term;
            hs.vote = 0;
        }
        let mut meta = SnapshotMetadata { index: at.index, term: at.term, ..Default::default() };
        if let Some(cs) = &cs {
            meta.set_conf_state(cs.clone());
        }
        let id = self.replica_id()?;
        let mut b = LogBatch::default();
        b.add_command(self.shard, Command::Clean);
        if let Some(id) = id {
            b.put_message(self.shard, REPLICA_ID.to_vec(), &HardState { term: id, ..Default::default() })
                .map_err(|e| self.err(e))?;
        }
        b.put_message(self.shard, SNAPSHOT_META.to_vec(), &meta).map_err(|e| self.err(e))?;
        if let Some(cs) = &cs {
            b.put_message(self.shard, CONF_STATE.to_vec(), cs).map_err(|e| self.err(e))?;
        }
        b.put_message(self.shard, HARD_STATE.to_vec(), &hs).map_err(|e| self.err(e))?;
        self.engine.write(&mut b, true).map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Drops entries before `index` (they are in a snapshot taken at
    /// `index - 1` with `term`).
    pub fn compact_to(&self, index: u64, term: u64) -> Result<(), LogError> {
        let mut meta = SnapshotMetadata { index: index - 1, term, ..Default::default() };
        if let Some(cs) = self.engine.get_message::<ConfState>(self.shard, CONF_STATE).map_err(|e| self.err(e))? {
            meta.set_conf_state(cs);
        }
        let mut b = LogBatch::default();
        b.put_message(self.shard, SNAPSHOT_META.to_vec(), &meta).map_err(|e| self.err(e))?;
        self.engine.write(&mut b, true).map_err(|e| self.err(e))?;
        self.engine.compact_to(self.shard, index);
        Ok(())
    }
}

impl crate::cluster::replica::LogStore for RaftLog {
    fn persist(&self, entries: &[Entry], hs: Option<&HardState>, snapshot: Option<&Snapshot>) -> raft::Result<()> {
        // A process crash keeps what reached the file; `--sync` decides
        // about power loss.
        RaftLog::persist(self, Persist { entries, hard_state: hs, snapshot, sync: self.sync })
            .map_err(|e| raft::Error::Store(StorageError::Other(Box::new(e))))
    }

    fn compact(&self, to: u64) -> raft::Result<()> {
        if to <= raft::Storage::first_index(self)? {
            return Ok(());
        }
        let term = raft::Storage::term(self, to - 1)?;
        self.compact_to(to, term).map_err(|e| raft::Error::Store(StorageError::Other(Box::new(e))))
    }

    fn durable(&self) -> bool {
        true
    }

    fn set_conf(&self, cs: &ConfState) -> raft::Result<()> {
        self.set_conf_state(cs).map_err(|e| raft::Error::Store(StorageError::Other(Box::new(e))))
    }

    fn set_commit(&self, commit: u64) -> raft::Result<()> {
        let mut hs: HardState =
            self.engine.get_message(self.shard, HARD_STATE).map_err(storage_err)?.unwrap_or_default();
        hs.commit = commit;
        RaftLog::persist(self, Persist { hard_state: Some(&hs), ..Default::default() })
            .map_err(|e| raft::Error::Store(StorageError::Other(Box::new(e))))
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

fn storage_err(e: raft_engine::Error) -> raft::Error {
    raft::Error::Store(StorageError::Other(Box::new(e)))
}

impl raft::Storage for RaftLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        let hs: Option<HardState> = self.engine.get_message(self.shard, HARD_STATE).map_err(storage_err)?;
        let cs: Option<ConfState> = self.engine.get_message(self.shard, CONF_STATE).map_err(storage_err)?;
        Ok(RaftState { hard_state: hs.unwrap_or_default(), conf_state: cs.unwrap_or_default() })
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let first = self.first_index()?;
        if low < first {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last_index()? + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let mut out = Vec::new();
        let max = max_size.into().map(|m| m as usize);
        self.engine.fetch_entries_to::<EntryExt>(self.shard, low, high, max, &mut out).map_err(storage_err)?;
        // raft-rs wants at least one entry even past the size limit.
        if out.is_empty() && low < high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        let (snap_index, snap_term) = self.snapshot_point()?;
        if idx == snap_index {
            return Ok(snap_term);
        }
        if idx < self.first_index()? {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        match self.engine.get_entry::<EntryExt>(self.shard, idx).map_err(storage_err)? {
            Some(e) => Ok(e.term),
            None => Err(raft::Error::Store(StorageError::Unavailable)),
        }
    }

    fn first_index(&self) -> raft::Result<u64> {
        let (snap_index, _) = self.snapshot_point()?;
        Ok(self.engine.first_index(self.shard).unwrap_or(snap_index + 1).max(snap_index + 1))
    }

    fn last_index(&self) -> raft::Result<u64> {
        let (snap_index, _) = self.snapshot_point()?;
        Ok(self.engine.last_index(self.shard).unwrap_or(snap_index).max(snap_index))
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        match &self.slot {
            Some(slot) => slot.for_raft(request_index),
            None => Err(raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use raft::Storage;

    fn entry(index: u64, term: u64) -> Entry {
        Entry { index, term, data: format!("e{index}t{term}").into_bytes().into(), ..Default::default() }
    }

    #[test]
    fn entries_and_states_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_str().unwrap();
        {
            let log = RaftLog::new(RaftLog::open_engine(path).unwrap().0, 3);
            let ents: Vec<Entry> = (1..=5).map(|i| entry(i, 1)).collect();
            let hs = HardState { term: 1, commit: 4, ..Default::default() };
            log.persist(Persist { entries: &ents, hard_state: Some(&hs), snapshot: None, sync: true }).unwrap();
            let cs = ConfState { voters: vec![1, 2, 3], ..Default::default() };
            log.set_conf_state(&cs).unwrap();
            // A new leader's entries replace the tail from index 4.
            log.persist(Persist {
                entries: &[entry(4, 2), entry(5, 2), entry(6, 2)],
                sync: true,
                ..Default::default()
            })
            .unwrap();
        }
        let log = RaftLog::new(RaftLog::open_engine(path).unwrap().0, 3);
        let st = log.initial_state().unwrap();
        assert_eq!((st.hard_state.term, st.hard_state.commit), (1, 4));
        assert_eq!(st.conf_state.voters, vec![1, 2, 3]);
        assert_eq!((log.first_index().unwrap(), log.last_index().unwrap()), (1, 6));
        let got = log.entries(1, 7, None, GetEntriesContext::empty(false)).unwrap();
        let terms: Vec<u64> = got.iter().map(|e| e.term).collect();
        assert_eq!(terms, [1, 1, 1, 2, 2, 2]);
        assert_eq!(log.term(5).unwrap(), 2);
        // Another shard in the same engine is empty.
        let other = RaftLog::new(Arc::clone(&log.engine), 4);
        assert_eq!((other.first_index().unwrap(), other.last_index().unwrap()), (1, 0));
    }

    /// A log in several files (small ones), 200 entries of shard 1.
    fn log_in_files() -> (tempfile::TempDir, String, Vec<PathBuf>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_str().unwrap().to_string();
        let cfg = raft_engine::Config {
            dir: path.clone(),
            target_file_size: raft_engine::ReadableSize::kb(64),
            ..Default::default()
        };
        {
            let engine = Engine::open(cfg).unwrap();
            for index in 1..=200u64 {
                // Incompressible, so that the log spans several files.
                let data: Vec<u8> = (0..2000).map(|_| rand::random::<u8>()).collect();
                let e = Entry { index, term: 1, data: data.into(), ..Default::default() };
                let mut b = LogBatch::default();
                b.add_entries::<EntryExt>(1, &[e]).unwrap();
                engine.write(&mut b, false).unwrap();
            }
        }
        let mut files: Vec<_> = std::fs::read_dir(&path)
            .unwrap()
            .map(|f| f.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "raftlog"))
            .collect();
        files.sort();
        assert!(files.len() >= 3, "{files:?}");
        (dir, path, files)
    }

    fn strict_open(path: &str) -> raft_engine::Result<()> {
        Engine::open(raft_engine::Config { dir: path.to_string(), ..Default::default() }).map(|_| ())
    }

    /// What a full disk left in the fault suite: the leftover of a failed
    /// write after a file's last batch, and the log going on in the next
    /// file. raft-engine's default recovery forgives a torn tail only in
    /// the last file, and refuses it; the node cuts it off and says so.
    #[test]
    fn a_torn_tail_before_the_last_file_opens_repaired() {
        let (_dir, path, files) = log_in_files();
        let mut f = std::fs::OpenOptions::new().append(true).open(&files[0]).unwrap();
        std::io::Write::write_all(&mut f, &[0xa5; 3000]).unwrap();
        drop(f);
        assert!(matches!(strict_open(&path), Err(raft_engine::Error::Corruption(_))), "the default took it");
        let (engine, recovery) = RaftLog::open_engine(&path).unwrap();
        assert!(matches!(recovery, Recovery::Repaired(_)), "{recovery:?}");
        let log = RaftLog::new(engine, 1);
        assert_eq!(log.entries(1, 201, None, GetEntriesContext::empty(false)).unwrap().len(), 200, "nothing lost");
    }

    /// A break in the middle of the log cannot be cut out without a hole
    /// (raft-engine then panics on the hole): refused, so the node can
    /// set the log aside (`set_aside`) and start its replicas afresh.
    #[test]
    fn a_log_broken_in_the_middle_is_refused_without_a_panic() {
        let (_dir, path, files) = log_in_files();
        let mut bytes = std::fs::read(&files[0]).unwrap();
        let mid = bytes.len() / 2;
        // More than a batch: a batch header is among them.
        bytes[mid..mid + 5000].fill(0xa5);
        std::fs::write(&files[0], bytes).unwrap();
        let err = RaftLog::open_engine(&path).err().expect("refused");
        assert!(matches!(err, LogError::Damaged { .. }), "{err}");
        let aside = RaftLog::set_aside(&path).unwrap();
        assert!(std::path::Path::new(&aside).exists() && !std::path::Path::new(&path).exists());
        let (_, recovery) = RaftLog::open_engine(&path).unwrap();
        assert_eq!(recovery, Recovery::Clean, "a fresh log");
    }

    #[test]
    fn holes_and_compacted_overwrites_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let log = RaftLog::new(RaftLog::open_engine(dir.path().to_str().unwrap()).unwrap().0, 1);
        let ents: Vec<Entry> = (1..=10).map(|i| entry(i, 1)).collect();
        log.persist(Persist { entries: &ents, ..Default::default() }).unwrap();
        assert!(matches!(
            log.persist(Persist { entries: &[entry(12, 1)], ..Default::default() }),
            Err(LogError::Hole { at: 12, last: 10, .. })
        ));
        log.compact_to(6, 1).unwrap();
        assert_eq!(log.first_index().unwrap(), 6);
        assert_eq!(log.term(5).unwrap(), 1, "the snapshot point keeps its term");
        assert!(matches!(log.term(4), Err(raft::Error::Store(StorageError::Compacted))));
        assert!(matches!(
            log.entries(3, 8, None, GetEntriesContext::empty(false)),
            Err(raft::Error::Store(StorageError::Compacted))
        ));
        assert!(matches!(
            log.persist(Persist { entries: &[entry(3, 2)], ..Default::default() }),
            Err(LogError::Compacted { at: 3, first: 6, .. })
        ));
        // Nothing changed.
        assert_eq!(log.last_index().unwrap(), 10);
    }
}

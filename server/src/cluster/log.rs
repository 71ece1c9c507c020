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

/// When the log is forced to disk (`--sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncPolicy {
    /// Every ready batch is fsynced before raft goes on: an acknowledged
    /// write survives power loss of every replica. The default.
    #[default]
    Always,
    /// Written at once (a process crash loses nothing), fsynced every
    /// [`BATCH_SYNC_INTERVAL`]: a power loss of a majority of a shard's
    /// replicas within that time can lose acknowledged writes.
    Batch,
    /// Written at once, fsynced when the kernel decides.
    None,
}

/// How often `--sync batch` forces the log to disk.
pub const BATCH_SYNC_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);

impl std::str::FromStr for SyncPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "always" => Ok(SyncPolicy::Always),
            "batch" => Ok(SyncPolicy::Batch),
            "none" => Ok(SyncPolicy::None),
            _ => Err(format!("unknown sync policy {s:?} (always, batch or none)")),
        }
    }
}

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
}

impl RaftLog {
    /// Opens (or creates) the log engine in `dir`, shared by a node's shards.
    pub fn open_engine(dir: &str) -> Result<Arc<Engine>, LogError> {
        let cfg = raft_engine::Config { dir: dir.to_string(), ..Default::default() };
        Engine::open(cfg).map(Arc::new).map_err(|source| LogError::Engine { dir: dir.to_string(), source })
    }

    /// Shard `shard`'s log in `engine`.
    pub fn new(engine: Arc<Engine>, shard: u64) -> RaftLog {
        let dir = engine.path().to_string();
        RaftLog { engine, shard, dir, sync: false, slot: None }
    }

    /// Hands raft the snapshots put in `slot` (without one, followers that
    /// need a snapshot wait).
    pub fn with_snapshots(mut self, slot: Arc<SnapshotSlot>) -> RaftLog {
        self.slot = Some(slot);
        self
    }

    /// The file holding this shard's state machine as of its last
    /// snapshot, beside the log's directory.
    pub fn snapshot_file(&self) -> PathBuf {
        PathBuf::from(format!("{}-snapshots", self.dir.trim_end_matches('/')))
            .join(format!("shard-{}.snap", self.shard))
    }

    /// The saved snapshot's bytes, if there is one (checked by the caller:
    /// `snapshot::decode`).
    pub fn load_snapshot(&self) -> Result<Option<Vec<u8>>, LogError> {
        let file = self.snapshot_file();
        match std::fs::read(&file) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(LogError::Snapshot { file, source }),
        }
    }

    /// Saves a snapshot whole or not at all: written beside, forced to
    /// disk, renamed over the last one, the directory forced too.
    fn write_snapshot(&self, data: &[u8]) -> Result<(), LogError> {
        use std::io::Write;
        let file = self.snapshot_file();
        let err = |source| LogError::Snapshot { file: file.clone(), source };
        let dir = file.parent().unwrap_or(std::path::Path::new("."));
        std::fs::create_dir_all(dir).map_err(err)?;
        let tmp = file.with_extension("snap.tmp");
        let mut f = std::fs::File::create(&tmp).map_err(err)?;
        f.write_all(data).map_err(err)?;
        f.sync_all().map_err(err)?;
        std::fs::rename(&tmp, &file).map_err(err)?;
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(err)?;
        Ok(())
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
            self.write_snapshot(&snap.data)?;
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
                crate::metrics::FSYNC.observe(started.elapsed());
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
        let file = self.snapshot_file();
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(LogError::Snapshot { file, source }),
        }
        let mut b = LogBatch::default();
        b.add_command(self.shard, Command::Clean);
        b.put_message(self.shard, REPLICA_ID.to_vec(), &HardState { term: id, ..Default::default() })
            .map_err(|e| self.err(e))?;
        b.put_message(self.shard, CONF_STATE.to_vec(), conf).map_err(|e| self.err(e))?;
        self.engine.write(&mut b, true).map_err(|e| self.err(e))?;
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

    fn save_snapshot(&self, data: Vec<u8>) -> std::sync::mpsc::Receiver<Result<(), String>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let log = self.clone();
        let spawned = std::thread::Builder::new().name(format!("shard-{}-save", self.shard)).spawn(move || {
            let _ = tx.send(log.write_snapshot(&data).map_err(|e| e.to_string()));
        });
        if let Err(e) = spawned {
            let (tx, rx2) = std::sync::mpsc::channel();
            let _ = tx.send(Err(format!("cannot start the snapshot writer: {e}")));
            return rx2;
        }
        rx
    }

    fn set_commit(&self, commit: u64) -> raft::Result<()> {
        let mut hs: HardState =
            self.engine.get_message(self.shard, HARD_STATE).map_err(storage_err)?.unwrap_or_default();
        hs.commit = commit;
        RaftLog::persist(self, Persist { hard_state: Some(&hs), ..Default::default() })
            .map_err(|e| raft::Error::Store(StorageError::Other(Box::new(e))))
    }
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
            let log = RaftLog::new(RaftLog::open_engine(path).unwrap(), 3);
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
        let log = RaftLog::new(RaftLog::open_engine(path).unwrap(), 3);
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

    #[test]
    fn holes_and_compacted_overwrites_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let log = RaftLog::new(RaftLog::open_engine(dir.path().to_str().unwrap()).unwrap(), 1);
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

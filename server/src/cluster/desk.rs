//! A shard replica's snapshots outside raft: the ones it offers followers
//! (views of its store, streamed by `transfer`), the one it is receiving
//! from a leader and the one received, and with `--data-dir` its saved
//! snapshot file.
//!
//! Raft carries only a [`Descriptor`] (which snapshot, taken where); the
//! items travel on a connection of their own. So raft's messages never
//! wait behind a snapshot, and neither side holds a shard's worth of
//! bytes: the leader walks a view while it sends, the follower writes
//! what arrives to a file (or, without a data directory, keeps it in
//! memory, bounded by its region's size).
//!
//! One writer per file: every save and every install renames into the
//! snapshot file under one lock, only if it is newer than what is there,
//! and only if no reset came in between. So a save racing an install
//! never leaves a mix of the two, an older snapshot never replaces a newer
//! one (raft-rs refuses to start on a log cut past its snapshot), and a
//! crash at any point leaves either the old file or the new one.

use std::collections::HashMap;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::apply::RememberedParts;
use super::snapshot::{self as snap, Point, Summary};
use crate::lock::lock;
use crate::store::view::StoreView;

/// A stream to a follower in progress (see [`Desk::stream_to`]).
pub struct StreamGuard {
    desk: Arc<Desk>,
    to: u64,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut streams = lock(&self.desk.streams);
        if let Some(n) = streams.get_mut(&self.to) {
            *n -= 1;
            if *n == 0 {
                streams.remove(&self.to);
            }
        }
    }
}

/// Magic of a descriptor in a raft snapshot's data.
const DESCRIPTOR_MAGIC: &[u8; 8] = b"DMKVSND1";
/// Snapshots offered for sending at once per replica: a view each holds
/// its store's retired space, so few.
pub const MAX_OUTGOING: usize = 2;
/// A snapshot offered that no sender took within this (raft asked, then
/// the follower caught up or leadership moved) is dropped: its view holds
/// the store's retired space. One taken stays on offer (and keeps the log
/// from being cut past it) until its sender is done with it, however long
/// a large shard takes; every step of a send has a timeout.
pub const UNTAKEN_TTL: Duration = Duration::from_secs(10);

/// Whether an offer is being sent: its sender holds it.
fn taken(o: &Arc<Outgoing>) -> bool {
    Arc::strong_count(o) > 1
}

/// Drops the offers no sender took in time.
fn expire(out: &mut HashMap<u64, Arc<Outgoing>>) {
    out.retain(|_, o| taken(o) || o.made.elapsed() < UNTAKEN_TTL);
}
/// Received bytes of one snapshot beyond the replica's region size: the
/// stream's framing and the remembered writes.
pub const RECEIVE_SLACK: u64 = 32 << 20;

/// What raft carries for a snapshot: which one, and where it was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub id: u64,
    pub at: Point,
}

impl Descriptor {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = DESCRIPTOR_MAGIC.to_vec();
        for x in [self.id, self.at.index, self.at.term] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        b
    }

    pub fn decode(b: &[u8]) -> Option<Descriptor> {
        if b.len() != 32 || &b[..8] != DESCRIPTOR_MAGIC {
            return None;
        }
        let w = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Some(Descriptor { id: w(8), at: Point { index: w(16), term: w(24) } })
    }
}

/// A snapshot offered to followers: its view is held (with the space it
/// keeps from reuse) until it is sent or dropped.
pub struct Outgoing {
    pub view: StoreView,
    pub remembered: RememberedParts,
    pub at: Point,
    made: Instant,
}

/// Where a received snapshot's bytes are.
#[derive(Debug, Clone)]
pub enum Data {
    File(PathBuf),
    Memory(Arc<Vec<u8>>),
}

impl Data {
    /// A reader of the bytes.
    pub fn reader(&self) -> std::io::Result<Box<dyn Read + Send>> {
        Ok(match self {
            Data::File(p) => Box::new(std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(p)?)),
            // Shared, not copied: the bytes are a shard's worth.
            Data::Memory(v) => Box::new(std::io::Cursor::new(SharedBytes(Arc::clone(v)))),
        })
    }
}

/// Received bytes read in place by several readers (validate, restore).
struct SharedBytes(Arc<Vec<u8>>);

impl AsRef<[u8]> for SharedBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

struct Receiving {
    id: u64,
    from: u64,
    next: u64,
    sink: Sink,
}

enum Sink {
    File(BufWriter<PacedFile>, PathBuf),
    Memory(Vec<u8>),
}

struct Received {
    desc: Descriptor,
    data: Data,
    at: Instant,
}

/// A received snapshot raft has not taken within this is dropped (raft
/// refused it, or took another): its bytes are a shard's worth.
pub const RECEIVED_TTL: Duration = Duration::from_secs(60);

/// What is in the snapshot directory, under the one lock its writers take.
struct FileState {
    /// The saved snapshot's point.
    on_disk: Option<Point>,
    /// Bumped by every reset: a save begun before one is dropped.
    generation: u64,
}

struct Files {
    dir: PathBuf,
    shard: u32,
    state: Mutex<FileState>,
}

/// A replica's snapshots (see the module's comment).
pub struct Desk {
    shard: u32,
    files: Option<Files>,
    /// Most bytes a received snapshot may have.
    max_bytes: u64,
    outgoing: Mutex<HashMap<u64, Arc<Outgoing>>>,
    /// Streams in progress, by follower (raft id): how many.
    streams: Mutex<HashMap<u64, usize>>,
    receiving: Mutex<Option<Receiving>>,
    received: Mutex<Option<Received>>,
}

/// How a chunk of a snapshot being received was taken.
#[derive(Debug)]
pub enum Taken {
    /// Bytes received so far.
    More(u64),
    /// The last chunk: the whole stream is here, to be validated.
    Whole(Data),
}

impl Desk {
    /// A replica that keeps snapshots in `dir` (created if need be; the
    /// leftovers of interrupted saves and receives are removed).
    pub fn durable(dir: &Path, shard: u32, max_bytes: u64) -> Result<Desk, String> {
        let err = |e: std::io::Error| format!("snapshot directory {}: {e}", dir.display());
        std::fs::create_dir_all(dir).map_err(err)?;
        let prefix = format!("shard-{shard}.snap.");
        for e in std::fs::read_dir(dir).map_err(err)?.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let files =
            Files { dir: dir.to_path_buf(), shard, state: Mutex::new(FileState { on_disk: None, generation: 0 }) };
        let on_disk = match std::fs::File::open(files.path()) {
            Ok(f) => match snap::Decoder::new(std::io::BufReader::new(f)) {
                Ok(d) => Some(d.at),
                // Its restore finds the damage and the replica rejoins
                // (a node always starts); anything saved replaces it.
                Err(snap::SnapshotError::Damaged(_)) => None,
                Err(e) => return Err(format!("{}: {e}", files.path().display())),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(err(e)),
        };
        lock(&files.state).on_disk = on_disk;
        Ok(Desk::new(shard, Some(files), max_bytes))
    }

    /// A replica that keeps nothing on disk.
    pub fn memory(shard: u32, max_bytes: u64) -> Desk {
        Desk::new(shard, None, max_bytes)
    }

    fn new(shard: u32, files: Option<Files>, max_bytes: u64) -> Desk {
        Desk {
            shard,
            files,
            max_bytes,
            outgoing: Mutex::default(),
            streams: Mutex::default(),
            receiving: Mutex::default(),
            received: Mutex::default(),
        }
    }

    /// Whether snapshots are saved on disk.
    pub fn durable_files(&self) -> bool {
        self.files.is_some()
    }

    /// The saved snapshot file.
    pub fn saved_file(&self) -> Option<PathBuf> {
        self.files.as_ref().map(Files::path)
    }

    /// The saved snapshot, to restore a store from.
    pub fn saved(&self) -> Result<Option<(PathBuf, std::fs::File)>, String> {
        let Some(files) = &self.files else { return Ok(None) };
        let p = files.path();
        match std::fs::File::open(&p) {
            Ok(f) => Ok(Some((p, f))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", p.display())),
        }
    }

    // --- the leader's side ---

    /// Offers `view` (taken at `at`) to followers; what raft carries for
    /// it. If there are too many, the oldest one no sender took goes (or,
    /// all taken, the oldest: its send goes on, but the log may be cut past
    /// it).
    pub fn offer(&self, view: StoreView, remembered: RememberedParts, at: Point) -> Descriptor {
        let mut out = lock(&self.outgoing);
        expire(&mut out);
        while out.len() >= MAX_OUTGOING {
            let oldest = out.iter().min_by_key(|(_, o)| (taken(o), o.made)).map(|(&id, _)| id).expect("not empty");
            out.remove(&oldest);
        }
        let id = rand::random::<u64>();
        out.insert(id, Arc::new(Outgoing { view, remembered, at, made: Instant::now() }));
        Descriptor { id, at }
    }

    /// The snapshot offered as `id`, while it is.
    pub fn outgoing(&self, id: u64) -> Option<Arc<Outgoing>> {
        lock(&self.outgoing).get(&id).cloned()
    }

    /// Done with offer `id` (sent, or given up).
    pub fn withdraw(&self, id: u64) {
        lock(&self.outgoing).remove(&id);
    }

    /// Marks a stream to follower `to` (a raft id) in progress until the
    /// guard is dropped: raft's wait for the snapshot to be taken counts
    /// from the stream's end.
    pub fn stream_to(self: &Arc<Self>, to: u64) -> StreamGuard {
        *lock(&self.streams).entry(to).or_insert(0) += 1;
        StreamGuard { desk: Arc::clone(self), to }
    }

    /// Whether a snapshot is being streamed to follower `to`.
    pub fn streaming_to(&self, to: u64) -> bool {
        lock(&self.streams).contains_key(&to)
    }

    /// The lowest index of a snapshot on offer: the log must keep the
    /// entries after it, or a follower that takes it needs another.
    pub fn oldest_offer(&self) -> Option<u64> {
        let mut out = lock(&self.outgoing);
        expire(&mut out);
        out.values().map(|o| o.at.index).min()
    }

    // --- the follower's side ---

    /// Takes a chunk of snapshot `id` from node `from`, at `offset`: a
    /// chunk at offset 0 starts it (dropping any other one being
    /// received), the next must follow on. Anything out of order, or past
    /// the bound, is refused and drops what was received.
    pub fn receive(&self, from: u64, id: u64, offset: u64, data: &[u8], last: bool) -> Result<Taken, String> {
        let mut r = lock(&self.receiving);
        if offset == 0 {
            if let Some(old) = r.take() {
                drop_sink(old.sink);
            }
            let sink = match &self.files {
                Some(f) => {
                    let p = f.temp(&format!("recv-{id:016x}"));
                    let file = std::fs::File::create(&p).map_err(|e| format!("{}: {e}", p.display()))?;
                    Sink::File(BufWriter::with_capacity(1 << 20, PacedFile::new(file)), p)
                }
                None => Sink::Memory(Vec::new()),
            };
            *r = Some(Receiving { id, from, next: 0, sink });
        }
        let Some(cur) = r.as_mut() else { return Err("no snapshot is being received (a part came first)".into()) };
        if (cur.id, cur.from) != (id, from) {
            // A part of a stream another one replaced (a deposed leader's,
            // still sending): refused, and the current one goes on. Were
            // it dropped, two senders would stop each other without end.
            return Err(format!(
                "snapshot part of {id:x} from node {from}: receiving {:x} from node {} now",
                cur.id, cur.from
            ));
        }
        if cur.next != offset {
            let why = format!("snapshot part at {offset} out of place (expected {} of {:x})", cur.next, cur.id);
            if let Some(old) = r.take() {
                drop_sink(old.sink);
            }
            return Err(why);
        }
        let next = cur.next + data.len() as u64;
        if next > self.max_bytes {
            if let Some(old) = r.take() {
                drop_sink(old.sink);
            }
            return Err(format!("snapshot larger than {} bytes, the most this replica takes", self.max_bytes));
        }
        let wrote = match &mut cur.sink {
            Sink::File(w, _) => w.write_all(data).map_err(|e| e.to_string()),
            Sink::Memory(v) => {
                v.extend_from_slice(data);
                Ok(())
            }
        };
        if let Err(e) = wrote {
            if let Some(old) = r.take() {
                drop_sink(old.sink);
            }
            return Err(format!("writing a received snapshot: {e}"));
        }
        cur.next = next;
        if !last {
            return Ok(Taken::More(next));
        }
        let done = r.take().expect("checked");
        match done.sink {
            Sink::File(w, p) => {
                let synced = w
                    .into_inner()
                    .map_err(|e| e.to_string())
                    .and_then(|f| f.0.sync_all().map_err(|e| format!("{}: {e}", p.display())));
                if let Err(e) = synced {
                    let _ = std::fs::remove_file(&p);
                    return Err(e);
                }
                Ok(Taken::Whole(Data::File(p)))
            }
            Sink::Memory(v) => Ok(Taken::Whole(Data::Memory(Arc::new(v)))),
        }
    }

    /// Throws away received `data` that will not be installed.
    pub fn discard(data: &Data) {
        drop_data(data);
    }

    /// Reads received `data` whole (checksum, every length): what it holds.
    pub fn validate(data: &Data) -> Result<Summary, String> {
        snap::validate(data.reader().map_err(|e| e.to_string())?).map_err(|e| e.to_string())
    }

    /// Keeps validated `data` as snapshot `desc`, for raft to take.
    pub fn received(&self, desc: Descriptor, data: Data) {
        if let Some(old) = lock(&self.received).replace(Received { desc, data, at: Instant::now() }) {
            drop_data(&old.data);
        }
    }

    /// Drops a received snapshot raft left for longer than [`RECEIVED_TTL`].
    pub fn drop_stale(&self) {
        expire(&mut lock(&self.outgoing));
        let mut rec = lock(&self.received);
        if rec.as_ref().is_some_and(|r| r.at.elapsed() >= RECEIVED_TTL)
            && let Some(r) = rec.take()
        {
            drop_data(&r.data);
        }
    }

    /// Whether snapshot `desc` was received whole and valid.
    pub fn has(&self, desc: &Descriptor) -> bool {
        lock(&self.received).as_ref().is_some_and(|r| r.desc == *desc)
    }

    /// Makes received snapshot `desc` the saved one (raft took it, before
    /// its log is replaced): renamed into place.
    pub fn install(&self, desc: &Descriptor) -> Result<(), String> {
        let Some(files) = &self.files else { return Ok(()) };
        let mut rec = lock(&self.received);
        let Some(r) = rec.as_mut().filter(|r| r.desc == *desc) else {
            return Err(format!("snapshot {:x} at {} was not received", desc.id, desc.at.index));
        };
        let Data::File(p) = &r.data else { return Err("a received snapshot in memory on a durable replica".into()) };
        let generation = lock(&files.state).generation;
        if files.install(p, desc.at, generation)? {
            r.data = Data::File(files.path());
            Ok(())
        } else {
            Err(format!("snapshot at {} is not newer than the saved one", desc.at.index))
        }
    }

    /// Takes received snapshot `desc`'s bytes, to restore the store from.
    pub fn take(&self, desc: &Descriptor) -> Option<Data> {
        let mut rec = lock(&self.received);
        if rec.as_ref().is_some_and(|r| r.desc == *desc) { rec.take().map(|r| r.data) } else { None }
    }

    // --- saves ---

    /// Saves `view` (taken at `at`) as the replica's snapshot file, on a
    /// thread of its own; the outcome comes on the returned channel. Only
    /// one that is newer than the saved file, and begun after the last
    /// reset, replaces it.
    pub fn save(
        self: &Arc<Self>,
        view: StoreView,
        remembered: RememberedParts,
        at: Point,
    ) -> std::sync::mpsc::Receiver<Result<(), String>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let Some(files) = &self.files else {
            let _ = tx.send(Ok(()));
            return rx;
        };
        let generation = lock(&files.state).generation;
        let desk = Arc::clone(self);
        let spawned = std::thread::Builder::new().name(format!("shard-{}-save", self.shard)).spawn(move || {
            // A whole shard's walk: the shard threads' ticks come first.
            super::thread_priority::background();
            let files = desk.files.as_ref().expect("durable");
            let tmp = files.temp(&format!("save-{:016x}", rand::random::<u64>()));
            let written = (|| {
                let f = PacedFile::new(std::fs::File::create(&tmp).map_err(|e| e.to_string())?);
                let (w, _) = snap::encode_view(&view, &remembered, at, BufWriter::with_capacity(1 << 20, f))?;
                let f = w.into_inner().map_err(|e| e.to_string())?.0;
                f.sync_all().map_err(|e| e.to_string())
            })();
            drop(view);
            let r = written.and_then(|()| match files.install(&tmp, at, generation)? {
                true => Ok(()),
                // A newer snapshot is saved, or the replica started over:
                // the log must not be cut on this one.
                false => Err("superseded by a newer snapshot or a reset".to_string()),
            });
            if r.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            let _ = tx.send(r.map_err(|e| format!("{}: {e}", tmp.display())));
        });
        if let Err(e) = spawned {
            let (tx, rx2) = std::sync::mpsc::channel();
            let _ = tx.send(Err(format!("cannot start the snapshot writer: {e}")));
            return rx2;
        }
        rx
    }

    /// Forgets every snapshot (a replica that starts over): the saved file
    /// goes, saves in progress are dropped, receives stop.
    pub fn reset(&self) -> Result<(), String> {
        if let Some(r) = lock(&self.receiving).take() {
            drop_sink(r.sink);
        }
        if let Some(r) = lock(&self.received).take() {
            drop_data(&r.data);
        }
        lock(&self.outgoing).clear();
        let Some(files) = &self.files else { return Ok(()) };
        let mut st = lock(&files.state);
        st.generation += 1;
        st.on_disk = None;
        match std::fs::remove_file(files.path()) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{}: {e}", files.path().display())),
        }
        sync_dir(&files.dir)
    }
}

impl Files {
    fn path(&self) -> PathBuf {
        self.dir.join(format!("shard-{}.snap", self.shard))
    }

    fn temp(&self, what: &str) -> PathBuf {
        self.dir.join(format!("shard-{}.snap.{what}", self.shard))
    }

    /// Renames `from` (whole, synced) over the saved snapshot if it is
    /// newer and no reset came since `generation`; whether it did. `from`
    /// is removed if not.
    fn install(&self, from: &Path, at: Point, generation: u64) -> Result<bool, String> {
        let mut st = lock(&self.state);
        if st.generation != generation || st.on_disk.is_some_and(|p| p.index >= at.index) {
            let _ = std::fs::remove_file(from);
            return Ok(false);
        }
        std::fs::rename(from, self.path()).map_err(|e| format!("{}: {e}", self.path().display()))?;
        sync_dir(&self.dir)?;
        st.on_disk = Some(at);
        Ok(true)
    }
}

fn sync_dir(dir: &Path) -> Result<(), String> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| format!("{}: {e}", dir.display()))
}

/// A snapshot file is forced to disk every this many bytes as it is
/// written, not all at the end: a shard's worth of dirty pages written back
/// at once stalls every other writer of the disk (the raft log's appends
/// among them, on the shard threads, long enough to cost leaderships).
pub const SYNC_EVERY: u64 = 16 << 20;

/// A file written with a sync every [`SYNC_EVERY`] bytes.
struct PacedFile(std::fs::File, u64);

impl PacedFile {
    fn new(f: std::fs::File) -> PacedFile {
        PacedFile(f, 0)
    }
}

impl Write for PacedFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.0.write(buf)?;
        self.1 += n as u64;
        if self.1 >= SYNC_EVERY {
            self.0.sync_data()?;
            self.1 = 0;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

fn drop_sink(s: Sink) {
    if let Sink::File(_, p) = s {
        let _ = std::fs::remove_file(p);
    }
}

fn drop_data(d: &Data) {
    // Only a file not yet installed is the desk's to remove; the saved
    // file is never removed here.
    if let Data::File(p) = d
        && p.file_name().is_some_and(|n| n.to_string_lossy().contains(".snap.recv-"))
    {
        let _ = std::fs::remove_file(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use crate::store::Store;

    fn store() -> Arc<Store> {
        let region = Arc::new(Region::create("desk", 4 << 20).unwrap());
        Arc::new(Store::format(region, 64, 9, 1, Duration::ZERO).unwrap())
    }

    fn stream(s: &Arc<Store>, at: Point) -> Vec<u8> {
        snap::encode(&s.view().unwrap(), &RememberedParts::default(), at).unwrap()
    }

    #[test]
    fn streams_are_counted_per_follower_until_their_guards_go() {
        let d = Arc::new(Desk::memory(1, 1 << 20));
        let (a, b) = (d.stream_to(7), d.stream_to(7));
        assert!(d.streaming_to(7) && !d.streaming_to(8));
        drop(a);
        assert!(d.streaming_to(7), "one stream to it is left");
        drop(b);
        assert!(!d.streaming_to(7));
    }

    #[test]
    fn descriptors_round_trip_and_nonsense_is_none() {
        let d = Descriptor { id: 7, at: Point { index: 9, term: 2 } };
        assert_eq!(Descriptor::decode(&d.encode()), Some(d));
        assert_eq!(Descriptor::decode(b"DMKVSNP3...."), None);
        assert_eq!(Descriptor::decode(&d.encode()[..31]), None);
    }

    /// A received snapshot goes to a file part by part, is validated, and
    /// is renamed into place when raft takes it; parts out of order and
    /// ones past the bound are refused and drop what came.
    #[test]
    fn snapshots_are_received_in_order_within_the_bound_and_installed() {
        let dir = tempfile::tempdir().unwrap();
        let s = store();
        for i in 0..300u32 {
            s.put(format!("k{i}").as_bytes(), &[i as u8; 500]).unwrap();
        }
        let at = Point { index: 40, term: 2 };
        let bytes = stream(&s, at);
        let desk = Desk::durable(dir.path(), 3, 1 << 30).unwrap();
        let mut off = 0;
        let chunks: Vec<&[u8]> = bytes.chunks(10_000).collect();
        let mut whole = None;
        for (i, c) in chunks.iter().enumerate() {
            match desk.receive(2, 11, off, c, i + 1 == chunks.len()).unwrap() {
                Taken::More(n) => off = n,
                Taken::Whole(d) => whole = Some(d),
            }
        }
        let data = whole.unwrap();
        assert_eq!(Desk::validate(&data).unwrap().at, at);
        let desc = Descriptor { id: 11, at };
        assert!(!desk.has(&desc));
        desk.received(desc, data);
        assert!(desk.has(&desc) && !desk.has(&Descriptor { id: 12, at }));
        desk.install(&desc).unwrap();
        assert!(dir.path().join("shard-3.snap").exists());
        let restored = store();
        snap::restore(&restored, desk.take(&desc).unwrap().reader().unwrap()).unwrap();
        assert_eq!(restored.get(b"k9").unwrap(), s.get(b"k9").unwrap());
        // Out of order: refused, and the next must start again at 0.
        desk.receive(2, 13, 0, &bytes[..100], false).unwrap();
        assert!(desk.receive(2, 13, 200, &bytes[200..300], false).is_err());
        assert!(desk.receive(2, 13, 100, &bytes[100..200], false).is_err(), "dropped");
        assert!(desk.receive(3, 14, 0, &bytes[..10], false).is_ok());
        assert!(desk.receive(2, 14, 10, &bytes[10..20], false).is_err(), "from another node");
        // A part of the stream that was replaced changes nothing: the
        // current one goes on.
        assert!(desk.receive(2, 13, 100, &bytes[100..200], false).is_err(), "replaced");
        assert!(matches!(desk.receive(3, 14, 10, &bytes[10..20], false), Ok(Taken::More(20))), "still receiving");
        // Past the bound.
        let small = Desk::memory(3, 1000);
        assert!(small.receive(2, 1, 0, &bytes[..900], false).is_ok());
        assert!(small.receive(2, 1, 900, &bytes[900..1100], false).unwrap_err().contains("larger"));
        // Nothing left behind but the saved file.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(names.len() <= 2, "{names:?}");
    }

    /// Finding 3: a save of an older point finishing after an install of a
    /// newer one, and a save begun before a reset, do not replace what is
    /// there (raft-rs would refuse to start on a log cut past the file).
    #[test]
    fn an_older_save_or_one_from_before_a_reset_never_replaces_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let s = store();
        s.put(b"k", b"old").unwrap();
        let desk = Arc::new(Desk::durable(dir.path(), 1, 1 << 30).unwrap());
        // A save at 10 is slow; meanwhile a snapshot at 50 is installed.
        let old_view = s.view().unwrap();
        s.put(b"k", b"new").unwrap();
        let newer = stream(&s, Point { index: 50, term: 2 });
        let d = Desk::memory(1, 1 << 30);
        let Taken::Whole(data) = d.receive(2, 5, 0, &newer, true).unwrap() else { panic!() };
        let desc = Descriptor { id: 5, at: Point { index: 50, term: 2 } };
        // Received on the durable desk.
        let Taken::Whole(fdata) = desk.receive(2, 5, 0, &newer, true).unwrap() else { panic!() };
        drop(data);
        desk.received(desc, fdata);
        desk.install(&desc).unwrap();
        let r = desk.save(old_view, RememberedParts::default(), Point { index: 10, term: 1 }).recv().unwrap();
        assert!(r.as_ref().is_err_and(|e| e.contains("superseded")), "the older save is refused: {r:?}");
        let (_, f) = desk.saved().unwrap().unwrap();
        assert_eq!(snap::Decoder::new(f).unwrap().at.index, 50, "the newer file stays");
        // A save begun before a reset (replace-replica) lands nowhere.
        let files = desk.files.as_ref().unwrap();
        let generation = lock(&files.state).generation;
        let tmp = files.temp("save-test");
        std::fs::write(&tmp, stream(&s, Point { index: 60, term: 2 })).unwrap();
        desk.reset().unwrap();
        assert!(desk.saved().unwrap().is_none(), "reset removes the file");
        assert!(!files.install(&tmp, Point { index: 60, term: 2 }, generation).unwrap());
        assert!(desk.saved().unwrap().is_none() && !tmp.exists());
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(names.len() <= 1, "no leftovers: {names:?}");
    }
}

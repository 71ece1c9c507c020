//! The index as the server keeps it: a directory of segments, mirrored
//! into the region for one-sided readers, and its growth a segment at a
//! time (extendible hashing, `dmkv_common::layout`).
//!
//! The server never reads the region's index back for its own decisions:
//! it keeps a private copy of every word it stores there (directory
//! entries as segment ids, every bucket word of every segment). Lock-free
//! lookups read that copy under an epoch guard; the writer changes it
//! under the writer lock.
//!
//! A split of segment S (depth L) into S0 and S1 (depth L+1), under the
//! writer lock (docs/one-sided.md has the readers' side):
//! 1. take two segments (retired ones past their grace period first, else
//!    fresh space from the allocator); clear their slots;
//! 2. copy each of S's slots to the half that serves its key, at the same
//!    bucket and slot, then write the halves' bucket headers;
//! 3. point the directory entries that named S at the halves;
//! 4. zero S's bucket headers: it serves nothing now. Its slots stay as
//!    they were (frozen), so a reader that read S's header before step 4
//!    finds what S held then.
//! 5. S is reused, as a segment again, only after every server lookup that
//!    may hold it has unpinned and the grace period has passed.

use std::collections::VecDeque;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use crossbeam_epoch as epoch;
use dmkv_common::error::Error;
use dmkv_common::layout::{self, BucketHeader, DirEntry, KeyHash, SEGMENT_UNITS, Slot, key_hash};
use dmkv_common::limits::{BUCKET_LEN, MAX_KEY_LEN, SEGMENT_BUCKETS, SLOTS_PER_BUCKET, UNIT, WORDS_PER_BUCKET};
use tracing::debug;

use super::{Store, Writer};
use crate::lock::lock;

/// Words of a segment: every bucket's header and slots.
pub const SEGMENT_WORDS: usize = SEGMENT_BUCKETS * WORDS_PER_BUCKET;
/// Most splits one write may make before giving up with INDEX_FULL: each
/// halves the keys sharing its segment, so needing more means the key's
/// buckets are full of keys whose hashes agree in many more bits than
/// chance would have (or the directory is at its deepest).
pub const MAX_SPLITS_PER_WRITE: usize = 4;

/// One segment as the server last wrote it.
pub struct Seg {
    /// Offset in units; a segment never moves.
    pub at: u64,
    /// Serves keys now (false: retired or in the pool).
    pub live: AtomicBool,
    words: Box<[AtomicU64]>,
}

impl Seg {
    /// Word `w` of bucket `b` (0 is the header, 1.. the slots).
    pub fn word(&self, b: usize, w: usize) -> u64 {
        // Acquire: pairs with the writer's release, so what a slot points
        // to is fully written before a lookup reads it.
        self.words[b * WORDS_PER_BUCKET + w].load(Ordering::Acquire)
    }

    /// Slot `i` of bucket `b`.
    pub fn slot(&self, b: usize, i: usize) -> u64 {
        self.word(b, i + 1)
    }

    /// Region offset of word `w` of bucket `b`.
    pub fn word_offset(&self, b: usize, w: usize) -> u64 {
        self.at * UNIT as u64 + (b * BUCKET_LEN + 8 * w) as u64
    }

    /// Every word, by position (bucket-major): for scans.
    pub fn words(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.words.iter().map(|w| w.load(Ordering::Acquire)).enumerate()
    }
}

/// What the writer alone knows of a segment.
#[derive(Debug, Clone, Copy)]
pub struct SegMeta {
    pub depth: u8,
    pub suffix: u32,
    pub tag: u32,
}

/// Segments per chunk of the server's segment table (allocated as needed,
/// so a large region's table costs memory only as its index grows).
const CHUNK: usize = 1024;

/// One chunk of the segment table.
type Chunk = Box<[OnceLock<Seg>]>;

/// The index's shared part: read by lock-free lookups.
pub struct Index {
    /// Segment id per directory entry.
    dir: Box<[AtomicU32]>,
    /// Segments by id, in chunks; ids are handed out in order and never
    /// freed.
    segs: Box<[OnceLock<Chunk>]>,
    capacity: usize,
    pub dir_depth: u64,
}

/// The index's writer-only part (inside the writer lock).
pub struct IndexWriter {
    pub meta: Vec<SegMeta>,
    /// Retired segments past their epoch, oldest first, waiting out the
    /// grace period: (segment, retired at, retirement's number).
    waiting: VecDeque<(u32, Instant, u64)>,
    /// Retired segments ready for reuse.
    pool: Vec<u32>,
    next_tag: u32,
    pub live: u64,
    pub splits: u64,
    /// Deepest local depth of any live segment.
    pub max_depth: u8,
}

impl Index {
    /// An index with room for `capacity` segments and 2^`dir_depth`
    /// directory entries.
    pub fn new(capacity: usize, dir_depth: u64) -> Index {
        Index {
            dir: (0..1usize << dir_depth).map(|_| AtomicU32::new(0)).collect(),
            segs: (0..capacity.div_ceil(CHUNK)).map(|_| OnceLock::new()).collect(),
            capacity,
            dir_depth,
        }
    }

    fn slot_of(&self, id: usize) -> Option<&OnceLock<Seg>> {
        self.segs.get(id / CHUNK)?.get().map(|c| &c[id % CHUNK])
    }

    /// Creates segment `id` (the next one). Writer only.
    fn create(&self, id: usize, seg: Seg) {
        let chunk = self.segs[id / CHUNK].get_or_init(|| (0..CHUNK).map(|_| OnceLock::new()).collect());
        assert!(chunk[id % CHUNK].set(seg).is_ok(), "segment ids are handed out once");
    }

    /// The segment serving `kh` now (the caller holds an epoch guard, so a
    /// segment retired meanwhile is not reused under it).
    pub fn segment(&self, kh: &KeyHash) -> (u32, &Seg) {
        let id = self.dir[kh.dir_index(self.dir_depth) as usize].load(Ordering::Acquire);
        (id, self.seg(id))
    }

    /// Segment `id`.
    pub fn seg(&self, id: u32) -> &Seg {
        self.slot_of(id as usize).and_then(OnceLock::get).expect("directory names only created segments")
    }

    /// The segment of every directory entry, in directory order.
    pub fn directory(&self) -> impl Iterator<Item = u32> + '_ {
        self.dir.iter().map(|d| d.load(Ordering::Acquire))
    }

    /// Every segment created so far, with its id.
    pub fn all(&self) -> impl Iterator<Item = (u32, &Seg)> {
        (0..self.capacity).map_while(|id| Some((id as u32, self.slot_of(id)?.get()?)))
    }
}

impl IndexWriter {
    pub fn new() -> IndexWriter {
        IndexWriter {
            meta: Vec::new(),
            waiting: VecDeque::new(),
            pool: Vec::new(),
            next_tag: 1,
            live: 0,
            splits: 0,
            max_depth: 0,
        }
    }

    fn tag(&mut self) -> u32 {
        let t = self.next_tag;
        // Wraps after 2^25 segment incarnations; a reader would need to
        // hold a directory entry that long for a collision to matter.
        self.next_tag = (self.next_tag + 1) & ((1 << layout::TAG_BITS) - 1);
        if self.next_tag == 0 {
            self.next_tag = 1;
        }
        t
    }
}

impl Store {
    fn store_word(&self, seg: &Seg, b: usize, w: usize, v: u64) {
        self.region.store_slot(seg.word_offset(b, w), v);
        seg.words[b * WORDS_PER_BUCKET + w].store(v, Ordering::Release);
    }

    /// Publishes `v` as slot `i` of bucket `b` of `seg`, in the region and
    /// in the server's copy. Writer only.
    pub(super) fn set_slot(&self, seg: &Seg, b: usize, i: usize, v: u64) {
        self.store_word(seg, b, i + 1, v);
    }

    /// Points directory entry `d` at segment `id`, in the region and in the
    /// server's copy. Writer only.
    fn set_dir(&self, d: u64, id: u32, entry: DirEntry) {
        self.region.store_slot(self.header.dir_entry_offset(d), entry.pack());
        self.index.dir[d as usize].store(id, Ordering::Release);
    }

    fn entry_of(&self, w: &Writer, id: u32) -> DirEntry {
        DirEntry { offset_units: self.index.seg(id).at, tag: w.index.meta[id as usize].tag }
    }

    /// A segment to fill: one retired past its grace period, else new
    /// space. Its slots are clear; its headers say nothing yet.
    fn take_segment(&self, w: &mut Writer) -> Result<u32, Error> {
        let id = match w.index.pool.pop() {
            Some(id) => id,
            None => {
                let id = w.index.meta.len();
                if id >= self.index.capacity {
                    return Err(Error::IndexFull);
                }
                let at = w.alloc.alloc(SEGMENT_UNITS).ok_or(Error::OutOfMemory)?;
                let seg = Seg {
                    at,
                    live: AtomicBool::new(false),
                    words: (0..SEGMENT_WORDS).map(|_| AtomicU64::new(0)).collect(),
                };
                self.index.create(id, seg);
                w.index.meta.push(SegMeta { depth: 0, suffix: 0, tag: 0 });
                self.counters.index_bytes.fetch_add((SEGMENT_UNITS * UNIT) as u64, Ordering::Relaxed);
                // Fresh space may hold an old item's bytes: clear it all
                // (no reader has an entry for it, so no order matters).
                self.region.write(at * UNIT as u64, &[0u8; SEGMENT_UNITS * UNIT]);
                return Ok(id as u32);
            }
        };
        // A pooled segment's words are its frozen old slots (its headers
        // are zero since it retired): clear all of it, in the region too
        // (whatever else may have been written there), before any header
        // says it serves keys again.
        let seg = self.index.seg(id);
        self.region.write(seg.at * UNIT as u64, &[0u8; SEGMENT_UNITS * UNIT]);
        for w in seg.words.iter() {
            w.store(0, Ordering::Release);
        }
        Ok(id)
    }

    /// Makes segment `id` serve (depth, suffix) under a new tag: writes its
    /// bucket headers. Its slots must be in place already.
    fn open_segment(&self, w: &mut Writer, id: u32, depth: u8, suffix: u32) {
        let tag = w.index.tag();
        w.index.meta[id as usize] = SegMeta { depth, suffix, tag };
        let seg = self.index.seg(id);
        let h = BucketHeader { depth, suffix, tag }.pack();
        for b in 0..SEGMENT_BUCKETS {
            self.store_word(seg, b, 0, h);
        }
        seg.live.store(true, Ordering::Release);
        w.index.live += 1;
        w.index.max_depth = w.index.max_depth.max(depth);
    }

    /// Lays out the first `n` segments (a power of two) and the directory.
    pub(super) fn format_index(&self, w: &mut Writer, n: u64) -> Result<(), Error> {
        let depth = n.trailing_zeros() as u8;
        let ids = (0..n).map(|_| self.take_segment(w)).collect::<Result<Vec<_>, _>>()?;
        for (suffix, &id) in ids.iter().enumerate() {
            self.open_segment(w, id, depth, suffix as u32);
        }
        for d in 0..self.header.dir_entries() {
            let id = ids[(d & (n - 1)) as usize];
            self.set_dir(d, id, self.entry_of(w, id));
        }
        Ok(())
    }

    /// Splits segment `id` in two (see the module's comment). On an error
    /// nothing changed.
    pub(super) fn split(&self, w: &mut Writer, id: u32, guard: &epoch::Guard) -> Result<(), Error> {
        let SegMeta { depth, suffix, .. } = w.index.meta[id as usize];
        if u64::from(depth) >= self.header.dir_depth {
            return Err(Error::IndexFull);
        }
        let first = self.take_segment(w)?;
        let second = match self.take_segment(w) {
            Ok(s) => s,
            Err(e) => {
                w.index.pool.push(first);
                return Err(e);
            }
        };
        let old = self.index.seg(id);
        let halves = [self.index.seg(first), self.index.seg(second)];
        let mut buf = Vec::new();
        for b in 0..SEGMENT_BUCKETS {
            for i in 0..SLOTS_PER_BUCKET {
                let word = old.slot(b, i);
                let Some(slot) = Slot::unpack(word) else { continue };
                // The key decides the half; an item whose header is not
                // sound, or whose key's fingerprint is not the slot's (the
                // region was written behind the server's back), is dropped
                // here as a write would drop it (`find_for_write`). It stays
                // in the frozen old segment; retired so its space comes back.
                match self.key_of(slot, &mut buf) {
                    Some(kh) if kh.fingerprint == slot.fingerprint => {
                        let half = (kh.dir_hash >> depth) & 1;
                        self.set_slot(halves[half as usize], b, i, word);
                    }
                    _ => {
                        self.counters.items.fetch_sub(1, Ordering::Relaxed);
                        self.retire(slot, guard);
                    }
                }
            }
        }
        self.open_segment(w, first, depth + 1, suffix);
        self.open_segment(w, second, depth + 1, suffix | 1 << depth);
        let entries = [self.entry_of(w, first), self.entry_of(w, second)];
        let step = 1u64 << depth;
        let mut d = u64::from(suffix);
        while d < self.header.dir_entries() {
            let half = ((d >> depth) & 1) as usize;
            self.set_dir(d, [first, second][half], entries[half]);
            d += step;
        }
        for b in 0..SEGMENT_BUCKETS {
            self.store_word(old, b, 0, 0);
        }
        old.live.store(false, Ordering::Release);
        w.index.live -= 1;
        w.index.splits += 1;
        self.counters.index_splits.fetch_add(1, Ordering::Relaxed);
        let done = std::sync::Arc::clone(&self.segs_done);
        let seq = self.retire_seq.fetch_add(1, Ordering::AcqRel);
        let at = Instant::now();
        guard.defer(move || lock(&done).push((id, at, seq)));
        debug!(segment = id, depth, suffix, "index segment split");
        Ok(())
    }

    /// The key hash of the item of `slot`, reading only its header and key
    /// (a split reads every item of the segment under the writer lock, so
    /// not their values: at most 480 × 1 KiB). Writer only: items of its
    /// own index never change while linked. `None` if the header cannot
    /// be the slot's item.
    pub(super) fn key_of(&self, slot: Slot, buf: &mut Vec<u8>) -> Option<KeyHash> {
        buf.resize(layout::ITEM_HEADER_LEN, 0);
        self.region.try_read(slot.offset(), buf).ok()?;
        let key_len = u32::from_le_bytes(buf[16..20].try_into().expect("4 bytes")) as usize;
        if key_len == 0 || key_len > MAX_KEY_LEN || layout::ITEM_HEADER_LEN + key_len > slot.len() {
            return None;
        }
        buf.resize(key_len, 0);
        self.region.try_read(slot.offset() + layout::ITEM_HEADER_LEN as u64, buf).ok()?;
        Some(key_hash(buf, self.header.hash_seed))
    }

    /// Puts back directory entry `d` in the region if it differs from the
    /// server's (one-sided readers would otherwise fall back to RPC for
    /// every key of it). Writer only.
    pub(super) fn audit_dir(&self, w: &Writer, kh: &KeyHash) {
        let d = kh.dir_index(self.header.dir_depth);
        let id = self.index.dir[d as usize].load(Ordering::Acquire);
        let own = self.entry_of(w, id).pack();
        let off = self.header.dir_entry_offset(d);
        if self.region.load_slot(off) != own {
            self.counters.foreign_slots.fetch_add(1, Ordering::Relaxed);
            self.region.store_slot(off, own);
        }
    }

    /// Whether any segment lies in `range` (units). Writer only (segments
    /// are made under the writer lock).
    pub(super) fn segment_in(&self, range: &std::ops::Range<u64>) -> bool {
        self.index.all().any(|(_, s)| s.at < range.end && s.at + SEGMENT_UNITS as u64 > range.start)
    }

    /// Moves retired segments past their epoch and grace period to the
    /// pool. Writer only.
    pub(super) fn reclaim_segments(&self, w: &mut Writer, hold: u64) {
        {
            let mut done = lock(&self.segs_done);
            if !done.is_empty() {
                done.sort_by_key(|&(_, _, seq)| seq);
                w.index.waiting.extend(done.drain(..));
            }
        }
        // A view walks the segments of its directory, split or not.
        while let Some(&(id, since, seq)) = w.index.waiting.front() {
            if since.elapsed() < self.grace || seq >= hold {
                break;
            }
            w.index.pool.push(id);
            w.index.waiting.pop_front();
        }
    }

    /// Starts (in units) of every segment ever made, sorted: they never
    /// move, so compaction plans around them.
    pub fn segment_starts(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.index.all().map(|(_, s)| s.at).collect();
        v.sort_unstable();
        v
    }
}

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

use dmkv_common::layout::{self, KeyHash};
use dmkv_common::limits::{BUCKET_LEN, SEGMENT_BUCKETS, UNIT, WORDS_PER_BUCKET};

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
    pub(super) words: Box<[AtomicU64]>,
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
pub(super) const CHUNK: usize = 1024;

/// One chunk of the segment table.
type Chunk = Box<[OnceLock<Seg>]>;

/// The index's shared part: read by lock-free lookups.
pub struct Index {
    /// Segment id per directory entry.
    pub(super) dir: Box<[AtomicU32]>,
    /// Segments by id, in chunks; ids are handed out in order and never
    /// freed.
    pub(super) segs: Box<[OnceLock<Chunk>]>,
    pub(super) capacity: usize,
    pub dir_depth: u64,
}

/// The index's writer-only part (inside the writer lock).
pub struct IndexWriter {
    pub meta: Vec<SegMeta>,
    /// Retired segments past their epoch, oldest first, waiting out the
    /// grace period: (segment, retired at, retirement's number).
    pub(super) waiting: VecDeque<(u32, Instant, u64)>,
    /// Retired segments ready for reuse.
    pub(super) pool: Vec<u32>,
    pub(super) next_tag: u32,
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

    pub(super) fn slot_of(&self, id: usize) -> Option<&OnceLock<Seg>> {
        self.segs.get(id / CHUNK)?.get().map(|c| &c[id % CHUNK])
    }

    /// Creates segment `id` (the next one). Writer only.
    pub(super) fn create(&self, id: usize, seg: Seg) {
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

    pub(super) fn tag(&mut self) -> u32 {
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

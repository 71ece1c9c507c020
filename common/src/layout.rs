//! The remote-memory layout: what every byte of a server's region means.
//!
//! A region is a header page, the index directory, and a data area of
//! 64-byte units that holds items and the index's segments:
//!
//! ```text
//! 0            HEADER_LEN        data_offset                       region_len
//! | header ... | directory ...   | item | segment | item | ...  free |
//! ```
//!
//! * The **index** is extendible hashing: a directory of 2^`dir_depth`
//!   8-byte entries, each naming the **segment** (32 buckets, 4 KiB, taken
//!   from the data area like an item) that serves the keys whose hash ends
//!   in that entry's index. A segment of local depth L serves every key
//!   whose hash's low L bits are its suffix, so 2^(dir_depth - L) entries
//!   name it. A full segment splits into two of depth L+1: the index grows
//!   a segment at a time, while readers keep reading (docs/one-sided.md).
//! * A **bucket** (128 bytes) is a header word, saying which keys the
//!   segment serves (depth, suffix) and which incarnation of it this is,
//!   then fifteen slots. A reader checks the header against its key in the
//!   same read as the slots, so a stale directory entry is detected there.
//! * A **slot** (8 bytes) packs a 16-bit key fingerprint, the item's length
//!   in units (15 bits) and its offset in units (33 bits), so one 8-byte
//!   atomic store publishes, replaces or removes an item. Zero is the empty
//!   slot; no item lives at offset 0.
//! * An **item** is a 32-byte header (checksum, version, key length, value
//!   length, client flags, expiry), the key, the value, and zero padding to
//!   a whole unit. The expiry is a unix second (0: never) judged against
//!   the server's clock, which the header page publishes at
//!   [`CLOCK_OFFSET`] (see [`crate::expiry`]).
//!   The checksum (xxh3-64) covers every meaningful byte after it, so a
//!   reader that raced a writer, or read space since reused by another key,
//!   sees a mismatch rather than wrong data.
//!
//! Server and clients use these same functions, so there is one definition.

use xxhash_rust::xxh3::{xxh3_64, xxh3_128_with_seed};

use crate::error::LayoutError;
use crate::limits::{
    BUCKET_LEN, MAX_DIRECTORY_DEPTH, MAX_KEY_LEN, MAX_REGION_LEN, MAX_VALUE_LEN, SEGMENT_BUCKETS, SEGMENT_LEN,
    SLOTS_PER_BUCKET, UNIT, WORDS_PER_BUCKET,
};

/// "DMKVREG1" read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"DMKVREG1");
/// Version of this layout. A reader refuses any other.
pub const LAYOUT_VERSION: u32 = 5;
/// Bytes reserved for the header at the start of a region (one page, so the
/// directory starts page-aligned).
pub const HEADER_LEN: usize = 4096;
/// Bytes of the header that carry data (the rest of the page is zero).
pub const HEADER_ENCODED_LEN: usize = 96;
/// Byte offset of the epoch within the header: one aligned 8-byte word, so
/// a reader can check it with a single atomic load.
pub const EPOCH_OFFSET: u64 = 16;
/// Length of the item header.
pub const ITEM_HEADER_LEN: usize = 32;
/// Largest item, in units: header, maximum key and maximum value.
pub const MAX_ITEM_UNITS: usize = (ITEM_HEADER_LEN + MAX_KEY_LEN + MAX_VALUE_LEN).div_ceil(UNIT);
/// Units of one index segment.
pub const SEGMENT_UNITS: usize = SEGMENT_LEN / UNIT;

const SLOT_OFFSET_BITS: u32 = 33;
const SLOT_UNITS_BITS: u32 = 15;
const SLOT_OFFSET_MASK: u64 = (1 << SLOT_OFFSET_BITS) - 1;
const SLOT_UNITS_MASK: u64 = (1 << SLOT_UNITS_BITS) - 1;
const _: () = assert!(MAX_ITEM_UNITS as u64 <= SLOT_UNITS_MASK);
const _: () = assert!(HEADER_ENCODED_LEN <= HEADER_LEN);
const _: () = assert!(SEGMENT_BUCKETS.is_power_of_two() && SEGMENT_BUCKETS <= 1 << 8);

/// The parameters a region is laid out by, as written in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionHeader {
    /// Bumped every time the region is (re-)registered; stale readers fail.
    pub epoch: u64,
    /// The directory has 2^`dir_depth` entries: the deepest a segment can
    /// get, so the most the index can grow to.
    pub dir_depth: u64,
    /// Seed of the key hash.
    pub hash_seed: u64,
    /// Byte offset of directory entry 0.
    pub index_offset: u64,
    /// Byte offset of the data area; a multiple of [`UNIT`].
    pub data_offset: u64,
    /// Length of the data area in bytes; a multiple of [`UNIT`].
    pub data_len: u64,
    /// Length of the whole region in bytes.
    pub region_len: u64,
    /// How long a retired item stays intact before its space is reused.
    /// A one-sided GET whose reads span longer than this must retry.
    pub grace_nanos: u64,
}

/// The directory depth a data area of `data_len` bytes gets: room for
/// twice as many entries as segments could ever fit, so that uneven
/// splits (some segments one level deeper than the rest) still find room.
pub fn directory_depth_for(data_len: u64) -> u32 {
    let segments = (data_len / SEGMENT_LEN as u64).max(1);
    (segments.next_power_of_two().trailing_zeros() + 1).min(MAX_DIRECTORY_DEPTH)
}

impl RegionHeader {
    /// Lays out a region of `region_len` bytes whose index starts with
    /// `initial_segments` segments (a power of two, at most the directory).
    pub fn plan(
        region_len: u64,
        initial_segments: u64,
        hash_seed: u64,
        epoch: u64,
        grace_nanos: u64,
    ) -> Result<Self, LayoutError> {
        if initial_segments == 0 || !initial_segments.is_power_of_two() {
            return Err(LayoutError::OutOfRange { field: "initial_segments", value: initial_segments });
        }
        if region_len > MAX_REGION_LEN {
            return Err(LayoutError::OutOfRange { field: "region_len", value: region_len });
        }
        let index_offset = HEADER_LEN as u64;
        // The directory is sized for the whole region, then the data area
        // is what is left (a little less than assumed: fine, it only needs
        // to be at least as deep as the data area asks for).
        let dir_depth = directory_depth_for(region_len.saturating_sub(index_offset));
        if initial_segments.trailing_zeros() > dir_depth {
            return Err(LayoutError::OutOfRange { field: "initial_segments", value: initial_segments });
        }
        let dir_len = 8u64 << dir_depth;
        let data_offset = (index_offset + dir_len).next_multiple_of(HEADER_LEN as u64);
        // The first segments and at least one maximum item must fit, or
        // the region is useless.
        let min_len = data_offset + initial_segments * SEGMENT_LEN as u64 + (MAX_ITEM_UNITS * UNIT) as u64;
        if region_len < min_len {
            return Err(LayoutError::OutOfRange { field: "region_len", value: region_len });
        }
        let data_len = (region_len - data_offset) / UNIT as u64 * UNIT as u64;
        let h = RegionHeader {
            epoch,
            dir_depth: u64::from(dir_depth),
            hash_seed,
            index_offset,
            data_offset,
            data_len,
            region_len,
            grace_nanos,
        };
        h.validate()?;
        Ok(h)
    }

    /// Checks that the header describes a consistent region.
    pub fn validate(&self) -> Result<(), LayoutError> {
        let bad = |field, value| Err(LayoutError::OutOfRange { field, value });
        if self.dir_depth > u64::from(MAX_DIRECTORY_DEPTH) {
            return bad("dir_depth", self.dir_depth);
        }
        if self.region_len > MAX_REGION_LEN {
            return bad("region_len", self.region_len);
        }
        if self.index_offset < HEADER_LEN as u64 || !self.index_offset.is_multiple_of(8) {
            return bad("index_offset", self.index_offset);
        }
        let index_end = (8u64 << self.dir_depth).checked_add(self.index_offset);
        match index_end {
            Some(end) if end <= self.data_offset => {}
            _ => return bad("dir_depth", self.dir_depth),
        }
        if !self.data_offset.is_multiple_of(UNIT as u64) || !self.data_len.is_multiple_of(UNIT as u64) {
            return bad("data_offset", self.data_offset);
        }
        match self.data_offset.checked_add(self.data_len) {
            Some(end) if end <= self.region_len => Ok(()),
            _ => bad("data_len", self.data_len),
        }
    }

    /// Number of directory entries.
    pub fn dir_entries(&self) -> u64 {
        1 << self.dir_depth
    }

    /// Byte offset of directory entry `d`.
    pub fn dir_entry_offset(&self, d: u64) -> u64 {
        debug_assert!(d < self.dir_entries());
        self.index_offset + 8 * d
    }

    /// Whether `[offset, offset+len)` lies inside the data area.
    pub fn in_data_area(&self, offset: u64, len: u64) -> bool {
        offset >= self.data_offset && offset.checked_add(len).is_some_and(|end| end <= self.data_offset + self.data_len)
    }

    /// Encodes the header into its first [`HEADER_ENCODED_LEN`] bytes.
    pub fn encode(&self) -> [u8; HEADER_ENCODED_LEN] {
        let mut b = [0u8; HEADER_ENCODED_LEN];
        b[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(HEADER_ENCODED_LEN as u32).to_le_bytes());
        let fields = [
            self.epoch,
            self.dir_depth,
            self.hash_seed,
            self.index_offset,
            self.data_offset,
            self.data_len,
            self.region_len,
            self.grace_nanos,
        ];
        for (i, f) in fields.iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&f.to_le_bytes());
        }
        let sum = xxh3_64(&b[..HEADER_ENCODED_LEN - 8]);
        b[HEADER_ENCODED_LEN - 8..].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Decodes and validates a header.
    pub fn decode(b: &[u8]) -> Result<Self, LayoutError> {
        if b.len() < HEADER_ENCODED_LEN {
            return Err(LayoutError::Truncated { need: HEADER_ENCODED_LEN, have: b.len() });
        }
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        if u64_at(0) != MAGIC {
            return Err(LayoutError::BadMagic);
        }
        let version = u32_at(8);
        if version != LAYOUT_VERSION {
            return Err(LayoutError::UnsupportedVersion(version));
        }
        if u32_at(12) as usize != HEADER_ENCODED_LEN {
            return Err(LayoutError::OutOfRange { field: "header_len", value: u32_at(12) as u64 });
        }
        if xxh3_64(&b[..HEADER_ENCODED_LEN - 8]) != u64_at(HEADER_ENCODED_LEN - 8) {
            return Err(LayoutError::Checksum);
        }
        let h = RegionHeader {
            epoch: u64_at(16),
            dir_depth: u64_at(24),
            hash_seed: u64_at(32),
            index_offset: u64_at(40),
            data_offset: u64_at(48),
            data_len: u64_at(56),
            region_len: u64_at(64),
            grace_nanos: u64_at(72),
        };
        h.validate()?;
        Ok(h)
    }
}

/// Bits of a segment's incarnation tag, in directory entries and bucket
/// headers. A segment's memory is reused only as a segment again, with a
/// new tag, so a reader holding an old directory entry can tell.
pub const TAG_BITS: u32 = 25;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;
const ENTRY_TAG_SHIFT: u32 = SLOT_OFFSET_BITS;
const ENTRY_VALID: u64 = 1 << 63;

/// A directory entry: which segment serves the keys of this index, and
/// which incarnation of it. The zero word is no entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DirEntry {
    /// Offset of the segment in units.
    pub offset_units: u64,
    /// Incarnation tag ([`TAG_BITS`] bits).
    pub tag: u32,
}

impl DirEntry {
    /// Packs the entry into its directory word.
    pub fn pack(self) -> u64 {
        debug_assert!(self.offset_units <= SLOT_OFFSET_MASK && u64::from(self.tag) <= TAG_MASK);
        ENTRY_VALID | ((u64::from(self.tag) & TAG_MASK) << ENTRY_TAG_SHIFT) | (self.offset_units & SLOT_OFFSET_MASK)
    }

    /// Unpacks a directory word; `None` for anything an entry cannot be
    /// (no valid bit, stray bits, offset 0).
    pub fn unpack(v: u64) -> Option<Self> {
        let known = ENTRY_VALID | (TAG_MASK << ENTRY_TAG_SHIFT) | SLOT_OFFSET_MASK;
        if v & ENTRY_VALID == 0 || v & !known != 0 || v & SLOT_OFFSET_MASK == 0 {
            return None;
        }
        Some(DirEntry { offset_units: v & SLOT_OFFSET_MASK, tag: ((v >> ENTRY_TAG_SHIFT) & TAG_MASK) as u32 })
    }

    /// Byte offset of the segment.
    pub fn offset(&self) -> u64 {
        self.offset_units * UNIT as u64
    }

    /// Byte offset of bucket `b` of the segment.
    pub fn bucket_offset(&self, b: u8) -> u64 {
        self.offset() + u64::from(b) * BUCKET_LEN as u64
    }
}

const HEADER_VALID: u64 = 1 << 63;
const HEADER_DEPTH_SHIFT: u32 = 32;
const HEADER_TAG_SHIFT: u32 = 38;

/// The header word of every bucket of a segment: the keys it serves
/// (those whose hash's low `depth` bits are `suffix`) and its incarnation.
/// The zero word marks a segment that serves nothing (retired, or never
/// one): a reader that finds it re-reads its directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketHeader {
    pub depth: u8,
    pub suffix: u32,
    pub tag: u32,
}

impl BucketHeader {
    /// Packs the header word.
    pub fn pack(self) -> u64 {
        debug_assert!(u32::from(self.depth) <= MAX_DIRECTORY_DEPTH && u64::from(self.tag) <= TAG_MASK);
        debug_assert!(self.depth >= 32 || self.suffix >> self.depth == 0);
        HEADER_VALID
            | ((u64::from(self.tag) & TAG_MASK) << HEADER_TAG_SHIFT)
            | (u64::from(self.depth) << HEADER_DEPTH_SHIFT)
            | u64::from(self.suffix)
    }

    /// Unpacks a header word; `None` for a retired segment or garbage.
    pub fn unpack(v: u64) -> Option<Self> {
        if v & HEADER_VALID == 0 {
            return None;
        }
        let depth = ((v >> HEADER_DEPTH_SHIFT) & 0x3f) as u8;
        let suffix = v as u32;
        if u32::from(depth) > MAX_DIRECTORY_DEPTH || (depth < 32 && suffix >> depth != 0) {
            return None;
        }
        Some(BucketHeader { depth, suffix, tag: ((v >> HEADER_TAG_SHIFT) & TAG_MASK) as u32 })
    }

    /// Whether this segment serves keys whose directory hash is `dir_hash`.
    pub fn serves(&self, dir_hash: u32) -> bool {
        low_bits(dir_hash, self.depth) == self.suffix
    }
}

/// The low `depth` bits of `h`.
pub fn low_bits(h: u32, depth: u8) -> u32 {
    if depth >= 32 { h } else { h & ((1u32 << depth) - 1) }
}

/// One index slot: where an item is and a fingerprint of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    /// 16 bits of the key's hash, to skip items of other keys cheaply.
    pub fingerprint: u16,
    /// Item length in units; at least 1.
    pub units: u16,
    /// Item offset in units from the start of the region; at least 1.
    pub offset_units: u64,
}

impl Slot {
    /// The value of an empty slot.
    pub const EMPTY: u64 = 0;

    /// A slot for an item at byte `offset` spanning `units` units.
    pub fn new(fingerprint: u16, offset: u64, units: usize) -> Self {
        assert!(offset.is_multiple_of(UNIT as u64) && offset > 0, "item offset {offset} not a non-zero unit multiple");
        assert!((1..=MAX_ITEM_UNITS).contains(&units), "item of {units} units");
        let offset_units = offset / UNIT as u64;
        assert!(offset_units <= SLOT_OFFSET_MASK, "offset {offset} beyond slot range");
        Slot { fingerprint, units: units as u16, offset_units }
    }

    /// Packs the slot into the 8 bytes stored in a bucket.
    pub fn pack(self) -> u64 {
        ((self.fingerprint as u64) << (SLOT_OFFSET_BITS + SLOT_UNITS_BITS))
            | ((self.units as u64 & SLOT_UNITS_MASK) << SLOT_OFFSET_BITS)
            | (self.offset_units & SLOT_OFFSET_MASK)
    }

    /// Unpacks a stored slot; `None` for an empty slot or one that cannot
    /// describe an item (zero length or offset).
    pub fn unpack(v: u64) -> Option<Self> {
        let s = Slot {
            fingerprint: (v >> (SLOT_OFFSET_BITS + SLOT_UNITS_BITS)) as u16,
            units: ((v >> SLOT_OFFSET_BITS) & SLOT_UNITS_MASK) as u16,
            offset_units: v & SLOT_OFFSET_MASK,
        };
        (s.units != 0 && s.offset_units != 0).then_some(s)
    }

    /// Byte offset of the item.
    pub fn offset(&self) -> u64 {
        self.offset_units * UNIT as u64
    }

    /// Byte length of the item (whole units).
    pub fn len(&self) -> usize {
        self.units as usize * UNIT
    }

    /// Always false: a slot describes at least one unit.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Where a key may live: its directory hash (which segment), its two
/// candidate buckets in that segment, and its fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHash {
    /// Low 32 bits of the hash: the directory index is its low bits.
    pub dir_hash: u32,
    /// The two candidate buckets within the segment (distinct).
    pub buckets: [u8; 2],
    pub fingerprint: u16,
}

impl KeyHash {
    /// The key's directory index in a directory of depth `dir_depth`.
    pub fn dir_index(&self, dir_depth: u64) -> u64 {
        u64::from(low_bits(self.dir_hash, dir_depth.min(32) as u8))
    }
}

/// Hashes `key`. The directory bits and the bucket bits are independent,
/// so a key keeps its buckets when its segment splits.
pub fn key_hash(key: &[u8], seed: u64) -> KeyHash {
    let h = xxh3_128_with_seed(key, seed);
    let hi = (h >> 64) as u64;
    let mask = SEGMENT_BUCKETS as u64 - 1;
    let b1 = (hi & mask) as u8;
    let mut b2 = ((hi >> 8) & mask) as u8;
    if b2 == b1 {
        b2 = b1 ^ 1;
    }
    KeyHash { dir_hash: h as u32, buckets: [b1, b2], fingerprint: (hi >> 48) as u16 }
}

/// The words of a bucket as read from the region (eight little-endian
/// u64s: the header, then the slots).
pub fn bucket_words(bucket: &[u8]) -> [u64; WORDS_PER_BUCKET] {
    assert_eq!(bucket.len(), BUCKET_LEN);
    std::array::from_fn(|i| u64::from_le_bytes(bucket[8 * i..8 * i + 8].try_into().expect("8 bytes")))
}

/// The slot words of a bucket as read from the region.
pub fn bucket_slots(bucket: &[u8]) -> [u64; SLOTS_PER_BUCKET] {
    let w = bucket_words(bucket);
    std::array::from_fn(|i| w[i + 1])
}

/// The occupied slots of `bucket` whose fingerprint is `fp`.
pub fn matching_slots(bucket: &[u8], fp: u16) -> impl Iterator<Item = Slot> {
    bucket_slots(bucket).into_iter().filter_map(Slot::unpack).filter(move |s| s.fingerprint == fp)
}

/// Length in units of an item with these key and value lengths.
pub fn item_units(key_len: usize, value_len: usize) -> usize {
    (ITEM_HEADER_LEN + key_len + value_len).div_ceil(UNIT)
}

/// A decoded, verified item borrowing from the buffer it was read into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemRef<'a> {
    pub version: u64,
    pub flags: u32,
    /// Unix second the item expires at; 0: never.
    pub expires_at: u32,
    pub key: &'a [u8],
    pub value: &'a [u8],
}

/// Appends the item to `out`, padded with zeros to whole units.
pub fn encode_item(key: &[u8], value: &[u8], version: u64, flags: u32, expires_at: u32, out: &mut Vec<u8>) {
    assert!(key.len() <= MAX_KEY_LEN && value.len() <= MAX_VALUE_LEN, "item exceeds limits");
    let start = out.len();
    out.extend_from_slice(&[0u8; 8]);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&expires_at.to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(value);
    let sum = xxh3_64(&out[start + 8..]);
    out[start..start + 8].copy_from_slice(&sum.to_le_bytes());
    out.resize(start + item_units(key.len(), value.len()) * UNIT, 0);
}

/// Decodes and verifies an item at the start of `b`.
///
/// Any torn, truncated or reused bytes give an error, never an item.
pub fn decode_item(b: &[u8]) -> Result<ItemRef<'_>, LayoutError> {
    if b.len() < ITEM_HEADER_LEN {
        return Err(LayoutError::Truncated { need: ITEM_HEADER_LEN, have: b.len() });
    }
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    let checksum = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
    let version = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
    let key_len = u32_at(16) as usize;
    let value_len = u32_at(20) as usize;
    let flags = u32_at(24);
    if key_len > MAX_KEY_LEN {
        return Err(LayoutError::OutOfRange { field: "key_len", value: key_len as u64 });
    }
    if value_len > MAX_VALUE_LEN {
        return Err(LayoutError::OutOfRange { field: "value_len", value: value_len as u64 });
    }
    let end = ITEM_HEADER_LEN + key_len + value_len;
    if b.len() < end {
        return Err(LayoutError::Truncated { need: end, have: b.len() });
    }
    if xxh3_64(&b[8..end]) != checksum {
        return Err(LayoutError::Checksum);
    }
    Ok(ItemRef {
        version,
        flags,
        expires_at: u32_at(28),
        key: &b[ITEM_HEADER_LEN..ITEM_HEADER_LEN + key_len],
        value: &b[ITEM_HEADER_LEN + key_len..end],
    })
}

/// Byte offset of the server's clock in the header page: one aligned
/// 8-byte word, the server's unix time in milliseconds (0: not published),
/// refreshed by the server every `CLOCK_INTERVAL` and never moving back.
/// It sits right after the lease block, so a cluster reader gets both in
/// one read. One-sided readers read it in every batch and judge item
/// expiry by it ([`crate::expiry::expired`]), as the server's own reads do.
pub const CLOCK_OFFSET: u64 = LEASE_OFFSET + LEASE_LEN as u64;
const _: () = assert!(CLOCK_OFFSET.is_multiple_of(8) && CLOCK_OFFSET as usize + 8 <= HEADER_LEN);

/// Byte offset of the lease block in the header page (cluster shards):
/// past the encoded header, on its own 48 bytes.
pub const LEASE_OFFSET: u64 = 128;
/// Length of the lease block: term, start, expiry, applied index,
/// placement version, check word.
pub const LEASE_LEN: usize = 48;
const _: () = assert!(HEADER_ENCODED_LEN as u64 <= LEASE_OFFSET && LEASE_OFFSET as usize + LEASE_LEN <= HEADER_LEN);
// The lease block and the clock word share one cache line: a reader's
// last read of a batch costs one line, not two.
const _: () = assert!(LEASE_OFFSET / 64 == (CLOCK_OFFSET + 7) / 64);

/// What a shard leader publishes in its region for one-sided readers: the
/// lease it holds (see `cluster::lease`). All zero: no lease.
///
/// Times are the leader node's `CLOCK_MONOTONIC` in nanoseconds: readers
/// on its host read the same clock, remote readers bound it
/// (`cluster::lease::ServerClock`), and a step of the wall clock moves
/// neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseBlock {
    /// The raft term the lease was granted in.
    pub term: u64,
    /// When this run of the lease began: its first publication since the
    /// leader last fenced, read after the store had applied every write
    /// acknowledged before the lease was granted. Renewals keep it.
    pub start_ns: u64,
    /// The lease's end.
    pub expiry_ns: u64,
    /// The index the leader had applied when it published this.
    pub applied: u64,
    /// The map version at which the shard's set of partitions last changed,
    /// as of `applied`: a reader that routed by an older map distrusts the
    /// batch (docs/elasticity.md).
    pub placement: u64,
}

impl LeaseBlock {
    /// The block's bytes; the check word covers the rest (and the region's
    /// hash seed), so a torn read, a mix of two writes, or a block copied
    /// from another region never decodes.
    pub fn encode(&self, hash_seed: u64) -> [u8; LEASE_LEN] {
        let mut b = [0u8; LEASE_LEN];
        b[0..8].copy_from_slice(&self.term.to_le_bytes());
        b[8..16].copy_from_slice(&self.start_ns.to_le_bytes());
        b[16..24].copy_from_slice(&self.expiry_ns.to_le_bytes());
        b[24..32].copy_from_slice(&self.applied.to_le_bytes());
        b[32..40].copy_from_slice(&self.placement.to_le_bytes());
        let check = lease_check(&b[..40], hash_seed);
        b[40..48].copy_from_slice(&check.to_le_bytes());
        b
    }

    /// The lease in `b`, if it holds one that checks out (`None` for the
    /// all-zero "no lease" block, anything torn, and short reads).
    pub fn decode(b: &[u8], hash_seed: u64) -> Option<LeaseBlock> {
        let b: &[u8; LEASE_LEN] = b.get(..LEASE_LEN)?.try_into().ok()?;
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if word(40) != lease_check(&b[..40], hash_seed) || word(0) == 0 {
            return None;
        }
        Some(LeaseBlock {
            term: word(0),
            start_ns: word(8),
            expiry_ns: word(16),
            applied: word(24),
            placement: word(32),
        })
    }
}

fn lease_check(b: &[u8], hash_seed: u64) -> u64 {
    // Never zero, so an all-zero block (no lease) never checks out.
    xxh3_128_with_seed(b, hash_seed ^ MAGIC) as u64 | 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_item() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, u64, u32, u32)> {
        (
            prop::collection::vec(any::<u8>(), 1..64),
            prop::collection::vec(any::<u8>(), 0..300),
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
        )
    }

    #[test]
    fn lease_blocks_round_trip_and_torn_ones_never_decode() {
        let l = LeaseBlock { term: 7, start_ns: 1_000_000_000, expiry_ns: 1_120_000_000, applied: 42, placement: 3 };
        let b = l.encode(99);
        assert_eq!(LeaseBlock::decode(&b, 99), Some(l));
        assert_eq!(LeaseBlock::decode(&b, 98), None, "another region's block");
        assert_eq!(LeaseBlock::decode(&[0u8; LEASE_LEN], 99), None, "no lease");
        assert_eq!(LeaseBlock::decode(&b[..LEASE_LEN - 1], 99), None, "short read");
        // Any one torn byte (from a later write with a longer lease).
        let later = LeaseBlock { expiry_ns: l.expiry_ns + 60_000_000, applied: 43, placement: 4, ..l }.encode(99);
        for i in 0..LEASE_LEN {
            let mut mixed = b;
            mixed[i] = later[i];
            if mixed != b && mixed != later {
                assert_eq!(LeaseBlock::decode(&mixed, 99), None, "byte {i}");
            }
        }
        // Any mix of whole words of the two.
        for mask in 1u32..63 {
            let mut mixed = b;
            for w in 0..6 {
                if mask & (1 << w) != 0 {
                    mixed[w * 8..w * 8 + 8].copy_from_slice(&later[w * 8..w * 8 + 8]);
                }
            }
            if mixed != b && mixed != later {
                assert_eq!(LeaseBlock::decode(&mixed, 99), None, "words {mask:b}");
            }
        }
    }

    proptest! {
        #[test]
        fn every_written_item_decodes_back((key, value, version, flags, expires_at) in arb_item()) {
            let mut buf = Vec::new();
            encode_item(&key, &value, version, flags, expires_at, &mut buf);
            prop_assert_eq!(buf.len(), item_units(key.len(), value.len()) * UNIT);
            let it = decode_item(&buf).unwrap();
            prop_assert_eq!(it, ItemRef { version, flags, expires_at, key: &key, value: &value });
        }

        #[test]
        fn every_single_bit_flip_is_detected((key, value, version, flags, expires_at) in arb_item(), pick in any::<prop::sample::Index>()) {
            let mut buf = Vec::new();
            encode_item(&key, &value, version, flags, expires_at, &mut buf);
            let meaningful = ITEM_HEADER_LEN + key.len() + value.len();
            let bit = pick.index(meaningful * 8);
            buf[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(decode_item(&buf).is_err());
        }

        #[test]
        fn every_truncation_is_detected((key, value, version, flags, expires_at) in arb_item(), pick in any::<prop::sample::Index>()) {
            let mut buf = Vec::new();
            encode_item(&key, &value, version, flags, expires_at, &mut buf);
            let meaningful = ITEM_HEADER_LEN + key.len() + value.len();
            let cut = pick.index(meaningful);
            prop_assert!(decode_item(&buf[..cut]).is_err());
        }

        #[test]
        fn slots_round_trip(fp in any::<u16>(), off in 1u64..(1 << 33), units in 1usize..=MAX_ITEM_UNITS) {
            let s = Slot::new(fp, off * UNIT as u64, units);
            let v = s.pack();
            prop_assert_ne!(v, Slot::EMPTY);
            prop_assert_eq!(Slot::unpack(v), Some(s));
        }

        #[test]
        fn header_round_trips_and_detects_flips(mib in 4u64..4096, bucket_pow in 0u32..8, seed in any::<u64>(), epoch in any::<u64>(), bit in 0usize..(HEADER_ENCODED_LEN * 8)) {
            let h = RegionHeader::plan(mib << 20, 1 << bucket_pow, seed, epoch, 1_000_000).unwrap();
            let mut enc = h.encode();
            prop_assert_eq!(RegionHeader::decode(&enc), Ok(h));
            enc[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(RegionHeader::decode(&enc).is_err());
        }

        /// Decoders see torn and arbitrary bytes all the time: they must
        /// never panic, only refuse.
        #[test]
        fn decoders_never_panic_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..400), lens in any::<(u32, u32)>()) {
            let _ = decode_item(&bytes);
            let _ = RegionHeader::decode(&bytes);
            let mut b = bytes.clone();
            b.resize(b.len().max(ITEM_HEADER_LEN), 0);
            b[16..20].copy_from_slice(&lens.0.to_le_bytes());
            b[20..24].copy_from_slice(&lens.1.to_le_bytes());
            prop_assert!(decode_item(&b).is_err() || b.len() >= ITEM_HEADER_LEN + lens.0 as usize + lens.1 as usize);
            for v in bytes.chunks_exact(8) {
                let v = u64::from_le_bytes(v.try_into().unwrap());
                let _ = Slot::unpack(v);
                let _ = DirEntry::unpack(v);
                let _ = BucketHeader::unpack(v);
            }
        }

        #[test]
        fn key_hash_buckets_are_distinct_and_in_range(key in prop::collection::vec(any::<u8>(), 1..40), seed in any::<u64>()) {
            let kh = key_hash(&key, seed);
            prop_assert!((kh.buckets[0] as usize) < SEGMENT_BUCKETS && (kh.buckets[1] as usize) < SEGMENT_BUCKETS);
            prop_assert_ne!(kh.buckets[0], kh.buckets[1]);
        }

        #[test]
        fn directory_entries_and_bucket_headers_round_trip(off in 1u64..(1 << 33), tag in 0u32..(1 << TAG_BITS), depth in 0u8..=32, h in any::<u32>()) {
            let e = DirEntry { offset_units: off, tag };
            prop_assert_eq!(DirEntry::unpack(e.pack()), Some(e));
            let b = BucketHeader { depth, suffix: low_bits(h, depth), tag };
            prop_assert_eq!(BucketHeader::unpack(b.pack()), Some(b));
            prop_assert!(b.serves(h));
            if depth > 0 {
                prop_assert!(!b.serves(h ^ (1 << (depth - 1))));
            }
        }
    }

    #[test]
    fn empty_and_degenerate_slots_unpack_to_none() {
        assert_eq!(Slot::unpack(0), None);
        assert_eq!(Slot::unpack(Slot::new(5, 64, 1).pack() & !SLOT_OFFSET_MASK), None);
    }

    #[test]
    fn plan_rejects_bad_parameters() {
        assert!(RegionHeader::plan(64 << 20, 3, 0, 0, 0).is_err());
        assert!(RegionHeader::plan(4096, 64, 0, 0, 0).is_err());
        // More first segments than the directory has entries.
        assert!(RegionHeader::plan(4 << 20, 1 << 20, 0, 0, 0).is_err());
        let h = RegionHeader::plan(64 << 20, 256, 0, 0, 0).unwrap();
        // 64 MiB: 16k segments could fit; the directory has room for twice that.
        assert_eq!(h.dir_depth, 15);
        assert!(h.data_offset >= h.index_offset + 8 * h.dir_entries());
        assert!(h.data_offset + h.data_len <= h.region_len);
    }

    #[test]
    fn unsupported_version_is_reported() {
        let h = RegionHeader::plan(64 << 20, 1024, 0, 0, 0).unwrap();
        let mut enc = h.encode();
        enc[8] = 9;
        assert_eq!(RegionHeader::decode(&enc), Err(LayoutError::UnsupportedVersion(9)));
    }
}

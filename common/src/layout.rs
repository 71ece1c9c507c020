//! The remote-memory layout: what every byte of a server's region means.
//!
//! A region is a header page, an index of 64-byte buckets, and a data area
//! of 64-byte units that holds items:
//!
//! ```text
//! 0            HEADER_LEN                   data_offset              region_len
//! | header ... | bucket 0 | bucket 1 | ... | item | item | ...  free |
//! ```
//!
//! * A **slot** (8 bytes, eight per bucket) packs a 16-bit key fingerprint,
//!   the item's length in units (15 bits) and its offset in units (33 bits),
//!   so one 8-byte atomic store publishes, replaces or removes an item.
//!   Zero is the empty slot; no item lives at offset 0.
//! * An **item** is a 32-byte header (checksum, version, key length, value
//!   length, flags), the key, the value, and zero padding to a whole unit.
//!   The checksum (xxh3-64) covers every meaningful byte after it, so a
//!   reader that raced a writer, or read space since reused by another key,
//!   sees a mismatch rather than wrong data.
//!
//! Server and clients use these same functions, so there is one definition.

use xxhash_rust::xxh3::{xxh3_64, xxh3_128_with_seed};

use crate::error::LayoutError;
use crate::limits::{BUCKET_LEN, MAX_KEY_LEN, MAX_REGION_LEN, MAX_VALUE_LEN, SLOTS_PER_BUCKET, UNIT};

/// "DMKVREG1" read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"DMKVREG1");
/// Version of this layout. A reader refuses any other.
pub const LAYOUT_VERSION: u32 = 1;
/// Bytes reserved for the header at the start of a region (one page, so the
/// index starts page-aligned).
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

const SLOT_OFFSET_BITS: u32 = 33;
const SLOT_UNITS_BITS: u32 = 15;
const SLOT_OFFSET_MASK: u64 = (1 << SLOT_OFFSET_BITS) - 1;
const SLOT_UNITS_MASK: u64 = (1 << SLOT_UNITS_BITS) - 1;
const _: () = assert!(MAX_ITEM_UNITS as u64 <= SLOT_UNITS_MASK);
const _: () = assert!(HEADER_ENCODED_LEN <= HEADER_LEN);

/// The parameters a region is laid out by, as written in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionHeader {
    /// Bumped every time the region is (re-)registered; stale readers fail.
    pub epoch: u64,
    /// Number of index buckets; a power of two.
    pub bucket_count: u64,
    /// Seed of the key hash.
    pub hash_seed: u64,
    /// Byte offset of bucket 0.
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

impl RegionHeader {
    /// Lays out a region of `region_len` bytes with `bucket_count` buckets.
    pub fn plan(
        region_len: u64,
        bucket_count: u64,
        hash_seed: u64,
        epoch: u64,
        grace_nanos: u64,
    ) -> Result<Self, LayoutError> {
        if bucket_count == 0 || !bucket_count.is_power_of_two() {
            return Err(LayoutError::OutOfRange { field: "bucket_count", value: bucket_count });
        }
        if region_len > MAX_REGION_LEN {
            return Err(LayoutError::OutOfRange { field: "region_len", value: region_len });
        }
        let index_offset = HEADER_LEN as u64;
        let index_len = bucket_count
            .checked_mul(BUCKET_LEN as u64)
            .ok_or(LayoutError::OutOfRange { field: "bucket_count", value: bucket_count })?;
        let data_offset = (index_offset + index_len).next_multiple_of(HEADER_LEN as u64);
        // At least one maximum item must fit, or the region is useless.
        let min_len = data_offset + (MAX_ITEM_UNITS * UNIT) as u64;
        if region_len < min_len {
            return Err(LayoutError::OutOfRange { field: "region_len", value: region_len });
        }
        let data_len = (region_len - data_offset) / UNIT as u64 * UNIT as u64;
        let h = RegionHeader {
            epoch,
            bucket_count,
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
        if self.bucket_count == 0 || !self.bucket_count.is_power_of_two() {
            return bad("bucket_count", self.bucket_count);
        }
        if self.region_len > MAX_REGION_LEN {
            return bad("region_len", self.region_len);
        }
        if self.index_offset < HEADER_LEN as u64 || !self.index_offset.is_multiple_of(BUCKET_LEN as u64) {
            return bad("index_offset", self.index_offset);
        }
        let index_end = self.bucket_count.checked_mul(BUCKET_LEN as u64).and_then(|l| l.checked_add(self.index_offset));
        match index_end {
            Some(end) if end <= self.data_offset => {}
            _ => return bad("bucket_count", self.bucket_count),
        }
        if !self.data_offset.is_multiple_of(UNIT as u64) || !self.data_len.is_multiple_of(UNIT as u64) {
            return bad("data_offset", self.data_offset);
        }
        match self.data_offset.checked_add(self.data_len) {
            Some(end) if end <= self.region_len => Ok(()),
            _ => bad("data_len", self.data_len),
        }
    }

    /// Byte offset of bucket `b`.
    pub fn bucket_offset(&self, b: u64) -> u64 {
        debug_assert!(b < self.bucket_count);
        self.index_offset + b * BUCKET_LEN as u64
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
            self.bucket_count,
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
            bucket_count: u64_at(24),
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

/// Where a key may live: two candidate buckets and its fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHash {
    pub buckets: [u64; 2],
    pub fingerprint: u16,
}

/// Hashes `key` for a region with `bucket_count` buckets (a power of two).
pub fn key_hash(key: &[u8], seed: u64, bucket_count: u64) -> KeyHash {
    debug_assert!(bucket_count.is_power_of_two());
    let h = xxh3_128_with_seed(key, seed);
    let mask = bucket_count - 1;
    let b1 = (h as u64) & mask;
    let hi = (h >> 64) as u64;
    let mut b2 = hi & mask;
    if b2 == b1 && bucket_count > 1 {
        b2 = b1 ^ 1;
    }
    KeyHash { buckets: [b1, b2], fingerprint: (hi >> 48) as u16 }
}

/// The slots of a bucket as read from the region (eight little-endian u64s).
pub fn bucket_slots(bucket: &[u8]) -> [u64; SLOTS_PER_BUCKET] {
    assert_eq!(bucket.len(), BUCKET_LEN);
    std::array::from_fn(|i| u64::from_le_bytes(bucket[8 * i..8 * i + 8].try_into().expect("8 bytes")))
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
    pub key: &'a [u8],
    pub value: &'a [u8],
}

/// Appends the item to `out`, padded with zeros to whole units.
pub fn encode_item(key: &[u8], value: &[u8], version: u64, flags: u32, out: &mut Vec<u8>) {
    assert!(key.len() <= MAX_KEY_LEN && value.len() <= MAX_VALUE_LEN, "item exceeds limits");
    let start = out.len();
    out.extend_from_slice(&[0u8; 8]);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
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
    if u32_at(28) != 0 {
        return Err(LayoutError::OutOfRange { field: "reserved", value: u32_at(28) as u64 });
    }
    Ok(ItemRef {
        version,
        flags,
        key: &b[ITEM_HEADER_LEN..ITEM_HEADER_LEN + key_len],
        value: &b[ITEM_HEADER_LEN + key_len..end],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_item() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, u64, u32)> {
        (
            prop::collection::vec(any::<u8>(), 1..64),
            prop::collection::vec(any::<u8>(), 0..300),
            any::<u64>(),
            any::<u32>(),
        )
    }

    proptest! {
        #[test]
        fn every_written_item_decodes_back((key, value, version, flags) in arb_item()) {
            let mut buf = Vec::new();
            encode_item(&key, &value, version, flags, &mut buf);
            prop_assert_eq!(buf.len(), item_units(key.len(), value.len()) * UNIT);
            let it = decode_item(&buf).unwrap();
            prop_assert_eq!(it, ItemRef { version, flags, key: &key, value: &value });
        }

        #[test]
        fn every_single_bit_flip_is_detected((key, value, version, flags) in arb_item(), pick in any::<prop::sample::Index>()) {
            let mut buf = Vec::new();
            encode_item(&key, &value, version, flags, &mut buf);
            let meaningful = ITEM_HEADER_LEN + key.len() + value.len();
            let bit = pick.index(meaningful * 8);
            buf[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(decode_item(&buf).is_err());
        }

        #[test]
        fn every_truncation_is_detected((key, value, version, flags) in arb_item(), pick in any::<prop::sample::Index>()) {
            let mut buf = Vec::new();
            encode_item(&key, &value, version, flags, &mut buf);
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
        fn header_round_trips_and_detects_flips(mib in 4u64..4096, bucket_pow in 6u32..14, seed in any::<u64>(), epoch in any::<u64>(), bit in 0usize..(HEADER_ENCODED_LEN * 8)) {
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
                let _ = Slot::unpack(u64::from_le_bytes(v.try_into().unwrap()));
            }
        }

        #[test]
        fn key_hash_buckets_are_distinct_and_in_range(key in prop::collection::vec(any::<u8>(), 1..40), seed in any::<u64>(), pow in 1u32..20) {
            let n = 1u64 << pow;
            let kh = key_hash(&key, seed, n);
            prop_assert!(kh.buckets[0] < n && kh.buckets[1] < n);
            prop_assert_ne!(kh.buckets[0], kh.buckets[1]);
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
        let h = RegionHeader::plan(64 << 20, 1024, 0, 0, 0).unwrap();
        assert!(h.data_offset >= h.index_offset + 1024 * 64);
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

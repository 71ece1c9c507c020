//! The one-sided GET protocol as a pure state machine: it says which bytes
//! of a region to read and judges what came back. No IO and no clock: the
//! caller posts the reads on whatever backend it has (shared memory, the
//! TCP engine, RDMA) and passes the time in, so the protocol is tested
//! deterministically against simulated regions that tear and reuse.
//!
//! A GET is:
//! 0. find the key's segment in the caller's copy of the directory (read
//!    its entry first if the copy lacks it: [`dir_read`]);
//! 1. read both candidate buckets in one batch (plus, for a hot key with a
//!    cached address, the item itself, so a hit takes one round trip), and
//!    check that the segment still serves the key (its bucket headers):
//!    if not, the directory entry was stale ([`AfterBuckets::Stale`]);
//! 2. pick the slots whose fingerprint matches and read exactly those items
//!    in one batch;
//! 3. verify checksum and key. Bytes that fail verification are never
//!    returned: the caller retries a bounded number of times, then asks the
//!    server over RPC;
//! 4. judge expiry by the server's clock, read from the region header in
//!    the same batch as the item and after it ([`clock_read`]): an item
//!    whose expiry the clock has reached is a miss, as on the server.
//!
//! Safety argument (see docs/one-sided.md): an item is fully written before
//! the release store that publishes its slot, and its space is reused only
//! after the region's grace period has passed since it was unlinked. A
//! reader that saw the slot and finished reading the item within the grace
//! period therefore read the intact item that was current when it read the
//! slot. Readers that take longer give up the attempt ([`Retry::Slow`]);
//! the checksum and key check catch every tear or reuse regardless.

use std::ops::Range;

use crate::layout::{
    BucketHeader, DirEntry, ITEM_HEADER_LEN, KeyHash, RegionHeader, SEGMENT_UNITS, Slot, bucket_words, decode_item,
    key_hash,
};
use crate::limits::{BUCKET_LEN, SLOTS_PER_BUCKET};

/// Most one-sided attempts of one GET before it goes over RPC.
pub const MAX_ATTEMPTS: usize = 4;
/// Most keys in one batch of a one-sided multi-get (up to three reads each).
pub const MAX_BATCH_KEYS: usize = 256;
/// A batch should take at most this share of the grace period, so that a
/// reader's attempt finishes inside it with room for a slower round.
const BATCH_GRACE_SHARE: u64 = 4;

/// How many keys the next batch of a multi-get should carry, after a batch
/// of `keys` keys took `elapsed` ns against a grace period of `grace` ns.
///
/// An attempt that outlasts the grace period is abandoned ([`Retry::Slow`])
/// however correct its bytes, so a batch too large for the transport's
/// speed (an emulated NIC, a congested link) would fail every attempt of
/// every key in it and send them all over RPC. The batch is sized to take
/// a quarter of the grace period at the speed just measured, growing back at
/// most twofold per batch.
pub fn next_batch_keys(keys: usize, elapsed: u64, grace: u64) -> usize {
    let keys = keys.clamp(1, MAX_BATCH_KEYS);
    let budget = grace / BATCH_GRACE_SHARE;
    let fit = (keys as u64).saturating_mul(budget).checked_div(elapsed).unwrap_or(u64::MAX);
    (fit.min(2 * keys as u64) as usize).clamp(1, MAX_BATCH_KEYS)
}

/// The read of `key`'s directory entry, for a caller whose copy of the
/// directory lacks it (or found it stale).
pub fn dir_read(kh: &KeyHash, header: &RegionHeader) -> ReadSpec {
    ReadSpec { offset: header.dir_entry_offset(kh.dir_index(header.dir_depth)), len: 8 }
}

/// Judges a directory entry as read: the entry, if it names a segment that
/// lies inside the data area. Anything else (torn, scribbled) is no entry.
pub fn judge_dir_entry(bytes: &[u8], header: &RegionHeader) -> Option<DirEntry> {
    let v = u64::from_le_bytes(bytes.try_into().ok()?);
    let e = DirEntry::unpack(v)?;
    header.in_data_area(e.offset(), (SEGMENT_UNITS * crate::limits::UNIT) as u64).then_some(e)
}

/// The read of the server's clock (see [`crate::layout::CLOCK_OFFSET`]),
/// to post last in every batch: the clock then was read no earlier than
/// any item in the batch, so an item it calls live was live when read.
pub fn clock_read() -> ReadSpec {
    ReadSpec { offset: crate::layout::CLOCK_OFFSET, len: 8 }
}

/// The server's clock (unix ms) in a [`clock_read`]'s bytes; 0 (no clock)
/// for anything but eight bytes.
pub fn judge_clock(bytes: &[u8]) -> u64 {
    bytes.try_into().map_or(0, u64::from_le_bytes)
}

/// One read the protocol needs: `len` bytes at region offset `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadSpec {
    pub offset: u64,
    pub len: u32,
}

/// Where a key's item was last found: lets a later GET read the item in the
/// same round trip as its bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hint {
    /// Which of the key's two candidate buckets (0 or 1).
    pub which: u8,
    /// Slot index in that bucket.
    pub index: u8,
    /// The slot's value when the item was read.
    pub slot: Slot,
}

/// A verified value: where it lies in the buffer of the item it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    /// Index of the item read (in the batch of item reads; 0 for a hint hit).
    pub item: usize,
    /// Byte range of the value within that item's buffer.
    pub value: Range<usize>,
    pub version: u64,
    /// The item's client flags and expiry (unix second; 0: never).
    pub flags: u32,
    pub expires_at: u32,
    /// Where to read the key next time.
    pub hint: Hint,
}

/// Why an attempt was abandoned; each is counted by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// An item failed verification (torn by a writer, or reused space).
    Torn,
    /// An item at a matching slot holds another key: reused space or a
    /// fingerprint collision. Never treated as "not found".
    OtherKey,
    /// The attempt took longer than the grace period, so the item may have
    /// been reused under it.
    Slow,
    /// The directory entry used named a segment that no longer serves the
    /// key (it split, or the entry was torn): read the entry again.
    StaleDirectory,
    /// The item can expire but the batch brought no server clock to judge
    /// it by (the region does not publish one): the server must answer.
    NoClock,
}

/// How an item that verified is judged by the server's clock `clock_ms`
/// (0: none read): live, expired (a miss), or not to be judged here.
fn judge_expiry(expires_at: u32, clock_ms: u64) -> Result<bool, Retry> {
    match (expires_at, clock_ms) {
        (0, _) => Ok(true),
        (_, 0) => Err(Retry::NoClock),
        (at, now) => Ok(!crate::expiry::expired(at, now)),
    }
}

/// What to do after the bucket reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterBuckets {
    /// The hinted item verified against its slot: done in one round trip.
    Hit(Hit),
    /// No slot of either bucket has the key's fingerprint.
    Miss,
    /// Read these items next (see [`Lookup::item_reads`]).
    ReadItems,
    /// Retry; with [`Retry::StaleDirectory`], after reading the key's
    /// directory entry again.
    Retry(Retry),
}

/// Result of the item reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Hit(Hit),
    Miss,
    Retry(Retry),
}

/// Most slots that can match a key's fingerprint: every slot of its two
/// buckets.
pub const MAX_CANDIDATES: usize = 2 * SLOTS_PER_BUCKET;

/// The slots that matched a key's fingerprint (bucket, index, slot).
#[derive(Debug, Clone, Default)]
struct Candidates {
    len: usize,
    at: [Option<(u8, u8, Slot)>; MAX_CANDIDATES],
}

impl Candidates {
    fn push(&mut self, c: (u8, u8, Slot)) {
        // Two buckets hold MAX_CANDIDATES slots, so this never overflows.
        assert!(self.len < MAX_CANDIDATES, "more candidates than slots");
        self.at[self.len] = Some(c);
        self.len += 1;
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn len(&self) -> usize {
        self.len
    }

    fn iter(&self) -> impl Iterator<Item = (u8, u8, Slot)> + '_ {
        self.at[..self.len].iter().flatten().copied()
    }
}

/// One GET attempt for one key.
#[derive(Debug, Clone)]
pub struct Lookup {
    kh: KeyHash,
    segment: DirEntry,
    bucket_offsets: [u64; 2],
    hint: Option<Hint>,
    started: u64,
    grace: u64,
    enforce_grace: bool,
    /// Slots that matched the fingerprint, in bucket order: inline, so a
    /// GET allocates nothing.
    candidates: Candidates,
    serving: Option<BucketHeader>,
}

impl Lookup {
    /// Starts an attempt at time `now` (nanoseconds on the caller's
    /// monotonic clock, taken before the first read is posted), in the
    /// segment `segment` (the key's directory entry, as the caller has it).
    pub fn new(key: &[u8], header: &RegionHeader, segment: DirEntry, hint: Option<Hint>, now: u64) -> Lookup {
        Self::with_hash(key_hash(key, header.hash_seed), header, segment, hint, now)
    }

    /// [`Lookup::new`] for a key already hashed.
    pub fn with_hash(kh: KeyHash, header: &RegionHeader, segment: DirEntry, hint: Option<Hint>, now: u64) -> Lookup {
        Lookup {
            kh,
            segment,
            bucket_offsets: kh.buckets.map(|b| segment.bucket_offset(b)),
            hint: hint.filter(|h| h.which < 2 && (h.index as usize) < SLOTS_PER_BUCKET),
            started: now,
            grace: header.grace_nanos,
            enforce_grace: true,
            candidates: Candidates::default(),
            serving: None,
        }
    }

    /// Turns off the grace-period check, leaving verification alone to
    /// catch reuse. For tests that provoke tears; never for real use.
    pub fn without_grace_check(mut self) -> Self {
        self.enforce_grace = false;
        self
    }

    /// The first batch: both buckets, then the hinted item if any.
    pub fn first_reads(&self, out: &mut Vec<ReadSpec>) {
        for &offset in &self.bucket_offsets {
            out.push(ReadSpec { offset, len: BUCKET_LEN as u32 });
        }
        if let Some(h) = self.hint {
            out.push(ReadSpec { offset: h.slot.offset(), len: h.slot.len() as u32 });
        }
    }

    /// Number of reads [`Lookup::first_reads`] adds.
    /// When the attempt started (the clock it was made with): no read of
    /// it came earlier.
    pub fn started(&self) -> u64 {
        self.started
    }

    pub fn first_read_count(&self) -> usize {
        2 + self.hint.is_some() as usize
    }

    fn too_slow(&self, now: u64) -> bool {
        self.enforce_grace && now.saturating_sub(self.started) >= self.grace
    }

    /// Judges the first batch: the two buckets and, if a hint was given,
    /// the hinted item's bytes.
    ///
    /// A bucket of any length but [`BUCKET_LEN`] (a backend that returned
    /// fewer or more bytes than asked for) is treated as torn, never read.
    ///
    /// `clock_ms` is the server's clock as read in the same batch
    /// ([`clock_read`], [`judge_clock`]); it judges the hinted item's expiry.
    pub fn after_buckets(
        &mut self,
        key: &[u8],
        buckets: [&[u8]; 2],
        hinted: Option<&[u8]>,
        now: u64,
        clock_ms: u64,
    ) -> AfterBuckets {
        if buckets.iter().any(|b| b.len() != BUCKET_LEN) {
            return AfterBuckets::Retry(Retry::Torn);
        }
        let words = buckets.map(bucket_words);
        // Both buckets must say that this incarnation of the segment serves
        // the key; otherwise the slots say nothing about it.
        let serves =
            |w: u64| BucketHeader::unpack(w).is_some_and(|h| h.tag == self.segment.tag && h.serves(self.kh.dir_hash));
        if !words.iter().all(|w| serves(w[0])) {
            return AfterBuckets::Retry(Retry::StaleDirectory);
        }
        self.serving = BucketHeader::unpack(words[0][0]);
        let slots: [[u64; SLOTS_PER_BUCKET]; 2] = words.map(|w| std::array::from_fn(|i| w[i + 1]));
        if let (Some(h), Some(item)) = (self.hint, hinted)
            && slots[h.which as usize][h.index as usize] == h.slot.pack()
            && !self.too_slow(now)
            && let Ok(it) = decode_item(item)
            && it.key == key
        {
            return match judge_expiry(it.expires_at, clock_ms) {
                Ok(false) => AfterBuckets::Miss,
                Err(r) => AfterBuckets::Retry(r),
                Ok(true) => {
                    let start = ITEM_HEADER_LEN + key.len();
                    AfterBuckets::Hit(Hit {
                        item: 0,
                        value: start..start + it.value.len(),
                        version: it.version,
                        flags: it.flags,
                        expires_at: it.expires_at,
                        hint: h,
                    })
                }
            };
        }
        self.candidates = Candidates::default();
        let mut torn_slot = false;
        for (which, bucket) in slots.iter().enumerate() {
            for (index, &v) in bucket.iter().enumerate() {
                match Slot::unpack(v) {
                    Some(s) if s.fingerprint == self.kh.fingerprint => {
                        self.candidates.push((which as u8, index as u8, s))
                    }
                    Some(_) => {}
                    // Neither empty nor a slot: a torn read of a slot that
                    // may have been this key's, so "missing" would be a guess.
                    None => torn_slot |= v != Slot::EMPTY,
                }
            }
        }
        match (self.candidates.is_empty(), torn_slot) {
            (false, _) => AfterBuckets::ReadItems,
            (true, true) => AfterBuckets::Retry(Retry::Torn),
            // A segment's memory is reused (as a segment again) only after
            // the grace period: a miss is believed only from reads that
            // all fall within it.
            (true, false) if self.too_slow(now) => AfterBuckets::Retry(Retry::Slow),
            (true, false) => AfterBuckets::Miss,
        }
    }

    /// What the segment's bucket headers said when they were last judged
    /// to serve the key: its depth and suffix, so the caller may take the
    /// same directory entry for every key with that suffix.
    pub fn serving(&self) -> Option<BucketHeader> {
        self.serving
    }

    /// The second batch: every item whose slot matched the fingerprint.
    pub fn item_reads(&self, out: &mut Vec<ReadSpec>) {
        for (_, _, s) in self.candidates.iter() {
            out.push(ReadSpec { offset: s.offset(), len: s.len() as u32 });
        }
    }

    /// Number of reads [`Lookup::item_reads`] adds.
    pub fn item_read_count(&self) -> usize {
        self.candidates.len()
    }

    /// Judges the items read for [`Lookup::item_reads`], in that order, by
    /// the server's clock `clock_ms` read in the same batch, after them.
    pub fn after_items(&self, key: &[u8], items: &[&[u8]], now: u64, clock_ms: u64) -> Outcome {
        assert_eq!(items.len(), self.candidates.len(), "one buffer per item read");
        if self.too_slow(now) {
            return Outcome::Retry(Retry::Slow);
        }
        let mut retry = None;
        for (i, ((which, index, slot), buf)) in self.candidates.iter().zip(items).enumerate() {
            match decode_item(buf) {
                Ok(it) if it.key == key => {
                    return match judge_expiry(it.expires_at, clock_ms) {
                        Ok(false) => Outcome::Miss,
                        Err(r) => Outcome::Retry(r),
                        Ok(true) => {
                            let start = ITEM_HEADER_LEN + key.len();
                            Outcome::Hit(Hit {
                                item: i,
                                value: start..start + it.value.len(),
                                version: it.version,
                                flags: it.flags,
                                expires_at: it.expires_at,
                                hint: Hint { which, index, slot },
                            })
                        }
                    };
                }
                Ok(_) => {
                    retry.get_or_insert(Retry::OtherKey);
                }
                Err(_) => retry = Some(Retry::Torn),
            }
        }
        match retry {
            Some(r) => Outcome::Retry(r),
            None => Outcome::Miss,
        }
    }
}

#[cfg(test)]
mod tests {
    //! The reader against a simulated region whose writer reuses freed space
    //! at once (no grace period) and whose reads tear at random offsets.

    use super::*;

    #[test]
    fn batch_size_follows_the_measured_speed() {
        const MS: u64 = 1_000_000;
        // 256 keys took 300 ms against a 100 ms grace: the next batch is
        // sized for 25 ms at that speed.
        assert_eq!(next_batch_keys(256, 300 * MS, 100 * MS), 21);
        // Fast batches grow back, at most twofold, up to the limit.
        assert_eq!(next_batch_keys(21, MS, 100 * MS), 42);
        assert_eq!(next_batch_keys(200, 0, 100 * MS), MAX_BATCH_KEYS);
        // Never below one key, whatever the speed; nonsense is clamped.
        assert_eq!(next_batch_keys(1, 10_000 * MS, 100 * MS), 1);
        assert_eq!(next_batch_keys(0, u64::MAX, 0), 1);
        assert_eq!(next_batch_keys(usize::MAX, 1, u64::MAX), MAX_BATCH_KEYS);
        // Converges: a transport 10x too slow for 256 keys settles at a
        // batch that takes about a quarter of the grace period.
        let per_key = 4 * MS;
        let mut keys = MAX_BATCH_KEYS;
        for _ in 0..8 {
            keys = next_batch_keys(keys, keys as u64 * per_key, 100 * MS);
        }
        assert!((5..=7).contains(&keys), "{keys}");
    }
    use crate::layout::{encode_item, item_units};
    use crate::limits::{SEGMENT_BUCKETS, SEGMENT_LEN, UNIT};
    use proptest::prelude::*;
    use std::collections::HashMap;

    const REGION: usize = 8 * 1024 * 1024;

    /// A region written as the server writes it: items out of place, slots
    /// published with one store, and segments split by the server's
    /// protocol (copy each slot to the half that now serves it, publish the
    /// halves in the directory, then clear the old segment's headers). The
    /// writer reuses freed item space at once (no grace period); retired
    /// segments are never reused (the server keeps them a grace period).
    struct Sim {
        header: RegionHeader,
        mem: Vec<u8>,
        free: Vec<(u64, usize)>,
        next: u64,
        version: u64,
        next_tag: u32,
        splits: u64,
        /// Every value each key ever had, by version.
        history: HashMap<Vec<u8>, HashMap<u64, Vec<u8>>>,
    }

    impl Sim {
        fn new() -> Sim {
            let header = RegionHeader::plan(REGION as u64, 1, 99, 1, 1_000).unwrap();
            let mut sim = Sim {
                header,
                mem: vec![0; REGION],
                free: Vec::new(),
                next: header.data_offset,
                version: 0,
                next_tag: 1,
                splits: 0,
                history: HashMap::new(),
            };
            let seg = sim.new_segment(0, 0);
            for d in 0..header.dir_entries() {
                sim.set_word(header.dir_entry_offset(d), seg.pack());
            }
            sim
        }

        fn word(&self, off: u64) -> u64 {
            u64::from_le_bytes(self.mem[off as usize..off as usize + 8].try_into().unwrap())
        }

        fn set_word(&mut self, off: u64, v: u64) {
            self.mem[off as usize..off as usize + 8].copy_from_slice(&v.to_le_bytes());
        }

        fn take(&mut self, len: usize) -> u64 {
            let at = self.next;
            self.next += len as u64;
            assert!(self.next as usize <= REGION, "simulated region full");
            at
        }

        /// A fresh segment serving (depth, suffix): slots zero, headers set.
        fn new_segment(&mut self, depth: u8, suffix: u32) -> DirEntry {
            let at = self.take(SEGMENT_LEN);
            let e = DirEntry { offset_units: at / UNIT as u64, tag: self.next_tag };
            self.next_tag += 1;
            let h = BucketHeader { depth, suffix, tag: e.tag }.pack();
            for b in 0..SEGMENT_BUCKETS as u8 {
                self.set_word(e.bucket_offset(b), h);
            }
            e
        }

        /// The directory entry for `kh`, as it is now.
        fn entry(&self, kh: &KeyHash) -> DirEntry {
            DirEntry::unpack(self.word(self.header.dir_entry_offset(kh.dir_index(self.header.dir_depth)))).unwrap()
        }

        fn slot_offsets(e: DirEntry, kh: &KeyHash) -> impl Iterator<Item = u64> {
            kh.buckets
                .into_iter()
                .flat_map(move |b| (1..=SLOTS_PER_BUCKET as u64).map(move |i| e.bucket_offset(b) + 8 * i))
        }

        fn item_key(&self, slot: Slot) -> Vec<u8> {
            decode_item(&self.mem[slot.offset() as usize..slot.offset() as usize + slot.len()]).unwrap().key.to_vec()
        }

        fn find(&self, key: &[u8]) -> Option<u64> {
            let kh = key_hash(key, self.header.hash_seed);
            Self::slot_offsets(self.entry(&kh), &kh)
                .find(|&off| Slot::unpack(self.word(off)).is_some_and(|s| self.item_key(s) == key))
        }

        /// Splits the segment serving `key`, if it can get deeper.
        fn split(&mut self, key: &[u8]) -> bool {
            let kh = key_hash(key, self.header.hash_seed);
            let old = self.entry(&kh);
            let h = BucketHeader::unpack(self.word(old.bucket_offset(0))).unwrap();
            if u64::from(h.depth) >= self.header.dir_depth {
                return false;
            }
            let halves =
                [self.new_segment(h.depth + 1, h.suffix), self.new_segment(h.depth + 1, h.suffix | 1 << h.depth)];
            for b in 0..SEGMENT_BUCKETS as u8 {
                for i in 1..=SLOTS_PER_BUCKET as u64 {
                    let w = self.word(old.bucket_offset(b) + 8 * i);
                    if let Some(slot) = Slot::unpack(w) {
                        let bit = (key_hash(&self.item_key(slot), self.header.hash_seed).dir_hash >> h.depth) & 1;
                        self.set_word(halves[bit as usize].bucket_offset(b) + 8 * i, w);
                    }
                }
            }
            for d in 0..self.header.dir_entries() {
                if crate::layout::low_bits(d as u32, h.depth) == h.suffix {
                    let e = halves[((d >> h.depth) & 1) as usize];
                    self.set_word(self.header.dir_entry_offset(d), e.pack());
                }
            }
            for b in 0..SEGMENT_BUCKETS as u8 {
                self.set_word(old.bucket_offset(b), 0);
            }
            self.splits += 1;
            true
        }

        /// Writes key=value out of place, publishes it, and frees the old
        /// item at once, so its space is reused by the next write.
        fn put(&mut self, key: &[u8], value: &[u8]) {
            self.put_expiring(key, value, 0);
        }

        /// [`Sim::put`] of an item that expires at unix second `expires_at`.
        fn put_expiring(&mut self, key: &[u8], value: &[u8], expires_at: u32) {
            let units = item_units(key.len(), value.len());
            let at = match self.free.iter().position(|&(_, u)| u >= units) {
                Some(i) => self.free.swap_remove(i).0,
                None => self.take(units * UNIT),
            };
            self.version += 1;
            let mut buf = Vec::new();
            encode_item(key, value, self.version, 0, expires_at, &mut buf);
            self.mem[at as usize..at as usize + buf.len()].copy_from_slice(&buf);
            self.history.entry(key.to_vec()).or_default().insert(self.version, value.to_vec());
            let kh = key_hash(key, self.header.hash_seed);
            let new = Slot::new(kh.fingerprint, at, units).pack();
            let slot_off = match self.find(key) {
                Some(off) => {
                    let old = Slot::unpack(self.word(off)).unwrap();
                    self.free.push((old.offset(), old.units as usize));
                    off
                }
                None => loop {
                    let e = self.entry(&kh);
                    if let Some(off) = Self::slot_offsets(e, &kh).find(|&off| self.word(off) == 0) {
                        break off;
                    }
                    if !self.split(key) {
                        self.free.push((at, units));
                        return;
                    }
                },
            };
            self.set_word(slot_off, new);
        }

        fn range(spec: ReadSpec) -> Range<usize> {
            spec.offset as usize..spec.offset as usize + spec.len as usize
        }

        /// The bytes `specs` would read now.
        fn snapshot(&self, specs: &[ReadSpec]) -> Vec<Vec<u8>> {
            specs.iter().map(|&s| self.mem[Self::range(s)].to_vec()).collect()
        }

        /// Reads that saw `before` up to a tear point and the region as it
        /// is now after it: what a read racing the writes in between sees.
        /// Tears fall at any byte, inside slots and headers too, which is
        /// harsher than the shm and engine readers (whole aligned words)
        /// and covers NICs that give no atomicity within a read.
        fn read(&self, before: &[Vec<u8>], specs: &[ReadSpec], tear: usize) -> Vec<Vec<u8>> {
            specs
                .iter()
                .zip(before)
                .map(|(&spec, old)| {
                    let mut out = old.clone();
                    let t = tear % (out.len() + 1);
                    out[t..].copy_from_slice(&self.mem[Self::range(spec)][t..]);
                    out
                })
                .collect()
        }
    }

    fn value_for(key: &[u8], v: u64, len: usize) -> Vec<u8> {
        (0..len).map(|i| key[0].wrapping_add(v as u8).wrapping_add(i as u8)).collect()
    }

    /// A reader's copy of the directory, filled an entry at a time.
    #[derive(Default)]
    struct DirCopy(HashMap<u64, DirEntry>);

    impl DirCopy {
        fn get(&mut self, sim: &Sim, key: &[u8]) -> DirEntry {
            let kh = key_hash(key, sim.header.hash_seed);
            let spec = dir_read(&kh, &sim.header);
            *self.0.entry(kh.dir_index(sim.header.dir_depth)).or_insert_with(|| {
                judge_dir_entry(&sim.snapshot(&[spec])[0], &sim.header).expect("entries are written whole")
            })
        }

        fn forget(&mut self, sim: &Sim, key: &[u8]) {
            self.0.remove(&key_hash(key, sim.header.hash_seed).dir_index(sim.header.dir_depth));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Writers (and segment splits) run between and during every read;
        /// whatever the reader returns is a value the key really had, and
        /// it never says "not found" for a key that was stored throughout,
        /// however stale its copy of the directory.
        #[test]
        fn reader_never_returns_unverified_bytes(
            steps in prop::collection::vec((0usize..16, 0usize..400, any::<usize>(), any::<usize>(), any::<bool>(), 0u8..4), 1..300)
        ) {
            let mut sim = Sim::new();
            let keys: Vec<Vec<u8>> = (0..16u8).map(|k| vec![b'a' + k; 3 + k as usize % 6]).collect();
            // Half the keys exist from the start; the others are stored
            // when first read, after splits the reader may not know of.
            for k in &keys[..8] {
                sim.put(k, &value_for(k, 0, 10));
            }
            let mut dir = DirCopy::default();
            let mut seen = [false; 16];
            let mut hints: HashMap<usize, Hint> = HashMap::new();
            let (mut hits, mut retries, mut stale, mut misses) = (0, 0, 0, 0);
            for (ki, len, tear1, tear2, use_hint, split) in steps {
                let key = &keys[ki];
                // A late key is read once while absent (its directory entry
                // cached then), and stored the next time, maybe after
                // splits: a reader that missed a split must not miss it.
                let absent = !sim.history.contains_key(key);
                if absent && seen[ki] {
                    sim.put(key, &value_for(key, 0, 10));
                }
                let absent = !sim.history.contains_key(key);
                seen[ki] = true;
                let entry = dir.get(&sim, key);
                let mut look = Lookup::new(key, &sim.header, entry, use_hint.then(|| hints.get(&ki).copied()).flatten(), 0)
                    .without_grace_check();
                let mut specs = Vec::new();
                look.first_reads(&mut specs);
                // A writer changes the region while the first batch is
                // read, and sometimes splits the key's segment (or
                // another's) under it.
                let before = sim.snapshot(&specs);
                if !absent {
                    sim.put(key, &value_for(key, sim.version, len));
                }
                let other = &keys[(ki + 1) % 8];
                sim.put(other, &value_for(other, sim.version, len / 2));
                match split {
                    1 => { sim.split(key); }
                    2 => { sim.split(&keys[(ki + 3) % keys.len()]); }
                    _ => {}
                }
                let bufs = sim.read(&before, &specs, tear1);
                let hinted = bufs.get(2).map(|b| &b[..]);
                let outcome = match look.after_buckets(key, [&bufs[0], &bufs[1]], hinted, 0, 0) {
                    AfterBuckets::Hit(h) => Outcome::Hit(h),
                    AfterBuckets::Miss => Outcome::Miss,
                    AfterBuckets::Retry(r) => Outcome::Retry(r),
                    AfterBuckets::ReadItems => {
                        let mut specs = Vec::new();
                        look.item_reads(&mut specs);
                        // ... and again while the items are read.
                        let before = sim.snapshot(&specs);
                        if !absent {
                            sim.put(key, &value_for(key, sim.version, len + 7));
                        }
                        if split == 3 {
                            sim.split(key);
                        }
                        let items = sim.read(&before, &specs, tear2);
                        let refs: Vec<&[u8]> = items.iter().map(|b| &b[..]).collect();
                        match look.after_items(key, &refs, 0, 0) {
                            Outcome::Hit(h) => {
                                let v = &items[h.item][h.value.clone()];
                                prop_assert!(!absent, "an absent key was found");
                                prop_assert_eq!(Some(&v.to_vec()), sim.history[key].get(&h.version), "value is not one the key had");
                                hints.insert(ki, h.hint);
                                hits += 1;
                                continue;
                            }
                            o => o,
                        }
                    }
                };
                match outcome {
                    Outcome::Hit(h) => {
                        let v = &bufs[2][h.value.clone()];
                        prop_assert!(!absent, "an absent key was found");
                        prop_assert_eq!(Some(&v.to_vec()), sim.history[key].get(&h.version), "hinted value is not one the key had");
                        hints.insert(ki, h.hint);
                        hits += 1;
                    }
                    Outcome::Miss => {
                        prop_assert!(absent, "a stored key was reported missing");
                        misses += 1;
                    }
                    Outcome::Retry(Retry::StaleDirectory) => {
                        dir.forget(&sim, key);
                        stale += 1;
                    }
                    Outcome::Retry(_) => retries += 1,
                }
            }
            prop_assert!(hits + retries + stale + misses > 0);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        /// Items expire while readers read them, the server's clock moving
        /// in steps between every read (including between an item's read
        /// and the clock's, posted after it in the same batch): a reader
        /// never returns an item its clock calls expired, never calls a
        /// live item missing, and with no clock published it leaves
        /// expiring items to the server.
        #[test]
        fn one_sided_reads_never_return_an_expired_item(
            steps in prop::collection::vec((0usize..4, prop::option::of(-2i64..4), 0u64..1500, 0u64..1500, any::<bool>()), 1..200),
            publish in prop::bool::weighted(0.9),
        ) {
            let mut sim = Sim::new();
            let keys: Vec<Vec<u8>> = (0..4u8).map(|k| vec![b'k', k]).collect();
            let mut clock: u64 = 1_800_000_000_000;
            let set_clock = |sim: &mut Sim, c: u64| if publish { sim.set_word(crate::layout::CLOCK_OFFSET, c) };
            set_clock(&mut sim, clock);
            // key -> (value, expires_at) as last written
            let mut current: HashMap<usize, (Vec<u8>, u32)> = HashMap::new();
            let mut hints: HashMap<usize, Hint> = HashMap::new();
            let mut dir = DirCopy::default();
            let (mut expired_misses, mut hits) = (0, 0);
            for (ki, ttl, step1, step2, use_hint) in steps {
                let key = &keys[ki];
                if let Some(ttl) = ttl {
                    let at = if ttl == 0 { 0 } else { ((clock / 1000) as i64 + ttl).max(1) as u32 };
                    let v = value_for(key, sim.version, 8);
                    sim.put_expiring(key, &v, at);
                    current.insert(ki, (v, at));
                }
                let entry = dir.get(&sim, key);
                let mut look = Lookup::new(key, &sim.header, entry, use_hint.then(|| hints.get(&ki).copied()).flatten(), 0);
                let mut specs = Vec::new();
                look.first_reads(&mut specs);
                let n = specs.len();
                let mut bufs = sim.snapshot(&specs);
                // The clock moves between the batch's reads and its clock read.
                clock += step1;
                set_clock(&mut sim, clock);
                let clock_seen = judge_clock(&sim.snapshot(&[clock_read()])[0]);
                prop_assert_eq!(clock_seen, if publish { clock } else { 0 });
                let hinted = (n == 3).then(|| std::mem::take(&mut bufs[2]));
                let first = look.after_buckets(key, [&bufs[0], &bufs[1]], hinted.as_deref(), 0, clock_seen);
                let (outcome, seen_at) = match first {
                    AfterBuckets::Hit(h) => (Outcome::Hit(h), clock_seen),
                    AfterBuckets::Miss => (Outcome::Miss, clock_seen),
                    AfterBuckets::Retry(r) => (Outcome::Retry(r), clock_seen),
                    AfterBuckets::ReadItems => {
                        let mut specs = Vec::new();
                        look.item_reads(&mut specs);
                        let items = sim.snapshot(&specs);
                        clock += step2;
                        set_clock(&mut sim, clock);
                        let clock_seen = judge_clock(&sim.snapshot(&[clock_read()])[0]);
                        let refs: Vec<&[u8]> = items.iter().map(|b| &b[..]).collect();
                        (look.after_items(key, &refs, 0, clock_seen), clock_seen)
                    }
                };
                let live = current.get(&ki).filter(|(_, at)| *at == 0 || (seen_at > 0 && !crate::expiry::expired(*at, seen_at)));
                match outcome {
                    Outcome::Hit(h) => {
                        prop_assert!(h.expires_at == 0 || !crate::expiry::expired(h.expires_at, seen_at), "returned an item expired at {} by clock {}", h.expires_at, seen_at);
                        let (v, at) = live.expect("a hit of a key with no live item");
                        prop_assert_eq!((h.expires_at, h.version), (*at, *sim.history[key].keys().max().unwrap()));
                        prop_assert_eq!(sim.history[key].get(&h.version), Some(v));
                        hints.insert(ki, h.hint);
                        hits += 1;
                    }
                    Outcome::Miss => {
                        prop_assert!(live.is_none(), "a live item was reported missing");
                        if current.contains_key(&ki) {
                            expired_misses += 1;
                        }
                    }
                    Outcome::Retry(Retry::NoClock) => {
                        prop_assert!(!publish, "no clock although one is published");
                        prop_assert!(current.get(&ki).is_some_and(|(_, at)| *at != 0));
                    }
                    Outcome::Retry(r) => prop_assert!(false, "nothing races here, yet {:?}", r),
                }
            }
            // Both kinds of outcome happen across cases (checked by
            // breaking the expiry judgment: every case with a write fails).
            let _ = (hits, expired_misses);
        }
    }

    /// Without splits the directory copy never goes stale; with them it
    /// does, the reader says so, and a fresh entry finds the key.
    #[test]
    fn a_split_makes_old_entries_stale_and_new_ones_find_the_key() {
        let mut sim = Sim::new();
        let keys: Vec<Vec<u8>> = (0..200u32).map(|i| format!("key{i}").into_bytes()).collect();
        for k in &keys {
            sim.put(k, b"v");
        }
        let first = DirCopy::default().get(&sim, &keys[0]);
        for _ in 0..3 {
            for k in &keys {
                sim.split(k);
            }
        }
        assert!(sim.splits >= 7, "{}", sim.splits);
        let get = |entry: DirEntry, key: &[u8]| {
            let mut look = Lookup::new(key, &sim.header, entry, None, 0);
            let mut specs = Vec::new();
            look.first_reads(&mut specs);
            let bufs = sim.snapshot(&specs);
            match look.after_buckets(key, [&bufs[0], &bufs[1]], None, 0, 0) {
                AfterBuckets::ReadItems => {
                    let mut specs = Vec::new();
                    look.item_reads(&mut specs);
                    let items = sim.snapshot(&specs);
                    let refs: Vec<&[u8]> = items.iter().map(|b| &b[..]).collect();
                    look.after_items(key, &refs, 0, 0)
                }
                AfterBuckets::Retry(r) => Outcome::Retry(r),
                o => panic!("{o:?}"),
            }
        };
        assert_eq!(get(first, &keys[0]), Outcome::Retry(Retry::StaleDirectory));
        for k in &keys {
            match get(DirCopy::default().get(&sim, k), k) {
                Outcome::Hit(h) => assert_eq!(h.version, sim.history[k].keys().copied().max().unwrap()),
                o => panic!("{o:?}"),
            }
        }
    }

    fn first_batch(sim: &Sim, key: &[u8]) -> (Lookup, Vec<ReadSpec>, Vec<Vec<u8>>) {
        let entry = DirCopy::default().get(sim, key);
        let look = Lookup::new(key, &sim.header, entry, None, 0);
        let mut specs = Vec::new();
        look.first_reads(&mut specs);
        let bufs = sim.snapshot(&specs);
        (look, specs, bufs)
    }

    /// Found by the property test: a slot torn inside its word can read as
    /// "offset 0", which is not a slot; that is a retry, never "missing".
    #[test]
    fn a_torn_slot_is_a_retry_not_a_miss() {
        let mut sim = Sim::new();
        sim.put(b"k", b"v");
        let off = sim.find(b"k").unwrap();
        let slot = Slot::unpack(sim.word(off)).unwrap();
        let (mut look, specs, mut bufs) = first_batch(&sim, b"k");
        let which = specs.iter().position(|s| (s.offset..s.offset + BUCKET_LEN as u64).contains(&off)).unwrap();
        let at = (off - specs[which].offset) as usize;
        // Keep fingerprint and length, lose the offset bits.
        let torn = slot.pack() & !((1u64 << 33) - 1);
        bufs[which][at..at + 8].copy_from_slice(&torn.to_le_bytes());
        assert_eq!(look.after_buckets(b"k", [&bufs[0], &bufs[1]], None, 0, 0), AfterBuckets::Retry(Retry::Torn));
    }

    /// Found by fuzzing (`fuzz::read_lookup`): a backend that hands back a
    /// bucket of another length than asked for (an engine reply is the
    /// server's word) made `bucket_slots` panic in the client.
    #[test]
    fn a_bucket_of_the_wrong_length_is_a_retry_not_a_panic() {
        let mut sim = Sim::new();
        sim.put(b"k", b"v");
        let (mut look, _, bufs) = first_batch(&sim, b"k");
        for short in [&bufs[0][..0], &bufs[0][..63]] {
            assert_eq!(look.after_buckets(b"k", [short, &bufs[1]], None, 0, 0), AfterBuckets::Retry(Retry::Torn));
            assert_eq!(look.after_buckets(b"k", [&bufs[0], short], None, 0, 0), AfterBuckets::Retry(Retry::Torn));
        }
        let long = [bufs[0].as_slice(), &[0u8; 8]].concat();
        assert_eq!(look.after_buckets(b"k", [&long, &bufs[1]], None, 0, 0), AfterBuckets::Retry(Retry::Torn));
    }

    #[test]
    fn slow_attempts_are_abandoned() {
        let sim = {
            let mut s = Sim::new();
            s.put(b"k", b"v");
            s
        };
        let (mut look, _, bufs) = first_batch(&sim, b"k");
        assert_eq!(look.after_buckets(b"k", [&bufs[0], &bufs[1]], None, 10, 0), AfterBuckets::ReadItems);
        let mut specs = Vec::new();
        look.item_reads(&mut specs);
        let items: Vec<Vec<u8>> = sim.snapshot(&specs);
        let refs: Vec<&[u8]> = items.iter().map(|b| &b[..]).collect();
        assert_eq!(look.after_items(b"k", &refs, sim.header.grace_nanos, 0), Outcome::Retry(Retry::Slow));
        match look.after_items(b"k", &refs, sim.header.grace_nanos - 1, 0) {
            Outcome::Hit(h) => assert_eq!(&items[h.item][h.value], b"v"),
            o => panic!("{o:?}"),
        }
        // A miss is believed only within the grace period too.
        let (mut look, _, bufs) = first_batch(&sim, b"absent");
        let late = look.after_buckets(b"absent", [&bufs[0], &bufs[1]], None, sim.header.grace_nanos, 0);
        assert!(matches!(late, AfterBuckets::Retry(Retry::Slow) | AfterBuckets::ReadItems), "{late:?}");
    }

    #[test]
    fn missing_key_is_a_miss_and_a_stale_hint_falls_back() {
        let mut sim = Sim::new();
        sim.put(b"k", b"v1");
        let (mut look, _, bufs) = first_batch(&sim, b"nope");
        // Fingerprints of other keys may match; then items decide.
        match look.after_buckets(b"nope", [&bufs[0], &bufs[1]], None, 0, 0) {
            AfterBuckets::Miss => {}
            AfterBuckets::ReadItems => {
                let mut specs = Vec::new();
                look.item_reads(&mut specs);
                let items: Vec<Vec<u8>> = sim.snapshot(&specs);
                let refs: Vec<&[u8]> = items.iter().map(|b| &b[..]).collect();
                assert_eq!(look.after_items(b"nope", &refs, 0, 0), Outcome::Retry(Retry::OtherKey));
            }
            o => panic!("{o:?}"),
        }
        // A hint whose slot changed is not trusted, even if its item verifies.
        let kh = key_hash(b"k", sim.header.hash_seed);
        let entry = sim.entry(&kh);
        let off = sim.find(b"k").unwrap();
        let which = (0..2).find(|&w| {
            let b = entry.bucket_offset(kh.buckets[w]);
            (b..b + BUCKET_LEN as u64).contains(&off)
        });
        let which = which.unwrap() as u8;
        let index = ((off - entry.bucket_offset(kh.buckets[which as usize])) / 8 - 1) as u8;
        let hint = Hint { which, index, slot: Slot::unpack(sim.word(off)).unwrap() };
        sim.put(b"k", b"v2");
        let mut look = Lookup::new(b"k", &sim.header, entry, Some(hint), 0);
        let mut specs = Vec::new();
        look.first_reads(&mut specs);
        assert_eq!(specs.len(), 3);
        let bufs: Vec<Vec<u8>> = sim.snapshot(&specs);
        assert_eq!(look.after_buckets(b"k", [&bufs[0], &bufs[1]], Some(&bufs[2]), 0, 0), AfterBuckets::ReadItems);
    }
}

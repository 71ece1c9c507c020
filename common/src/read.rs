//! The one-sided GET protocol as a pure state machine: it says which bytes
//! of a region to read and judges what came back. No IO and no clock: the
//! caller posts the reads on whatever backend it has (shared memory, the
//! TCP engine, RDMA) and passes the time in, so the protocol is tested
//! deterministically against simulated regions that tear and reuse.
//!
//! A GET is:
//! 1. read both candidate buckets in one batch (plus, for a hot key with a
//!    cached address, the item itself, so a hit takes one round trip);
//! 2. pick the slots whose fingerprint matches and read exactly those items
//!    in one batch;
//! 3. verify checksum and key. Bytes that fail verification are never
//!    returned: the caller retries a bounded number of times, then asks the
//!    server over RPC.
//!
//! Safety argument (see docs/one-sided.md): an item is fully written before
//! the release store that publishes its slot, and its space is reused only
//! after the region's grace period has passed since it was unlinked. A
//! reader that saw the slot and finished reading the item within the grace
//! period therefore read the intact item that was current when it read the
//! slot. Readers that take longer give up the attempt ([`Retry::Slow`]);
//! the checksum and key check catch every tear or reuse regardless.

use std::ops::Range;

use crate::layout::{ITEM_HEADER_LEN, KeyHash, RegionHeader, Slot, bucket_slots, decode_item, key_hash};
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
    Retry(Retry),
}

/// Result of the item reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Hit(Hit),
    Miss,
    Retry(Retry),
}

/// One GET attempt for one key.
#[derive(Debug, Clone)]
pub struct Lookup {
    kh: KeyHash,
    bucket_offsets: [u64; 2],
    hint: Option<Hint>,
    started: u64,
    grace: u64,
    enforce_grace: bool,
    candidates: Vec<(u8, u8, Slot)>,
}

impl Lookup {
    /// Starts an attempt at time `now` (nanoseconds on the caller's
    /// monotonic clock, taken before the first read is posted).
    pub fn new(key: &[u8], header: &RegionHeader, hint: Option<Hint>, now: u64) -> Lookup {
        let kh = key_hash(key, header.hash_seed, header.bucket_count);
        Lookup {
            kh,
            bucket_offsets: kh.buckets.map(|b| header.bucket_offset(b)),
            hint: hint.filter(|h| h.which < 2 && (h.index as usize) < SLOTS_PER_BUCKET),
            started: now,
            grace: header.grace_nanos,
            enforce_grace: true,
            candidates: Vec::new(),
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
    pub fn after_buckets(&mut self, key: &[u8], buckets: [&[u8]; 2], hinted: Option<&[u8]>, now: u64) -> AfterBuckets {
        if buckets.iter().any(|b| b.len() != BUCKET_LEN) {
            return AfterBuckets::Retry(Retry::Torn);
        }
        let slots = buckets.map(bucket_slots);
        if let (Some(h), Some(item)) = (self.hint, hinted)
            && slots[h.which as usize][h.index as usize] == h.slot.pack()
            && !self.too_slow(now)
            && let Ok(it) = decode_item(item)
            && it.key == key
        {
            let start = ITEM_HEADER_LEN + key.len();
            return AfterBuckets::Hit(Hit {
                item: 0,
                value: start..start + it.value.len(),
                version: it.version,
                hint: h,
            });
        }
        self.candidates.clear();
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
            (true, false) => AfterBuckets::Miss,
        }
    }

    /// The second batch: every item whose slot matched the fingerprint.
    pub fn item_reads(&self, out: &mut Vec<ReadSpec>) {
        for &(_, _, s) in &self.candidates {
            out.push(ReadSpec { offset: s.offset(), len: s.len() as u32 });
        }
    }

    /// Number of reads [`Lookup::item_reads`] adds.
    pub fn item_read_count(&self) -> usize {
        self.candidates.len()
    }

    /// Judges the items read for [`Lookup::item_reads`], in that order.
    pub fn after_items(&self, key: &[u8], items: &[&[u8]], now: u64) -> Outcome {
        assert_eq!(items.len(), self.candidates.len(), "one buffer per item read");
        if self.too_slow(now) {
            return Outcome::Retry(Retry::Slow);
        }
        let mut retry = None;
        for (i, (&(which, index, slot), buf)) in self.candidates.iter().zip(items).enumerate() {
            match decode_item(buf) {
                Ok(it) if it.key == key => {
                    let start = ITEM_HEADER_LEN + key.len();
                    return Outcome::Hit(Hit {
                        item: i,
                        value: start..start + it.value.len(),
                        version: it.version,
                        hint: Hint { which, index, slot },
                    });
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
    use crate::limits::UNIT;
    use proptest::prelude::*;
    use std::collections::HashMap;

    const BUCKETS: u64 = 4;
    const REGION: usize = 2 * 1024 * 1024 + 64 * 1024;

    struct Sim {
        header: RegionHeader,
        mem: Vec<u8>,
        free: Vec<(u64, usize)>,
        next: u64,
        version: u64,
        /// Every value each key ever had, by version.
        history: HashMap<Vec<u8>, HashMap<u64, Vec<u8>>>,
    }

    impl Sim {
        fn new() -> Sim {
            let header = RegionHeader::plan(REGION as u64, BUCKETS, 99, 1, 1_000).unwrap();
            let next = header.data_offset;
            Sim { header, mem: vec![0; REGION], free: Vec::new(), next, version: 0, history: HashMap::new() }
        }

        fn slot_at(&self, off: u64) -> u64 {
            u64::from_le_bytes(self.mem[off as usize..off as usize + 8].try_into().unwrap())
        }

        fn set_slot(&mut self, off: u64, v: u64) {
            self.mem[off as usize..off as usize + 8].copy_from_slice(&v.to_le_bytes());
        }

        fn find(&self, key: &[u8]) -> Option<u64> {
            let kh = key_hash(key, self.header.hash_seed, BUCKETS);
            for b in kh.buckets {
                for i in 0..SLOTS_PER_BUCKET as u64 {
                    let off = self.header.bucket_offset(b) + 8 * i;
                    if let Some(s) = Slot::unpack(self.slot_at(off)) {
                        let item = decode_item(&self.mem[s.offset() as usize..s.offset() as usize + s.len()]).unwrap();
                        if item.key == key {
                            return Some(off);
                        }
                    }
                }
            }
            None
        }

        /// Writes key=value out of place, publishes it, and frees the old
        /// item at once, so its space is reused by the next write.
        fn put(&mut self, key: &[u8], value: &[u8]) {
            let units = item_units(key.len(), value.len());
            let at = match self.free.iter().position(|&(_, u)| u >= units) {
                Some(i) => self.free.swap_remove(i).0,
                None => {
                    let at = self.next;
                    self.next += (units * UNIT) as u64;
                    assert!(self.next as usize <= REGION, "simulated region full");
                    at
                }
            };
            self.version += 1;
            let mut buf = Vec::new();
            encode_item(key, value, self.version, 0, &mut buf);
            self.mem[at as usize..at as usize + buf.len()].copy_from_slice(&buf);
            self.history.entry(key.to_vec()).or_default().insert(self.version, value.to_vec());
            let kh = key_hash(key, self.header.hash_seed, BUCKETS);
            let new = Slot::new(kh.fingerprint, at, units).pack();
            let slot_off = match self.find(key) {
                Some(off) => {
                    let old = Slot::unpack(self.slot_at(off)).unwrap();
                    self.free.push((old.offset(), old.units as usize));
                    off
                }
                None => {
                    let mut empty = None;
                    'b: for b in kh.buckets {
                        for i in 0..SLOTS_PER_BUCKET as u64 {
                            let off = self.header.bucket_offset(b) + 8 * i;
                            if self.slot_at(off) == 0 {
                                empty = Some(off);
                                break 'b;
                            }
                        }
                    }
                    match empty {
                        Some(off) => off,
                        None => {
                            self.free.push((at, units));
                            return;
                        }
                    }
                }
            };
            self.set_slot(slot_off, new);
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
        /// Tears fall at any byte, inside slots too, which is harsher than
        /// the shm and engine readers (whole aligned words) and covers NICs
        /// that give no atomicity within a read.
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

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Writers run between and during every read; whatever the reader
        /// returns is a value the key really had, and it never says "not
        /// found" for a key that was stored throughout.
        #[test]
        fn reader_never_returns_unverified_bytes(
            steps in prop::collection::vec((0usize..6, 0usize..400, any::<usize>(), any::<usize>(), any::<bool>()), 1..300)
        ) {
            let mut sim = Sim::new();
            let keys: Vec<Vec<u8>> = (0..6u8).map(|k| vec![b'a' + k; 3 + k as usize]).collect();
            for k in &keys {
                sim.put(k, &value_for(k, 0, 10));
            }
            let mut hints: HashMap<usize, Hint> = HashMap::new();
            let (mut hits, mut retries) = (0, 0);
            for (ki, len, tear1, tear2, use_hint) in steps {
                let key = &keys[ki];
                let mut look = Lookup::new(key, &sim.header, use_hint.then(|| hints.get(&ki).copied()).flatten(), 0)
                    .without_grace_check();
                let mut specs = Vec::new();
                look.first_reads(&mut specs);
                // A writer changes the region while the first batch is read.
                let before = sim.snapshot(&specs);
                sim.put(key, &value_for(key, sim.version, len));
                sim.put(&keys[(ki + 1) % keys.len()], &value_for(key, sim.version, len / 2));
                let bufs = sim.read(&before, &specs, tear1);
                let hinted = bufs.get(2).map(|b| &b[..]);
                let outcome = match look.after_buckets(key, [&bufs[0], &bufs[1]], hinted, 0) {
                    AfterBuckets::Hit(h) => Outcome::Hit(h),
                    AfterBuckets::Miss => Outcome::Miss,
                    AfterBuckets::Retry(r) => Outcome::Retry(r),
                    AfterBuckets::ReadItems => {
                        let mut specs = Vec::new();
                        look.item_reads(&mut specs);
                        // ... and again while the items are read.
                        let before = sim.snapshot(&specs);
                        sim.put(key, &value_for(key, sim.version, len + 7));
                        let items = sim.read(&before, &specs, tear2);
                        let refs: Vec<&[u8]> = items.iter().map(|b| &b[..]).collect();
                        match look.after_items(key, &refs, 0) {
                            Outcome::Hit(h) => {
                                let v = &items[h.item][h.value.clone()];
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
                        prop_assert_eq!(Some(&v.to_vec()), sim.history[key].get(&h.version), "hinted value is not one the key had");
                        hints.insert(ki, h.hint);
                        hits += 1;
                    }
                    Outcome::Miss => prop_assert!(false, "a stored key was reported missing"),
                    Outcome::Retry(_) => retries += 1,
                }
            }
            prop_assert!(hits + retries > 0);
        }
    }

    /// Found by the property test: a slot torn inside its word can read as
    /// "offset 0", which is not a slot; that is a retry, never "missing".
    #[test]
    fn a_torn_slot_is_a_retry_not_a_miss() {
        let mut sim = Sim::new();
        sim.put(b"k", b"v");
        let off = sim.find(b"k").unwrap();
        let slot = Slot::unpack(sim.slot_at(off)).unwrap();
        let mut look = Lookup::new(b"k", &sim.header, None, 0);
        let mut specs = Vec::new();
        look.first_reads(&mut specs);
        let mut bufs = sim.snapshot(&specs);
        let which = specs.iter().position(|s| (s.offset..s.offset + 64).contains(&off)).unwrap();
        let at = (off - specs[which].offset) as usize;
        // Keep fingerprint and length, lose the offset bits.
        let torn = slot.pack() & !((1u64 << 33) - 1);
        bufs[which][at..at + 8].copy_from_slice(&torn.to_le_bytes());
        assert_eq!(look.after_buckets(b"k", [&bufs[0], &bufs[1]], None, 0), AfterBuckets::Retry(Retry::Torn));
    }

    /// Found by fuzzing (`fuzz::read_lookup`): a backend that hands back a
    /// bucket of another length than asked for (an engine reply is the
    /// server's word) made `bucket_slots` panic in the client.
    #[test]
    fn a_bucket_of_the_wrong_length_is_a_retry_not_a_panic() {
        let mut sim = Sim::new();
        sim.put(b"k", b"v");
        let mut look = Lookup::new(b"k", &sim.header, None, 0);
        let mut specs = Vec::new();
        look.first_reads(&mut specs);
        let bufs = sim.snapshot(&specs);
        for short in [&bufs[0][..0], &bufs[0][..63]] {
            assert_eq!(look.after_buckets(b"k", [short, &bufs[1]], None, 0), AfterBuckets::Retry(Retry::Torn));
            assert_eq!(look.after_buckets(b"k", [&bufs[0], short], None, 0), AfterBuckets::Retry(Retry::Torn));
        }
        let long = [bufs[0].as_slice(), &[0u8; 8]].concat();
        assert_eq!(look.after_buckets(b"k", [&long, &bufs[1]], None, 0), AfterBuckets::Retry(Retry::Torn));
    }

    #[test]
    fn slow_attempts_are_abandoned() {
        let sim = {
            let mut s = Sim::new();
            s.put(b"k", b"v");
            s
        };
        let mut look = Lookup::new(b"k", &sim.header, None, 0);
        let mut specs = Vec::new();
        look.first_reads(&mut specs);
        let bufs: Vec<Vec<u8>> = sim.snapshot(&specs);
        assert_eq!(look.after_buckets(b"k", [&bufs[0], &bufs[1]], None, 10), AfterBuckets::ReadItems);
        let mut specs = Vec::new();
        look.item_reads(&mut specs);
        let items: Vec<Vec<u8>> = sim.snapshot(&specs);
        let refs: Vec<&[u8]> = items.iter().map(|b| &b[..]).collect();
        assert_eq!(look.after_items(b"k", &refs, sim.header.grace_nanos), Outcome::Retry(Retry::Slow));
        match look.after_items(b"k", &refs, sim.header.grace_nanos - 1) {
            Outcome::Hit(h) => assert_eq!(&items[h.item][h.value], b"v"),
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn missing_key_is_a_miss_and_a_stale_hint_falls_back() {
        let mut sim = Sim::new();
        sim.put(b"k", b"v1");
        let mut look = Lookup::new(b"nope", &sim.header, None, 0);
        let mut specs = Vec::new();
        look.first_reads(&mut specs);
        let bufs: Vec<Vec<u8>> = sim.snapshot(&specs);
        // Fingerprints of other keys may match; then items decide.
        match look.after_buckets(b"nope", [&bufs[0], &bufs[1]], None, 0) {
            AfterBuckets::Miss => {}
            AfterBuckets::ReadItems => {
                let mut specs = Vec::new();
                look.item_reads(&mut specs);
                let items: Vec<Vec<u8>> = sim.snapshot(&specs);
                let refs: Vec<&[u8]> = items.iter().map(|b| &b[..]).collect();
                assert_eq!(look.after_items(b"nope", &refs, 0), Outcome::Retry(Retry::OtherKey));
            }
            o => panic!("{o:?}"),
        }
        // A hint whose slot changed is not trusted, even if its item verifies.
        let kh = key_hash(b"k", sim.header.hash_seed, BUCKETS);
        let off = sim.find(b"k").unwrap();
        let which = (0..2).find(|&w| {
            let b = sim.header.bucket_offset(kh.buckets[w]);
            (b..b + 64).contains(&off)
        });
        let which = which.unwrap() as u8;
        let index = ((off - sim.header.bucket_offset(kh.buckets[which as usize])) / 8) as u8;
        let hint = Hint { which, index, slot: Slot::unpack(sim.slot_at(off)).unwrap() };
        sim.put(b"k", b"v2");
        let mut look = Lookup::new(b"k", &sim.header, Some(hint), 0);
        let mut specs = Vec::new();
        look.first_reads(&mut specs);
        assert_eq!(specs.len(), 3);
        let bufs: Vec<Vec<u8>> = sim.snapshot(&specs);
        assert_eq!(look.after_buckets(b"k", [&bufs[0], &bufs[1]], Some(&bufs[2]), 0), AfterBuckets::ReadItems);
    }
}

//! The key-value store over a region: the index writer, item allocation,
//! retirement with a grace period, and the server's own (RPC) reads.
//!
//! Writers serialise on one mutex; readers take no lock. A write puts the
//! new item in free space, then publishes it with one release store of its
//! 8-byte slot; the old item is retired. Retired space is reused only when
//! (a) no server thread can still be reading it (crossbeam-epoch) and
//! (b) the remote-reader grace period has passed since it was unlinked, so
//! a one-sided reader that saw the old slot less than `grace` ago still
//! finds the old bytes intact.
//!
//! The region is shared memory, so the server never trusts what it reads
//! back from it for its own decisions. It keeps a private copy of every
//! slot word and reads slots only from that copy, so the allocator only
//! ever frees blocks the writer itself allocated; a slot word in the region
//! that differs from the copy is counted (`foreign_slots`), logged and put
//! back. Item bytes are read with bounds checks and verified; one that
//! fails is counted (`corrupt_reads`) and logged, never a panic.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_epoch as epoch;
use dmkv_common::error::{Error, check_key, check_value};
use dmkv_common::layout::{self, KeyHash, RegionHeader, Slot, decode_item, encode_item, item_units, key_hash};
use dmkv_common::limits::{SLOTS_PER_BUCKET, UNIT};

use tracing::warn;

use crate::alloc::{Allocator, Space};
use crate::lock::lock;
use crate::region::Region;

mod evacuate;

pub use evacuate::{Candidate, Relocation};

/// Counters exported by STATS. Relaxed atomics: they are statistics.
#[derive(Debug, Default)]
pub struct Counters {
    pub gets: AtomicU64,
    pub get_hits: AtomicU64,
    pub puts: AtomicU64,
    pub deletes: AtomicU64,
    pub out_of_memory: AtomicU64,
    pub index_full: AtomicU64,
    pub items: AtomicU64,
    pub used_bytes: AtomicU64,
    /// Items that failed verification when the server read them back:
    /// the region was written behind the server's back (or a bug).
    pub corrupt_reads: AtomicU64,
    /// Slot words found in the region that differ from the server's own
    /// copy of the index: something else wrote the shared index. Each is
    /// put back.
    pub foreign_slots: AtomicU64,
    /// Items the compactor moved, and their bytes.
    pub compactor_moves: AtomicU64,
    pub compactor_moved_bytes: AtomicU64,
    /// Ranges the compactor started to empty, emptied, and gave up on.
    pub compactor_ranges: AtomicU64,
    pub compactor_ranges_done: AtomicU64,
    pub compactor_ranges_abandoned: AtomicU64,
}

/// At most one warning a second about a region written behind the
/// server's back: whoever scribbles on it could otherwise flood the log.
/// The counters say how many there were.
struct LogLimit {
    clock: Instant,
    /// When the last warning was let through, in ms since `clock`, plus one
    /// interval (so that the first one passes).
    last_ms: AtomicU64,
}

impl LogLimit {
    const INTERVAL_MS: u64 = 1000;

    fn new() -> Self {
        LogLimit { clock: Instant::now(), last_ms: AtomicU64::new(0) }
    }

    fn allow(&self) -> bool {
        let now = self.clock.elapsed().as_millis() as u64 + Self::INTERVAL_MS;
        let last = self.last_ms.load(Ordering::Relaxed);
        now >= last + Self::INTERVAL_MS
            && self.last_ms.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }
}

/// Most epoch-collector flushes one [`Store::reclaim_wait`] makes.
const EPOCH_FLUSHES: usize = 64;

/// A block unlinked from the index and waiting out its grace period.
#[derive(Debug, Clone, Copy)]
struct Retired {
    at: u64,
    units: usize,
    since: Instant,
}

struct Writer {
    alloc: Allocator,
    next_version: u64,
    /// Blocks past their epoch but maybe not their time grace, oldest first.
    waiting: VecDeque<Retired>,
    scratch: Vec<u8>,
}

/// Where a key's slot was found: which of its two buckets, the slot's
/// index there and the packed slot word (a one-sided reader's hint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub which: u8,
    pub index: u8,
    pub slot: u64,
}

/// The store: a region laid out per [`RegionHeader`], and its writer.
pub struct Store {
    region: Arc<Region>,
    header: RegionHeader,
    grace: Duration,
    /// The server's own copy of every slot word (bucket-major, eight per
    /// bucket), private to this process. The writer stores each slot here
    /// and in the region; the server's lookups read only this copy.
    index: Box<[AtomicU64]>,
    /// Recovers from poisoning (`crate::lock`). A write's one commit point
    /// is its slot store; what it did before (take a block) that did not
    /// reach it is at worst leaked space, never a block both free and
    /// linked. The allocator and the retire queue complete each update
    /// with nothing that can panic midway; every assertion on the way
    /// checks an invariant the writer itself keeps, not region contents.
    writer: Mutex<Writer>,
    /// Blocks whose epoch has passed, handed over by crossbeam-epoch's
    /// deferred functions (which may run on any thread). Recovers from
    /// poisoning: pushes and drains leave a valid Vec whatever happens.
    epoch_done: Arc<Mutex<Vec<Retired>>>,
    /// Units retired and not yet handed back through `epoch_done`: the
    /// epoch collector works through its backlog a bounded amount per
    /// call, so a burst of retirements (the compactor's) can sit there.
    in_epoch: Arc<AtomicU64>,
    pub counters: Counters,
    log_limit: LogLimit,
}

impl Store {
    /// Formats `region` with `bucket_count` buckets and an empty index.
    pub fn format(
        region: Arc<Region>,
        bucket_count: u64,
        hash_seed: u64,
        epoch: u64,
        grace: Duration,
    ) -> Result<Store, dmkv_common::LayoutError> {
        let header = RegionHeader::plan(region.len() as u64, bucket_count, hash_seed, epoch, grace.as_nanos() as u64)?;
        region.write(0, &header.encode());
        let start = header.data_offset / UNIT as u64;
        let end = start + header.data_len / UNIT as u64;
        // The formatted index is all zeros, and so is this copy of it.
        let index = (0..header.bucket_count * SLOTS_PER_BUCKET as u64).map(|_| AtomicU64::new(Slot::EMPTY)).collect();
        Ok(Store {
            region,
            header,
            grace,
            index,
            writer: Mutex::new(Writer {
                alloc: Allocator::new(start, end),
                next_version: 1,
                waiting: VecDeque::new(),
                scratch: Vec::new(),
            }),
            epoch_done: Arc::new(Mutex::new(Vec::new())),
            in_epoch: Arc::default(),
            counters: Counters::default(),
            log_limit: LogLimit::new(),
        })
    }

    /// How long retired space stays intact for one-sided readers.
    pub fn grace(&self) -> Duration {
        self.grace
    }

    /// The region's layout.
    pub fn header(&self) -> &RegionHeader {
        &self.header
    }

    /// The region.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    fn slot_offset(&self, bucket: u64, i: usize) -> u64 {
        self.header.bucket_offset(bucket) + (i * 8) as u64
    }

    /// Slot `i` of `bucket` as the server itself last wrote it.
    fn own_slot(&self, bucket: u64, i: usize) -> u64 {
        // Acquire: pairs with `set_slot`'s release, so the item it points
        // to is fully written before a lookup reads it.
        self.index[bucket as usize * SLOTS_PER_BUCKET + i].load(Ordering::Acquire)
    }

    /// Publishes `v` as slot `i` of `bucket`, in the region (for one-sided
    /// readers) and in the server's own copy. Writer only.
    fn set_slot(&self, bucket: u64, i: usize, v: u64) {
        self.region.store_slot(self.slot_offset(bucket, i), v);
        self.index[bucket as usize * SLOTS_PER_BUCKET + i].store(v, Ordering::Release);
    }

    /// Compares the region's slot words of `bucket` with the server's own
    /// and puts back any that differ: one-sided readers then find the
    /// server's items again. Writer only (no store of its own races this).
    fn audit_bucket(&self, bucket: u64) {
        for i in 0..SLOTS_PER_BUCKET {
            let own = self.own_slot(bucket, i);
            let off = self.slot_offset(bucket, i);
            let seen = self.region.load_slot(off);
            if seen != own {
                let n = self.counters.foreign_slots.fetch_add(1, Ordering::Relaxed) + 1;
                if self.log_limit.allow() {
                    warn!(
                        bucket,
                        slot = i,
                        found = format_args!("{seen:#018x}"),
                        expected = format_args!("{own:#018x}"),
                        foreign_slots = n,
                        "the region's index was written by someone else; restoring the server's slot"
                    );
                }
                self.region.store_slot(off, own);
            }
        }
    }

    /// Counts and logs an item of the server's own index that does not
    /// verify: its bytes in the region were written behind its back.
    fn corrupt_item(&self, slot: Slot, why: &dyn std::fmt::Display) {
        let n = self.counters.corrupt_reads.fetch_add(1, Ordering::Relaxed) + 1;
        if self.log_limit.allow() {
            warn!(
                offset = slot.offset(),
                len = slot.len(),
                corrupt_reads = n,
                "an item in the region does not verify ({why}); it was written by someone else"
            );
        }
    }

    /// Reads the whole item of `slot` into `buf`; whether it verifies.
    /// Slots come from the server's own index, so a failure is never a
    /// torn read (items are immutable while linked, and lookups hold an
    /// epoch guard): it is counted and logged.
    fn read_verified(&self, slot: Slot, buf: &mut Vec<u8>) -> bool {
        buf.resize(slot.len(), 0);
        if let Err(e) = self.region.try_read(slot.offset(), buf) {
            self.corrupt_item(slot, &e);
            return false;
        }
        match decode_item(buf) {
            Ok(_) => true,
            Err(e) => {
                self.corrupt_item(slot, &e);
                false
            }
        }
    }

    /// Whether the item of `slot` is `key`'s, reading only its header and
    /// key. Only for the writer: it holds the writer lock, and published
    /// items never change, so what it reads cannot be torn.
    fn item_has_key(&self, slot: Slot, key: &[u8], buf: &mut Vec<u8>) -> bool {
        // At least one unit (64 bytes), so the key length below is inside.
        let len = (layout::ITEM_HEADER_LEN + key.len()).min(slot.len());
        buf.resize(len, 0);
        if self.region.try_read(slot.offset(), buf).is_err() {
            return false;
        }
        let key_len = u32::from_le_bytes(buf[16..20].try_into().expect("4 bytes")) as usize;
        key_len == key.len()
            && buf.len() == layout::ITEM_HEADER_LEN + key.len()
            && &buf[layout::ITEM_HEADER_LEN..] == key
    }

    /// Finds the slot holding `key` for a lookup: (bucket, index, slot),
    /// with `buf` holding the verified item.
    fn find(&self, kh: &KeyHash, key: &[u8], buf: &mut Vec<u8>) -> Option<(u64, usize, Slot)> {
        for &b in &kh.buckets {
            for i in 0..SLOTS_PER_BUCKET {
                let Some(slot) = Slot::unpack(self.own_slot(b, i)) else { continue };
                if slot.fingerprint == kh.fingerprint
                    && self.read_verified(slot, buf)
                    && decode_item(buf).is_ok_and(|item| item.key == key)
                {
                    return Some((b, i, slot));
                }
            }
        }
        None
    }

    /// Finds the slot holding `key` for a write, reading just the items'
    /// headers and keys. Writer only. On the way it repairs the region's
    /// copy of both buckets, and unlinks (and retires) items of its own
    /// index that no longer verify: their value is lost either way, and
    /// left linked they would shadow the key's next write or hold their
    /// space for good.
    fn find_for_write(
        &self,
        kh: &KeyHash,
        key: &[u8],
        buf: &mut Vec<u8>,
        guard: &epoch::Guard,
    ) -> Option<(u64, usize, Slot)> {
        for &b in &kh.buckets {
            self.audit_bucket(b);
        }
        for &b in &kh.buckets {
            for i in 0..SLOTS_PER_BUCKET {
                let Some(slot) = Slot::unpack(self.own_slot(b, i)) else { continue };
                if slot.fingerprint != kh.fingerprint {
                    continue;
                }
                if self.item_has_key(slot, key, buf) {
                    return Some((b, i, slot));
                }
                // Another key with the same fingerprint (rare), or an item
                // scribbled over: only a full check tells them apart.
                if !self.read_verified(slot, buf) {
                    self.set_slot(b, i, Slot::EMPTY);
                    self.counters.items.fetch_sub(1, Ordering::Relaxed);
                    self.retire(slot, guard);
                }
            }
        }
        None
    }

    /// Looks `key` up; returns (value, version).
    pub fn get(&self, key: &[u8]) -> Result<Option<(Bytes, u64)>, Error> {
        Ok(self.get_located(key)?.map(|(v, version, _)| (v, version)))
    }

    /// Looks `key` up; returns (value, version, where its slot is).
    pub fn get_located(&self, key: &[u8]) -> Result<Option<(Bytes, u64, Location)>, Error> {
        check_key(key)?;
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        let kh = key_hash(key, self.header.hash_seed, self.header.bucket_count);
        let _guard = epoch::pin();
        let mut buf = Vec::new();
        let Some((b, index, slot)) = self.find(&kh, key, &mut buf) else { return Ok(None) };
        self.counters.get_hits.fetch_add(1, Ordering::Relaxed);
        let item = decode_item(&buf).expect("verified in find");
        let (version, start, len) = (item.version, layout::ITEM_HEADER_LEN + item.key.len(), item.value.len());
        let which = if b == kh.buckets[0] { 0 } else { 1 };
        let at = Location { which, index: index as u8, slot: slot.pack() };
        Ok(Some((Bytes::from(buf).slice(start..start + len), version, at)))
    }

    /// Stores `value` under `key`; returns the write's version.
    ///
    /// On any error nothing changed: the old value (if any) stays readable.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<u64, Error> {
        check_key(key)?;
        check_value(value)?;
        let kh = key_hash(key, self.header.hash_seed, self.header.bucket_count);
        let units = item_units(key.len(), value.len());
        let guard = epoch::pin();
        let mut w = lock(&self.writer);
        let w = &mut *w;
        let mut probe = Vec::new();
        let existing = self.find_for_write(&kh, key, &mut probe, &guard);
        let target = match existing {
            Some((b, i, _)) => (b, i),
            None => match self.free_slot(&kh) {
                Some(t) => t,
                None => {
                    self.counters.index_full.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::IndexFull);
                }
            },
        };
        self.reclaim(w, &guard);
        let Some(at) = w.alloc.alloc(units) else {
            self.counters.out_of_memory.fetch_add(1, Ordering::Relaxed);
            return Err(Error::OutOfMemory);
        };
        let version = w.next_version;
        w.next_version += 1;
        w.scratch.clear();
        encode_item(key, value, version, 0, &mut w.scratch);
        let offset = at * UNIT as u64;
        // Unit-aligned, and the write's padding to a whole word stays inside
        // the item's units.
        self.region.write(offset, &w.scratch);
        let new_slot = Slot::new(kh.fingerprint, offset, units);
        self.set_slot(target.0, target.1, new_slot.pack());
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.counters.used_bytes.fetch_add((units * UNIT) as u64, Ordering::Relaxed);
        match existing {
            Some((_, _, old)) => self.retire(old, &guard),
            None => {
                self.counters.items.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(version)
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &[u8]) -> Result<bool, Error> {
        check_key(key)?;
        let kh = key_hash(key, self.header.hash_seed, self.header.bucket_count);
        let guard = epoch::pin();
        let _w = lock(&self.writer);
        let mut probe = Vec::new();
        let Some((b, i, old)) = self.find_for_write(&kh, key, &mut probe, &guard) else { return Ok(false) };
        self.set_slot(b, i, Slot::EMPTY);
        self.counters.deletes.fetch_add(1, Ordering::Relaxed);
        self.counters.items.fetch_sub(1, Ordering::Relaxed);
        self.retire(old, &guard);
        Ok(true)
    }

    /// An empty slot in the emptier candidate bucket, to spread load.
    fn free_slot(&self, kh: &KeyHash) -> Option<(u64, usize)> {
        let mut best: Option<(usize, u64, usize)> = None;
        for &b in &kh.buckets {
            let mut empties = 0;
            let mut first = None;
            for i in 0..SLOTS_PER_BUCKET {
                if self.own_slot(b, i) == Slot::EMPTY {
                    empties += 1;
                    first.get_or_insert(i);
                }
            }
            if let Some(i) = first
                && best.is_none_or(|(e, _, _)| empties > e)
            {
                best = Some((empties, b, i));
            }
        }
        best.map(|(_, b, i)| (b, i))
    }

    /// Hands an unlinked block to the epoch collector; its space comes back
    /// through `epoch_done` and then waits out the time grace in `reclaim`.
    fn retire(&self, old: Slot, guard: &epoch::Guard) {
        let r = Retired { at: old.offset_units, units: old.units as usize, since: Instant::now() };
        let done = Arc::clone(&self.epoch_done);
        let in_epoch = Arc::clone(&self.in_epoch);
        in_epoch.fetch_add(r.units as u64, Ordering::Relaxed);
        guard.defer(move || {
            lock(&done).push(r);
            in_epoch.fetch_sub(r.units as u64, Ordering::Relaxed);
        });
        self.counters.used_bytes.fetch_sub((r.units * UNIT) as u64, Ordering::Relaxed);
    }

    /// Frees retired blocks whose epoch and grace period have both passed.
    fn reclaim(&self, w: &mut Writer, guard: &epoch::Guard) {
        guard.flush();
        {
            let mut done = lock(&self.epoch_done);
            if !done.is_empty() {
                done.sort_by_key(|r| r.since);
                w.waiting.extend(done.drain(..));
            }
        }
        let now = Instant::now();
        while let Some(r) = w.waiting.front() {
            if now.duration_since(r.since) < self.grace {
                break;
            }
            w.alloc.free(r.at, r.units);
            w.waiting.pop_front();
        }
    }

    /// If space is waiting out its grace period, how long until the oldest
    /// of it is free. A PUT that failed with out-of-memory may retry then.
    pub fn reclaim_wait(&self) -> Option<Duration> {
        let mut guard = epoch::pin();
        let mut w = lock(&self.writer);
        // Work through the collector's backlog, boundedly: each flush
        // runs a few bags of deferred functions. Repinned in between: a
        // guard held at one epoch lets the global epoch advance at most
        // once, and garbage is freed two advances after it was retired.
        for _ in 0..EPOCH_FLUSHES {
            if self.in_epoch.load(Ordering::Relaxed) == 0 {
                break;
            }
            guard.flush();
            guard.repin();
        }
        self.reclaim(&mut w, &guard);
        let pending_epoch = !lock(&self.epoch_done).is_empty() || self.in_epoch.load(Ordering::Relaxed) > 0;
        match w.waiting.front() {
            Some(r) => Some(self.grace.saturating_sub(r.since.elapsed())),
            None if pending_epoch => Some(Duration::ZERO),
            None => None,
        }
    }

    /// Units retired and not yet back from the epoch collector.
    pub fn in_epoch_units(&self) -> u64 {
        self.in_epoch.load(Ordering::Relaxed)
    }

    /// The allocator's free-space figures, in units.
    pub fn space(&self) -> Space {
        lock(&self.writer).alloc.space()
    }

    /// The data area, in units.
    pub fn data_units(&self) -> std::ops::Range<u64> {
        let start = self.header.data_offset / UNIT as u64;
        start..start + self.header.data_len / UNIT as u64
    }

    /// Number of index slots.
    pub fn slot_count(&self) -> u64 {
        self.header.bucket_count * SLOTS_PER_BUCKET as u64
    }

    /// Test hook: scribbles over `key`'s entry in the shared region as a
    /// client that could write it would. The key's slot word gets its
    /// offset bits flipped (pointing far outside the region), every empty
    /// slot of its two buckets gets a bogus word with the key's fingerprint,
    /// and with `garble_item` the item's header and key are overwritten
    /// too. The server's own copy of the index is left alone: that is what
    /// must keep the server working. Returns whether `key` was found.
    #[doc(hidden)]
    pub fn scribble_for_tests(&self, key: &[u8], garble_item: bool) -> bool {
        let kh = key_hash(key, self.header.hash_seed, self.header.bucket_count);
        let _w = lock(&self.writer);
        let mut buf = Vec::new();
        let Some((b, i, slot)) = self.find(&kh, key, &mut buf) else { return false };
        let offset_bits = (1u64 << 33) - 1;
        self.region.store_slot(self.slot_offset(b, i), slot.pack() ^ offset_bits);
        let bogus = Slot { fingerprint: kh.fingerprint, units: 3, offset_units: offset_bits - 5 }.pack();
        for &b in &kh.buckets {
            for i in 0..SLOTS_PER_BUCKET {
                if self.own_slot(b, i) == Slot::EMPTY {
                    self.region.store_slot(self.slot_offset(b, i), bogus);
                }
            }
        }
        if garble_item {
            self.region.write(slot.offset(), &[0xA5; layout::ITEM_HEADER_LEN + 8]);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(mib: usize, buckets: u64, grace: Duration) -> Store {
        let region = Arc::new(Region::create("t", mib << 20).unwrap());
        Store::format(region, buckets, 7, 1, grace).unwrap()
    }

    #[test]
    fn put_get_delete_overwrite() {
        let s = store(4, 1024, Duration::ZERO);
        assert_eq!(s.get(b"k").unwrap(), None);
        let v1 = s.put(b"k", b"one").unwrap();
        assert_eq!(s.get(b"k").unwrap(), Some((Bytes::from_static(b"one"), v1)));
        let v2 = s.put(b"k", &[9u8; 5000]).unwrap();
        assert!(v2 > v1);
        assert_eq!(s.get(b"k").unwrap().unwrap().0.len(), 5000);
        assert!(s.delete(b"k").unwrap());
        assert!(!s.delete(b"k").unwrap());
        assert_eq!(s.get(b"k").unwrap(), None);
        assert_eq!(s.counters.items.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn bad_input_changes_nothing() {
        let s = store(4, 1024, Duration::ZERO);
        s.put(b"k", b"v").unwrap();
        assert_eq!(s.put(b"", b"v"), Err(Error::EmptyKey));
        assert_eq!(s.put(&[1; 1025], b"v"), Err(Error::KeyTooLarge(1025)));
        assert_eq!(s.put(b"k", &vec![0; (1 << 20) + 1]), Err(Error::ValueTooLarge((1 << 20) + 1)));
        assert_eq!(s.get(b"k").unwrap().unwrap().0, Bytes::from_static(b"v"));
    }

    #[test]
    fn full_store_keeps_every_acknowledged_value() {
        let s = store(2, 256, Duration::ZERO);
        let mut acked = Vec::new();
        for i in 0..100_000u32 {
            match s.put(format!("key{i}").as_bytes(), &[i as u8; 900]) {
                Ok(_) => acked.push(i),
                Err(Error::OutOfMemory | Error::IndexFull) => {}
                Err(e) => panic!("{e}"),
            }
            if i > 5000 && acked.len() < i as usize / 2 {
                break;
            }
        }
        assert!(acked.len() > 100);
        for i in &acked {
            assert_eq!(s.get(format!("key{i}").as_bytes()).unwrap().unwrap().0, vec![*i as u8; 900]);
        }
    }

    #[test]
    fn space_is_reused_only_after_the_grace_period() {
        let s = store(2, 64, Duration::from_secs(3600));
        let mut n = 0;
        while s.put(b"k", &[n as u8; 1000]).is_ok() {
            n += 1;
            assert!(n < 10_000, "grace period never held space back");
        }
        // Every overwrite's old block is still waiting: the store is full.
        assert!(s.reclaim_wait().is_some());
        assert_eq!(s.get(b"k").unwrap().unwrap().0, vec![(n - 1) as u8; 1000]);

        let s = store(2, 64, Duration::ZERO);
        for n in 0..10_000u32 {
            s.put(b"k", &[n as u8; 1000]).unwrap();
        }
    }

    /// A region scribbled over as a hostile client would (the issue's
    /// reproduction: flipped offset bits in slot words) must not crash the
    /// server or stop it taking writes, nor lose values it was not told
    /// to forget, nor free space it did not allocate.
    #[test]
    fn a_scribbled_region_is_counted_repaired_and_never_trusted() {
        let s = store(4, 1024, Duration::ZERO);
        let value = |i: u32, round: u32| format!("value-{i}-{round}").repeat(i as usize % 5 + 1);
        for i in 0..300u32 {
            s.put(format!("k{i}").as_bytes(), value(i, 0).as_bytes()).unwrap();
        }
        // k0..k19: slot words scribbled; k20..k29: item bytes too.
        for i in 0..30u32 {
            assert!(s.scribble_for_tests(format!("k{i}").as_bytes(), i >= 20));
        }
        // Lookups go by the server's own index: slot-only scribbles change
        // nothing for it; garbled items are gone, and counted.
        for i in 0..300u32 {
            let got = s.get(format!("k{i}").as_bytes()).unwrap().map(|(v, _)| v);
            let want = (!(20..30).contains(&i)).then(|| Bytes::from(value(i, 0)));
            assert_eq!(got, want, "k{i}");
        }
        assert!(s.counters.corrupt_reads.load(Ordering::Relaxed) >= 10);
        assert_eq!(s.counters.foreign_slots.load(Ordering::Relaxed), 0, "nothing audited yet");
        // Writes to the scribbled keys succeed, audit their buckets, and
        // unlink the garbled items.
        for i in 0..30u32 {
            s.put(format!("k{i}").as_bytes(), value(i, 1).as_bytes()).unwrap();
            assert_eq!(s.get(format!("k{i}").as_bytes()).unwrap().unwrap().0, value(i, 1));
        }
        assert!(s.counters.foreign_slots.load(Ordering::Relaxed) >= 30);
        assert_eq!(s.counters.items.load(Ordering::Relaxed), 300);
        // The region's index is the server's again, for one-sided readers.
        for b in 0..s.header.bucket_count {
            for i in 0..SLOTS_PER_BUCKET {
                let (own, seen) = (s.own_slot(b, i), s.region.load_slot(s.slot_offset(b, i)));
                let touched = (0..30u32).any(|k| key_hash(format!("k{k}").as_bytes(), 7, 1024).buckets.contains(&b));
                if touched {
                    assert_eq!(own, seen, "bucket {b} slot {i} not repaired");
                }
            }
        }
        // Fresh keys, deletes: everything keeps working, and the books
        // balance (only the writer's own blocks were ever retired).
        for i in 300..600u32 {
            s.put(format!("k{i}").as_bytes(), value(i, 0).as_bytes()).unwrap();
        }
        for i in 0..600u32 {
            let round = u32::from(i < 30);
            assert_eq!(s.get(format!("k{i}").as_bytes()).unwrap().unwrap().0, value(i, round), "k{i}");
            assert!(s.delete(format!("k{i}").as_bytes()).unwrap(), "k{i}");
        }
        assert_eq!(s.counters.items.load(Ordering::Relaxed), 0);
        assert_eq!(s.counters.used_bytes.load(Ordering::Relaxed), 0);
    }
}

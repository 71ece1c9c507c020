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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_epoch as epoch;
use dmkv_common::error::{Error, check_key, check_value};
use dmkv_common::layout::{self, KeyHash, RegionHeader, Slot, decode_item, encode_item, item_units, key_hash};
use dmkv_common::limits::{SLOTS_PER_BUCKET, UNIT};

use crate::alloc::{Allocator, class_units};
use crate::region::Region;

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
    /// Server-side reads whose item failed verification: always a bug.
    pub corrupt_reads: AtomicU64,
}

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
    writer: Mutex<Writer>,
    /// Blocks whose epoch has passed, handed over by crossbeam-epoch's
    /// deferred functions (which may run on any thread).
    epoch_done: Arc<Mutex<Vec<Retired>>>,
    pub counters: Counters,
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
        Ok(Store {
            region,
            header,
            grace,
            writer: Mutex::new(Writer {
                alloc: Allocator::new(start, end),
                next_version: 1,
                waiting: VecDeque::new(),
                scratch: Vec::new(),
            }),
            epoch_done: Arc::new(Mutex::new(Vec::new())),
            counters: Counters::default(),
        })
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

    /// Reads the item of `slot` and returns it if it is `key`'s.
    ///
    /// Callers hold an epoch guard, so the block cannot be reused under them
    /// and a verification failure is a bug, counted as such.
    fn read_item_if_key(&self, slot: Slot, key: &[u8], buf: &mut Vec<u8>) -> bool {
        buf.resize(slot.len(), 0);
        self.region.read(slot.offset(), buf);
        match decode_item(buf) {
            Ok(item) => item.key == key,
            Err(_) => {
                self.counters.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Whether the item of `slot` is `key`'s, reading only its header and
    /// key. Only for the writer: it holds the writer lock, and published
    /// items never change, so what it reads cannot be torn.
    fn item_has_key(&self, slot: Slot, key: &[u8], buf: &mut Vec<u8>) -> bool {
        let len = (layout::ITEM_HEADER_LEN + key.len()).min(slot.len());
        buf.resize(len, 0);
        self.region.read(slot.offset(), buf);
        let key_len = u32::from_le_bytes(buf[16..20].try_into().expect("4 bytes")) as usize;
        key_len == key.len()
            && buf.len() == layout::ITEM_HEADER_LEN + key.len()
            && &buf[layout::ITEM_HEADER_LEN..] == key
    }

    /// Finds the slot holding `key`: (bucket, index, slot). With `whole`,
    /// `buf` ends up holding the verified item; otherwise (writers only)
    /// just its header and key are read.
    fn find(&self, kh: &KeyHash, key: &[u8], buf: &mut Vec<u8>, whole: bool) -> Option<(u64, usize, Slot)> {
        for &b in &kh.buckets {
            for i in 0..SLOTS_PER_BUCKET {
                let Some(slot) = Slot::unpack(self.region.load_slot(self.slot_offset(b, i))) else { continue };
                if slot.fingerprint != kh.fingerprint {
                    continue;
                }
                let found =
                    if whole { self.read_item_if_key(slot, key, buf) } else { self.item_has_key(slot, key, buf) };
                if found {
                    return Some((b, i, slot));
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
        let Some((b, index, slot)) = self.find(&kh, key, &mut buf, true) else { return Ok(None) };
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
        let mut w = self.writer.lock().expect("writer lock poisoned");
        let w = &mut *w;
        let mut probe = Vec::new();
        let existing = self.find(&kh, key, &mut probe, false);
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
        self.region.store_slot(self.slot_offset(target.0, target.1), new_slot.pack());
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.counters.used_bytes.fetch_add((class_units(units) * UNIT) as u64, Ordering::Relaxed);
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
        let _w = self.writer.lock().expect("writer lock poisoned");
        let mut probe = Vec::new();
        let Some((b, i, old)) = self.find(&kh, key, &mut probe, false) else { return Ok(false) };
        self.region.store_slot(self.slot_offset(b, i), Slot::EMPTY);
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
                if self.region.load_slot(self.slot_offset(b, i)) == Slot::EMPTY {
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
        guard.defer(move || done.lock().expect("epoch_done poisoned").push(r));
        self.counters.used_bytes.fetch_sub((class_units(r.units) * UNIT) as u64, Ordering::Relaxed);
    }

    /// Frees retired blocks whose epoch and grace period have both passed.
    fn reclaim(&self, w: &mut Writer, guard: &epoch::Guard) {
        guard.flush();
        {
            let mut done = self.epoch_done.lock().expect("epoch_done poisoned");
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
        let guard = epoch::pin();
        let mut w = self.writer.lock().expect("writer lock poisoned");
        self.reclaim(&mut w, &guard);
        let pending_epoch = !self.epoch_done.lock().expect("epoch_done poisoned").is_empty();
        match w.waiting.front() {
            Some(r) => Some(self.grace.saturating_sub(r.since.elapsed())),
            None if pending_epoch => Some(Duration::ZERO),
            None => None,
        }
    }

    /// Bytes of the data area and bytes in use, for STATS.
    pub fn memory(&self) -> (u64, u64) {
        let w = self.writer.lock().expect("writer lock poisoned");
        (self.header.data_len, w.alloc.used_units() * UNIT as u64)
    }

    /// Number of index slots.
    pub fn slot_count(&self) -> u64 {
        self.header.bucket_count * SLOTS_PER_BUCKET as u64
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
}

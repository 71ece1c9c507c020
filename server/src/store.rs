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
//! The index grows a segment at a time (`index`); the region is shared
//! memory, so the server never trusts what it reads back from it for its
//! own decisions. It keeps a private copy of every index word and reads
//! slots only from that copy, so the allocator only
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
use dmkv_common::limits::{SEGMENT_BUCKETS, SEGMENT_LEN, SLOTS_PER_BUCKET, UNIT, WORDS_PER_BUCKET};

use tracing::warn;

use crate::alloc::{Allocator, Space};
use crate::lock::lock;
use crate::region::Region;

mod dump;
mod evacuate;
pub mod evict;
mod holds;
mod index;
mod index_ops;
pub mod item;
mod ops;
mod plan;
mod recency;
mod relocation;
pub mod view;

use index::{Index, IndexWriter, MAX_SPLITS_PER_WRITE, Seg};
use item::ItemMeta;
pub(crate) use plan::{Current, Plan};
pub use relocation::{Candidate, Relocation};

/// Counters exported by STATS. Relaxed atomics: they are statistics.
#[derive(Debug, Default)]
pub struct Counters {
    pub gets: AtomicU64,
    pub get_hits: AtomicU64,
    /// GETs that found the key's item expired (a miss).
    pub get_expired: AtomicU64,
    /// Items evicted to make room (`--evict lru`).
    pub evictions: AtomicU64,
    /// Of those, items evicted where they were because a write needed
    /// their range in one piece (`Store::evict_listed`).
    pub evicted_for_room: AtomicU64,
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
    /// Index segments split, and bytes of the data area the index holds.
    pub index_splits: AtomicU64,
    pub index_bytes: AtomicU64,
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

/// The index's size and growth, for STATS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexStats {
    /// Segments serving keys.
    pub segments: u64,
    /// Slots in them.
    pub slots: u64,
    /// Splits so far.
    pub splits: u64,
    /// Deepest segment.
    pub max_depth: u64,
    /// Depth of the directory: the deepest a segment can get.
    pub dir_depth: u64,
}

/// Most epoch-collector flushes one [`Store::reclaim_wait`] makes.
const EPOCH_FLUSHES: usize = 64;

/// Retired blocks handed to the epoch collector together, in one deferred
/// function followed by one flush; and the longest the oldest of them
/// waits for a batch to fill when a set or update comes (deletes,
/// evictions and the compactor's moves hand over only a full batch; the
/// compactor's waits and an out-of-memory retry hand over any). A flush
/// per write (as before) walks every thread registered with the collector:
/// with it dmkvd spent 4.57 us per operation at YCSB A 2x16, with the
/// batches 3.83 us (docs/performance.md). The batch is the store's, not a thread's: no
/// thread that stops writing keeps retired blocks in its own bag
/// (segments retired by a split are flushed at once), and `reclaim_wait`
/// hands the batch over from whichever thread runs out of room.
const RETIRE_BATCH: usize = 32;
const RETIRE_BATCH_WAIT: Duration = Duration::from_millis(1);

/// A block unlinked from the index and waiting out its grace period.
#[derive(Debug, Clone, Copy)]
struct Retired {
    at: u64,
    units: usize,
    since: Instant,
    /// Its retirement's number (`Store::retire_seq`): views hold those
    /// from theirs on.
    seq: u64,
}

struct Writer {
    alloc: Allocator,
    index: IndexWriter,
    next_version: u64,
    /// Blocks past their epoch but maybe not their time grace, oldest first.
    waiting: VecDeque<Retired>,
    scratch: Vec<u8>,
    /// Eviction's sampling.
    rng: u64,
}

/// Where a key's slot was found: which of its two buckets, the slot's
/// index there and the packed slot word (a one-sided reader's hint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub which: u8,
    pub index: u8,
    pub slot: u64,
}

/// A slot of the server's index: segment, bucket in it, slot in the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pos {
    seg: u32,
    bucket: usize,
    slot: usize,
}

/// The store: a region laid out per [`RegionHeader`], and its writer.
pub struct Store {
    region: Arc<Region>,
    header: RegionHeader,
    grace: Duration,
    /// The server's own copy of the index (directory and every word of
    /// every segment), private to this process. The writer stores each
    /// word here and in the region; the server's lookups read only this.
    index: Index,
    /// Segments retired by splits whose epoch has passed (from
    /// crossbeam-epoch's deferred functions, as `epoch_done`).
    segs_done: Arc<Mutex<Vec<(u32, Instant, u64)>>>,
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
    /// Units retired and not yet handed back through `epoch_done` (the
    /// store's batch not handed over yet included): the epoch collector
    /// works through its backlog a bounded amount per call, so a burst of
    /// retirements (the compactor's) can sit there.
    in_epoch: Arc<AtomicU64>,
    /// Retirements not handed to the epoch collector yet, oldest first (at
    /// most [`RETIRE_BATCH`]): pushed and taken under the writer lock.
    /// Recovers from poisoning: a push or a take leaves a valid Vec.
    retiring: Mutex<Vec<Retired>>,
    pub counters: Counters,
    log_limit: LogLimit,
    /// Last-access stamps, with eviction on (`evict`).
    recency: std::sync::OnceLock<recency::Recency>,
    /// A cluster replica's store: it keeps recency, but only its shard's
    /// leader chooses what goes, and every replica removes it through the
    /// log; nothing here evicts on its own (`Store::evicts_here`).
    replicated_eviction: std::sync::atomic::AtomicBool,
    /// Retirements of blocks and segments so far, numbered under the
    /// writer lock: a view holds those from its number on.
    retire_seq: AtomicU64,
    /// Snapshot views in progress (`view`).
    views: holds::Views,
    /// Bumped whenever the store is emptied (to be refilled from a
    /// snapshot or a log): a read that saw the same generation before and
    /// after did not see contents being replaced.
    generation: AtomicU64,
}

/// Index segments a store formatted for `bucket_count` buckets starts
/// with: whole segments, a power of two of them.
pub fn initial_segments(bucket_count: u64) -> u64 {
    bucket_count.div_ceil(SEGMENT_BUCKETS as u64).max(1).next_power_of_two()
}

impl Store {
    /// Formats `region` with an empty index of `bucket_count` buckets to
    /// start with (rounded up to whole segments); it grows from there.
    pub fn format(
        region: Arc<Region>,
        bucket_count: u64,
        hash_seed: u64,
        epoch: u64,
        grace: Duration,
    ) -> Result<Store, dmkv_common::LayoutError> {
        let segments = initial_segments(bucket_count);
        let header = RegionHeader::plan(region.len() as u64, segments, hash_seed, epoch, grace.as_nanos() as u64)?;
        let start = header.data_offset / UNIT as u64;
        let end = start + header.data_len / UNIT as u64;
        let store = Store {
            region,
            header,
            grace,
            index: Index::new((header.data_len / SEGMENT_LEN as u64) as usize, header.dir_depth),
            segs_done: Arc::default(),
            retire_seq: AtomicU64::new(0),
            views: holds::Views::default(),
            generation: AtomicU64::new(0),
            writer: Mutex::new(Writer {
                alloc: Allocator::new(start, end),
                index: IndexWriter::new(),
                next_version: 1,
                waiting: VecDeque::new(),
                scratch: Vec::new(),
                rng: hash_seed | 1,
            }),
            epoch_done: Arc::new(Mutex::new(Vec::new())),
            in_epoch: Arc::default(),
            retiring: Mutex::new(Vec::with_capacity(RETIRE_BATCH)),
            counters: Counters::default(),
            log_limit: LogLimit::new(),
            recency: std::sync::OnceLock::new(),
            replicated_eviction: std::sync::atomic::AtomicBool::new(false),
        };
        {
            let mut w = lock(&store.writer);
            // `plan` checked that the first segments fit.
            store
                .format_index(&mut w, segments)
                .map_err(|_| dmkv_common::LayoutError::OutOfRange { field: "buckets", value: bucket_count })?;
        }
        // The header last: a reader that can see it finds a whole index.
        store.region.write(0, &header.encode());
        crate::clock::publish_to(&store.region);
        Ok(store)
    }

    /// How long retired space stays intact for one-sided readers.
    pub fn grace(&self) -> Duration {
        self.grace
    }

    /// How many times the store was emptied (see `clear`).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The region's layout.
    pub fn header(&self) -> &RegionHeader {
        &self.header
    }

    /// The region.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Compares the region's words of bucket `b` of `seg` (header and
    /// slots) with the server's own and puts back any that differ:
    /// one-sided readers then find the server's items again. Writer only
    /// (no store of its own races this).
    fn audit_bucket(&self, seg: &Seg, b: usize) {
        for w in 0..WORDS_PER_BUCKET {
            let own = seg.word(b, w);
            let off = seg.word_offset(b, w);
            let seen = self.region.load_slot(off);
            if seen != own {
                let n = self.counters.foreign_slots.fetch_add(1, Ordering::Relaxed) + 1;
                if self.log_limit.allow() {
                    warn!(
                        offset = off,
                        found = format_args!("{seen:#018x}"),
                        expected = format_args!("{own:#018x}"),
                        foreign_slots = n,
                        "the region's index was written by someone else; restoring the server's word"
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

    /// Finds the slot holding `key` in `seg` for a lookup, with `buf`
    /// holding the verified item.
    fn find(&self, seg: &Seg, kh: &KeyHash, key: &[u8], buf: &mut Vec<u8>) -> Option<(usize, usize, Slot)> {
        for &b in &kh.buckets {
            let b = usize::from(b);
            for i in 0..SLOTS_PER_BUCKET {
                let Some(slot) = Slot::unpack(seg.slot(b, i)) else { continue };
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
        seg: &Seg,
        kh: &KeyHash,
        key: &[u8],
        buf: &mut Vec<u8>,
        guard: &epoch::Guard,
    ) -> Option<(usize, usize, Slot)> {
        for &b in &kh.buckets {
            self.audit_bucket(seg, usize::from(b));
        }
        for &b in &kh.buckets {
            let b = usize::from(b);
            for i in 0..SLOTS_PER_BUCKET {
                let Some(slot) = Slot::unpack(seg.slot(b, i)) else { continue };
                if slot.fingerprint != kh.fingerprint {
                    continue;
                }
                if self.item_has_key(slot, key, buf) {
                    return Some((b, i, slot));
                }
                // Another key with the same fingerprint (rare), or an item
                // scribbled over: only a full check tells them apart.
                if !self.read_verified(slot, buf) {
                    self.set_slot(seg, b, i, Slot::EMPTY);
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

    /// Looks `key` up by the server's clock (an expired item is none);
    /// returns (value, version, where its slot is).
    pub fn get_located(&self, key: &[u8]) -> Result<Option<(Bytes, u64, Location)>, Error> {
        Ok(self.get_item(key, crate::clock::now_ms())?.map(|(item, at)| (item.value, item.meta.version, at)))
    }

    /// Stores `value` under `key`; returns the write's version.
    ///
    /// On any error nothing changed: the old value (if any) stays readable.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<u64, Error> {
        self.put_versioned(key, value, None)
    }

    /// [`Store::put`] with the version given (`Some`: a restored item,
    /// which keeps the version it had, or a replicated write, whose version
    /// is its log index; later writes get higher ones).
    pub(crate) fn put_versioned(&self, key: &[u8], value: &[u8], given: Option<u64>) -> Result<u64, Error> {
        let plan = |_: Option<Current<'_>>| Ok(Plan { value: value.into(), flags: 0, expires_at: 0, version: given });
        self.write_item(key, false, plan).map(|m| m.version)
    }

    /// The one write path: finds `key`'s item, lets `plan` decide from it
    /// (read whole and verified when `needs_current`, and only if live at
    /// `plan`'s clock: see `Current`) what to store or to refuse, then
    /// stores it out of place and publishes it with one slot store.
    ///
    /// On any error nothing changed: the old value (if any) stays readable.
    pub(crate) fn write_item<'v>(
        &self,
        key: &[u8],
        needs_current: bool,
        plan: impl FnOnce(Option<Current<'_>>) -> Result<Plan<'v>, Error>,
    ) -> Result<ItemMeta, Error> {
        check_key(key)?;
        let kh = key_hash(key, self.header.hash_seed);
        let guard = epoch::pin();
        let mut w = lock(&self.writer);
        let w = &mut *w;
        let mut probe = Vec::new();
        // Space past its grace period first: a split may need it.
        self.reclaim(w, &guard);
        self.audit_dir(w, &kh);
        let (_, seg) = self.index.segment(&kh);
        let found = self.find_for_write(seg, &kh, key, &mut probe, &guard);
        let mut current_buf = Vec::new();
        let current = match found {
            Some((_, _, slot)) if needs_current && self.read_verified(slot, &mut current_buf) => {
                decode_item(&current_buf).ok().map(|it| Current { item: it })
            }
            _ => None,
        };
        let plan = plan(current)?;
        check_value(&plan.value)?;
        let units = item_units(key.len(), plan.value.len());
        let mut splits = 0;
        // The first round's lookup is the one made above: nothing changed
        // since. After a split, look again in the key's new segment.
        let mut first = Some(found);
        let (target, existing) = loop {
            let (id, seg) = self.index.segment(&kh);
            let hit = match first.take() {
                Some(f) => f,
                None => self.find_for_write(seg, &kh, key, &mut probe, &guard),
            };
            if let Some((b, i, old)) = hit {
                break (Pos { seg: id, bucket: b, slot: i }, Some(old));
            }
            if let Some((b, i)) = self.free_slot(seg, &kh) {
                break (Pos { seg: id, bucket: b, slot: i }, None);
            }
            let split = if splits < MAX_SPLITS_PER_WRITE { self.split(w, id, &guard) } else { Err(Error::IndexFull) };
            match split {
                Ok(()) => splits += 1,
                Err(e) => {
                    let counter = match e {
                        Error::OutOfMemory => &self.counters.out_of_memory,
                        _ => &self.counters.index_full,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
            }
        };
        let Some(at) = w.alloc.alloc(units) else {
            self.counters.out_of_memory.fetch_add(1, Ordering::Relaxed);
            return Err(Error::OutOfMemory);
        };
        let version = plan.version.unwrap_or(w.next_version);
        // An item rewritten with the version it had (a touch): a view's
        // version filter cannot tell it is newer than the view.
        let relinked = version < w.next_version;
        w.next_version = w.next_version.max(version.saturating_add(1));
        w.scratch.clear();
        encode_item(key, &plan.value, version, plan.flags, plan.expires_at, &mut w.scratch);
        let offset = at * UNIT as u64;
        // Unit-aligned, and the write's padding to a whole word stays inside
        // the item's units.
        self.region.write(offset, &w.scratch);
        let new_slot = Slot::new(kh.fingerprint, offset, units);
        if relinked {
            self.views.note_relinked(new_slot);
        }
        self.set_slot(self.index.seg(target.seg), target.bucket, target.slot, new_slot.pack());
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.counters.used_bytes.fetch_add((units * UNIT) as u64, Ordering::Relaxed);
        self.note_write(at, units);
        match existing {
            Some(old) => self.retire(old, &guard),
            None => {
                self.counters.items.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(ItemMeta { version, flags: plan.flags, expires_at: plan.expires_at })
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &[u8]) -> Result<bool, Error> {
        self.delete_where(key, |_, _| Ok(true))
    }

    /// Removes `key`'s item if `judge` (given its slot and a buffer to
    /// read it into) says so: Ok(true) remove, and report it existed;
    /// Ok(false) remove, and report it did not (an expired item); Err,
    /// keep it and fail. Ok(false) without asking if there is none.
    pub(crate) fn delete_where(
        &self,
        key: &[u8],
        judge: impl FnOnce(Slot, &mut Vec<u8>) -> Result<bool, Error>,
    ) -> Result<bool, Error> {
        check_key(key)?;
        let kh = key_hash(key, self.header.hash_seed);
        let guard = epoch::pin();
        let w = lock(&self.writer);
        self.audit_dir(&w, &kh);
        let mut probe = Vec::new();
        let (_, seg) = self.index.segment(&kh);
        let Some((b, i, old)) = self.find_for_write(seg, &kh, key, &mut probe, &guard) else { return Ok(false) };
        let existed = judge(old, &mut probe)?;
        self.set_slot(seg, b, i, Slot::EMPTY);
        self.counters.deletes.fetch_add(1, Ordering::Relaxed);
        self.counters.items.fetch_sub(1, Ordering::Relaxed);
        self.retire(old, &guard);
        Ok(existed)
    }

    /// An empty slot in the emptier candidate bucket, to spread load.
    fn free_slot(&self, seg: &Seg, kh: &KeyHash) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None;
        for &b in &kh.buckets {
            let b = usize::from(b);
            let mut empties = 0;
            let mut first = None;
            for i in 0..SLOTS_PER_BUCKET {
                if seg.slot(b, i) == Slot::EMPTY {
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

    /// Hands an unlinked block to the epoch collector (in the store's next
    /// batch); its space comes back through `epoch_done` and then waits out
    /// the time grace in `reclaim`. Writer only.
    fn retire(&self, old: Slot, guard: &epoch::Guard) {
        let seq = self.retire_seq.fetch_add(1, Ordering::AcqRel);
        let r = Retired { at: old.offset_units, units: old.units as usize, since: Instant::now(), seq };
        self.views.note_unlinked(old, self.header.data_len / UNIT as u64 / holds::MAX_HELD_SHARE);
        self.in_epoch.fetch_add(r.units as u64, Ordering::Relaxed);
        self.counters.used_bytes.fetch_sub((r.units * UNIT) as u64, Ordering::Relaxed);
        let full = {
            let mut batch = lock(&self.retiring);
            batch.push(r);
            batch.len() >= RETIRE_BATCH
        };
        if full {
            self.hand_over(guard);
        }
    }

    /// Defers the store's batch of retirements as one function and flushes
    /// this thread's bag, so the batch is in the collector's global queue
    /// (no thread's bag holds it); it comes back no earlier than every
    /// guard pinned now is gone (later than each block was unlinked), once
    /// collections have run.
    /// Writer only.
    fn hand_over(&self, guard: &epoch::Guard) {
        let batch = std::mem::replace(&mut *lock(&self.retiring), Vec::with_capacity(RETIRE_BATCH));
        if batch.is_empty() {
            return;
        }
        debug_assert!(batch.len() <= RETIRE_BATCH, "the retirement batch outgrew its bound");
        let done = Arc::clone(&self.epoch_done);
        let in_epoch = Arc::clone(&self.in_epoch);
        guard.defer(move || {
            let units: u64 = batch.iter().map(|r| r.units as u64).sum();
            lock(&done).extend(batch);
            // Release: a reader of `in_epoch` that sees it drop sees the
            // blocks in `epoch_done`.
            in_epoch.fetch_sub(units, Ordering::Release);
        });
        guard.flush();
    }

    /// Frees retired blocks whose epoch and grace period have both passed.
    fn reclaim(&self, w: &mut Writer, guard: &epoch::Guard) {
        let now = Instant::now();
        let due =
            lock(&self.retiring).first().is_some_and(|r| now.saturating_duration_since(r.since) >= RETIRE_BATCH_WAIT);
        if due {
            self.hand_over(guard);
        }
        {
            let mut done = lock(&self.epoch_done);
            if !done.is_empty() {
                done.sort_by_key(|r| r.since);
                w.waiting.extend(done.drain(..));
            }
        }
        // Blocks unlinked since a view began stay as they are while it lives.
        let hold = self.views.hold_from();
        while let Some(r) = w.waiting.front() {
            if now.duration_since(r.since) < self.grace || r.seq >= hold {
                break;
            }
            w.alloc.free(r.at, r.units);
            w.waiting.pop_front();
        }
        self.reclaim_segments(w, hold);
    }

    /// If space is waiting out its grace period, how long until the oldest
    /// of it is free. A PUT that failed with out-of-memory may retry then.
    pub fn reclaim_wait(&self) -> Option<Duration> {
        let mut guard = epoch::pin();
        let mut w = lock(&self.writer);
        // Whatever waits for a batch to fill goes now: room is short.
        self.hand_over(&guard);
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
        // `in_epoch` first: a batch coming back between the two reads is
        // then seen in `epoch_done`, never missed by both.
        let in_epoch = self.in_epoch.load(Ordering::Acquire) > 0;
        let pending_epoch = in_epoch || !lock(&self.epoch_done).is_empty();
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

    /// Whether `extra` more bytes of items keep live items and the index
    /// (plus two segments for a write that splits) within `percent` of the
    /// data area. Live bytes are the same on every replica of a shard
    /// (they applied the same commands), unlike free space, which depends
    /// on grace periods and compaction: a cluster leader admits a write
    /// only while this holds, so every replica can apply it.
    pub fn live_within(&self, extra: u64, percent: u64) -> bool {
        u128::from(self.live_bytes() + extra) * 100 <= u128::from(self.header.data_len) * u128::from(percent)
    }

    /// Live items and the index, plus two segments for a write that
    /// splits: what [`Store::live_within`] bounds.
    pub fn live_bytes(&self) -> u64 {
        let c = &self.counters;
        c.used_bytes.load(Ordering::Relaxed) + c.index_bytes.load(Ordering::Relaxed) + 2 * SEGMENT_LEN as u64
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

    /// The index's figures now.
    pub fn index_stats(&self) -> IndexStats {
        let w = lock(&self.writer);
        IndexStats {
            segments: w.index.live,
            slots: w.index.live * (SEGMENT_BUCKETS * SLOTS_PER_BUCKET) as u64,
            splits: w.index.splits,
            max_depth: u64::from(w.index.max_depth),
            dir_depth: self.header.dir_depth,
        }
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
        let kh = key_hash(key, self.header.hash_seed);
        let _guard = epoch::pin();
        let _w = lock(&self.writer);
        let mut buf = Vec::new();
        let (_, seg) = self.index.segment(&kh);
        let Some((b, i, slot)) = self.find(seg, &kh, key, &mut buf) else { return false };
        let offset_bits = (1u64 << 33) - 1;
        self.region.store_slot(seg.word_offset(b, i + 1), slot.pack() ^ offset_bits);
        let bogus = Slot { fingerprint: kh.fingerprint, units: 3, offset_units: offset_bits - 5 }.pack();
        for &b in &kh.buckets {
            let b = usize::from(b);
            for i in 0..SLOTS_PER_BUCKET {
                if seg.slot(b, i) == Slot::EMPTY {
                    self.region.store_slot(seg.word_offset(b, i + 1), bogus);
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

    /// Small values fill memory, not the index: it grows from one segment
    /// until the data area itself is full.
    #[test]
    fn the_index_grows_until_memory_is_full() {
        let s = store(8, SEGMENT_BUCKETS as u64, Duration::ZERO);
        assert_eq!(s.index_stats().segments, 1);
        let mut n = 0u32;
        let err = loop {
            match s.put(format!("key{n}").as_bytes(), &n.to_le_bytes().repeat(4)) {
                Ok(_) => n += 1,
                Err(e) => break e,
            }
        };
        assert_eq!(err, Error::OutOfMemory, "after {n} items");
        let space = s.space();
        let used = space.used as f64 / (space.used + space.free) as f64;
        assert!(used >= 0.9, "only {:.1} % of the data area used at the first refusal", used * 100.0);
        let ix = s.index_stats();
        assert!(ix.splits > 100 && ix.segments > 100, "{ix:?}");
        for i in 0..n {
            assert_eq!(s.get(format!("key{i}").as_bytes()).unwrap().unwrap().0, i.to_le_bytes().repeat(4), "key{i}");
        }
        // Deletes and new keys keep working in the grown index.
        for i in (0..n).step_by(2) {
            assert!(s.delete(format!("key{i}").as_bytes()).unwrap());
        }
        for i in 0..n / 4 {
            s.put(format!("new{i}").as_bytes(), b"v").unwrap();
        }
    }

    /// An item listed for a move whose segment splits before the move is
    /// still moved (found in the half that serves its key), so the range
    /// the compactor is emptying does empty.
    #[test]
    fn moves_follow_items_into_split_segments() {
        let s = store(8, SEGMENT_BUCKETS as u64, Duration::ZERO);
        s.put(b"target", b"moving").unwrap();
        let (_, _, at) = s.get_located(b"target").unwrap().unwrap();
        let slot = Slot::unpack(at.slot).unwrap();
        let range = slot.offset_units..slot.offset_units + u64::from(slot.units);
        let listed = s.begin_evacuation(range.clone()).unwrap();
        assert_eq!(listed.len(), 1);
        let splits = s.index_stats().splits;
        for i in 0..3000u32 {
            s.put(format!("k{i}").as_bytes(), b"v").unwrap();
        }
        assert!(s.index_stats().splits > splits + 5, "{:?}", s.index_stats());
        let to = s.reserve(listed[0].units()).unwrap();
        assert_eq!(s.relocate(&listed[0], to), Relocation::Moved);
        assert_eq!(s.get(b"target").unwrap().unwrap().0, Bytes::from_static(b"moving"));
        let (_, _, now) = s.get_located(b"target").unwrap().unwrap();
        assert_eq!(Slot::unpack(now.slot).unwrap().offset_units, to);
    }

    /// The server's own lock-free lookups race the writer's splits: every
    /// key acknowledged before a lookup started is found, with its value.
    #[test]
    fn lookups_racing_splits_never_miss() {
        use std::sync::atomic::AtomicBool;
        let s = Arc::new(store(16, 64, Duration::from_millis(1)));
        let acked = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..2u64)
            .map(|t| {
                let (s, acked, stop) = (Arc::clone(&s), Arc::clone(&acked), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut x = t + 1;
                    let mut checked = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let n = acked.load(Ordering::Acquire);
                        if n == 0 {
                            continue;
                        }
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let i = x % n;
                        let got = s.get(format!("key{i}").as_bytes()).unwrap();
                        assert_eq!(got.map(|(v, _)| v), Some(Bytes::from(format!("value{i}"))), "key{i} of {n}");
                        checked += 1;
                    }
                    checked
                })
            })
            .collect();
        for i in 0..60_000u64 {
            s.put(format!("key{i}").as_bytes(), format!("value{i}").as_bytes()).unwrap();
            acked.store(i + 1, Ordering::Release);
        }
        stop.store(true, Ordering::Relaxed);
        let checked: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
        assert!(s.index_stats().splits > 50, "{:?}", s.index_stats());
        assert!(checked > 1000, "{checked}");
    }

    /// Space a thread retired comes back to whichever thread runs out of
    /// room, even if the retiring thread never writes again (a connection
    /// thread gone quiet): nothing waits in that thread's own epoch bag.
    /// With a flush per write the last retirement stayed in the idle
    /// thread's bag; with flushes counted per thread, up to a batch of them.
    #[test]
    fn an_idle_writers_retired_space_comes_back_to_another_thread() {
        let s = Arc::new(store(8, 64, Duration::ZERO));
        let (idle_tx, idle_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let writer = Arc::clone(&s);
        let t = std::thread::spawn(move || {
            for i in 0..(RETIRE_BATCH as u32 - 1) {
                writer.put(b"big", &vec![i as u8; 16 << 10]).unwrap();
            }
            idle_tx.send(()).unwrap();
            // Alive and quiet, as a connection thread with no more writes.
            let _ = stop_rx.recv();
        });
        idle_rx.recv().unwrap();
        let mut rounds = 0;
        while s.in_epoch_units() > 0 {
            rounds += 1;
            assert!(rounds < 1_000, "{} units stay with the idle thread", s.in_epoch_units());
            let _ = s.reclaim_wait();
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(stop_tx);
        t.join().unwrap();
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
        for k in 0..30u32 {
            let kh = key_hash(format!("k{k}").as_bytes(), 7);
            let (_, seg) = s.index.segment(&kh);
            for b in kh.buckets.map(usize::from) {
                for w in 0..WORDS_PER_BUCKET {
                    let (own, seen) = (seg.word(b, w), s.region.load_slot(seg.word_offset(b, w)));
                    assert_eq!(own, seen, "bucket {b} word {w} not repaired");
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

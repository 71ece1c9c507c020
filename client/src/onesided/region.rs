//! An attached one-sided path to one region ([`OneSided`]): GETs and
//! multi-GETs driven through [`dmkv_common::read`] over a backend, with
//! the lease of a cluster shard's region judged per batch.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use dmkv_common::layout::{DirEntry, KeyHash, LEASE_LEN, LEASE_OFFSET, RegionHeader, key_hash};
use dmkv_common::read::{
    AfterBuckets, Hint, Lookup, MAX_ATTEMPTS, Outcome, ReadSpec, Retry, clock_read, dir_read, judge_clock,
    judge_dir_entry, next_batch_keys,
};

use super::access_log::AccessLog;
use super::attempt_clock::AttemptClock;
use super::directory::DirCache;
use super::hints::{HintCache, HintId};
use super::scratch::{self, ItemMeta, LocalGet};
use crate::read_path::Transport;
use crate::value::Versioned;
use dmkv_common::cluster::lease_check::{self as lease, AttemptStart, LeaseClock};

use super::backend::{BackendError, Reads};
use super::counters::ReadCounters;
#[cfg(feature = "rdma")]
use super::rdma;
use super::{engine, shm};

pub(super) enum Backend {
    Shm(shm::ShmRegion),
    Engine(engine::EnginePool),
    #[cfg(feature = "rdma")]
    Rdma(Box<rdma::RdmaPath>),
}

impl Backend {
    pub(super) async fn read(&self, specs: &[ReadSpec], out: &mut Reads) -> Result<(), BackendError> {
        match self {
            Backend::Shm(s) => s.read(specs, out),
            Backend::Engine(e) => e.read(specs, out).await,
            #[cfg(feature = "rdma")]
            Backend::Rdma(r) => r.read(specs, out).await,
        }
    }
}

/// The cost of a one-sided (multi-)GET, for path selection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Trace {
    /// Batches of reads posted, each one round trip.
    pub round_trips: u32,
    /// Of those, round trips of attempts that had to be retried.
    pub retries: u32,
}

/// Result of a one-sided GET.
pub enum OneSidedGet {
    Found(Versioned),
    Missing,
    /// Verification kept failing: ask the server over RPC.
    GiveUp,
}

/// An attached one-sided path to one server's region.
pub struct OneSided {
    pub(super) header: RegionHeader,
    pub(super) dir: DirCache,
    pub(super) backend: Backend,
    pub(super) transport: Transport,
    pub(super) hints: Mutex<HintCache>,
    pub(super) counters: std::sync::Arc<ReadCounters>,
    pub(super) clock: AttemptClock,
    pub(super) enforce_grace: bool,
    /// Keys per batch of a multi-get, sized to this path's measured speed.
    pub(super) batch_keys: AtomicUsize,
    /// A cluster shard's region: every batch reads the lease block last,
    /// and counts only if the attempt lay inside one run of the lease, on
    /// the leader's clock as this bounds it (`lease`). `None`: a single
    /// node's region, no lease.
    pub(super) lease: Option<LeaseClock>,
    /// A cluster shard's region read under its lease: the shard, and the
    /// map its batches are checked against (a batch of keys the map gives
    /// another shard, or one older than the shard's partitions, is not
    /// believed; with no map, none is).
    pub(super) route: Option<(u32, Option<std::sync::Arc<crate::route_view::RouteView>>)>,
    /// Reads to report to a server that evicts.
    pub(crate) accesses: AccessLog,
    /// Which region, for access reports.
    pub(crate) region_id: u32,
}

/// Where a batch's closing read is: after every data read of the batch,
/// the server's clock (so it was read no earlier than the items), and in
/// a leased region (a cluster shard's) the lease block before it, in the
/// same read: the two share a cache line, and the read can then be the
/// batch's last, as the lease argument needs the block to be (an RDMA
/// batch fences its last read for that: see `rdma::RdmaPath`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Tail {
    at: usize,
    leased: bool,
}

const _: () = assert!(
    dmkv_common::layout::CLOCK_OFFSET == LEASE_OFFSET + LEASE_LEN as u64,
    "the clock word follows the lease block"
);

impl Tail {
    /// The lease block as read; `None` for an unleased region or a
    /// failed read.
    pub(super) fn lease<'r>(&self, reads: &'r Reads) -> Option<&'r [u8]> {
        if !self.leased {
            return None;
        }
        reads.get(self.at)?.get(..LEASE_LEN)
    }

    /// The server's clock as read (0: none).
    pub(super) fn clock(&self, reads: &Reads) -> u64 {
        let bytes = reads.get(self.at).unwrap_or(&[]);
        let word = if self.leased { bytes.get(LEASE_LEN..).unwrap_or(&[]) } else { bytes };
        judge_clock(word)
    }
}

/// One key's progress through a (multi-)GET.
struct Pending<'k> {
    key: &'k [u8],
    kh: KeyHash,
    segment: DirEntry,
    /// The entry was read from the directory in this attempt.
    fresh: bool,
    look: Lookup,
    hint: Option<Hint>,
    first: Range<usize>,
    items: Range<usize>,
}

impl OneSided {
    /// Which backend this path uses.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Caches where the server said `key`'s slot is (an RPC GET's reply),
    /// so its next one-sided GET reads bucket and item in one round trip.
    /// Nonsense is ignored; a stale hint costs one round trip, never a
    /// wrong value (it is trusted only while the bucket holds its slot).
    pub fn learn_hint(&self, key: &[u8], which: u32, index: u32, slot: u64) {
        let (Ok(which), Ok(index)) = (u8::try_from(which), u8::try_from(index)) else { return };
        if which > 1 || usize::from(index) >= dmkv_common::limits::SLOTS_PER_BUCKET {
            return;
        }
        let Some(slot) = dmkv_common::layout::Slot::unpack(slot) else { return };
        let id = self.hint_id(key);
        self.hints.lock().expect("hints poisoned").put(id, Hint { which, index, slot });
    }

    /// Whether `key`'s item address is cached (its GET can take one round
    /// trip).
    pub fn has_hint(&self, key: &[u8]) -> bool {
        let id = self.hint_id(key);
        self.hints.lock().expect("hints poisoned").get(id).is_some()
    }

    pub(super) fn hint_id(&self, key: &[u8]) -> HintId {
        HintId::of(&key_hash(key, self.header.hash_seed))
    }

    /// When an attempt starts (see `clock`: never late).
    pub(super) fn attempt_start(&self) -> u64 {
        self.clock.start()
    }

    /// When an attempt is judged (see `clock`: never early).
    pub(super) fn judge_time(&self) -> u64 {
        self.clock.judge()
    }

    pub(super) fn lookup(&self, kh: KeyHash, segment: DirEntry) -> (Lookup, Option<Hint>) {
        let hint = self.hint(&kh);
        (self.lookup_hinted(kh, segment, hint), hint)
    }

    /// The cached address of the key hashed to `kh`.
    pub(super) fn hint(&self, kh: &KeyHash) -> Option<Hint> {
        self.hints.lock().expect("hints poisoned").get(HintId::of(kh))
    }

    /// An attempt starting now in `segment`, reading the hinted item too.
    pub(super) fn lookup_hinted(&self, kh: KeyHash, segment: DirEntry, hint: Option<Hint>) -> Lookup {
        let look = Lookup::with_hash(kh, &self.header, segment, hint, self.attempt_start());
        if self.enforce_grace { look } else { look.without_grace_check() }
    }

    /// The directory entry of each of `todo`'s keys (hashed in `hashes`),
    /// reading those not cached in one batch (`None` where that read did
    /// not give one); and which it read.
    pub(super) async fn directory_entries(
        &self,
        hashes: &[KeyHash],
    ) -> Result<(Vec<Option<DirEntry>>, Vec<usize>), BackendError> {
        let mut entries: Vec<Option<DirEntry>> = hashes.iter().map(|kh| self.dir.get(kh)).collect();
        let missing: Vec<usize> = (0..hashes.len()).filter(|&j| entries[j].is_none()).collect();
        if missing.is_empty() {
            return Ok((entries, missing));
        }
        let specs: Vec<ReadSpec> = missing.iter().map(|&j| dir_read(&hashes[j], &self.header)).collect();
        let mut reads = Reads::default();
        self.backend.read(&specs, &mut reads).await?;
        self.counters.directory_reads.fetch_add(specs.len() as u64, Ordering::Relaxed);
        for (n, &j) in missing.iter().enumerate() {
            entries[j] = reads.get(n).and_then(|b| judge_dir_entry(b, &self.header));
            if let Some(e) = entries[j] {
                self.dir.put(&hashes[j], e);
            }
        }
        Ok((entries, missing))
    }

    /// GETs `key` with one-sided reads, at most [`MAX_ATTEMPTS`] attempts.
    pub async fn get(&self, key: &[u8]) -> Result<OneSidedGet, BackendError> {
        Ok(self.get_traced(key).await?.0)
    }

    /// [`OneSided::get`], also saying how many round trips it took.
    pub async fn get_traced(&self, key: &[u8]) -> Result<(OneSidedGet, Trace), BackendError> {
        if self.is_local() {
            // An empty buffer grows to the value's exact size, which the
            // returned `Bytes` then owns: one allocation, one copy.
            let mut value = Vec::new();
            let (got, trace) = scratch::with_scratch(|s| self.get_local(key, s, &mut value))?;
            if scratch::yield_due(1) {
                tokio::task::yield_now().await;
            }
            return Ok((local_result(got, value), trace));
        }
        let (mut out, trace) = self.multi_get_traced(&[key]).await?;
        Ok((out.pop().expect("one result per key"), trace))
    }

    /// GETs many keys: all bucket reads in one batch, then all item reads in
    /// one batch, repeated for the keys that must retry. Batches carry at
    /// most as many keys as this path reads within a quarter of the grace
    /// period ([`next_batch_keys`]).
    pub async fn multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<OneSidedGet>, BackendError> {
        Ok(self.multi_get_traced(keys).await?.0)
    }

    /// [`OneSided::multi_get`], also saying how many round trips it took.
    pub async fn multi_get_traced<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<(Vec<OneSidedGet>, Trace), BackendError> {
        if let Some(r) = self.multi_get_local(keys) {
            if scratch::yield_due(keys.len()) {
                tokio::task::yield_now().await;
            }
            return r;
        }
        let mut results: Vec<Option<OneSidedGet>> = (0..keys.len()).map(|_| None).collect();
        let mut trace = Trace::default();
        let mut todo: Vec<usize> = (0..keys.len()).collect();
        for _ in 0..MAX_ATTEMPTS {
            if todo.is_empty() {
                break;
            }
            let mut retry_all = Vec::new();
            let mut rest = &todo[..];
            while !rest.is_empty() {
                let n = self.batch_keys.load(Ordering::Relaxed).clamp(1, rest.len());
                let (batch, tail) = rest.split_at(n);
                rest = tail;
                // Only multi-gets are sized: a single GET (the hot path) is
                // not timed twice more.
                let start = (keys.len() > 1).then(|| self.attempt_start());
                let (retry, rounds) = self.attempt(keys, batch, &mut results).await?;
                if let Some(start) = start {
                    let took = self.judge_time().saturating_sub(start);
                    // Without the grace check (tests that provoke tears) no batch is too slow.
                    let grace = if self.enforce_grace { self.header.grace_nanos } else { u64::MAX };
                    self.batch_keys.store(next_batch_keys(n, took, grace), Ordering::Relaxed);
                }
                trace.round_trips += rounds;
                if !retry.is_empty() {
                    trace.retries += rounds;
                }
                retry_all.extend(retry);
            }
            todo = retry_all;
        }
        for i in todo {
            self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
            results[i] = Some(OneSidedGet::GiveUp);
        }
        Ok((results.into_iter().map(|r| r.expect("every key resolved")).collect(), trace))
    }

    /// One attempt for keys `todo` of `keys`; returns those that must retry
    /// and the round trips (batches of reads) the attempt took.
    pub(super) async fn attempt<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        todo: &[usize],
        results: &mut [Option<OneSidedGet>],
    ) -> Result<(Vec<usize>, u32), BackendError> {
        let mut retry = Vec::new();
        let mut lease_start =
            AttemptStart::at(self.attempt_start(), self.routed_by(todo.iter().map(|&i| keys[i].as_ref())));
        // A key's first GET, or its first after a split, reads its
        // directory entry first: one more round trip.
        let hashes: Vec<KeyHash> = todo.iter().map(|&i| key_hash(keys[i].as_ref(), self.header.hash_seed)).collect();
        let (entries, read) = self.directory_entries(&hashes).await?;
        let dir_round = u32::from(!read.is_empty());
        let mut specs = Vec::with_capacity(todo.len() * 3);
        let mut pend: Vec<(usize, Pending)> = Vec::with_capacity(todo.len());
        for (j, ((&i, kh), entry)) in todo.iter().zip(hashes).zip(entries).enumerate() {
            let key = keys[i].as_ref();
            let Some(segment) = entry else {
                // A torn or refused entry read.
                self.counters.retry(Retry::Torn);
                retry.push(i);
                continue;
            };
            let (look, hint) = self.lookup(kh, segment);
            let start = specs.len();
            look.first_reads(&mut specs);
            let fresh = read.binary_search(&j).is_ok();
            pend.push((i, Pending { key, kh, segment, fresh, look, hint, first: start..specs.len(), items: 0..0 }));
        }
        if pend.is_empty() {
            return Ok((retry, dir_round));
        }
        let tail = self.push_tail(&mut specs);
        let mut reads = Reads::default();
        self.backend.read(&specs, &mut reads).await?;
        self.check_lease(&reads, tail, &mut lease_start)?;
        let clock = tail.clock(&reads);
        let mut item_specs = Vec::new();
        let mut second = Vec::new();
        for (i, mut p) in pend {
            let (b0, b1) = (reads.get(p.first.start), reads.get(p.first.start + 1));
            let (Some(b0), Some(b1)) = (b0, b1) else {
                self.counters.retry(Retry::Torn);
                retry.push(i);
                continue;
            };
            let hinted = p.hint.and_then(|_| reads.get(p.first.start + 2));
            let judged = p.look.after_buckets(p.key, [b0, b1], hinted, self.judge_time(), clock);
            // An entry just read from the directory: its segment's headers
            // say which other indexes it serves (once, not every GET).
            if p.fresh
                && let Some(h) = p.look.serving()
            {
                self.dir.learn(p.segment, h.depth, h.suffix);
            }
            match judged {
                AfterBuckets::Hit(h) => {
                    let item = hinted.expect("hit comes from the hinted item");
                    self.counters.hint_hits.fetch_add(1, Ordering::Relaxed);
                    results[i] = Some(self.found(&p.kh, item, &h));
                }
                AfterBuckets::Miss => results[i] = Some(self.missing(&p.kh)),
                AfterBuckets::Retry(r) => {
                    if r == Retry::StaleDirectory {
                        self.dir.forget(&p.kh, p.segment);
                    }
                    self.counters.retry(r);
                    retry.push(i);
                }
                AfterBuckets::ReadItems => {
                    let start = item_specs.len();
                    p.look.item_reads(&mut item_specs);
                    p.items = start..item_specs.len();
                    second.push((i, p));
                }
            }
        }
        if second.is_empty() {
            return Ok((retry, 1 + dir_round));
        }
        let tail = self.push_tail(&mut item_specs);
        let mut items = Reads::default();
        self.backend.read(&item_specs, &mut items).await?;
        self.check_lease(&items, tail, &mut lease_start)?;
        let clock = tail.clock(&items);
        for (i, p) in second {
            let bufs: Vec<&[u8]> = p.items.clone().map(|j| items.get(j).unwrap_or(&[])).collect();
            match p.look.after_items(p.key, &bufs, self.judge_time(), clock) {
                Outcome::Hit(h) => results[i] = Some(self.found(&p.kh, bufs[h.item], &h)),
                Outcome::Miss => results[i] = Some(self.missing(&p.kh)),
                Outcome::Retry(r) => {
                    self.counters.retry(r);
                    retry.push(i);
                }
            }
        }
        Ok((retry, 2 + dir_round))
    }

    /// The offsets of items read, for a report to an evicting server.
    pub fn take_accesses(&self) -> Option<Vec<u64>> {
        self.accesses.take_ready()
    }

    /// Adds a batch's closing read ([`Tail`]), after every data read (a
    /// reader must see the lease block as it was after them).
    pub(super) fn push_tail(&self, specs: &mut Vec<ReadSpec>) -> Tail {
        let leased = self.lease.is_some();
        specs.push(match leased {
            true => ReadSpec { offset: LEASE_OFFSET, len: (LEASE_LEN + 8) as u32 },
            false => clock_read(),
        });
        Tail { at: specs.len() - 1, leased }
    }

    /// The map version an attempt of `keys` is checked against (see
    /// `route`); no bound in a single node's region.
    pub(super) fn routed_by<'a>(&self, keys: impl Iterator<Item = &'a [u8]>) -> u64 {
        match &self.route {
            Some((shard, Some(view))) => view.routed_by(*shard, keys),
            Some((_, None)) => 0,
            None => u64::MAX,
        }
    }

    /// Whether a batch's reads may be believed: in a cluster region, only
    /// if the attempt so far (from `start` to the end of this batch) lay
    /// inside one run of the lease whose block the batch read last
    /// (`lease::check`). Bucket and item reads of one GET each pass this,
    /// so the GET took effect while the region's replica was the only
    /// leader and held every acknowledged write (docs/replication.md).
    pub(super) fn check_lease(&self, reads: &Reads, tail: Tail, start: &mut AttemptStart) -> Result<(), BackendError> {
        let Some(clock) = &self.lease else { return Ok(()) };
        let ended = self.judge_time();
        match lease::check(clock, self.header.hash_seed, tail.lease(reads), reads.stamps, start, ended) {
            Ok(()) => Ok(()),
            Err(why) => {
                use dmkv_common::cluster::lease::Distrust;
                if let (Distrust::StaleMap, Some((_, Some(view)))) = (why, &self.route) {
                    // The router asks for the map again (the read goes
                    // over RPC, which may well succeed and say nothing).
                    view.mark_stale();
                }
                let c = &self.counters;
                let why_counter = match why {
                    Distrust::NoLease => None,
                    Distrust::NotYet => Some(&c.lease_not_yet),
                    Distrust::Expired => Some(&c.lease_expired),
                    Distrust::StaleMap => Some(&c.stale_map),
                };
                if let Some(n) = why_counter {
                    n.fetch_add(1, Ordering::Relaxed);
                }
                c.unleased.fetch_add(1, Ordering::Relaxed);
                Err(BackendError::Unleased)
            }
        }
    }

    pub(super) fn found(&self, kh: &KeyHash, item: &[u8], h: &dmkv_common::read::Hit) -> OneSidedGet {
        let meta = self.note_found(kh, h);
        OneSidedGet::Found(Versioned {
            value: Bytes::copy_from_slice(&item[h.value.clone()]),
            version: meta.version,
            flags: meta.flags,
            expires_at: meta.expires_at,
        })
    }

    /// Counts a hit and remembers where it was.
    pub(super) fn note_found(&self, kh: &KeyHash, h: &dmkv_common::read::Hit) -> ItemMeta {
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        self.hints.lock().expect("hints poisoned").put(HintId::of(kh), h.hint);
        self.accesses.note(h.hint.slot.offset_units);
        ItemMeta { version: h.version, flags: h.flags, expires_at: h.expires_at }
    }

    pub(super) fn missing(&self, kh: &KeyHash) -> OneSidedGet {
        self.note_missing(kh);
        OneSidedGet::Missing
    }

    /// Counts a miss and forgets where the key was.
    pub(super) fn note_missing(&self, kh: &KeyHash) {
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        self.hints.lock().expect("hints poisoned").remove(HintId::of(kh));
    }
}

/// A local GET's result with its value (found: the whole buffer).
pub(super) fn local_result(got: LocalGet, value: Vec<u8>) -> OneSidedGet {
    match got {
        LocalGet::Found(m) => OneSidedGet::Found(Versioned {
            value: Bytes::from(value),
            version: m.version,
            flags: m.flags,
            expires_at: m.expires_at,
        }),
        LocalGet::Missing => OneSidedGet::Missing,
        LocalGet::GiveUp => OneSidedGet::GiveUp,
    }
}

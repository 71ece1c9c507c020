//! Single GETs over shared memory on the caller's thread: no runtime, no
//! task, and no heap allocation once the caller's buffers have grown to
//! their working size. The same protocol as [`OneSided::multi_get`] (the
//! pure judgments of [`dmkv_common::read`]), for one key, with reads that
//! are plain copies from the mapping.
//!
//! This is the hot path of a same-host reader: every GET of the async
//! client over shm runs here, and [`crate::blocking::Client::get_into`] runs
//! it without a runtime at all.

use std::sync::atomic::Ordering;

use dmkv_common::layout::{KeyHash, key_hash};
use dmkv_common::read::{AfterBuckets, MAX_ATTEMPTS, MAX_CANDIDATES, Outcome, Retry, dir_read, judge_dir_entry};

use super::backend::BackendError;
use super::hints::HintId;
use super::region::{Backend, OneSided, OneSidedGet, Trace};
use super::shm::ShmRegion;
use dmkv_common::cluster::lease_check::AttemptStart;

use super::region::local_result;
use super::scratch::{LocalGet, Scratch, with_scratch};

impl OneSided {
    /// The shared-memory backend, if this path reads through one.
    pub(super) fn shm(&self) -> Option<&ShmRegion> {
        match &self.backend {
            Backend::Shm(s) => Some(s),
            _ => None,
        }
    }

    /// Whether [`OneSided::get_local`] can serve GETs: the region is mapped
    /// in this process.
    pub fn is_local(&self) -> bool {
        self.shm().is_some()
    }

    /// GETs `keys` one after another on this thread, having first asked
    /// for the memory of every key whose place is cached (buckets and
    /// hinted item), so that the batch waits for memory about once rather
    /// than once per key. `None` on a path that is not local.
    pub(super) fn multi_get_local<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Option<Result<(Vec<OneSidedGet>, Trace), BackendError>> {
        let shm = self.shm()?;
        {
            let mut hints = self.hints.lock().expect("hints poisoned");
            for k in keys {
                let kh = key_hash(k.as_ref(), self.header.hash_seed);
                let Some(segment) = self.dir.get(&kh) else { continue };
                for b in kh.buckets {
                    shm.prefetch(segment.bucket_offset(b), dmkv_common::limits::BUCKET_LEN);
                }
                if let Some(h) = hints.get(HintId::of(&kh)) {
                    shm.prefetch(h.slot.offset(), h.slot.len());
                }
            }
        }
        let mut trace = Trace::default();
        let mut out = Vec::with_capacity(keys.len());
        let r = with_scratch(|s| {
            for k in keys {
                let mut value = Vec::new();
                let (got, t) = self.get_local(k.as_ref(), s, &mut value)?;
                trace.round_trips += t.round_trips;
                trace.retries += t.retries;
                out.push(local_result(got, value));
            }
            Ok(())
        });
        Some(r.map(|()| (out, trace)))
    }

    /// GETs `key` by copying from the mapped region on this thread, at most
    /// [`MAX_ATTEMPTS`] attempts. A found value replaces `out`'s contents.
    /// Fails with [`BackendError::Closed`] on a path that is not local.
    pub fn get_local(
        &self,
        key: &[u8],
        scratch: &mut Scratch,
        out: &mut Vec<u8>,
    ) -> Result<(LocalGet, Trace), BackendError> {
        let shm = self.shm().ok_or(BackendError::Closed)?;
        let kh = key_hash(key, self.header.hash_seed);
        let mut trace = Trace::default();
        for _ in 0..MAX_ATTEMPTS {
            let (got, rounds) = self.attempt_local(shm, key, kh, scratch, out)?;
            trace.round_trips += rounds;
            match got {
                Some(g) => return Ok((g, trace)),
                None => trace.retries += rounds,
            }
        }
        self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
        Ok((LocalGet::GiveUp, trace))
    }

    /// One attempt; `None` when it must be retried (the cause counted), and
    /// the round trips (batches of reads) it took.
    pub(super) fn attempt_local(
        &self,
        shm: &ShmRegion,
        key: &[u8],
        kh: KeyHash,
        s: &mut Scratch,
        out: &mut Vec<u8>,
    ) -> Result<(Option<LocalGet>, u32), BackendError> {
        let mut rounds = 0;
        // The directory entry and the hint are independent lookups that
        // both miss the cache over many keys: ask for the entry's line,
        // then take the hint while it comes.
        self.dir.prefetch(&kh);
        let hint = self.hint(&kh);
        let (segment, fresh) = match self.dir.get(&kh) {
            Some(e) => (e, false),
            None => {
                s.specs.clear();
                s.specs.push(dir_read(&kh, &self.header));
                shm.read(&s.specs, &mut s.reads)?;
                rounds += 1;
                self.counters.directory_reads.fetch_add(1, Ordering::Relaxed);
                match s.reads.get(0).and_then(|b| judge_dir_entry(b, &self.header)) {
                    Some(e) => {
                        self.dir.put(&kh, e);
                        (e, true)
                    }
                    None => {
                        self.counters.retry(Retry::Torn);
                        return Ok((None, rounds));
                    }
                }
            }
        };
        let mut look = self.lookup_hinted(kh, segment, hint);
        // The attempt's start is read before its first read of the data:
        // the lease check counts from it.
        let mut lease_start = AttemptStart::at(look.started(), self.routed_by(std::iter::once(key)));
        s.specs.clear();
        look.first_reads(&mut s.specs);
        let clock = self.read_batch(shm, s, &mut lease_start)?;
        rounds += 1;
        let (Some(b0), Some(b1)) = (s.reads.get(0), s.reads.get(1)) else {
            self.counters.retry(Retry::Torn);
            return Ok((None, rounds));
        };
        let hinted = hint.and_then(|_| s.reads.get(2));
        let judged = look.after_buckets(key, [b0, b1], hinted, self.judge_time(), clock);
        if fresh && let Some(h) = look.serving() {
            self.dir.learn(segment, h.depth, h.suffix);
        }
        match judged {
            AfterBuckets::Hit(h) => {
                let item = hinted.expect("hit comes from the hinted item");
                self.counters.hint_hits.fetch_add(1, Ordering::Relaxed);
                copy_value(out, &item[h.value.clone()]);
                return Ok((Some(LocalGet::Found(self.note_found(&kh, &h))), rounds));
            }
            AfterBuckets::Miss => {
                self.note_missing(&kh);
                return Ok((Some(LocalGet::Missing), rounds));
            }
            AfterBuckets::Retry(r) => {
                if r == Retry::StaleDirectory {
                    self.dir.forget(&kh, segment);
                }
                self.counters.retry(r);
                return Ok((None, rounds));
            }
            AfterBuckets::ReadItems => {}
        }
        s.specs.clear();
        look.item_reads(&mut s.specs);
        let n = look.item_read_count();
        let clock = self.read_batch(shm, s, &mut lease_start)?;
        rounds += 1;
        let mut bufs: [&[u8]; MAX_CANDIDATES] = [&[]; MAX_CANDIDATES];
        for (j, b) in bufs.iter_mut().enumerate().take(n) {
            *b = s.reads.get(j).unwrap_or(&[]);
        }
        Ok((
            match look.after_items(key, &bufs[..n], self.judge_time(), clock) {
                Outcome::Hit(h) => {
                    copy_value(out, &bufs[h.item][h.value.clone()]);
                    Some(LocalGet::Found(self.note_found(&kh, &h)))
                }
                Outcome::Miss => {
                    self.note_missing(&kh);
                    Some(LocalGet::Missing)
                }
                Outcome::Retry(r) => {
                    self.counters.retry(r);
                    None
                }
            },
            rounds,
        ))
    }
}

impl OneSided {
    /// Reads the batch in `s.specs`, with the lease block (a cluster
    /// region's) and the server's clock added last; checks the lease (for
    /// the attempt from `start` on) and returns the clock (0: none read).
    pub(super) fn read_batch(
        &self,
        shm: &ShmRegion,
        s: &mut Scratch,
        start: &mut AttemptStart,
    ) -> Result<u64, BackendError> {
        let tail = self.push_tail(&mut s.specs);
        shm.read(&s.specs, &mut s.reads)?;
        self.check_lease(&s.reads, tail, start)?;
        Ok(tail.clock(&s.reads))
    }
}

/// Replaces `out`'s contents with `value`, reusing its capacity.
fn copy_value(out: &mut Vec<u8>, value: &[u8]) {
    out.clear();
    out.extend_from_slice(value);
}

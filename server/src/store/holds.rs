//! What snapshot views of a store hold back from reuse: the blocks
//! unlinked since each view began, counted against [`MAX_HELD_SHARE`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dmkv_common::layout::Slot;

use crate::lock::lock;

/// A view may hold at most this share (1/n) of the data area's units from
/// reuse before it is aborted.
pub const MAX_HELD_SHARE: u64 = 4;
/// What `retire` keeps for one view.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) id: u64,
    /// Retirements numbered from here on are held (see `Store::retire_seq`).
    pub(super) from_seq: u64,
    /// Blocks unlinked since the view began.
    pub(super) unlinked: Mutex<Vec<Slot>>,
    /// Blocks (their first unit) linked since the view began with a
    /// version older than the view's next one: a touch rewrites an item
    /// and keeps its version, so the view's version filter would take the
    /// new copy (its expiry from after the view's moment) for the view's.
    /// The walk leaves them out; the copy of the view's moment is in
    /// `unlinked`. Bounded with `unlinked`: each such write unlinks one.
    pub(super) relinked: Mutex<std::collections::HashSet<u64>>,
    /// Units held so far.
    pub(super) units: AtomicU64,
    pub(super) aborted: AtomicBool,
}

/// The views of a store in progress.
#[derive(Debug, Default)]
pub(super) struct Views {
    pub(super) list: Mutex<Vec<Arc<Held>>>,
    /// Views in `list`: `retire` looks only when there are any.
    pub(super) active: std::sync::atomic::AtomicUsize,
    pub(super) next_id: AtomicU64,
}

impl Views {
    /// Notes that `slot` was unlinked (and is held for every view); aborts
    /// a view that now holds more than `max_units`.
    pub(super) fn note_unlinked(&self, slot: Slot, max_units: u64) {
        if self.active.load(Ordering::Acquire) == 0 {
            return;
        }
        let list = lock(&self.list);
        for h in list.iter() {
            if h.aborted.load(Ordering::Relaxed) {
                continue;
            }
            let held = h.units.fetch_add(u64::from(slot.units), Ordering::Relaxed) + u64::from(slot.units);
            if held > max_units {
                h.aborted.store(true, Ordering::Release);
                lock(&h.unlinked).clear();
                lock(&h.relinked).clear();
                continue;
            }
            lock(&h.unlinked).push(slot);
        }
    }

    /// Notes that `slot` is about to be linked with a version older than
    /// the store's next one, by a touch or a compactor move (before it is
    /// published, so a walk that sees the slot sees the note).
    pub(super) fn note_relinked(&self, slot: Slot) {
        if self.active.load(Ordering::Acquire) == 0 {
            return;
        }
        for h in lock(&self.list).iter().filter(|h| !h.aborted.load(Ordering::Relaxed)) {
            lock(&h.relinked).insert(slot.offset_units);
        }
    }

    /// Retirements from this number on are held (`u64::MAX`: none).
    pub(super) fn hold_from(&self) -> u64 {
        if self.active.load(Ordering::Acquire) == 0 {
            return u64::MAX;
        }
        lock(&self.list)
            .iter()
            .filter(|h| !h.aborted.load(Ordering::Relaxed))
            .map(|h| h.from_seq)
            .min()
            .unwrap_or(u64::MAX)
    }

    /// Aborts every view: the store is being emptied and refilled
    /// (`Store::clear`), so what a view walks from now on is no state the
    /// store was in at the view's moment (a refill's items, unlinked by a
    /// replay, would come back as if live).
    pub(super) fn abort_all(&self) {
        for h in lock(&self.list).iter() {
            h.aborted.store(true, Ordering::Release);
            lock(&h.unlinked).clear();
            lock(&h.relinked).clear();
        }
    }

    pub(super) fn remove(&self, id: u64) {
        let mut list = lock(&self.list);
        list.retain(|h| h.id != id);
        self.active.store(list.len(), Ordering::Release);
    }
}

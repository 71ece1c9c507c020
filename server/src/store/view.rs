//! Consistent views of a store for snapshots, taken without stopping
//! writes: a view is the store as of one moment (a shard's applied index),
//! read by another thread while the shard applies later writes.
//!
//! Writes are out of place and every unlinked block goes through `retire`,
//! so the store as of the view is: the items of the directory's segments
//! then (a segment split since is frozen, and kept), less those written
//! since (their versions are the view's next version or later), plus those
//! unlinked since (logged by `retire` for the view). Nothing unlinked after
//! the view began is reused while the view lives: `reclaim` holds retired
//! blocks and segments from the view's first retirement on. That hold is
//! the view's cost, bounded by [`MAX_HELD_SHARE`] of the data area: past
//! it the view is aborted (its reader gets [`ViewError::Aborted`]) and
//! space flows again.
//!
//! A touch rewrites an item keeping its version, and so does a compactor
//! move, so the version filter cannot tell such a copy from the view's:
//! their blocks are noted as they are linked (`Held::relinked`) and left
//! out, and the view's copy is met in the unlinked list. So the walk meets
//! every item of the view once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dmkv_common::layout::{ItemRef, Slot, decode_item};
use dmkv_common::limits::{SEGMENT_BUCKETS, SLOTS_PER_BUCKET};
use thiserror::Error;

use super::Store;
use super::holds::Held;
pub use super::holds::MAX_HELD_SHARE;
use crate::lock::lock;

/// Most views of one store at once (a snapshot for each follower that
/// needs one, and a save).
pub const MAX_VIEWS: usize = 4;

/// Why a view could not be taken or read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ViewError {
    #[error("{MAX_VIEWS} snapshots of this store are in progress already")]
    TooMany,
    #[error("the snapshot was aborted: writes since it began held more than 1/{MAX_HELD_SHARE} of the store's memory")]
    Aborted,
}

/// A consistent view of a store (see the module's comment).
pub struct StoreView {
    store: Arc<Store>,
    held: Arc<Held>,
    /// The directory's segments when the view began.
    segments: Vec<u32>,
    next_version: u64,
}

impl Store {
    /// A view of the store as it is now. The caller makes sure no write
    /// runs meanwhile (the shard thread takes it between two applies); it
    /// costs a pass over the directory.
    pub fn view(self: &Arc<Self>) -> Result<StoreView, ViewError> {
        let w = lock(&self.writer);
        let mut list = lock(&self.views.list);
        if list.len() >= MAX_VIEWS {
            return Err(ViewError::TooMany);
        }
        let held = Arc::new(Held {
            id: self.views.next_id.fetch_add(1, Ordering::Relaxed),
            from_seq: self.retire_seq.load(Ordering::Acquire),
            unlinked: Mutex::new(Vec::new()),
            relinked: Mutex::new(Default::default()),
            units: AtomicU64::new(0),
            aborted: AtomicBool::new(false),
        });
        list.push(Arc::clone(&held));
        self.views.active.store(list.len(), Ordering::Release);
        drop(list);
        let mut segments: Vec<u32> = self.index.directory().collect();
        segments.sort_unstable();
        segments.dedup();
        Ok(StoreView { store: Arc::clone(self), held, segments, next_version: w.next_version })
    }
}

impl StoreView {
    /// The version the store's next write got when the view began: every
    /// item of the view is older.
    pub fn next_version(&self) -> u64 {
        self.next_version
    }

    /// Whether the view was aborted ([`ViewError::Aborted`]): a walk that
    /// failed for that may succeed with a new view, once writes slow.
    pub fn aborted(&self) -> bool {
        self.held.aborted.load(Ordering::Acquire)
    }

    /// Calls `f` with every item of the view (perhaps twice, see the
    /// module's comment). Items that do not verify (scribbled over) are
    /// left out, as a dump leaves them out.
    pub fn walk(&self, mut f: impl FnMut(&ItemRef<'_>) -> Result<(), String>) -> Result<(), String> {
        let mut buf = Vec::new();
        let aborted = || self.held.aborted.load(Ordering::Acquire);
        let mut one = |slot: Slot, buf: &mut Vec<u8>| -> Result<(), String> {
            if !self.store.read_verified(slot, buf) {
                return Ok(());
            }
            match decode_item(buf) {
                Ok(item)
                    if item.version < self.next_version && !lock(&self.held.relinked).contains(&slot.offset_units) =>
                {
                    f(&item)
                }
                _ => Ok(()),
            }
        };
        for &id in &self.segments {
            if aborted() {
                return Err(ViewError::Aborted.to_string());
            }
            let seg = self.store.index.seg(id);
            for b in 0..SEGMENT_BUCKETS {
                for i in 0..SLOTS_PER_BUCKET {
                    if let Some(slot) = Slot::unpack(seg.slot(b, i)) {
                        one(slot, &mut buf)?;
                    }
                }
            }
        }
        // Everything of the view not met in the index was unlinked before
        // its segment was walked, and is in this list once the write that
        // unlinked it has retired it: writes publish the new slot, then
        // retire the old block, under the writer lock, so taking the lock
        // once waits out a write the walk saw half done.
        drop(lock(&self.store.writer));
        let unlinked = std::mem::take(&mut *lock(&self.held.unlinked));
        if aborted() {
            return Err(ViewError::Aborted.to_string());
        }
        for slot in unlinked {
            one(slot, &mut buf)?;
        }
        // An abort during the loops released what the view held: a block
        // met after it may have been reused, or the store emptied.
        if aborted() {
            return Err(ViewError::Aborted.to_string());
        }
        Ok(())
    }
}

impl Drop for StoreView {
    fn drop(&mut self) {
        self.store.views.remove(self.held.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use std::collections::BTreeMap;
    use std::time::Duration;

    fn store(grace: Duration) -> Arc<Store> {
        Arc::new(Store::format(Arc::new(Region::create("view", 8 << 20).unwrap()), 16, 3, 1, grace).unwrap())
    }

    fn items(v: &StoreView) -> BTreeMap<Vec<u8>, (Vec<u8>, u64)> {
        let mut m = BTreeMap::new();
        v.walk(|it| {
            let old = m.insert(it.key.to_vec(), (it.value.to_vec(), it.version));
            // Met twice: the same version both times.
            assert!(old.is_none_or(|(_, ver)| ver == it.version), "two versions of {:?}", it.key);
            Ok(())
        })
        .unwrap();
        m
    }

    fn dump(s: &Store) -> BTreeMap<Vec<u8>, (Vec<u8>, u64)> {
        let mut m = BTreeMap::new();
        s.dump(|k, v, ver| {
            m.insert(k.to_vec(), (v.to_vec(), ver));
        });
        m
    }

    /// A view read while writes go on (overwrites, deletes, splits of the
    /// index, space reused) is the store as it was when the view began.
    #[test]
    fn a_view_is_the_store_of_its_moment_whatever_is_written_after() {
        // No grace: retired space would be reused at once, if not held.
        let s = store(Duration::ZERO);
        for i in 0..400u32 {
            s.put(format!("k{i}").as_bytes(), &i.to_le_bytes().repeat(1 + i as usize % 9)).unwrap();
        }
        let before = dump(&s);
        let view = s.view().unwrap();
        // Every key rewritten, a third deleted, many new ones (splits).
        for i in 0..400u32 {
            s.put(format!("k{i}").as_bytes(), b"later").unwrap();
        }
        for i in (0..400u32).step_by(3) {
            s.delete(format!("k{i}").as_bytes()).unwrap();
        }
        for i in 0..3000u32 {
            s.put(format!("new{i}").as_bytes(), &[7u8; 40]).unwrap();
        }
        assert!(s.index_stats().splits > 0, "the index split meanwhile");
        assert_eq!(items(&view), before);
        drop(view);
        assert_eq!(s.views.active.load(Ordering::Relaxed), 0);
    }

    /// A touch after the view began rewrites the item with the version it
    /// had: the view still holds the item's expiry of its moment, one copy
    /// of it, though the item was touched twice (the second touch unlinks
    /// the first's copy too).
    #[test]
    fn a_touch_after_the_view_began_is_not_in_it() {
        const NOW: u64 = 1_800_000_000_000;
        let s = store(Duration::ZERO);
        let w = crate::store::item::Write {
            expiry: crate::store::item::Expiry::At(2_000_000_000),
            ..crate::store::item::Write::set(b"v")
        };
        s.write(b"k", &w, NOW).unwrap();
        let view = s.view().unwrap();
        s.touch(b"k", 2_100_000_000, NOW).unwrap().expect("touched");
        s.touch(b"k", 2_200_000_000, NOW).unwrap().expect("touched again");
        let mut seen = Vec::new();
        view.walk(|it| {
            seen.push(it.expires_at);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![2_000_000_000], "the view's copies of k, by expiry");
    }

    /// The compactor moves a copy a touch made after the view began: the
    /// moved copy is not the view's either.
    #[test]
    fn a_touched_item_moved_after_the_view_began_is_not_in_it() {
        use crate::store::{Candidate, Relocation};
        const NOW: u64 = 1_800_000_000_000;
        let s = store(Duration::ZERO);
        let w = crate::store::item::Write {
            expiry: crate::store::item::Expiry::At(2_000_000_000),
            ..crate::store::item::Write::set(b"v")
        };
        s.write(b"k", &w, NOW).unwrap();
        let view = s.view().unwrap();
        s.touch(b"k", 2_100_000_000, NOW).unwrap().expect("touched");
        let (_, at) = s.get_item(b"k", NOW).unwrap().unwrap();
        let slot = Slot::unpack(at.slot).unwrap();
        let items = s.begin_evacuation(slot.offset_units..slot.offset_units + u64::from(slot.units)).unwrap();
        assert_eq!(items.len(), 1);
        let to = s.reserve(items.iter().map(Candidate::units).sum()).unwrap();
        assert_eq!(s.relocate(&items[0], to), Relocation::Moved);
        let mut seen = Vec::new();
        view.walk(|it| {
            seen.push(it.expires_at);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![2_000_000_000], "the view's copies of k, by expiry");
    }

    /// Writes racing a walk on another thread.
    #[test]
    fn a_view_walked_while_another_thread_writes_is_its_moment() {
        let s = store(Duration::ZERO);
        for i in 0..2000u32 {
            s.put(format!("k{i}").as_bytes(), &i.to_le_bytes()).unwrap();
        }
        let before = dump(&s);
        let view = s.view().unwrap();
        let w = Arc::clone(&s);
        let writer = std::thread::spawn(move || {
            for round in 0..5u32 {
                for i in 0..2000u32 {
                    let k = format!("k{i}");
                    if (i + round) % 4 == 0 {
                        w.delete(k.as_bytes()).unwrap();
                    } else {
                        w.put(k.as_bytes(), &[round as u8; 24]).unwrap();
                    }
                }
            }
        });
        let got = items(&view);
        writer.join().unwrap();
        assert_eq!(got, before);
    }

    /// A view that holds too much space is aborted, and space flows again.
    #[test]
    fn a_view_holding_too_much_is_aborted() {
        let s = store(Duration::ZERO);
        s.put(b"k", &[1u8; 1000]).unwrap();
        let view = s.view().unwrap();
        let mut n = 0;
        // Rewrites of one key: without the abort, memory fills up.
        while !view.held.aborted.load(Ordering::Relaxed) {
            s.put(b"k", &[2u8; 1000]).unwrap();
            n += 1;
            assert!(n < 100_000, "never aborted");
        }
        assert_eq!(view.walk(|_| Ok(())), Err(ViewError::Aborted.to_string()));
        // An aborted view holds nothing: rewrites go on without end.
        for _ in 0..20_000 {
            s.put(b"k", &[3u8; 1000]).unwrap();
        }
        drop(view);
        let views: Vec<_> = (0..MAX_VIEWS).map(|_| s.view().unwrap()).collect();
        assert_eq!(s.view().err(), Some(ViewError::TooMany));
        drop(views);
        assert!(s.view().is_ok());
    }

    /// A store emptied and refilled under a view (an in-place restart:
    /// cleared, restored from an older snapshot, its log replayed) is no
    /// longer the view's moment: the walk fails rather than mix the two
    /// (a key the replay deletes again would come back from the unlinked
    /// list).
    #[test]
    fn a_view_of_a_store_emptied_and_refilled_meanwhile_fails() {
        let s = store(Duration::ZERO);
        for i in 0..50u32 {
            s.put(format!("k{i}").as_bytes(), b"old").unwrap();
        }
        let view = s.view().unwrap();
        s.clear(1).unwrap();
        s.put(b"k7", b"replayed").unwrap();
        s.delete(b"k7").unwrap();
        let got = view.walk(|_| Ok(()));
        assert_eq!(got, Err(ViewError::Aborted.to_string()), "a walk across a refill must fail");
        drop(view);
        assert!(s.view().is_ok(), "a new view of the refilled store works");
    }
}

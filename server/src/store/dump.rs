//! The store's side of raft snapshots: every live item listed with its
//! version, and a store emptied and filled again from such a list, so a
//! replica that catches up by snapshot holds what the leader held, down
//! to the versions.

use dmkv_common::error::Error;
use dmkv_common::layout::decode_item;

use super::Store;
use crate::lock::lock;

impl Store {
    /// Calls `f(key, value, version)` for every live item, under the writer
    /// lock (so the list is one moment's picture: no write runs meanwhile);
    /// returns the version the next write would get. Items that do not
    /// verify (scribbled over) are left out and counted as corrupt reads.
    pub fn dump(&self, mut f: impl FnMut(&[u8], &[u8], u64)) -> u64 {
        let w = lock(&self.writer);
        let mut buf = Vec::new();
        for (_, _, _, slot) in self.live_slots() {
            if self.read_verified(slot, &mut buf)
                && let Ok(item) = decode_item(&buf)
            {
                f(item.key, item.value, item.version);
            }
        }
        w.next_version
    }

    /// How many live items there are and an order-independent checksum of
    /// them (key, value, version, flags, expiry), as one moment's picture
    /// (under the writer lock): replicas of a shard that applied the same
    /// log give the same pair, whatever order their indexes keep. For
    /// tests and diagnostics: it walks the whole store.
    pub fn digest(&self) -> (u64, u64) {
        let _w = lock(&self.writer);
        let mut buf = Vec::new();
        let (mut items, mut sum) = (0u64, 0u64);
        for (_, _, _, slot) in self.live_slots() {
            if self.read_verified(slot, &mut buf)
                && let Ok(it) = decode_item(&buf)
            {
                let mut h = xxhash_rust::xxh3::Xxh3Default::new();
                h.update(&(it.key.len() as u64).to_le_bytes());
                h.update(it.key);
                h.update(&it.version.to_le_bytes());
                h.update(&it.flags.to_le_bytes());
                h.update(&it.expires_at.to_le_bytes());
                h.update(it.value);
                items += 1;
                sum = sum.wrapping_add(h.digest());
            }
        }
        (items, sum)
    }

    /// Up to `max` live items at server time `now_ms` whose keys `keep`
    /// takes, as (key, value length, expiry), in index order (memcached's
    /// `stats cachedump`), reading at most about `max_bytes` of items.
    /// Read as GETs read, under an epoch guard and not the writer lock, so
    /// writes go on meanwhile and the list is no one moment's picture; the
    /// bounds keep the guard (which holds back reclaiming) short.
    pub fn list(
        &self,
        max: usize,
        max_bytes: u64,
        now_ms: u64,
        keep: impl Fn(&[u8]) -> bool,
    ) -> Vec<(Vec<u8>, usize, u32)> {
        let _guard = crossbeam_epoch::pin();
        let mut buf = Vec::new();
        let mut out = Vec::new();
        let mut read = 0u64;
        for (_, _, _, slot) in self.live_slots() {
            if out.len() >= max || read >= max_bytes {
                break;
            }
            read += u64::from(slot.units) * dmkv_common::limits::UNIT as u64;
            if self.read_verified(slot, &mut buf)
                && let Ok(it) = decode_item(&buf)
                && !dmkv_common::expiry::expired(it.expires_at, now_ms)
                && keep(it.key)
            {
                out.push((it.key.to_vec(), it.value.len(), it.expires_at));
            }
        }
        out
    }

    /// Every live key (for emptying the store).
    fn keys(&self) -> Vec<Vec<u8>> {
        let mut keys = Vec::new();
        self.dump(|k, _, _| keys.push(k.to_vec()));
        keys
    }

    /// Deletes every item, and sets the version the next write gets: the
    /// store then takes a snapshot's items with [`Store::restore`].
    pub fn clear(&self, next_version: u64) -> Result<(), Error> {
        // Before the first key goes: a read begun on the old contents must
        // be able to tell (`Store::generation`).
        self.generation.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // A snapshot being walked from the old contents would mix them
        // with the refill's (a key a replay deletes again comes back).
        self.views.abort_all();
        for k in self.keys() {
            self.delete(&k)?;
        }
        lock(&self.writer).next_version = next_version;
        Ok(())
    }

    /// Stores an item of a snapshot with the version, flags and expiry it
    /// had.
    pub fn restore(&self, key: &[u8], value: &[u8], version: u64, flags: u32, expires_at: u32) -> Result<(), Error> {
        let plan = |_: Option<super::Current<'_>>| {
            Ok(super::Plan { value: value.into(), flags, expires_at, version: Some(version) })
        };
        self.write_item(key, false, plan).map(|_| ())
    }

    /// Stores an item copied from another store (a partition moving here)
    /// with the version, flags and expiry it had there, unless the item
    /// held is newer, or the same (a copy applied again). Returns whether
    /// it was stored. An expired item held is still compared by version:
    /// what decides is which write came later, not what a clock says.
    pub fn ingest(&self, key: &[u8], value: &[u8], version: u64, flags: u32, expires_at: u32) -> Result<bool, Error> {
        let plan = |cur: Option<super::Current<'_>>| match cur.map(|c| c.meta()) {
            Some(m)
                if m.version > version || (m.version == version && (m.flags, m.expires_at) == (flags, expires_at)) =>
            {
                Err(Error::Exists)
            }
            _ => Ok(super::Plan { value: value.into(), flags, expires_at, version: Some(version) }),
        };
        match self.write_item(key, true, plan) {
            Ok(_) => Ok(true),
            Err(Error::Exists) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Removes `key`'s item if its version is below `below` (the source of
    /// a copy no longer had the key when its versions reached `below`).
    /// Returns whether an item went.
    pub fn ingest_absence(&self, key: &[u8], below: u64) -> Result<bool, Error> {
        let judge = |slot, buf: &mut Vec<u8>| {
            let held = if self.read_verified(slot, buf) { decode_item(buf).ok().map(|it| it.version) } else { None };
            match held {
                Some(v) if v >= below => Err(Error::Exists),
                _ => Ok(true),
            }
        };
        match self.delete_where(key, judge) {
            Ok(went) => Ok(went),
            Err(Error::Exists) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    fn store() -> Store {
        Store::format(Arc::new(Region::create("dump", 8 << 20).unwrap()), 64, 3, 1, Duration::ZERO).unwrap()
    }

    /// key → (value, version).
    type Items = BTreeMap<Vec<u8>, (Vec<u8>, u64)>;

    fn all(s: &Store) -> (Items, u64) {
        let mut m = BTreeMap::new();
        let next = s.dump(|k, v, ver| {
            m.insert(k.to_vec(), (v.to_vec(), ver));
        });
        (m, next)
    }

    #[test]
    fn a_dump_restored_elsewhere_is_the_same_store() {
        let a = store();
        // Enough keys to split the index, overwrites and deletes between.
        for i in 0..3000u32 {
            a.put(format!("k{i}").as_bytes(), &i.to_le_bytes().repeat(1 + i as usize % 7)).unwrap();
        }
        for i in (0..3000u32).step_by(3) {
            a.put(format!("k{i}").as_bytes(), b"again").unwrap();
        }
        for i in (0..3000u32).step_by(5) {
            a.delete(format!("k{i}").as_bytes()).unwrap();
        }
        let (items, next) = all(&a);
        assert_eq!(items.len(), 2400);
        let b = store();
        b.put(b"stale", b"gone after clear").unwrap();
        b.clear(next).unwrap();
        for (k, (v, ver)) in &items {
            b.restore(k, v, *ver, 0, 0).unwrap();
        }
        assert_eq!(all(&b), (items, next), "same items, versions and next version");
        assert_eq!(a.put(b"new", b"1").unwrap(), b.put(b"new", b"1").unwrap());
    }
}

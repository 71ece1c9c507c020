//! Where keys' items were last found, so a GET can read bucket and item in
//! one round trip.
//!
//! Bounded by construction: a fixed array of sets of [`WAYS`] entries,
//! indexed by the key's hash; a new key takes an empty way or evicts the
//! least recently used one of its set. Nothing else holds keys, so no mix of
//! puts, deletes and re-puts can make it grow.
//!
//! Entries are named by a 64-bit hash of the key ([`HintId`]), not the key:
//! no allocation per new key and no second pointer to chase per GET. Two
//! keys with one id share an entry; that costs a round trip, never a wrong
//! value, because a hinted item is believed only if it holds the key read.

use dmkv_common::layout::KeyHash;
use dmkv_common::read::Hint;

/// Entries per set.
pub const WAYS: usize = 2;

/// A key's name in the cache: 64 bits of its [`KeyHash`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HintId(u64);

impl HintId {
    /// The id of the key hashed to `kh`.
    pub fn of(kh: &KeyHash) -> HintId {
        let [b0, b1] = kh.buckets;
        HintId(u64::from(kh.dir_hash) | u64::from(kh.fingerprint) << 32 | u64::from(b0) << 48 | u64::from(b1) << 56)
    }
}

#[derive(Clone, Copy)]
struct Entry {
    id: HintId,
    hint: Hint,
    /// When it was last used, in [`HintCache::tick`]s.
    used: u64,
}

/// A bounded, set-associative map from key to [`Hint`].
pub struct HintCache {
    sets: Vec<[Option<Entry>; WAYS]>,
    tick: u64,
}

impl HintCache {
    /// A cache of at most `entries` keys (rounded up to a multiple of
    /// [`WAYS`]); 0 turns it off.
    pub fn new(entries: usize) -> HintCache {
        let sets = entries.div_ceil(WAYS);
        HintCache { sets: vec![[None; WAYS]; sets], tick: 0 }
    }

    /// Most keys it can hold.
    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.sets.len() * WAYS
    }

    /// Keys held now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.sets.iter().flatten().filter(|e| e.is_some()).count()
    }

    fn set(&mut self, id: HintId) -> Option<&mut [Option<Entry>; WAYS]> {
        let n = self.sets.len() as u64;
        if n == 0 {
            return None;
        }
        self.tick += 1;
        // The id's bits are a hash's already; spread them over the sets
        // (Fibonacci hashing, so any set count works).
        let at = (id.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % n;
        self.sets.get_mut(at as usize)
    }

    /// The hint cached for `id`.
    pub fn get(&mut self, id: HintId) -> Option<Hint> {
        let tick = self.tick + 1;
        let e = self.set(id)?.iter_mut().flatten().find(|e| e.id == id)?;
        e.used = tick;
        Some(e.hint)
    }

    /// Caches `hint` for `id`, evicting the least recently used key of its
    /// set if the set is full.
    pub fn put(&mut self, id: HintId, hint: Hint) {
        let tick = self.tick + 1;
        let Some(set) = self.set(id) else { return };
        if let Some(e) = set.iter_mut().flatten().find(|e| e.id == id) {
            e.hint = hint;
            e.used = tick;
            return;
        }
        let way = set
            .iter()
            .position(Option::is_none)
            .unwrap_or_else(|| (0..WAYS).min_by_key(|&w| set[w].as_ref().map_or(0, |e| e.used)).unwrap_or(0));
        set[way] = Some(Entry { id, hint, used: tick });
    }

    /// Forgets `id`.
    pub fn remove(&mut self, id: HintId) {
        if let Some(set) = self.set(id)
            && let Some(way) = set.iter().position(|e| e.as_ref().is_some_and(|e| e.id == id))
        {
            set[way] = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_common::layout::{Slot, key_hash};

    fn id(k: &[u8]) -> HintId {
        HintId::of(&key_hash(k, 7))
    }

    fn hint(n: u64) -> Hint {
        Hint { which: 0, index: 0, slot: Slot::new(1, 64 * (n % 1000 + 1), 1) }
    }

    /// Delete/re-put churn of ever new keys must not grow the cache: the
    /// FIFO it replaced kept every deleted key in its queue until it aged
    /// out, and re-putting pushed it again.
    #[test]
    fn churn_stays_bounded() {
        let mut c = HintCache::new(1024);
        for i in 0..200_000u64 {
            let k = format!("key{i}");
            c.put(id(k.as_bytes()), hint(i));
            c.remove(id(k.as_bytes()));
            c.put(id(k.as_bytes()), hint(i + 1));
            if i % 3 == 0 {
                c.remove(id(k.as_bytes()));
            }
            if i % 1000 == 0 {
                assert!(c.len() <= c.capacity());
            }
        }
        assert_eq!(c.capacity(), 1024);
        assert!(c.len() > 512, "the cache still holds recent keys: {}", c.len());
        // Every key deleted after use (a queue-like workload): the old FIFO's
        // queue reached 300,000 keys here with an empty map.
        for i in 0..200_000u64 {
            let k = format!("gone{i}");
            c.put(id(k.as_bytes()), hint(i));
            c.remove(id(k.as_bytes()));
            if i % 2 == 0 {
                c.put(id(k.as_bytes()), hint(i));
                c.remove(id(k.as_bytes()));
            }
        }
        assert!(c.len() <= c.capacity() && c.sets.len() * WAYS == 1024);
    }

    #[test]
    fn get_put_remove_and_lru() {
        let mut c = HintCache::new(2);
        assert_eq!(c.get(id(b"a")), None);
        c.put(id(b"a"), hint(1));
        c.put(id(b"b"), hint(2));
        assert_eq!(c.get(id(b"a")), Some(hint(1)));
        // One set of two ways: "c" evicts the least recently used, "b".
        c.put(id(b"c"), hint(3));
        assert_eq!((c.get(id(b"a")), c.get(id(b"b")), c.get(id(b"c"))), (Some(hint(1)), None, Some(hint(3))));
        c.put(id(b"a"), hint(4));
        assert_eq!(c.get(id(b"a")), Some(hint(4)));
        c.remove(id(b"a"));
        assert_eq!(c.get(id(b"a")), None);
        assert_eq!(c.len(), 1);
        let mut off = HintCache::new(0);
        off.put(id(b"a"), hint(1));
        assert_eq!((off.get(id(b"a")), off.len()), (None, 0));
    }
}

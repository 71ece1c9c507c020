//! The keys a shard's log wrote in partitions it is moving out, since the
//! mover last took them (docs/elasticity.md, "Catch up"). Each replica
//! notes them as it applies its log from the move's WATCH entry on, so a
//! new leader holds them too; the mover takes them from the leader round
//! by round and copies each key as the store holds it then.
//!
//! Not part of the replicated state: a replica that restored a snapshot,
//! or started from one, missed the writes before it, so every watched
//! partition it holds is marked *whole* (the mover copies the whole
//! partition again), and so is one whose notes passed their bound. A
//! take from a complete set is exact; a take from a whole one is a
//! superset. Either way a key written since the view of the copy reaches
//! the target.

use std::collections::{BTreeMap, HashSet};

use bytes::Bytes;
use dmkv_common::cluster::map::partition_of;

use super::placement::Placement;

/// Most keys noted per partition before it is marked whole.
pub const MAX_NOTED_KEYS: usize = 1 << 16;
/// Most key bytes noted per partition before it is marked whole.
pub const MAX_NOTED_BYTES: usize = 8 << 20;

/// What a partition's notes say since the last take.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Notes {
    pub keys: HashSet<Bytes>,
    bytes: usize,
    /// Some writes were not noted: the whole partition must be copied.
    pub whole: bool,
}

/// Notes per watched partition.
#[derive(Debug)]
pub struct Noted {
    by_partition: BTreeMap<u32, Notes>,
    max_keys: usize,
    max_bytes: usize,
}

impl Default for Noted {
    fn default() -> Noted {
        Noted::with_bounds(MAX_NOTED_KEYS, MAX_NOTED_BYTES)
    }
}

impl Noted {
    /// Notes bounded per partition by `max_keys` keys and `max_bytes` key
    /// bytes.
    pub fn with_bounds(max_keys: usize, max_bytes: usize) -> Noted {
        Noted { by_partition: BTreeMap::new(), max_keys, max_bytes }
    }

    /// Notes `key` if its partition is watched.
    pub fn note(&mut self, placement: &Placement, key: &[u8]) {
        let p = partition_of(key);
        if !placement.watched(p) {
            return;
        }
        let n = self.by_partition.entry(p).or_default();
        if n.whole {
            return;
        }
        if n.keys.len() >= self.max_keys || n.bytes + key.len() > self.max_bytes {
            *n = Notes { whole: true, ..Notes::default() };
            return;
        }
        if n.keys.insert(Bytes::copy_from_slice(key)) {
            n.bytes += key.len();
        }
    }

    /// Every watched partition is to be copied whole: the store changed
    /// in a way no key list names (a flush), or this replica's store came
    /// from a snapshot and missed the writes before it.
    pub fn all_whole(&mut self, placement: &Placement) {
        for m in placement.moves().iter().filter(|m| placement.watched(m.partition)) {
            self.by_partition.insert(m.partition, Notes { whole: true, ..Notes::default() });
        }
    }

    /// Drops the notes of partitions no longer watched.
    pub fn retain_watched(&mut self, placement: &Placement) {
        self.by_partition.retain(|&p, _| placement.watched(p));
    }

    /// Takes the notes of `partition` (empty if nothing was written since
    /// the last take), leaving it noted afresh from here on.
    pub fn take(&mut self, partition: u32) -> Notes {
        self.by_partition.get_mut(&partition).map(std::mem::take).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_common::cluster::map::PARTITIONS;
    use dmkv_common::proto;

    fn key_in(p: u32, i: usize) -> Vec<u8> {
        (0..).map(|n| format!("n{n}").into_bytes()).filter(|k| partition_of(k) == p).nth(i).unwrap()
    }

    #[test]
    fn only_watched_partitions_are_noted_and_a_bound_makes_them_whole() {
        let mut placement = Placement::all();
        let (p, q) = (5, 6);
        let watch = proto::MoveStep { partition: p, version: 2, kind: proto::move_step::Kind::Watch as i32, claim: 0 };
        assert_eq!(placement.apply_step(&watch), Ok(true));
        let mut n = Noted::default();
        n.note(&placement, &key_in(p, 0));
        n.note(&placement, &key_in(p, 0));
        n.note(&placement, &key_in(q, 0));
        let got = n.take(p);
        assert_eq!((got.keys.len(), got.whole), (1, false));
        assert!(n.take(p).keys.is_empty(), "taken");
        assert!(n.take(q).keys.is_empty(), "not watched");
        let mut small = Noted::with_bounds(2, 1 << 20);
        for i in 0..3 {
            small.note(&placement, &key_in(p, i));
            small.note(&placement, &key_in(q, i));
        }
        let got = small.take(p);
        assert!(got.whole && got.keys.is_empty(), "past the bound: whole, {got:?}");
        assert!((0..PARTITIONS).all(|x| !small.take(x).whole), "only the watched partition");
        let mut short = Noted::with_bounds(100, 2 * key_in(p, 0).len());
        for i in [0, 0, 0] {
            short.note(&placement, &key_in(p, i));
        }
        assert!(!short.take(p).whole, "one key noted thrice is one key");
        n.note(&placement, &key_in(p, 1));
        n.all_whole(&placement);
        assert!(n.take(p).whole);
        let forget =
            proto::MoveStep { partition: p, version: 2, kind: proto::move_step::Kind::Forget as i32, claim: 0 };
        assert_eq!(placement.apply_step(&forget), Ok(true));
        n.note(&placement, &key_in(p, 2));
        n.retain_watched(&placement);
        assert!(n.take(p).keys.is_empty());
    }
}

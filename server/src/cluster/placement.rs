//! A shard's placement: the partitions it owns and the map version at which
//! that set last changed. It is part of the shard's replicated state
//! (changed only by log entries, carried in snapshots, the same on every
//! replica), so the shard itself, not any node's map, decides what it
//! serves: a write to a partition it does not own is refused where it
//! applies, on every replica alike, and its leader publishes the version in
//! the lease block for one-sided readers (docs/elasticity.md).

use std::sync::atomic::{AtomicU64, Ordering};

use dmkv_common::cluster::map::{ClusterMap, PARTITIONS, ShardId, partition_of};
use dmkv_common::proto;

/// Words of the partition bit set.
const WORDS: usize = PARTITIONS as usize / 64;
const _: () = assert!(PARTITIONS.is_multiple_of(64));
/// Bytes of a placement in a snapshot: its version and the bit set.
pub const ENCODED_LEN: usize = 8 + WORDS * 8;

/// The partitions a shard owns, as of its applied log index.
#[derive(Clone, PartialEq, Eq)]
pub struct Placement {
    version: u64,
    owned: [u64; WORDS],
}

impl std::fmt::Debug for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Placement").field("version", &self.version).field("partitions", &self.count()).finish()
    }
}

/// Why a placement change entry was not applied (every replica alike).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadChange {
    /// It names a partition past [`PARTITIONS`].
    Partition(u32),
    /// It both takes and gives up one partition.
    Both(u32),
}

impl std::fmt::Display for BadChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadChange::Partition(p) => write!(f, "partition {p} is not below {PARTITIONS}"),
            BadChange::Both(p) => write!(f, "partition {p} is both taken and given up"),
        }
    }
}

impl Placement {
    /// What `shard` owns in `map` (a cluster's first map, for a replica
    /// whose log starts at the beginning).
    pub fn of_map(map: &ClusterMap, shard: ShardId) -> Placement {
        let mut owned = [0u64; WORDS];
        for p in map.partitions_of(shard) {
            owned[p as usize / 64] |= 1 << (p % 64);
        }
        Placement { version: map.version, owned }
    }

    /// Every partition, at version 1: a shard that is the whole key space.
    pub fn all() -> Placement {
        Placement { version: 1, owned: [u64::MAX; WORDS] }
    }

    /// The map version of the last change.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Whether partition `p` is owned.
    pub fn owns(&self, p: u32) -> bool {
        p < PARTITIONS && self.owned[p as usize / 64] & (1 << (p % 64)) != 0
    }

    /// Whether `key`'s partition is owned.
    pub fn owns_key(&self, key: &[u8]) -> bool {
        self.owns(partition_of(key))
    }

    /// Partitions owned.
    pub fn count(&self) -> u32 {
        self.owned.iter().map(|w| w.count_ones()).sum()
    }

    /// Applies a change decided for map version `c.version`: only if that
    /// is newer than this placement's (a change proposed twice, by a mover
    /// that took over, applies once). Returns whether anything changed. A
    /// change naming a partition that does not exist, or one both taken
    /// and given up, changes nothing.
    pub fn apply(&mut self, c: &proto::PlacementChange) -> Result<bool, BadChange> {
        for &p in c.own.iter().chain(&c.release) {
            if p >= PARTITIONS {
                return Err(BadChange::Partition(p));
            }
        }
        if let Some(&p) = c.own.iter().find(|p| c.release.contains(p)) {
            return Err(BadChange::Both(p));
        }
        if c.version <= self.version {
            return Ok(false);
        }
        for &p in &c.own {
            self.owned[p as usize / 64] |= 1 << (p % 64);
        }
        for &p in &c.release {
            self.owned[p as usize / 64] &= !(1 << (p % 64));
        }
        self.version = c.version;
        Ok(true)
    }

    /// The placement's bytes in a snapshot.
    pub fn encode(&self) -> [u8; ENCODED_LEN] {
        let mut b = [0u8; ENCODED_LEN];
        b[..8].copy_from_slice(&self.version.to_le_bytes());
        for (i, w) in self.owned.iter().enumerate() {
            b[8 + i * 8..16 + i * 8].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// A placement from a snapshot's bytes (`None`: not [`ENCODED_LEN`]).
    pub fn decode(b: &[u8]) -> Option<Placement> {
        if b.len() != ENCODED_LEN {
            return None;
        }
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let mut owned = [0u64; WORDS];
        for (i, w) in owned.iter_mut().enumerate() {
            *w = word(8 + i * 8);
        }
        Some(Placement { version: word(0), owned })
    }
}

/// A shard replica's placement as the node's request handlers read it:
/// written by the shard's thread as each change applies (before any
/// proposal's answer is sent, so an answer implies it), read without locks.
#[derive(Debug)]
pub struct SharedPlacement {
    version: AtomicU64,
    owned: [AtomicU64; WORDS],
}

impl SharedPlacement {
    pub fn new(p: &Placement) -> SharedPlacement {
        let s = SharedPlacement { version: AtomicU64::new(0), owned: std::array::from_fn(|_| AtomicU64::new(0)) };
        s.set(p);
        s
    }

    /// Takes the replica's placement as it is now.
    pub fn set(&self, p: &Placement) {
        for (w, &v) in self.owned.iter().zip(&p.owned) {
            w.store(v, Ordering::Release);
        }
        self.version.store(p.version, Ordering::Release);
    }

    /// Whether `key`'s partition is owned (as of the last change applied).
    pub fn owns_key(&self, key: &[u8]) -> bool {
        let p = partition_of(key);
        self.owned[p as usize / 64].load(Ordering::Acquire) & (1 << (p % 64)) != 0
    }

    /// The version of the last change applied.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Partitions owned (as of the last change applied).
    pub fn count(&self) -> u32 {
        self.owned.iter().map(|w| w.load(Ordering::Relaxed).count_ones()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn map() -> ClusterMap {
        let nodes: BTreeMap<u64, String> = (1..=3).map(|i| (i, format!("127.0.0.1:{}", 7070 + i))).collect();
        ClusterMap::initial(nodes, 4, 3).unwrap()
    }

    fn change(version: u64, own: &[u32], release: &[u32]) -> proto::PlacementChange {
        proto::PlacementChange { version, own: own.to_vec(), release: release.to_vec() }
    }

    #[test]
    fn a_first_placement_is_what_the_map_gives_the_shard() {
        let m = map();
        let all: Vec<Placement> = (0..4).map(|s| Placement::of_map(&m, s)).collect();
        for p in 0..PARTITIONS {
            assert_eq!((0..4).filter(|&s| all[s].owns(p)).count(), 1, "partition {p} has one owner");
        }
        for k in 0..1000 {
            let key = format!("k{k}");
            let s = m.shard_of(key.as_bytes()).id as usize;
            assert!(all[s].owns_key(key.as_bytes()));
        }
        assert_eq!(all.iter().map(Placement::count).sum::<u32>(), PARTITIONS);
        assert_eq!(all[0].version(), m.version);
        assert!(!all[0].owns(PARTITIONS), "no partition past the last");
    }

    #[test]
    fn changes_apply_once_in_version_order_and_bad_ones_change_nothing() {
        let mut p = Placement::of_map(&map(), 0);
        let before = p.clone();
        let owned = (0..PARTITIONS).find(|&q| p.owns(q)).unwrap();
        let other = (0..PARTITIONS).find(|&q| !p.owns(q)).unwrap();
        assert_eq!(p.apply(&change(1, &[], &[owned])), Ok(false), "not newer than the map's");
        assert_eq!(p.apply(&change(5, &[PARTITIONS], &[])), Err(BadChange::Partition(PARTITIONS)));
        assert_eq!(p.apply(&change(5, &[other], &[other])), Err(BadChange::Both(other)));
        assert_eq!(p, before);
        assert_eq!(p.apply(&change(5, &[other], &[owned])), Ok(true));
        assert!(p.owns(other) && !p.owns(owned) && p.version() == 5);
        assert_eq!(p.apply(&change(5, &[owned], &[])), Ok(false), "the same version again");
        assert!(!p.owns(owned));
        assert_eq!(Placement::decode(&p.encode()), Some(p.clone()));
        assert_eq!(Placement::decode(&p.encode()[1..]), None);
        let shared = SharedPlacement::new(&before);
        shared.set(&p);
        assert_eq!(shared.version(), 5);
        let key = (0..).map(|i| format!("k{i}")).find(|k| partition_of(k.as_bytes()) == other).unwrap();
        assert!(shared.owns_key(key.as_bytes()));
    }
}

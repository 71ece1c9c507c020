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
/// Bytes of a placement as the first DMKVSNP5 snapshots hold it: its
/// version and the bit set (no version skew, no moves).
pub const ENCODED_LEN_V1: usize = 8 + WORDS * 8;
/// Most moves one shard takes part in at once (as source or target): the
/// mover runs one per node at a time; the rest is slack for records an
/// abandoned move left until they are forgotten.
pub const MAX_MOVES: usize = 8;
/// Bytes of one move record: partition u32, version u64, role u8.
const MOVE_LEN: usize = 13;
/// Bytes of a record's claim, after all records (snapshots from before
/// claims end with the records: their claims are 0).
const CLAIM_LEN: usize = 8;
/// Most bytes a placement takes in a snapshot (see [`Placement::encode`]).
pub const MAX_ENCODED_LEN: usize = ENCODED_LEN_V1 + 8 + 1 + MAX_MOVES * (MOVE_LEN + CLAIM_LEN);
/// Highest version an item may carry into a shard, and highest version
/// skew: far above any log index a shard reaches, far below overflow.
pub const MAX_VERSION: u64 = 1 << 62;

/// A shard's part in a move of a partition (docs/elasticity.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveRole {
    /// The source: its log's writes to the partition are noted.
    Out,
    /// The target: it takes copies of the partition for this move.
    In,
}

/// A move the shard takes part in, as its log recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoveRecord {
    pub partition: u32,
    /// The map version the move flips to.
    pub version: u64,
    pub role: MoveRole,
    /// The highest claim of a mover that recorded this step (claims grow
    /// with each mover that takes the move over, `move_claim.rs`): a step,
    /// copy, note ask or own of a lower claim is a stale mover's, refused.
    pub claim: u64,
}

/// The partitions a shard owns, as of its applied log index, and what a
/// move of partitions adds to that replicated state.
#[derive(Clone, PartialEq, Eq)]
pub struct Placement {
    version: u64,
    owned: [u64; WORDS],
    /// Added to a write's log index to make its version: raised past the
    /// versions a copy from another shard carried in (`Ingest`), so a
    /// key's versions only go up across a move.
    version_skew: u64,
    /// At most [`MAX_MOVES`], one per partition.
    moves: Vec<MoveRecord>,
}

impl std::fmt::Debug for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Placement")
            .field("version", &self.version)
            .field("partitions", &self.count())
            .field("version_skew", &self.version_skew)
            .field("moves", &self.moves)
            .finish()
    }
}

/// Why a move step was not recorded (every replica alike; nothing changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadStep {
    /// A partition past [`PARTITIONS`], or a step of no known kind.
    Malformed,
    /// The step's version is not past the shard's placement version (the
    /// move's flip would not be newer than what the shard applied).
    Stale,
    /// WATCH of a partition the shard does not own, or TAKE of one it owns.
    WrongOwner,
    /// [`MAX_MOVES`] moves are recorded already.
    Full,
}

/// Why a placement change entry was not applied (every replica alike).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadChange {
    /// It names a partition past [`PARTITIONS`].
    Partition(u32),
    /// It both takes and gives up one partition.
    Both(u32),
    /// It owns a partition whose move the shard recorded under a higher
    /// claim than the change's (a mover that was taken over).
    Overtaken(u32),
}

impl std::fmt::Display for BadChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadChange::Partition(p) => write!(f, "partition {p} is not below {PARTITIONS}"),
            BadChange::Both(p) => write!(f, "partition {p} is both taken and given up"),
            BadChange::Overtaken(p) => write!(f, "partition {p}'s move was taken over by a newer mover"),
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
        Placement { version: map.version, owned, version_skew: 0, moves: Vec::new() }
    }

    /// Every partition, at version 1: a shard that is the whole key space.
    pub fn all() -> Placement {
        Placement { version: 1, owned: [u64::MAX; WORDS], version_skew: 0, moves: Vec::new() }
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

    /// What a write's log index is raised by to make its version.
    pub fn version_skew(&self) -> u64 {
        self.version_skew
    }

    /// A copy applied at log index `index` carried versions below `above`:
    /// every later write's version (a later index plus the skew) is at
    /// least `above`. `above` is at most [`MAX_VERSION`] (the caller
    /// checks), so the skew stays below it too.
    pub fn raise_version_skew(&mut self, index: u64, above: u64) {
        debug_assert!(above <= MAX_VERSION, "a copy's versions pass the bound");
        self.version_skew = self.version_skew.max(above.saturating_sub(index));
    }

    /// The moves the shard takes part in.
    pub fn moves(&self) -> &[MoveRecord] {
        &self.moves
    }

    /// The move of `partition` this shard records, if any.
    pub fn move_of(&self, partition: u32) -> Option<MoveRecord> {
        self.moves.iter().copied().find(|m| m.partition == partition)
    }

    /// Whether writes to `partition` are noted for a move out of the shard.
    pub fn watched(&self, partition: u32) -> bool {
        self.move_of(partition).is_some_and(|m| m.role == MoveRole::Out)
    }

    /// Whether a copy of `partition` for the move at `version`, sent by a
    /// mover of `claim`, is taken: the shard records that move under no
    /// higher claim and does not own the partition (the target before it
    /// owns it; the source after its release, whose copy goes by the same
    /// entries).
    pub fn takes(&self, partition: u32, version: u64, claim: u64) -> bool {
        !self.owns(partition) && self.move_of(partition).is_some_and(|m| m.version == version && m.claim <= claim)
    }

    /// Whether a mover of `claim` was overtaken on `partition`'s move: the
    /// shard recorded it under a higher claim.
    pub fn overtaken(&self, partition: u32, claim: u64) -> bool {
        self.move_of(partition).is_some_and(|m| m.claim > claim)
    }

    /// Records a step of a move; returns whether anything changed (the
    /// same step again changes nothing). A move's record replaces an older
    /// one of the same partition (an abandoned move's); the same step of a
    /// higher claim raises the record's, one of a lower claim is
    /// [`BadStep::Stale`].
    pub fn apply_step(&mut self, step: &proto::MoveStep) -> Result<bool, BadStep> {
        use proto::move_step::Kind;
        let (p, v) = (step.partition, step.version);
        if p >= PARTITIONS {
            return Err(BadStep::Malformed);
        }
        let role = match Kind::try_from(step.kind) {
            Ok(Kind::Watch) => MoveRole::Out,
            Ok(Kind::Take) => MoveRole::In,
            Ok(Kind::Forget) => {
                let before = self.moves.len();
                self.moves.retain(|m| !(m.partition == p && m.version == v));
                return Ok(self.moves.len() != before);
            }
            _ => return Err(BadStep::Malformed),
        };
        // The step recorded already (by this mover, or one it took over):
        // whatever the placement since (a source that released the
        // partition keeps its record), only the claim may change.
        if let Some(m) = self.moves.iter_mut().find(|m| m.partition == p && m.version == v && m.role == role) {
            return match step.claim.cmp(&m.claim) {
                std::cmp::Ordering::Less => Err(BadStep::Stale),
                std::cmp::Ordering::Equal => Ok(false),
                std::cmp::Ordering::Greater => {
                    m.claim = step.claim;
                    Ok(true)
                }
            };
        }
        if v <= self.version {
            return Err(BadStep::Stale);
        }
        if self.owns(p) != (role == MoveRole::Out) {
            return Err(BadStep::WrongOwner);
        }
        let record = MoveRecord { partition: p, version: v, role, claim: step.claim };
        match self.moves.iter().position(|m| m.partition == p) {
            Some(i) if self.moves[i].version < v => {
                self.moves[i] = record;
                Ok(true)
            }
            Some(_) => Err(BadStep::Stale),
            None if self.moves.len() >= MAX_MOVES => Err(BadStep::Full),
            None => {
                self.moves.push(record);
                Ok(true)
            }
        }
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
        // A stale mover's own: the move was taken over here, and the
        // target may lack what the newer mover is copying.
        if let Some(&p) = c.own.iter().find(|&&p| self.overtaken(p, c.claim)) {
            return Err(BadChange::Overtaken(p));
        }
        for &p in &c.own {
            self.owned[p as usize / 64] |= 1 << (p % 64);
        }
        for &p in &c.release {
            self.owned[p as usize / 64] &= !(1 << (p % 64));
        }
        self.version = c.version;
        // The change's mover (or undoer) holds the move now: a mover it
        // took over sends no copy and takes no note from here on.
        for m in self.moves.iter_mut().filter(|m| m.version == c.version) {
            m.claim = m.claim.max(c.claim);
        }
        // A target that owns the partition now takes no more copies: its
        // own writes are newer than any copy.
        self.moves.retain(|m| !(m.role == MoveRole::In && c.own.contains(&m.partition)));
        Ok(true)
    }

    /// The placement's bytes in a snapshot: version u64, the bit set's
    /// words, version skew u64, count u8, then per move partition u32,
    /// version u64, role u8 (0 out, 1 in), then per move its claim u64. At
    /// most [`MAX_ENCODED_LEN`].
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(MAX_ENCODED_LEN);
        b.extend_from_slice(&self.version.to_le_bytes());
        for w in &self.owned {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b.extend_from_slice(&self.version_skew.to_le_bytes());
        debug_assert!(self.moves.len() <= MAX_MOVES);
        b.push(self.moves.len() as u8);
        for m in &self.moves {
            b.extend_from_slice(&m.partition.to_le_bytes());
            b.extend_from_slice(&m.version.to_le_bytes());
            b.push(u8::from(m.role == MoveRole::In));
        }
        for m in &self.moves {
            b.extend_from_slice(&m.claim.to_le_bytes());
        }
        b
    }

    /// A placement from a snapshot's bytes: [`Placement::encode`]'s form,
    /// or (`v1`) the first DMKVSNP5 form of [`ENCODED_LEN_V1`] bytes.
    /// `None` for anything else, a skew past [`MAX_VERSION`] or a move
    /// record that could not have been made.
    pub fn decode(b: &[u8], v1: bool) -> Option<Placement> {
        let word = |i: usize| b.get(i..i + 8).map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")));
        let mut owned = [0u64; WORDS];
        for (i, w) in owned.iter_mut().enumerate() {
            *w = word(8 + i * 8)?;
        }
        let mut p = Placement { version: word(0)?, owned, version_skew: 0, moves: Vec::new() };
        if v1 {
            return (b.len() == ENCODED_LEN_V1).then_some(p);
        }
        p.version_skew = word(ENCODED_LEN_V1).filter(|&s| s <= MAX_VERSION)?;
        let count = *b.get(ENCODED_LEN_V1 + 8)? as usize;
        let rest = &b[ENCODED_LEN_V1 + 9..];
        if count > MAX_MOVES {
            return None;
        }
        // Records, then (since claims) their claims.
        let (records, claims) = match rest.len() {
            n if n == count * MOVE_LEN => (rest, &[][..]),
            n if n == count * (MOVE_LEN + CLAIM_LEN) => rest.split_at(count * MOVE_LEN),
            _ => return None,
        };
        for (i, r) in records.chunks_exact(MOVE_LEN).enumerate() {
            let partition = u32::from_le_bytes(r[..4].try_into().expect("4 bytes"));
            let version = u64::from_le_bytes(r[4..12].try_into().expect("8 bytes"));
            let role = match r[12] {
                0 => MoveRole::Out,
                1 => MoveRole::In,
                _ => return None,
            };
            // A source's record outlives its release at the move's version
            // (until the move is forgotten): no order with the placement's
            // version is checked here.
            let fresh = !p.moves.iter().any(|m| m.partition == partition);
            if partition >= PARTITIONS || !fresh {
                return None;
            }
            let claim = claims
                .get(i * CLAIM_LEN..(i + 1) * CLAIM_LEN)
                .map_or(0, |c| u64::from_le_bytes(c.try_into().expect("8 bytes")));
            p.moves.push(MoveRecord { partition, version, role, claim });
        }
        Some(p)
    }
}

/// A shard replica's placement as the node's request handlers read it:
/// written by the shard's thread as each change applies (before any
/// proposal's answer is sent, so an answer implies it), read without locks.
#[derive(Debug)]
pub struct SharedPlacement {
    version: AtomicU64,
    owned: [AtomicU64; WORDS],
    /// Told of each new version (the node's map refresh).
    wake: Option<std::sync::Arc<tokio::sync::Notify>>,
}

impl SharedPlacement {
    pub fn new(p: &Placement) -> SharedPlacement {
        let s = SharedPlacement {
            version: AtomicU64::new(0),
            owned: std::array::from_fn(|_| AtomicU64::new(0)),
            wake: None,
        };
        s.set(p);
        s
    }

    /// Tells `wake` of every new version from now on.
    pub fn with_wake(mut self, wake: std::sync::Arc<tokio::sync::Notify>) -> SharedPlacement {
        self.wake = Some(wake);
        self
    }

    /// Takes the replica's placement as it is now.
    pub fn set(&self, p: &Placement) {
        for (w, &v) in self.owned.iter().zip(&p.owned) {
            w.store(v, Ordering::Release);
        }
        let before = self.version.swap(p.version, Ordering::AcqRel);
        if before != p.version
            && let Some(w) = &self.wake
        {
            w.notify_one();
        }
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
        proto::PlacementChange { version, own: own.to_vec(), release: release.to_vec(), claim: 0 }
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
        assert_eq!(Placement::decode(&p.encode(), false), Some(p.clone()));
        assert_eq!(Placement::decode(&p.encode()[1..], false), None);
        let v1 = Placement::decode(&p.encode()[..ENCODED_LEN_V1], true).expect("the first DMKVSNP5 form");
        assert_eq!((v1.version(), v1.version_skew(), v1.moves().len()), (5, 0, 0));
        assert_eq!(Placement::decode(&p.encode()[..ENCODED_LEN_V1], false), None);
        let shared = SharedPlacement::new(&before);
        shared.set(&p);
        assert_eq!(shared.version(), 5);
        let key = (0..).map(|i| format!("k{i}")).find(|k| partition_of(k.as_bytes()) == other).unwrap();
        assert!(shared.owns_key(key.as_bytes()));
    }

    fn step(partition: u32, version: u64, kind: proto::move_step::Kind) -> proto::MoveStep {
        claimed(partition, version, kind, 0)
    }

    fn claimed(partition: u32, version: u64, kind: proto::move_step::Kind, claim: u64) -> proto::MoveStep {
        proto::MoveStep { partition, version, kind: kind as i32, claim }
    }

    /// A source watches only what it owns, a target takes only what it
    /// does not, for a move newer than its placement; a newer move replaces
    /// an abandoned one's record; owning the partition ends the taking;
    /// records and skew survive a snapshot, and a damaged one is refused.
    #[test]
    fn move_records_follow_the_rules_and_survive_a_snapshot() {
        use proto::move_step::Kind::{Forget, Take, Watch};
        let mut p = Placement::of_map(&map(), 0);
        let v = p.version();
        let owned = (0..PARTITIONS).find(|&q| p.owns(q)).unwrap();
        let other = (0..PARTITIONS).find(|&q| !p.owns(q)).unwrap();
        assert_eq!(p.apply_step(&step(owned, v + 2, Take)), Err(BadStep::WrongOwner));
        assert_eq!(p.apply_step(&step(other, v + 2, Watch)), Err(BadStep::WrongOwner));
        assert_eq!(p.apply_step(&step(other, v, Take)), Err(BadStep::Stale));
        assert_eq!(p.apply_step(&step(PARTITIONS, v + 2, Take)), Err(BadStep::Malformed));
        assert_eq!(
            p.apply_step(&proto::MoveStep { partition: other, version: v + 2, kind: 0, claim: 0 }),
            Err(BadStep::Malformed)
        );
        assert_eq!(p.apply_step(&step(owned, v + 2, Watch)), Ok(true));
        assert_eq!(p.apply_step(&step(owned, v + 2, Watch)), Ok(false), "the same step again");
        assert!(p.watched(owned) && !p.watched(other));
        assert_eq!(p.apply_step(&step(other, v + 2, Take)), Ok(true));
        assert!(p.takes(other, v + 2, 0) && !p.takes(other, v + 3, 0) && !p.takes(owned, v + 2, 0));
        assert_eq!(p.apply_step(&step(other, v + 4, Take)), Ok(true), "a newer move replaces the record");
        assert_eq!(p.apply_step(&step(other, v + 2, Take)), Err(BadStep::Stale), "an older move's step comes late");
        assert!(p.takes(other, v + 4, 0) && !p.takes(other, v + 2, 0));
        p.raise_version_skew(10, 1000);
        p.raise_version_skew(500, 900);
        assert_eq!(p.version_skew(), 990, "raised only");
        let back = Placement::decode(&p.encode(), false).expect("decodes");
        assert_eq!(back, p);
        let mut damaged = p.encode();
        let role = ENCODED_LEN_V1 + 9 + (p.moves().len() - 1) * MOVE_LEN + 12;
        damaged[role] = 7;
        assert_eq!(Placement::decode(&damaged, false), None, "a role that does not exist");
        let mut skewed = p.encode();
        skewed[ENCODED_LEN_V1..ENCODED_LEN_V1 + 8].copy_from_slice(&(MAX_VERSION + 1).to_le_bytes());
        assert_eq!(Placement::decode(&skewed, false), None, "a skew past the bound");
        // Owning the partition ends the taking; the source's watch stays
        // until forgotten, and a snapshot holds it meanwhile.
        assert_eq!(p.apply(&change(v + 4, &[other], &[owned])), Ok(true));
        assert!(!p.takes(other, v + 4, 0) && p.move_of(other).is_none());
        let mut released = p.clone();
        assert_eq!(released.apply(&change(v + 5, &[], &[owned])), Ok(true));
        assert!(released.watched(owned) && released.version() >= v + 2);
        assert_eq!(Placement::decode(&released.encode(), false), Some(released.clone()), "between release and forget");
        assert_eq!(p.apply_step(&step(owned, v + 2, Forget)), Ok(true));
        assert_eq!(p.apply_step(&step(owned, v + 2, Forget)), Ok(false));
        assert!(p.moves().is_empty());
        let mut full = Placement::of_map(&map(), 0);
        let free: Vec<u32> = (0..PARTITIONS).filter(|&q| !full.owns(q)).take(MAX_MOVES + 1).collect();
        for &q in &free[..MAX_MOVES] {
            assert_eq!(full.apply_step(&step(q, v + 1, Take)), Ok(true));
        }
        assert_eq!(full.apply_step(&step(free[MAX_MOVES], v + 1, Take)), Err(BadStep::Full));
        assert_eq!(Placement::decode(&full.encode(), false).map(|f| f.moves().len()), Some(MAX_MOVES));
        assert!(full.encode().len() <= MAX_ENCODED_LEN);
    }

    /// A mover that takes a move over raises its record's claim; the
    /// stale mover's steps, copies (by `takes`) and own are refused from
    /// then on; claims survive a snapshot, and a snapshot from before
    /// claims decodes with claims of 0.
    #[test]
    fn a_newer_claim_fences_the_mover_it_took_over() {
        use proto::move_step::Kind::{Take, Watch};
        let mut p = Placement::of_map(&map(), 0);
        let v = p.version() + 2;
        let owned = (0..PARTITIONS).find(|&q| p.owns(q)).unwrap();
        let other = (0..PARTITIONS).find(|&q| !p.owns(q)).unwrap();
        assert_eq!(p.apply_step(&claimed(other, v, Take, 5)), Ok(true));
        assert_eq!(p.apply_step(&claimed(owned, v, Watch, 5)), Ok(true));
        assert!(p.takes(other, v, 5) && !p.takes(other, v, 4));
        // Taken over by the mover of claim 9.
        assert_eq!(p.apply_step(&claimed(other, v, Take, 9)), Ok(true));
        assert_eq!(p.apply_step(&claimed(other, v, Take, 9)), Ok(false), "the same step again");
        assert_eq!(p.apply_step(&claimed(other, v, Take, 5)), Err(BadStep::Stale), "the stale mover's step");
        assert!(!p.takes(other, v, 5) && p.takes(other, v, 9));
        assert!(p.overtaken(other, 5) && !p.overtaken(other, 9) && !p.overtaken(owned, 5));
        let stale = proto::PlacementChange { version: v, own: vec![other], release: vec![], claim: 5 };
        let before = p.clone();
        assert_eq!(p.apply(&stale), Err(BadChange::Overtaken(other)));
        assert_eq!(p, before, "a refused own changes nothing");
        let back = Placement::decode(&p.encode(), false).expect("decodes");
        assert_eq!(back, p);
        assert_eq!(back.move_of(other).map(|m| m.claim), Some(9));
        // Before claims: the records end the bytes.
        let old = p.encode();
        let old = &old[..old.len() - p.moves().len() * CLAIM_LEN];
        let back = Placement::decode(old, false).expect("a snapshot from before claims");
        assert!(back.moves().iter().all(|m| m.claim == 0) && back.moves().len() == 2);
        assert_eq!(Placement::decode(&p.encode()[..old.len() + 3], false), None, "claims cut short");
        // A source that released the partition takes the newer mover's
        // watch (the resumed move's), and refuses the stale one's.
        let release = proto::PlacementChange { version: v, own: vec![], release: vec![owned], claim: 5 };
        let mut released = p.clone();
        assert_eq!(released.apply(&release), Ok(true));
        assert_eq!(released.apply_step(&claimed(owned, v, Watch, 9)), Ok(true));
        assert_eq!(released.apply_step(&claimed(owned, v, Watch, 7)), Err(BadStep::Stale));
        assert!(released.overtaken(owned, 7) && !released.overtaken(owned, 9));
        // An undo's burn (no partition changes) raises the claim too: the
        // stopped mover's copies and note asks are refused after it.
        let mut burnt = p.clone();
        let burn = proto::PlacementChange { version: v, own: vec![], release: vec![], claim: 11 };
        assert_eq!(burnt.apply(&burn), Ok(true));
        assert!(!burnt.takes(other, v, 9) && burnt.takes(other, v, 11) && burnt.overtaken(owned, 9));
        let own = proto::PlacementChange { version: v, own: vec![other], release: vec![], claim: 9 };
        assert_eq!(p.apply(&own), Ok(true));
        assert!(p.owns(other));
    }
}

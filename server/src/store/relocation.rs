//! What the compactor moves and what became of a move.

use dmkv_common::layout::Slot;

/// A live item the compactor means to move: where its slot is in the index,
/// and the slot word it had when it was listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub(super) seg: u32,
    pub(super) pos: usize,
    pub(super) word: u64,
}

impl Candidate {
    /// Units of the item.
    pub fn units(&self) -> u64 {
        Slot::unpack(self.word).map_or(0, |s| u64::from(s.units))
    }
}

/// What became of one move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relocation {
    /// Moved.
    Moved,
    /// The key was overwritten or deleted since it was listed (or its item
    /// no longer verified and was unlinked): nothing to move.
    Gone,
    /// Evicted where it was ([`super::Store::evict_listed`]).
    Evicted,
}

//! What a partition move asks of a shard's leader, and its answers: the
//! shard thread passes them between the mover and `ShardCore::moving`.

/// What a partition move asks of a shard's leader.
#[derive(Debug, Clone, Copy)]
pub enum MoveAsk {
    /// The keys of this partition its log wrote since the last ask, for
    /// the mover of this claim (refused if the move was taken over).
    Notes(u32, u64),
    /// A consistent view of its store.
    View,
    /// The outcomes it remembers of writes to keys of this partition.
    Remembered(u32),
}

/// The leader's answer, with its `horizon`: the version its next write
/// gets (every version it gave is below) as of the answer.
pub enum MoveAnswer {
    Notes { notes: super::noted::Notes, horizon: u64 },
    View { view: crate::store::view::StoreView, horizon: u64 },
    Remembered(Vec<super::apply::RememberedWrite>),
}

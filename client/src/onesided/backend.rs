//! What a one-sided backend (shared memory, the engine, RDMA) answers: the
//! bytes of a batch of reads, or why it could not serve them.

use std::ops::Range;

use thiserror::Error;

/// Why a backend could not serve a batch. Every variant means the path is
/// unusable until attached again; nothing read is returned.
#[derive(Debug, Clone, Error)]
pub enum BackendError {
    #[error("cannot attach: {0}")]
    Attach(String),
    #[error("one-sided connection closed")]
    Closed,
    #[error("region registration is stale (new epoch or rkey)")]
    Stale,
    #[error("one-sided read timed out")]
    Timeout,
    #[error("one-sided protocol error: {0}")]
    Protocol(String),
    /// The exception: a cluster shard's region held no lease that covered
    /// the reads (a follower's, a deposed leader's, or a lease being
    /// renewed late). Nothing read is returned; ask the leader over RPC.
    /// The path stays attached.
    #[error("the region holds no lease covering the reads")]
    Unleased,
}

/// The results of one batch of reads: the bytes of each read, in order, or
/// `None` for a read the backend refused (out of bounds).
#[derive(Debug, Default)]
pub struct Reads {
    pub(super) data: Vec<u8>,
    pub(super) ranges: Vec<Option<Range<usize>>>,
    /// The server's monotonic clock before the batch's first read and
    /// after its last, where the backend stamps batches (the engine).
    pub(super) stamps: Option<(u64, u64)>,
}

impl Reads {
    pub(super) fn clear(&mut self) {
        self.data.clear();
        self.ranges.clear();
        self.stamps = None;
    }

    /// Appends room for a read of `len` bytes and returns it.
    pub(super) fn push_slot(&mut self, len: usize) -> &mut [u8] {
        let start = self.data.len();
        self.data.resize(start + len, 0);
        self.ranges.push(Some(start..start + len));
        &mut self.data[start..]
    }

    pub(super) fn push_failed(&mut self) {
        self.ranges.push(None);
    }

    /// The bytes of read `i`; `None` if it failed.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        self.ranges.get(i)?.clone().map(|r| &self.data[r])
    }
}

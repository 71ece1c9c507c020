//! A batch of READs: what the caller asks for, what it gets back, and the bookkeeping of a
//! posted batch until its completion arrives.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::error::VerbsError;
use crate::limits::MAX_READS_PER_BATCH;
use crate::local_buffer::LocalInner;

/// Low bits of the NIC-level wr_id that hold a read's index in its batch (above: batch number).
pub(crate) const BATCH_INDEX_BITS: u32 = 16;
const _: () = assert!(MAX_READS_PER_BATCH <= 1 << BATCH_INDEX_BITS);

/// One RDMA READ: `len` bytes at `remote_addr` (covered by `rkey`) into the local buffer at
/// `local_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    /// Caller's id, reported back in [`Completion::wr_id`].
    pub wr_id: u64,
    /// Remote virtual address.
    pub remote_addr: u64,
    /// Remote key of the region that contains the range.
    pub rkey: u32,
    /// Bytes to read (1..=[`MAX_READ_LEN`](crate::MAX_READ_LEN)).
    pub len: u32,
    /// Where the bytes land in the [`LocalBuffer`](crate::LocalBuffer).
    pub local_offset: usize,
}

/// The outcome of one read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The read's [`ReadRequest::wr_id`].
    pub wr_id: u64,
    /// `Ok` when the bytes are in the local buffer.
    pub result: Result<(), VerbsError>,
}

/// A posted batch; the NIC reports it with one completion tagged `seq`.
pub(crate) struct InFlight {
    pub(crate) seq: u64,
    pub(crate) wr_ids: Vec<u64>,
    pub(crate) local: Arc<LocalInner>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Runs once the batch completed or its QP was destroyed: either way the NIC is done.
        self.local.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A finished batch waiting to be handed out by `poll`.
pub(crate) struct Finished {
    pub(crate) seq: u64,
    pub(crate) wr_ids: Vec<u64>,
    /// Index (in the batch) of the first failed read, its status and status text.
    pub(crate) error: Option<(usize, u32, String)>,
}

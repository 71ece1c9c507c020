//! Public tuning constants: batch, queue and read limits and the RC transport parameters.
//! Kept apart from the types that use them so every module can import them without depending
//! on the queue pair.

/// Most READs one [`QueuePair::post_reads`](crate::QueuePair::post_reads) call accepts (one doorbell
/// for the whole batch).
pub const MAX_READS_PER_BATCH: usize = 256;
/// Largest send queue (outstanding READ work requests) a [`QueuePair`](crate::QueuePair) may ask for.
pub const MAX_SEND_QUEUE_DEPTH: u32 = 4096;
/// Largest single READ. The verbs limit is 2^31 bytes; dmkv's reads are far smaller, so anything
/// near the limit is a caller bug worth rejecting early.
pub const MAX_READ_LEN: u32 = 1 << 30;
/// Outstanding RDMA READs / atomics per QP on the wire, both as requester (`max_rd_atomic`) and
/// responder (`max_dest_rd_atomic`); lowered to the device's limits. Both peers use the same
/// rule, so with the same device model they agree.
pub const MAX_RD_ATOMIC: u8 = 16;
/// Local ACK timeout exponent: 4.096 µs * 2^14 ≈ 67 ms before a request is retransmitted.
pub const ACK_TIMEOUT: u8 = 14;
/// Transport retries before a lost peer turns into `IBV_WC_RETRY_EXC_ERR` (7 is the maximum;
/// 7 * 67 ms ≈ 0.5 s to detect a dead server).
pub const RETRY_COUNT: u8 = 7;
/// RNR retries. Only SENDs can hit receiver-not-ready and dmkv never sends, but 7 would mean
/// "retry forever", so keep it finite.
pub const RNR_RETRY: u8 = 3;
/// Minimal RNR NAK timer advertised by the responder (12 = 0.64 ms), unused by READs.
pub const MIN_RNR_TIMER: u8 = 12;
/// GRH hop limit for RoCE v2 packets (routable; 64 is the usual default).
pub const HOP_LIMIT: u8 = 64;
/// Work completions fetched per `ibv_poll_cq` call.
pub const POLL_BATCH: usize = 16;
/// Alignment of [`LocalBuffer`](crate::LocalBuffer) allocations (a page: the NIC pins whole pages anyway).
pub const LOCAL_BUFFER_ALIGN: usize = 4096;

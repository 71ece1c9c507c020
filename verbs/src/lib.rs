//! `dmkv-verbs`: the small, safe subset of libibverbs that dmkv needs for one-sided RDMA READs.
//!
//! dmkv's server exposes its remote-memory region for RDMA READ; clients fetch index entries and
//! values with batches of READs over reliable-connected (RC) queue pairs. This crate is the only
//! place in dmkv that touches the verbs API, and every `unsafe` block of that path lives here.
//!
//! The building blocks:
//! - [`Context`]: an opened device, the chosen port and GID, and a protection domain.
//! - [`MemoryRegion`]: memory registered for remote reads (the server's region), and
//!   [`LocalBuffer`]: an owned, registered buffer the NIC writes READ results into.
//! - [`QueuePair`]: an RC queue pair with its own completion queue; connect it with the peer's
//!   [`Endpoint`] (exchanged out of band, e.g. over dmkv's TCP control connection), then
//!   [`QueuePair::post_reads`] / [`QueuePair::poll`] or [`QueuePair::read_batch`].
//!
//! The raw bindings come from `ibverbs-sys`: the safe `ibverbs` crate cannot post RDMA READs nor
//! register memory it did not allocate. `ibv_post_send` and `ibv_poll_cq` are `static inline`
//! functions in `<infiniband/verbs.h>` that bindgen does not bind; like them, this crate calls
//! the provider's function pointers in `ibv_context.ops`.
//!
//! - [`MsgQp`], [`Srq`], [`MsgCq`] and [`Slots`]: RC SEND/RECV messages for the verbs RPC.
//!
//! On a machine without RDMA support [`Context::open`] returns [`VerbsError::NoDevice`]; callers
//! fall back to another transport.

mod batch;
mod channel;
mod completions;
mod context;
mod endpoint;
mod error;
mod limits;
mod local_buffer;
mod memory_region;
mod msg;
mod post;
mod queue_pair;
mod slots;

pub use batch::{Completion, ReadRequest};
pub use context::Context;
pub use endpoint::{Endpoint, mtu_bytes};
pub use error::{VerbsError, WC_STATUS_REM_ACCESS_ERR, WC_STATUS_RETRY_EXC_ERR, WC_STATUS_WR_FLUSH_ERR};
pub use limits::{
    ACK_TIMEOUT, HOP_LIMIT, LOCAL_BUFFER_ALIGN, MAX_RD_ATOMIC, MAX_READ_LEN, MAX_READS_PER_BATCH, MAX_SEND_QUEUE_DEPTH,
    MIN_RNR_TIMER, POLL_BATCH, RETRY_COUNT, RNR_RETRY,
};
pub use local_buffer::LocalBuffer;
pub use memory_region::MemoryRegion;
pub use msg::{MSG_RNR_RETRY, MsgCompletion, MsgCq, MsgOp, MsgQp, RecvInto, Srq};
pub use queue_pair::QueuePair;
pub use slots::{MAX_SLOT_BYTES, MAX_SLOTS, Slot, Slots};

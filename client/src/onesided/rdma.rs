//! The RDMA backend (feature `rdma`): the NIC reads the server's region over
//! reliable-connection queue pairs. The verbs calls live in the `dmkv-verbs`
//! crate; this module only maps the read protocol's batches onto them.
//!
//! Two rules keep it from stalling the async runtime or dying with an
//! unrelated connection:
//! - A small pool of lanes (a queue pair, its registered buffer and its
//!   completion channel), one batch in flight on each. A read takes a free
//!   lane, posts, spins for a few polls (a hardware read completes in
//!   microseconds), then sleeps on the completion channel through
//!   [`AsyncFd`]: no worker thread is ever held for longer than the spin.
//! - The server's queue pairs live as long as the connection that set them
//!   up, so that connection is the path's own control connection, not one
//!   of the client's pooled RPC connections (which the path controller
//!   replaces when they are congested). When it closes, the path is stale.

use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dmkv_common::layout::{HEADER_ENCODED_LEN, RegionHeader};
use dmkv_common::limits::{MAX_KEY_LEN, MAX_VALUE_LEN};
use dmkv_common::proto::{self, request::Op, response::Result as R};
use dmkv_common::read::ReadSpec;
use dmkv_verbs::{
    Context, Endpoint, LocalBuffer, MAX_READS_PER_BATCH, MemoryRegion, QueuePair, ReadRequest, VerbsError,
};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Semaphore;
use tokio::time::{Instant, timeout_at};

use super::{BackendError, Reads};
use crate::conn::Conn;
use crate::pool::RpcPool;

/// Queue pairs per path: as many batches in flight at once. At most the
/// server's per-connection limit (`MAX_QPS_PER_CONNECTION`, 4).
pub const LANES: usize = 4;
/// Bytes of the registered buffer of each lane; bigger batches are split.
const LANE_BUF: usize = 2 * 1024 * 1024;
const _: () = assert!(LANE_BUF >= MAX_VALUE_LEN + MAX_KEY_LEN + 64, "one item fits a lane's buffer");
/// Send-queue depth of a lane's queue pair: one batch at a time.
const LANE_DEPTH: u32 = MAX_READS_PER_BATCH as u32;
/// Polls of the completion queue before a read sleeps on the channel.
const SPIN_POLLS: u32 = 64;

/// One queue pair with its buffer; one batch in flight at a time.
struct Lane {
    /// A duplicate of the queue pair's completion-channel descriptor, so
    /// the reactor's registration never outlives the descriptor it watches.
    events: AsyncFd<OwnedFd>,
    qp: QueuePair,
    buf: LocalBuffer,
}

/// Registers a duplicate of `fd` with the runtime's reactor, for reading.
fn watch(fd: RawFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: `fd` is the open completion channel of a live queue pair (the
    // caller holds it); the borrow ends before this function returns.
    let dup = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?;
    // SAFETY: `dup` is an open descriptor owned by the AsyncFd for its whole
    // life, and OwnedFd::as_raw_fd always returns that same descriptor.
    unsafe { AsyncFd::register_with_interest(dup, Interest::READABLE) }.map_err(|e| e.into_parts().1)
}

/// Connected queue pairs to one server's region.
pub struct RdmaPath {
    free: Mutex<Vec<Lane>>,
    permits: Semaphore,
    /// A read was abandoned mid-batch (its lane could not be reused):
    /// later reads fail so the client attaches anew.
    broken: AtomicBool,
    /// Holds the server's queue pairs.
    control: Arc<Conn>,
    addr: u64,
    len: u64,
    rkey: u32,
    timeout: Duration,
    _ctx: Arc<Context>,
}

fn verbs(e: VerbsError) -> BackendError {
    match e {
        VerbsError::Timeout => BackendError::Timeout,
        // A failed completion leaves the queue pair in error: attach anew.
        VerbsError::Completion { .. } | VerbsError::QpFailed => BackendError::Stale,
        e => BackendError::Protocol(e.to_string()),
    }
}

impl RdmaPath {
    /// Opens a local device, connects [`LANES`] queue pairs to the server
    /// over a control connection of their own, and proves the path with one
    /// read of the region header (which must carry `epoch`).
    pub async fn attach(pool: &RpcPool, epoch: u64, timeout: Duration) -> Result<RdmaPath, BackendError> {
        let ctx = Context::open(None).map_err(|e| BackendError::Attach(format!("no usable RDMA device here: {e}")))?;
        let attach = |e: VerbsError| BackendError::Attach(format!("RDMA: {e}"));
        let control =
            pool.dedicated_conn().await.map_err(|e| BackendError::Attach(format!("RDMA control connection: {e}")))?;
        let mut lanes = Vec::with_capacity(LANES);
        let mut region = None;
        for _ in 0..LANES {
            let mut qp = QueuePair::create_with_events(&ctx, LANE_DEPTH).map_err(attach)?;
            let op = Op::RdmaConnect(proto::RdmaConnect { endpoint: qp.endpoint().to_bytes().to_vec().into() });
            let reply = match control.send(op).await {
                Ok(f) => f.wait(timeout).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let reply = match reply.map(crate::error::unwrap) {
                Ok(Ok(R::RdmaConnect(r))) => r,
                Ok(Ok(other)) => return Err(BackendError::Attach(format!("RDMA connect: unexpected reply {other:?}"))),
                Ok(Err(e)) => return Err(BackendError::Attach(format!("RDMA connect: {e}"))),
                Err(e) => return Err(BackendError::Attach(format!("RDMA connect: {e}"))),
            };
            let remote = Endpoint::from_bytes(&reply.endpoint).map_err(attach)?;
            qp.connect(&remote).map_err(attach)?;
            let buf = MemoryRegion::register_local(&ctx, LANE_BUF).map_err(attach)?;
            let fd = qp.event_fd().ok_or_else(|| BackendError::Attach("RDMA: no completion channel".into()))?;
            let events = watch(fd).map_err(|e| BackendError::Attach(format!("RDMA completion channel: {e}")))?;
            let this = (reply.addr, reply.length, reply.rkey, reply.epoch);
            if region.is_some_and(|r| r != this) {
                return Err(BackendError::Stale);
            }
            region = Some(this);
            lanes.push(Lane { events, qp, buf });
        }
        let (addr, len, rkey, reply_epoch) = region.expect("LANES > 0");
        let path = RdmaPath {
            free: Mutex::new(lanes),
            permits: Semaphore::new(LANES),
            broken: AtomicBool::new(false),
            control,
            addr,
            len,
            rkey,
            timeout,
            _ctx: ctx,
        };
        let mut probe = Reads::default();
        path.read(&[ReadSpec { offset: 0, len: HEADER_ENCODED_LEN as u32 }], &mut probe).await?;
        match probe.get(0).map(RegionHeader::decode) {
            Some(Ok(h)) if h.epoch == epoch && reply_epoch == epoch => Ok(path),
            Some(Ok(_)) => Err(BackendError::Stale),
            _ => Err(BackendError::Attach("RDMA probe read did not return the region header".into())),
        }
    }

    /// Reads every spec in order; a spec outside the region yields `None`.
    pub async fn read(&self, specs: &[ReadSpec], out: &mut Reads) -> Result<(), BackendError> {
        if self.control.is_closed() {
            return Err(BackendError::Closed);
        }
        if self.broken.load(Ordering::Acquire) {
            return Err(BackendError::Stale);
        }
        let deadline = Instant::now() + self.timeout;
        let permit = match timeout_at(deadline, self.permits.acquire()).await {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => return Err(BackendError::Closed),
            Err(_) => return Err(BackendError::Timeout),
        };
        // A permit stands for a free lane: destroyed lanes take theirs along.
        let Some(lane) = self.free.lock().expect("rdma lanes poisoned").pop() else {
            return Err(BackendError::Stale);
        };
        let mut held = Held { path: self, lane: Some(lane), permit: Some(permit) };
        let Some(lane) = held.lane.as_mut() else { return Err(BackendError::Stale) };
        out.clear();
        let mut chunk: Vec<ReadRequest> = Vec::new();
        let mut used = 0usize;
        for s in specs {
            let len = s.len as usize;
            let inside = s.offset.checked_add(s.len as u64).is_some_and(|end| end <= self.len);
            if !inside || len > LANE_BUF {
                lane.flush(&mut chunk, deadline, out).await?;
                used = 0;
                out.push_failed();
                continue;
            }
            if chunk.len() == MAX_READS_PER_BATCH || used + len > LANE_BUF {
                lane.flush(&mut chunk, deadline, out).await?;
                used = 0;
            }
            chunk.push(ReadRequest {
                wr_id: chunk.len() as u64,
                remote_addr: self.addr + s.offset,
                rkey: self.rkey,
                len: s.len,
                local_offset: used,
            });
            used += len;
        }
        lane.flush(&mut chunk, deadline, out).await?;
        held.give_back();
        Ok(())
    }
}

/// A lane taken from the pool with its permit. Returned by
/// [`Held::give_back`] after a clean batch; a lane dropped with a batch that
/// failed, timed out or was cancelled may still be written by the NIC, so it
/// is destroyed instead, its permit forgotten (permits stay equal to free
/// lanes) and the path marked broken.
struct Held<'p> {
    path: &'p RdmaPath,
    lane: Option<Lane>,
    permit: Option<tokio::sync::SemaphorePermit<'p>>,
}

impl Held<'_> {
    fn give_back(mut self) {
        if let Some(lane) = self.lane.take() {
            self.path.free.lock().expect("rdma lanes poisoned").push(lane);
        }
        // The permit is released when `self` drops, after the lane is back.
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if self.lane.take().is_some() {
            self.path.broken.store(true, Ordering::Release);
            if let Some(p) = self.permit.take() {
                p.forget();
            }
        }
    }
}

impl Lane {
    /// Posts `chunk` as one batch (one doorbell), waits for it without
    /// blocking the thread, and copies the results out in order.
    async fn flush(
        &mut self,
        chunk: &mut Vec<ReadRequest>,
        deadline: Instant,
        out: &mut Reads,
    ) -> Result<(), BackendError> {
        if chunk.is_empty() {
            return Ok(());
        }
        let seq = self.qp.post_reads(chunk, &mut self.buf).map_err(verbs)?;
        self.wait(seq, deadline).await?;
        for r in chunk.iter() {
            let data = self.buf.slice(r.local_offset, r.len as usize).map_err(verbs)?;
            out.push_slot(data.len()).copy_from_slice(data);
        }
        chunk.clear();
        Ok(())
    }

    /// Spins for [`SPIN_POLLS`] polls, then sleeps on the completion
    /// channel until batch `seq` is done or `deadline` passes.
    async fn wait(&mut self, seq: u64, deadline: Instant) -> Result<(), BackendError> {
        for _ in 0..SPIN_POLLS {
            if let Some(done) = self.qp.try_finish(seq).map_err(verbs)? {
                return done.map_err(verbs);
            }
            std::hint::spin_loop();
        }
        loop {
            self.qp.arm_events().map_err(verbs)?;
            // A completion that landed before arming raises no event.
            if let Some(done) = self.qp.try_finish(seq).map_err(verbs)? {
                return done.map_err(verbs);
            }
            let mut ready = match timeout_at(deadline, self.events.readable()).await {
                Ok(r) => r.map_err(|e| BackendError::Protocol(format!("RDMA completion channel: {e}")))?,
                Err(_) => return Err(BackendError::Timeout),
            };
            self.qp.take_events().map_err(verbs)?;
            ready.clear_ready();
            if let Some(done) = self.qp.try_finish(seq).map_err(verbs)? {
                return done.map_err(verbs);
            }
        }
    }
}

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
//!   up, so that connection is the lanes' own control connection, not one
//!   of the client's pooled RPC connections (which the path controller
//!   replaces when they are congested). When it closes, the lanes are stale.
//!
//! The lanes are the node's ([`RdmaLanes`]), the region is the path's
//! ([`RdmaPath`]): a server registers every region it serves with one
//! device, so the same queue pairs read a single node's region or any
//! shard replica's region of a cluster node, each with its own rkey. A
//! cluster session keeps one set of lanes per node ([`NodeLanes`]) for all
//! the shard regions it reads there.

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

use super::post_plan::{Limits, Plan, Step};
use super::{BackendError, Reads};
use crate::conn::Conn;
use crate::pool::RpcPool;

/// Queue pairs per node: as many batches in flight at once. At most the
/// server's per-connection limit (`MAX_QPS_PER_CONNECTION`, 4).
pub const LANES: usize = 4;
/// Bytes of the registered buffer of each lane; bigger batches are split.
const LANE_BUF: usize = 2 * 1024 * 1024;
const _: () = assert!(LANE_BUF >= MAX_VALUE_LEN + MAX_KEY_LEN + 64, "one item fits a lane's buffer");
/// Send-queue depth of a lane's queue pair: one batch at a time.
const LANE_DEPTH: u32 = MAX_READS_PER_BATCH as u32;
/// Timeouts a connect of the lanes may take in all (the control
/// connection, a reply per lane, the probe read).
const CONNECT_STEPS: u32 = LANES as u32 + 2;
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

/// Connected queue pairs to one server node.
pub struct RdmaLanes {
    free: Mutex<Vec<Lane>>,
    permits: Semaphore,
    /// A read was abandoned mid-batch (its lane could not be reused), or
    /// failed in a way that leaves its queue pair in error: later reads
    /// fail so the client attaches anew.
    broken: AtomicBool,
    /// Holds the server's queue pairs.
    control: Arc<Conn>,
    timeout: Duration,
    _ctx: Arc<Context>,
}

/// One region read over a node's lanes.
pub struct RdmaPath {
    lanes: Arc<RdmaLanes>,
    addr: u64,
    len: u64,
    rkey: u32,
    /// A leased region (a cluster shard's): the last read of every batch
    /// (its lease block) is fenced, so it reads the memory after every
    /// other read of the batch did, as the lease argument needs
    /// (docs/replication.md). A single node's region has no lease.
    last_after_rest: bool,
}

/// A cluster session's lanes to its node, shared by its shard regions:
/// connected by the first attach that needs them, connected anew by the
/// first attach after they broke.
#[derive(Default)]
pub struct NodeLanes(tokio::sync::Mutex<Option<Arc<RdmaLanes>>>);

impl NodeLanes {
    /// The node's lanes, connected now if there are none or they broke.
    async fn get(&self, pool: &RpcPool, timeout: Duration) -> Result<Arc<RdmaLanes>, BackendError> {
        let mut slot = self.0.lock().await;
        if let Some(l) = slot.as_ref().filter(|l| l.usable()) {
            return Ok(Arc::clone(l));
        }
        // Each step has its own timeout; the whole is bounded too, since
        // other shards' attaches wait behind this lock.
        let connecting = RdmaLanes::connect(pool, timeout);
        let (lanes, _) = match tokio::time::timeout(timeout.saturating_mul(CONNECT_STEPS), connecting).await {
            Ok(r) => r?,
            Err(_) => return Err(BackendError::Attach("RDMA: connecting the queue pairs timed out".into())),
        };
        let lanes = Arc::new(lanes);
        *slot = Some(Arc::clone(&lanes));
        Ok(lanes)
    }
}

fn verbs(e: VerbsError) -> BackendError {
    match e {
        VerbsError::Timeout => BackendError::Timeout,
        // A failed completion leaves the queue pair in error: attach anew.
        VerbsError::Completion { .. } | VerbsError::QpFailed => BackendError::Stale,
        e => BackendError::Protocol(e.to_string()),
    }
}

/// A region the server names at `addr` for `len` bytes, refused if it
/// wraps the address space: every read's address is then `addr` plus an
/// offset checked against `len`, which cannot overflow.
fn region_bounds(addr: u64, len: u64) -> Result<(), BackendError> {
    match addr.checked_add(len) {
        Some(_) => Ok(()),
        None => Err(BackendError::Attach(format!("RDMA: the server named a region of {len} bytes at {addr:#x}"))),
    }
}

/// The region a single node's RDMA_CONNECT reply names: (address,
/// length, rkey, epoch).
type ConnectRegion = (u64, u64, u32, u64);

impl RdmaLanes {
    /// Opens a local device and connects [`LANES`] queue pairs to the
    /// server over a control connection of their own; also returns the
    /// region the server's replies name (a single node's; zeros from a
    /// cluster node, whose regions are in its region info).
    async fn connect(pool: &RpcPool, timeout: Duration) -> Result<(RdmaLanes, ConnectRegion), BackendError> {
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
        let region = region.expect("LANES > 0");
        let lanes = RdmaLanes {
            free: Mutex::new(lanes),
            permits: Semaphore::new(LANES),
            broken: AtomicBool::new(false),
            control,
            timeout,
            _ctx: ctx,
        };
        Ok((lanes, region))
    }

    /// Whether reads may still go over these lanes.
    fn usable(&self) -> bool {
        !self.control.is_closed() && !self.broken.load(Ordering::Acquire)
    }
}

impl RdmaPath {
    /// Connects lanes to a single node and proves the path with one read
    /// of the region header (which must carry `epoch`).
    pub async fn attach(pool: &RpcPool, epoch: u64, timeout: Duration) -> Result<RdmaPath, BackendError> {
        let (lanes, (addr, len, rkey, reply_epoch)) = RdmaLanes::connect(pool, timeout).await?;
        if reply_epoch != epoch {
            return Err(BackendError::Stale);
        }
        region_bounds(addr, len)?;
        RdmaPath { lanes: Arc::new(lanes), addr, len, rkey, last_after_rest: false }.proved(epoch).await
    }

    /// A path to a cluster node's region described by `desc` (a shard
    /// replica's), over the node's lanes in `node` (connected now if
    /// needed), proved with one read of the region header.
    pub async fn attach_region(
        pool: &RpcPool,
        node: &NodeLanes,
        desc: &proto::RegionDescriptor,
        timeout: Duration,
    ) -> Result<RdmaPath, BackendError> {
        if desc.rdma_rkey == 0 {
            return Err(BackendError::Attach("the server did not register this region for RDMA".into()));
        }
        region_bounds(desc.base_addr, desc.length)?;
        let lanes = node.get(pool, timeout).await?;
        let path = RdmaPath {
            lanes,
            addr: desc.base_addr,
            len: desc.length,
            rkey: desc.rdma_rkey,
            last_after_rest: desc.leased,
        };
        path.proved(desc.epoch).await
    }

    /// `self`, once a read of the region's header shows `epoch`.
    async fn proved(self, epoch: u64) -> Result<RdmaPath, BackendError> {
        let mut probe = Reads::default();
        self.read(&[ReadSpec { offset: 0, len: HEADER_ENCODED_LEN as u32 }], &mut probe).await?;
        match probe.get(0).map(RegionHeader::decode) {
            Some(Ok(h)) if h.epoch == epoch => Ok(self),
            Some(Ok(_)) => Err(BackendError::Stale),
            _ => Err(BackendError::Attach("RDMA probe read did not return the region header".into())),
        }
    }

    /// Reads every spec in order; a spec outside the region yields `None`.
    pub async fn read(&self, specs: &[ReadSpec], out: &mut Reads) -> Result<(), BackendError> {
        let lanes = &*self.lanes;
        if lanes.control.is_closed() {
            return Err(BackendError::Closed);
        }
        if lanes.broken.load(Ordering::Acquire) {
            return Err(BackendError::Stale);
        }
        let deadline = Instant::now() + lanes.timeout;
        let permit = match timeout_at(deadline, lanes.permits.acquire()).await {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => return Err(BackendError::Closed),
            Err(_) => return Err(BackendError::Timeout),
        };
        // A permit stands for a free lane: destroyed lanes take theirs along.
        let Some(lane) = lanes.free.lock().expect("rdma lanes poisoned").pop() else {
            return Err(BackendError::Stale);
        };
        let mut held = Held { lanes, lane: Some(lane), permit: Some(permit) };
        let Some(lane) = held.lane.as_mut() else { return Err(BackendError::Stale) };
        out.clear();
        let mut chunk: Vec<ReadRequest> = Vec::with_capacity(specs.len().min(MAX_READS_PER_BATCH));
        let limits = Limits { reads: MAX_READS_PER_BATCH, bytes: LANE_BUF };
        for step in Plan::new(specs, self.len, limits, self.last_after_rest) {
            match step {
                Step::Refuse(_) => out.push_failed(),
                Step::Post { reads, fence_last } => {
                    let mut used = 0usize;
                    for (n, s) in specs[reads].iter().enumerate() {
                        chunk.push(ReadRequest {
                            wr_id: n as u64,
                            remote_addr: self.addr + s.offset,
                            rkey: self.rkey,
                            len: s.len,
                            local_offset: used,
                        });
                        used += s.len as usize;
                    }
                    lane.flush(&mut chunk, fence_last, deadline, out).await?;
                }
            }
        }
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
    lanes: &'p RdmaLanes,
    lane: Option<Lane>,
    permit: Option<tokio::sync::SemaphorePermit<'p>>,
}

impl Held<'_> {
    fn give_back(mut self) {
        if let Some(lane) = self.lane.take() {
            self.lanes.free.lock().expect("rdma lanes poisoned").push(lane);
        }
        // The permit is released when `self` drops, after the lane is back.
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if self.lane.take().is_some() {
            self.lanes.broken.store(true, Ordering::Release);
            if let Some(p) = self.permit.take() {
                p.forget();
            }
        }
    }
}

impl Lane {
    /// Posts `chunk` as one batch (one doorbell; its last read after the
    /// others with `fence_last`), waits for it without blocking the
    /// thread, and copies the results out in order.
    async fn flush(
        &mut self,
        chunk: &mut Vec<ReadRequest>,
        fence_last: bool,
        deadline: Instant,
        out: &mut Reads,
    ) -> Result<(), BackendError> {
        if chunk.is_empty() {
            return Ok(());
        }
        let seq = match fence_last {
            true => self.qp.post_reads_last_fenced(chunk, &mut self.buf),
            false => self.qp.post_reads(chunk, &mut self.buf),
        }
        .map_err(verbs)?;
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

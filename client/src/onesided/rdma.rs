//! The RDMA backend (feature `rdma`): the NIC reads the server's region over
//! a reliable-connection queue pair set up through the RPC connection. The
//! verbs calls live in the `dmkv-verbs` crate; this module only maps the
//! read protocol's batches onto them.
//!
//! One batch is in flight per path at a time (the queue pair and its local
//! buffer sit behind a mutex), and the completion is busy-polled: an RDMA
//! read completes in microseconds, less than a task switch would cost.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dmkv_common::layout::{HEADER_ENCODED_LEN, RegionHeader};
use dmkv_common::read::ReadSpec;
use dmkv_verbs::{
    Context, Endpoint, LocalBuffer, MAX_READS_PER_BATCH, MemoryRegion, QueuePair, ReadRequest, VerbsError,
};

use super::{BackendError, Reads};
use crate::client::Client;

/// Bytes of the registered buffer RDMA reads land in; bigger batches are
/// split.
const LOCAL_BUF: usize = 8 * 1024 * 1024;
/// Send-queue depth of the client's queue pair.
const QP_DEPTH: u32 = 1024;

struct Inner {
    qp: QueuePair,
    buf: LocalBuffer,
    _ctx: Arc<Context>,
}

/// A connected queue pair to one server's region.
pub struct RdmaPath {
    inner: Mutex<Inner>,
    addr: u64,
    len: u64,
    rkey: u32,
    timeout: Duration,
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
    /// Opens a local device, connects a queue pair to the server over
    /// `client`'s RPC connection, and proves the path with one read of the
    /// region header (which must carry `epoch`).
    pub async fn attach(client: &Client, epoch: u64, timeout: Duration) -> Result<RdmaPath, BackendError> {
        let ctx = Context::open(None).map_err(|e| BackendError::Attach(format!("no usable RDMA device here: {e}")))?;
        let attach = |e: VerbsError| BackendError::Attach(format!("RDMA: {e}"));
        let mut qp = QueuePair::create(&ctx, QP_DEPTH).map_err(attach)?;
        let reply = client
            .rdma_connect(qp.endpoint().to_bytes().to_vec())
            .await
            .map_err(|e| BackendError::Attach(format!("RDMA connect: {e}")))?;
        let remote = Endpoint::from_bytes(&reply.endpoint).map_err(attach)?;
        qp.connect(&remote).map_err(attach)?;
        let buf = MemoryRegion::register_local(&ctx, LOCAL_BUF).map_err(attach)?;
        let path = RdmaPath {
            inner: Mutex::new(Inner { qp, buf, _ctx: ctx }),
            addr: reply.addr,
            len: reply.length,
            rkey: reply.rkey,
            timeout,
        };
        let mut probe = Reads::default();
        path.read(&[ReadSpec { offset: 0, len: HEADER_ENCODED_LEN as u32 }], &mut probe)?;
        match probe.get(0).map(RegionHeader::decode) {
            Some(Ok(h)) if h.epoch == epoch && reply.epoch == epoch => Ok(path),
            Some(Ok(_)) => Err(BackendError::Stale),
            _ => Err(BackendError::Attach("RDMA probe read did not return the region header".into())),
        }
    }

    /// Reads every spec in order; a spec outside the region yields `None`.
    pub fn read(&self, specs: &[ReadSpec], out: &mut Reads) -> Result<(), BackendError> {
        let mut g = self.inner.lock().expect("rdma lock poisoned");
        let Inner { qp, buf, .. } = &mut *g;
        let deadline = Instant::now() + self.timeout;
        out.clear();
        let mut chunk: Vec<ReadRequest> = Vec::new();
        let mut used = 0usize;
        for s in specs {
            let len = s.len as usize;
            let inside = s.offset.checked_add(s.len as u64).is_some_and(|end| end <= self.len);
            if !inside || len > LOCAL_BUF {
                flush(qp, buf, &mut chunk, deadline, out)?;
                used = 0;
                out.push_failed();
                continue;
            }
            if chunk.len() == MAX_READS_PER_BATCH || used + len > LOCAL_BUF {
                flush(qp, buf, &mut chunk, deadline, out)?;
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
        flush(qp, buf, &mut chunk, deadline, out)
    }
}

/// Posts `chunk` as one batch (one doorbell), waits for it, and copies the
/// results out in order.
fn flush(
    qp: &mut QueuePair,
    buf: &mut LocalBuffer,
    chunk: &mut Vec<ReadRequest>,
    deadline: Instant,
    out: &mut Reads,
) -> Result<(), BackendError> {
    if chunk.is_empty() {
        return Ok(());
    }
    qp.read_batch(chunk, buf, deadline).map_err(verbs)?;
    for r in chunk.iter() {
        let data = buf.slice(r.local_offset, r.len as usize).map_err(verbs)?;
        out.push_slot(data.len()).copy_from_slice(data);
    }
    chunk.clear();
    Ok(())
}

//! The `rdma` backend of one-sided reads (feature `rdma`): regions are
//! registered with an RDMA device for remote reads only, and each client
//! connection that asks gets reliable-connection queue pairs whose reads
//! the NIC serves without the server's CPU. The verbs calls themselves
//! live in the `dmkv-verbs` crate.
//!
//! One device per node ([`RdmaDevice`]): its protection domain holds every
//! region the node registers, so a client's queue pairs read any of them
//! (a single node's one region, or every shard replica's of a cluster
//! node) with the rkey of the region it means.

use std::sync::{Arc, Mutex};

use dmkv_verbs::{Context, Endpoint, MemoryRegion, QueuePair, VerbsError};

use crate::lock::lock;
use crate::region::Region;

/// Most queue pairs one RPC connection may hold.
pub const MAX_QPS_PER_CONNECTION: usize = 4;
/// Read work requests a server-side queue pair accepts in flight. The
/// server never posts on it; the depth only sizes the responder.
const SERVER_QP_DEPTH: u32 = 16;

/// An opened RDMA device: where regions are registered and client queue
/// pairs are accepted.
pub struct RdmaDevice {
    ctx: Arc<Context>,
}

/// Where a client reads a region: its address, length and rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remote {
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

/// A region's registration with the device.
pub struct RdmaRegion {
    device: Arc<RdmaDevice>,
    /// `None` only between a deregistration and the registration that
    /// replaces it, or after that registration failed.
    mr: Mutex<Option<MemoryRegion>>,
    region: Arc<Region>,
}

impl RdmaDevice {
    /// Opens `device` (or the first active one).
    pub fn open(device: Option<&str>) -> Result<Arc<RdmaDevice>, VerbsError> {
        Ok(Arc::new(RdmaDevice { ctx: Context::open(device)? }))
    }

    /// The opened device.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.ctx.device_name()
    }

    /// Registers `region` for remote reads.
    pub fn register(self: &Arc<Self>, region: Arc<Region>) -> Result<RdmaRegion, VerbsError> {
        let mr = register(&self.ctx, &region)?;
        Ok(RdmaRegion { device: Arc::clone(self), mr: Mutex::new(Some(mr)), region })
    }

    /// Creates a queue pair for a client whose endpoint is `client` (as
    /// sent on the wire) and connects it; the client's side needs the
    /// endpoint returned. The queue pair lives as long as the caller keeps
    /// it (the connection that asked for it).
    pub fn accept(&self, client: &[u8]) -> Result<(QueuePair, Endpoint), VerbsError> {
        let remote = Endpoint::from_bytes(client)?;
        let mut qp = QueuePair::create(&self.ctx, SERVER_QP_DEPTH)?;
        qp.connect(&remote)?;
        let endpoint = qp.endpoint();
        Ok((qp, endpoint))
    }
}

/// The device a node uses, and whether the operator named it: a region
/// that cannot be registered on a named device stops the server; on one
/// found by itself, that region is read over shared memory and TCP only.
pub struct RdmaUse {
    pub device: Arc<RdmaDevice>,
    pub required: bool,
}

impl RdmaUse {
    /// Registers `region` (named `what` in messages): `Ok(None)` when it
    /// cannot be and the device was not named (warned).
    pub fn register(&self, region: Arc<Region>, what: &str) -> Result<Option<RdmaRegion>, String> {
        match self.device.register(region) {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                let msg = format!("cannot register {what} for RDMA reads on {}: {e}", self.device.device_name());
                if self.required {
                    return Err(msg);
                }
                tracing::warn!("{msg}; it is read over shared memory and TCP only");
                Ok(None)
            }
        }
    }
}

/// Registers a duplicate of `cq`'s completion-channel descriptor with the
/// runtime's reactor, for reading.
pub fn watch(cq: &dmkv_verbs::MsgCq) -> std::io::Result<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>> {
    let dup = cq.dup_event_fd()?;
    // SAFETY: `dup` is an open descriptor owned by the AsyncFd for its whole
    // life, and OwnedFd::as_raw_fd always returns that same descriptor.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(dup, tokio::io::Interest::READABLE) }
        .map_err(|e| e.into_parts().1)
}

fn register(ctx: &Arc<Context>, region: &Region) -> Result<MemoryRegion, VerbsError> {
    // SAFETY: the mapping stays valid as long as `region`, which the
    // `RdmaRegion` keeps alive in an Arc and which outlives the
    // registration (dropped first in `reregister` or with that struct).
    unsafe { MemoryRegion::register_remote_read(ctx, region.base_ptr(), region.len()) }
}

impl RdmaRegion {
    /// The device the region is registered with.
    pub fn device(&self) -> &Arc<RdmaDevice> {
        &self.device
    }

    /// Where clients read the region now.
    pub fn remote(&self) -> Result<Remote, VerbsError> {
        let mr = lock(&self.mr);
        let mr = mr.as_ref().ok_or(VerbsError::InvalidState("region is not registered"))?;
        Ok(Remote { addr: mr.addr(), len: mr.len() as u64, rkey: mr.rkey() })
    }

    /// Registers the region anew: a new rkey; the old one stops working
    /// (a reader still using it gets a remote access error, which moves its
    /// queue pair to the error state: it attaches again).
    pub fn reregister(&self) -> Result<u32, VerbsError> {
        let mut mr = lock(&self.mr);
        if let Some(old) = mr.take() {
            old.deregister()?;
        }
        let new = register(&self.device.ctx, &self.region)?;
        let rkey = new.rkey();
        *mr = Some(new);
        Ok(rkey)
    }
}

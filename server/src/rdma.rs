//! The `rdma` backend of one-sided reads (feature `rdma`): the region is
//! registered with an RDMA device for remote reads only, and each client
//! connection that asks gets a reliable-connection queue pair whose reads
//! the NIC serves without the server's CPU. The verbs calls themselves
//! live in the `dmkv-verbs` crate.

use std::sync::{Arc, Mutex};

use dmkv_verbs::{Context, Endpoint, MemoryRegion, QueuePair, VerbsError};

use crate::region::Region;

/// Most queue pairs one RPC connection may hold.
pub const MAX_QPS_PER_CONNECTION: usize = 4;
/// Read work requests a server-side queue pair accepts in flight. The
/// server never posts on it; the depth only sizes the responder.
const SERVER_QP_DEPTH: u32 = 16;

/// The region's registration with an RDMA device.
pub struct RdmaRegion {
    ctx: Arc<Context>,
    mr: Mutex<Option<MemoryRegion>>,
    region: Arc<Region>,
}

/// What a client needs to read the region: the server's endpoint, address,
/// length and rkey.
pub struct Accepted {
    pub qp: QueuePair,
    pub endpoint: Endpoint,
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

impl RdmaRegion {
    /// Opens `device` (or the first active one) and registers `region`.
    pub fn open(device: Option<&str>, region: Arc<Region>) -> Result<RdmaRegion, VerbsError> {
        let ctx = Context::open(device)?;
        let mr = Self::register(&ctx, &region)?;
        Ok(RdmaRegion { ctx, mr: Mutex::new(Some(mr)), region })
    }

    fn register(ctx: &Arc<Context>, region: &Region) -> Result<MemoryRegion, VerbsError> {
        // SAFETY: the mapping stays valid as long as `region`, which this
        // struct keeps alive in an Arc and which outlives the registration
        // (dropped first in `reregister` or with this struct).
        unsafe { MemoryRegion::register_remote_read(ctx, region.base_ptr(), region.len()) }
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.ctx.device_name()
    }

    /// Registers the region anew: a new rkey; the old one stops working.
    pub fn reregister(&self) -> Result<u32, VerbsError> {
        let mut mr = self.mr.lock().expect("mr lock poisoned");
        if let Some(old) = mr.take() {
            old.deregister()?;
        }
        let new = Self::register(&self.ctx, &self.region)?;
        let rkey = new.rkey();
        *mr = Some(new);
        Ok(rkey)
    }

    /// Creates a queue pair for a client whose endpoint is `client`
    /// (as sent on the wire) and connects it.
    pub fn accept(&self, client: &[u8]) -> Result<Accepted, VerbsError> {
        let remote = Endpoint::from_bytes(client)?;
        let mut qp = QueuePair::create(&self.ctx, SERVER_QP_DEPTH)?;
        qp.connect(&remote)?;
        let mr = self.mr.lock().expect("mr lock poisoned");
        let mr = mr.as_ref().ok_or(VerbsError::InvalidState("region is not registered"))?;
        Ok(Accepted { endpoint: qp.endpoint(), qp, addr: mr.addr(), len: mr.len() as u64, rkey: mr.rkey() })
    }
}

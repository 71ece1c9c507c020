//! The software one-sided engine: RDMA READ semantics over TCP, for clients
//! that have neither RDMA nor shared memory with the server.
//!
//! Like a NIC, it checks each read's rkey and bounds against the region's
//! registration, copies the bytes, and replies; it never runs key-value
//! code and never takes the store's locks. Connections are read and
//! answered by the loop in [`framed`], as the RPC service's are.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::BytesMut;
use dmkv_common::onesided::{
    MAX_REQUEST_FRAME, ReadStatus, ReadWr, ReplyBuilder, WireError, check_read, decode_request, next_frame,
};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::counters::EngineCounters;
use crate::framed;
use crate::listen;
use crate::region::Region;
use crate::registration::Registration;

/// Threads of the engine's runtime: like a NIC's several read engines, so
/// one busy connection does not hold up the others.
pub const ENGINE_THREADS: usize = 2;

/// Runs [`serve`] on threads of its own ([`ENGINE_THREADS`], with their
/// own runtime), as a NIC serves reads beside the host's CPUs: RPC load on
/// the server's workers then never queues one-sided reads behind it. The
/// returned receiver resolves when the engine has stopped.
pub fn spawn_thread(
    listener: TcpListener,
    region: Arc<Region>,
    reg: Arc<Registration>,
    counters: Arc<EngineCounters>,
    bounds: Bounds,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<tokio::sync::oneshot::Receiver<()>> {
    // The listener is registered with the caller's runtime; move it over.
    let listener = listener.into_std()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(ENGINE_THREADS)
        .thread_name("dmkvd-engine")
        .enable_all()
        .build()?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name("dmkvd-engine".into()).spawn(move || {
        rt.block_on(async move {
            match TcpListener::from_std(listener) {
                Ok(l) => serve(l, region, reg, counters, bounds, shutdown).await,
                Err(e) => warn!("one-sided engine stopped: {e}"),
            }
        });
        let _ = done_tx.send(());
    })?;
    Ok(done_rx)
}

/// What the engine allows its connections.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Connections served at once; more wait in the accept queue.
    pub max_connections: usize,
    pub limits: framed::Limits,
}

/// Accepts engine connections until shutdown.
pub async fn serve(
    listener: TcpListener,
    region: Arc<Region>,
    reg: Arc<Registration>,
    counters: Arc<EngineCounters>,
    bounds: Bounds,
    shutdown: watch::Receiver<bool>,
) {
    let rx = shutdown.clone();
    let mut conns = listen::serve(listener, "engine", bounds.max_connections, shutdown, move |(stream, peer)| {
        let reads = Reads {
            region: Arc::clone(&region),
            reg: Arc::clone(&reg),
            counters: Arc::clone(&counters),
            peer,
            wrs: Vec::new(),
        };
        framed::serve_connection(stream, "engine", reads, bounds.limits, rx.clone())
    })
    .await;
    conns.shutdown().await;
}

/// One engine connection's reads: checked against the registration like a
/// NIC would, then copied out of the region.
struct Reads {
    region: Arc<Region>,
    reg: Arc<Registration>,
    counters: Arc<EngineCounters>,
    peer: SocketAddr,
    /// The batch being answered; kept to reuse its allocation.
    wrs: Vec<ReadWr>,
}

impl framed::Handler for Reads {
    type Error = WireError;

    async fn handle_next(&mut self, inbuf: &mut BytesMut, out: &mut BytesMut) -> Result<bool, WireError> {
        let Some(body) = next_frame(inbuf, MAX_REQUEST_FRAME)? else { return Ok(false) };
        let batch_id = decode_request(&body, &mut self.wrs)?;
        let (rkey, len) = (self.reg.rkey(), self.region.len() as u64);
        let mut reply = ReplyBuilder::new(out, batch_id, self.wrs.len());
        let mut bytes = 0u64;
        for (i, w) in self.wrs.iter().enumerate() {
            let status = check_read(w, rkey, len, bytes);
            if status == ReadStatus::Success {
                bytes += w.len as u64;
            } else {
                self.counters.rejected.fetch_add(1, Ordering::Relaxed);
                debug!(peer = ?self.peer, ?status, offset = w.offset, len = w.len, "one-sided read rejected");
            }
            reply.push(i, status, w.len, |dst| self.region.read(w.offset, dst));
        }
        reply.finish();
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.reads.fetch_add(self.wrs.len() as u64, Ordering::Relaxed);
        self.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(true)
    }
}

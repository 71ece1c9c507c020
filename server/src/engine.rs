//! The software one-sided engine: RDMA READ semantics over TCP, for clients
//! that have neither RDMA nor shared memory with the server.
//!
//! Like a NIC, it checks each read's rkey and bounds against the region's
//! registration, copies the bytes, and replies; it never runs key-value
//! code and never takes the store's locks. Every batch of reads read from
//! the socket is answered, and all replies to one socket read go out in one
//! write.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::BytesMut;
use dmkv_common::onesided::{MAX_REQUEST_FRAME, ReadStatus, ReplyBuilder, check_read, decode_request, next_frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, warn};

use crate::region::Region;
use crate::registration::Registration;

const READ_BUF: usize = 64 * 1024;
/// Threads of the engine's runtime: like a NIC's several read engines, so
/// one busy connection does not hold up the others.
pub const ENGINE_THREADS: usize = 2;

/// What the engine counts (exported by STATS).
#[derive(Debug, Default)]
pub struct EngineCounters {
    pub batches: AtomicU64,
    pub reads: AtomicU64,
    pub bytes: AtomicU64,
    pub rejected: AtomicU64,
}

/// Runs [`serve`] on threads of its own ([`ENGINE_THREADS`], with their
/// own runtime), as a NIC serves reads beside the host's CPUs: RPC load on
/// the server's workers then never queues one-sided reads behind it. The
/// returned receiver resolves when the engine has stopped.
pub fn spawn_thread(
    listener: TcpListener,
    region: Arc<Region>,
    reg: Arc<Registration>,
    counters: Arc<EngineCounters>,
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
                Ok(l) => serve(l, region, reg, counters, shutdown).await,
                Err(e) => warn!("one-sided engine stopped: {e}"),
            }
        });
        let _ = done_tx.send(());
    })?;
    Ok(done_rx)
}

/// Accepts engine connections until shutdown.
pub async fn serve(
    listener: TcpListener,
    region: Arc<Region>,
    reg: Arc<Registration>,
    counters: Arc<EngineCounters>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    conns.spawn(serve_conn(stream, Arc::clone(&region), Arc::clone(&reg), Arc::clone(&counters), shutdown.clone()));
                }
                Err(e) => warn!("engine accept failed: {e}"),
            },
            _ = shutdown.changed() => break,
        }
        while conns.try_join_next().is_some() {}
    }
    conns.shutdown().await;
}

async fn serve_conn(
    stream: TcpStream,
    region: Arc<Region>,
    reg: Arc<Registration>,
    counters: Arc<EngineCounters>,
    mut shutdown: watch::Receiver<bool>,
) {
    let peer = stream.peer_addr().ok();
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let mut inbuf = BytesMut::with_capacity(READ_BUF);
    let mut out = BytesMut::new();
    let mut wrs = Vec::new();
    loop {
        if inbuf.capacity() - inbuf.len() < READ_BUF / 4 {
            inbuf.reserve(READ_BUF);
        }
        let n = tokio::select! {
            r = rd.read_buf(&mut inbuf) => match r { Ok(n) => n, Err(_) => return },
            _ = shutdown.changed() => return,
        };
        if n == 0 {
            return;
        }
        let mut fatal = None;
        loop {
            let body = match next_frame(&mut inbuf, MAX_REQUEST_FRAME) {
                Ok(Some(b)) => b,
                Ok(None) => break,
                Err(e) => {
                    fatal = Some(e);
                    break;
                }
            };
            let batch_id = match decode_request(&body, &mut wrs) {
                Ok(id) => id,
                Err(e) => {
                    fatal = Some(e);
                    break;
                }
            };
            let (rkey, len) = (reg.rkey(), region.len() as u64);
            let mut reply = ReplyBuilder::new(&mut out, batch_id, wrs.len());
            let mut bytes = 0u64;
            for (i, w) in wrs.iter().enumerate() {
                let status = check_read(w, rkey, len, bytes);
                if status == ReadStatus::Success {
                    bytes += w.len as u64;
                } else {
                    counters.rejected.fetch_add(1, Ordering::Relaxed);
                    debug!(?peer, ?status, offset = w.offset, len = w.len, "one-sided read rejected");
                }
                reply.push(i, status, w.len, |dst| region.read(w.offset, dst));
            }
            reply.finish();
            counters.batches.fetch_add(1, Ordering::Relaxed);
            counters.reads.fetch_add(wrs.len() as u64, Ordering::Relaxed);
            counters.bytes.fetch_add(bytes, Ordering::Relaxed);
            if out.len() >= crate::service::MAX_PENDING_REPLY_BYTES {
                if wr.write_all(&out).await.is_err() {
                    return;
                }
                out.clear();
            }
        }
        if !out.is_empty() {
            if wr.write_all(&out).await.is_err() {
                return;
            }
            out.clear();
        }
        if let Some(e) = fatal {
            warn!(?peer, "closing engine connection: {e}");
            return;
        }
    }
}

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
use dmkv_common::auth::{Purpose, Role};
use dmkv_common::onesided::{
    HANDSHAKE_OK, HANDSHAKE_PROOF_LEN, HANDSHAKE_RATE_LIMITED, HANDSHAKE_REFUSED, MAX_REQUEST_FRAME, ReadStatus,
    ReadWr, ReplyBuilder, WireError, check_read, decode_request, encode_greeting, next_frame,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use crate::access::{Denied, Gate, handshake_timeout};
use crate::counters::EngineCounters;
use crate::framed;
use crate::listen;
use crate::registration::{ServedSet, find_by_rkey};

/// Threads of the engine's runtime: like a NIC's several read engines, so
/// one busy connection does not hold up the others.
pub const ENGINE_THREADS: usize = 2;

/// Runs [`serve`] on threads of its own ([`ENGINE_THREADS`], with their
/// own runtime), as a NIC serves reads beside the host's CPUs: RPC load on
/// the server's workers then never queues one-sided reads behind it. The
/// returned receiver resolves when the engine has stopped.
pub fn spawn_thread(
    listener: TcpListener,
    engine: Engine,
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
                Ok(l) => serve(l, engine, shutdown).await,
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

/// What the engine serves and how: the region and its registration, the
/// counters it keeps, and who may connect.
pub struct Engine {
    /// The regions it reads, found by the rkey of each read.
    pub regions: ServedSet,
    pub counters: Arc<EngineCounters>,
    pub bounds: Bounds,
    pub gate: Arc<Gate>,
    pub tls: Option<TlsAcceptor>,
    /// Counts the engine's connections and bytes.
    pub stats: Arc<crate::counters::ListenerStats>,
}

/// Accepts engine connections until shutdown.
pub async fn serve(listener: TcpListener, engine: Engine, shutdown: watch::Receiver<bool>) {
    let rx = shutdown.clone();
    let Engine { regions, counters, bounds, gate, tls, stats } = engine;
    let conn_stats = Arc::clone(&stats);
    let mut conns = listen::serve(listener, stats, bounds.max_connections, shutdown, move |(stream, peer)| {
        let reads = Reads { regions: regions.clone(), counters: Arc::clone(&counters), peer, wrs: Vec::new() };
        let conn =
            Conn { gate: Arc::clone(&gate), tls: tls.clone(), limits: bounds.limits, stats: Arc::clone(&conn_stats) };
        serve_connection(stream, reads, conn, rx.clone())
    })
    .await;
    conns.shutdown().await;
}

/// What each engine connection shares with the others.
struct Conn {
    gate: Arc<Gate>,
    tls: Option<TlsAcceptor>,
    limits: framed::Limits,
    stats: Arc<crate::counters::ListenerStats>,
}

/// Runs TLS (if on) and the handshake, then serves reads until the peer
/// closes.
async fn serve_connection(mut stream: TcpStream, reads: Reads, conn: Conn, shutdown: watch::Receiver<bool>) {
    let Conn { gate, tls, limits, stats } = conn;
    let peer = reads.peer;
    let _ = stream.set_nodelay(true);
    match tls {
        None => match tokio::time::timeout(handshake_timeout(&limits), handshake(&mut stream, &gate, peer)).await {
            Ok(Ok(())) => framed::serve_connection(stream, Some(peer), stats, reads, limits, shutdown).await,
            Ok(Err(e)) => debug!(?peer, "engine handshake failed: {e}"),
            Err(_) => debug!(?peer, "engine handshake timed out"),
        },
        Some(acceptor) => {
            let work = async {
                let mut s = acceptor.accept(stream).await?;
                handshake(&mut s, &gate, peer).await?;
                Ok::<_, std::io::Error>(s)
            };
            match tokio::time::timeout(handshake_timeout(&limits), work).await {
                Ok(Ok(s)) => framed::serve_connection(s, Some(peer), stats, reads, limits, shutdown).await,
                Ok(Err(e)) => debug!(?peer, "engine TLS or handshake failed: {e}"),
                Err(_) => debug!(?peer, "engine handshake timed out"),
            }
        }
    }
}

/// The engine's side of the handshake (see `dmkv_common::onesided`): a
/// greeting with a fresh nonce, the client's proof, one status byte.
async fn handshake(
    stream: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin),
    gate: &Gate,
    peer: SocketAddr,
) -> std::io::Result<()> {
    let nonce = gate.nonce();
    stream.write_all(&encode_greeting(gate.enabled(), &nonce)).await?;
    stream.flush().await?;
    let mut proof = [0u8; HANDSHAKE_PROOF_LEN];
    stream.read_exact(&mut proof).await?;
    let verdict = match gate.enabled() {
        false => Ok(Role::Admin),
        true => gate.check(Purpose::Engine, Some(peer.ip()), &nonce, &proof, Role::Data),
    };
    let status = match verdict {
        Ok(_) => HANDSHAKE_OK,
        Err(Denied::BadProof) => HANDSHAKE_REFUSED,
        Err(Denied::RateLimited) => HANDSHAKE_RATE_LIMITED,
    };
    stream.write_all(&[status]).await?;
    stream.flush().await?;
    match verdict {
        Ok(_) => Ok(()),
        Err(d) => Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, d.to_string())),
    }
}

/// One engine connection's reads: checked against the registration like a
/// NIC would, then copied out of the region.
struct Reads {
    regions: ServedSet,
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
        // Stamped with the clock a shard's lease is published on: a reader
        // of a cluster region judges the lease by these (`lease::judge`).
        let mut reply = ReplyBuilder::new(out, batch_id, self.wrs.len(), crate::clock::mono_ns());
        let mut bytes = 0u64;
        let regions = self.regions.current();
        for (i, w) in self.wrs.iter().enumerate() {
            // An rkey no region has is refused like a NIC would.
            let Some(target) = find_by_rkey(&regions, w.rkey) else {
                self.counters.rejected.fetch_add(1, Ordering::Relaxed);
                debug!(peer = ?self.peer, offset = w.offset, len = w.len, "one-sided read of no region rejected");
                reply.push(i, ReadStatus::BadRkey, w.len, |_| {});
                continue;
            };
            let status = check_read(w, target.reg.rkey(), target.region.len() as u64, bytes);
            if status == ReadStatus::Success {
                bytes += w.len as u64;
            } else {
                self.counters.rejected.fetch_add(1, Ordering::Relaxed);
                debug!(peer = ?self.peer, ?status, offset = w.offset, len = w.len, "one-sided read rejected");
            }
            reply.push(i, status, w.len, |dst| target.region.read(w.offset, dst));
        }
        reply.finish(crate::clock::mono_ns());
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.reads.fetch_add(self.wrs.len() as u64, Ordering::Relaxed);
        self.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(true)
    }
}

//! The TCP backend: batches of reads sent to the server's software
//! one-sided engine, many batches in flight on one connection, replies
//! matched by batch id; a pool of such connections, repathed when congested.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use dmkv_common::auth::{self, Purpose, Token};
use dmkv_common::onesided::{
    GREETING_LEN, HANDSHAKE_OK, HANDSHAKE_RATE_LIMITED, MAX_REPLY_FRAME, ReadStatus, ReadWr, decode_greeting,
    decode_reply, encode_request, next_frame,
};
use dmkv_common::read::ReadSpec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;

use super::{BackendError, Reads};
use crate::conn::{Dialed, PendingMap, dial, read_loop};
use crate::outbox::{Outbox, Push, write_loop};
use crate::path::ConnHealth;
use crate::tls::Connector;

/// How an engine connection is opened: TLS if the engine speaks it, and
/// the secret to prove in the handshake.
#[derive(Clone, Default)]
pub struct Dialer {
    pub tls: Option<Connector>,
    pub token: Option<Arc<Token>>,
}

/// The client's side of the engine handshake (see
/// `dmkv_common::onesided`).
async fn handshake(stream: &mut (impl AsyncRead + AsyncWrite + Unpin), token: Option<&Token>) -> Result<(), String> {
    let mut greeting = [0u8; GREETING_LEN];
    stream.read_exact(&mut greeting).await.map_err(|e| format!("no greeting: {e}"))?;
    let (auth, nonce) = decode_greeting(&greeting).map_err(|e| e.to_string())?;
    let proof = auth::answer(auth, token, Purpose::Engine, &nonce)
        .ok_or("the engine requires authentication and this client has no token")?;
    stream.write_all(&proof).await.map_err(|e| e.to_string())?;
    stream.flush().await.map_err(|e| e.to_string())?;
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).await.map_err(|e| format!("no handshake status: {e}"))?;
    match status[0] {
        HANDSHAKE_OK => Ok(()),
        HANDSHAKE_RATE_LIMITED => Err("the engine refused: too many failed attempts from this address".into()),
        _ => Err("the engine refused this client's token".into()),
    }
}

type Pending = PendingMap<BytesMut>;

/// A connection to a server's one-sided engine.
pub struct EngineConn {
    outbox: Arc<Outbox>,
    pending: Pending,
    next: AtomicU64,
    closed: Arc<AtomicBool>,
    rkey: u64,
    timeout: Duration,
}

impl Drop for EngineConn {
    /// The writer writes what is queued and stops.
    fn drop(&mut self) {
        self.outbox.close();
    }
}

impl EngineConn {
    /// Connects to the engine at `addr` and shakes hands; reads will
    /// present `rkey`.
    pub async fn connect(
        addr: &str,
        rkey: u64,
        timeout: Duration,
        dialer: &Dialer,
    ) -> Result<EngineConn, BackendError> {
        let attach_err = |e: String| BackendError::Attach(format!("engine {addr}: {e}"));
        let work = async {
            let stream = dial(addr, timeout, dialer.tls.as_ref()).await.map_err(|e| e.to_string())?;
            let token = dialer.token.as_deref();
            match stream {
                Dialed::Plain(mut s) => {
                    handshake(&mut s, token).await?;
                    let (rd, wr) = s.into_split();
                    Ok::<_, String>(EngineConn::start(rd, wr, rkey, timeout))
                }
                Dialed::Tls(mut s) => {
                    handshake(&mut s, token).await?;
                    let (rd, wr) = tokio::io::split(*s);
                    Ok(EngineConn::start(rd, wr, rkey, timeout))
                }
            }
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(r) => r.map_err(attach_err),
            Err(_) => Err(attach_err("handshake timed out".into())),
        }
    }

    fn start(
        rd: impl AsyncRead + Unpin + Send + 'static,
        wr: impl AsyncWrite + Unpin + Send + 'static,
        rkey: u64,
        timeout: Duration,
    ) -> EngineConn {
        let outbox = Arc::new(Outbox::default());
        let pending: Pending = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        tokio::spawn(write_loop(wr, Arc::clone(&outbox), Arc::clone(&closed)));
        tokio::spawn(read_loop(
            rd,
            Arc::clone(&pending),
            Arc::clone(&closed),
            |buf: &mut BytesMut| match next_frame(buf, MAX_REPLY_FRAME).map_err(|e| e.to_string())? {
                Some(body) if body.len() >= 8 => {
                    Ok(Some((u64::from_le_bytes(body[..8].try_into().expect("8 bytes")), body)))
                }
                Some(_) => Err("engine reply shorter than its batch id".into()),
                None => Ok(None),
            },
            |_, _| {},
        ));
        EngineConn { outbox, pending, next: AtomicU64::new(1), closed, rkey, timeout }
    }

    /// Encodes a batch into the outbox, waiting for room if it is full
    /// (the caller's timeout bounds the whole read); false once closed.
    async fn queue(&self, id: u64, wrs: &[ReadWr]) -> bool {
        let encode = |b: &mut BytesMut| {
            encode_request(id, wrs, b);
            Ok::<_, std::convert::Infallible>(())
        };
        loop {
            let room = self.outbox.room();
            tokio::pin!(room);
            room.as_mut().enable();
            match self.outbox.try_push(encode) {
                Ok(Push::Queued) => return true,
                Ok(Push::Full) => room.await,
                Ok(Push::Closed) | Err(_) => return false,
            }
        }
    }

    /// Posts `specs` as one batch (one frame) and waits for its completions.
    pub async fn read(&self, specs: &[ReadSpec], out: &mut Reads) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed);
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let wrs: Vec<ReadWr> = specs.iter().map(|s| ReadWr { rkey: self.rkey, offset: s.offset, len: s.len }).collect();
        let (otx, orx) = oneshot::channel();
        self.pending.lock().expect("pending poisoned").insert(id, crate::conn::Waiter { tx: otx, deadline: None });
        if !self.queue(id, &wrs).await || self.closed.load(Ordering::Acquire) {
            self.pending.lock().expect("pending poisoned").remove(&id);
            return Err(BackendError::Closed);
        }
        let body = match tokio::time::timeout(self.timeout, orx).await {
            Ok(Ok(b)) => b,
            Ok(Err(_)) => return Err(BackendError::Closed),
            Err(_) => {
                self.pending.lock().expect("pending poisoned").remove(&id);
                return Err(BackendError::Timeout);
            }
        };
        let reply = decode_reply(&body).map_err(|e| BackendError::Protocol(e.to_string()))?;
        if reply.results.len() != specs.len() {
            return Err(BackendError::Protocol("reply has the wrong number of completions".into()));
        }
        check_lengths(specs, &reply.results)?;
        out.clear();
        out.stamps = Some((reply.started, reply.ended));
        for (status, range) in reply.results {
            match status {
                ReadStatus::Success => out.push_slot(range.len()).copy_from_slice(&body[range]),
                ReadStatus::BadRkey => return Err(BackendError::Stale),
                ReadStatus::OutOfBounds | ReadStatus::TooLong => out.push_failed(),
            }
        }
        Ok(())
    }
}

/// Refuses a reply whose successful reads are not the lengths asked for:
/// callers index the bytes of a bucket or an item by the length they asked
/// for, and a reply is only the server's word.
fn check_lengths(specs: &[ReadSpec], results: &[(ReadStatus, std::ops::Range<usize>)]) -> Result<(), BackendError> {
    let wrong =
        specs.iter().zip(results).find(|(s, (status, r))| *status == ReadStatus::Success && r.len() != s.len as usize);
    match wrong {
        Some((s, (_, r))) => Err(BackendError::Protocol(format!(
            "engine returned {} bytes for a read of {} at offset {}",
            r.len(),
            s.len,
            s.offset
        ))),
        None => Ok(()),
    }
}

/// Several connections to one engine, used in turn. A connection whose
/// round trips stay congested is replaced by a fresh one in the background
/// (PLB-style; see [`ConnHealth`]); reads go on over the old one meanwhile.
pub struct EnginePool {
    shared: Arc<PoolShared>,
}

struct PoolShared {
    addr: String,
    rkey: u64,
    timeout: Duration,
    dialer: Dialer,
    conns: Vec<std::sync::Mutex<Arc<EngineConn>>>,
    replacing: Vec<AtomicBool>,
    next: AtomicUsize,
    health: ConnHealth,
}

impl EnginePool {
    /// Opens `n` (at least one) connections to the engine at `addr`.
    pub async fn connect(
        addr: &str,
        rkey: u64,
        timeout: Duration,
        n: usize,
        health: ConnHealth,
        dialer: Dialer,
    ) -> Result<EnginePool, BackendError> {
        let mut conns = Vec::new();
        for _ in 0..n.max(1) {
            conns.push(std::sync::Mutex::new(Arc::new(EngineConn::connect(addr, rkey, timeout, &dialer).await?)));
        }
        let replacing = conns.iter().map(|_| AtomicBool::new(false)).collect();
        let shared = PoolShared {
            addr: addr.to_string(),
            rkey,
            timeout,
            dialer,
            conns,
            replacing,
            next: AtomicUsize::new(0),
            health,
        };
        Ok(EnginePool { shared: Arc::new(shared) })
    }

    /// Posts `specs` as one batch on the next connection.
    pub async fn read(&self, specs: &[ReadSpec], out: &mut Reads) -> Result<(), BackendError> {
        let s = &self.shared;
        let i = s.next.fetch_add(1, Ordering::Relaxed) % s.conns.len();
        let conn = Arc::clone(&s.conns[i].lock().expect("engine pool poisoned"));
        let start = Instant::now();
        conn.read(specs, out).await?;
        if s.health.record(i, start.elapsed().as_nanos() as u64) {
            self.replace(i);
        }
        Ok(())
    }

    /// Opens a fresh connection for slot `i` and swaps it in when ready.
    fn replace(&self, i: usize) {
        let s = Arc::clone(&self.shared);
        if s.replacing[i].swap(true, Ordering::AcqRel) {
            return;
        }
        tokio::spawn(async move {
            match EngineConn::connect(&s.addr, s.rkey, s.timeout, &s.dialer).await {
                Ok(c) => {
                    tracing::debug!(conn = i, "engine connection congested: moved to a new one");
                    *s.conns[i].lock().expect("engine pool poisoned") = Arc::new(c);
                }
                Err(e) => tracing::debug!("engine repath failed: {e}"),
            }
            s.replacing[i].store(false, Ordering::Release);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply that gives a bucket read fewer bytes than asked for is a
    /// protocol error, not bytes handed to the bucket decoder.
    #[test]
    fn successful_reads_of_the_wrong_length_are_refused() {
        let specs = [ReadSpec { offset: 4096, len: 64 }, ReadSpec { offset: 8192, len: 64 }];
        let ok = [(ReadStatus::Success, 20..84), (ReadStatus::OutOfBounds, 84..84)];
        assert!(check_lengths(&specs, &ok).is_ok());
        let short = [(ReadStatus::Success, 20..84), (ReadStatus::Success, 84..90)];
        assert!(matches!(check_lengths(&specs, &short), Err(BackendError::Protocol(_))));
        let long = [(ReadStatus::Success, 20..85), (ReadStatus::Success, 85..149)];
        assert!(matches!(check_lengths(&specs, &long), Err(BackendError::Protocol(_))));
    }
}

//! The TCP backend: batches of reads sent to the server's software
//! one-sided engine, many batches in flight on one connection, replies
//! matched by batch id.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use dmkv_common::onesided::{MAX_REPLY_FRAME, ReadStatus, ReadWr, decode_reply, encode_request, next_frame};
use dmkv_common::read::ReadSpec;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use super::{BackendError, Reads};
use crate::conn::{PendingMap, SEND_QUEUE, read_loop, write_loop};

type Pending = PendingMap<BytesMut>;

/// A connection to a server's one-sided engine.
pub struct EngineConn {
    tx: mpsc::Sender<BytesMut>,
    pending: Pending,
    next: AtomicU64,
    closed: Arc<AtomicBool>,
    rkey: u64,
    timeout: Duration,
}

impl EngineConn {
    /// Connects to the engine at `addr`; reads will present `rkey`.
    pub async fn connect(addr: &str, rkey: u64, timeout: Duration) -> Result<EngineConn, BackendError> {
        let stream = match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(BackendError::Attach(format!("engine {addr}: {e}"))),
            Err(_) => return Err(BackendError::Attach(format!("engine {addr}: connect timed out"))),
        };
        let _ = stream.set_nodelay(true);
        let (rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::channel::<BytesMut>(SEND_QUEUE);
        let pending: Pending = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        tokio::spawn(write_loop(wr, rx, Arc::clone(&closed)));
        tokio::spawn(read_loop(rd, Arc::clone(&pending), Arc::clone(&closed), |buf: &mut BytesMut| match next_frame(
            buf,
            MAX_REPLY_FRAME,
        )
        .map_err(|e| e.to_string())?
        {
            Some(body) if body.len() >= 8 => {
                Ok(Some((u64::from_le_bytes(body[..8].try_into().expect("8 bytes")), body)))
            }
            Some(_) => Err("engine reply shorter than its batch id".into()),
            None => Ok(None),
        }));
        Ok(EngineConn { tx, pending, next: AtomicU64::new(1), closed, rkey, timeout })
    }

    /// Posts `specs` as one batch (one frame) and waits for its completions.
    pub async fn read(&self, specs: &[ReadSpec], out: &mut Reads) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed);
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let wrs: Vec<ReadWr> = specs.iter().map(|s| ReadWr { rkey: self.rkey, offset: s.offset, len: s.len }).collect();
        let mut frame = BytesMut::new();
        encode_request(id, &wrs, &mut frame);
        let (otx, orx) = oneshot::channel();
        self.pending.lock().expect("pending poisoned").insert(id, otx);
        if self.tx.send(frame).await.is_err() || self.closed.load(Ordering::Acquire) {
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
        out.clear();
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
